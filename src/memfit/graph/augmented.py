"""Python's augmented assignments (``h += t``, ``h *= s``) traced as PyTorch runs them.

``torch.fx``'s ``Proxy`` has no ``__iadd__``, so Python falls back to ``__add__`` and rebinds the name: the traced
graph computes ``h = h + t``, out of place. On a tensor, eager PyTorch runs ``Tensor.__iadd__``, in place: every
other name of that tensor (``skip = h`` before the addition, a U-Net's list of skips, a view, the model's input)
sees the sum too. Traced out of place, those names kept the old value: a fresh user's model trained on silently
with outputs 0.48 off and a weight's gradient ``None`` where PyTorch's was not.

:class:`InplaceProxy` records each augmented assignment as the out-of-place node fx made before (same target,
same node name, so plans made earlier still apply), marked; :func:`keep_in_place` then turns a marked node into
Python's in-place operator (``operator.iadd``: ``Tensor.__iadd__`` on a tensor, a new value on a Python number)
unless nothing can tell the difference: the left operand is the output of an op that makes a tensor of its own
and does not save it for backward (a convolution, a linear layer, a normalization, an addition: not ``sigmoid``,
whose output its backward reads, which PyTorch's in-place update would make autograd refuse), and the update is
its only reader. There memfit's solver may still choose the in-place form (:mod:`memfit.variants.inplace`), as for
torchvision's ``out += identity``. What the graph cannot show, the profile checks on the example batch
(:func:`check_out_of_place`): the result must keep the left operand's shape and dtype, as PyTorch's in-place
update does (``h += t`` with ``t`` broadcasting ``h`` larger is refused by PyTorch, a float32 ``t`` added into a
float16 ``h`` stays float16). Attributes (``h.T``, ``h.data``) are views and take the in-place operator too.
"""

from __future__ import annotations

import operator
import traceback

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from memfit.warn import in_library

__all__ = [
    "WRITE_LINE",
    "InplaceProxy",
    "assign_into",
    "check_out_of_place",
    "keep_in_place",
    "put_back_updated_state",
    "state_of",
    "user_line",
    "writes_into",
    "written_constants",
]

_MARK = "memfit_augmented"

# Python's augmented operators: (the dunder fx lacks, the out-of-place operator fx falls back to, the in-place one)
_AUGMENTED = [("__iadd__", operator.add, operator.iadd), ("__isub__", operator.sub, operator.isub),
              ("__imul__", operator.mul, operator.imul), ("__itruediv__", operator.truediv, operator.itruediv),
              ("__ifloordiv__", operator.floordiv, operator.ifloordiv), ("__imod__", operator.mod, operator.imod),
              ("__ipow__", operator.pow, operator.ipow), ("__iand__", operator.and_, operator.iand),
              ("__ior__", operator.or_, operator.ior), ("__ixor__", operator.xor, operator.ixor),
              ("__ilshift__", operator.lshift, operator.ilshift), ("__irshift__", operator.rshift, operator.irshift)]


_KEPT = "memfit_augmented_out_of_place"  # (and the user's line, for check_out_of_place's message)


class InplaceProxy(fx.Proxy):
    """``torch.fx.Proxy`` whose augmented assignments are recorded as marked out-of-place nodes, for
    :func:`keep_in_place` to decide (``@=`` is left to Python: a tensor has no ``__imatmul__`` either); its
    attributes (``h.T``, ``h.data``) are such proxies too."""

    def __getattr__(self, k: str) -> fx.Proxy:
        return _InplaceAttribute(self, k)

    def __setitem__(self, key, value) -> None:
        """``h[key] = value`` (and ``h[key] += t``, which Python runs as a read, an in-place update of that view and
        this assignment): recorded as :func:`assign_into`, which PyTorch runs as eager code does (fx's ``Proxy``
        has no ``__setitem__``, and a model with a slice assignment could not be traced at all)."""
        self.tracer.create_proxy("call_function", assign_into, (self, key, value), {})  # (its line: WRITE_LINE)


class _InplaceAttribute(fx.proxy.Attribute, InplaceProxy):
    """fx's lazily recorded attribute (``h.T``), with :class:`InplaceProxy`'s augmented assignments: ``v = h.T;
    v += 1`` updated a copy, and ``self.ema.data *= 0.9`` never changed the buffer (fresh-user findings)."""


