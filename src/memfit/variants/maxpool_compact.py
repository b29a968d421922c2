"""MaxPool2d that saves the argmax as a ``uint8`` offset inside the pooling window.

PyTorch's ``max_pool2d`` saves its *input* and the ``int64`` flat argmax indices for the backward
pass, although the backward only needs the indices (the input is used for its shape). Here the
backward keeps, per output element, the position of the maximum inside its window as one byte
(``kernel_h * kernel_w <= 256``) plus the input shape as plain Python ints: 1/8 of the int64
indices, and no input.

Forward: ``F.max_pool2d(..., return_indices=True)`` (PyTorch's kernel, so identical output and
tie-breaking), then the flat index ``idx = ih * W + iw`` of each output ``(oh, ow)`` becomes::

    h0 = oh * stride_h - pad_h,  w0 = ow * stride_w - pad_w         (window origin)
    offset = ((ih - h0) // dil_h) * kernel_w + (iw - w0) // dil_w     (in [0, kernel_h * kernel_w))

Backward inverts that (``ih = h0 + (offset // kernel_w) * dil_h``, ...) and calls PyTorch's own
``aten.max_pool2d_with_indices_backward`` with the rebuilt int64 indices, so the gradient, including
the accumulation order of overlapping windows (kernel 3 / stride 2, ResNet's stem), is bit-for-bit
PyTorch's. That kernel reads only the shape of its ``self`` argument, so a zero-stride expanded
scalar stands in for the input.

On the CPU both conversions are table lookups in NumPy, written into tensors PyTorch allocated (so its memory
accounting sees them): forward, ``r = idx - (h0 * W + w0)`` in place, then ``offset = table[r]`` (``r`` is
``dh * dil_h * W + dw * dil_w``, distinct for every in-window position when ``(kernel_w - 1) * dil_w < W``;
otherwise the arithmetic above); backward, ``idx = table[offset] + (h0 * W + w0)``. Without a division pass,
the forward on ``[16, 480, 16, 16]`` (kernel 3, stride 1) took 55 ms against 70 ms (PyTorch's own pooling
with indices: 51 ms), the backward 6.5 ms against 19 ms (PyTorch's: 6.8 ms), one thread.

Through channels-last (``maxpool-compact-cl``, the CPU only): PyTorch's CPU max-pooling kernel for contiguous
(NCHW) tensors runs one window at a time; its channels-last kernel vectorizes over channels. Each group of planes
``[g, H, W]`` is therefore copied into a channels-last ``[1, g, H, W]``, pooled there, and the output copied back
(the offsets are read straight off the channels-last indices). The same kernel family, so the same maxima, ties
and NaN positions (tests), and the same backward. One thread, forward (``benchmarks/maxpool_channels_last.py``):
GoogLeNet's inception branch pool on ``[16, 192, 16, 16]`` (3x3, stride 1) 4.4 ms against PyTorch's 14.3 ms, its
first pool on ``[16, 64, 64, 64]`` 11.3 against 24.0 ms, ResNet-50's stem 5.9 against 11.6 ms. The copies of a
group of planes stay in cache; unchunked, a whole ``[16, 480, 32, 32]`` input copied at once was slower than
PyTorch's kernel. The profile times it per node like any variant, and keeps its time where it is below PyTorch's.

Chunking: the int64 indices and the arithmetic on them take up to 24 bytes per output element at once
(6x a float32 output; on an H200 0.85 GB forward and 1.18 GB backward for ResNet-50's stem at batch 184).
For a contiguous input both passes therefore run over the ``N * C`` planes in groups of about
:data:`memfit.variants.relu_mask.CHUNK_ELEMENTS` output elements. Planes are pooled independently, so
values, tie-breaking and accumulation order are unchanged.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from memfit.variants.relu_mask import CHUNK_ELEMENTS, numpy_ok
from memfit.variants.single_backward import single_backward

__all__ = ["MaxPool2dCompact", "MaxPool2dCompactFn", "max_pool2d_compact", "window_bases"]


def window_bases(oh: int, ow: int, stride, padding, device) -> tuple[Tensor, Tensor]:
    """Per output position: the window origin ``(h0, w0)`` as ``[oh, 1]`` and ``[1, ow]`` int64 tensors."""
    h0 = torch.arange(oh, device=device, dtype=torch.int64).mul_(stride[0]).sub_(padding[0]).unsqueeze(1)
    w0 = torch.arange(ow, device=device, dtype=torch.int64).mul_(stride[1]).sub_(padding[1]).unsqueeze(0)
    return h0, w0


class MaxPool2dCompactFn(torch.autograd.Function):
    """``apply(x, kernel_size, stride, padding, dilation, ceil_mode, via_channels_last=False)`` with 2-tuples; ``x``
    is 4-D. ``via_channels_last``: pool a contiguous CPU input through channels-last copies (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, kernel_size, stride, padding, dilation, ceil_mode: bool,
                via_channels_last: bool = False) -> Tensor:
        kh, kw = kernel_size
        if kh * kw > 256:
            raise ValueError(f"kernel area {kh * kw} > 256 does not fit a uint8 offset")
        if not ctx.needs_input_grad[0]:  # no backward will run
            return F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode)
        args = (kernel_size, stride, padding, dilation, ceil_mode)
        cl = via_channels_last and x.device.type == "cpu" and x.is_contiguous()
        planes = _planes(x)
        if planes is None:
            src = x.contiguous(memory_format=torch.channels_last) if cl else x
            out, offset = _pool_offsets(src, *args)
            del src
            out, offset = out.contiguous(), offset.contiguous()
        else:  # a group of planes at a time
            n, (oh, ow) = planes.shape[0], _out_hw(x, *args)
            out = x.new_empty(x.shape[:2] + (oh, ow))
            offset = torch.empty(out.shape, dtype=torch.uint8, device=x.device)
            out_p, off_p = out.view(n, oh, ow), offset.view(n, oh, ow)
            for lo, hi in _groups(n, oh * ow, x.device):
                src = planes[lo:hi].unsqueeze(0).contiguous(memory_format=torch.channels_last) if cl else planes[lo:hi]
                o, off = _pool_offsets(src, *args)
                del src
                out_p[lo:hi] = o[0] if cl else o
                off_p[lo:hi] = off[0] if cl else off
                del o, off
        ctx.save_for_backward(offset)
        ctx.args = (kernel_size, stride, padding, dilation, ceil_mode)
        ctx.in_shape = x.shape
        return out

    @staticmethod
    @single_backward("maxpool-compact")
    def backward(ctx, grad: Tensor):
        (offset,) = ctx.saved_tensors
        n = ctx.in_shape[0] * ctx.in_shape[1]
        oh, ow = offset.shape[-2:]
        if not (grad.is_contiguous() and offset.is_contiguous()) or n * oh * ow <= _chunk(grad.device):
            return _pool_backward(grad, offset, ctx.in_shape, *ctx.args), None, None, None, None, None, None
        gx = grad.new_empty(ctx.in_shape)
        gx_p, g_p, off_p = gx.view(n, *ctx.in_shape[2:]), grad.reshape(n, oh, ow), offset.view(n, oh, ow)
        for lo, hi in _groups(n, oh * ow, grad.device):
            _pool_backward(g_p[lo:hi], off_p[lo:hi], (hi - lo, *ctx.in_shape[2:]), *ctx.args, out=gx_p[lo:hi])
        return gx, None, None, None, None, None, None


