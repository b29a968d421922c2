r"""BatchNorm whose backward is computed from its output instead of its input.

PyTorch's BatchNorm saves its input ``x`` for the backward pass. The next layer usually saves the
BatchNorm *output* ``y`` anyway (a convolution saves its input; a residual add saves nothing, so the
tensor lives on in the next convolution), so keeping ``x`` as well doubles the memory of that edge.
In-place activated BatchNorm (Rota Bulo, Porzi, Kontschieder, CVPR 2018, section 3) observes that the
normalised input can be recovered from the output, and computes the whole backward from ``y``:

Forward (training; statistics over the ``M = N * prod(spatial)`` values of each channel ``c``)::

    mu_c = mean(x_c),  var_c = mean((x_c - mu_c)^2),  invstd_c = 1 / sqrt(var_c + eps)
    x_hat = (x - mu_c) * invstd_c,  y = gamma_c * x_hat + beta_c
    running_mean <- (1 - m) running_mean + m mu_c
    running_var  <- (1 - m) running_var  + m var_c * M / (M - 1)

Backward from the output::

    x_hat   = (y - beta_c) / gamma_c                         (requires gamma_c != 0)
    dbeta_c  = sum(dy)
    dgamma_c = sum(dy * x_hat)
    dx = gamma_c * invstd_c * (dy - dbeta_c / M - x_hat * dgamma_c / M)

Eval mode (normalising with the running statistics): ``dx = gamma_c * invstd_running_c * dy`` and the
same ``dgamma``, ``dbeta``.

Saved for backward: the output ``y`` (shared with whatever the next layer saves), ``gamma``, ``beta``
(parameters) and one per-channel vector (``invstd``, or the running variance in eval mode). The input
is not saved, so it is freed as soon as nothing else references it.

Implementation: the forward is ``torch.native_batch_norm`` itself (identical output and running
statistics; ``num_batches_tracked`` and ``momentum=None`` are handled in the module exactly as in
``nn.BatchNorm``). The training backward is PyTorch's fused ``native_batch_norm_backward`` kernel
called with ``input = y``, ``save_mean = beta``, ``save_invstd = 1 / gamma`` and
``weight = gamma^2 * invstd``: its ``x_hat = (input - save_mean) * save_invstd`` is then
``(y - beta) / gamma`` and its ``dx`` factor ``save_invstd * weight`` is ``gamma * invstd``; its
``dgamma = sum(dy * x_hat)`` does not involve ``weight``. This holds for negative ``gamma`` too. For
half / bf16 inputs the per-channel vectors are passed in float32 (the kernel's mixed-precision path).

Constraint: ``gamma`` must be non-zero in every channel (checked in the backward, which raises
``RuntimeError`` otherwise). Accuracy degrades as ``|beta| / |gamma|`` grows: the recovered ``x_hat``
carries an error of about ``ulp(y) / |gamma|`` (:func:`ill_conditioned` tells where that exceeds float32
rounding, with a tighter limit for a half-precision output, :func:`condition_limit`; memfit's planner then runs
the layer as PyTorch's own, and does not rewrite BatchNorms with half-precision outputs at all). Gradients
therefore match PyTorch's to float32 rounding, not bit-for-bit (PyTorch computes ``x_hat`` from ``x``; here it
comes from the rounded ``y``).

Activation fusion. Fused with ``LeakyReLU(s)`` for ``s > 0`` (InPlace-ABN uses ``s = 0.01``) the module
returns ``z = leaky_relu(y, s)`` and saves only ``z``: ``leaky_relu`` is invertible
(``y = z if z > 0 else z / s``; ``dy = dz if z > 0 else s * dz``, PyTorch's ``y > 0`` convention).
Fusion with plain ReLU is refused: ``dx`` needs ``x_hat`` at every position, including where ``y < 0``,
which ReLU maps to 0 and so destroys (``dgamma``/``dbeta`` would be recoverable, ``dx`` is not). For
BN + ReLU use this module followed by the 1-bit-mask ReLU of :mod:`memfit.variants.relu_mask`: that
saves ``y`` + 1 bit/element, against PyTorch's ``x`` + ``relu(y)``; it pays off when ``relu(y)`` is not
saved by the next layer anyway, and otherwise the two are even.

Graph constraint: since ``y`` is saved, nothing may modify ``y`` in place afterwards (e.g.
``nn.ReLU(inplace=True)`` right after the BatchNorm, or ResNet's ``out += identity``); autograd's
version check then raises at backward ("modified by an inplace operation"). Make those ops
out-of-place when using this variant. Note that for ``conv -> BN -> ReLU -> conv`` the saving is
then nil (``y`` + ``relu(y)`` against PyTorch's ``x`` + ``relu(y)``); it is real when the BatchNorm
output is saved by the next layer anyway (``BN -> conv``, ``BN -> linear``) or with the fused
LeakyReLU (one tensor instead of two).

``inplace=True`` writes the result (``y`` or ``z``) into the input's storage (``ctx.mark_dirty``), as
InPlace-ABN does, so the layer needs no output allocation; the input must not be used by anyone else
(same caveat as ``nn.ReLU(inplace=True)``).
"""

