"""Shape-specializing tracing: ``torch.fx`` tracing with each traced value's shape, dtype and device known.

``torch.fx`` traces on stand-ins (``Proxy``) that know nothing of the tensors they stand for, so Python code that
branches on a size (``if batch_size != position_ids.shape[0]:``, Hugging Face's attention-mask preparation) cannot
be traced. A memfit plan is made for the example batch's shapes anyway, so where such a line stops the trace,
:func:`memfit.graph.capture.capture` traces again with :class:`ShapeSpecializing`: each node also gets its value on
a fake tensor (``torch._subclasses.FakeTensorMode``: shapes, dtypes and devices, no data), and ``.shape``,
``.size()``, ``.dim()``, ``.numel()``, ``.dtype``, ``.device`` and ``len()`` of a traced tensor give the example's
values, as a Python ``if`` on them does; tensors made from plain numbers alone (``torch.arange(seq_len)``) are
computed for real, so Python tests of their values run too (:mod:`memfit.graph.folded`). The graph then holds for
those shapes, dtypes and that autocast state only (:class:`Specialized`): :class:`memfit.runtime.planned.PlannedModule`
traces smaller inputs again and runs the plan on that trace where it applies (:mod:`memfit.runtime.reshaped`), and
runs the user's model as PyTorch does for others.

This is the method of fx's ``MetaTracer`` and of Hugging Face's former ``HFTracer`` (shape propagation on
meta/fake tensors during symbolic tracing), on PyTorch's ``FakeTensorMode``. Data-dependent control flow on the
inputs, parameters or buffers (``if x.sum() > 0:``, ``.item()``) stays refused: a fake tensor holds no values.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import operator
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

from memfit.graph.attributes import hooks_of, put_back_hooks, reads_paused
from memfit.graph.augmented import InplaceProxy, user_line
from memfit.graph.folded import FOLDED_FACTORIES, Folding, FoldingAborted

try:  # (private to fx: the patches of Module.__call__ and wrapped functions, taken off for a block)
    from torch.fx._symbolic_trace import _maybe_revert_all_patches
except ImportError:  # pragma: no cover - older or newer torch without it
    _maybe_revert_all_patches = contextlib.nullcontext

FAKE = "memfit_fake"  # node.meta key: the node's value on fake tensors
_MISSING = object()
# the fake-tensor mode of each model traced with shapes, with the layout of its parameters and buffers then
_FAKE_MODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# what a traced tensor answers with the example's values (the rest stays traced)
_SIZED = frozenset({"shape", "ndim", "dtype", "device", "layout", "size", "dim", "numel", "nelement",
                    "is_floating_point", "is_complex", "element_size", "is_cuda", "is_sparse"})
# grad-mode switches as PyTorch has them (capture replaces them while tracing, to refuse torch.no_grad() in forward;
# fake tensors use them internally)
_GRAD_MODE = (torch._C._set_grad_enabled, torch.autograd.grad_mode.inference_mode.__enter__)


@dataclass(frozen=True)
class Specialized:
    """What a shape-specialized trace holds for: the forward's arguments' structure (a list's length, a dict's
    keys: ``for i in idx`` ran as often as the example's list is long) and the shapes and dtypes of the tensors in
    them, by argument name (``{"input_ids": (<leaf>, [([2, 32], torch.int64)])}``), the autocast state it was traced
    in (``(enabled, dtype)`` on the inputs' device type), and ``line``: the line whose Python code stopped the
    plain trace (reading a size), which made memfit specialize."""

    inputs: dict[str, tuple[Any, list[tuple[list[int], torch.dtype]]]]
    autocast: tuple[bool, torch.dtype | None]
    line: str

    @staticmethod
    def of(examples: dict[str, Any], line: str) -> Specialized:
        """The :class:`Specialized` for a trace of the arguments ``examples`` (name -> value) in the autocast state
        of now."""
        return Specialized({name: _signature(v) for name, v in examples.items()},
                           autocast_state(_device_type(examples)), line)

    def differs(self, env: dict[str, Any]) -> tuple[str, str] | None:
        """How the bound arguments ``env`` (name -> value) differ from what the trace holds for: ``(kind, words for a
        warning)``, the kind ``"structure"`` (a list's length, a dict's keys), ``"dtypes"``, ``"shapes"`` (only they
        differ) or ``"autocast"``; or ``None`` where they match."""
        def said(k):
            return ", ".join(f"{shape} {str(dtype).removeprefix('torch.')}" for shape, dtype in k) or "none"

        found = {}  # kind -> words for the first argument that differs so (structure, then dtypes, then shapes: a
        # smaller batch with a bool mask was told of its smaller ids only, and that they were larger than planned)
        for name, (structure, kinds) in self.inputs.items():
            now_structure, now = _signature(env.get(name))
            if now_structure != structure:
                found.setdefault("structure", (
                    f"{name} is a {type(env.get(name)).__name__} of {now_structure.num_leaves} items (planned: "
                    f"{structure.num_leaves})" if now_structure.num_leaves != structure.num_leaves else
                    f"{name} has other keys or container types than planned"))
            elif now != kinds:
                dtypes = len(now) != len(kinds) or any(a[1] != b[1] for a, b in zip(now, kinds))
                found.setdefault("dtypes" if dtypes else "shapes",
                                 f"{name} has tensors {said(now)} (planned: {said(kinds)})")
        for kind in ("structure", "dtypes"):
            if kind in found:
                return kind, found[kind]
        if autocast_state(_device_type(env)) != self.autocast:  # (before shapes: a smaller batch under autocast
            enabled, dtype = self.autocast                       # is not a smaller batch the plan applies to)
            return "autocast", ("another autocast state than at planning "
                                f"({'autocast to ' + str(dtype) if enabled else 'no autocast'})")
        return ("shapes", found["shapes"]) if "shapes" in found else None

    def larger(self, env: dict[str, Any]) -> tuple:
        """``(argument, tensor, dimension)`` of each size in ``env`` larger than the trace's, for arguments of the
        trace's structure, dtypes and autocast state (:meth:`differs` says ``"shapes"``): none, and the plan's
        decisions can apply to a trace of their shapes (:mod:`memfit.runtime.reshaped`); a longer sequence and a
        larger batch are different changes."""
        return tuple((name, k, d) for name, (_, kinds) in self.inputs.items()
                     for k, ((shape, _), (planned, _)) in enumerate(zip(_signature(env.get(name))[1], kinds))
                     for d, (a, b) in enumerate(zip(shape, planned)) if a > b)

    def shapes(self, env: dict[str, Any]) -> tuple:
        """The shapes of the tensors in the bound arguments ``env``, by argument: a key for a trace of them."""
        return tuple((name, tuple(tuple(shape) for shape, _ in _signature(env.get(name))[1]))
                     for name in self.inputs)


def _signature(value) -> tuple[Any, list[tuple[list[int], torch.dtype]]]:
    """``(pytree structure, [(shape, dtype) of each tensor])`` of an argument's value."""
    leaves, structure = tree_flatten(value)
    return structure, [(list(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor)]


def _device_type(values: dict[str, Any]) -> str:
    return next((t.device.type for t in tree_leaves(list(values.values())) if isinstance(t, torch.Tensor)), "cpu")


def autocast_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    """``(enabled, dtype)`` of autocast on ``device_type`` now."""
    enabled = torch.is_autocast_enabled(device_type)
    return enabled, (torch.get_autocast_dtype(device_type) if enabled else None)


# tensor factories, recorded as graph nodes while tracing with the example's shapes (their sizes, dtype and device are
# plain values then, `torch.zeros(b, 10, dtype=h.dtype, device=h.device)`, and fx would make the tensor once, while
# tracing, as a constant of the graph: a write into it was refused); those of memfit.graph.folded.FOLDED_FACTORIES
# are computed for real, and recorded where a traced operation reads them
_RANDOM_FACTORIES = ("rand", "randn", "randint", "randperm", "normal")  # (drawn in every step, as PyTorch draws)
_FACTORIES = ("zeros", "ones", "full", "empty", "arange", "eye", "linspace", *_RANDOM_FACTORIES)
_RECORDING: list[ShapeSpecializing] = []  # the tracer recording factories (none inside _untraced)


@contextlib.contextmanager
def _recorded_factories(tracer: ShapeSpecializing) -> Iterator[None]:
    """While ``tracer`` traces, ``torch.zeros(...)`` and the other :data:`_FACTORIES` called from the traced code
    (not from :func:`_untraced` code, nor with ``out=``) become graph nodes; ``torch`` is put back on exit."""
    real = {name: getattr(torch, name) for name in _FACTORIES}
    # (PyTorch's caches of its functions, filled at their first use, which may come while tracing: filled with these
    # wrappers, they kept the first traced model, its example batch and graph alive for the whole process)
    torch.overrides.get_ignored_functions()
    torch.overrides.get_overridable_functions()

    def recorded(name, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if _RECORDING and _RECORDING[-1] is tracer and kwargs.get("out") is None:
                if (tracer.folding is not None and name in FOLDED_FACTORIES
                        and not any(isinstance(v, fx.Proxy) for v in tree_leaves((args, kwargs)))
                        and tracer.folding.folds_next_factory()):
                    return tracer.folding.factory(fn, args, kwargs)
                return tracer.create_proxy("call_function", fn, args, kwargs)
            return fn(*args, **kwargs)
        return call

    for name, fn in real.items():
        setattr(torch, name, recorded(name, fn))
    _RECORDING.append(tracer)
    try:
        yield
    finally:
        _RECORDING.remove(tracer)
        for name, fn in real.items():
            setattr(torch, name, fn)


@contextlib.contextmanager
def _untraced(patches: bool = True) -> Iterator[None]:
    """Run the model's code for real inside a trace: fx's patches (``Module.__call__``, wrapped functions; with
    ``patches``), memfit's attribute log and the trace's Python dispatch modes (random draws, state writes) off, and
    PyTorch's grad-mode switches back."""
    patched = (torch._C._set_grad_enabled, torch.autograd.grad_mode.inference_mode.__enter__)
    torch._C._set_grad_enabled, torch.autograd.grad_mode.inference_mode.__enter__ = _GRAD_MODE
    recording = _RECORDING[:]
    _RECORDING.clear()
    profiler = sys.getprofile()  # (memfit's log of the user's functions, attributes.record_calls: what runs here is
    sys.setprofile(None)         # not traced, and fake tensors' Python under that hook took most of a trace's time)
    try:
        with _maybe_revert_all_patches() if patches else contextlib.nullcontext(), reads_paused(), \
                _disable_current_modes():
            yield
    finally:
        sys.setprofile(profiler)
        _RECORDING[:] = recording
        torch._C._set_grad_enabled, torch.autograd.grad_mode.inference_mode.__enter__ = patched


@contextlib.contextmanager
def _hooks_off(module: torch.nn.Module) -> Iterator[None]:
    """The hooks of ``module`` and of its submodules off while the block runs: a module with hooks is one node (memfit
    runs its hooks in every step), and its value on fake tensors is its forward's (a user's hook would keep fake
    tensors; Hugging Face's gradient checkpointing hooks the input embedding's output, and its output recorder a
    mixture-of-experts router inside a hooked layer: the router logits it kept were fake tensors, which reached the
    load-balancing loss)."""
    saved = hooks_of(module)
    for registry, _ in saved:
        registry.clear()
    try:
        yield
    finally:
        put_back_hooks(saved)


class SizedProxy(InplaceProxy):
    """:class:`InplaceProxy` that answers ``.shape``, ``.size()``, ``.dim()``, ``.dtype``, ... and ``len()`` with its
    value on fake tensors (where known): plain Python values, so Python code on them runs as in eager PyTorch."""

    def __getattr__(self, k: str):
        value = self.node.meta.get(FAKE, _MISSING)
        if k in _SIZED and isinstance(value, torch.Tensor):
            return getattr(value, k)
        if k in ("keys", "values", "items") and isinstance(value, dict):  # (a dict argument: its keys, as planned)
            return {"keys": lambda: list(value), "values": lambda: [self[key] for key in value],
                    "items": lambda: [(key, self[key]) for key in value]}[k]
        return _SizedAttribute(self, k)

    def __len__(self) -> int:
        value = self.node.meta.get(FAKE, _MISSING)
        if isinstance(value, (torch.Tensor, tuple, list, dict)):
            return len(value)
        return super().__len__()


class _SizedAttribute(fx.proxy.Attribute, SizedProxy):
    """fx's lazily recorded attribute (``h.T``, ``h.view``) as a :class:`SizedProxy`."""


class ShapeSpecializing:
    """Mixin for a ``torch.fx.Tracer``: each node it creates gets its value on fake tensors in ``node.meta[FAKE]``
    (computed from the example arguments ``examples``, by name), and its proxies are :class:`SizedProxy`. A node
    whose value cannot be computed (data-dependent output) has none, and its proxy behaves as fx's."""

    def __init__(self, examples: dict[str, Any], *args, fold: bool | frozenset[int] = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.examples = examples
        self.unknown: list[str] = []  # the first operation whose value could not be computed on fake tensors
        # compute tensors made from plain numbers for real (memfit.graph.folded); a frozenset: all but those of the
        # factory calls it numbers (Folding's unfolded)
        self.fold = fold
        self.folding: Folding | None = None

    def fake(self, value):
        """``value`` with each tensor in it as a fake tensor of this trace."""
        return tree_map(lambda t: self.fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, value)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return SizedProxy(node, self)

    def trace(self, root, concrete_args=None):
        """fx's; an exception raised gets ``memfit_unknown``: the first operation whose shapes memfit could not
        compute (``[]`` where none), for the error message."""
        # (fake tensors' logged tracebacks: "failed while attempting to run meta", reported once in memfit's error;
        # and where a fake tensor reached the user's code, a fresh user saw 128 lines)
        quiet = logging.getLogger("torch._subclasses.fake_tensor")
        was, quiet.disabled = quiet.disabled, True
        if isinstance(root, torch.nn.Module):  # (one mode per model: its parameters made fake once, not per trace)
            self.fake_mode = _fake_mode_of(root, self.fake_mode)
        if self.fold is not False:
            state = {id(t) for t in itertools.chain(root.parameters(), root.buffers())}
            self.folding = Folding(self, state, user_line,
                                   self.fold if isinstance(self.fold, frozenset) else frozenset())
        try:
            with _recorded_factories(self), self.folding or contextlib.nullcontext():
                return super().trace(root, concrete_args)
        except FoldingAborted:
            raise
        except Exception as exc:
            exc.memfit_unknown = self.unknown
            raise
        finally:
            quiet.disabled = was
            self.folding = None

    def create_arg(self, a):
        """fx's; a folded tensor (:mod:`memfit.graph.folded`) as the operations that made it."""
        if self.folding is not None and isinstance(a, torch.Tensor) and self.folding.folded(a):
            return self.folding.emit(a).node
        return super().create_arg(a)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        value = self._value(node)
        if value is not _MISSING:
            node.meta[FAKE] = value
        return node

    def _value(self, node: fx.Node):
        # (fake tensors' "failed while attempting to run meta" logs are off: see trace; fx's patches stay on for
        # PyTorch's own operations, which call no module and no wrapped function: taking them off and putting them
        # back at each node took a quarter of a trace's time)
        with _untraced(patches=not _torch_operation(node)):
            return self._computed(node)

    def _computed(self, node: fx.Node):
        if node.op == "placeholder":
            name = str(node.target).lstrip("*")
            return self.fake(self.examples[name]) if name in self.examples else _MISSING
        if node.op == "get_attr":
            try:
                return self.fake(operator.attrgetter(str(node.target))(self.root))
            except AttributeError:
                return _MISSING
        if node.op not in ("call_function", "call_method", "call_module"):
            return _MISSING
        unknown = []

        def fake_of(n: fx.Node):
            value = n.meta.get(FAKE, _MISSING)
            if value is _MISSING:
                unknown.append(n)
            return value

        args, kwargs = fx.node.map_arg((node.args, node.kwargs), fake_of)
        if unknown:
            return _MISSING
        try:
            with self.fake_mode, _ZerosForShapes(self):
                if node.op == "call_function":
                    return node.target(*args, **kwargs)
                if node.op == "call_method":
                    return getattr(args[0], node.target)(*args[1:], **kwargs)
                module = self.root.get_submodule(node.target)
                state = {name: self.fake(t) for name, t in
                         [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]}
                with _hooks_off(module):
                    return torch.func.functional_call(module, state, tuple(args), kwargs)
        except Exception as exc:  # noqa: BLE001 -- (data-dependent, or not computable on fake tensors: traced as fx does)
            if not self.unknown:  # (the first: where the example's shapes stopped being known)
                self.unknown.append(f"{node.op} {getattr(node.target, '__name__', node.target)} "
                                    f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})")
            return _MISSING

    def to_bool(self, obj: fx.Proxy) -> bool:
        """A test of sizes, dtypes or devices (``if torch.numel(x) > 1:``) as its value on the example; any other
        (``if h.sum() > 0:``, ``if x.requires_grad:``: a fake tensor's answer need not be the real one's) as fx
        refuses it."""
        value = obj.node.meta.get(FAKE, _MISSING)
        if isinstance(value, (bool, int, float)) and _from_sizes(obj.node):
            return bool(value)
        try:
            return super().to_bool(obj)
        except fx.proxy.TraceError as exc:  # (OPT's layer drop, `if torch.rand([]) < self.layerdrop:`, was told to
            exc.memfit_drawn = _drawn(obj.node)  # wrap transformers' whole call in a function of its own)
            raise

    def iter(self, obj: fx.Proxy):
        """A tuple, list or tensor of known length (``torch.chunk(h, 4)``, ``for row in x``) as its items; a dict
        as its keys."""
        value = obj.node.meta.get(FAKE, _MISSING)
        if isinstance(value, (tuple, list)) or (isinstance(value, torch.Tensor) and value.dim() > 0):
            return iter([obj[k] for k in range(len(value))])
        if isinstance(value, dict):
            return iter(list(value))
        return super().iter(obj)


# operations that draw random numbers, by name (a random draw the test of a Python `if` depends on)
_DRAWS = frozenset(_RANDOM_FACTORIES) | {"bernoulli", "multinomial", "poisson", "rand_like", "randn_like",
                                          "randint_like", "bernoulli_", "uniform_", "normal_", "random_",
                                          "exponential_", "geometric_", "cauchy_", "log_normal_", "dropout"}


def _drawn(node: fx.Node) -> bool:
    """Whether ``node``'s value depends on a random draw made in the graph (``torch.rand([]) < p``)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("call_function", "call_method") and getattr(n.target, "__name__", n.target) in _DRAWS:
            return True
        todo += n.all_input_nodes
    return False


def _fake_mode_of(model: torch.nn.Module, fresh: FakeTensorMode) -> FakeTensorMode:
    """The fake-tensor mode ``model`` was last traced with where its parameters and buffers are the same tensors with
    the same layouts and storages since (a trace again for other shapes, :mod:`memfit.runtime.reshaped`, then finds
    their fake tensors made: making them again took a fifth of a small transformer's trace); else ``fresh``. (A fake
    mode remembers a tensor by identity: after ``model.half()``, which swaps each parameter's data, it would answer
    with the float32 fake.)"""
    layout = tuple((id(t), tuple(t.shape), t.stride(), t.dtype, t.device, t.untyped_storage().data_ptr())
                   for t in itertools.chain(model.parameters(), model.buffers()) if t.layout == torch.strided)
    kept = _FAKE_MODES.get(model)
    if kept is not None and kept[1] == layout:
        return kept[0]
    _FAKE_MODES[model] = (fresh, layout)
    return fresh


def _torch_operation(node: fx.Node) -> bool:
    """Whether ``node`` is a method of a tensor or a function of PyTorch's operators or Python's (``torch.cat``,
    ``F.linear``, ``operator.add``), which calls no ``nn.Module`` and none of the functions ``torch.fx`` patches."""
    if node.op == "call_method":
        return isinstance(node.args[0], fx.Node) and isinstance(node.args[0].meta.get(FAKE), torch.Tensor)
    if node.op != "call_function":
        return False
    where = getattr(node.target, "__module__", None) or ""
    return (where in ("torch", "_operator", "builtins", "math") or where.startswith(("torch._C", "torch._ops"))
            or isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)))


# operations whose output shapes do not depend on the values of their inputs, but whose shape function refuses what
# their kernel takes: `torch._grouped_mm`'s accepts only bfloat16 and float16, its CPU kernel float32 too
# (transformers' mixture-of-experts layers: Mixtral, Qwen2-MoE); their shapes are those of a run on zeros
_RUN_FOR_SHAPES = frozenset(fn for fn in (getattr(torch, "_grouped_mm", None),
                                          getattr(torch.nn.functional, "grouped_mm", None)) if fn is not None)


class _ZerosForShapes(TorchFunctionMode):
    """While a node's value is computed on fake tensors (a module's forward included), each of
    :data:`_RUN_FOR_SHAPES` whose shape function fails runs on real zero tensors of its inputs' shapes, strides,
    dtypes and devices (grad mode off), and its output becomes a fake tensor of ``tracer``'s."""

    def __init__(self, tracer: ShapeSpecializing):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _RUN_FOR_SHAPES:
            return func(*args, **kwargs)
        try:
            return func(*args, **kwargs)
        except RuntimeError:
            def real(v):
                if isinstance(v, torch.Tensor):
                    return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device).zero_()
                return v

            with _disable_current_modes(), torch.no_grad():
                out = func(*tree_map(real, args), **tree_map(real, kwargs))
            return self.tracer.fake(out)


# operations on sizes whose result is still a size, dtype or device fact
_ON_SIZES = frozenset(v for v in vars(operator).values() if callable(v)) | {len, int, float, bool, min, max, abs}


def _from_sizes(node: fx.Node) -> bool:
    """Whether ``node`` computes from sizes, dtypes and devices alone (``x.size(0) == y.numel()``): its value on fake
    tensors is the real one's."""
    if node.op == "call_method":
        return node.target in _SIZED
    if node.op != "call_function":
        return False
    if node.target is getattr:
        return node.args[1] in _SIZED
    if node.target is torch.numel:
        return True
    return node.target in _ON_SIZES and all(_from_sizes(n) for n in node.all_input_nodes)