def _chunk(device: torch.device) -> int:
    return CHUNK_ELEMENTS.get(device.type, 1 << 22)


def _planes(x: Tensor) -> Tensor | None:
    """``x`` as ``[N * C, H, W]`` when grouping planes pays (contiguous, more output than one chunk), else
    ``None``."""
    if not x.is_contiguous() or x.numel() <= _chunk(x.device):
        return None
    return x.view(-1, *x.shape[-2:])


def _groups(planes: int, per_plane: int, device: torch.device):
    """``(lo, hi)`` plane ranges of about one chunk of output elements each (at least one plane)."""
    step = max(1, _chunk(device) // max(1, per_plane))
    return [(lo, min(planes, lo + step)) for lo in range(0, planes, step)]


def _out_hw(x: Tensor, kernel_size, stride, padding, dilation, ceil_mode) -> tuple[int, int]:
    """PyTorch's max-pool output height and width for ``x``."""
    probe = F.max_pool2d(x.new_empty((1, 1) + tuple(x.shape[-2:])), kernel_size, stride, padding, dilation,
                         ceil_mode)
    return probe.shape[-2], probe.shape[-1]


def _offset_table(kernel_size, dilation, W: int) -> np.ndarray | None:
    """``table[dh * dil_h * W + dw * dil_w] = dh * kernel_w + dw`` (uint8), or ``None`` where two in-window
    positions could share an ``r`` (a window wider than the input)."""
    (kh, kw), (dil_h, dil_w) = kernel_size, dilation
    if (kw - 1) * dil_w >= W:
        return None
    table = np.zeros((kh - 1) * dil_h * W + (kw - 1) * dil_w + 1, dtype=np.uint8)
    dh, dw = np.divmod(np.arange(kh * kw), kw)
    table[dh * dil_h * W + dw * dil_w] = np.arange(kh * kw)
    return table


def _pool_offsets(x: Tensor, kernel_size, stride, padding, dilation, ceil_mode) -> tuple[Tensor, Tensor]:
    """``(output, uint8 in-window offsets)`` of max pooling ``x`` (3-D or 4-D)."""
    kw = kernel_size[1]
    out, idx = F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode, return_indices=True)
    W = x.shape[-1]
    h0, w0 = window_bases(out.shape[-2], out.shape[-1], stride, padding, x.device)
    # channels-last indices (pooled through channels-last): NumPy reads them as [N, oh, ow, C], contiguous
    cl = idx.dim() == 4 and not idx.is_contiguous() and idx.is_contiguous(memory_format=torch.channels_last)
    flat = idx.permute(0, 2, 3, 1) if cl else idx
    table = _offset_table(kernel_size, dilation, W) if numpy_ok(flat) else None
    if table is not None:  # NumPy: r = idx - base in place, then a lookup into PyTorch's uint8 tensor
        offset = torch.empty_like(idx, dtype=torch.uint8)  # (laid out as idx)
        r = flat.numpy()
        base = (h0 * W + w0).numpy()
        np.subtract(r, base[..., None] if cl else base, out=r)
        # (every r is in range: "clip" avoids a buffer)
        np.take(table, r, out=(offset.permute(0, 2, 3, 1) if cl else offset).numpy(), mode="clip")
        return out, offset
    ih = torch.div(idx, W, rounding_mode="floor")
    iw = idx.sub_(ih * W)  # idx is ours: reuse its storage
    ih.sub_(h0)
    iw.sub_(w0)
    if dilation[0] != 1:
        ih.div_(dilation[0], rounding_mode="floor")
    if dilation[1] != 1:
        iw.div_(dilation[1], rounding_mode="floor")
    offset = ih.mul_(kw).add_(iw).to(torch.uint8)
    return out, offset


