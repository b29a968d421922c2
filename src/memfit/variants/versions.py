"""Refusing to recompute from tensors changed in place since the forward pass.

Autograd refuses to unpack a saved tensor whose version counter moved after it was saved ("modified by an
inplace operation"). What memfit recomputes in the backward pass (checkpoint regions, striped chains) reads
the parameters again: a weight or bias changed between the forward and the backward pass (an
``optimizer.step()`` in between) would silently give gradients of neither the old nor the new values. These
helpers record version counters when the values are first used and raise autograd's error where one moved.
"""

from __future__ import annotations

import torch


def versions(tensors) -> list[tuple[torch.Tensor, int]]:
    """``[(tensor, its version counter now)]`` for each of ``tensors``."""
    return [(t, t._version) for t in tensors]


def _describe(t: torch.Tensor) -> str:
    kind = "a parameter" if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) else \
        "a tensor"
    return f"{kind} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def raise_if_changed(recorded: list[tuple[torch.Tensor, int]], where: str) -> None:
    """Raise autograd's in-place error if a tensor of ``recorded`` (:func:`versions`) changed since.

    Args:
        recorded: ``(tensor, version)`` pairs.
        where: what read them, for the message (``"a checkpoint region"``).

    Raises:
        RuntimeError: "one of the variables needed for gradient computation has been modified by an inplace
            operation", naming the tensor, its versions and ``where``.
    """
    for t, version in recorded:
        if t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{_describe(t)}] is at version {t._version}; expected version {version} instead. (memfit: "
                f"{where} read it in the forward pass and computes again from it in the backward pass, and it "
                "changed in between, e.g. by an optimizer.step() between the forward and backward passes. Change "
                "it after the backward pass; plain PyTorch raises this error too where it saved the tensor, and "
                "where it did not (a bias) it would use the forward pass's values, which memfit no longer has.)")
