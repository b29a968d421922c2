"""A chain of spatially local layers run in horizontal stripes (row tiles), forward and backward.

Where a network's peak is the backward pass of its widest full-resolution convolutions (VGG-16's first
two blocks), no schedule of PyTorch's own kernels can go lower: the backward of one 3x3 convolution holds
its input, its output's gradient and its input's gradient at full resolution, whatever is recomputed or
offloaded. Running a *chain* of such layers (convolutions, pointwise activations, max-pooling) one stripe
of rows at a time removes those full-resolution tensors altogether: the forward pass computes the chain's
output stripe by stripe without keeping anything but the chain's input; the backward pass recomputes
each stripe (with the halo of rows its receptive field needs) and back-propagates the matching stripe of
the output gradient through it, adding up the weight gradients and the input-gradient stripes. Only the
chain's input, its output, their gradients and one stripe's working set are ever alive.

This is spatial tiling of a checkpointed segment, the idea behind split-CNN (Jin et al., "Split-CNN:
Splitting Window-based Operations in Convolutional Neural Networks for Memory System Optimization",
ASPLOS 2019). Tensor shapes: the chain's input is ``[N, C, H, W]``; a stripe of output rows ``[lo, hi)``
reads input rows ``[a, b)`` (:func:`stripe_rows`). The sums over
stripes are exact in real arithmetic (the output gradient is the sum of its stripes, and the
back-propagation is linear in it); in floating point, the weight gradients are summed in a different
order than PyTorch's one-call kernel, so they equal PyTorch's to float rounding, not bit for bit.

What a chain may hold (checked by :func:`chain_layer_ok`): ``Conv2d`` with ``padding_mode="zeros"`` and
numeric, ``"valid"`` or symmetric ``"same"`` padding, ``MaxPool2d`` without ``ceil_mode`` or
``return_indices``, and pointwise activations (``ReLU``, ``LeakyReLU``, ``ReLU6``, ``Hardtanh``,
``SiLU``, ``GELU``, ``Sigmoid``, ``Tanh``, ``Identity``; :mod:`memfit.graph.tiling` also turns their
functional forms, ``F.relu(x)``, ``x.relu()``, ``F.max_pool2d(x, 2)``..., into such modules). BatchNorm in
training mode is not row-local (its statistics span the whole tensor), nor is dropout (its random mask would change with
the stripes), so they end a chain.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from memfit.graph.attributes import has_own_hooks
from memfit.variants.single_backward import single_backward
from memfit.variants.versions import raise_if_changed, versions

__all__ = ["TiledChain", "TiledChainFn", "chain_layer_ok", "stripe_rows"]

_POINTWISE = (nn.ReLU, nn.LeakyReLU, nn.ReLU6, nn.Hardtanh, nn.SiLU, nn.GELU, nn.Sigmoid, nn.Tanh,
              nn.Identity)


def _same_padding(m: nn.Conv2d) -> tuple[int, int] | None:
    """The zero padding ``padding="same"`` amounts to, per side, or ``None`` where it pads one side more than
    the other (an odd ``dilation * (kernel - 1)``, as for even kernels)."""
    pads = []
    for k, d in zip(m.kernel_size, m.dilation, strict=True):
        total = d * (k - 1)
        if total % 2:
            return None
        pads.append(total // 2)
    return pads[0], pads[1]


def _padding(m: nn.Conv2d | nn.MaxPool2d) -> tuple[int, int]:
    if isinstance(m, nn.Conv2d) and isinstance(m.padding, str):
        return (0, 0) if m.padding == "valid" else _same_padding(m)  # (chain_layer_ok refused the rest)
    return _pair(m.padding)


def chain_layer_ok(m: nn.Module) -> bool:
    """``m`` computes each output row from a fixed window of input rows, with no state and no randomness,
    so a chain of such layers can run stripe by stripe: see the module docstring for the list. A layer with a
    hook is not (the stripes call no module, so the hook would not run)."""
    if has_own_hooks(m):
        return False
    if type(m) is nn.Conv2d:
        return m.padding_mode == "zeros" and (m.padding != "same" or _same_padding(m) is not None)
    if type(m) is nn.MaxPool2d:
        return not m.ceil_mode and not m.return_indices
    return type(m) in _POINTWISE


@dataclass(frozen=True)
class _Window:
    """Rows of a layer's input that output rows ``[lo, hi)`` read: ``kernel``, ``stride``, ``padding``,
    ``dilation`` along the height (1, 1, 0, 1 for pointwise layers)."""

    kernel: int = 1
    stride: int = 1
    padding: int = 0
    dilation: int = 1

    def rows(self, lo: int, hi: int) -> tuple[int, int]:
        """Input rows ``[a, b)`` (before clamping to the tensor; negative or past-the-end rows are padding)."""
        return lo * self.stride - self.padding, (hi - 1) * self.stride - self.padding + self.dilation * (self.kernel - 1) + 1


def _window(m: nn.Module) -> _Window:
    if isinstance(m, nn.Conv2d | nn.MaxPool2d):
        k, s, d = (_pair(getattr(m, a))[0] for a in ("kernel_size", "stride", "dilation"))
        return _Window(k, s, _padding(m)[0], d)
    return _Window()


def _pointwise(m: nn.Module, x: Tensor, inplace: bool) -> Tensor:
    """Pointwise layer ``m`` on ``x``, written into ``x`` only if ``inplace`` (whatever ``m.inplace`` says:
    the chain decides when its own buffers may be overwritten)."""
    if isinstance(m, nn.ReLU):
        return F.relu(x, inplace=inplace)
    if isinstance(m, nn.LeakyReLU):
        return F.leaky_relu(x, m.negative_slope, inplace=inplace)
    if isinstance(m, nn.Hardtanh):  # ReLU6 included
        return F.hardtanh(x, m.min_val, m.max_val, inplace=inplace)
    if isinstance(m, nn.SiLU):
        return F.silu(x, inplace=inplace)
    if isinstance(m, nn.GELU):
        return F.gelu(x, approximate=m.approximate)
    return m(x)


def _run_rows(m: nn.Module, x: Tensor, x_lo: int, height: int, lo: int, hi: int, inplace: bool,
              swap: dict[int, Tensor]) -> Tensor:
    """Output rows ``[lo, hi)`` of layer ``m`` from ``x``, which holds its input's rows ``[x_lo, x_lo +
    x.shape[2])`` of ``height``; the rows past the input's edges are the layer's own padding. A pointwise
    layer overwrites ``x`` if ``inplace``; ``swap`` maps ``id(parameter)`` to the tensor to use for it."""
    if not isinstance(m, nn.Conv2d | nn.MaxPool2d):
        return _pointwise(m, x, inplace)
    w = _window(m)
    a, b = w.rows(lo, hi)
    top, bottom = max(0, -a), max(0, b - height)
    x = x[:, :, max(a, 0) - x_lo: min(b, height) - x_lo]
    if top or bottom:
        x = F.pad(x, (0, 0, top, bottom), value=0.0 if isinstance(m, nn.Conv2d) else float("-inf"))
    pw = _padding(m)[1]
    if isinstance(m, nn.Conv2d):
        bias = None if m.bias is None else swap.get(id(m.bias), m.bias)
        return F.conv2d(x, swap.get(id(m.weight), m.weight), bias, m.stride, (0, pw), m.dilation, m.groups)
    return F.max_pool2d(x, m.kernel_size, m.stride, (0, pw), m.dilation)


def _heights(layers: Sequence[nn.Module], height: int) -> list[int]:
    """Input height of each layer, then the chain's output height."""
    out = [height]
    for m in layers:
        w = _window(m)
        out.append((out[-1] + 2 * w.padding - w.dilation * (w.kernel - 1) - 1) // w.stride + 1)
    return out


def stripe_rows(layers: Sequence[nn.Module], height: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """Rows ``[a, b)`` each layer's input must hold (clamped to the tensor) for output rows ``[lo, hi)``
    of the whole chain, then ``(lo, hi)`` itself: ``len(layers) + 1`` pairs."""
    heights = _heights(layers, height)
    ranges = [(lo, hi)]
    for m, h in zip(reversed(layers), reversed(heights[:-1]), strict=True):
        a, b = _window(m).rows(*ranges[0])
        ranges.insert(0, (max(a, 0), min(b, h)))
    return ranges


def _stripe(layers: Sequence[nn.Module], x: Tensor, ranges: list[tuple[int, int]], heights: list[int],
            inplace: bool, swap: dict[int, Tensor] | None = None) -> Tensor:
    """The chain's output rows ``ranges[-1]`` from ``x`` (input rows ``ranges[0]``). Pointwise layers
    overwrite their input if ``inplace`` and it is not ``x``, the caller's tensor (which an ``Identity``
    passes on)."""
    given = x
    for i, m in enumerate(layers):
        x = _run_rows(m, x, ranges[i][0], heights[i], *ranges[i + 1], inplace=inplace and x is not given,
                      swap=swap or {})
    return x


def _params(layers: Sequence[nn.Module]) -> list[Tensor]:
    """The layers' parameters, each once (a layer may appear twice in a chain)."""
    return list({id(p): p for m in layers for p in m.parameters()}.values())


def _bounds(height: int, stripes: int) -> list[tuple[int, int]]:
    stripes = max(1, min(stripes, height))
    cuts = [round(i * height / stripes) for i in range(stripes + 1)]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


class TiledChainFn(torch.autograd.Function):
    """``apply(layers, stripes, x, *params) -> y``: the chain ``layers`` (a tuple of modules passing
    :func:`chain_layer_ok`) on ``x`` (``[N, C, H, W]``) computed in ``stripes`` stripes of output rows.
    ``params`` are the layers' parameters, listed so that autograd returns their gradients. Saves ``x``
    only. Returns ``[N, C_out, H_out, W_out]``, the same as running the layers in turn (to float rounding).
    """

    @staticmethod
    def forward(ctx, layers, stripes, x, *params):
        if x.dim() != 4:
            raise ValueError(f"a tiled chain takes [N, C, H, W] inputs, got shape {list(x.shape)}")
        heights = _heights(layers, x.shape[2])
        out = None
        with torch.no_grad():
            for lo, hi in _bounds(heights[-1], stripes):
                ranges = stripe_rows(layers, x.shape[2], lo, hi)
                y = _stripe(layers, x[:, :, ranges[0][0]: ranges[0][1]], ranges, heights, True)
                if out is None:
                    out = y.new_empty((*y.shape[:2], heights[-1], y.shape[3]))
                out[:, :, lo:hi] = y
                del y
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.layers, ctx.stripes, ctx.heights = layers, stripes, heights
        # (the backward pass computes the chain again from the parameters: one changed since, a weight plain
        # PyTorch would refuse or a bias it would not need, gave gradients of neither value)
        ctx.versions = versions(params)
        # (and from the parameter objects the forward pass read: torch.func.functional_call puts the modules' own
        # back when its call returns, before the backward pass; a fresh user's gradients were 1e-2 off)
        ctx.params = params
        ctx.save_for_backward(x)
        return out

    @staticmethod
    @single_backward("tiled-chain")
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        raise_if_changed(ctx.versions, "a chain computed in row stripes (tiled-chain)")
        layers, heights = ctx.layers, ctx.heights
        params = ctx.params
        # each stripe back-propagates into leaf aliases of the parameters whose .grad is the running sum:
        # autograd adds each stripe's gradient into it in place as soon as it is made, so no parameter's
        # gradient is held twice (torch.autograd.grad would return all of a stripe's gradients at once)
        leaves = [p.detach().requires_grad_(ctx.needs_input_grad[3 + i]) for i, p in enumerate(params)]
        swap = {id(p): leaf for p, leaf in zip(_params(layers), leaves, strict=True)}  # (the layers' own now)
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[2] else None
        device, on, dtype = ctx.autocast
        for lo, hi in _bounds(heights[-1], ctx.stripes):
            if grad_x is None and not wanted:
                break
            ranges = stripe_rows(layers, x.shape[2], lo, hi)
            xs = x[:, :, ranges[0][0]: ranges[0][1]].detach().requires_grad_(grad_x is not None)
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=on):
                y = _stripe(layers, xs, ranges, heights, False, swap)
            torch.autograd.backward(y, grad_out[:, :, lo:hi], inputs=([xs] if grad_x is not None else []) + wanted)
            del y
            if grad_x is not None:
                grad_x[:, :, ranges[0][0]: ranges[0][1]] += xs.grad
            del xs
        return (None, None, grad_x, *(leaf.grad if leaf.requires_grad else None for leaf in leaves))


class TiledChain(nn.Module):
    """The layers of a chain (see :func:`chain_layer_ok`) run ``stripes`` row stripes at a time.

    The layers are the model's own module objects, registered here again (``layers``, an ``nn.ModuleList``),
    so the chain's ``parameters()`` are theirs; ``stripes`` (int >= 1) is the number of output-row stripes.

    Raises:
        TypeError: a layer cannot run in stripes.
        ValueError: ``stripes`` < 1.
    """

    def __init__(self, layers: Sequence[nn.Module], stripes: int) -> None:
        super().__init__()
        bad = [m for m in layers if not chain_layer_ok(m)]
        if bad:
            raise TypeError(f"cannot run {bad[0]!r} in row stripes (see memfit.variants.tiled.chain_layer_ok)")
        if stripes < 1:
            raise ValueError(f"stripes must be >= 1, got {stripes}")
        self.layers = nn.ModuleList(layers)
        self.stripes = int(stripes)

    def forward(self, x: Tensor) -> Tensor:
        layers = tuple(self.layers)
        params = _params(layers)
        return TiledChainFn.apply(layers, self.stripes, x, *params)

    def extra_repr(self) -> str:
        return f"{len(self.layers)} layers, stripes={self.stripes}"

    def node_op(self) -> str:
        """Its text in ``Plan.node_ops`` (:func:`memfit.graph.calls.node_ops`): the stripe count is the plan's
        ``tiled`` decision, which a hand edit may change (and is then warned about), not the graph's."""
        return f"TiledChain({len(self.layers)} layers)"