def _pool_backward(grad: Tensor, offset: Tensor, in_shape, kernel_size, stride, padding, dilation,
                   ceil_mode, out: Tensor | None = None) -> Tensor:
    """PyTorch's max-pool input gradient from ``grad`` and the uint8 offsets (3-D or 4-D), written into
    ``out`` when given."""
    kw = kernel_size[1]
    W = in_shape[-1]
    h0, w0 = window_bases(offset.shape[-2], offset.shape[-1], stride, padding, offset.device)
    # idx = (h0 + dh * dil_h) * W + (w0 + dw * dil_w)
    if numpy_ok(offset):  # NumPy: a lookup into PyTorch's int64 tensor, then the bases
        dh, dw = np.divmod(np.arange(kernel_size[0] * kw, dtype=np.int64), kw)
        idx = torch.empty(offset.shape, dtype=torch.int64)
        dst = idx.numpy()
        # (NumPy reads the uint8 offsets as intp: a chunk's 8 bytes per element, as the torch path's conversion)
        np.take(dh * (dilation[0] * W) + dw * dilation[1], offset.numpy(), out=dst, mode="clip")
        np.add(dst, (h0 * W + w0).numpy(), out=dst)
    else:
        off = offset.to(torch.int64)
        dh = torch.div(off, kw, rounding_mode="floor")
        dw = off.sub_(dh * kw)
        idx = dh.mul_(dilation[0] * W).add_(dw.mul_(dilation[1])).add_(h0 * W + w0)
        del dw
    shape_only = grad.new_zeros(()).expand(in_shape)
    args = (grad, shape_only, list(kernel_size), list(stride), list(padding), list(dilation), ceil_mode, idx)
    if out is not None:
        return torch.ops.aten.max_pool2d_with_indices_backward.grad_input(*args, grad_input=out)
    return torch.ops.aten.max_pool2d_with_indices_backward(*args)


