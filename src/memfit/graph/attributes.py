"""The Python attributes of the model that its traced forward pass read, and their values then.

``torch.fx`` runs the Python code of ``forward`` once, while tracing, and records only tensor operations:
a Python value the code reads (``self.route`` choosing an expert, ``F.dropout(h, p=self.p)``,
``out * self.scale``, ``self.training`` in a block fx traces into, ``self.config.layer_scale``, a function kept
as ``self.act``) is baked into the graph as the constant it was then. Changing such an attribute after
planning changes what plain PyTorch computes but not what the traced graph computes, so the planned module
would train a different function, silently (a fresh user's scale changed from 1 to 3: gradients off by 0.23;
a block switched to eval mode: 0.86). :func:`record_reads` finds those attributes while tracing; the planned
module compares them at each training call (:meth:`memfit.runtime.planned.PlannedModule.forward`) and refuses
a change.

Recorded, per module: attributes read from its instance ``__dict__`` (not parameters, buffers or submodules,
which the graph reads live), ``training`` included; plain class attributes of the user's classes read through
``self`` (``type(m).scale``); names read while absent (``getattr(self, "gain", 1.0)``). Plain data (``None``,
booleans, numbers, strings, enums, tuples / lists / frozensets of those up to 256 items) is compared by
value; any other object (a tensor, an array, a function) by identity, and the plain attributes of a
config-like object (one with a ``__dict__``) by value too. Left out: names starting with ``_``, and attributes
the forward pass itself assigns (``self.calls += 1``: README, "Python attributes changed in forward").
Not seen: a list or array changed in place (the same object), and attributes of objects other than modules
and their direct config-like attributes.

How: while tracing, each module's class is swapped for a subclass (same name and module, so ``torch.fx``
still treats ``torch.nn`` layers as leaves) whose ``__getattribute__`` and ``__setattr__`` log the names;
the classes are put back when tracing ends, also on error. A module whose class cannot be swapped is not
watched.
"""

from __future__ import annotations

import contextlib
import copy
import dis
import enum
import os
import sys
import sysconfig
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import fx, nn

__all__ = ["AttributeLog", "changed_attribute", "changed_global", "collecting_now", "collects_in_call",
           "global_reads", "has_hooks", "has_own_hooks", "hooks_of", "is_plain", "put_back_hooks", "record_calls",
           "record_reads", "renormed_parameters"]

_MAX_ITEMS = 256
_SUBCLASSES: dict[type, type] = {}


def is_plain(value: Any) -> bool:
    """``value`` is plain data whose equality says whether a traced graph still matches it."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes | enum.Enum):
        return True
    if isinstance(value, tuple | list | frozenset) and len(value) <= _MAX_ITEMS:
        return all(is_plain(v) for v in value)
    return False


class _Ref:
    """A value that is not plain data (a tensor, an array, a function, a config object), watched by identity, and a
    config-like object's plain attributes by value too (``self.config.layer_scale``)."""

    __slots__ = ("obj", "plain")

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        fields = _fields(obj)
        self.plain = None if fields is None else {k: v for k, v in fields.items() if is_plain(v)}

    def matches(self, now: Any) -> bool:
        """``now`` is the object watched with the same plain fields, or (a config object or dict) an object of
        the same type with the same plain fields (``dataclasses.replace(cfg)``)."""
        if self.plain is None:
            return now is self.obj
        if now is not self.obj and type(now) is not type(self.obj):
            return False
        fields = _fields(now) or {}
        return all(k in fields and _equal(fields[k], v) for k, v in self.plain.items())

    def __repr__(self) -> str:
        return f"the {type(self.obj).__name__} object it held then"

    def __deepcopy__(self, memo: dict) -> _Ref:
        new = _Ref.__new__(_Ref)
        new.obj, new.plain = copy.deepcopy(self.obj, memo), copy.deepcopy(self.plain, memo)
        return new


def _fields(obj: Any) -> dict | None:
    """The fields of a config-like object (its ``__dict__``) or of a dict; ``None`` for tensors, arrays,
    functions and other objects watched by identity alone."""
    if isinstance(obj, dict):
        return obj
    fields = getattr(obj, "__dict__", None)
    if isinstance(fields, dict) and not callable(obj) and not isinstance(obj, torch.Tensor):
        return fields
    return None


def _equal(now: Any, then: Any) -> bool:
    """Plain values equal, a tuple and a list with equal items included."""
    if isinstance(now, tuple | list) and isinstance(then, tuple | list):
        return len(now) == len(then) and all(_equal(a, b) for a, b in zip(now, then, strict=True))
    return is_plain(now) and bool(now == then)


