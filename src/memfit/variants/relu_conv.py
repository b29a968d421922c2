"""A convolution of a ReLU that saves the ReLU's input instead of its output (``relu-conv``).

PyTorch's ``conv2d(relu(y))`` saves ``relu(y)`` for the convolution's weight gradient; where ``y`` is a BatchNorm's
output computed from that output in the backward pass (in-place activated BatchNorm: Rota Bulo, Porzi, Kontschieder,
CVPR 2018, section 3; :mod:`memfit.variants.bn_from_output`), ``y`` is saved as well. With a ReLU, unlike the leaky
ReLU in-place ABN uses, ``y`` cannot be recovered from ``relu(y)``, so the pair keeps two activation-sized tensors
(``y`` and ``relu(y)``), as PyTorch's own BatchNorm -> in-place ReLU -> convolution keeps two (the convolution's
output and ``relu(y)``). Computing ``relu(y)`` again inside the convolution's backward pass from the saved ``y``
keeps one: the fused call here saves ``y`` (the same tensor BatchNorm saves) and the weight, and ``relu(y)`` is a
transient of its forward and backward passes. This is MONeT's in-place ABN idea (Shah et al., ICLR 2021, section 4)
carried over to ReLU, at the price of one ReLU more per backward pass and an out-of-place ReLU in the forward pass;
no checkpoint region is needed for it.

Gradients are PyTorch's bit for bit: the forward pass is ``F.conv2d(torch.relu(y), ...)``, the backward pass is
PyTorch's own ``aten.convolution_backward`` on the recomputed ``relu(y)``, then ReLU's own ``threshold_backward``
(``relu(y) <= 0`` exactly where ``y <= 0``). Only ``padding_mode="zeros"`` with numeric padding is handled.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor

from memfit.variants.conv_split_backward import keep_conv_args
from memfit.variants.single_backward import single_backward

__all__ = ["ReluConvFn", "relu_conv"]


class ReluConvFn(torch.autograd.Function):
    """``apply(y, weight, bias, stride, padding, dilation, groups)`` = ``F.conv2d(torch.relu(y), weight, bias,
    stride, padding, dilation, groups)``, saving ``y`` and ``weight`` (not ``relu(y)``).

    ``y``: ``[N, C_in, H, W]``; ``weight``: ``[C_out, C_in / groups, kh, kw]``; ``bias``: ``[C_out]`` or ``None``;
    ``stride``, ``padding``, ``dilation``: pairs of ints. Returns ``[N, C_out, H_out, W_out]``. Backward workspace:
    ``relu(y)`` again (``y``'s bytes) beside PyTorch's convolution backward's own.
    """

    @staticmethod
    def forward(ctx, y: Tensor, weight: Tensor, bias: Tensor | None, stride, padding, dilation, groups: int) -> Tensor:
        a = torch.relu(y)
        out = F.conv2d(a, weight, bias, stride, padding, dilation, groups)
        ctx.save_for_backward(y, weight)
        keep_conv_args(ctx, bias, stride, padding, dilation, groups)
        return out

    @staticmethod
    @single_backward("relu-conv")
    def backward(ctx, grad: Tensor):
        y, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.args
        need_y, need_w, need_b = ctx.needs_input_grad[:3]
        a = torch.relu(y)
        mask = [bool(need_y), bool(need_w), bool(need_b) and ctx.bias_sizes is not None]
        ga, gw, gb = torch.ops.aten.convolution_backward(grad, a, weight, ctx.bias_sizes, stride, padding, dilation,
                                                         False, [0, 0], groups, mask)
        del a
        gy = torch.ops.aten.threshold_backward(ga, y, 0) if need_y else None
        return gy, gw, gb, None, None, None, None


def relu_conv(y: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
              groups: int = 1) -> Tensor:
    """``F.conv2d(torch.relu(y), weight, bias, stride, padding, dilation, groups)`` that saves ``y`` instead of
    ``relu(y)`` for its backward pass (:class:`ReluConvFn`). ``y``: ``[N, C_in, H, W]``; ``stride``, ``padding``,
    ``dilation``: ints or pairs.

    Raises:
        TypeError: ``padding`` is a string (``"same"``); ValueError: ``y`` is not 4-D.
    """
    if y.dim() != 4:
        raise ValueError(f"relu_conv expects a 4-D input [N, C, H, W], got shape {list(y.shape)}")
    if isinstance(padding, str):
        raise TypeError("relu_conv needs numeric padding, not a string like 'same'")

    def pair(v):
        return tuple(int(u) for u in v) if isinstance(v, (list, tuple)) else (int(v),) * 2

    device_type = y.device.type
    if torch.is_autocast_enabled(device_type):
        # autocast's cast for a convolution, done here (differentiably) so the saved tensors and gradients match
        dtype = torch.get_autocast_dtype(device_type)
        y, weight = y.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        with torch.autocast(device_type, enabled=False):
            return ReluConvFn.apply(y, weight, bias, pair(stride), pair(padding), pair(dilation), groups)
    return ReluConvFn.apply(y, weight, bias, pair(stride), pair(padding), pair(dilation), groups)


torch.fx.wrap("relu_conv")
