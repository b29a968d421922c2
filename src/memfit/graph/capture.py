"""Trace an ``nn.Module`` with ``torch.fx`` into a :class:`~memfit.graph.ir.Graph`."""

from __future__ import annotations

import contextlib
import copy
import dis
import functools
import inspect
import io
import itertools
import operator
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit.graph.asserts import with_assert_values
from memfit.graph.attributes import (
    AttributeLog,
    collecting_now,
    collects_in_call,
    has_own_hooks,
    hooks_of,
    put_back_hooks,
    record_calls,
    record_reads,
    renormed_parameters,
)
from memfit.graph.augmented import (
    WRITE_LINE,
    InplaceProxy,
    keep_in_place,
    put_back_updated_state,
    state_of,
    user_line,
    writes_into,
    written_constants,
    written_operands,
)
from memfit.graph.calls import (
    dataclass_builder,
    dataclass_parts,
    forward_params,
    in_traced_order,
    numpy_scalar_as_python,
    plain_scalar,
    rebuilt_of_its_class,
    setting_constant,
    tensors_in,
)
from memfit.graph.folded import FoldingAborted
from memfit.graph.ir import Graph, Node
from memfit.graph.sized import ShapeSpecializing, Specialized
from memfit.warn import in_library, warn_user


class TraceError(RuntimeError):
    """The model could not be traced by ``torch.fx``; the message names the failing line and the fix."""


class ForwardRaisedError(TraceError, ValueError):
    """The forward pass raised an exception of its own (a raise statement of the user's) while traced: an error on
    these inputs, as plain PyTorch would raise it (a ``ValueError``, like any forward pass that fails on the example
    inputs), not a limit of tracing."""


def _raised_by_user(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a raise statement in the user's code (not torch's, nor an installed package's): the
    innermost frame is the user's (`if x.shape[-1] != D: raise ValueError(...)` on one line failed in fx's test of
    the condition, not in the raise)."""
    line = _user_frame(exc)
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (not line.startswith("inside torch") and _library_call(exc) is None
            and (tb is None or _users(tb.tb_frame.f_code.co_filename))
            and re.search(r"(^|: )\s*raise\b", line) is not None)


def _installed(filename: str) -> bool:
    """``filename`` belongs to a package pip installed (``einops/einops.py`` beside ``einops-0.8.2.dist-info``, in
    site-packages or a ``--target`` directory), not to the user's own files."""
    return _package_root(filename) is not None


def _package_root(filename: str) -> tuple[str, str] | None:
    """``(directory, package)`` of the installed package holding ``filename`` (:func:`_installed`), or ``None``."""
    path = os.path.abspath(filename)
    parts = path.split(os.sep)
    for k in range(len(parts) - 1, max(len(parts) - 8, 1), -1):
        directory, top = os.sep.join(parts[:k - 1]) or os.sep, parts[k - 1].removesuffix(".py")
        if _has_dist_info(directory, top.replace("-", "_").lower()):
            return directory, top
    return None


@functools.lru_cache(maxsize=256)
def _has_dist_info(directory: str, package: str) -> bool:
    try:
        return any(e.endswith((".dist-info", ".egg-info")) and e.split("-")[0].replace("-", "_").lower() == package
                   for e in os.listdir(directory))
    except OSError:
        return False