_MISSING = object()


class _Missing:
    def __repr__(self) -> str:
        return "absent"


ABSENT = _Missing()


def _snapshot(value: Any) -> Any:
    return value if is_plain(value) else _Ref(value)


class AttributeLog:
    """Attributes read (``name -> "instance" | "class" | "missing"``) and names assigned, per module (by ``id``),
    while tracing."""

    def __init__(self) -> None:
        self.reads: dict[int, dict[str, str]] = {}
        self.writes: dict[int, set[str]] = {}
        self.before: dict[tuple[int, str], tuple[nn.Module, Any]] = {}  # (module, its value before the first write)
        self.state_writes: list[str] = []  # "path.name" of buffers/parameters forward replaced (restored since)
        self.tensor_writes: list[str] = []  # "path.name" of plain attributes forward set to a traced tensor
        self.read_after_write: set[tuple[int, str]] = set()  # (module id, name) read again after forward assigned it

    def put_back(self) -> None:
        """Give every attribute forward assigned the value it had before (remove one it added): a failed trace is
        traced again from the model as it was."""
        for (_, name), (module, old) in self.before.items():
            if old is _MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = old

    def values(self, model: nn.Module) -> dict[str, dict[str, tuple[str, Any]]]:
        """``{module path: {attribute: (kind, value)}}`` for the attributes read and not assigned (path ``""``: the
        model itself), their values as they are now (after tracing): plain data by value, other objects by identity
        (:class:`_Ref`), ``ABSENT`` for a name read while it did not exist (``getattr(self, "gain", 1.0)``)."""
        out: dict[str, dict[str, tuple[str, Any]]] = {}
        for path, module in model.named_modules():
            reads = self.reads.get(id(module), {})
            written = self.writes.get(id(module), set())
            kept: dict[str, tuple[str, Any]] = {}
            for name in sorted(set(reads) - written):
                now = _current(module, name, reads[name])
                if now is _MISSING:
                    kept[name] = (reads[name], ABSENT)
                elif not isinstance(now, nn.Module):
                    kept[name] = (reads[name], _snapshot(now))
            if kept:
                out[path] = kept
        return out


def _current(module: nn.Module, name: str, kind: str) -> Any:
    """The attribute's value now where it was read from (``_MISSING`` if it is not there); for one read from the
    class, what the module reads now: an instance attribute set since (``m.use_aux = False`` over the class's
    ``use_aux = True``) hides the class's (a fresh user's aux head kept running, silently)."""
    value = vars(module).get(name, _MISSING)
    if kind == "class":
        return value if value is not _MISSING else getattr(type(module), name, _MISSING)
    if kind == "missing" and value is _MISSING:
        value = getattr(type(module), name, _MISSING)
    return value


_ACTIVE: list[AttributeLog] = []


@contextlib.contextmanager
def reads_paused() -> Iterator[None]:
    """Within :func:`record_reads`, log nothing while the block runs: memfit's own runs of the model's code while
    tracing (:mod:`memfit.graph.sized` computing shapes on fake tensors), which the traced graph does not hold."""
    saved = _ACTIVE[:]
    _ACTIVE.clear()
    try:
        yield
    finally:
        _ACTIVE[:] = saved


