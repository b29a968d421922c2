"""Python's augmented assignments (``h += t``, ``h *= s``) traced as PyTorch runs them.

``torch.fx``'s ``Proxy`` has no ``__iadd__``, so Python falls back to ``__add__`` and rebinds the name: the traced
graph computes ``h = h + t``, out of place. On a tensor, eager PyTorch runs ``Tensor.__iadd__``, in place: every
other name of that tensor (``skip = h`` before the addition, a U-Net's list of skips, a view, the model's input)
sees the sum too. Traced out of place, those names kept the old value: a fresh user's model trained on silently
with outputs 0.48 off and a weight's gradient ``None`` where PyTorch's was not.

:class:`InplaceProxy` records each augmented assignment as the out-of-place node fx made before (same target,
same node name, so plans made earlier still apply), marked; :func:`keep_in_place` then turns a marked node into
Python's in-place operator (``operator.iadd``: ``Tensor.__iadd__`` on a tensor, a new value on a Python number)
wherever the old value may be read again. Out of place is kept only where nothing can tell the difference: the
left operand is a tensor the forward pass made itself (through no view of anything else) and the addition is its
only reader. There memfit's solver may still choose the in-place form (:mod:`memfit.variants.inplace`), as for
torchvision's ``out += identity``. Where a reader before the assignment saved the tensor for backward, PyTorch's
in-place update makes autograd's version check fail at backward, and now so does the traced graph, as it should.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

__all__ = ["InplaceProxy", "keep_in_place", "put_back_updated_state", "state_of"]

_MARK = "memfit_augmented"

# Python's augmented operators: (the dunder fx lacks, the out-of-place operator fx falls back to, the in-place one)
_AUGMENTED = [("__iadd__", operator.add, operator.iadd), ("__isub__", operator.sub, operator.isub),
              ("__imul__", operator.mul, operator.imul), ("__itruediv__", operator.truediv, operator.itruediv),
              ("__ifloordiv__", operator.floordiv, operator.ifloordiv), ("__imod__", operator.mod, operator.imod),
              ("__ipow__", operator.pow, operator.ipow), ("__iand__", operator.and_, operator.iand),
              ("__ior__", operator.or_, operator.ior), ("__ixor__", operator.xor, operator.ixor),
              ("__ilshift__", operator.lshift, operator.ilshift), ("__irshift__", operator.rshift, operator.irshift)]


class InplaceProxy(fx.Proxy):
    """``torch.fx.Proxy`` whose augmented assignments are recorded as marked out-of-place nodes, for
    :func:`keep_in_place` to decide (``@=`` is left to Python: a tensor has no ``__imatmul__`` either)."""


def _augmented(out_of_place, in_place):
    def method(self: fx.Proxy, other):
        proxy = self.tracer.create_proxy("call_function", out_of_place, (self, other), {})
        proxy.node.meta[_MARK] = in_place
        return proxy

    method.__name__ = f"__i{out_of_place.__name__.rstrip('_')}__"
    return method


for _name, _out, _in in _AUGMENTED:
    setattr(InplaceProxy, _name, _augmented(_out, _in))

# ops whose result is a tensor of its own, never its input nor a view of it
_NEW_TENSOR_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.matmul, operator.neg, operator.and_, operator.or_, operator.xor, operator.lshift, operator.rshift,
    torch.add, torch.sub, torch.mul, torch.div, torch.matmul, torch.mm, torch.bmm, torch.cat, torch.stack,
    torch.relu, torch.sigmoid, torch.tanh, torch.exp, torch.softmax, torch.clone, torch.where,
    F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.linear,
    F.batch_norm, F.layer_norm, F.group_norm, F.instance_norm, F.softmax, F.log_softmax, F.gelu,
    F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool2d,
    F.interpolate, F.embedding,
}
_NEW_TENSOR_METHODS = {"add", "sub", "mul", "div", "matmul", "clone", "sigmoid", "tanh", "exp", "softmax",
                       "log_softmax", "sum", "mean"}
_NEW_TENSOR_MODULES = (nn.modules.conv._ConvNd, nn.Linear, nn.Bilinear, nn.modules.batchnorm._NormBase,
                       nn.GroupNorm, nn.LayerNorm, nn.Embedding, nn.modules.pooling._MaxPoolNd,
                       nn.modules.pooling._AvgPoolNd, nn.modules.pooling._AdaptiveAvgPoolNd, nn.Upsample,
                       nn.Softmax, nn.LogSoftmax, nn.GELU, nn.Sigmoid, nn.Tanh)
# (activations with an `inplace` flag, F.relu(..., inplace=True), Dropout (its input itself in eval mode),
# Identity, Flatten and every other op may return their input or a view of it: followed through to their inputs)


def _new_tensor(gm: nn.Module, node: fx.Node) -> bool:
    """Whether ``node``'s value is surely a tensor of its own (not an input, a parameter, or a view)."""
    if node.meta.get(_MARK) is not None:  # an augmented assignment kept out of place
        return True
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        return isinstance(m, _NEW_TENSOR_MODULES) or (getattr(m, "inplace", None) is False
                                                      and type(m).__module__ == "torch.nn.modules.activation")
    if node.op == "call_function":
        return node.target in _NEW_TENSOR_FUNCTIONS and not node.kwargs.get("inplace", False)
    if node.op == "call_method":
        return node.target in _NEW_TENSOR_METHODS
    return False


