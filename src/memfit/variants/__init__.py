"""Memory-efficient operator implementations (MONeT's operator variants) and their registry.

Each variant is a ``torch.autograd.Function`` with a drop-in ``nn.Module`` wrapper (a subclass of the
PyTorch module it replaces) that saves less for the backward pass and gives PyTorch's gradients:

* ``relu-mask``: ReLU / LeakyReLU / ReLU6 / Hardtanh save a 1-bit mask (bit-exact gradients);
* ``bn-from-output``: BatchNorm1d/2d/3d computes its backward from its output (float32 rounding); the planner
  uses it through a rewritten graph (:mod:`memfit.graph.bn_output`), not as a per-node variant;
* ``maxpool-compact``: MaxPool2d saves uint8 in-window argmax offsets (bit-exact gradients);
* ``maxpool-compact-cl``: the same, pooled through channels-last copies of groups of planes on the CPU, whose
  kernel is vectorized (GoogLeNet's pools at batch 16, 128 px: 2-6x faster forward than PyTorch's own);
* ``conv-split-backward``: Conv1d/2d/3d saves what PyTorch saves but computes its weight and input
  gradients in two calls, so their workspaces never coexist (bit-exact gradients; MONeT's
  convolution-algorithm choice, on the CPU);
* ``conv-native``: Conv2d with cuDNN (CUDA) or oneDNN (CPU) off, so that PyTorch's own im2col + GEMM
  kernels run, split backward: a workspace of columns instead of the vendor library's (MONeT's algorithm
  choice, the one per-call form PyTorch allows; float rounding against cuDNN's TF32 and oneDNN's
  blocked kernels). On the CPU it drops oneDNN's weight-sized reorders (a 1024-channel 3x3 convolution
  at 6x6: 72 MiB of backward workspace to 38 MiB, the weight's gradient included);
* ``relu-conv``: ``nn.Conv2d`` of a ReLU of a BatchNorm run from its output saves the ReLU's input (which that
  BatchNorm saves anyway) instead of its output and computes the ReLU again in its backward pass
  (:mod:`memfit.variants.relu_conv`; bit-exact). It spans two nodes, so, like ``bn-from-output``, the planner uses
  it through the rewritten graph (:func:`memfit.graph.bn_output.apply_bn_from_output`);
* ``bn-saved-stats``: a BatchNorm that a plan recomputes normalizes with its forward pass's statistics
  instead of computing them again (:mod:`memfit.variants.bn_saved_stats`; bit-exact on the CPU). It
  changes the recomputation only, so it is not a registry entry: the profile times it per node
  (``NodeCost.recompute_seconds``) and a plan lists where it runs (``Plan.stats_recompute``);
* ``tiled-chain``: a block of convolutions, pooling and activations run in row stripes, forward and backward
  (:mod:`memfit.variants.tiled`; float32 rounding). It rewrites the graph (several nodes become one), so it
  is not a registry entry either: :mod:`memfit.solve.tiling` profiles and solves candidate graphs;
* ``inplace`` / ``inplace-rhs`` / ``relu-mask-inplace``: ReLU-family activations and additions (modules,
  functions or methods) written into their operand (:mod:`memfit.variants.inplace`; bit-exact). These
  depend on the graph around the node, so they are not registry entries: the profile offers them where
  autograd allows.

``VARIANTS`` maps a variant name to a :class:`VariantSpec`; ``spec.applies(m)`` says whether it can
replace module ``m`` and ``spec.make(m)`` builds the replacement, which shares ``m``'s Parameter and
buffer objects (so optimizer state, ``state_dict`` keys and running statistics are unchanged). The
fused BatchNorm + LeakyReLU (InPlace-ABN) spans two modules and is therefore not a registry entry:
use :func:`fuse_bn_leaky_relu`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules.utils import _pair

from .bn_from_output import (
    BatchNorm1dFromOutput,
    BatchNorm2dFromOutput,
    BatchNorm3dFromOutput,
    BNFromOutputFn,
    bn_from_output,
    fuse_bn_leaky_relu,
)
from .bn_from_output import from_module as bn_from_module
from .conv_split_backward import (
    Conv1dSplitBackward,
    Conv2dNative,
    Conv2dSplitBackward,
    Conv3dSplitBackward,
    ConvSplitBackwardFn,
    conv_split_backward,
)
from .conv_split_backward import applies as _conv_split_applies
from .conv_split_backward import from_module as conv_split_from_module
from .conv_split_backward import native_applies as _conv_native_applies
from .conv_split_backward import native_pays as _conv_native_pays
from .inplace import INPLACE_VARIANTS, OPERAND, inplace_forms, saves_its_output
from .maxpool_compact import MaxPool2dCompact, MaxPool2dCompactFn, max_pool2d_compact
from .relu_conv import ReluConvFn, relu_conv
from .relu_mask import (
    HardtanhMask,
    LeakyReLUMask,
    MaskedActivationFn,
    ReLU6Mask,
    ReLUMask,
    hardtanh_mask,
    leaky_relu_mask,
    pack_mask,
    relu6_mask,
    relu_mask,
    unpack_mask,
)
from .replaceable import replaceable
from .tiled import TiledChain, TiledChainFn

__all__ = [
    "INPLACE_VARIANTS",
    "OPERAND",
    "VARIANTS",
    "BNFromOutputFn",
    "BatchNorm1dFromOutput",
    "BatchNorm2dFromOutput",
    "BatchNorm3dFromOutput",
    "Conv1dSplitBackward",
    "Conv2dNative",
    "Conv2dSplitBackward",
    "Conv3dSplitBackward",
    "ConvSplitBackwardFn",
    "HardtanhMask",
    "LeakyReLUMask",
    "MaskedActivationFn",
    "MaxPool2dCompact",
    "MaxPool2dCompactFn",
    "ReLU6Mask",
    "ReLUMask",
    "ReluConvFn",
    "TiledChain",
    "TiledChainFn",
    "VariantSpec",
    "bn_from_module",
    "bn_from_output",
    "conv_split_backward",
    "conv_split_from_module",
    "fuse_bn_leaky_relu",
    "hardtanh_mask",
    "inplace_forms",
    "leaky_relu_mask",
    "max_pool2d_compact",
    "pack_mask",
    "relu6_mask",
    "relu_conv",
    "relu_mask",
    "replaceable",
    "saves_its_output",
    "unpack_mask",
    "variant_call",
    "variants_for",
]


@dataclass(frozen=True)
class VariantSpec:
    """One operator variant.

    Attributes:
        name: registry key, e.g. ``"relu-mask"``.
        module_types: the PyTorch module classes it replaces (matched exactly, not by ``isinstance``,
            so an already-converted module, itself a subclass, is not converted again).
        saves: one line: what the variant keeps for backward, against PyTorch.
        exact: gradients are bit-for-bit PyTorch's (else equal to float rounding).
        applies: ``applies(module) -> bool``.
        make: ``make(module) -> nn.Module``, the replacement sharing the module's Parameters/buffers.
        caveat: a condition on the surrounding graph that ``applies`` cannot check ("" if none).
        offered: the profile offers it to the planner as a per-node variant. Not ``bn-from-output``: the in-place
            activation after a BatchNorm must then run out of place, which changes the graph, so the planner
            reaches it as a rewritten graph it solves beside the traced one (:mod:`memfit.graph.bn_output`);
            ``conv-native`` is offered although not
            bit-exact: it rounds like cuDNN's own algorithms do against each other (PyTorch's default,
            ``torch.backends.cudnn.deterministic=False``, is not bit-reproducible either).
        pays: ``pays(module, inputs) -> bool``, where the profile should measure it on this call's input
            values (``inputs``: the node's positional arguments): a shape test, so that a variant that cannot
            lower a peak there is not timed at all (``None``: everywhere ``applies`` says).
        faster_kernel: it runs another of PyTorch's kernels that can be faster than the default one (the
            channels-last pooling), so the profile keeps its measured time even where it is below PyTorch's
            (every other variant adds work to PyTorch's own kernel: a faster measurement is noise, raised to the
            default's; :func:`memfit.profile.costs._no_faster_than_default`).
    """

    name: str
    module_types: tuple[type[nn.Module], ...]
    saves: str
    exact: bool
    applies: Callable[[nn.Module], bool]
    make: Callable[[nn.Module], nn.Module]
    caveat: str = ""
    offered: bool = True
    pays: Callable[[nn.Module, tuple], bool] | None = None
    faster_kernel: bool = False


_ACT_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    nn.ReLU: ReLUMask, nn.LeakyReLU: LeakyReLUMask, nn.ReLU6: ReLU6Mask, nn.Hardtanh: HardtanhMask,
}
_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _make_act(m: nn.Module) -> nn.Module:
    return _ACT_CLASSES[type(m)].from_module(m)


def _maxpool_applies(m: nn.Module) -> bool:
    if type(m) is not nn.MaxPool2d or m.return_indices:
        return False
    kh, kw = _pair(m.kernel_size)
    return kh * kw <= 256


def _on_the_cpu(m: nn.Module, inputs: tuple) -> bool:
    """``maxpool-compact-cl`` pays only for a contiguous 4-D CPU input (elsewhere it runs as ``maxpool-compact``)."""
    x = inputs[0] if inputs else None
    return isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() == 4 and x.is_contiguous()


def _make_checked(spec_name: str, applies: Callable[[nn.Module], bool],
                  build: Callable[[nn.Module], nn.Module]) -> Callable[[nn.Module], nn.Module]:
    def make(m: nn.Module) -> nn.Module:
        if not applies(m):
            raise TypeError(f"variant {spec_name!r} does not apply to {m!r}")
        return build(m)
    return make


def _spec(name, types, saves, exact, applies, build, caveat="", offered=True, pays=None,
          faster_kernel=False) -> VariantSpec:
    def checked(m: nn.Module, applies=applies) -> bool:
        return replaceable(m) and applies(m)
    return VariantSpec(name, types, saves, exact, checked, _make_checked(name, checked, build), caveat, offered,
                       pays, faster_kernel)


VARIANTS: dict[str, VariantSpec] = {
    s.name: s
    for s in (
        _spec("relu-mask", tuple(_ACT_CLASSES),
              "1 bit per element (uint8, packed 8 per byte) instead of the input or output",
              True, lambda m: type(m) in _ACT_CLASSES, _make_act),
        _spec("bn-from-output", _BN_TYPES,
              "the output y (usually saved by the next layer anyway) and per-channel invstd instead of the input",
              False, lambda m: type(m) in _BN_TYPES, bn_from_module,
              "the output must not be modified in place later (ReLU(inplace=True), `out += identity`): "
              "autograd then raises at backward; every weight must be non-zero at backward", offered=False),
        _spec("maxpool-compact", (nn.MaxPool2d,),
              "uint8 in-window argmax offsets instead of the input and int64 indices",
              True, _maxpool_applies, MaxPool2dCompact.from_module),
        _spec("maxpool-compact-cl", (nn.MaxPool2d,),
              "uint8 in-window argmax offsets instead of the input and int64 indices (as maxpool-compact); "
              "pooled through channels-last copies of its input, where PyTorch's CPU kernel is vectorized",
              True, _maxpool_applies, MaxPool2dCompact.from_module_via_channels_last, pays=_on_the_cpu,
              faster_kernel=True),
        _spec("conv-split-backward", (nn.Conv1d, nn.Conv2d, nn.Conv3d),
              "the same as PyTorch (input and weight); the weight and input gradients are computed in two "
              "calls, so their workspaces never coexist",
              True, _conv_split_applies, conv_split_from_module),
        _spec("conv-native", (nn.Conv2d,),
              "the same as PyTorch (input and weight); runs with cuDNN (CUDA) or oneDNN (CPU) off, so its "
              "workspace is PyTorch's im2col columns instead of the vendor library's",
              False, _conv_native_applies, Conv2dNative.from_module, pays=_conv_native_pays),
    )
}


def variants_for(module: nn.Module) -> list[VariantSpec]:
    """The registered variants that can replace ``module``."""
    return [s for s in VARIANTS.values() if s.applies(module)]


def variant_call(gm: fx.GraphModule, node: fx.Node, name: str) -> Callable[[dict[str, Any]], Any]:
    """``f(env) -> value`` evaluating ``node`` with operator variant ``name`` (a registry entry for a
    ``call_module`` node, or an in-place form), as :func:`memfit.graph.calls.node_fn` evaluates the default.

    Raises:
        ValueError: ``name`` is not a variant of this node.
    """
    from memfit.graph.calls import node_fn

    if name in INPLACE_VARIANTS:
        forms = inplace_forms(gm, node)
        if name in forms:
            return forms[name]
    elif name in VARIANTS and node.op == "call_module":
        module = gm.get_submodule(node.target)
        if VARIANTS[name].applies(module):
            return node_fn(gm, node, module=VARIANTS[name].make(module))
    raise ValueError(f"variant {name!r} does not apply to node {node.name} ({node.op} {node.target})")