def _library_call(exc: BaseException) -> tuple[str, str, str] | None:
    """``(package, function, line)`` where ``exc`` was raised inside an installed package other than torch (einops'
    ``rearrange``): the package's function the user's code called, and the user's line that called it."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _users(f.filename)]
    if not frames or not _installed(frames[-1].filename):
        return None
    own = [k for k, f in enumerate(frames) if not _installed(f.filename)]
    if not own:
        return None
    caller = frames[own[-1]]
    entry = frames[own[-1] + 1] if own[-1] + 1 < len(frames) else frames[-1]
    package = (_package_root(entry.filename) or ("", "a package"))[1]
    return package, entry.name, f"{caller.filename}:{caller.lineno} in {caller.name}: {caller.line}"


@dataclass
class Captured:
    """A traced model: the fx ``GraphModule`` (sharing parameters and buffers with the user's model),
    its plain-data :class:`Graph`, the model itself, and the plain Python attributes its forward pass read
    while tracing (``{module path: {attribute: value}}``, :mod:`memfit.graph.attributes`): the graph holds
    their values as constants. ``called``: ``(code, globals)`` of the user's Python functions that ran while
    tracing (:func:`memfit.graph.attributes.global_reads` watches the globals they read). ``fixed_args``: the
    forward's arguments traced as a value (``None``, a flag: :func:`capture`), by name: the graph holds for it only;
    ``unread_args``: those its own code never reads, whose other values change nothing; ``autocast_tests``: the lines
    of the user's code that read the autocast state while tracing (``torch.is_autocast_enabled()``)."""

    gm: fx.GraphModule
    graph: Graph
    model: nn.Module | None = None
    attributes: dict[str, dict[str, Any]] = field(default_factory=dict)
    called: list = field(default_factory=list)
    fixed_args: dict[str, Any] = field(default_factory=dict)
    unread_args: tuple[str, ...] = ()
    autocast_tests: tuple[str, ...] = ()
    specialized: Specialized | None = None


def _in_torch(filename: str) -> bool:
    """Whether ``filename`` is in torch's own package (not torchvision's, whose path starts alike: a fresh user's
    DenseNet was shown fx's line, inside torch, instead of torchvision's ``if tensor.requires_grad:``)."""
    return filename.startswith(os.path.dirname(torch.__file__) + os.sep)


def _in_numpy(filename: str) -> bool:
    """Whether ``filename`` is numpy's (its Python files, or a compiled module's ``.pyx`` source: a fresh user's
    ``np.random.rand(x.shape[1])`` was shown ``numpy/random/_common.pyx:309`` as the failing line)."""
    numpy = sys.modules.get("numpy")
    return filename.endswith(".pyx") or (numpy is not None and numpy.__file__ is not None
                                         and filename.startswith(os.path.dirname(numpy.__file__) + os.sep))


def _users(filename: str) -> bool:
    """Whether ``filename`` is the user's code: neither torch's, numpy's nor memfit's tracing."""
    return not _in_torch(filename) and not _in_numpy(filename) and "memfit/graph" not in filename


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch: the user's line that fx could not trace."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if _users(f.filename)]
    if not user:  # it failed inside one of torch's own modules (nn.TransformerEncoderLayer's fast-path checks)
        if not frames:
            return "(no traceback)"
        f = frames[-1]
        return f"inside torch, {f.filename}:{f.lineno} in {f.name}: {f.line}"
    f = user[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {f.line}"


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or repr(t)


def _block(node: fx.Node) -> str:
    """The enclosing block: the module path two levels deep (``layer1.0``), or one level (``features``)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] if isinstance(v, tuple) else str(k) for k, v in stack.items()]
    paths = [p.split("@")[0] for p in paths]
    if not paths:
        return ""
    parts = paths[-1].split(".")
    depth = 2 if len(parts) >= 2 and parts[1].isdigit() else 1
    return ".".join(parts[:depth])


class _GradModeChange(Exception):
    """The traced forward switched autograd's grad mode (raised inside :func:`_refuse_grad_mode_changes`)."""


@contextlib.contextmanager
def _refuse_grad_mode_changes():
    """While tracing, raise :class:`_GradModeChange` where the forward enters ``torch.no_grad()``,
    ``torch.enable_grad()``, ``torch.set_grad_enabled(...)`` or ``torch.inference_mode()``: ``torch.fx``
    does not record grad mode, so the traced graph would silently compute gradients there (seen: a frozen
    teacher under ``torch.no_grad()`` got gradients)."""
    real_set, real_inference = torch._C._set_grad_enabled, torch.autograd.grad_mode.inference_mode.__enter__

    def refuse(*args, **kwargs):
        raise _GradModeChange()

    torch._C._set_grad_enabled = refuse
    torch.autograd.grad_mode.inference_mode.__enter__ = refuse
    try:
        yield
    finally:
        torch._C._set_grad_enabled = real_set
        torch.autograd.grad_mode.inference_mode.__enter__ = real_inference


class _AutocastBlock(Exception):
    """The traced forward entered ``torch.autocast`` (raised inside :func:`_refuse_autocast_blocks`)."""


@contextlib.contextmanager
def _refuse_autocast_blocks():
    """While tracing, raise :class:`_AutocastBlock` where the forward enters ``torch.autocast`` (a ``with`` block, a
    decorated submodule, ``enabled=False`` around a float32 head): ``torch.fx`` does not record it, so the graph
    would run that part in the caller's precision (fresh users' outputs 3.5e-3 to 1.1e-2 off, reported as "a Python
    test in forward"). An ``enabled=False`` block traced outside autocast changes nothing and is let through (the
    planned module warns where it is called under another autocast state than at planning)."""
    real = torch.amp.autocast_mode.autocast.__enter__

    def refuse(self, *args, **kwargs):
        device = getattr(self, "device", "cpu")
        if not getattr(self, "_enabled", True) and not torch.is_autocast_enabled(device):
            return real(self, *args, **kwargs)  # (off inside off: nothing changes; a call under autocast is warned)
        raise _AutocastBlock()

    torch.amp.autocast_mode.autocast.__enter__ = refuse
    try:
        yield
    finally:
        torch.amp.autocast_mode.autocast.__enter__ = real


_AUTOCAST_STATE = ("is_autocast_enabled", "is_autocast_cpu_enabled", "get_autocast_dtype", "get_autocast_cpu_dtype",
                   "get_autocast_gpu_dtype")


@contextlib.contextmanager
def _watch_autocast_tests(seen: list[str]):
    """While tracing, note in ``seen`` the user's line of each call of ``torch.is_autocast_enabled()`` (and the
    autocast dtype getters) from the user's code: fx runs such a test once, so the graph holds the planning state's
    branch, and :class:`memfit.runtime.planned.PlannedModule` refuses a call in another autocast state."""
    real = {name: getattr(torch, name) for name in _AUTOCAST_STATE if hasattr(torch, name)}

    def watched(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if not in_library(caller):
                seen.append(user_line())
            return fn(*args, **kwargs)
        return call

    for name, fn in real.items():
        setattr(torch, name, watched(fn))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(torch, name, fn)


_DRAW_ADVICE = ("Draw it from the tensors of the step: `keep = x.new_empty(()).bernoulli_(1 - p)` then "
                "`x + f(x) * keep / (1 - p)` for a whole branch (it is computed at every step, and zeroed when "
                "dropped), `x.new_empty(x.shape[0], 1, 1, 1).bernoulli_(1 - p)` per sample (as torchvision's "
                "StochasticDepth does), `torch.randn_like(x)` for noise, `torch.rand_like(x[0]) > 0.5` for a mask, "
                "`torch.rand_like(x[:, 0]).argsort()` for a permutation of the batch (for torch.randperm(n)).")
_PY_RANDOM = ("random", "uniform", "randint", "randrange", "choice", "choices", "gauss", "normalvariate",
              "shuffle", "sample", "betavariate", "expovariate", "triangular")
# numpy.random's functions on its global generator (a draw through them was caught by the generator's state alone,
# without the user's line)
_NP_RANDOM = ("rand", "randn", "random", "random_sample", "ranf", "sample", "uniform", "normal", "randint",
              "random_integers", "choice", "permutation", "shuffle", "binomial", "bernoulli", "beta", "exponential",
              "gamma", "poisson", "standard_normal", "laplace", "lognormal", "multinomial", "dirichlet")


class _SeededOps(TorchDispatchMode):
    """Notes the user's line (in ``seen``) of each operator that draws from a random generator
    (``torch.Tag.nondeterministic_seeded``) and runs while tracing: on concrete tensors, so outside the graph."""

    def __init__(self, seen: list[str]):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen.append(_call_site())
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _watch_random_draws(seen: list[str]):
    """While tracing, note where the forward draws a random number outside the graph (``torch.rand(1).item() < p``,
    ``random.random()``): fx runs such a draw once, while tracing, and the plan keeps its value for good (a fresh
    user's stochastic depth kept a residual branch at every step). Lines go in ``seen``; a draw the watch cannot
    place (``numpy.random``, a ``from random import random``) is caught by the generators' states changing, noted
    as ``"?"``. Every generator is put back as it was."""
    import random
    import sys

    numpy = sys.modules.get("numpy")
    states = (torch.get_rng_state(), random.getstate(), numpy.random.get_state() if numpy is not None else None)
    real = [(random, name, getattr(random, name)) for name in _PY_RANDOM if hasattr(random, name)]
    if numpy is not None:
        real += [(numpy.random, name, getattr(numpy.random, name)) for name in _NP_RANDOM
                 if hasattr(numpy.random, name)]

    def watched(f):
        def draw(*args, **kwargs):
            seen.append(_call_site())
            return f(*args, **kwargs)
        return draw

    for owner, name, f in real:
        setattr(owner, name, watched(f))
    try:
        with _SeededOps(seen):
            yield
    finally:
        for owner, name, f in real:
            setattr(owner, name, f)
        after = (torch.get_rng_state(), random.getstate(), numpy.random.get_state() if numpy is not None else None)
        changed = (not torch.equal(states[0], after[0]) or states[1] != after[1]
                   or (numpy is not None and any(not numpy.array_equal(a, b) if hasattr(a, "shape") else a != b
                                                 for a, b in zip(states[2], after[2]))))
        if changed and not seen:
            seen.append("?")
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        if numpy is not None:
            numpy.random.set_state(states[2])


class _StateWrite(Exception):
    """The traced forward wrote, in place, into a parameter or buffer of the model held as a concrete tensor (raised
    by :class:`_ConcreteStateWrites` before the write runs)."""

    def __init__(self, name: str, line: str):
        super().__init__(name)
        self.name, self.line = name, line


# storages of the tensors the trace under way keeps as constants of its graph (``_tensor_constant<i>``, made from
# plain numbers: `e = torch.ones(4)` read by a traced operation), which a later write on concrete tensors would
# change after the graph read them (:class:`_ConcreteStateWrites`)
_BAKED: list[set[int]] = []


@contextlib.contextmanager
def _baked_constants():
    """Note, while the block traces, the storages of the tensors the graph keeps as constants (:data:`_BAKED`)."""
    _BAKED.append(set())
    try:
        yield
    finally:
        _BAKED.pop()


class _ConstantWrite(_StateWrite):
    """The traced forward wrote, in place and on concrete tensors, into a tensor the graph keeps as a constant."""


class _AttributeWrite(_StateWrite):
    """The traced forward wrote, in place, into a tensor kept as a plain attribute of a module (not a registered
    parameter or buffer)."""


def _plain_tensor_attributes(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the modules of ``model`` keep as plain attributes (``self.stat = torch.zeros(4)``, not registered
    with ``register_buffer``), by qualified name (as torch.fx names them in ``get_attr`` nodes)."""
    found = {}
    for path, module in model.named_modules():
        for key, value in vars(module).items():
            if (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.device.type != "meta"
                    and value.layout == torch.strided):  # (a sparse tensor has no storage to watch)
                found.setdefault(f"{path}.{key}".lstrip("."), value)
    return found


def _attribute_write_error(model: nn.Module, name: str, line: str) -> TraceError:
    leaf = name.rsplit(".", 1)[-1]
    return TraceError(
        f"the forward pass of {type(model).__name__} writes in place into {name}, a tensor kept as a plain attribute "
        "(not registered as a buffer): torch.fx keeps such a tensor as a constant of the graph, and a write into it "
        "runs once, while tracing, or into a copy, so the planned step would not update it as PyTorch does (a "
        "fresh user's running mean: loss and gradients silently off).\n"
        f"  failing line: {line}\n"
        f"  Register it as a buffer in __init__, `self.register_buffer('{leaf}', torch.zeros(...))` "
        "(persistent=False keeps it out of state_dict()): the plan then updates it in every step, as PyTorch does, "
        "and it moves with the model between devices. Your model is as it was.")


class _ConcreteStateWrites(TorchDispatchMode):
    """While tracing, raises :class:`_StateWrite` where an operator that runs on concrete tensors (so outside the
    graph fx records) would write into the storage of one of the model's parameters or buffers (``state``: storage
    data pointer -> name). That is how a forward reaches them through ``self.parameters()``, a list of tensors or
    ``torch._foreach_*``, as a momentum (EMA) update of a target network is written: fx would run the write once,
    while tracing, changing the model, and the planned step never (a fresh user's BYOL-style target network stayed
    frozen while plain PyTorch's moved, and its online gradients drifted apart). Raised before the write, so the
    model is as it was."""

    def __init__(self, state: dict[int, str], trainable: set[int] = frozenset(),
                 attributes: dict[int, str] | None = None):
        super().__init__()
        self.state = state
        self.trainable = trainable  # storage pointers of the parameters that require grad
        self.attributes = attributes or {}  # storage pointer -> name of a tensor kept as a plain module attribute
        self.read_at: str | None = None  # the first line computing from one of them on concrete tensors

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.read_at is None and self.trainable and any(
                isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.trainable
                for t in tree_leaves((args, kwargs))):
            self.read_at = _call_site()
        for t in written_operands(func, args, kwargs):
            if name := self.state.get(t.untyped_storage().data_ptr()):
                raise _StateWrite(name, _call_site())
            if name := self.attributes.get(t.untyped_storage().data_ptr()):
                raise _AttributeWrite(name, _call_site())
            if _BAKED and t.untyped_storage().data_ptr() in _BAKED[-1]:
                raise _ConstantWrite("", _call_site())
        return func(*args, **kwargs)


class _ReentrantCheckpoint(Exception):
    """The traced forward called ``torch.utils.checkpoint`` with ``use_reentrant=True``."""


def _call_site() -> str:
    """The innermost frame of the current stack outside torch and memfit: the user's line."""
    frames = [f for f in traceback.extract_stack() if _users(f.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}: {frames[-1].line}" if frames else "?"


@contextlib.contextmanager
def _watch_user_checkpoints(seen: list[str]):
    """While tracing, note each call of ``torch.utils.checkpoint`` (its line, in ``seen``): fx traces through a
    non-reentrant checkpoint, so its function runs once in the graph and memfit plans recomputation itself; a
    reentrant one raises :class:`_ReentrantCheckpoint` (it runs its function under ``torch.no_grad()``)."""
    import torch.utils.checkpoint as cp

    # the non-reentrant generator's name differs between torch versions; checkpoint() looks it up at call time
    names = [n for n in ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")
             if hasattr(cp, n)]
    real = {n: getattr(cp, n) for n in names}
    real_apply = cp.CheckpointFunction.__dict__.get("apply")

    def watched(name):
        def generator(*args, **kwargs):
            if not seen or seen[-1] != _call_site():
                seen.append(_call_site())
            return real[name](*args, **kwargs)
        return generator

    def reentrant(*args, **kwargs):
        seen.append(_call_site())
        raise _ReentrantCheckpoint()

    for n in names:
        setattr(cp, n, watched(n))
    cp.CheckpointFunction.apply = reentrant
    try:
        yield
    finally:
        for n, f in real.items():
            setattr(cp, n, f)
        if real_apply is not None:
            cp.CheckpointFunction.apply = real_apply
        else:
            del cp.CheckpointFunction.apply


_LEAVES: dict[type, Callable] = {}  # autograd.Function subclass -> the graph's call of its apply


def _leaf_apply(cls: type) -> Callable:
    """The function a traced graph calls for ``cls.apply`` (one per class): PyTorch's own ``apply``, so that the
    class's ``forward`` and ``backward`` run as written."""
    if cls not in _LEAVES:
        real = torch.autograd.Function.__dict__["apply"]

        def apply(*args, **kwargs):
            return real.__get__(None, cls)(*args, **kwargs)

        apply.__name__ = apply.__qualname__ = f"{cls.__name__}_apply"
        apply.__module__ = cls.__module__
        apply.autograd_function = cls
        _LEAVES[cls] = apply
    return _LEAVES[cls]


@contextlib.contextmanager
def _autograd_functions_as_leaves():
    """While tracing, record each call of a ``torch.autograd.Function`` of the user's (not of torch's own) as one
    graph node that calls its ``apply``. Otherwise fx traces into its ``forward`` and the graph differentiates that
    with autograd's own formulas, never running the class's ``backward`` (seen: a straight-through rounding
    estimator trained with all-zero gradients, a side-effecting forward that ran only while tracing)."""
    Function = torch.autograd.Function
    real = Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        proxies = [a for a in tree_leaves((args, kwargs)) if isinstance(a, fx.Proxy)]
        if proxies and not cls.__module__.startswith("torch."):
            return proxies[0].tracer.create_proxy("call_function", _leaf_apply(cls), args, kwargs)
        return real.__get__(None, cls)(*args, **kwargs)

    Function.apply = classmethod(apply)
    try:
        yield
    finally:
        Function.apply = real


def _traced_on_failing_line(exc: BaseException) -> list[tuple[str, fx.Proxy]]:
    """``(name, proxy)`` of the locals of the user's innermost frame in ``exc``'s traceback that are fx stand-ins and
    that its failing line names."""
    tb, last = exc.__traceback__, None
    while tb is not None:
        if _users(tb.tb_frame.f_code.co_filename):
            last = tb
        tb = tb.tb_next
    if last is None:
        return []
    line = traceback.extract_tb(last, limit=1)[0].line or ""
    return [(name, value) for name, value in last.tb_frame.f_locals.items()
            if isinstance(value, fx.Proxy) and re.search(rf"\b{re.escape(name)}\b", line)]


def _arguments_in_control_flow(exc: BaseException) -> list[str]:
    """Names of the forward's own arguments (fx placeholders) that the failing line of the user's code reads,
    found in that frame's locals: ``if extra:`` on ``forward(self, x, extra=False)``."""
    return [name for name, value in _traced_on_failing_line(exc) if value.node.op == "placeholder"]


def _sizes_on_failing_line(exc: BaseException) -> list[str]:
    """Names on the failing line of the user's code that hold a traced size (``B, C, H, W = x.shape`` then
    ``if H % 2:``): a fresh user's unpacked shape got the advice for data-dependent control flow."""
    def size(node) -> bool:
        while isinstance(node, fx.Node) and node.target is operator.getitem:
            node = node.args[0]
        return isinstance(node, fx.Node) and (
            (node.op == "call_function" and node.target is getattr and node.args[1:2] in (("shape",), ("ndim",)))
            or (node.op == "call_method" and node.target in ("size", "dim", "numel")))

    return [name for name, value in _traced_on_failing_line(exc) if size(value.node)]


def _iterated_argument(exc: BaseException) -> str | None:
    """The name of the forward's argument whose iteration raised ``exc`` (the ``self`` of fx's ``Proxy.__iter__``,
    a placeholder), or ``None`` where what was iterated is a value computed in forward."""
    tb = exc.__traceback__
    while tb is not None:
        proxy = tb.tb_frame.f_locals.get("self") if tb.tb_frame.f_code.co_name == "__iter__" else None
        if isinstance(proxy, fx.Proxy) and proxy.node.op == "placeholder":
            return str(proxy.node.target)
        tb = tb.tb_next
    return None


def _used_as_value(name: str, line: str) -> bool:
    """``name`` is tested on ``line`` as a Python value would be (``if extra:``, ``if not extra``, ``if head ==
    "h1"``, ``while depth > 0``): the forward's argument is then most likely a flag or a setting, fixed for planning.
    An argument tested through tensor operations (``if (x > 0).any():``, ``if x[0, 0] > 0:``, ``torch.dist(x, y) >
    1``) is the input tensor itself, and its control flow data-dependent."""
    n = re.escape(name)
    return bool(re.search(rf"\b(if|elif|while|assert)\s+(not\s+)?{n}\s*(:|==|!=|<|>|\bis\b|\bin\b|\band\b|\bor\b|"
                          rf"\belse\b|$)", line))


_DISTRIBUTIONS = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "distributions") + os.sep


def _in_distributions(exc: BaseException) -> bool:
    """``exc`` was raised inside ``torch.distributions`` (a ``Normal(mu, std)`` validating its arguments, ``rsample``
    or ``kl_divergence`` broadcasting them)."""
    tb = exc.__traceback__
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_DISTRIBUTIONS):
            return True
        tb = tb.tb_next
    return False


def _module_level(exc: BaseException, name: str) -> bool:
    """Whether the installed package's function ``name`` that ``exc`` passed through is a module-level function of
    its module (``einops.rearrange``), which ``torch.fx.wrap(name)`` can mark, rather than a closure (a decorator's
    ``wrapper``)."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == name and _installed(frame.f_code.co_filename):
            found = frame.f_globals.get(name)
            return callable(found) and getattr(inspect.unwrap(found), "__code__", None) is frame.f_code
        tb = tb.tb_next
    return False


def _trace_advice(model: nn.Module, exc: BaseException) -> str:
    """What to change, for an exception fx raised while tracing ``model``."""
    library = _library_call(exc)
    if library is not None and library[0] != "torchvision" and library[1] != "forward":
        package, name, caller = library  # (a fresh user's einops.rearrange was called "a raise statement of yours")
        if not _module_level(exc, name):  # (a decorator's `wrapper`: fx.wrap("wrapper") then broke every trace)
            return (f"  {package}'s {name} (called at {caller}) runs Python code of its own on torch.fx's stand-ins "
                    "for your tensors, which it cannot handle. Let fx record that call whole: move it into a function "
                    "of your own at module level, marked with torch.fx.wrap(\"your_function\") (memfit then runs it "
                    f"as one step; `{name}` is not a module-level function of {package}, so it cannot be marked "
                    "itself).")
        return (f"  {package}'s {name} (called at {caller}) runs Python code of its own on torch.fx's stand-ins for your "
                f"tensors, which it cannot handle. Let fx record the call whole: in your file, after importing it, "
                f"write torch.fx.wrap(\"{name}\") at module level (or call it through a function of yours marked "
                "so); memfit then runs it as one step.")
    if _in_distributions(exc):  # (a VAE's Normal(...).rsample() was told about control flow, or iteration)
        return ("  torch.distributions objects check and broadcast their parameters in Python (validate_args, "
                "broadcast_all), which torch.fx cannot trace. Write the sampling with tensor operations (`z = mu + "
                "std * torch.randn_like(std)`, and a closed-form KL such as `0.5 * (mu**2 + std**2 - 1 - "
                "2 * std.log()).sum(1)`), or move the code that builds and uses the distribution into a function of "
                "its own at module level, marked with torch.fx.wrap(\"name\") (run as one step).")
    if "Proxy object cannot be iterated" in str(exc) and (argument := _iterated_argument(exc)):
        return (f"  `{argument}` is an argument of forward that the line iterates over (a list or tuple of "
                "tensors, FPN-style feature maps): torch.fx traces each argument as one graph input and cannot "
                "iterate it. Give each tensor an argument of its own (`def forward(self, c3, c4, c5)`, called "
                "`planned(*feats)`), or plan a wrapper module whose forward takes them one by one and builds the list "
                "for your module.")
    if "Proxy object cannot be iterated" in str(exc):
        return ("  iterating over a traced value (`for p in torch.chunk(h, 4, dim=1)`, a comprehension over a "
                "tensor, `*h.shape`), which torch.fx cannot do: it does not know how many items there are. Unpack "
                "into a fixed count (`a, b, c, d = h.chunk(4, 1)`), index with a count fixed in __init__ "
                "(`parts = h.chunk(self.n, 1)` then `parts[i] for i in range(self.n)`), or move that code into a "
                "function fx keeps whole (torch.fx.wrap).")
    if "control flow" in str(exc) and (re.search(r"\.shape\b|\.size\(|\.dim\(|\.ndim\b|\blen\(", _user_frame(exc))
                                       or _sizes_on_failing_line(exc)):
        return ("  Python control flow on a tensor's shape (`if h.shape[-1] == x.shape[-1]:`): torch.fx traces shapes "
                "as graph values, not numbers. Decide it from the module's own settings, fixed when it is built "
                "(`self.residual = layer.in_features == layer.out_features` in __init__, read in forward), or move "
                "that code into a function of its own marked with torch.fx.wrap (called as one step, with real "
                "shapes).")
    arguments = _arguments_in_control_flow(exc) if "control flow" in str(exc) else []
    arguments = [a for a in arguments if _used_as_value(a, _user_frame(exc))]  # (the input tensor: below)
    if arguments:
        names = ", ".join(f"`{a}`" for a in arguments)
        a = arguments[0]
        return (f"  {names} {'are arguments' if len(arguments) > 1 else 'is an argument'} of forward, which torch.fx "
                "traces as graph inputs (memfit traces None, a flag, a number or a string as its value, but not a "
                "tuple, a list, a dict or another object of settings), so Python control flow on "
                f"{'them' if len(arguments) > 1 else 'it'} cannot be traced. Fix the value for planning: plan a "
                "wrapper module that passes it (`class Fixed(nn.Module): def __init__(self, m): super().__init__(); "
                f"self.m = m` and `def forward(self, x): return self.m(x, {a}=...)`), or make it an attribute of "
                f"the model (`self.{a} = ...` read in forward), which memfit then watches: changing it after "
                "planning raises.")
    compiled = [name for name, m in model.named_modules() if hasattr(m, "_orig_mod")]
    if compiled == [""]:  # the model itself: memfit.optimize(torch.compile(model), ...)
        return ("  the model is wrapped in torch.compile, which torch.fx cannot trace: plan the model itself "
                "(model._orig_mod) and train the planned module uncompiled; memfit runs PyTorch's eager kernels, "
                "and its plan's budget holds for them.")
    if compiled:
        return (f"  {', '.join(name or 'the model' for name in compiled[:3])} is wrapped in torch.compile, which "
                f"torch.fx cannot trace: plan the model with the module itself ({compiled[0] or 'model'}._orig_mod "
                "in its place); memfit runs PyTorch's eager kernels.")
    # (nn.Module.compile(), torch.compile in place: a fresh user got the advice about data-dependent control flow)
    in_place = [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
    if in_place:
        return (f"  {', '.join(name or 'the model' for name in in_place[:3])} was compiled in place "
                "(module.compile()), which torch.fx cannot trace: plan the model before compiling it (or build it "
                "again without .compile()); memfit runs PyTorch's eager kernels.")
    frames = traceback.extract_tb(exc.__traceback__)
    torch_nn = torch.__file__.rsplit("/", 1)[0] + "/nn/modules/"
    inner = [f for f in frames if f.filename.startswith(torch_nn)]
    user = _user_frame(exc)
    if inner and "super()" in user:
        f = inner[-1]
        return (f"  the check that fails is PyTorch's own ({f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}: "
                f"{f.line}), reached through super() in a subclass of a torch.nn module: torch.fx traces a "
                "subclass like any module of yours, so the parent's checks run on traced values. Hold the torch.nn "
                "module as a child instead (self.bn = nn.BatchNorm2d(...); self.bn(x) * 1.5) or call its "
                "functional form (torch.nn.functional).")
    if user.startswith("inside torch") and type(model).__module__.startswith("torch."):
        return (f"  the model is PyTorch's own {type(model).__name__}, whose forward torch.fx cannot trace (its "
                "checks read tensor values). Plan a module of your own that holds it as a child instead, e.g. "
                "`class Net(nn.Module): __init__: self.body = encoder; forward(x): return self.body(x)`: memfit then "
                "keeps it whole (it runs as one step, which memfit cannot recompute or offload in part).")
    if isinstance(exc, (NameError, ImportError, SyntaxError)):
        return ("  that is an error in the forward pass itself, which plain PyTorch raises too when it runs that "
                "line, not a limit of tracing: fix it and plan again.")
    line = _user_frame(exc)
    if _raised_by_user(exc):  # (a fresh user's was given control-flow advice)
        return ("  the forward pass raised it itself: a raise statement of yours, which tracing reached as plain "
                "PyTorch would on these inputs, not a limit of tracing. Fix the forward, or plan the module whose "
                "forward is meant to run.")
    if re.search(r"\b(int|float)\([^()]*(\.shape\b|\.size\(|\bnumel\(|\blen\()", line):  # a size, not a value
        return ("  a traced size converted to a Python number (int(x.shape[1])), which torch.fx cannot do: drop the "
                "int(): tensor calls (view, reshape, new_zeros, expand) take the traced size as it is.")
    if re.search(r"\b(float|int|bool|complex)\(\) argument", str(exc)) or re.search(r"\.(item|tolist)\(", line):
        return ("  a tensor's value read as a Python number (.item(), float(t), int(t)), which a traced forward does "
                "not have (fx records operations, not values): keep it a tensor (x * x.abs().amax() for "
                "x * float(x.abs().max().item())), or move that line into a function fx keeps whole "
                "(torch.fx.wrap; memfit then runs it as one step).")
    if "'len' is not supported" in str(exc) or "cannot be interpreted as an integer" in str(exc):
        return ("  a loop or count over a traced size (for i in range(len(x)), range(x.shape[0])), which torch.fx "
                "cannot unroll because the size is a graph value, not a number: apply the layer to the whole batch "
                "at once (nn.Linear and most layers take any leading dimensions), loop over a count fixed in "
                "__init__, or move the loop into a function fx keeps whole (torch.fx.wrap).")
    # (the size may come from an earlier line, `B = x.shape[0]`, and then the call's TypeError is all there is)
    factory = re.search(r"torch\.(zeros|ones|empty|full|rand|randn|randint|arange|eye)\(", _user_frame(exc)) and (
        re.search(r"\.shape\b|\.size\(|\blen\(", _user_frame(exc)) or isinstance(exc, TypeError))
    if "Proxy" in str(exc) or factory:  # (zeros() says "takes 1 positional argument but 2 were given")
        return ("  a value computed from a tensor (its shape, a size) reaches a function that needs a plain "
                "number, which torch.fx cannot pass (a tensor factory sized by a traced shape): use an operation "
                "that takes the tensor itself (e.g. torch.rand_like(x[:, :1, :1, :1]) for torch.rand(x.shape[0], 1, "
                "1, 1), x.new_zeros((x.shape[0], 16)) for torch.zeros(x.shape[0], 16)), or move that line into a "
                "function fx keeps whole (torch.fx.wrap).")
    if isinstance(exc, KeyError) and "__fx_create_arg__" in str(exc):
        return ("  an object whose __getattr__ raises KeyError for a name it does not hold (a dict with attribute "
                "access, `return self[k]`): torch.fx asks each value it records for __fx_create_arg__ with hasattr(), "
                "which needs AttributeError. Raise AttributeError there, or return a dataclass (@dataclasses.dataclass) or a "
                "dict (a subclass of dict too), which memfit traces and gives back as returned.")
    if re.search(r"\.(register_hook|register_post_accumulate_grad_hook)\(", line):
        return ("  a tensor hook registered in forward (h.register_hook(fn)), which torch.fx cannot record: move it "
                "into a function of its own at module level that registers the hook and returns the tensor, marked "
                "with torch.fx.wrap(\"name\") (`def hooked(h): h.register_hook(fn); return h`; fx records the call, "
                "which memfit runs in every step), or register it on the output after the planned module's call.")
    attr = re.search(r"\.(requires_grad|is_cuda|is_leaf|device|dtype|is_floating_point\(\))\b", line)
    if attr and re.search(r"\b(if|elif|while|assert)\b", line.rsplit(": ", 1)[-1] if ": " in line else line):
        return (f"  a Python test of a tensor's {attr[1]}, which a traced forward does not have as a bool (torch.fx "
                "records it as a graph value): memfit plans a training step, so test what the step knows instead "
                "(torch.is_grad_enabled() or self.training for requires_grad; a dtype or device kept as an attribute "
                "in __init__), drop the branch the training step does not take, or move that code into a function "
                "fx keeps whole (torch.fx.wrap)." + (
                    " A model that checkpoints itself when gradients are on (torchvision's DenseNet with "
                    "memory_efficient=True, a gradient_checkpointing option) plans with that option off: memfit "
                    "plans the recomputation itself." if attr[1] == "requires_grad" else ""))
    if isinstance(exc, NotImplementedError) and "argument of type" in str(exc):
        return (f"  a value of a class torch.fx cannot record ({str(exc).rsplit(':', 1)[-1].strip()}), returned by "
                "the forward or passed to an operation: return tensors in a tuple, list, dict, namedtuple or "
                "dataclass (@dataclasses.dataclass) instead, which memfit traces, counts and gives back as returned.")
    if "control flow" in str(exc):
        return ("  memfit needs a forward pass without data-dependent Python control flow on tensor values; "
                "rewrite that line with tensor operations (e.g. torch.where), or move that code into a function of "
                "its own at module level, marked with torch.fx.wrap(\"name\") (fx then records it as one call, which "
                "memfit runs as one step; a submodule of yours is traced into like the rest).")
    # (fresh users: a decorator's TypeError, a Mapping batch's AttributeError were all given the advice above)
    return ("  torch.fx runs the forward once on stand-ins for its tensors, which take tensor operations only, and "
            f"that line did something else with one ({type(exc).__name__}). Move that code into a function of its "
            "own at module level, marked with torch.fx.wrap(\"name\") (fx then records it as one call, which memfit "
            "runs as one step; a submodule of yours is traced into like the rest), or compute it outside the model "
            "and pass the result in.")


class _Tracer(fx.Tracer):
    """``torch.fx``'s tracer with modules that have hooks kept whole, numpy scalar constants as the Python
    scalars they equal, and augmented assignments (``h += t``) recorded for :func:`keep_in_place`."""

    def proxy(self, node: fx.Node) -> fx.Proxy:
        """:class:`InplaceProxy`: ``h += t`` recorded as such, where fx's ``Proxy`` rebinds ``h`` to ``h + t``."""
        return InplaceProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, *rest, **more):
        """fx's, with the user's line kept on each in-place write (for :func:`_refuse_written_constants`)."""
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **more)
        if writes_into(proxy.node):
            proxy.node.meta[WRITE_LINE] = user_line()
        return proxy

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        """fx's, with the forward's ``*args`` and ``**kwargs`` passed empty (``()``, ``{}``), as the step passes them
        (values in them are refused): on fx's stand-ins, ``self.inner(x, **kwargs)`` and ``kwargs.get("flag")``
        could not be traced (a fresh user's forward passing its keywords on). Their placeholders stay in the graph."""
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)
        return fn, [(({} if str(a.node.target).startswith("**") else ())
                     if isinstance(a, fx.Proxy) and a.node.op == "placeholder" and str(a.node.target).startswith("*")
                     else a) for a in args]

    def call_module(self, m: nn.Module, forward, args, kwargs):
        """fx's; a module that is not a submodule of the model (made in forward, as Hugging Face's hub-kernel layers
        wrap ``apply_rotary_pos_emb``) is traced into: fx raised ``NameError: module is not installed as a
        submodule``. A module kept whole (a ``torch.nn`` layer) runs Hugging Face's output-recorder hooks on its
        traced output (:func:`memfit.graph.attributes.collects_in_call`), as its call would: fx's leaf calls run no
        hooks, and Qwen2-MoE's router logits, an ``nn.Linear``'s output, went uncollected."""
        try:
            path = self.path_of_module(m)
        except NameError:
            return forward(*args, **kwargs)
        leaf = self.is_leaf_module(m, path)
        if leaf:
            hidden = [f"{path}.{name}" for name, sub in m.named_modules() if name and any(
                collects_in_call(h) and collecting_now(h) for h in sub._forward_hooks.values())]
            if hidden:  # (its output would be missing from what transformers collects: a loss term, silently)
                raise TraceError(
                    f"memfit keeps {path} ({type(m).__name__}) whole, as one operation (a hook of yours is registered "
                    f"on it, or it is a torch.nn container), so Hugging Face's output recorder cannot collect the "
                    f"outputs of {', '.join(hidden[:3])}{' ...' if len(hidden) > 3 else ''} inside it while tracing: "
                    "the router logits of the load-balancing loss (output_router_logits=True), hidden states or "
                    "attention weights would miss them (a fresh user's hook on a Mixtral layer changed the loss "
                    "silently). Register your hook on the planned module, or on a module with no such submodule, or "
                    "plan without that output flag. Your model is as it was.")
        out = super().call_module(m, forward, args, kwargs)
        if leaf:
            for hook in [h for h in m._forward_hooks.values() if collects_in_call(h)]:
                hook(m, args, out)
        return out

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """A module with hooks of its own is kept whole, so that its hooks run in every step (traced into, they
        ran once, while tracing: a fresh user's Grad-CAM hooks on ResNet's ``layer4`` captured nothing)."""
        return has_own_hooks(m) or super().is_leaf_module(m, module_qualified_name)

    def create_arg(self, a):
        """A numpy scalar (``F.dropout(h, p=self.p)`` with ``self.p = np.float64(0.1)``) as a Python scalar: fx
        refuses ``np.float32`` and writes ``np.float64(0.1)`` into its generated code, which then fails with
        ``NameError: name 'np' is not defined``. PyTorch's type promotion treats both alike.

        A dataclass instance (an output ``Out(logits=...)``) as a call of :func:`dataclass_builder`, which
        rebuilds it from its fields' traced values without running its ``__init__`` again. fx's own form calls the
        class with every field: a ``__post_init__`` then ran a second time on values it had already processed (a
        fresh user's temperature scaling divided the logits twice, gradients 9e-3 off), a ``field(init=False)``
        was refused by ``__init__``, and a dataclass that is a dict (Hugging Face's ``ModelOutput``) came back a
        plain dict."""
        a = numpy_scalar_as_python(a)
        if rebuilt_of_its_class(a):
            attributes, items = dataclass_parts(a)
            return self.create_node("call_function", dataclass_builder(type(a)),
                                    (self.create_arg(attributes), self.create_arg(items)), {})
        out = super().create_arg(a)
        if (_BAKED and isinstance(a, torch.Tensor) and isinstance(out, fx.Node) and out.op == "get_attr"
                and str(out.target).startswith("_tensor_constant") and a.layout == torch.strided):
            _BAKED[-1].add(a.untyped_storage().data_ptr())  # (a constant of the graph: see _ConcreteStateWrites)
        return out