from __future__ import annotations

import torch
import torch.fx
from torch import Tensor, nn

from memfit.variants.single_backward import single_backward

__all__ = [
    "HALF_DTYPES",
    "BNFromOutputFn",
    "BatchNorm1dFromOutput",
    "BatchNorm2dFromOutput",
    "BatchNorm3dFromOutput",
    "bn_from_output",
    "condition_limit",
    "from_module",
    "fuse_bn_leaky_relu",
    "ill_conditioned",
    "ill_conditioned_channels",
]

#: the half-precision dtypes (float32 per-channel vectors in the backward; :func:`condition_limit` 1)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _stat_dtype(x: Tensor, *params: Tensor | None) -> torch.dtype:
    """dtype of ``native_batch_norm``'s ``save_mean`` / ``save_invstd`` for these arguments."""
    if x.dtype in HALF_DTYPES and any(p is not None and p.dtype == torch.float32 for p in params):
        return torch.float32
    return x.dtype


def _dense(x: Tensor) -> bool:
    return x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)) or (
        x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d))


def _channel_view(v: Tensor, ndim: int) -> Tensor:
    return v.view([1, -1] + [1] * (ndim - 2))


class BNFromOutputFn(torch.autograd.Function):
    """``apply(x, weight, bias, running_mean, running_var, training, momentum, eps, slope, inplace)``.

    ``training``: normalise with batch statistics (and update the running ones if given);
    ``slope``: ``None`` for plain BatchNorm, else the (positive) LeakyReLU slope fused after it.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps, slope, inplace):
        if training:
            if inplace and _dense(x):
                # true in-place: torch's kernel reads all of x for the statistics, then maps each
                # element independently, so out=x is safe for a dense (contiguous or channels-last) x;
                # strided inputs go through the copy below (checked bit-exact in the tests)
                sdt = _stat_dtype(x, weight, bias, running_mean, running_var)
                save_mean = x.new_empty(0, dtype=sdt)
                stat = x.new_empty(0, dtype=sdt)
                torch.ops.aten.native_batch_norm.out(x, weight, bias, running_mean, running_var, True,
                                                      momentum, eps, out=x, save_mean=save_mean,
                                                      save_invstd=stat)
                out = x
            else:
                out, save_mean, stat = torch.native_batch_norm(x, weight, bias, running_mean, running_var,
                                                               True, momentum, eps)
                if inplace:
                    x.copy_(out)
                    out = x
            del save_mean
        else:
            # eval mode: normalise with the running statistics; keep a snapshot of running_var
            out = torch.batch_norm(x, weight, bias, running_mean, running_var, False, momentum, eps, False)
            stat = running_var.clone()
            if inplace:
                x.copy_(out)
                out = x
        if slope is not None:
            if out is x:
                torch.nn.functional.leaky_relu_(out, slope)
            else:
                out = torch.nn.functional.leaky_relu_(out, slope)  # out is our own temporary
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(out, weight, bias, stat)
        ctx.training, ctx.eps, ctx.slope = training, eps, slope
        return out

    @staticmethod
    @single_backward("bn-from-output")
    def backward(ctx, grad):
        out, weight, bias, stat = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if not (need_x or need_w or need_b):
            return (None,) * 10
        if weight is not None and not bool((weight != 0).all()):
            raise RuntimeError(
                "BatchNorm-from-output backward needs every weight (gamma) to be non-zero: it recovers "
                "x_hat = (y - beta) / gamma from the output. Use plain nn.BatchNorm for this layer.")
        c, ndim = out.shape[1], out.dim()
        # per-channel vectors in float32 for half/bf16 (mixed-precision kernel path), else x's dtype
        pdt = torch.float32 if out.dtype in HALF_DTYPES else out.dtype
        w = weight.to(pdt) if weight is not None else out.new_ones(c, dtype=pdt)
        b = bias.to(pdt) if bias is not None else out.new_zeros(c, dtype=pdt)
        if ctx.slope is not None:
            z = out
            grad = torch.ops.aten.leaky_relu_backward(grad, z, ctx.slope, True)  # z > 0 ? g : g * s
            y = torch.nn.functional.leaky_relu(z, 1.0 / ctx.slope)  # z > 0 ? z : z / s
        else:
            y = out
        if grad.dtype != y.dtype:
            grad = grad.to(y.dtype)
        gx = gw = gb = None
        if ctx.training:
            invstd = stat.to(pdt)
            gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
                grad, y, w * w * invstd, None, None, b, 1.0 / w, True, ctx.eps, [need_x, need_w, need_b])
        else:
            if need_x:  # dx = dy * gamma * invstd_running: torch's own eval kernel, bit-exact
                gx = torch.ops.aten.native_batch_norm_backward(
                    grad, y, w, torch.zeros_like(w), stat.to(pdt), None, None, False, ctx.eps,
                    [True, False, False])[0]
            dims = [0] + list(range(2, ndim))
            if need_w:
                x_hat = (y.to(pdt) - _channel_view(b, ndim)) / _channel_view(w, ndim)
                gw = (grad.to(pdt) * x_hat).sum(dims)
                del x_hat
            if need_b:
                gb = grad.to(pdt).sum(dims)
        if gw is not None and weight is not None:
            gw = gw.to(weight.dtype)
        if gb is not None and bias is not None:
            gb = gb.to(bias.dtype)
        return gx, gw, gb, None, None, None, None, None, None, None


#: ``|bias| / |weight|`` above which a channel's recovered ``x_hat`` loses precision in float32: its error is about
#: ``2**-24 * |bias| / |weight|`` of ``x_hat``'s scale. Through a whole model (a fresh user's MobileNet-style net,
#: one step against float64) the weight gradient of a BatchNorm at 32 was 2.8e-5 off, under the 3.2e-5 of plain
#: float32's worst parameter in that step; at 64 it became the step's worst (7e-5), at 1020 1.4e-3 (the limit was
#: 1024 until then). ``|weight| = 1e-7`` gave a weight gradient 4.6x off. For other output dtypes see
#: :func:`condition_limit`.
CONDITION_LIMIT = 32.0


def condition_limit(dtype: torch.dtype) -> float:
    """The largest ``|bias| / |weight|`` at which a BatchNorm whose output has ``dtype`` is run from its output:
    :data:`CONDITION_LIMIT` (32) for float32 and float64, and 1 for float16 and bfloat16.

    The rounded output adds an error of about ``eps(dtype) * |bias| / |weight|`` to the recovered ``x_hat``. In
    float32, for one BatchNorm with random upstream gradients, that is 1.5e-6 of the weight gradient at 64 and
    3e-5 at 1024, against PyTorch's 1.3e-7 (``benchmarks/bn_from_output_precision.py``); through a whole model
    the weight gradient can cancel and the relative error is larger (:data:`CONDITION_LIMIT`). bfloat16's and
    float16's own rounding is that large already: PyTorch's bfloat16 weight gradient is itself 0.3% off float64's,
    and run from the output it was 0.35% off at a ratio of 1/8, 0.5% at 1, 1.6% at 8 and 110% at 1024 (and a fresh user's 32x
    off at 500 through a whole model), so in half precision the ratio must stay below 1, where the error is about
    PyTorch's own."""
    return 1.0 if dtype in HALF_DTYPES else CONDITION_LIMIT