def assign_into(tensor: torch.Tensor, key, value) -> torch.Tensor:
    """``tensor[key] = value`` as eager PyTorch runs it (an in-place write into ``tensor``'s storage: autograd
    rewrites ``tensor``'s history as a ``CopySlices``), returning ``tensor``: the node a traced slice assignment
    becomes (:meth:`InplaceProxy.__setitem__`). Later readers of ``tensor`` read the written storage, as in the
    user's code; the profile sees the write through the version counter, like any in-place method's."""
    tensor[key] = value
    return tensor


def user_line() -> str:
    frames = [f for f in traceback.extract_stack() if not in_library(f.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else "?"


def _augmented(out_of_place, in_place):
    def method(self: fx.Proxy, other):
        proxy = self.tracer.create_proxy("call_function", out_of_place, (self, other), {})
        proxy.node.meta[_MARK] = in_place
        proxy.node.meta[_KEPT] = user_line()
        return proxy

    method.__name__ = f"__i{out_of_place.__name__.rstrip('_')}__"
    return method


for _name, _out, _in in _AUGMENTED:
    setattr(InplaceProxy, _name, _augmented(_out, _in))

# ops whose result is a tensor of its own (never an input nor a view of one) that their backward does not read
# (sigmoid, tanh, exp, softmax and ReLU save their output: PyTorch's in-place update of it fails at backward)
_NEW_TENSOR_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.matmul,
    operator.neg, torch.add, torch.sub, torch.mul, torch.matmul, torch.mm, torch.bmm, torch.cat, torch.stack,
    torch.clone, torch.where, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
    F.conv_transpose3d, F.linear, F.batch_norm, F.layer_norm, F.group_norm, F.instance_norm, F.gelu,
    F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool2d,
    F.interpolate, F.embedding,
}
_NEW_TENSOR_METHODS = {"add", "sub", "mul", "matmul", "clone", "sum", "mean"}
_NEW_TENSOR_MODULES = (nn.modules.conv._ConvNd, nn.Linear, nn.Bilinear, nn.modules.batchnorm._NormBase,
                       nn.GroupNorm, nn.LayerNorm, nn.Embedding, nn.modules.pooling._MaxPoolNd,
                       nn.modules.pooling._AvgPoolNd, nn.modules.pooling._AdaptiveAvgPoolNd, nn.Upsample, nn.GELU)


def _new_tensor(gm: nn.Module, node: fx.Node) -> bool:
    """Whether ``node``'s value is surely a tensor of its own that no backward reads (not an input, a parameter,
    a view, or an output its op saves)."""
    if _KEPT in node.meta:  # an augmented assignment kept out of place
        return True
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), _NEW_TENSOR_MODULES)
    if node.op == "call_function":
        return node.target in _NEW_TENSOR_FUNCTIONS and not node.kwargs.get("inplace", False)
    if node.op == "call_method":
        return node.target in _NEW_TENSOR_METHODS
    return False


def keep_in_place(root: nn.Module, graph: fx.Graph) -> list[fx.Node]:
    """Turn each augmented assignment :class:`InplaceProxy` recorded into Python's in-place operator unless its left
    operand is a fresh tensor no backward reads (:func:`_new_tensor`) and the update is its only reader; those stay
    out of place, marked for :func:`check_out_of_place`. Reads the graph only (no values).

    Args:
        root: the traced module (for the types of ``call_module`` nodes).
        graph: the traced graph, changed in place.

    Returns:
        The nodes made in-place (their names unchanged).
    """
    made = []
    for node in graph.nodes:
        in_place = node.meta.pop(_MARK, None)
        if in_place is None:
            continue
        lhs = node.args[0]
        if isinstance(lhs, fx.Node) and not (_new_tensor(root, lhs) and set(lhs.users) == {node}):
            node.target = in_place
            made.append(node)
            del node.meta[_KEPT]
    return made


_IN_PLACE_DUNDERS = frozenset(f"__i{op}__" for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod",
                                                      "pow", "lshift", "rshift", "and", "xor", "or"))