def _watching(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is not None:
        return sub
    user_classes = [k for k in cls.__mro__ if not k.__module__.startswith(("torch.", "builtins"))]

    def __getattribute__(self, name):
        try:
            value = super(sub, self).__getattribute__(name)
        except AttributeError:
            if _ACTIVE and name[:1] != "_":
                own = object.__getattribute__(self, "__dict__")
                if not any(name in own.get(d, {}) for d in ("_parameters", "_buffers", "_modules")):
                    _ACTIVE[-1].reads.setdefault(id(self), {}).setdefault(name, "missing")
            raise
        if _ACTIVE and name[:1] != "_":
            if name in object.__getattribute__(self, "__dict__"):
                _ACTIVE[-1].reads.setdefault(id(self), {})[name] = "instance"
                if name in _ACTIVE[-1].writes.get(id(self), ()):  # (read again after forward assigned it)
                    _ACTIVE[-1].read_after_write.add((id(self), name))
            elif any(name in vars(k) and is_plain(vars(k)[name]) for k in user_classes):
                _ACTIVE[-1].reads.setdefault(id(self), {})[name] = "class"
        return value

    def __setattr__(self, name, value):
        if _ACTIVE:
            _ACTIVE[-1].writes.setdefault(id(self), set()).add(name)
            _ACTIVE[-1].before.setdefault((id(self), name), (self, vars(self).get(name, _MISSING)))
        super(sub, self).__setattr__(name, value)

    sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__setattr__": __setattr__,
                                      "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    _SUBCLASSES[cls] = sub
    return sub


@contextlib.contextmanager
def record_reads(model: nn.Module) -> Iterator[AttributeLog]:
    """While the block runs (``torch.fx`` tracing ``model``), log the attributes each module of ``model`` reads
    and assigns; :meth:`AttributeLog.values` then gives those read. Every module's class is restored on exit."""
    log = AttributeLog()
    swapped: list[tuple[nn.Module, type]] = []
    paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
    # each module's buffers and parameters as they are: forward may replace one with a traced value (`self.step =
    # self.step + 1`), which would leave an fx Proxy in the user's model (its state_dict then did not save)
    state = [(m, table, dict(getattr(m, table))) for m in {id(m): m for m in model.modules()}.values()
             for table in ("_buffers", "_parameters")]
    try:
        for module in {id(m): m for m in model.modules()}.values():
            cls = type(module)
            try:
                module.__class__ = _watching(cls)
            except Exception:  # noqa: BLE001, S112 -- (a class that cannot be subclassed or swapped: not watched)
                continue
            swapped.append((module, cls))
        _ACTIVE.append(log)
        yield log
    finally:
        if _ACTIVE and _ACTIVE[-1] is log:
            _ACTIVE.pop()
        for module, cls in swapped:
            object.__setattr__(module, "__class__", cls)
        # an attribute forward assigned a traced value (`self.feat = h.detach()`) would keep an fx Proxy on the
        # user's model (a fresh user's torch.save(model) then failed): put back what was there
        for (_, name), (module, old) in log.before.items():
            if isinstance(vars(module).get(name), torch.fx.Proxy):
                log.tensor_writes.append(_label(paths.get(id(module), "?"), name))
                if old is _MISSING:
                    del module.__dict__[name]
                else:
                    module.__dict__[name] = old
        # (a tensor registered while tracing, such as a mask cached on the first call, is what PyTorch's first
        # forward pass would leave too; only a traced value is put back)
        for module, table, saved in state:
            now = getattr(module, table)
            traced = [k for k, v in now.items() if isinstance(v, torch.fx.Proxy)]
            for k in traced:
                log.state_writes.append(_label(paths.get(id(module), "?"), k))
                if k in saved:
                    now[k] = saved[k]
                else:
                    del now[k]


def _label(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def changed_attribute(watched: list[tuple[str, nn.Module, str, str, Any]]) -> tuple[str, str, str] | None:
    """The first ``(path.attribute, value then, value now)`` of ``watched`` (``(path, module, attribute, kind,
    value when traced)``, from :meth:`AttributeLog.values`) whose value changed, the values as text for a message
    (``repr`` of plain values), else ``None``."""
    for path, module, name, kind, then in watched:
        now = _current(module, name, kind)
        if _unchanged(then, now):
            continue
        label = f"{path}.{name}" if path else name
        shown = "the same object with other values" if isinstance(then, _Ref) and now is then.obj else _shown(now)
        return label, repr(then), shown
    return None


def _unchanged(then: Any, now: Any) -> bool:
    """``now`` (``_MISSING`` where absent) is what ``then`` (a snapshot: :func:`_snapshot`, or ``ABSENT``) watched."""
    if now is then or (isinstance(then, _Ref) and then.matches(now)):
        return True
    if then is ABSENT:
        return now is _MISSING
    return not isinstance(then, _Ref) and now is not _MISSING and is_plain(now) and _equal(now, then)


def _shown(now: Any) -> str:
    """``now`` as a message shows it."""
    return "absent" if now is _MISSING else repr(now) if is_plain(now) else f"another {type(now).__name__} object"


def renormed_parameters(model: nn.Module, gm: fx.GraphModule | None = None) -> list[torch.Tensor]:
    """The parameters the forward pass rewrites inside a ``torch.nn`` layer or function, where the traced graph does
    not show the write: ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``max_norm`` (and ``F.embedding(ids, w,
    max_norm=...)`` in ``gm``) renormalize the rows they look up, in place. Planning runs the forward pass several
    times, and must put them back (a fresh user's tied embedding and output weights had the planning batch's rows
    renormalized by ``memfit.optimize``: the first step on other tokens gave a loss of 5.587 where plain PyTorch gave
    6.310)."""
    out = {id(m.weight): m.weight for m in model.modules()
           if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None
           and isinstance(m.weight, torch.Tensor)}
    for node in gm.graph.nodes if gm is not None else ():
        if node.op != "call_function" or node.target not in (F.embedding, F.embedding_bag):
            continue
        max_norm = node.kwargs.get("max_norm", node.args[3] if len(node.args) > 3 else None)
        weight = node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else None)
        if max_norm is not None and isinstance(weight, fx.Node) and weight.op == "get_attr":
            value = gm
            for part in str(weight.target).split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.Tensor):
                out[id(value)] = value
    return list(out.values())