def ill_conditioned_channels(weight: Tensor, bias: Tensor | None, dtype: torch.dtype | None = None) -> Tensor:
    """Per channel, whether ``|weight|`` is 0, below ``|bias| / condition_limit(dtype)``, or so small (``< 2**24``
    times float32's or float64's smallest normal number, or below ``dtype``'s) that the output underflows: a bool
    tensor of ``weight``'s shape ``(C,)``, on its device, without synchronization. ``bias``: shape ``(C,)`` or None
    (no bias). ``dtype``: the BatchNorm output's dtype (a bfloat16 activation under ``torch.autocast`` with float32
    parameters), ``weight``'s by default (:func:`condition_limit`)."""
    out = weight.dtype if dtype is None else dtype
    limit = condition_limit(out)
    # (the backward's per-channel vectors are float32 for half-precision weights: float16's own smallest normal
    # number times 2**24 is 1024, which flagged every float16 BatchNorm: a fresh user's finding)
    vectors = torch.float32 if weight.dtype in HALF_DTYPES else weight.dtype
    with torch.no_grad():
        w = weight.abs()
        bad = w < max(torch.finfo(vectors).tiny * 2.0 ** 24, torch.finfo(out).tiny)
        if bias is not None:
            bad |= w * limit < bias.abs()
    return bad


