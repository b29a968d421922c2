r"""BatchNorm recomputed from the statistics of its forward pass (``bn-saved-stats``).

A checkpoint region that contains a BatchNorm in training mode recomputes it in the backward pass. PyTorch's
kernel then computes the batch statistics again (a reduction over the ``M = N * prod(spatial)`` values of each
channel) before it normalizes: on the CPU that took 4-8x the time of the normalization alone (float32,
``8 x 256 x 32 x 32``: 4.05 ms against 0.96 ms). The statistics are those of the forward pass, since the
recomputation sees the same input, so memfit keeps the per-channel ``save_mean`` and ``save_invstd`` that the
forward pass computed (``2 * C`` values; the input of the BatchNorm is what the checkpoint drops) and the
recomputation only normalizes::

    alpha_c = invstd_c * gamma_c,   beta_c = b_c - mean_c * alpha_c,   y = x * alpha_c + beta_c

with the products and sums fused (one rounding) as PyTorch's CPU kernel fuses them, so ``y`` is bit for bit
what the forward pass computed. The recomputation returns the forward pass's own ``save_mean`` and
``save_invstd`` tensors, so autograd saves what it saved in the forward pass, and it writes no running
statistics.

Where it applies (anything else runs PyTorch's kernel, as without this): ``aten.native_batch_norm`` in training
mode on the CPU, float32 or float64 input in a contiguous or channels-last layout, weight and bias of the
input's dtype or absent. It matched PyTorch's output bit for bit on 600 random cases of those (2-D to 5-D,
with and without affine parameters and running statistics); other layouts go through another kernel path,
which it does not reproduce, and CUDA's kernels (cuDNN's among them) are not checked.

Source: memfit's own. The normalization form ``x * alpha + beta`` is PyTorch's CPU kernel's
(``aten/src/ATen/native/cpu/batch_norm_kernel.cpp``); recomputation itself is Chen et al. (2016) and MONeT
(Shah et al., ICLR 2021, section 3). ``remat-ilp`` and ``--no-variants`` recompute BatchNorm as PyTorch's
checkpoint does (statistics again); ``memfit`` uses this form wherever a plan recomputes a BatchNorm it applies
to.

Usage (what :class:`memfit.runtime.planned.PlannedModule` does for one node)::

    rec = RecordStats()
    with rec:
        y = bn(x)               # forward pass: PyTorch's kernel; rec.stats holds (mean, invstd) per call
    with ReplayStats(rec.stats):
        y2 = bn(x)              # recomputation: y2 equals y bit for bit, statistics not computed again
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NAME = "bn-saved-stats"
_OP = torch.ops.aten.native_batch_norm.default
_LAYOUTS = {4: torch.channels_last, 5: torch.channels_last_3d}

Stats = tuple[torch.Tensor, torch.Tensor] | None  # (save_mean, save_invstd) of one call; None: not applicable


def _bound(args, kwargs) -> tuple:
    """``(input, weight, bias, running_mean, running_var, training, momentum, eps)`` of a call."""
    names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
    values = list(args) + [kwargs[k] for k in names[len(args):]]
    return tuple(values)


def applies(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, training: bool) -> bool:
    """Whether :func:`normalize` reproduces PyTorch's training-mode output for this call bit for bit: the CPU,
    float32 or float64, a contiguous or channels-last input, parameters of the input's dtype or absent."""
    if not training or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.dim() < 2:
        return False
    if any(p is not None and (p.dtype != x.dtype or p.device != x.device) for p in (weight, bias)):
        return False
    layout = _LAYOUTS.get(x.dim())
    return x.is_contiguous() or (layout is not None and x.is_contiguous(memory_format=layout))


def normalize(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
              mean: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    """BatchNorm's training-mode output from its saved statistics.

    Args:
        x: input, ``(N, C, *spatial)``, float32 or float64 (see :func:`applies`).
        weight, bias: ``(C,)`` affine parameters, or ``None`` (1 and 0).
        mean, invstd: ``(C,)``, the ``save_mean`` and ``save_invstd`` PyTorch's kernel returned for ``x``.

    Returns:
        ``(N, C, *spatial)`` in ``x``'s layout: ``x * alpha + beta`` per channel, each a fused multiply-add.
    """
    c = x.shape[1]
    with torch.no_grad():
        alpha = invstd * weight if weight is not None else invstd.clone()
        b = bias if bias is not None else torch.zeros(c, dtype=x.dtype, device=x.device)
        beta = torch.addcmul(b, mean, alpha, value=-1)
        shape = [1, c] + [1] * (x.dim() - 2)
        return torch.addcmul(beta.view(shape), x, alpha.view(shape))


class RecordStats(TorchDispatchMode):
    """Runs PyTorch's batch-norm kernels unchanged and records, per ``native_batch_norm`` call in order, its
    ``(save_mean, save_invstd)`` where :func:`applies` holds and ``None`` elsewhere (``stats``)."""

    def __init__(self):
        super().__init__()
        self.stats: list[Stats] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _OP:
            x, weight, bias, _, _, training, _, _ = _bound(args, kwargs)
            self.stats.append((out[1], out[2]) if applies(x, weight, bias, training) else None)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the recorded statistics."""
        return sum(m.nbytes + s.nbytes for m, s in filter(None, self.stats))


class ReplayStats(TorchDispatchMode):
    """Recomputes each ``native_batch_norm`` call from the statistics :class:`RecordStats` recorded for the
    same call of the forward pass (consumed in order: a second recomputation runs PyTorch's kernel); calls
    without statistics, or whose input no longer qualifies, run PyTorch's kernel. ``replayed`` counts the
    calls it recomputed from statistics."""

    def __init__(self, stats: list[Stats]):
        super().__init__()
        self.stats = stats
        self.replayed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _OP:
            return func(*args, **kwargs)
        saved = self.stats.pop(0) if self.stats else None
        x, weight, bias, _, _, training, _, _ = _bound(args, kwargs)
        if saved is None or not applies(x, weight, bias, training) or saved[0].shape != (x.shape[1],):
            return func(*args, **kwargs)
        mean, invstd = saved
        self.replayed += 1
        return normalize(x, weight, bias, mean, invstd), mean, invstd
