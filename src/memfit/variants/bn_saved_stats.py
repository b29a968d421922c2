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

How: the forward pass and the recomputation run the node under a ``TorchFunctionMode`` that sees
``F.batch_norm`` / ``torch.batch_norm`` calls only (a module's own bookkeeping, such as
``num_batches_tracked``, runs as usual). In the forward pass it calls ``torch.native_batch_norm``, which
``F.batch_norm`` reaches on the CPU anyway (the same autograd node, ``NativeBatchNormBackward0``, saving the
same tensors), and keeps its ``save_mean`` and ``save_invstd``. In the recomputation it returns
:func:`normalize`'s output through an autograd Function that saves what ``NativeBatchNormBackward0`` saves, in
its order (input, running mean, running variance, weight, mean, invstd; ``None`` skipped), which is what a
non-reentrant checkpoint's recomputation collects. A mode that sees every ATen operator instead cost about
0.2 ms per BatchNorm in the step, which ate most of the gain on ResNet-50.

Usage (what :class:`memfit.runtime.planned.PlannedModule` does for one node)::

    rec = RecordStats()
    with rec:
        y = bn(x)               # forward pass; rec.stats holds (mean, invstd) per call
    with ReplayStats(rec.stats):
        y2 = bn(x)              # recomputation: y2 equals y bit for bit, statistics not computed again
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

NAME = "bn-saved-stats"
_LAYOUTS = {4: torch.channels_last, 5: torch.channels_last_3d}
_F_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_TORCH_ARGS = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps",
               "cudnn_enabled")
_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}

Stats = tuple[torch.Tensor, torch.Tensor] | None  # (save_mean, save_invstd) of one call; None: not applicable


def _bound(func, args, kwargs) -> dict | None:
    """The arguments of an ``F.batch_norm`` or ``torch.batch_norm`` call by name, or ``None`` for other calls."""
    if func is F.batch_norm:
        names = _F_ARGS
    elif func is torch.batch_norm:
        names = _TORCH_ARGS
    else:
        return None
    values = dict(_DEFAULTS)
    values.update(zip(names, args))
    values.update(kwargs)
    return values


def applies(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, training: bool) -> bool:
    """Whether :func:`normalize` reproduces PyTorch's training-mode output for this call bit for bit: the CPU,
    float32 or float64, a non-empty contiguous or channels-last input, parameters of the input's dtype or absent,
    outside autocast."""
    if not training or not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dim() < 2 or not x.numel():
        return False
    if x.dtype not in (torch.float32, torch.float64) or torch.is_autocast_enabled("cpu"):
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


class _FromStats(torch.autograd.Function):
    """:func:`normalize` as a recomputation of ``native_batch_norm``: it saves what ``NativeBatchNormBackward0``
    saves, in its order, for the checkpoint to collect. It has no backward of its own (a recomputation's graph
    is never differentiated)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, mean, invstd):
        ctx.save_for_backward(x, running_mean, running_var, weight, mean, invstd)
        return normalize(x, weight, bias, mean, invstd)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a BatchNorm recomputed from saved statistics (bn-saved-stats) has no backward of its "
                           "own; it runs only in a non-reentrant checkpoint's recomputation")


class RecordStats(TorchFunctionMode):
    """Runs each ``F.batch_norm`` / ``torch.batch_norm`` call as PyTorch's CPU path does
    (``torch.native_batch_norm``) and records, per call in order, its ``(save_mean, save_invstd)`` where
    :func:`applies` holds and ``None`` elsewhere (``stats``; those calls run unchanged)."""

    def __init__(self):
        super().__init__()
        self.stats: list[Stats] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        a = _bound(func, args, kwargs)
        if a is None:
            return func(*args, **kwargs)
        x, weight, bias = a["input"], a["weight"], a["bias"]
        if not applies(x, weight, bias, a["training"]):
            self.stats.append(None)
            return func(*args, **kwargs)
        verify = getattr(F, "_verify_batch_size", None)  # F.batch_norm's check of one value per channel
        if verify is not None:
            verify(x.size())
        out, mean, invstd = torch.native_batch_norm(x, weight, bias, a["running_mean"], a["running_var"], True,
                                                    a["momentum"], a["eps"])
        self.stats.append((mean, invstd))
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the recorded statistics."""
        return sum(m.nbytes + s.nbytes for m, s in filter(None, self.stats))


class ReplayStats(TorchFunctionMode):
    """Recomputes each ``F.batch_norm`` / ``torch.batch_norm`` call from the statistics :class:`RecordStats`
    recorded for the same call of the forward pass (consumed in order: a second recomputation runs PyTorch's
    kernel); calls without statistics, or whose input no longer qualifies, run unchanged. Running statistics
    are not updated. ``replayed`` counts the calls recomputed from statistics."""

    def __init__(self, stats: list[Stats]):
        super().__init__()
        self.stats = stats
        self.replayed = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        a = _bound(func, args, kwargs)
        if a is None:
            return func(*args, **kwargs)
        saved = self.stats.pop(0) if self.stats else None
        x, weight, bias = a["input"], a["weight"], a["bias"]
        if saved is None or not applies(x, weight, bias, a["training"]) or saved[0].shape != (x.shape[1],):
            return func(*args, **kwargs)
        self.replayed += 1
        return _FromStats.apply(x, weight, bias, a["running_mean"], a["running_var"], *saved)