def ill_conditioned(weight: Tensor | None, bias: Tensor | None, dtype: torch.dtype | None = None) -> Tensor:
    """A 0-dim bool tensor (on the parameters' device, no synchronization): some channel is
    :func:`ill_conditioned_channels` (for an output of ``dtype``, the weight's by default), so that computing the
    backward pass from the output would not give PyTorch's gradients to that dtype's rounding. ``False`` without
    an affine weight. Shapes ``(C,)``."""
    if weight is None:
        return torch.zeros((), dtype=torch.bool)
    return ill_conditioned_channels(weight, bias, dtype).any()


def bn_from_output(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                   weight: Tensor | None = None, bias: Tensor | None = None, training: bool = False,
                   momentum: float = 0.1, eps: float = 1e-5, negative_slope: float | None = None,
                   inplace: bool = False) -> Tensor:
    """``F.batch_norm`` (same signature and running-statistics update) whose backward reads the output.

    ``negative_slope``: if given (> 0), a LeakyReLU with that slope is fused after the normalisation.
    ``inplace``: write the result into ``x``.
    """
    if training:
        size = x.shape
        m = size[0]
        for s in size[2:]:
            m *= s
        if m == 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {size}")
        if eps <= 0.0:
            raise ValueError(f"batch_norm eps must be positive during training, but got {eps}")
    elif running_var is None or running_mean is None:
        raise ValueError("bn_from_output in eval mode needs running_mean and running_var")
    if negative_slope is not None and not negative_slope > 0:
        raise ValueError(f"the fused LeakyReLU must have a positive slope to be invertible, got {negative_slope}")
    return BNFromOutputFn.apply(x, weight, bias, running_mean, running_var, bool(training), float(momentum),
                                float(eps), None if negative_slope is None else float(negative_slope),
                                bool(inplace))


torch.fx.wrap("bn_from_output")