def in_place_name(name: str) -> bool:
    """Whether a tensor method of this name writes into its first operand (``add_``, ``__iadd__``, ``__setitem__``;
    ``__and__`` and ``__mul__`` end with "_" too: `mask & m` read as a write was refused)."""
    return (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_DUNDERS or name == "__setitem__"


def written_operands(func, args: tuple, kwargs: dict) -> list:
    """The tensors the ATen operator ``func`` (an ``OpOverload``, as a ``TorchDispatchMode`` sees it) writes into,
    by its schema's alias annotations (``Tensor(a!)``)."""
    if not func._schema.is_mutable:
        return []
    written = []
    for k, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or k >= len(args) else args[k]
        written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


def writes_into(node: fx.Node) -> bool:
    """Whether ``node`` writes into its first operand in place (``h.add_(t)``, ``h += t`` made in place,
    ``h[k] = v``)."""
    if node.op == "call_method":
        return in_place_name(node.target)
    return node.op == "call_function" and (node.target in _IN_PLACE or node.target in (assign_into, operator.setitem))


WRITE_LINE = "memfit_write_line"  # node.meta key: the user's line of an in-place write (set while tracing)


def written_constants(graph: fx.Graph) -> list[fx.Node]:
    """The nodes that write into a tensor constant (``get_attr _tensor_constant<i>``): a tensor the forward pass
    makes from plain numbers (``z = torch.zeros(4, 10)``), which ``torch.fx`` makes once, while tracing, and
    keeps. fx also computes, then and once, whatever reads that tensor with no traced value (``z * 2``,
    ``z.sum(1)``, ``z[:, 0] = z[:, 1]``), so those read it before a write of a traced value into it
    (``z[:, 1:-1] = h``): a fresh user's ViT built its token sequence so, and trained with its embedding's gradient
    missing and the loss 0.006 off, silently. :func:`memfit.graph.capture.capture` refuses these."""
    return [user for node in graph.nodes if node.op == "get_attr" and str(node.target).startswith("_tensor_constant")
            for user in node.users if writes_into(user) and user.args and user.args[0] is node]


def check_out_of_place(node: fx.Node, env: dict, out) -> None:
    """Raise where ``node``, an augmented assignment :func:`keep_in_place` kept out of place, gives a result of
    another shape or dtype than its left operand (values of the example batch in ``env``, by node name): PyTorch's
    in-place update keeps both (it refuses to broadcast ``h`` larger; it casts into ``h``'s dtype).

    Raises:
        RuntimeError: names the user's line and what to write instead.
    """
    line = node.meta.get(_KEPT)
    lhs = env.get(node.args[0].name) if line and isinstance(node.args[0], fx.Node) else None
    if not isinstance(lhs, torch.Tensor) or not isinstance(out, torch.Tensor):
        return
    if out.shape != lhs.shape or out.dtype != lhs.dtype:
        raise RuntimeError(
            f"an augmented assignment at {line} gives a {out.dtype} {list(out.shape)} result from a {lhs.dtype} "
            f"{list(lhs.shape)} tensor: PyTorch runs it in place, which keeps the left side's shape and dtype (a "
            "larger broadcast shape is refused, another dtype is cast into it), and memfit, tracing it, would not "
            "do the same. Write what you mean: `h = h + t` for the new shape or dtype, or `h += t.to(h.dtype)` / "
            "`h.add_(t)` for PyTorch's in-place update. Your model is as it was.")

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


def put_back_updated_state(state: list[tuple[str, nn.Module, str, dict]], everything: bool = False) -> None:
    """After tracing, put back the buffers and parameters that forward updated by augmented assignments
    (``self.count += 1``, ``self.ema *= 0.9``): Python rebound each name to the traced value, which in PyTorch is
    the same tensor updated in place, and which the graph (made in-place by :func:`keep_in_place`) updates in every
    step. Left there, the ``GraphModule`` built next would hold the tracer's value instead of the tensor. Any other
    traced value assigned to a buffer is left for :func:`memfit.graph.attributes.record_reads` to refuse, unless
    ``everything`` (a failed trace, before tracing again)."""
    for path, module, table, saved in state:
        now = getattr(module, table)
        for name, value in list(now.items()):
            if name in saved and isinstance(value, fx.Proxy) and (everything or _updates_in_place(
                    value, f"{path}.{name}" if path else name)):
                now[name] = saved[name]