def max_pool2d_compact(x: Tensor, kernel_size, stride=None, padding=0, dilation=1,
                       ceil_mode: bool = False, via_channels_last: bool = False) -> Tensor:
    """``F.max_pool2d`` (3-D ``[C, H, W]`` or 4-D input) saving uint8 in-window argmax offsets (one byte per output
    element); ``via_channels_last``: a contiguous CPU input is pooled through channels-last copies of groups of its
    planes (PyTorch's vectorized kernel; the same values, ties and gradients)."""
    k = _pair(kernel_size)
    s = k if (stride is None or (isinstance(stride, (list, tuple)) and len(stride) == 0)) else _pair(stride)
    p, d = _pair(padding), _pair(dilation)
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        # PyTorch lays a channels-last input's gradient out channels-last; the compact backward makes it
        # contiguous, and the layer before would then reduce in another order (and copy): PyTorch's own
        # pooling instead, which the profile measures (this variant then saves no less)
        return F.max_pool2d(x, k, s, p, d, bool(ceil_mode))
    if x.dim() == 3:
        return MaxPool2dCompactFn.apply(x.unsqueeze(0), k, s, p, d, bool(ceil_mode), via_channels_last).squeeze(0)
    return MaxPool2dCompactFn.apply(x, k, s, p, d, bool(ceil_mode), via_channels_last)


torch.fx.wrap("max_pool2d_compact")


class MaxPool2dCompact(nn.MaxPool2d):
    """Drop-in ``nn.MaxPool2d`` (a subclass) saving uint8 argmax offsets; ``return_indices`` must be False.
    ``via_channels_last``: pool contiguous CPU inputs through channels-last copies (``maxpool-compact-cl``)."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices: bool = False,
                 ceil_mode: bool = False, via_channels_last: bool = False) -> None:
        if return_indices:
            raise ValueError("MaxPool2dCompact does not return indices; use nn.MaxPool2d")
        super().__init__(kernel_size, stride, padding, dilation, False, ceil_mode)
        self.via_channels_last = via_channels_last
        kh, kw = _pair(self.kernel_size)
        if kh * kw > 256:
            raise ValueError(f"kernel area {kh * kw} > 256 does not fit a uint8 offset")

    def forward(self, input: Tensor) -> Tensor:
        return max_pool2d_compact(input, self.kernel_size, self.stride, self.padding, self.dilation,
                                  self.ceil_mode, self.via_channels_last)

    @classmethod
    def from_module(cls, m: nn.MaxPool2d) -> MaxPool2dCompact:
        return cls(m.kernel_size, m.stride, m.padding, m.dilation, m.return_indices, m.ceil_mode)

    @classmethod
    def from_module_via_channels_last(cls, m: nn.MaxPool2d) -> MaxPool2dCompact:
        """``maxpool-compact-cl``: as :meth:`from_module`, pooling through channels-last copies."""
        return cls(m.kernel_size, m.stride, m.padding, m.dilation, m.return_indices, m.ceil_mode, True)