def has_own_hooks(module: nn.Module) -> bool:
    """``module`` has a forward, forward-pre or backward hook registered on it (not counting global ones), or a
    ``forward`` of its own instance (``layer.forward = f``, as monkey-patching libraries do), which an operator
    variant standing in for its class's computation would skip as it would skip a hook (a fresh user's patched
    LeakyReLU ran as its class's: outputs 0.17 off, silently). Not ``torch.compile``'s wrapper, whose instance
    ``forward`` is the compiled one: it is refused with its own advice."""
    return bool(any(not collects_in_call(h) for h in module._forward_hooks.values()) or module._forward_pre_hooks
                or module._backward_hooks or module._backward_pre_hooks
                or ("forward" in module.__dict__ and not hasattr(module, "_orig_mod")))


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
              "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks")  # (a module's hook registries)


def hooks_of(model: nn.Module) -> list[tuple[dict, dict]]:
    """``(registry, copy)`` of each hook registry of ``model``'s modules, for :func:`put_back_hooks`."""
    return [(d, dict(d)) for m in model.modules() for name in _HOOK_DICTS if (d := getattr(m, name, None)) is not None]


def put_back_hooks(saved: list[tuple[dict, dict]]) -> None:
    """The hook registries as :func:`hooks_of` saw them, in place (a hook handle refers to its registry): hooks a
    failed trace registered (Hugging Face's output recorder installs its hooks at the first call that asks for hidden
    states, and marks the model as hooked; the mark was put back, so a second trace installed them again, and each
    layer's hidden state was collected twice) are gone."""
    for registry, before in saved:
        if registry.keys() != before.keys():
            registry.clear()
            registry.update(before)


def collecting_now(hook) -> bool:
    """Whether the recorder ``hook`` (:func:`collects_in_call`) would collect its module's output now, inside the
    model's call that asked for it: transformers' context variable holds the hook's key. ``True`` where that cannot
    be read (another transformers version): then memfit assumes it would."""
    try:
        collector = hook.__globals__["_active_collector"].get()
        key = hook.__closure__[hook.__code__.co_freevars.index("key")].cell_contents
    except (AttributeError, KeyError, ValueError, IndexError, TypeError):
        return True
    return collector is not None and key in collector


def collects_in_call(hook) -> bool:
    """Whether ``hook`` is Hugging Face transformers' output recorder (``output_capturing_hook``): it collects its
    module's output only while the model's own call runs (a context variable its ``capture_outputs`` decorator sets
    and resets) and does nothing otherwise. So it is not a hook of the user's: traced into, it runs on fx's
    stand-ins and what it collects (the router logits of a mixture-of-experts load-balancing loss,
    ``output_router_logits=True``; ``output_hidden_states=True``'s hidden states) is part of the graph. Kept whole
    for it, the module's hook ran on nothing while tracing, and Mixtral's load-balancing loss failed on an empty
    tuple (``gate_logits[0]``)."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


def has_hooks(modules: list[nn.Module]) -> bool:
    """Any of ``modules`` has a forward, forward-pre or backward hook of its own, or a global module hook exists
    (``torch.nn.modules.module.register_module_forward_hook``): such a hook sees (and may keep) its module's
    inputs and outputs."""
    from torch.nn.modules import module as torch_module

    if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
            or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks):
        return True
    return any(has_own_hooks(m) for m in modules)


_SITE = tuple(p for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")} if p)


def _users(code) -> bool:
    """``code`` is the user's (not memfit's, torch's, the standard library's or an installed package's)."""
    return _users_file(code.co_filename)


def _users_file(name: str) -> bool:
    """The file ``name`` is the user's (see :func:`_users`)."""
    from memfit.warn import in_library

    return not (in_library(name) or name.startswith("<") or os.path.abspath(name).startswith(_SITE))


@contextlib.contextmanager
def record_calls() -> Iterator[dict]:
    """``{code: globals}`` of the user's Python functions (:func:`_users`) called inside the block: while
    ``torch.fx`` traces, those whose code the graph holds (a method of a module other than ``forward`` that forward
    never calls, a LightningModule's ``training_step``, is not one: its globals are not baked)."""
    called: dict = {}
    mine: dict = {}  # code -> whether it is the user's (cached: fx calls many of torch's functions)

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            users = mine.get(code)
            if users is None:
                users = mine[code] = _users(code)
            if users:
                called.setdefault(code, frame.f_globals)

    before = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield called
    finally:
        sys.setprofile(before)


