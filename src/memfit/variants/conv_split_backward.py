"""Convolution whose backward computes the weight and the input gradients in two separate calls (and the
same with cuDNN or oneDNN off).

PyTorch's convolution backward (``aten.convolution_backward`` with ``output_mask=[True, True, True]``)
computes the input gradient and the weight gradient in one call. On the CPU, oneDNN then holds, at
the same time, the new input gradient and reordered copies of ``grad_output`` and of the input in its
blocked layout: for a contiguous (NCHW) float32 ``[2, 64, 128, 128]`` 3x3 convolution that is 24 MiB of
transient memory, three activation-sized tensors. Calling the same kernel twice, first for the weight
(and bias) gradient and then for the input gradient, never holds more than two (16 MiB there), at
about 10% more backward time for that layer (``grad_output`` is reordered twice). In networks whose
peak is the backward of their widest full-resolution convolutions (VGG-16, UNet), that transient is
what sets the peak, and no recomputation or offloading plan can lower it.

This is the CPU counterpart of MONeT's convolution-algorithm choice (Shah et al., ICLR 2021,
section 4.2: each cuDNN algorithm trades workspace for time): the solver picks, per convolution,
PyTorch's joint backward or this split one from their measured time and workspace. PyTorch does not
expose a per-call cuDNN algorithm choice from Python (only the global ``torch.backends.cudnn.benchmark``),
so on CUDA this is the only convolution choice available; there the split backward runs cuDNN's
backward-data and backward-filter one after the other, as the joint call does.

``conv-native`` is the same split convolution with the vendor library switched off around its forward and
both backward calls, so that PyTorch's own kernels run (im2col + GEMM). On CUDA that is cuDNN: the
native kernels' workspace is one sample's column buffer (``C_in * prod(kernel) * prod(spatial_out)``
elements), against cuDNN's, which PyTorch sizes by its algorithm heuristics and can be gigabytes: 4.5 GB
for VGG-16's second convolution at batch 176, 224x224, on an H200, in deterministic and default modes
alike, beside 2.3 GB activations. It is slower, and its results differ from cuDNN's by rounding (cuDNN's
convolutions use TF32 by default, ``torch.backends.cudnn.allow_tf32``; the GEMM path follows
``torch.backends.cuda.matmul``). On the CPU it is oneDNN (``torch.backends.mkldnn``), whose kernels
reorder the weight (and its gradient) into a blocked layout at every call: a weight-sized transient in
the forward and the backward pass, which dominates where channels are many and the image small (a
UNet's bottleneck: ``[2, 1024, 6, 6]`` through a 1024-channel 3x3 convolution, 36 MiB of weights, took
72 MiB of backward workspace with oneDNN, the weight's gradient included, and 38 MiB natively). The native
CPU kernels hold the whole batch's im2col columns instead, nine times the input for a 3x3 convolution, so
they cost more memory and time at full resolution: the profile measures both per node and the solver
picks. Its results differ from oneDNN's by float rounding (another summation order), and are PyTorch's
own bit for bit with ``torch.backends.mkldnn.enabled = False``.

The forward is ``F.conv1d/2d/3d`` and the backward is PyTorch's own kernel with a partial
``output_mask``, so outputs and gradients are bit-for-bit PyTorch's (``conv-native``: PyTorch's with the vendor library
off). What is saved (input and
weight) is what PyTorch saves. Only ``padding_mode="zeros"`` and numeric padding are handled (other
modes pad in a separate op; ``padding="same"`` is resolved by the caller of ``F.conv*d``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn

from memfit.variants.single_backward import single_backward

__all__ = [
    "Conv1dSplitBackward",
    "Conv2dNative",
    "Conv2dSplitBackward",
    "Conv3dSplitBackward",
    "ConvSplitBackwardFn",
    "conv_split_backward",
    "from_module",
    "native_applies",
    "native_pays",
    "vendor_kernels_off",
]

_FORWARD = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@contextlib.contextmanager
def vendor_kernels_off(native: bool):
    """cuDNN and oneDNN switched off (``torch.backends.cudnn.enabled``, ``torch.backends.mkldnn.enabled``)
    while the body runs, if ``native``, so that PyTorch's own im2col + GEMM kernels run on either device.
    (``torch.backends.cudnn.flags`` and ``torch.backends.mkldnn.flags`` would also reset the libraries' other
    settings, ``benchmark``, ``deterministic`` and TF32, to their defaults.)"""
    if not native:
        yield
        return
    before = torch.backends.cudnn.enabled, torch.backends.mkldnn.enabled
    torch.backends.cudnn.enabled = False
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.cudnn.enabled, torch.backends.mkldnn.enabled = before


def keep_conv_args(ctx, bias: Tensor | None, stride, padding, dilation, groups: int) -> None:
    """Keep on ``ctx`` what ``aten.convolution_backward`` needs besides the tensors: ``ctx.args`` (stride, padding,
    dilation as lists, groups) and ``ctx.bias_sizes`` (``[C_out]``, or ``None`` without a bias)."""
    ctx.args = (list(stride), list(padding), list(dilation), groups)
    ctx.bias_sizes = None if bias is None else [bias.shape[0]]


class ConvSplitBackwardFn(torch.autograd.Function):
    """``apply(x, weight, bias, stride, padding, dilation, groups, native=False)``.

    ``x``: ``[N, C_in, *spatial]`` (1, 2 or 3 spatial dimensions); ``weight``: ``[C_out, C_in / groups,
    *kernel]``; ``bias``: ``[C_out]`` or ``None``; ``stride``, ``padding``, ``dilation``: tuples of ints
    of the spatial rank; ``native``: run the forward and both backward calls with cuDNN and oneDNN off
    (PyTorch's own kernels). Returns ``[N, C_out, *spatial_out]``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, stride, padding, dilation,
                groups: int, native: bool = False) -> Tensor:
        with vendor_kernels_off(native):
            out = _FORWARD[x.dim() - 2](x, weight, bias, stride, padding, dilation, groups)
        ctx.save_for_backward(x, weight)
        keep_conv_args(ctx, bias, stride, padding, dilation, groups)
        ctx.native = native
        return out

    @staticmethod
    @single_backward("conv-split-backward")
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.args
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        zeros = [0] * len(stride)

        def call(mask):
            with vendor_kernels_off(ctx.native):
                return torch.ops.aten.convolution_backward(
                    grad, x, weight, ctx.bias_sizes, stride, padding, dilation, False, zeros, groups, mask)

        gw = gb = gx = None
        if need_w or need_b:  # first: its reorders are freed before the input gradient exists
            _, gw, gb = call([False, bool(need_w), bool(need_b) and ctx.bias_sizes is not None])
        if need_x:
            gx = call([True, False, False])[0]
        return gx, gw, gb, None, None, None, None, None


