"""The plain Python attributes of the model that its traced forward pass read, and their values then.

``torch.fx`` runs the Python code of ``forward`` once, while tracing, and records only tensor operations:
a Python value the code reads (``self.route`` choosing an expert, ``F.dropout(h, p=self.p)``,
``out * self.scale``) is baked into the graph as the constant it was then. Changing such an attribute after
planning changes what plain PyTorch computes but not what the traced graph computes, so the planned module
would train a different function, silently (a fresh user's scale changed from 1 to 3: gradients off by 0.23).
:func:`record_reads` finds those attributes while tracing; the planned module compares them at each training
call (:meth:`memfit.runtime.planned.PlannedModule.forward`) and refuses a change.

Recorded: attributes in a module's instance ``__dict__`` (not parameters, buffers or submodules, which the
graph reads live) whose values are plain data: ``None``, booleans, numbers, strings, enums, and tuples,
lists or frozensets of those (up to 256 items). Left out: names starting with ``_``, ``training`` (the
planned module runs the graph in training mode only), and attributes the forward pass itself assigns
(``self.calls += 1``: README, "Python attributes changed in forward").

How: while tracing, each module's class is swapped for a subclass (same name and module, so ``torch.fx``
still treats ``torch.nn`` layers as leaves) whose ``__getattribute__`` and ``__setattr__`` log the names;
the classes are put back when tracing ends, also on error. A module whose class cannot be swapped is not
watched.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["AttributeLog", "changed_attribute", "record_reads"]

_MAX_ITEMS = 256
_SUBCLASSES: dict[type, type] = {}


def is_plain(value: Any) -> bool:
    """``value`` is plain data whose equality says whether a traced graph still matches it."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes | enum.Enum):
        return True
    if isinstance(value, tuple | list | frozenset) and len(value) <= _MAX_ITEMS:
        return all(is_plain(v) for v in value)
    return False


class AttributeLog:
    """Names read and assigned per module (by ``id``) while tracing."""

    def __init__(self) -> None:
        self.reads: dict[int, set[str]] = {}
        self.writes: dict[int, set[str]] = {}

    def values(self, model: nn.Module) -> dict[str, dict[str, Any]]:
        """``{module path: {attribute: value}}`` for the plain attributes read and not assigned (path ``""``:
        the model itself), the values as they are now (after tracing)."""
        out: dict[str, dict[str, Any]] = {}
        for path, module in model.named_modules():
            names = self.reads.get(id(module), set()) - self.writes.get(id(module), set())
            own = vars(module)
            kept = {n: own[n] for n in sorted(names) if n in own and is_plain(own[n])}
            if kept:
                out[path] = kept
        return out


_ACTIVE: list[AttributeLog] = []


def _watching(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is not None:
        return sub

    def __getattribute__(self, name):
        value = super(sub, self).__getattribute__(name)
        if _ACTIVE and name[:1] != "_" and name != "training" and name in object.__getattribute__(self, "__dict__"):
            _ACTIVE[-1].reads.setdefault(id(self), set()).add(name)
        return value

    def __setattr__(self, name, value):
        if _ACTIVE:
            _ACTIVE[-1].writes.setdefault(id(self), set()).add(name)
        super(sub, self).__setattr__(name, value)

    sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__setattr__": __setattr__,
                                      "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    _SUBCLASSES[cls] = sub
    return sub


@contextlib.contextmanager
def record_reads(model: nn.Module) -> Iterator[AttributeLog]:
    """While the block runs (``torch.fx`` tracing ``model``), log the attributes each module of ``model`` reads
    and assigns; :meth:`AttributeLog.values` then gives the plain ones read. Every module's class is restored
    on exit."""
    log = AttributeLog()
    swapped: list[tuple[nn.Module, type]] = []
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


_MISSING = object()


def changed_attribute(watched: list[tuple[str, nn.Module, str, Any]]) -> tuple[str, Any, Any] | None:
    """The first ``(path.attribute, value then, value now)`` of ``watched`` (``(path, module, attribute, value
    when traced)``) whose value changed, else ``None``."""
    for path, module, name, then in watched:
        now = vars(module).get(name, _MISSING)
        if now is then:
            continue
        if now is _MISSING or now != then:
            label = f"{path}.{name}" if path else name
            return label, then, ("(no longer a plain attribute)" if now is _MISSING else now)
    return None