def global_reads(called: list[tuple[Any, dict]]) -> list[tuple[str, dict, str, Any]]:
    """The module-level names (globals) that the user's code run while tracing (``called``: ``(code, globals)``,
    from :func:`record_calls`) reads. ``torch.fx`` bakes the values they had then into the graph, as it does a
    module attribute's (a fresh user's ``CFG["scale"] = 3.0`` and ``TEMPERATURE = 0.5`` after planning: outputs 3.5
    off, silently).

    Watched: a global (``SCALE``), a constant key or index of one (``CFG["scale"]``: only that entry, so a loop's
    ``CFG["epoch"] += 1`` is not a change), an attribute of one of the user's modules (``myconfig.SCALE``), and a
    function kept in a global (``ACT = F.gelu`` after planning changes what plain PyTorch computes). Returns
    ``(label, namespace, name, value then)`` each, compared by :func:`changed_global`: plain data by value, a dict
    or config-like object read whole by identity and its plain fields by value, another object by identity. Left
    out: modules and classes themselves, and code outside the user's files or not run while tracing (a function
    ``torch.fx.wrap`` registered runs live, reading its globals then)."""
    out: dict[tuple, tuple[str, dict, str, Any]] = {}

    def watch(label: str, space: dict, name: str, value: Any, key: Any = _MISSING) -> None:
        if key is not _MISSING:  # one entry of a dict, list or tuple, read by a constant key or index
            if (id(space), name, None) in out:
                return
            out[(id(space), name, key)] = (f"{label}[{key!r}]", space, (name, key), _snapshot(value[key]))
        else:
            out.setdefault((id(space), name, None), (label, space, name, _snapshot(value)))

    for code, g in called:
        prefix = g.get("__name__", "?")
        ins = list(dis.get_instructions(code))
        for k, op in enumerate(ins):
            if op.opname not in ("LOAD_GLOBAL", "LOAD_NAME") or op.argval not in g:
                continue
            name, value = op.argval, g[op.argval]
            nxt = ins[k + 1] if k + 1 < len(ins) else None
            if isinstance(value, types.ModuleType):  # myconfig.SCALE, myhelpers.scale(h)
                if nxt is None or nxt.opname not in ("LOAD_ATTR", "LOAD_METHOD") or not _users_module(value):
                    continue
                attr = getattr(value, nxt.argval, _MISSING)
                if attr is not _MISSING and not isinstance(attr, types.ModuleType | type):
                    watch(f"{value.__name__}.{nxt.argval}", vars(value), nxt.argval, attr)
                continue
            if isinstance(value, type) or name.startswith("__"):
                continue
            after = ins[k + 2] if k + 2 < len(ins) else None
            if (nxt is not None and nxt.opname == "LOAD_CONST" and after is not None
                    and (after.opname == "BINARY_SUBSCR" or (after.opname == "BINARY_OP" and after.argrepr == "[]"))
                    and isinstance(value, dict | list | tuple)):
                try:
                    watch(f"{prefix}.{name}", g, name, value, nxt.argval)
                    continue
                except (KeyError, IndexError, TypeError):
                    pass
            watch(f"{prefix}.{name}", g, name, value)
    return list(out.values())


def _users_module(module: types.ModuleType) -> bool:
    """``module`` is a file of the user's (not memfit's, torch's, the standard library's or a package's)."""
    path = getattr(module, "__file__", None)
    return bool(path) and _users_file(path)


def changed_global(watched: list[tuple[str, dict, str, Any]]) -> tuple[str, str, str] | None:
    """The first ``(module.name, value then, value now)`` of ``watched`` (:func:`global_reads`) whose value
    changed, as text for a message, else ``None``."""
    for label, g, name, then in watched:
        if isinstance(name, tuple):  # one entry, read by a constant key or index
            whole = g.get(name[0], _MISSING)
            try:
                now = whole[name[1]]
            except (KeyError, IndexError, TypeError):
                now = _MISSING
        else:
            now = g.get(name, _MISSING)
        if _unchanged(then, now):
            continue
        if isinstance(then, _Ref) and now is then.obj and then.plain is not None:  # (a field changed: name it)
            fields = _fields(now) or {}
            for k, v in then.plain.items():
                if k not in fields or not _equal(fields[k], v):
                    key = f"[{k!r}]" if isinstance(now, dict) else f".{k}"
                    return label + key, repr(v), repr(fields[k]) if k in fields else "absent"
        return label, repr(then), _shown(now)
    return None