class _BufferTracer(_Tracer):
    """:class:`_Tracer` with reads of buffers recorded as ``get_attr`` nodes. The default tracer runs an
    expression that reads only buffers (``self.count.add_(1)``, ``1 + self.ema``) once, while tracing, and
    records its value as a constant: such an update never ran again, and such a value never changed."""

    proxy_buffer_attributes = True


class _SizedTracer(ShapeSpecializing, _Tracer):
    """:class:`_Tracer` with the example's shapes (:mod:`memfit.graph.sized`)."""


class _SizedBufferTracer(ShapeSpecializing, _BufferTracer):
    """:class:`_BufferTracer` with the example's shapes (:mod:`memfit.graph.sized`)."""


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or (a.is_floating_point() and a.shape == b.shape
                                 and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all()))


_TENSOR_CONSTANT = re.compile(r"_tensor_constant\d+")


def _constant_write_error(model: nn.Module, line: str) -> TraceError:
    return TraceError(
        f"the forward pass of {type(model).__name__} writes into a tensor made from plain numbers (such as "
        "`z = torch.zeros(4, 10)`), at\n"
        f"  failing line: {line}\n"
        "  torch.fx makes that tensor once, while tracing, and computes then, once, what reads it without a "
        "traced value (`z * 2`, `z.sum(1)`, `z.mul_(2.0)`), not in the order of the forward's reads and writes: the "
        "planned step would use other values. Make the tensor from a traced one, `h.new_zeros(4, 10)` (or "
        "`torch.zeros(4, 10, device=h.device, dtype=h.dtype)`), so that it is made in every step. Your model is as "
        "it was.")