def _aliases(gm: nn.Module, node: fx.Node) -> set[fx.Node]:
    """``node`` and, through every op that may return its input or a view of it, the nodes it may share memory
    with."""
    found, todo = set(), [node]
    while todo:
        v = todo.pop()
        if v not in found:
            found.add(v)
            if not _new_tensor(gm, v):
                todo.extend(v.all_input_nodes)
    return found


def keep_in_place(root: nn.Module, graph: fx.Graph) -> list[fx.Node]:
    """Turn each augmented assignment :class:`InplaceProxy` recorded into Python's in-place operator where the
    old value may be read again, and unmark the rest (kept out of place). Reads the graph only (no values).

    Args:
        root: the traced module (for the types of ``call_module`` nodes).
        graph: the traced graph, changed in place.

    Returns:
        The nodes made in-place (their names unchanged).
    """
    made = []
    for node in graph.nodes:
        in_place = node.meta.get(_MARK)
        if in_place is None:
            continue
        lhs = node.args[0]
        if isinstance(lhs, fx.Node):
            group = _aliases(root, lhs)
            if any(v.op in ("placeholder", "get_attr") or any(u is not node and u not in group for u in v.users)
                   for v in group):
                node.target = in_place
                made.append(node)
                del node.meta[_MARK]
    for node in graph.nodes:
        node.meta.pop(_MARK, None)
    return made



_IN_PLACE = {in_place for _, _, in_place in _AUGMENTED}


def _updates_in_place(value, qualified_name: str) -> bool:
    """Whether ``value``, assigned while tracing to the buffer or parameter ``qualified_name``, is that very
    tensor updated by augmented assignments that :func:`keep_in_place` made in-place."""
    node = getattr(value, "node", None)
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _IN_PLACE:
        node = node.args[0]
    return isinstance(node, fx.Node) and node.op == "get_attr" and node.target == qualified_name


def state_of(model: nn.Module) -> list[tuple[str, nn.Module, str, dict]]:
    """Each module's buffers and parameters as they are now, for :func:`put_back_updated_state`."""
    return [(path, m, table, dict(getattr(m, table))) for path, m in model.named_modules()
            for table in ("_buffers", "_parameters")]


def put_back_updated_state(state: list[tuple[str, nn.Module, str, dict]]) -> None:
    """After tracing, put back the buffers and parameters that forward updated by augmented assignments
    (``self.count += 1``, ``self.ema *= 0.9``): Python rebound each name to the traced value, which in PyTorch is
    the same tensor updated in place, and which the graph (made in-place by :func:`keep_in_place`) updates in every
    step. Left there, the ``GraphModule`` built next would hold the tracer's value instead of the tensor. Any other
    traced value assigned to a buffer is left for :func:`memfit.graph.attributes.record_reads` to refuse."""
    for path, module, table, saved in state:
        now = getattr(module, table)
        for name, value in list(now.items()):
            if name in saved and value is not saved[name] and _updates_in_place(
                    value, f"{path}.{name}" if path else name):
                now[name] = saved[name]
