"""In-place forms of element-wise nodes, for the planner to choose where autograd allows them.

An out-of-place ReLU or addition allocates its result while its operand is still alive, so for one moment
both exist (in the forward pass and in every recomputation); the in-place form writes the result into the
operand and allocates nothing. PyTorch code is in-place here by hand (``nn.ReLU(inplace=True)``,
``out += identity`` in torchvision's ResNet) only where its author checked that nothing else needs the
operand; memfit checks it on the profiled graph instead (:mod:`memfit.profile.costs`), so models written
with ``F.relu(x)`` and ``out = out + identity`` get the same memory, and the integer program decides node by
node (MONeT, Shah et al., ICLR 2021, section 4, "in-place operations" among the local optimizations).

Forms (``inplace_forms(gm, node)``: variant name -> ``f(env) -> value`` as in :func:`memfit.graph.calls.node_fn`):

* ``"inplace"``: ``nn.ReLU`` / ``F.relu`` / ``torch.relu`` / ``Tensor.relu`` -> ``torch.relu_``;
  ``nn.LeakyReLU`` / ``F.leaky_relu`` with a slope >= 0 -> ``leaky_relu_`` (PyTorch's in-place backward
  refuses negative slopes); ``a + b`` / ``torch.add(a, b, alpha=k)`` / ``a.add(b)`` -> ``a.add_(b, alpha=k)``.
  Saves what PyTorch's op saves (ReLU: its result, now in the operand's storage; addition: nothing).
* ``"inplace-rhs"``: ``a + b`` -> ``b.add_(a)`` (both tensors, no ``alpha``): floating-point addition is
  commutative, so the result is bit-for-bit the same.
* ``"relu-mask-inplace"``: the ReLU family (``nn.ReLU``, ``nn.LeakyReLU``, ``nn.ReLU6``, ``nn.Hardtanh``,
  ``F.relu``, ``torch.relu``, ``Tensor.relu``) as the 1-bit-mask variant of :mod:`memfit.variants.relu_mask`
  writing into its operand: saves 1 bit per element and allocates nothing. (``nn.ReLU6`` and
  ``nn.Hardtanh`` get no plain ``"inplace"`` form: PyTorch's ``hardtanh_`` saves a full copy of its input.)

Every form computes what PyTorch's op computes with the same kernel, so values and gradients are
bit-for-bit PyTorch's. Whether a form is *legal* depends on the graph, not the op: the overwritten operand
(``OPERAND[name]`` is its argument position) must be made by an earlier node, read by no other node,
saved for backward by no node, not be a model output, and have the result's shape, dtype and strides. The
profile checks that and offers the form only then; the integer program further keeps the node in the same
checkpoint region as the operand's producer (a region must not modify its own inputs) and does not offload
either of them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from memfit.graph.calls import arg_loader
from memfit.variants.relu_mask import hardtanh_mask, leaky_relu_mask, relu_mask
from memfit.variants.replaceable import replaceable as _replaceable

__all__ = ["INPLACE_VARIANTS", "OPERAND", "PLAIN_INPLACE", "inplace_forms", "saves_its_output"]

#: variant name -> argument position of the operand it overwrites
OPERAND: dict[str, int] = {"inplace": 0, "inplace-rhs": 1, "relu-mask-inplace": 0}
INPLACE_VARIANTS = tuple(OPERAND)
#: the forms that run PyTorch's own kernel into their operand: the same work as PyTorch's op, less the
#: result's allocation (``relu-mask-inplace`` adds a mask's packing)
PLAIN_INPLACE = ("inplace", "inplace-rhs")

_RELU_FUNCTIONS = (torch.relu, F.relu)
_ADD_FUNCTIONS = (operator.add, torch.add)


def _kind(gm: fx.GraphModule, node: fx.Node) -> tuple[str, dict[str, Any]] | None:
    """``(kind, parameters)`` of an element-wise node with an in-place form, else ``None``.

    kind: ``relu``, ``leaky_relu``, ``hardtanh`` (parameters ``min_val``/``max_val``) or ``add``."""
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        if getattr(m, "inplace", True) or not _replaceable(m):
            return None  # already in place (or not an activation), or has hooks a form would skip
        t = type(m)
        if t is nn.ReLU:
            return "relu", {}
        if t is nn.LeakyReLU:
            return "leaky_relu", {"negative_slope": float(m.negative_slope)}
        if t in (nn.ReLU6, nn.Hardtanh):
            return "hardtanh", {"min_val": float(m.min_val), "max_val": float(m.max_val)}
        return None
    if node.op == "call_function":
        if node.target in _RELU_FUNCTIONS and len(node.args) == 1 and not node.kwargs.get("inplace", False) \
                and set(node.kwargs) <= {"inplace"}:
            return "relu", {}
        if node.target is F.leaky_relu and not node.kwargs.get("inplace", False) and len(node.args) == 1 \
                and set(node.kwargs) <= {"negative_slope", "inplace"}:
            return "leaky_relu", {"negative_slope": float(node.kwargs.get("negative_slope", 0.01))}
        if node.target in _ADD_FUNCTIONS and len(node.args) == 2 and set(node.kwargs) <= {"alpha"}:
            return "add", dict(node.kwargs)
        return None
    if node.op == "call_method":
        if node.target == "relu" and len(node.args) == 1 and not node.kwargs:
            return "relu", {}
        if node.target == "add" and len(node.args) == 2 and set(node.kwargs) <= {"alpha"}:
            return "add", dict(node.kwargs)
    return None


def saves_its_output(gm: fx.GraphModule, node: fx.Node, variant: str) -> bool:
    """Whether ``node`` run as ``variant`` saves its own output for backward, so that no later in-place form may
    overwrite it (autograd's version check would fail at backward): ``bn-from-output``, and the ``inplace`` form
    of a ReLU or LeakyReLU (``relu_`` saves its result). PyTorch's own ops are not known here (the profile finds
    what they save)."""
    if variant == "bn-from-output":
        return True
    found = _kind(gm, node) if variant == "inplace" else None
    return found is not None and found[0] != "add"


def _holds_sum(x: torch.Tensor, other) -> bool:
    """Whether ``x + other`` has ``x``'s dtype and shape, so that it can be written into ``x``. Planned where it
    had; a step in another autocast state or dtype can change that (a float32 LayerNorm output plus a bfloat16
    Linear output under autocast, planned outside it: written into the bfloat16 operand, the sum was rounded,
    gradients 1e-3 off), and the addition then runs out of place, as PyTorch's does."""
    if not isinstance(x, torch.Tensor):
        return False
    if isinstance(other, torch.Tensor):
        return torch.result_type(x, other) == x.dtype and torch.broadcast_shapes(x.shape, other.shape) == x.shape
    return torch.result_type(x, other) == x.dtype