def _refuse_written_constants(model: nn.Module, graph: fx.Graph) -> None:
    """Raise where the forward pass writes a traced value into a tensor made from plain numbers
    (:func:`memfit.graph.augmented.written_constants`)."""
    written = written_constants(graph)
    if written:
        raise _constant_write_error(model, written[0].meta.get(WRITE_LINE, "?"))


def _check_traced(model: nn.Module, graph: fx.Graph) -> None:
    """What a traced graph must not have before memfit builds its GraphModule (:func:`_refuse_written_constants`,
    a write into a tensor kept as a plain attribute, :func:`_check_names`)."""
    _refuse_written_constants(model, graph)
    attributes = _plain_tensor_attributes(model)
    for node in graph.nodes:
        if node.op == "get_attr" and node.target in attributes:
            for user in node.users:
                if writes_into(user) and user.args and user.args[0] is node:
                    raise _attribute_write_error(model, node.target, user.meta.get(WRITE_LINE, "?"))
    _check_names(model, graph)


@functools.cache
def _graph_module_names() -> frozenset[str]:
    """The attribute names ``torch.fx.GraphModule`` has beyond ``nn.Module``'s (``code``, ``graph``, ``meta``,
    ``recompile``, ...)."""
    gm = fx.GraphModule(nn.Module(), fx.Graph())
    plain = nn.Module()
    return frozenset((set(dir(gm)) | set(vars(gm))) - set(dir(plain)) - set(vars(plain)))


def _check_names(model: nn.Module, graph: fx.Graph) -> None:
    """Raise where the forward pass uses a submodule, parameter, buffer or tensor attribute of the model itself
    whose name ``torch.fx.GraphModule`` uses for its own (``self.code``, ``self.graph``): the graph module memfit
    runs holds the model's attributes under their names, and there the name means fx's (a fresh user's VAE head
    ``self.code`` failed with a bare "`code` is not an nn.Module"; a graph network's ``self.graph`` adjacency
    buffer with advice about control flow)."""
    used = {str(n.target).split(".")[0] for n in graph.nodes if n.op in ("call_module", "get_attr")}
    reserved = _graph_module_names()
    clash = sorted(used & reserved)
    if clash:
        kinds = {name: ("submodule" if name in model._modules else "parameter" if name in model._parameters
                        else "buffer" if name in model._buffers else "attribute") for name in clash}
        raise TraceError(
            f"{type(model).__name__}'s {', '.join(f'{kinds[n]} `self.{n}`' for n in clash)} "
            f"{'has a name' if len(clash) == 1 else 'have names'} that torch.fx's GraphModule uses for its own "
            f"attributes ({', '.join(sorted(n for n in reserved if not n.startswith('_')))[:160]}"
            f"...), and memfit runs your model as a GraphModule holding its attributes by name. Rename "
            f"{'it' if len(clash) == 1 else 'them'} (`self.{clash[0]}_` or a more specific name; map old checkpoints' "
            f"state_dict keys), or plan the model inside a container, `memfit.optimize(nn.Sequential(model), ...)`, "
            "where the names sit one level down (parameters are shared: keep saving `model.state_dict()`). "
            "Your model is as it was.")