def conv_split_backward(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0,
                        dilation=1, groups: int = 1, native: bool = False) -> Tensor:
    """``F.conv1d/2d/3d`` (chosen by ``x.dim()``: 3, 4 or 5) whose backward computes the weight and input
    gradients in two calls; with ``native``, all three run with cuDNN and oneDNN off (``conv-native``). ``stride``,
    ``padding``, ``dilation``: ints or tuples; string padding is not accepted (``TypeError``); an input of
    another rank raises ``ValueError``."""
    rank = x.dim() - 2
    if rank not in _FORWARD:
        raise ValueError(f"expected a 3-, 4- or 5-D input [N, C, *spatial], got shape {list(x.shape)}")
    if isinstance(padding, str):
        raise TypeError("conv_split_backward needs numeric padding, not a string like 'same'")

    def tup(v):
        return tuple(v) if isinstance(v, (list, tuple)) else (int(v),) * rank

    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        # what autocast does for PyTorch's convolution (a lower-precision op on CPU and CUDA): cast the
        # floating inputs with differentiable casts, so the saved tensors and the gradients' dtypes match
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        with torch.autocast(device_type, enabled=False):
            return ConvSplitBackwardFn.apply(x, weight, bias, tup(stride), tup(padding), tup(dilation), groups,
                                             native)
    return ConvSplitBackwardFn.apply(x, weight, bias, tup(stride), tup(padding), tup(dilation), groups, native)


torch.fx.wrap("conv_split_backward")


