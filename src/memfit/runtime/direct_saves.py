"""Parameters and model inputs saved inside a checkpoint region are held directly, not through the checkpoint.

Non-reentrant ``torch.utils.checkpoint`` hands every tensor autograd saves inside its function to its own
saved-tensor hooks, parameters and the model's inputs too: unpacking any of them in the backward pass starts
the region's recomputation. The plan counts only activations as what a region saves (a parameter or an input
is allocated for the whole step anyway), so it expects the recomputation where the region's last saved
*activation* is unpacked. A node saving only parameters at the region's end (a Linear head with a frozen,
tied weight saves its weight and not its input) started the recomputation one backward step early, while the
head's 460 KB output gradient was still alive: a fresh user's LSTM language model measured 1.09x its budget.

:class:`DirectSaves` pushes saved-tensor hooks inside the region that keep parameters and inputs themselves
(as autograd does without hooks) and pass every other tensor to the checkpoint's hooks, in the forward pass
and in the recomputation alike, so the checkpoint counts the same saved tensors both times (its early stop
then ends at the last saved activation, as profiled: ``memfit.profile.costs._recording``). Like autograd, it
refuses to unpack a tensor that was modified in place after it was saved (a discriminator's ``optimizer.step()``
before the generator's backward pass): hooked saved tensors skip autograd's own version check, so without
this the recomputation silently used the new weights where plain PyTorch raises.
"""

from __future__ import annotations

import torch
from typing_extensions import Self

from memfit.variants.versions import raise_if_changed


class _Saved:
    """A tensor saved in a region, with its version counter at the time: a parameter or an input held as itself
    (``packed`` is ``None``), or a buffer saved through the checkpoint's hooks (``packed``, what they returned)."""

    __slots__ = ("packed", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, packed=None):
        self.tensor = tensor
        self.version = tensor._version
        self.packed = packed


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # (sparse or other tensors without a storage)
        return None


class DirectSaves:
    """Context manager, entered inside a checkpoint region's function: tensors whose storage's data pointer is in
    ``ptrs`` (the model's parameters and the step's inputs) are saved as themselves, every other tensor through
    the saved-tensor hooks active on entry (the checkpoint's, in the forward pass or in the recomputation). Those
    in ``watched`` (the model's buffers) go through the checkpoint's hooks too, and their version counter is
    checked when they are unpacked (a buffer changed between forward and backward raises, as in plain PyTorch;
    the recomputation ran from a snapshot of it, and gave gradients of neither value).

    Args:
        ptrs: storage data pointers (``untyped_storage().data_ptr()``) of the tensors to hold directly (a set, or
            a dict keyed by them; the caller keeps those tensors alive while a recomputation can run, so that no
            tensor it makes can take one of their addresses).
        watched: storage data pointers of the tensors whose version is checked.
    """

    def __init__(self, ptrs: set[int] | dict[int, torch.Tensor], watched: set[int] = frozenset()):
        self.ptrs = ptrs
        self.watched = watched
        self._hooks = None

    def __enter__(self) -> Self:
        top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        top = top_hooks(False) if top_hooks is not None else None
        if top is None:  # (not inside a checkpoint, or a PyTorch without the function: nothing to do)
            self._hooks = None
            return self
        pack, unpack = top
        ptrs, watched = self.ptrs, self.watched

        def pack_direct(t):
            ptr = _storage_ptr(t)
            if ptr in ptrs:
                return _Saved(t)
            if ptr in watched:
                return _Saved(t, pack(t))
            return pack(t)

        def unpack_direct(x):
            if not isinstance(x, _Saved):
                return _unpack_explained(unpack, x)
            raise_if_changed([(x.tensor, x.version)], "a checkpoint region")
            return x.tensor if x.packed is None else _unpack_explained(unpack, x.packed)

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack_direct, unpack_direct)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None


def _unpack_explained(unpack, packed):
    """``unpack(packed)`` (the checkpoint's hook), its error said in the training loop's terms where the region's
    recomputation finds one of its inputs changed in place since the forward pass: a fresh user's loop normalized a
    returned feature map in place (``feats.mul_(0.5)``) before ``loss.backward()``, which plain PyTorch allows where
    no operation saved it, and got autograd's bare "modified by an inplace operation"."""
    try:
        return unpack(packed)
    except RuntimeError as e:
        if "modified by an inplace operation" not in str(e):
            raise
        raise RuntimeError(
            "memfit: a tensor that a checkpoint region of the plan recomputes from (an activation the region reads, "
            "often one the model also returns) was modified in place between the forward and the backward pass. Plain "
            "PyTorch may not save it, but the plan keeps it to recompute the region in the backward pass. Change it "
            "out of place instead (feats = feats * 0.5, or a copy for metrics: feats.detach().clone()) before "
            f"backward(). Autograd's error: {e}") from e