def _as_traced_fixed(graph: fx.Graph, fixed: dict[str, Any], names: list[str]) -> fx.Graph:
    """``graph``, traced with ``concrete_args`` setting the forward's arguments ``fixed`` to their values, with fx's
    checks of those values removed (``_assert_is_none``, and ``torch._assert`` of an ``==``: they fail as bare
    assertions; :class:`memfit.runtime.planned.PlannedModule` refuses another value itself, with a message) and
    each such argument's placeholder named as the argument again (fx names it ``mask_1``). ``names``: the forward's
    arguments in traced order (:func:`memfit.graph.calls.in_traced_order`), one placeholder each."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    renamed = {node: name for node, name in zip(placeholders, names) if name in fixed and str(node.target) != name}
    checked = set(renamed) | {n for n, name in zip(placeholders, names) if name in fixed}
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        if getattr(node.target, "__name__", "") == "_assert_is_none" and node.args and node.args[0] in checked:
            graph.erase_node(node)
        elif (node.target is torch._assert and node.args and isinstance(eq := node.args[0], fx.Node)
              and eq.target is operator.eq and eq.args and eq.args[0] in checked):
            graph.erase_node(node)
            if not eq.users:
                graph.erase_node(eq)
    for node, name in renamed.items():
        # (another node may hold that name: a buffer named as the argument, `self.adj if adj is None else adj`,
        # read by a get_attr node fx named `adj`, and graph.lint() failed with "Node redefined name adj!")
        other = next((n for n in graph.nodes if n.name == name and n is not node), None)
        if other is not None:
            other._rename(f"{name}_1")
            node._rename(name)  # (the name freed in fx's namespace, which later nodes are named from)
        node.target = node.name = name
    graph.lint()
    return graph


def _trace(model: nn.Module, fixed: dict[str, Any] | None = None,
           examples: dict[str, Any] | None = None, constants_fallback: bool = True,
           fold: bool | frozenset[int] = True) -> fx.GraphModule:
    """:func:`_trace_graph`, leaving ``model`` as it was; the forward's arguments ``fixed`` are traced as their values
    (:func:`capture`); with ``examples`` (the forward's arguments by name), traced with their shapes
    (:mod:`memfit.graph.sized`). ``torch.fx`` stores each tensor constant the forward makes
    (``torch.arange(16)``, ``torch.ones(16, 16)``) as an attribute ``_tensor_constant<i>`` of the module it traces,
    numbered from the first free name; the ``GraphModule`` holds copies of its own. Left on the model, they
    made a second trace number its constants on, so a plan made in the same process no longer matched the graph's
    node names (a fresh user's causal mask: ``memfit.optimize(m, ids, plan_=...)`` refused its own plan)."""
    names = [p.name for p in in_traced_order(forward_params(model))]
    before = set(vars(model))
    try:
        return _trace_graph(model, fixed, names, examples, constants_fallback, fold)
    finally:
        for name in set(vars(model)) - before:
            if _TENSOR_CONSTANT.fullmatch(name):
                delattr(model, name)


def _put_back_attempt(attributes: AttributeLog, numbers: list[tuple[str, dict, str, Any]],
                      state: list[tuple[str, nn.Module, str, dict]], hooks: list[tuple[dict, dict]]) -> None:
    """Put back what a failed trace of the model assigned before it failed, to trace it again: the modules'
    attributes (``self.calls += 1``, logged by :func:`memfit.graph.attributes.record_reads`), the numbers of
    :func:`_python_numbers`, the buffers and parameters (:func:`memfit.graph.augmented.state_of`) and the hooks it
    registered (:func:`memfit.graph.attributes.put_back_hooks`)."""
    attributes.put_back()
    put_back_hooks(hooks)
    for _, box, key, old in numbers:
        box[key] = old
    put_back_updated_state(state, everything=True)


def _trace_graph(model: nn.Module, fixed: dict[str, Any] | None = None, names: list[str] | None = None,
                 examples: dict[str, Any] | None = None, constants_fallback: bool = True,
                 fold: bool | frozenset[int] = True) -> fx.GraphModule:
    """Trace with :class:`_BufferTracer`; where that fails but :class:`_Tracer` (buffers read as constants, as
    ``fx.symbolic_trace`` reads them) works (a buffer read in Python control flow), warn and use the latter.
    The arguments ``fixed`` are traced as their values (:func:`_trace`); ``names``: the forward's, in traced order;
    ``examples``: the forward's arguments by name, to trace with their shapes (:mod:`memfit.graph.sized`);
    ``fold``: with ``examples``, compute tensors made from plain numbers for real (:mod:`memfit.graph.folded`;
    :class:`memfit.graph.folded.FoldingAborted` where the forward writes into one); a frozenset: all but those of
    the factory calls it numbers;
    ``constants_fallback=False``: raise where :class:`_BufferTracer` fails (:func:`capture` first traces with the
    example's shapes, with buffers as graph values: read as constants, a loop `range(self.centers.shape[0])` kept
    the count it had while tracing when the buffer was replaced by a longer one, silently)."""
    tracer = _BufferTracer() if examples is None else _SizedBufferTracer(examples, fold=fold)
    state_before = state_of(model)
    fixed, names = fixed or {}, names or []
    concrete = dict(fixed) or None
    try:
        with warnings.catch_warnings():  # (an Enum, a dtype: fx cannot assert it, and says so; the module refuses)
            warnings.filterwarnings("ignore", message="Was not able to add assertion")
            graph = _as_traced_fixed(tracer.trace(model, concrete_args=concrete), fixed, names)
    except (_GradModeChange, FoldingAborted):
        raise
    except Exception as exc:
        if not constants_fallback:
            raise
        # with buffers as constants, what forward computes on buffers and parameters alone runs for real, once:
        # if that writes one (a queue `self.queue[:, :b] = k.t()`, a counter `self.hist[0] = ...`, a data-dependent
        # initialisation `if self.initialized.item() == 0: self.loc.data.copy_(...)`), the graph has not got the
        # write and training would differ from PyTorch's (a fresh user's MoCo queue: gradients 0.85 off)
        state = [(name, t, t.detach().clone()) for name, t in itertools.chain(
            model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))]
        plain = _Tracer() if examples is None else _SizedTracer(examples, fold=fold)
        put_back_updated_state(state_before, everything=True)  # (what the failed attempt assigned: it traces again)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Was not able to add assertion")
                graph = _as_traced_fixed(plain.trace(model, concrete_args=concrete), fixed, names)  # (raises when the
            # model does not trace at all)
        except FoldingAborted:
            raise
        except Exception as again:
            # report the attempt that got further into forward: a plain Python error after a line that traces
            # only with buffers as graph values (`import math` forgotten after `self.cos[:T]`) was reported as the
            # fallback's failure at that earlier, correct line
            if len(plain.graph.nodes) > len(tracer.graph.nodes):
                raise
            raise exc from again
        finally:
            written = [name for name, t, before in state if not _same_values(t.detach(), before)]
            for name, t, before in state:
                if name in written:
                    t.detach().copy_(before)  # (torch.no_grad is refused while tracing)
        if written:
            raise TraceError(
                f"torch.fx could not trace {type(model).__name__} with its buffers as graph values "
                f"({type(exc).__name__}: {exc})\n  failing line: {_user_frame(exc)}\n  and the forward pass writes "
                f"{', '.join(written[:4])}{' ...' if len(written) > 4 else ''} there, which a graph with the buffers "
                "read as constants would not do in training steps. Write it with tensor operations fx records, "
                "in place (`self.hist[0:1].add_(1)`, `self.queue[:, :b].copy_(k.t())`), without Python control "
                "flow on tensor values (`.item()`, `if tensor:`; initialise from data before planning, with one "
                "call of the model). Your model is as it was.") from exc
        buffers = {name for name, _ in model.named_buffers()}
        reads = {n for n in graph.nodes if n.op == "get_attr" and n.target in buffers}
        writes = sorted({str(n.args[0].target) for n in graph.nodes if n.args and n.args[0] in reads
                         and writes_into(n)})
        baked = [n for n in graph.nodes if n.op == "get_attr" and str(n.target).startswith("_tensor_constant")]
        if writes and baked:
            raise TraceError(
                f"torch.fx could not trace {type(model).__name__} with its buffers as graph values "
                f"({type(exc).__name__}: {exc})\n  failing line: {_user_frame(exc)}\n  With them read as constants "
                f"the forward pass writes {', '.join(writes[:4])} in every step but uses values computed from "
                "buffers once, while tracing (a MoCo queue read through `self.queue.clone()` trained with "
                "gradients 0.85 off). Keep Python control flow off tensor values, so that the model traces with its "
                "buffers as graph values: then writes into them (`self.queue[:, :b] = k.t()`, "
                "`self.queue[:, :b].copy_(k.t())`) run in every step.") from exc
        keep_in_place(plain.root, graph)
        put_back_updated_state(state_before)
        _check_traced(model, graph)
        gm = fx.GraphModule(plain.root, graph, type(model).__name__)
        warnings.warn(
            f"memfit traced {type(model).__name__} with its buffers read as constants: with buffers as graph "
            f"values, tracing failed ({type(exc).__name__}: {exc}; at {_user_frame(exc)}). Computations on "
            "buffers alone (outside torch.nn modules), such as in-place updates of your own buffers, ran once "
            "while tracing and will not run in training steps.", stacklevel=4)
        return gm
    keep_in_place(tracer.root, graph)
    put_back_updated_state(state_before)
    _check_traced(model, graph)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def check_traced_outputs(model: nn.Module, gm: fx.GraphModule, fresh_inputs: Callable[[], tuple]) -> None:
    """Run ``model`` and its traced graph ``gm`` on the example inputs (``fresh_inputs()``: a new copy each time, in
    the traced forward's order: its keyword-only arguments, after the others, are given to ``model`` by name)
    from one RNG seed, without gradients, and refuse a graph whose outputs differ from the model's: a Python test
    torch.fx evaluated once while tracing, on its stand-ins for the inputs, took another branch than the step takes
    (``isinstance(scale, torch.Tensor)`` on an argument is ``False`` on fx's stand-in: a fresh user's planned module
    ignored ``scale``, outputs 3.51 off, silently). Inconclusive, and skipped, where the model itself gives two
    outputs for one seed (a generator of its own), where a node writes into a parameter, or where a run fails (the
    profile then reports it). Buffers (BatchNorm's statistics) are put back after each run.

    Raises:
        TraceError: the outputs differ (the message gives the first that does and by how much).
    """
    written = [n for n in gm.graph.nodes if n.op == "get_attr" and any(writes_into(u) for u in n.users)]
    if any(_is_param(gm, str(n.target)) for n in written):
        return
    # (and parameters a layer renormalizes in place, nn.Embedding(max_norm=...), which no node shows writing)
    restored = [(b, b.detach().clone()) for b in [*model.buffers(), *renormed_parameters(model, gm)]]
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []  # (all it seeds)
    # what the model's own forward assigns (`self.feat = h.detach()`, a mask cached on the first call) is put back
    modules = list({id(m): m for m in model.modules()}.values())
    tables = [(m, dict(vars(m)), {k: dict(vars(m)[k]) for k in ("_parameters", "_buffers", "_modules")})
              for m in modules]
    # the model's own torch.Generators (`torch.randn(shape, generator=self.gen)`), which fork_rng does not cover
    found = [v for m in [*modules, gm] for v in vars(m).values() if isinstance(v, torch.Generator)]
    for node in gm.graph.nodes:
        fx.node.map_aggregate((node.args, node.kwargs),
                              lambda v: found.append(v) if isinstance(v, torch.Generator) else None)
    generators = [(g, g.get_state()) for g in {id(g): g for g in found}.values()]

    def run(fn) -> list[torch.Tensor]:
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                torch.manual_seed(0)
                return [t.detach() for t in tensors_in(fn(*fresh_inputs()))]
        finally:
            with torch.no_grad():
                for b, saved in restored:
                    b.copy_(saved)
            for g, state in generators:
                g.set_state(state)
            for m, attrs, inner in tables:
                for key, saved in inner.items():
                    vars(m)[key].clear()
                    vars(m)[key].update(saved)
                for key in [k for k in vars(m) if k not in attrs]:
                    del vars(m)[key]
                vars(m).update({k: v for k, v in attrs.items() if k not in inner})

    named = in_traced_order(forward_params(model))
    positional = [p.name for p in named if p.kind != p.KEYWORD_ONLY]
    keyword = [p.name for p in named if p.kind == p.KEYWORD_ONLY]

    def eager(*inputs):
        if not keyword or len(inputs) <= len(positional):
            return model(*inputs)
        return model(*inputs[:len(positional)], **dict(zip(keyword, inputs[len(positional):])))

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # (a failing GraphModule prints its code)
            traced = run(gm)
    except Exception as exc:  # noqa: BLE001 -- (where the model runs, a branch fx took is the cause)
        traced, failure = None, exc
    try:
        first = run(eager)
    except Exception:  # noqa: BLE001 -- (the model itself fails on them: the profile reports it)
        return
    if traced is None:
        raise TraceError(f"the graph torch.fx traced from {type(model).__name__} fails on the example inputs, where the "
                         f"model runs ({type(failure).__name__}: {str(failure)[:300]}): {_BRANCH_ADVICE}") from failure
    if not _same_outputs(first, traced):
        try:  # (a model that gives two outputs for one seed, a generator of its own: inconclusive)
            if not _same_outputs(first, run(eager)):
                return
        except Exception:  # noqa: BLE001
            return
    if len(traced) != len(first):
        raise TraceError(f"the graph torch.fx traced from {type(model).__name__} returns {len(traced)} tensors where the "
                         f"model returns {len(first)} on the example inputs: {_BRANCH_ADVICE}")
    for k, (a, b) in enumerate(zip(first, traced)):
        if not _same_outputs([a], [b]):
            gap = ((a.double() - b.double()).abs().max().item() if a.shape == b.shape and a.is_floating_point()
                   else None)
            what = f"differs by up to {gap:.3g}" if gap is not None else f"is {tuple(b.shape)}, not {tuple(a.shape)}"
            raise TraceError(f"the graph torch.fx traced from {type(model).__name__} computes another output than the "
                             f"model on the example inputs (output {k} {what}): {_BRANCH_ADVICE}")


_BRANCH_ADVICE = (
    "a Python test in forward ran once, while tracing, on fx's stand-ins for its arguments, and took another branch "
    "than the model takes (`isinstance(scale, torch.Tensor)` on an argument, a check of its type or of "
    "torch.is_autocast_enabled(), a global or attribute forward changes). Decide it in __init__ or in the training "
    "loop and pass the model what the branch needs, or move that code into a function of its own at module level, "
    "marked with torch.fx.wrap(\"name\") (run as one step, with the real values). Your model is as it was.")


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        return isinstance(gm.get_parameter(target), nn.Parameter)
    except AttributeError:
        return False


def _same_outputs(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Two lists of tensors of equal shapes, dtypes and values (floats within 1e-4 relative, 1e-5 absolute; NaNs
    where the other has NaNs)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.is_floating_point() or x.is_complex():
            if not torch.allclose(x, y, rtol=1e-4, atol=1e-5, equal_nan=True):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _python_numbers(model: nn.Module) -> list[tuple[str, dict, str, Any]]:
    """``(label, container, key, value)`` for the plain numbers forward could keep count in outside the module's own
    attributes: the entries of a dict attribute of a module (``self.stats["it"]``), and the module-level numbers of
    the files that define the model's classes (``global STEP``)."""
    found = []
    for path, m in model.named_modules():
        for name, value in vars(m).items():
            if not name.startswith("_") and isinstance(value, dict):
                found += [(f"self{'.' + path if path else ''}.{name}[{k!r}]", value, k, v) for k, v in value.items()
                          if type(v) in (int, float)]
    files = {type(m).__module__ for m in model.modules()} - {None}
    for file in sorted(f for f in files if not f.startswith(("torch.", "torchvision.")) and f in sys.modules):
        space = vars(sys.modules[file])
        found += [(f"the global {k} ({file})", space, k, v) for k, v in list(space.items())
                  if type(v) in (int, float) and not k.startswith("__")]
    return found


def _refuse_changed_numbers(model: nn.Module, numbers: list[tuple[str, dict, str, Any]]) -> None:
    """Refuse a forward that changed a number of :func:`_python_numbers` while tracing (put back first): fx ran the
    update once, and the planned step would keep its value (a fresh user's global step counter froze, silently; one
    kept in a dict moved at each planning and was refused at the first step, again after planning again)."""
    changed = [(label, box, key, old) for label, box, key, old in numbers if box.get(key, old) != old]
    for _, box, key, old in changed:
        box[key] = old
    if changed:
        label = changed[0][0]
        raise TraceError(
            f"the forward pass of {type(model).__name__} updates {label}, a Python number: torch.fx runs that once, "
            "while tracing, and the planned step would keep the value it had then, at every step. Keep the count in "
            "a buffer updated in place (`self.register_buffer('step', torch.zeros((), dtype=torch.long))` in "
            "__init__, `self.step.add_(1)` in forward), or update it in your training loop. Your model is as it "
            "was.")


def _refuse_scripted(model: nn.Module) -> None:
    """Refuse TorchScript modules (``torch.jit.script`` / ``torch.jit.trace``), before anything runs: torch.fx
    cannot see into them, and a fresh user's scripted Conv-BatchNorm-ReLU block was planned, had its BatchNorm
    statistics moved by the profile, and then failed at the planned module's first call with an internal
    ``AttributeError``."""
    scripted: list[str] = []
    for name, m in model.named_modules():  # the outermost ones (a scripted block's children are scripted too)
        if isinstance(m, torch.jit.ScriptModule) and not any(
                s == "" or name.startswith(s + ".") for s in scripted):
            scripted.append(name)
    if scripted:
        where = "the model itself" if scripted[0] == "" else ", ".join(repr(n) for n in scripted[:3])
        raise TraceError(
            f"{where} {'is a TorchScript module' if len(scripted) == 1 else 'are TorchScript modules'} "
            "(torch.jit.script or torch.jit.trace), which torch.fx cannot trace and memfit cannot plan. Plan the "
            "module before scripting it: build the model with the plain nn.Module in its place (the module you "
            "passed to torch.jit.script), and train the planned module as it is.")


def refuse_decorated_forward(model: nn.Module) -> None:
    """Refuse a model whose forward is wrapped by a decorator (``functools.wraps``, or a bare ``def wrapper(*args,
    **kwargs)``), before anything runs. torch.fx calls the model's own forward with every argument positional, so
    the decorator sees them other than your calls pass them: fresh users' decorators added a loss term only when
    ``labels`` came as a keyword (planned silently without it: gradients 6.4e-6 off), returned a tuple instead of
    a dict, or filled in a keyword (``kwargs.setdefault``) that fx had already passed; transformers' ``forward``
    is decorated so (``@can_return_tuple``). Called from a wrapper module, the decorator runs while tracing with
    the arguments as the wrapper passes them."""
    forward = getattr(type(model), "forward", None)
    if not callable(forward) or hasattr(model, "_orig_mod") or forward is nn.Module.forward:
        return  # (torch.compile's wrapper, and a module without a forward, have advice of their own)
    inner = inspect.unwrap(forward)
    try:
        params = list(inspect.signature(forward, follow_wrapped=False).parameters.values())
    except (TypeError, ValueError):
        return
    bare = bool(params) and params[0].kind is inspect.Parameter.VAR_POSITIONAL
    variadic = inner is forward and len(params) > 1 and all(
        p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for p in params[1:])
    if variadic:  # (a decorator without functools.wraps, or a wrapper passing everything on: EMA, ModelWithLoss)
        code = getattr(forward, "__code__", None)
        raise TraceError(
            f"{type(model).__name__}.forward takes only *args and **kwargs"
            f"{' (' + code.co_qualname.split('.<locals>')[0] + ')' if hasattr(code, 'co_qualname') else ''}: a decorator "
            "without functools.wraps, or a wrapper passing everything on to another module. torch.fx traces *args "
            "and **kwargs empty, so your inputs cannot reach the model. Plan the module it calls (memfit.optimize("
            "model.module, ...), parameters are shared), give forward named parameters (`def forward(self, x, "
            "mask=None)`), or, for a decorator, plan a wrapper module whose forward names them and calls the "
            "model. Your model is as it was.")
    if inner is forward and not bare:
        return
    code = getattr(forward, "__code__", None)
    name = getattr(code, "co_qualname", getattr(code, "co_name", "")).split(".<locals>")[0] if code else ""
    try:
        real = ", ".join(list(inspect.signature(inner).parameters)[1:]) if inner is not forward else "x, ..."
    except (TypeError, ValueError):
        real = "x, ..."
    raise TraceError(
        f"{type(model).__name__}.forward is wrapped by a decorator{f' ({name})' if name else ''}. torch.fx would "
        "call it with every argument positional, so the decorator would see them "
        "otherwise than your calls pass them (keywords it reads or fills in, the return type it chooses) and the "
        "plan would train what fx saw. Plan a wrapper module that calls your model as your training loop does, "
        "which fx traces into, decorator included: `class Wrapped(nn.Module): def __init__(self, m): "
        f"super().__init__(); self.m = m` and `def forward(self, {real}): return self.m(...)` passing them by "
        "keyword as you do, then memfit.optimize(Wrapped(model), batch, ...) (parameters are shared: keep saving "
        "`model.state_dict()`). Your model is as it was.")


def _containers(model: nn.Module) -> list[tuple[str, Any, Any]]:
    """``(label, container, copy)`` of each list, dict and set a module of ``model`` holds as a plain attribute
    (``self.feats = []``), with a shallow copy of its contents, for :func:`_refuse_traced_stores`."""
    found = []
    for path, m in model.named_modules():
        for name, value in vars(m).items():
            if not name.startswith("_") and type(value) in (list, dict, set):
                found.append((f"self{'.' + path if path else ''}.{name}", value, copy.copy(value)))
    return found


def _put_back_containers(containers: list[tuple[str, Any, Any]]) -> None:
    """Give each container of :func:`_containers` its contents from before tracing."""
    for _, box, saved in containers:
        box.clear()
        if isinstance(box, list):
            box.extend(saved)
        else:
            box.update(saved)


def _refuse_traced_stores(model: nn.Module, containers: list[tuple[str, Any, Any]]) -> None:
    """Refuse a forward that put traced values into a list, dict or set attribute (``self.feats.append(h)``,
    ``self.cache["h"] = h``: features kept for a feature-matching or deep-supervision loss), putting the containers
    back: fx runs that once, while tracing, and the planned step stores nothing (a fresh user's feature loss was
    silently 0, or read planning's stale tensors without gradients: parameters 7.7e-3 off in 3 steps)."""
    def traced(value) -> bool:
        items = value.values() if isinstance(value, dict) else value
        return any(isinstance(v, fx.Proxy) or (isinstance(v, (tuple, list)) and any(isinstance(u, fx.Proxy) for u in v))
                   for v in items)

    stored = [label for label, box, _ in containers if traced(box)]
    if stored:
        _put_back_containers(containers)
        raise TraceError(
            f"the forward pass of {type(model).__name__} stores traced values into "
            f"{', '.join(stored[:3])}{' ...' if len(stored) > 3 else ''} (a list, dict or set it keeps): torch.fx runs "
            "that once, while tracing, and the planned step would store nothing there (a loss reading them would "
            "see planning's leftovers, or nothing). Return them from forward (`return out, [h1, h2]`, read in "
            "loss_fn), or register forward hooks on the layers that make them (memfit keeps a hooked layer whole "
            "and runs its hooks in every step). Your model is as it was.")


def _unread_arguments(model: nn.Module, names: list[str]) -> set[str]:
    """Of ``names``, the arguments that the model's own ``forward`` never loads (no ``LOAD_*`` of the name in its
    bytecode, closures included): another value of one changes nothing, so the planned module does not refuse it
    (a fresh user's Hugging Face style ``use_cache=False``, never read in training, was refused at ``True``). None
    where forward reads its locals dynamically (``locals()``, ``vars()``, ``eval``)."""
    code = getattr(getattr(type(model), "forward", None), "__code__", None)
    if code is None:
        return set()
    loads: set[str] = set()
    for ins in dis.get_instructions(code):
        if not ins.opname.startswith("LOAD_"):
            continue
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval in ("locals", "vars", "eval", "exec"):
            return set()
        loads.update(ins.argval if isinstance(ins.argval, tuple) else (ins.argval,))  # (3.13's LOAD_FAST_LOAD_FAST)
    return {name for name in names if name not in loads}


def _refuse_root_hooks(model: nn.Module) -> None:
    """Refuse a model with hooks on itself (forward, forward-pre or backward hooks, or an instance ``forward``),
    before anything runs: the planned module runs the traced graph, not the model's ``__call__``, so they would
    never run (fresh users' counters were then refused at the first step as "registered after planning", and a
    pre-hook scaling the input as a differing output). Hooks on submodules are kept, their module whole."""
    kinds = [f"a {kind}" if len(table) == 1 else f"{len(table)} {kind}s" for kind, table in (
        ("forward pre-hook", model._forward_pre_hooks), ("forward hook", model._forward_hooks),
        ("backward hook", model._backward_hooks), ("backward pre-hook", model._backward_pre_hooks)) if table]
    instance = "forward" in model.__dict__ and not hasattr(model, "_orig_mod")
    if kinds:
        raise TraceError(
            f"the model itself ({type(model).__name__}) has {' and '.join(kinds)} of its own, which the planned module "
            "would not run: it runs the traced forward, not your model's call. Remove them (keep the handles "
            "register_*_hook returned, and call handle.remove()) and register them on the planned module "
            "(planned = memfit.optimize(model, ...); planned.register_forward_hook(hook)), which runs them around "
            "each call as PyTorch runs them around your model's. Your model is as it was.")
    if instance:
        raise TraceError(
            f"the model itself ({type(model).__name__}) has a forward set on the instance (model.forward = f), which "
            "the planned module would not run: it traces the class's forward. Define that forward in a class (a "
            "subclass of yours, or a module wrapping the model) and plan that. Your model is as it was.")


def _random_branch_advice(line: str) -> str:
    """What to change where the failing ``line`` tests a random draw (:func:`memfit.graph.sized._drawn`)."""
    read = sorted(set(re.findall(r"self\.(\w+)", line.split(" in ", 1)[-1])))
    where = f" (the line reads {', '.join('`self.' + a + '`' for a in read)})" if read else ""
    return ("  That line branches on a random draw (a layer dropped at random: layer drop, stochastic depth), so the "
            "operations a step runs change from step to step, and one plan cannot hold them. Where an option of "
            f"the model draws it, turn it off while training with memfit{where}: for transformers models, "
            "`layerdrop=0.0` in the config the model is built from (the layers copy it when built). In your own "
            "code: " + _DRAW_ADVICE)


def _refuse_untraced(model: nn.Module, exc: BaseException, draws: list[str], unknown: list[str] = (),
                     unfolded: list[str] = ()) -> None:
    """Raise the :class:`TraceError` (or :class:`ForwardRaisedError`) for ``exc``, a failure to trace ``model``;
    ``draws``: the lines that drew random numbers in that trace; ``unknown``: the first operation whose shapes the
    trace with the example's shapes could not compute (:mod:`memfit.graph.sized`); ``unfolded``: the lines that
    wrote into a tensor made from sizes and numbers, which was then traced as a graph value
    (:class:`memfit.graph.folded.FoldingAborted`)."""
    line = _user_frame(exc)
    # (a draw sized by a traced shape, `np.random.rand(x.shape[1])`, fails there: its advice was the size's alone)
    drawn = ("  That line draws a random number outside the graph too, which fx would run once, while tracing, "
             "however it is sized. " + _DRAW_ADVICE + "\n") if line in draws else ""
    advice = _random_branch_advice(line) if getattr(exc, "memfit_drawn", False) else _trace_advice(model, exc)
    raise (ForwardRaisedError if _raised_by_user(exc) else TraceError)(
        f"torch.fx could not trace {type(model).__name__}: {type(exc).__name__}: {exc}\n"
        f"  failing line: {line}\n" + drawn + advice
        + (f"\n  (Traced again with the example batch's shapes, memfit could not compute those of {unknown[0]} on "
           "fake tensors, so sizes after it were unknown again; a size set by the data, such as a boolean mask's "
           "selection, has no value before the step runs.)" if unknown else "")
        + (f"\n  (memfit computes a tensor made from sizes and numbers alone, such as torch.eye(n), for real while "
           "tracing, so that a Python test of its values works; this forward writes into such a tensor in place ("
           f"{unfolded[0]}), which makes it a graph value, and a test of it data-dependent. Write it out of place "
           "instead (`e = e.index_fill(0, torch.tensor([0]), 2.0)` for `e[0, :] = 2.0`, `e = e * 2` for "
           "`e.mul_(2)`), which memfit computes for real too.)" if unfolded and "control flow" in str(exc) else "")
    ) from exc


def capture(model: nn.Module, examples: dict[str, Any] | None = None) -> Captured:
    """Trace ``model`` symbolically with ``torch.fx``.

    Reads of the model's own buffers are graph values (``get_attr`` nodes), so an in-place update of a
    buffer in forward (``self.count.add_(1)``) runs in every step, and tracing leaves the buffers unchanged.

    Args:
        model: any ``nn.Module`` whose forward has no data-dependent Python control flow.
        examples: the forward's arguments by name (the example batch; those left out at their default too).
            Those that are one plain Python value (:func:`memfit.graph.calls.plain_scalar`: ``None``, a flag, a
            number, a string) are settings: ``None``, flags and strings are traced as their values (fx's ``concrete_args``), numbers where the trace fails on a line reading them
            (:func:`_trace`); :attr:`Captured.fixed_args` says which. Traced as graph inputs, ``mask is None`` was
            ``False`` and ``if mask is None:`` took the other branch (a fresh user's causal attention,
            ``is_causal=mask is None``, ran unmasked, its gradients off by 1.5e-3, silently), and ``if
            output_hidden_states:`` (Hugging Face's flags) could not be traced at all. Where the trace fails
            (Python code on a traced size: ``if batch_size != position_ids.shape[0]:`` in Hugging Face's mask
            preparation), it is traced again with the examples' shapes, dtypes and devices known
            (:mod:`memfit.graph.sized`), and :attr:`Captured.specialized` says what the graph then holds for.

    Returns:
        :class:`Captured`: the fx ``GraphModule`` (its submodules are the model's own objects, so
        parameters, buffers and gradients are shared) and the plain-data :class:`Graph`.

    Raises:
        TraceError: fx could not trace the model; the message names the failing file and line of the
            user's code and suggests the fix (remove data-dependent control flow there, or wrap that
            submodule as a leaf with ``torch.fx.wrap``).

    Warns:
        UserWarning: the model traces only with its buffers read as constants (a buffer in Python control
            flow): then computations on buffers alone ran once, while tracing, and are not in the graph.
    """
    _refuse_scripted(model)
    refuse_decorated_forward(model)
    _refuse_root_hooks(model)
    numbers = _python_numbers(model)
    plain = {name: v for name, v in (examples or {}).items() if plain_scalar(v)}
    # settings (None, flags, strings, Enum members, dtypes) are traced as their values; a number where the trace
    # fails on a line reading it
    fixed = {name: v for name, v in plain.items() if setting_constant(v)}
    real = [(name, t) for name, t in itertools.chain(model.named_parameters(), model.named_buffers())
            if t.device.type != "meta" and t.untyped_storage().data_ptr()]
    containers = _containers(model)
    first_failure: BaseException | None = None  # (the plain trace's, where a shape-specialized one followed)
    first_draws: list[str] = []
    # (the factory calls whose tensors the forward wrote into, once it did, traced as graph values: memfit.graph.folded)
    fold: bool | frozenset[int] = True
    unfolded: list[str] = []  # (the lines of those writes)
    try:
        while True:
            checkpoints: list[str] = []
            draws: list[str] = []
            writes = _ConcreteStateWrites({t.untyped_storage().data_ptr(): name for name, t in real},
                                          {t.untyped_storage().data_ptr() for _, t in real if t.requires_grad},
                                          attributes={t.untyped_storage().data_ptr(): name for name, t
                                                      in _plain_tensor_attributes(model).items()
                                                      if t.untyped_storage().data_ptr()})
            state, attributes, autocast_tests, hooks = state_of(model), None, [], hooks_of(model)
            try:
                with (_refuse_grad_mode_changes(), _refuse_autocast_blocks(), _watch_autocast_tests(autocast_tests),
                      _watch_user_checkpoints(checkpoints), _autograd_functions_as_leaves(),
                      _watch_random_draws(draws), record_reads(model) as attributes, record_calls() as called,
                      _baked_constants(), writes):
                    gm = _trace(model, fixed, examples if first_failure is not None else None,
                                constants_fallback=examples is None or first_failure is not None, fold=fold)
            except FoldingAborted as exc:  # (traced again with those tensors as graph values, as before folding)
                _put_back_attempt(attributes, numbers, state, hooks)
                _put_back_containers(containers)
                traced = frozenset() if fold is True else fold
                # (all of them where the written tensor's factories are not known, or were already traced)
                fold = False if not exc.factories or exc.factories <= traced else traced | exc.factories
                unfolded.append(str(exc))
                continue
            except _ReentrantCheckpoint:
                raise TraceError(
                    f"the forward pass of {type(model).__name__} calls torch.utils.checkpoint with use_reentrant=True, "
                    "which runs its function under torch.no_grad() and hides it from torch.fx.\n"
                    f"  failing line: {checkpoints[-1]}\n"
                    "  memfit plans recomputation itself: remove that checkpoint (or turn your model's gradient "
                    "checkpointing option off), or pass use_reentrant=False."
                ) from None
            except TraceError:
                raise
            except _AttributeWrite as exc:
                raise _attribute_write_error(model, exc.name, exc.line) from None
            except _ConstantWrite as exc:  # (refused as a traced write into such a tensor is)
                raise _constant_write_error(model, exc.line) from None
            except _StateWrite as exc:
                raise TraceError(
                    f"the forward pass of {type(model).__name__} writes into its parameter or buffer {exc.name!r} in place "
                    "through a tensor torch.fx does not trace (reached by a loop over self.parameters() or "
                    "self.named_buffers(), a list of tensors, or torch._foreach_*: a momentum (EMA) update of a target "
                    "network): fx would run that write once, while tracing, and the planned step never.\n"
                    f"  failing line: {exc.line}\n"
                    "  Move the update out of forward, into your training loop before each call of the planned model "
                    "(`model.momentum_update(); loss = loss_fn(planned(x))`), or write it on the module's attributes "
                    "(`self.target.weight.mul_(m).add_(self.online.weight.detach(), alpha=1 - m)`), which fx records and "
                    "the plan runs at every step. Your model is as it was."
                ) from None
            except _AutocastBlock as exc:
                raise TraceError(
                    f"the forward pass of {type(model).__name__} enters torch.autocast, which torch.fx does not record: "
                    "the plan would run that part in the precision of the caller's context.\n"
                    f"  failing line: {_user_frame(exc)}\n"
                    "  Call the planned module inside torch.autocast instead (memfit.optimize inside the same context, "
                    "as the README's mixed-precision section says); for a part that must stay in float32 "
                    "(`enabled=False` around a head), cast explicitly (`self.head(h.float())`), or move that part into a "
                    "function of its own at module level marked with torch.fx.wrap(\"name\") (run as one step, its "
                    "autocast block included). Your model is as it was."
                ) from None
            except _GradModeChange as exc:
                raise TraceError(
                    f"the forward pass of {type(model).__name__} changes autograd's grad mode (torch.no_grad, "
                    "torch.enable_grad, torch.set_grad_enabled or torch.inference_mode), which torch.fx does not "
                    "record: the plan would compute gradients there.\n"
                    f"  failing line: {_user_frame(exc)}\n"
                    "  Write `t = f(x).detach()` instead of `with torch.no_grad(): t = f(x)` (the same values and "
                    "gradients), or compute that part outside the model and pass it in as an input. An update of the "
                    "model's own weights under torch.no_grad() (a momentum encoder's, MoCo's @torch.no_grad() "
                    "_momentum_update_key_encoder) belongs in your training loop, before each call of the planned model."
                ) from None
            except Exception as exc:  # noqa: BLE001 -- fx raises many types (TraceError, TypeError, ...); refused below
                needed = {name: v for name, v in plain.items()
                          if name not in fixed and name in _arguments_in_control_flow(exc)}
                if needed and attributes is not None:  # (a number the line needs as one: traced again, fixed)
                    _put_back_attempt(attributes, numbers, state, hooks)
                    _put_back_containers(containers)
                    fixed.update(needed)
                    continue
                if (examples is not None and first_failure is None and attributes is not None
                        and not _raised_by_user(exc)):
                    # (traced again with the example's shapes: a plan holds for them only anyway)
                    _put_back_attempt(attributes, numbers, state, hooks)
                    _put_back_containers(containers)
                    first_failure, first_draws = exc, draws
                    continue
                unknown = getattr(exc, "memfit_unknown", [])
                if first_failure is not None and _user_frame(exc) == _user_frame(first_failure):
                    exc, draws = first_failure, first_draws  # (stopped on the same line: the plain trace's error says why)
                _refuse_untraced(model, exc, draws, unknown, unfolded)
            if first_failure is not None and draws:
                # (traced with the example's shapes, it draws random numbers the plain trace stopped before, as
                # torch.distributions' rsample does: the plain trace's error has the advice for that line)
                _refuse_untraced(model, first_failure, first_draws)
            break
    except BaseException:  # (the model as it was: a failed trace may have stored stand-ins)
        _put_back_containers(containers)
        raise
    _refuse_traced_stores(model, containers)
    frozen_grads = [n.target for n in gm.graph.nodes if n.op == "get_attr" and str(n.target).startswith(
        "_tensor_constant") and isinstance(t := getattr(gm, n.target, None), torch.Tensor) and t.grad_fn is not None]
    if frozen_grads:
        raise TraceError(
            f"the forward pass of {type(model).__name__} computes a tensor from the model's trainable parameters "
            "through values torch.fx does not trace (a loop over self.parameters(), a list of tensors: "
            "`sum(p.pow(2).sum() for p in self.parameters())`): fx computed it once, while tracing, and the planned "
            "step would reuse that one tensor and its autograd graph at every step (the gradient of the weights as "
            "they were when traced, then PyTorch's 'Trying to backward through the graph a second time').\n"
            + (f"  failing line: {writes.read_at}\n" if writes.read_at else "")
            + "  Compute it in loss_fn (`loss_fn=lambda out: F.cross_entropy(out, y) + 1e-4 * sum(p.pow(2).sum() "
            "for p in model.parameters())`, which memfit measures), or from the modules' attributes "
            "(`self.fc.weight.pow(2).sum()`), which fx records. Your model is as it was.")
    if draws:
        where = next((d for d in draws if d != "?"), None)
        raise TraceError(
            f"the forward pass of {type(model).__name__} draws a random number on values torch.fx does not trace "
            "(`torch.rand(1).item() < p`, `random.random()`, numpy.random, or random noise of a fixed size): fx ran "
            "that draw once, while tracing, and the planned step would keep its value at every step (a branch "
            "always taken or always skipped, the same noise).\n"
            + (f"  failing line: {where}\n" if where else "")
            + "  " + _DRAW_ADVICE + " Your model and random generators are as they were.")
    _refuse_changed_numbers(model, numbers)
    # a number forward reads and assigns (`self.it += 1`, a warm-up counter): fx ran that once, while tracing, and the
    # graph holds the value it had then (a fresh user's ramp stayed at its first step, gradients 3.09 off, silently)
    paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
    # (one forward reads again after the update: a counter it only keeps, `self.calls += 1`, is the loop's business)
    counters = [(m, name, old) for (mid, name), (m, old) in attributes.before.items()
                if (mid, name) in attributes.read_after_write and type(old) in (int, float)
                and vars(m).get(name, old) != old]
    if counters:
        for m, name, old in counters:  # (the model as it was)
            m.__dict__[name] = old
        m, name, _ = counters[0]
        label = f"{paths.get(id(m), '')}.{name}".lstrip(".")
        raise TraceError(
            f"the forward pass of {type(model).__name__} updates the Python number self.{label} (`self.{name} += 1`): "
            "torch.fx runs that once, while tracing, and the planned step would keep the value it had then, at "
            "every step. Make it a buffer updated in place, which the plan runs in every step "
            f"(`self.register_buffer('{name}', torch.zeros((), dtype=torch.long))` in __init__, "
            f"`self.{name}.add_(1)` in forward), or update it in your training loop. Your model is as it was.")
    if attributes.state_writes:
        names = ", ".join(attributes.state_writes[:4]) + (" ..." if len(attributes.state_writes) > 4 else "")
        raise TraceError(
            f"the forward pass of {type(model).__name__} assigns a new tensor to its buffer or parameter {names} "
            "(`self.step = self.step + 1`, `self.mu = 0.9 * self.mu + ...`): torch.fx cannot record an assignment, "
            "so the planned step would never update it. Update it in place instead, which the plan runs in every "
            "step: `self.step.add_(1)`, `self.mu.mul_(0.9).add_(0.1 * x.mean(0).detach())` (the same values). "
            "Your model is as it was.")
    if attributes.tensor_writes:
        names = ", ".join(attributes.tensor_writes[:4]) + (" ..." if len(attributes.tensor_writes) > 4 else "")
        warnings.warn(
            f"memfit: the forward pass of {type(model).__name__} sets {names} to a tensor it computes (an auxiliary loss, a "
            "feature kept for later): torch.fx cannot record an assignment, so the planned training step never sets "
            "it, and it keeps the value it had before planning (a loss added from it is stale: its gradients are "
            "missing). Return that tensor from forward instead (`return out, aux_loss`), or compute it with a "
            "forward hook on the module that makes it.", stacklevel=3)
    if checkpoints:
        warnings.warn(
            f"memfit traced through the torch.utils.checkpoint call{'s' if len(checkpoints) > 1 else ''} in "
            f"{type(model).__name__} ({checkpoints[0]}{' ...' if len(checkpoints) > 1 else ''}): the plan runs "
            "those functions once and decides what to recompute itself, so BatchNorm statistics are updated "
            "once per step (PyTorch's checkpoint updates them again when it recomputes), and a percentage "
            "budget is of plain PyTorch's peak without your checkpoints, which can be well above your model's "
            "own peak. Give the budget in bytes (or 'min') to stay under what your checkpoints reached.",
            stacklevel=3)
    try:  # the forward's parameter kinds (fx's generated forward puts keyword-only ones before *args)
        kinds = {name: p.kind.name for name, p in inspect.signature(model.forward).parameters.items()}
    except (TypeError, ValueError):
        kinds = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and str(node.target).lstrip("*") in kinds:
            node.meta["memfit_kind"] = kinds[str(node.target).lstrip("*")]
    with_assert_values(gm)
    _warn_opaque(gm)
    unread = _unread_arguments(model, list(fixed))
    return Captured(gm=gm, graph=graph_of(gm), model=model, attributes=attributes.values(model),
                    called=list(called.items()), fixed_args={k: v for k, v in fixed.items() if k not in unread},
                    unread_args=tuple(sorted(unread)), autocast_tests=tuple(dict.fromkeys(autocast_tests)),
                    specialized=None if first_failure is None else Specialized.of(examples, _user_frame(first_failure)))


def graph_of(gm: fx.GraphModule) -> Graph:
    """The plain-data :class:`Graph` of a traced ``GraphModule``."""
    nodes: list[Node] = []
    inputs: list[str] = []
    outputs: list[str] = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            inputs.append(n.name)
        elif n.op == "output":
            outputs = [a.name for a in n.all_input_nodes]
        else:
            mtype = None
            if n.op == "call_module":
                mtype = type(gm.get_submodule(n.target)).__name__
            nodes.append(Node(name=n.name, op=n.op, target=_target_name(n),
                              inputs=[a.name for a in n.all_input_nodes], block=_block(n), module_type=mtype))
    return Graph(nodes=nodes, inputs=inputs, outputs=outputs)


def _warn_opaque(gm: fx.GraphModule) -> None:
    """Warn about torch.nn modules with submodules that fx keeps as one node (it does not trace into
    ``torch.nn``): memfit can keep or recompute what they save only as a whole."""
    def stacked_rnn(mod: nn.Module) -> bool:  # several recurrent layers in one kernel call
        return isinstance(mod, nn.RNNBase) and mod.num_layers > 1

    mods = [(n.target, gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module"]
    opaque = sorted({f"{t} ({type(m).__name__})" for t, m in mods
                     if (any(True for _ in m.children()) or stacked_rnn(m))
                     and not has_own_hooks(m)})  # (kept whole for its hooks)
    if opaque:
        rnn = any(stacked_rnn(m) for _, m in mods)
        warn_user(
            f"memfit sees {', '.join(opaque[:5])}{' ...' if len(opaque) > 5 else ''} as single operations "
            "(torch.fx does not trace into torch.nn modules): what they save for backward can only be kept "
            "or recomputed as a whole. For finer plans, write such blocks from their parts (Linear, "
            "LayerNorm, ...) in your own module" + (", and a recurrent network of several layers as one "
            "single-layer nn.LSTM / nn.GRU per layer" if rnn else "") + ".")
