"""ReLU-family activations whose backward keeps a 1-bit mask instead of a full tensor.

PyTorch's ``ReLU`` / ``LeakyReLU`` / ``Hardtanh`` / ``ReLU6`` save their input or output (2 or 4 bytes
per element) for the backward pass, yet the backward only needs one bit per element: "does the
gradient pass through here or not" (MONeT, Shah et al., ICLR 2021, section 4). The functions here save
that bit, packed 8 per byte in a ``uint8`` tensor: 1/32 of a float32 activation, 1/16 of a bf16 one.

Each backward calls the same ATen kernel as PyTorch (``threshold_backward``, ``leaky_relu_backward``)
on the unpacked mask a chunk at a time (``torch.where`` where a tensor cannot be chunked), so gradients are
bit-for-bit PyTorch's, and the forward *is* PyTorch's op.
Boundary conventions (checked against torch, reproduced exactly):

* ``relu``: gradient passes iff ``not (x <= 0)``: 0 at ``x == 0`` and ``x == -0.0``, passes at NaN.
* ``leaky_relu``: ``grad`` iff ``x > 0``, else ``grad * negative_slope`` (also at 0 and NaN).
* ``hardtanh`` / ``relu6``: gradient passes iff ``min_val < x < max_val``: 0 at exactly ``min_val``
  and ``max_val``; for half/bf16 the comparison is in float32, as in torch's kernel (the mask is
  computed by ``aten.hardtanh_backward`` itself). In-place: torch decides on the original input (its
  ``hardtanh_`` autograd keeps a full copy of it!); so does this one. NaN inputs: torch's CPU
  ``hardtanh_backward`` is itself inconsistent (its vectorised loop gives 0, its scalar loop -- strided
  tensors and the last ``numel % vector_width`` elements of contiguous ones -- passes the gradient),
  so no mask can match it everywhere; here NaN always gives 0, like torch's vectorised path.

``inplace=True`` writes the result into the input, like ``nn.ReLU(inplace=True)`` (the input is
marked dirty, so autograd's version checks and view handling behave as for PyTorch's in-place op).
The mask is computed from the input before it is overwritten, so in-place ``leaky_relu`` also works
with a negative slope (PyTorch refuses that case in its backward).

Packing (:func:`pack_mask`): the boolean mask is laid out in the input's logical (row-major) order,
padded with zeros to a multiple of 8 elements. On the CPU, NumPy's ``packbits`` / ``unpackbits``
(``bitorder="little"``) do the work, writing into torch-allocated tensors; they are about 10x faster than
torch ops (``[32, 96, 64, 64]``, one thread: 0.5 ms against 5.6 to pack, 0.6 against 5.4 to unpack), and
for float32 and float64 inputs NumPy's comparisons make the mask too (ReLU's forward with the mask 5.6 ms
instead of 8.5, ReLU6's 6.8 instead of 14.4; ``benchmarks/mask_backward.py``). Elsewhere (CUDA) each group of
8 bytes (one ``int64`` word, little-endian) is folded into one byte with three shift-or steps, and
:func:`unpack_mask` is the inverse; a portable (slower) multiply-and-sum path is used on big-endian hosts.

Chunking: packing a whole tensor at once allocates 3 bytes per element of temporaries (the boolean mask
and two shifted words), 3/4 of a float32 activation; unpacking, 1 byte per element (measured on the CPU:
24 and 8 MiB for a 32 MiB activation; on an H200 425 MB for a 590 MB one), and the kernel reads the mask in
the gradient's dtype (4 more for float32). For contiguous tensors the mask is therefore made, packed and
unpacked :data:`CHUNK_ELEMENTS` elements at a time, so these temporaries stay a few MiB whatever the
activation's size; the values are unchanged (each element's bit depends on that element only).

All functions are ``once_differentiable`` (no double backward).
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch
import torch.fx
from torch import Tensor, nn

from memfit.variants.single_backward import single_backward

__all__ = [
    "CHUNK_ELEMENTS",
    "HardtanhMask",
    "LeakyReLUMask",
    "MaskedActivationFn",
    "ReLU6Mask",
    "ReLUMask",
    "hardtanh_mask",
    "leaky_relu_mask",
    "pack_mask",
    "relu6_mask",
    "relu_mask",
    "unpack_mask",
]

_LITTLE = sys.byteorder == "little"
_FOLD = 0x0101010101010101  # one set bit at the bottom of each byte of an int64 word

#: elements packed or unpacked at once, per device type (multiples of 8): on the CPU 2^18 (temporaries of
#: at most 768 KiB packing, 1.25 MiB unpacking float32), on CUDA 2^22 (12 and 20 MiB; fewer kernel launches)
CHUNK_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 22}


def _chunk(t: Tensor) -> int:
    return CHUNK_ELEMENTS.get(t.device.type, 1 << 22)


def packed_mask_of(src: Tensor, mask_fn, np_mask_fn=None) -> Tensor:
    """``pack_mask(mask_fn(src))``, made in chunks of :data:`CHUNK_ELEMENTS` elements when ``src`` is
    contiguous, so the boolean mask and the packing's temporaries never exist for the whole tensor.

    Args:
        src: the tensor the mask is computed from (any shape, dtype).
        mask_fn: elementwise ``mask_fn(t) -> bool Tensor`` of ``t``'s shape.
        np_mask_fn: the same mask as ``mask_fn`` on a NumPy array (float32 or float64), or ``None``; used for
            contiguous CPU tensors of those dtypes, chunk by chunk.

    Returns:
        1-D ``uint8`` tensor of ``ceil(src.numel() / 8)`` bytes, as :func:`pack_mask`.
    """
    n, chunk = src.numel(), _chunk(src)
    if np_mask_fn is not None and src.dtype in (torch.float32, torch.float64) and numpy_ok(src):
        flat = src.detach().view(-1).numpy()
        out = torch.empty((n + 7) // 8, dtype=torch.uint8)
        dst = out.numpy()
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            dst[lo // 8:(hi + 7) // 8] = np.packbits(np_mask_fn(flat[lo:hi]), bitorder="little")
        return out
    if n <= chunk or not src.is_contiguous():
        return pack_mask(mask_fn(src))
    flat = src.view(-1)
    out = torch.empty((n + 7) // 8, dtype=torch.uint8, device=src.device)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        out[lo // 8:(hi + 7) // 8] = pack_mask(mask_fn(flat[lo:hi]))
    return out


def numpy_ok(t: Tensor) -> bool:
    """Whether NumPy can read ``t`` in place: a plain contiguous CPU tensor (not a subclass such as a fake
    or functional tensor, whose data NumPy cannot see)."""
    return type(t) is Tensor and t.device.type == "cpu" and t.is_contiguous() and not t.is_neg()


def pack_mask(mask: Tensor) -> Tensor:
    """Pack a boolean tensor (any shape / strides) into ``uint8``, 8 elements per byte.

    Element ``i`` of ``mask.reshape(-1)`` becomes bit ``i % 8`` of byte ``i // 8``; the last byte is
    zero-padded. Returns a 1-D contiguous ``uint8`` tensor of ``ceil(numel / 8)`` elements.
    """
    flat = mask.reshape(-1)
    if flat.dtype != torch.bool:
        flat = flat.ne(0)
    if numpy_ok(flat):  # NumPy's packbits, a chunk at a time (its temporaries stay a chunk's eighth)
        n, chunk = flat.numel(), _chunk(flat)
        out = torch.empty((n + 7) // 8, dtype=torch.uint8)
        src, dst = flat.detach().numpy(), out.numpy()
        for lo in range(0, n, chunk):
            dst[lo // 8:(min(n, lo + chunk) + 7) // 8] = np.packbits(src[lo:lo + chunk], bitorder="little")
        return out
    return _pack_torch(flat)


def _pack_torch(flat: Tensor) -> Tensor:
    """:func:`pack_mask` of a 1-D bool tensor by torch ops (for CUDA, where NumPy cannot reach)."""
    n = flat.numel()
    if n % 8:
        flat = torch.cat([flat, flat.new_zeros(8 - n % 8)])
    elif not flat.is_contiguous() or flat.storage_offset() % 8:
        flat = flat.clone()
    if _LITTLE:
        v = flat.view(torch.uint8).view(torch.int64)  # 8 bytes (each 0 or 1) per word
        v = v.bitwise_or(v >> 7)  # byte j: bits 0..1 = b_j, b_{j+1}
        v.bitwise_or_(v >> 14)  # bits 0..3
        v.bitwise_or_(v >> 28)  # bits 0..7 of byte 0 = b_0 .. b_7
        return v.to(torch.uint8)  # keep the low byte (conversion wraps modulo 256)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=flat.device)
    return (flat.view(torch.uint8).view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def unpack_mask(packed: Tensor, numel: int) -> Tensor:
    """Inverse of :func:`pack_mask`: a 1-D ``uint8`` tensor of ``numel`` zeros and ones."""
    if numpy_ok(packed):  # NumPy's unpackbits into a torch tensor, a chunk at a time
        out, chunk = torch.empty(numel, dtype=torch.uint8), _chunk(packed)
        src, dst = packed.detach().numpy(), out.numpy()
        for lo in range(0, numel, chunk):
            hi = min(numel, lo + chunk)
            dst[lo:hi] = np.unpackbits(src[lo // 8:(hi + 7) // 8], count=hi - lo, bitorder="little")
        return out
    return _unpack_torch(packed, numel)


def _unpack_torch(packed: Tensor, numel: int) -> Tensor:
    """:func:`unpack_mask` by torch ops (for CUDA, where NumPy cannot reach)."""
    if _LITTLE:
        v = packed.to(torch.int64)
        v = v.bitwise_or(v << 28)
        v.bitwise_or_(v << 14)
        v.bitwise_or_(v << 7)  # bit j of the byte now sits at bit 8*j (and stray copies elsewhere)
        v.bitwise_and_(_FOLD)
        out = v.view(torch.uint8)
    else:
        shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
        out = packed.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1).reshape(-1)
    return out[:numel]


_KINDS = ("relu", "leaky_relu", "hardtanh")


class MaskedActivationFn(torch.autograd.Function):
    """``torch.autograd.Function`` behind all the mask activations.

    ``apply(x, kind, a, b, inplace)``: ``kind`` is ``"relu"`` (``a``, ``b`` unused), ``"leaky_relu"``
    (``a`` = negative slope) or ``"hardtanh"`` (``a`` = min, ``b`` = max). Saves only the packed mask
    (``ceil(numel / 8)`` bytes) through ``ctx.save_for_backward``, so saved-tensor hooks see it.
    """

    @staticmethod
    def forward(ctx, x: Tensor, kind: str, a: float, b: float, inplace: bool) -> Tensor:
        if not ctx.needs_input_grad[0]:  # no backward will run: plain torch op, nothing packed
            fn = {"relu": lambda: torch.relu_(x) if inplace else torch.relu(x),
                  "leaky_relu": lambda: torch.nn.functional.leaky_relu(x, a, inplace),
                  "hardtanh": lambda: torch.nn.functional.hardtanh(x, a, b, inplace)}.get(kind)
            if fn is None:
                raise ValueError(f"unknown activation kind {kind!r}; expected one of {_KINDS}")
            out = fn()
            if inplace:
                ctx.mark_dirty(x)
            return out
        if kind == "relu":
            if inplace:
                out = torch.relu_(x)
            else:
                out = torch.relu(x)
            # == not (out <= 0): out is >= 0, -0.0 or NaN
            packed = packed_mask_of(out, Tensor.bool, lambda t: t != 0)
        elif kind == "leaky_relu":
            packed = packed_mask_of(x, lambda t: t > 0, lambda t: t > 0)
            if inplace:
                out = torch.nn.functional.leaky_relu_(x, a)
            else:
                out = torch.nn.functional.leaky_relu(x, a)
        elif kind == "hardtanh":
            # Ask PyTorch's own backward kernel which elements pass (it compares in float for
            # half/bf16, which a plain ``x <= min_val`` on a bf16 tensor need not do). Torch decides on
            # the input in both the out-of-place and the in-place op (for ``hardtanh_`` autograd keeps a
            # full copy of the original input), so the mask is taken before ``x`` is overwritten.
            def passes(t: Tensor) -> Tensor:  # NaN -> 0 everywhere (torch: 0 on its vectorised path only)
                return torch.ops.aten.hardtanh_backward(t.new_ones(()).expand(t.shape), _nan_below(t), a, b).bool()

            def np_passes(t):  # the bounds rounded to t's dtype, as torch's kernel does; NaN -> 0
                lo, hi = t.dtype.type(a), t.dtype.type(b)
                return np.logical_and(t > lo, t < hi)

            packed = packed_mask_of(x, passes, np_passes)
            if inplace:
                out = torch.nn.functional.hardtanh_(x, a, b)
            else:
                out = torch.nn.functional.hardtanh(x, a, b)
        else:
            raise ValueError(f"unknown activation kind {kind!r}; expected one of {_KINDS}")
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(packed)
        ctx.kind, ctx.a, ctx.shape, ctx.numel, ctx.stride = kind, a, x.shape, x.numel(), out.stride()
        return out

    @staticmethod
    @single_backward("relu-mask")
    def backward(ctx, grad: Tensor):
        (packed,) = ctx.saved_tensors
        n, chunk = ctx.numel, _chunk(grad)
        # the layout PyTorch's own backward gives its result, from the gradient's and the saved tensor's
        # strides: the next backward reduces over it (a convolution's bias gradient), so another layout
        # sums in another order (seen: 4e-9 on a bias, behind a chunk/cat mix of channels)
        stride = _backward_stride(ctx.kind, grad, ctx.shape, ctx.stride)
        if n > chunk and grad.is_contiguous() and stride == grad.stride():  # a chunk at a time into the result
            gx = torch.empty_like(grad, memory_format=torch.contiguous_format)
            gflat, oflat = grad.view(-1), gx.view(-1)
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                _by_kernel(unpack_mask(packed[lo // 8:(hi + 7) // 8], hi - lo), gflat[lo:hi], ctx.kind, ctx.a,
                           oflat[lo:hi])
            return gx, None, None, None, None
        m = unpack_mask(packed, n).view(ctx.shape)
        gx = torch.empty_strided(ctx.shape, stride, dtype=grad.dtype, device=grad.device)
        if n <= chunk:
            return _by_kernel(m, grad, ctx.kind, ctx.a, gx), None, None, None, None
        # one byte per element (0/1 read as bool), in the logical order of the input: a quarter of the mask in
        # grad's dtype that the kernel would read, which would be the backward's largest temporary
        return _masked(m.view(torch.bool), grad, ctx.kind, ctx.a, gx), None, None, None, None


def _nan_below(t: Tensor) -> Tensor:
    """``t`` with NaN replaced by ``-inf`` (infinities and finite values unchanged), so a kernel's comparisons
    put NaN below every bound on its vectorised and its scalar path alike. With it, PyTorch's float
    ``hardtanh_backward`` of ones then ``bool()`` make the hardtanh mask 3x faster than with a bool-valued
    comparison (``t.eq(t)``: 0.5 ns an element on the CPU, one thread, against 0.1 for a float kernel), with
    the same values in float32, float64, bfloat16 and float16: ReLU6's forward with the mask on
    ``[32, 96, 64, 64]`` took 14.4 ms instead of 24 (``benchmarks/mask_backward.py``)."""
    return torch.nan_to_num(t, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def _backward_stride(kind: str, grad: Tensor, shape, stride) -> tuple[int, ...]:
    """Strides of the result of PyTorch's backward kernel for ``kind`` given ``grad`` and a saved tensor of
    ``shape`` and ``stride``. Each kernel is an element-wise TensorIterator op, whose result layout follows
    its operands in their order: ``(saved, grad)`` for ``threshold_backward`` and ``leaky_relu_backward``,
    ``(grad, saved)`` for ``hardtanh_backward``. A meta-device addition of the operands in that order gives the
    same layout (checked on every permutation and broadcast of 1- to 4-D operands on the CPU, in float32,
    bfloat16 and float16, ignoring size-1 dimensions). The meta tensors are float32 whatever ``grad``'s dtype:
    in bfloat16 or float16 they disagree with the CPU where an operand is broadcast, and so do the kernels'
    own meta functions."""
    return _layout(kind == "hardtanh", tuple(grad.shape), grad.stride(), tuple(shape), tuple(stride))


@functools.lru_cache(maxsize=4096)
def _layout(grad_first: bool, grad_shape, grad_stride, shape, stride) -> tuple[int, ...]:
    # (cached: the meta-device addition takes 0.17 ms on the CPU, 15 times a small mask's whole backward)
    meta = {"device": "meta", "dtype": torch.float32}
    g, saved = torch.empty_strided(grad_shape, grad_stride, **meta), torch.empty_strided(shape, stride, **meta)
    return (torch.add(g, saved) if grad_first else torch.add(saved, g)).stride()


def _by_kernel(m: Tensor, grad: Tensor, kind: str, slope: float, out: Tensor) -> Tensor:
    """The activation's input gradient, written into ``out``, from its unpacked mask ``m`` (``uint8`` zeros and
    ones, ``grad``'s shape): PyTorch's own backward kernel reading the mask in ``grad``'s dtype as the saved
    tensor (``threshold_backward``: 0 where the mask is 0, else ``grad``; ``leaky_relu_backward``: ``grad``
    where it is 1, else ``grad * slope``), so the values are that kernel's bit for bit. It makes a temporary of
    ``m``'s size in ``grad``'s dtype, so it is called a chunk at a time. Six times faster than
    ``torch.where`` on the CPU: for ``[32, 96, 64, 64]`` float32 (MobileNet-V2's widest ReLU6), one thread,
    9 ms against 60 ms, PyTorch's own backward 6 ms."""
    saved = m.to(grad.dtype)
    if kind == "leaky_relu":
        return torch.ops.aten.leaky_relu_backward.grad_input(grad, saved, slope, False, grad_input=out)
    return torch.ops.aten.threshold_backward.grad_input(grad, saved, 0.5, grad_input=out)


def _masked(m: Tensor, grad: Tensor, kind: str, slope: float, out: Tensor | None = None) -> Tensor:
    """The activation's input gradient from its unpacked mask ``m`` (bool, ``grad``'s shape), by ``torch.where``
    (no temporary beyond ``m``; slower than :func:`_by_kernel`)."""
    if kind == "leaky_relu":  # as aten.leaky_relu_backward: x > 0 ? g : g * slope
        gx = torch.mul(grad, slope, out=out) if out is not None else grad.mul(slope)
        return torch.where(m, grad, gx, out=gx)
    if out is not None:
        return torch.where(m, grad, torch.zeros((), dtype=grad.dtype), out=out)
    return torch.where(m, grad, 0)  # as aten.threshold_backward: 0 or g


def relu_mask(x: Tensor, inplace: bool = False) -> Tensor:
    """``torch.relu`` with a 1-bit saved mask."""
    return MaskedActivationFn.apply(x, "relu", 0.0, 0.0, inplace)


def leaky_relu_mask(x: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    """``F.leaky_relu`` with a 1-bit saved mask."""
    return MaskedActivationFn.apply(x, "leaky_relu", float(negative_slope), 0.0, inplace)


def hardtanh_mask(x: Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False) -> Tensor:
    """``F.hardtanh`` with a 1-bit saved mask."""
    return MaskedActivationFn.apply(x, "hardtanh", float(min_val), float(max_val), inplace)


def relu6_mask(x: Tensor, inplace: bool = False) -> Tensor:
    """``F.relu6`` (= ``hardtanh(x, 0, 6)`` in torch) with a 1-bit saved mask."""
    return MaskedActivationFn.apply(x, "hardtanh", 0.0, 6.0, inplace)


# torch.fx.symbolic_trace records these as single call_function nodes instead of tracing into them.
for _name in ("relu_mask", "leaky_relu_mask", "hardtanh_mask"):
    torch.fx.wrap(_name)


class ReLUMask(nn.ReLU):
    """Drop-in ``nn.ReLU`` (a subclass) whose backward saves a 1-bit mask."""

    def forward(self, input: Tensor) -> Tensor:
        return relu_mask(input, self.inplace)

    @classmethod
    def from_module(cls, m: nn.ReLU) -> ReLUMask:
        return cls(inplace=m.inplace)


class LeakyReLUMask(nn.LeakyReLU):
    """Drop-in ``nn.LeakyReLU`` (a subclass) whose backward saves a 1-bit mask."""

    def forward(self, input: Tensor) -> Tensor:
        return leaky_relu_mask(input, self.negative_slope, self.inplace)

    @classmethod
    def from_module(cls, m: nn.LeakyReLU) -> LeakyReLUMask:
        return cls(negative_slope=m.negative_slope, inplace=m.inplace)


class HardtanhMask(nn.Hardtanh):
    """Drop-in ``nn.Hardtanh`` (a subclass) whose backward saves a 1-bit mask."""

    def forward(self, input: Tensor) -> Tensor:
        return hardtanh_mask(input, self.min_val, self.max_val, self.inplace)

    @classmethod
    def from_module(cls, m: nn.Hardtanh) -> HardtanhMask:
        return cls(min_val=m.min_val, max_val=m.max_val, inplace=m.inplace)


class ReLU6Mask(nn.ReLU6):
    """Drop-in ``nn.ReLU6`` (a subclass) whose backward saves a 1-bit mask."""

    def forward(self, input: Tensor) -> Tensor:
        return hardtanh_mask(input, 0.0, 6.0, self.inplace)

    @classmethod
    def from_module(cls, m: nn.ReLU6) -> ReLU6Mask:
        return cls(inplace=m.inplace)