def inplace_forms(gm: fx.GraphModule, node: fx.Node) -> dict[str, Callable[[dict[str, Any]], Any]]:
    """The in-place forms of ``node`` (see the module docstring), by variant name; ``{}`` if it has none.

    Each value is ``f(env) -> value`` reading the node's arguments from ``env`` (name -> value), like
    :func:`memfit.graph.calls.node_fn`. Legality in the surrounding graph is not checked here."""
    found = _kind(gm, node)
    if found is None:
        return {}
    kind, p = found
    load = arg_loader(node)
    forms: dict[str, Callable] = {}
    if kind == "add":
        alpha = p.get("alpha", 1)

        def add_lhs(env):
            (a, b), _ = load(env)
            if not _holds_sum(a, b):
                return torch.add(a, b, alpha=alpha) if alpha != 1 else a + b
            return a.add_(b, alpha=alpha) if alpha != 1 else a.add_(b)
        forms["inplace"] = add_lhs
        if "alpha" not in p or alpha == 1:
            def add_rhs(env):
                (a, b), _ = load(env)
                return b.add_(a) if _holds_sum(b, a) else a + b
            forms["inplace-rhs"] = add_rhs
        return forms
    if kind == "relu":
        forms["inplace"] = lambda env: torch.relu_(load(env)[0][0])
        forms["relu-mask-inplace"] = lambda env: relu_mask(load(env)[0][0], inplace=True)
    elif kind == "leaky_relu":
        slope = p["negative_slope"]
        if slope >= 0:
            forms["inplace"] = lambda env: F.leaky_relu(load(env)[0][0], slope, inplace=True)
        forms["relu-mask-inplace"] = lambda env: leaky_relu_mask(load(env)[0][0], slope, inplace=True)
    elif kind == "hardtanh":
        lo, hi = p["min_val"], p["max_val"]
        forms["relu-mask-inplace"] = lambda env: hardtanh_mask(load(env)[0][0], lo, hi, inplace=True)
    return forms
