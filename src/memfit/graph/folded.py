"""Values a shape-specialized trace computes for real: tensors made from plain numbers alone.

While :class:`memfit.graph.sized.ShapeSpecializing` traces with the example's shapes, a tensor factory called with
plain numbers (``torch.arange(seq_len)``, sizes read from traced tensors included) makes a tensor whose value is
fixed by the shapes the graph holds for anyway, and so is every tensor computed from such tensors alone. Tracing
them as graph values (as fx does with any tensor) hides their values from the forward's Python code: Hugging Face's
mask preparation tests whether the position ids it computed are one sequence per row (``find_packed_sequence_indices``)
and, on a traced value, cannot, so a traced causal language model built and applied an explicit causal mask (and
copied the keys and values of grouped-query attention for it) where eager PyTorch calls
``scaled_dot_product_attention(..., is_causal=True)``: 1.16x eager's peak at ``strategy="none"`` on a 2-layer Llama.

:class:`Folding` computes such tensors for real instead (**folded** tensors), so Python code on them runs as in
eager PyTorch, and puts each into the graph only where a traced operation reads it, as the operations that made it
(replayed as graph nodes, so a step computes it as PyTorch does; no constant is stored). This is constant folding
as compilers do it, limited to values the specialization fixes. Not folded, and traced as before:

* random factories (``torch.rand``) and operations that draw (``torch.Tag.nondeterministic_seeded``): a draw made
  while tracing would be kept for good;
* ``torch.empty``: its values are whatever the memory held;
* any operation reading a parameter, a buffer, or a tensor that requires grad, or a traced value.

A write into a folded tensor (``z = torch.zeros(b, 10); z[:, 0] = h``, ``mask.masked_fill_(...)``) raises
:class:`FoldingAborted`, naming the factory calls that tensor was computed from (numbered in the order the forward
makes them), and :func:`memfit.graph.capture.capture` traces again with those left as graph values, as before folding
(the Python code may already have read the value before the write), and the others folded.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from memfit.graph.augmented import in_place_name, written_operands

# factories whose tensor is fixed by their arguments (random ones draw; `empty` holds whatever the memory held)
FOLDED_FACTORIES = frozenset({"zeros", "ones", "full", "arange", "eye", "linspace"})


class FoldingAborted(Exception):
    """The traced forward writes into a folded tensor (raised before the write): ``line``, the user's line;
    ``factories``, the numbers of the factory calls (:attr:`Folding.factories`) the written tensor was computed from
    (empty where the write is into another tensor a folded operation read)."""

    def __init__(self, line: str, factories: frozenset[int] = frozenset()):
        super().__init__(line)
        self.factories = factories


class _NotFoldable(Exception):
    """The operation draws a random number: it is traced as a graph value instead (raised before the draw)."""


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors ``func(*args, **kwargs)`` writes into by its name (``add_``, ``__setitem__``, ``out=``)."""
    if not (in_place_name(getattr(func, "__name__", "")) or kwargs.get("out") is not None):
        return []
    return [t for t in tree_leaves((args[:1], kwargs.get("out"))) if isinstance(t, torch.Tensor)]


def _operator_form(name: str):
    """``operator.ne`` for ``__ne__`` (as fx records ``a != b`` on its stand-ins), ``(operator.sub, True)`` for the
    reflected ``__rsub__``; ``None`` where there is none."""
    if not (name.startswith("__") and name.endswith("__")):
        return None
    bare = {"div": "truediv", "rdiv": "rtruediv"}.get(name[2:-2], name[2:-2])  # (Tensor.__rtruediv__ is __rdiv__)
    for reflected, base in ((False, bare), (True, bare[1:] if bare.startswith("r") else None)):
        if base is None:
            continue
        fn = getattr(operator, base, None) or getattr(operator, base + "_", None)
        if callable(fn) and base not in ("call", "setitem", "delitem", "contains", "index"):
            return fn, reflected
    return None


def _tensor_method(func) -> bool:
    """Whether ``func`` is a method of ``torch.Tensor`` (``new_ones`` too, which ``torch.overrides`` lists as
    ignored but passes to ``__torch_function__``)."""
    name = getattr(func, "__name__", None)
    return name is not None and any(getattr(cls, name, None) is func for cls in (torch.Tensor, torch._C.TensorBase))


def _replayable(func) -> bool:
    """Whether :func:`_replay` can record ``func`` as fx records it on its stand-ins."""
    if getattr(func, "__name__", None) == "__get__":  # (a property: `t.T`)
        return getattr(getattr(func, "__self__", None), "__name__", None) is not None
    if _tensor_method(func):
        name = getattr(func, "__name__", "")
        return not name.startswith("__") or _operator_form(name) is not None
    return callable(func) and getattr(func, "__module__", None) is not None


def _replay(func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)`` on fx stand-ins, recorded as fx records the same call written in Python: a dunder as
    its ``operator`` function, a tensor method as ``call_method``, anything else as ``call_function``."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(args[0], func.__self__.__name__)
    if _tensor_method(func):
        form = _operator_form(name)
        if form is not None:
            fn, reflected = form
            return fn(args[1], args[0]) if reflected else fn(*args, **kwargs)
        if isinstance(args[0], fx.Proxy):
            return getattr(args[0], name)(*args[1:], **kwargs)
    return func(*args, **kwargs)