class _SplitMixin:
    native = False

    def forward(self, input: Tensor) -> Tensor:
        return conv_split_backward(input, self.weight, self.bias, self.stride, self.padding, self.dilation,
                                   self.groups, self.native)

    @classmethod
    def from_module(cls, conv: nn.modules.conv._ConvNd):
        """A variant sharing ``conv``'s Parameter objects (same state_dict keys, ``isinstance`` of its class)."""
        if not (native_applies(conv) if cls.native else applies(conv)):
            raise TypeError(f"no {'native' if cls.native else 'split-backward'} variant for {conv!r}")
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                  padding=conv.padding, dilation=conv.dilation, groups=conv.groups, bias=conv.bias is not None,
                  padding_mode=conv.padding_mode, device="meta")
        for name in list(new._parameters):
            new._parameters[name] = conv._parameters[name]
        new.train(conv.training)
        return new


class Conv1dSplitBackward(_SplitMixin, nn.Conv1d):
    """``nn.Conv1d`` subclass whose backward computes the weight and input gradients in two calls."""


class Conv2dSplitBackward(_SplitMixin, nn.Conv2d):
    """``nn.Conv2d`` subclass whose backward computes the weight and input gradients in two calls."""


class Conv3dSplitBackward(_SplitMixin, nn.Conv3d):
    """``nn.Conv3d`` subclass whose backward computes the weight and input gradients in two calls."""


class Conv2dNative(_SplitMixin, nn.Conv2d):
    """``nn.Conv2d`` subclass that runs with cuDNN and oneDNN off (PyTorch's own im2col + GEMM kernels: no
    vendor workspace or weight reorder, im2col columns instead) and computes its weight and input gradients
    in two calls (``conv-native``)."""

    native = True


_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv1d: Conv1dSplitBackward, nn.Conv2d: Conv2dSplitBackward, nn.Conv3d: Conv3dSplitBackward,
}


def applies(m: nn.Module) -> bool:
    """True for an ``nn.Conv1d/2d/3d`` (exact type) with zero padding given as numbers."""
    return type(m) in _CLASSES and m.padding_mode == "zeros" and not isinstance(m.padding, str)


def native_applies(m: nn.Module) -> bool:
    """True for an ``nn.Conv2d`` (exact type) that :func:`applies` to, with ``groups == 1``, on any device: with
    cuDNN or oneDNN off already, it runs the same kernels as PyTorch's own convolution, its backward in two
    calls (a plan made with them on still applies). Where it can lower a peak is :func:`native_pays`."""
    return type(m) is nn.Conv2d and applies(m) and m.groups == 1


def native_pays(m: nn.Conv2d, inputs: tuple) -> bool:
    """Whether ``conv-native`` can lower a peak for ``m`` called on ``inputs`` (``(x, ...)``, ``x`` of shape
    ``[N, C_in, H, W]``), so that the profile measures it there. On CUDA, wherever cuDNN is on (its
    workspace depends on its algorithm, so it is measured). On the CPU, where oneDNN is on, the step computes
    in float32 (oneDNN also runs bfloat16 under autocast, which PyTorch's own CPU kernels are much slower at),
    and the im2col columns of the whole batch that PyTorch's own kernels hold (``N * C_in * kh * kw * H_out *
    W_out`` elements) are smaller than the weight, which oneDNN reorders at every call: a wide convolution on
    a small image. Elsewhere (a full-resolution layer: columns nine times the input for a 3x3 kernel) the
    native kernels cost more memory and time, and measuring them would only slow the profile down (2x for
    the test suite's models)."""
    x = inputs[0] if inputs else None
    if not isinstance(x, Tensor) or x.dim() != 4:
        return False
    if m.weight.is_cuda:
        return torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled
    if not (m.weight.device.type == "cpu" and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False  # PyTorch's own kernels run already: nothing to switch off
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
    if dtype != torch.float32:
        return False
    kh, kw = m.kernel_size
    out = [(size + 2 * p - d * (k - 1) - 1) // s + 1 for size, p, d, k, s in
           zip(x.shape[2:], m.padding, m.dilation, m.kernel_size, m.stride, strict=True)]
    columns = x.shape[0] * m.in_channels * kh * kw * out[0] * out[1]
    return columns < m.weight.numel()


def from_module(conv: nn.Module) -> nn.Module:
    """The split-backward variant of ``conv``, sharing its parameters. Raises ``TypeError`` if it does not
    apply (see :func:`applies`)."""
    if type(conv) not in _CLASSES:
        raise TypeError(f"no split-backward variant for {conv!r}")
    return _CLASSES[type(conv)].from_module(conv)  # checks the rest