class _FromOutputMixin:
    """forward() of ``nn.BatchNorm*`` (torch 2.x), routed through :func:`bn_from_output`."""

    activation: str | None
    negative_slope: float
    inplace: bool

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None, *, activation: str | None = None,
                 negative_slope: float = 0.01, inplace: bool = False) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        if activation not in (None, "leaky_relu"):
            if activation == "relu":
                raise ValueError(
                    "BatchNorm + ReLU cannot be computed from the output: ReLU discards y < 0, which dx "
                    "needs. Use activation='leaky_relu' (InPlace-ABN) or a separate ReLUMask.")
            raise ValueError(f"activation must be None or 'leaky_relu', got {activation!r}")
        if activation == "leaky_relu" and not negative_slope > 0:
            raise ValueError(f"the fused LeakyReLU needs negative_slope > 0 to be invertible, got {negative_slope}")
        self.activation = activation
        self.negative_slope = float(negative_slope)
        self.inplace = bool(inplace)

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, torch.fx.Proxy):
            raise TypeError(
                f"{type(self).__name__} cannot be traced by torch.fx: tracing through it would freeze its "
                "train/eval mode into the graph. Capture the model with plain nn.BatchNorm and swap the "
                "variant into the GraphModule afterwards (the call_module node keeps its target).")
        self._check_input_dim(input)
        eaf = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            eaf = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = True if self.training else (self.running_mean is None and self.running_var is None)
        use_buffers = not self.training or self.track_running_stats
        return bn_from_output(
            input,
            self.running_mean if use_buffers else None,
            self.running_var if use_buffers else None,
            self.weight, self.bias, bn_training, eaf, self.eps,
            self.negative_slope if self.activation == "leaky_relu" else None,
            self.inplace,
        )

    def extra_repr(self) -> str:
        s = super().extra_repr()
        if self.activation is not None:
            s += f", activation={self.activation}, negative_slope={self.negative_slope}"
        if self.inplace:
            s += ", inplace=True"
        return s

    @classmethod
    def from_module(cls, bn: nn.modules.batchnorm._BatchNorm, activation: str | None = None,
                    negative_slope: float = 0.01, inplace: bool = False):
        """A variant sharing ``bn``'s Parameter objects and its buffer registry itself (same state_dict keys,
        ``isinstance`` of ``bn``'s class): a checkpoint region's recomputation, which swaps ``bn``'s buffers for
        copies, swaps them here too (with copied entries, the recomputation counted ``num_batches_tracked`` a
        second time); train/eval mode is copied."""
        new = cls(bn.num_features, eps=bn.eps, momentum=bn.momentum, affine=bn.affine,
                  track_running_stats=bn.track_running_stats, device="meta",
                  activation=activation, negative_slope=negative_slope, inplace=inplace)
        for name in list(new._parameters):
            new._parameters[name] = bn._parameters[name]
        new.__dict__["_buffers"] = bn._buffers
        new.train(bn.training)
        return new


class BatchNorm1dFromOutput(_FromOutputMixin, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` subclass whose backward uses the output; extra keyword-only arguments
    ``activation`` (``None`` or ``"leaky_relu"``), ``negative_slope``, ``inplace``."""


class BatchNorm2dFromOutput(_FromOutputMixin, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` subclass whose backward uses the output; extra keyword-only arguments
    ``activation`` (``None`` or ``"leaky_relu"``), ``negative_slope``, ``inplace``."""


class BatchNorm3dFromOutput(_FromOutputMixin, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` subclass whose backward uses the output; extra keyword-only arguments
    ``activation`` (``None`` or ``"leaky_relu"``), ``negative_slope``, ``inplace``."""


_CLASSES = {nn.BatchNorm1d: BatchNorm1dFromOutput, nn.BatchNorm2d: BatchNorm2dFromOutput,
            nn.BatchNorm3d: BatchNorm3dFromOutput}


def from_module(bn: nn.modules.batchnorm._BatchNorm, activation: str | None = None,
                negative_slope: float = 0.01, inplace: bool = False) -> nn.Module:
    """The from-output variant of ``bn`` (``nn.BatchNorm1d/2d/3d``), sharing its parameters and buffers."""
    cls = _CLASSES.get(type(bn))
    if cls is None:
        raise TypeError(f"no from-output variant for {type(bn).__name__}")
    return cls.from_module(bn, activation=activation, negative_slope=negative_slope, inplace=inplace)


def fuse_bn_leaky_relu(bn: nn.modules.batchnorm._BatchNorm, act: nn.LeakyReLU,
                       inplace: bool | None = None) -> nn.Module:
    """InPlace-ABN: one module computing ``act(bn(x))`` that saves only its output. Replace ``bn`` by the
    result and ``act`` by ``nn.Identity()``. ``inplace`` defaults to ``act.inplace``."""
    return from_module(bn, activation="leaky_relu", negative_slope=act.negative_slope,
                       inplace=act.inplace if inplace is None else inplace)