def _storage(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; ``None`` for a tensor without one (sparse, nested)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class _DrawsOrWrites(TorchDispatchMode):
    """While a folded operation runs: raises :class:`_NotFoldable` before an operator that draws a random number and
    :class:`FoldingAborted` before one that writes into the storage of one of ``inputs`` (a write its name did not
    say: a fresh tensor's are fine)."""

    def __init__(self, inputs: dict[int, frozenset[int]], line):
        super().__init__()
        self.storages = inputs  # storage address -> the factory calls its tensor was computed from
        self.line = line

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise _NotFoldable
        written = [_storage(t) for t in written_operands(func, args, kwargs)]
        if any(w in self.storages for w in written):
            raise FoldingAborted(self.line(), frozenset().union(*(self.storages[w] for w in written
                                                                  if w in self.storages)))
        return func(*args, **kwargs)


class Folding(TorchFunctionMode):
    """The folded tensors of one trace (see the module's docstring) and the mode that computes them: active around
    the tracer's ``trace`` (memfit's own computations on fake tensors pass through it: they read no folded tensor).

    ``tracer``: the ``fx.Tracer`` (its ``create_proxy``, ``create_arg``); ``state``: ids of the model's parameters
    and buffers (never folded: their values change between steps); ``line``: a function giving the user's line, for
    :class:`FoldingAborted`; ``unfolded``: the numbers of the factory calls (in the order the forward makes them,
    counting those with plain arguments) to trace as graph values (the written ones of an earlier attempt)."""

    def __init__(self, tracer: fx.Tracer, state: set[int], line, unfolded: frozenset[int] = frozenset()):
        super().__init__()
        self.tracer, self.state, self.line, self.unfolded = tracer, state, line, unfolded
        self.recipes: dict[int, tuple[torch.Tensor, Any]] = {}  # id -> (tensor, how it was made)
        self.roots: dict[int, frozenset[int]] = {}  # id -> the factory calls it was computed from
        self.emitted: dict[int, fx.Proxy] = {}  # id of a tensor or a call's recipe -> its graph value
        self.factories = 0  # factory calls with plain arguments so far

    def folded(self, value) -> bool:
        entry = self.recipes.get(id(value))
        return entry is not None and entry[0] is value

    def folds_next_factory(self) -> bool:
        """Count a factory call with plain arguments; whether it is folded (not in ``unfolded``)."""
        self.factories += 1
        return self.factories - 1 not in self.unfolded

    def factory(self, fn, args: tuple, kwargs: dict):
        """``fn(*args, **kwargs)`` (one of :data:`FOLDED_FACTORIES`, plain arguments; the factory call numbered
        ``factories - 1``) computed for real, folded."""
        out = fn(*args, **kwargs)
        self._note(out, (fn, args, kwargs, True), frozenset({self.factories - 1}))
        return out

    def _note(self, out, call, roots: frozenset[int]) -> None:
        leaves, spec = tree_flatten(out)
        for k, t in enumerate(leaves):
            if isinstance(t, torch.Tensor) and not self.folded(t):  # (`.to()`, `.contiguous()` may return their input)
                self.recipes[id(t)] = (t, (call, spec, k))
                self.roots[id(t)] = roots

    def _roots(self, values) -> frozenset[int]:
        return frozenset().union(*(self.roots[id(v)] for v in values if self.folded(v)))

    def emit(self, value) -> fx.Proxy:
        """The graph value of the folded tensor ``value``: the operations that made it, recorded once."""
        if id(value) in self.emitted:
            return self.emitted[id(value)]
        (fn, args, kwargs, is_factory), spec, k = self.recipes[id(value)][1]
        key = id(self.recipes[id(value)][1][0])
        if key not in self.emitted:
            args, kwargs = tree_map(lambda v: self.emit(v) if self.folded(v) else v, (args, kwargs))
            self.emitted[key] = (self.tracer.create_proxy("call_function", fn, args, kwargs) if is_factory
                                 else _replay(fn, args, kwargs))
        out = self.emitted[key]
        if spec.num_leaves != 1 or not spec.is_leaf():  # (an item of what the call returned: `x.chunk(2)[1]`)
            out = tree_unflatten([*range(spec.num_leaves)], spec)
            out = _item_at(self.emitted[key], out, k)
        self.emitted[id(value)] = out
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if not any(self.folded(v) for v in leaves):
            return func(*args, **kwargs)
        written = [t for t in _written(func, args, kwargs) if self.folded(t)]
        if written:
            raise FoldingAborted(self.line(), self._roots(written))
        traced = any(isinstance(v, fx.Proxy) for v in leaves) or any(
            isinstance(v, torch.Tensor) and not self.folded(v) and (id(v) in self.state or v.requires_grad)
            for v in leaves)
        if not traced:
            try:
                inputs: dict[int, frozenset[int]] = {}
                for v in leaves:
                    if isinstance(v, torch.Tensor) and (where := _storage(v)) is not None:
                        inputs[where] = inputs.get(where, frozenset()) | self._roots([v])
                with _DrawsOrWrites(inputs, self.line):
                    out = func(*args, **kwargs)
            except _NotFoldable:
                pass
            else:  # (a size, a bool, a number: Python code reads it as in eager PyTorch)
                made = any(isinstance(t, torch.Tensor) for t in tree_leaves(out))
                if not made or _replayable(func):
                    self._note(out, (func, args, kwargs, False), self._roots(leaves))
                    return out
        # (traced as before: the folded tensors it reads become graph values; `folded[h_index]` as fx records
        # `h[h_index]`, operator.getitem, not a call of the method `__getitem__`)
        args, kwargs = tree_map(lambda v: self.emit(v) if self.folded(v) else v, (args, kwargs))
        return _replay(func, args, kwargs)


def _item_at(proxy, positions, k: int):
    """The ``k``-th tensor of a call's output ``proxy``, whose structure ``positions`` holds leaf numbers."""
    if isinstance(positions, int):
        return proxy
    items = positions.items() if isinstance(positions, dict) else enumerate(positions)
    for key, sub in items:
        if k in tree_leaves(sub):
            return _item_at(proxy[key], sub, k)
    raise KeyError(k)
