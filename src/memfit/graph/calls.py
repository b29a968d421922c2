"""Run single fx nodes: the one place that turns a traced node into a call (used by profile and runtime)."""

from __future__ import annotations

import collections
import dataclasses
import enum
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import fx


def node_fn(gm: fx.GraphModule, node: fx.Node, module=None) -> Callable[[dict[str, Any]], Any]:
    """Return ``f(env) -> value`` that evaluates ``node`` reading its arguments from ``env`` (name -> value).

    ``module`` replaces the called submodule of a ``call_module`` node (an operator variant)."""
    load = arg_loader(node)

    if node.op == "call_module":
        mod = module if module is not None else gm.get_submodule(node.target)

        def run(env):
            a, k = load(env)
            return mod(*a, **k)
    elif node.op == "call_function":
        target = node.target

        def run(env):
            a, k = load(env)
            return target(*a, **k)
    elif node.op == "call_method":
        name = node.target

        def run(env):
            a, k = load(env)
            return getattr(a[0], name)(*a[1:], **k)
    elif node.op == "get_attr":
        obj: Any = gm
        for part in node.target.split("."):
            obj = getattr(obj, part)

        def run(env, obj=obj):
            return obj
    else:
        raise ValueError(f"cannot run fx node {node.name} with op {node.op}")
    return run


def arg_loader(node: fx.Node) -> Callable[[dict[str, Any]], tuple[Any, Any]]:
    """``load(env) -> (args, kwargs)``: ``node``'s arguments with every node replaced by its value in ``env``."""
    args, kwargs = node.args, node.kwargs
    nested = (tuple, list, dict, slice)
    if not any(isinstance(a, nested) for a in (*args, *kwargs.values())):
        # (the common case, each argument a value or a constant: this runs for every node of every planned step, and
        # fx's map_arg walks its arguments as a tree, a few microseconds a node)
        arg_parts = tuple((a.name, None) if isinstance(a, fx.Node) else (None, a) for a in args)
        kwarg_parts = tuple((k, (v.name, None) if isinstance(v, fx.Node) else (None, v)) for k, v in kwargs.items())

        def load_flat(env):
            return (tuple(c if n is None else env[n] for n, c in arg_parts),
                    {k: c if n is None else env[n] for k, (n, c) in kwarg_parts})
        return load_flat

    def load(env):
        return fx.node.map_arg(args, lambda a: env[a.name]), fx.node.map_arg(kwargs, lambda a: env[a.name])
    return load


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The fx nodes that compute (not placeholders or the output), in forward order."""
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def node_ops(gm: fx.GraphModule) -> list[str]:
    """What each computing node of ``gm`` runs, in forward order, as text that is the same in every process: a
    module's class and ``extra_repr`` (``"Conv2d(3, 8, kernel_size=(3, 3), stride=(2, 2))"``), a function's or
    method's name with its constant arguments (``"flatten(_, 1)"``, ``".view(_, -1, 4)"``; ``_`` for a
    graph value) or an attribute read (``"@weight"``). Two graphs with the same node names can differ here
    (``nn.ReLU`` swapped for ``nn.Dropout`` keeps the name ``_1``; so does a convolution's stride, which changes
    every activation after it)."""
    ops = []
    for node in compute_nodes(gm):
        t = node.target
        if node.op == "call_module":
            module = gm.get_submodule(t)
            text = getattr(module, "node_op", None)  # a module of memfit's own that says which settings count
            ops.append(text() if callable(text) else f"{type(module).__name__}({module.extra_repr()})")
        elif node.op == "get_attr":
            ops.append(f"@{t}")
        else:
            args = [_constant_text(a) for a in node.args] + [f"{k}={_constant_text(v)}" for k, v in node.kwargs.items()]
            ops.append(f"{call_name(node)}({', '.join(args)})")
    return ops


def node_inputs(gm: fx.GraphModule) -> list[list[str]]:
    """The names of the nodes each computing node of ``gm`` reads, in forward order and in the order its
    arguments name them: two graphs with the same node names and operations can differ here (``c = b * 2``
    edited to ``c = a * 2``), and a plan's in-place forms are legal only for the graph it was solved for."""
    return [[a.name for a in node.all_input_nodes] for node in compute_nodes(gm)]


def call_name(node: fx.Node) -> str:
    """The name of what a ``call_function`` / ``call_method`` node calls: ``"flatten"``, ``".view"``."""
    t = node.target
    if isinstance(t, str):  # a method's name (or an attribute's path)
        return f".{t}" if node.op == "call_method" else t
    return getattr(t, "__name__", None) or getattr(t, "__qualname__", None) or type(t).__name__


def _constant_text(value) -> str:
    """``value`` (an fx node argument) as text without object addresses: ``_`` for a graph value."""
    if isinstance(value, fx.Node):
        return "_"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_constant_text(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_constant_text(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, (bool, int, float, str, slice, torch.dtype, torch.device)):
        return repr(value)
    if value is Ellipsis:
        return "..."
    return type(value).__name__


def rebuilt_of_its_class(value) -> bool:
    """A value searched and rebuilt through :func:`dataclass_parts` and :func:`dataclass_builder`, in the graph and
    around it: a dataclass instance, or a dict of a subclass other than fx's immutable one and ``defaultdict`` (an
    ``OrderedDict``, as torchvision's segmentation models return; a ``class Out(dict)`` of the user's), which
    torch.fx would record as a plain dict (a fresh user's ``out.move_to_end`` then failed)."""
    from torch.fx.immutable_collections import immutable_dict

    return (dataclasses.is_dataclass(value) and not isinstance(value, type)) or (
        isinstance(value, dict) and type(value) not in (dict, immutable_dict, collections.defaultdict))


def forward_params(model) -> list[inspect.Parameter]:
    """The parameters of ``model.forward`` (none where its signature cannot be read)."""
    try:
        return list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return []


def in_traced_order(params: list[inspect.Parameter]) -> list[inspect.Parameter]:
    """The forward's named parameters in the order torch.fx's traced forward takes them: positional ones, then the
    keyword-only ones (bound by name from a dict of example inputs)."""
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)] + [
        p for p in params if p.kind == p.KEYWORD_ONLY]


def forward_arguments(model, inputs: tuple) -> dict[str, Any]:
    """``model``'s forward arguments for the positional ``inputs``, by name, those left out at their default (none
    for an argument without one; ``def forward(self, ids, mask=None, output_hidden_states: bool = False)`` called
    with ``ids`` alone). :func:`memfit.graph.capture.capture` traces the plain Python values among them as settings,
    and with their shapes where Python code on a size stops the plain trace."""
    named = in_traced_order(forward_params(model))
    values = {p.name: inputs[k] if k < len(inputs) else p.default for k, p in enumerate(named)}
    return {name: v for name, v in values.items() if v is not inspect.Parameter.empty}


def tensors_in(value) -> list:
    """All tensors inside a (possibly nested) value: tuples, lists, dicts, namedtuples and dataclass instances (a
    forward's ``return Output(logits=...)``: their attributes and entries, :func:`dataclass_parts`; PyTorch's pytree
    does not search them) are searched, in the order :func:`map_tensors` visits them."""
    from torch.utils._pytree import tree_leaves

    found = []
    for v in tree_leaves(value, is_leaf=rebuilt_of_its_class):  # (before a pytree registration: transformers' fails)
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif rebuilt_of_its_class(v):
            found += tensors_in(list(dataclass_parts(v)))
    return found


def tensor_paths(value, prefix: str = "") -> list[str]:
    """Where each tensor :func:`tensors_in` finds sits in ``value``, in its order, as Python would index it after
    ``prefix``: ``[1][0]``, ``['aux']['n']``, ``.features[1]`` (a dataclass's attribute). For messages that name an
    output of the model."""
    from torch.utils._pytree import keystr, tree_flatten_with_path

    found: list[str] = []
    for path, v in tree_flatten_with_path(value, is_leaf=rebuilt_of_its_class)[0]:
        name = prefix + keystr(path)
        if isinstance(v, torch.Tensor):
            found.append(name)
        elif rebuilt_of_its_class(v):
            attrs, items = dataclass_parts(v)
            for k, sub in attrs.items():
                found += tensor_paths(sub, f"{name}.{k}")
            for k, sub in items.items():
                found += tensor_paths(sub, f"{name}[{k!r}]")
    return found


def map_tensors(fn: Callable, value):
    """``value`` with each tensor ``t`` inside it (as :func:`tensors_in` finds them) replaced by ``fn(t)``; a
    dataclass instance is rebuilt with its attributes and entries mapped (:func:`dataclass_builder`)."""
    from torch.utils._pytree import tree_map

    def leaf(v):
        if isinstance(v, torch.Tensor):
            return fn(v)
        if rebuilt_of_its_class(v):  # (rebuilt as the traced forward builds it: no __post_init__ again)
            attrs, items = map_tensors(fn, dataclass_parts(v))
            return dataclass_builder(type(v))(attrs, items)
        return v

    return tree_map(leaf, value, is_leaf=rebuilt_of_its_class)


def mutable_containers(value):
    """``value`` with fx's immutable containers made plain ``dict`` and ``list`` again, as the forward returned them
    (``out["loss"] = loss`` on a dict output raised fx's "immutable_dict does not support mutation" for a fresh
    user)."""
    from torch.fx.immutable_collections import immutable_dict, immutable_list

    if type(value) in (dict, immutable_dict):
        return {k: mutable_containers(v) for k, v in value.items()}
    if type(value) in (list, immutable_list):
        return [mutable_containers(v) for v in value]
    if type(value) is tuple:
        return tuple(mutable_containers(v) for v in value)
    return value


def dataclass_parts(value) -> tuple[dict[str, Any], dict]:
    """``(attributes, items)`` of a dataclass instance: its fields that are set, then the other attributes in its
    ``__dict__`` (set in ``__post_init__``: ``self.probs = logits.softmax(-1)``), and, for one that is also a dict
    (Hugging Face's ``ModelOutput``), its entries (``o["pooled"] = h`` too); ``{}`` where it is not."""
    fields = dataclasses.fields(value) if dataclasses.is_dataclass(value) else ()
    attrs = {f.name: getattr(value, f.name) for f in fields if hasattr(value, f.name)}
    for name, v in getattr(value, "__dict__", {}).items():
        attrs.setdefault(name, v)
    return attrs, (dict(value.items()) if isinstance(value, dict) else {})


_BUILDERS: dict[type, Callable] = {}


def dataclass_builder(cls: type) -> Callable:
    """A function ``build(attributes, items)`` that makes an instance of the dataclass ``cls`` as the traced forward
    made it (:func:`dataclass_parts`): created with ``cls.__new__``, each attribute set as it is
    (``object.__setattr__``, frozen classes too), fx's immutable lists and dicts made plain again, and, for a
    dataclass that is also a dict, its entries set in order. Neither ``__init__`` nor ``__post_init__`` runs: the
    values are the ones they produced while tracing. One function per class; the traced graph calls it where the
    forward built the dataclass (:class:`memfit.graph.capture._Tracer`)."""
    if cls not in _BUILDERS:
        base = next((b for b in cls.__mro__ if b in (collections.OrderedDict, dict)), None)

        def build(attributes, items):
            obj = cls.__new__(cls)
            if base is not None:
                base.__init__(obj)
            for name, value in attributes.items():
                object.__setattr__(obj, name, mutable_containers(value))
            for key, value in items.items():
                base.__setitem__(obj, key, mutable_containers(value))
            return obj

        build.__name__ = build.__qualname__ = f"make_{cls.__name__}"
        _BUILDERS[cls] = build
    return _BUILDERS[cls]


def check_var_positional(gm: fx.GraphModule, args: tuple, what: str = "example_inputs") -> None:
    """Refuse more positional ``args`` than the traced forward names as positional parameters.

    * Before its ``*args`` (``forward(self, x, *args, mask=None)``): PyTorch puts them in ``*args``, which torch.fx
      traces empty, while fx's generated forward takes ``(x, mask=None, *args)`` and would pass the second one as
      ``mask`` (a fresh user's output 0.61 off).
    * Before its keyword-only parameters (``forward(self, x, *, mask=None)``): PyTorch refuses ``model(x, mask)``
      with a ``TypeError``, while fx's generated forward takes ``(x, mask=None)`` and would accept it.

    The placeholders carry the forward's parameter kinds (``meta["memfit_kind"]``, set by
    :func:`memfit.graph.capture`).

    Raises:
        ValueError: such ``example_inputs``, or (``TypeError``) such a call of the planned module (``what`` other
            than ``"example_inputs"``), as PyTorch raises for the model's own call; the message says how to pass
            the argument.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kinds = [p.meta.get("memfit_kind") for p in placeholders]
    named = [str(p.target) for p, kind in zip(placeholders, kinds, strict=True)
             if kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    if len(args) <= len(named):
        return
    if "VAR_POSITIONAL" in kinds:
        star = next(str(p.target) for p, kind in zip(placeholders, kinds, strict=True) if kind == "VAR_POSITIONAL")
        error = ValueError if what == "example_inputs" else TypeError  # (a call's error is a TypeError, as Python's)
        raise error(f"{what} has {len(args)} positional inputs, but the model's forward names {len(named)} "
                         f"({', '.join(named)}) before {star}: PyTorch passes the others in {star}, which torch.fx "
                         "traces empty, so memfit cannot plan them. Give that input a parameter of its own in forward "
                         "(def forward(self, x, extra, ...)), or wrap the model in a module whose forward names it; "
                         "keyword-only arguments are passed by keyword")
    keyword_only = [str(p.target) for p, kind in zip(placeholders, kinds, strict=True) if kind == "KEYWORD_ONLY"]
    if keyword_only:
        listed = ", ".join(repr(k) for k in keyword_only[:len(args) - len(named)])
        how = (f"in example_inputs, as a dict of the forward's arguments {{..., {keyword_only[0]!r}: ...}}"
               if what == "example_inputs" else f"planned(..., {keyword_only[0]}=...)")
        error = ValueError if what == "example_inputs" else TypeError
        raise error(f"{what} has {len(args)} positional inputs, but the model's forward takes {len(named)} "
                    f"({', '.join(named) or 'none'}) and then {listed} by keyword only, as PyTorch would refuse "
                    f"model(*inputs): pass {'it' if len(keyword_only) == 1 else 'them'} by keyword ({how})")


def positional_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``args`` and ``kwargs`` of a call of the traced forward as one tuple of positional inputs: a keyword
    argument takes its parameter's place, and a parameter left out before it takes its default.

    Raises:
        TypeError: an unknown keyword, one given by position too, or a parameter left out (before one given by
            keyword) that has no default; the message names them.
    """
    check_var_positional(gm, args, "the planned module's call")
    if not kwargs:
        return tuple(args)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = [str(p.target).lstrip("*") for p in placeholders]
    var = [str(p.target) for p in placeholders if str(p.target).startswith("*")]
    named = [str(p.target) for p in placeholders if not str(p.target).startswith("*")]
    unknown = [k for k in kwargs if k not in named]
    if unknown:
        traced = (f"; torch.fx traced {', '.join(var)} empty, so a value passed in {'it' if len(var) == 1 else 'them'} "
                  "cannot be planned: give it a parameter of its own in forward") if var else ""
        raise TypeError(f"the model's forward takes no argument {', '.join(repr(k) for k in unknown)} (it takes "
                        f"{', '.join(named)}{traced})")
    twice = [k for k in kwargs if names.index(k) < len(args)]
    if twice:
        raise TypeError(f"argument {', '.join(repr(k) for k in twice)} given by position and by keyword")
    last = max(names.index(k) for k in kwargs)
    out = list(args)
    for k in range(len(args), last + 1):
        if names[k] in kwargs:
            out.append(kwargs[names[k]])
        elif placeholders[k].args:
            out.append(placeholders[k].args[0])
        elif str(placeholders[k].target).startswith("**"):  # (traced empty)
            out.append({})
        elif str(placeholders[k].target).startswith("*"):
            out.append(())
        else:
            raise TypeError(f"the model's forward needs {names[k]!r} (no default value)")
    return tuple(out)


def input_values(placeholders: list[fx.Node], env: dict[str, Any]) -> dict[str, str]:
    """The forward's arguments (of ``placeholders``) in ``env`` (:func:`bind_inputs`) that are plain Python values
    (numbers, strings, booleans, ``None`` and tuples of them), as ``repr`` text by argument name: fx traces them as
    graph inputs, so a call with another value runs the same graph with, say, another ``scale_factor``, and other
    activation sizes."""
    def plain(v) -> bool:
        return plain_scalar(v) or (isinstance(v, (tuple, list)) and all(plain(x) for x in v))

    return {str(n.target): repr(env[n.name]) for n in placeholders if n.name in env and plain(env[n.name])}


def plain_scalar(value) -> bool:
    """``value`` is one plain Python value: ``None``, a boolean, a number or a string (a flag, a mode, a scale), or a
    setting of :func:`setting_constant`."""
    return value is None or isinstance(value, (bool, int, float, str)) or setting_constant(value)


def setting_constant(value) -> bool:
    """``value`` is a setting a forward tests by identity or passes to operations as it is: ``None``, a flag, a
    string, an ``Enum`` member (an ``IntEnum`` too), a ``torch.dtype``, ``torch.device``, ``torch.layout`` or
    ``torch.memory_format``. torch.fx would trace it as a stand-in on which ``mode is Mode.FROZEN`` is ``False``,
    silently (a fresh user's frozen backbone trained: gradients 1.34 where PyTorch has none)."""
    return value is None or isinstance(value, (bool, str, enum.Enum, torch.dtype, torch.device, torch.layout,
                                               torch.memory_format))


def numpy_scalar_as_python(value):
    """A numpy scalar (``np.float64(0.1)``, ``np.int64(3)``) as the Python number it equals; anything else as it is."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def same_fixed_value(planned, now) -> bool:
    """``now`` is the value ``planned`` that a forward's argument was traced for (:func:`memfit.graph.capture.capture`
    fixes such arguments): the same type and equal (``1`` is not ``True``: ``flag is True`` tells them apart)."""
    now = numpy_scalar_as_python(now)  # (a numpy scalar from a sweep's config: np.int64(3) runs as 3 does)
    return now is planned or (type(now) is type(planned) and now == planned)


def bind_inputs(gm: fx.GraphModule, inputs: tuple, call: bool = False) -> dict[str, Any]:
    """The values of ``gm``'s placeholders (the forward's arguments) for the positional ``inputs``: an argument
    that ``inputs`` leaves out takes its default (``def forward(self, x, mask=None)``; fx keeps it in the
    placeholder's ``args``).

    Raises:
        ValueError: more inputs than the forward takes, or a left-out argument without a default; the message
            names the arguments and, for a keyword-only one, says how to pass it: in ``example_inputs``, or in the
            planned module's call (``call=True``).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = ", ".join(str(p.target) for p in placeholders)
    if len(inputs) > len(placeholders):
        raise ValueError(f"example_inputs has {len(inputs)} inputs, but the model's forward takes "
                         f"{len(placeholders)} ({names}); pass a tuple of the forward's positional inputs, in order")
    env: dict[str, Any] = {}
    for k, ph in enumerate(placeholders):
        if k < len(inputs):
            env[ph.name] = inputs[k]
        elif ph.args:
            env[ph.name] = ph.args[0]
        elif str(ph.target).startswith("**"):  # forward(self, ids, mask=None, **kwargs): traced with none
            env[ph.name] = {}
        elif str(ph.target).startswith("*"):
            env[ph.name] = ()
        else:
            missing = [str(p.target) for p in placeholders[k:] if not p.args and not str(p.target).startswith("*")]
            keyword_only = [str(p.target) for p in placeholders[k:] if str(p.target) in missing
                            and p.meta.get("memfit_kind") == "KEYWORD_ONLY"]
            if keyword_only:
                raise ValueError(f"example_inputs has {len(inputs)} inputs, but the model's forward also needs "
                                 f"{', '.join(repr(m) for m in missing)} (no default value), "
                                 f"{'keyword-only' if keyword_only == missing else 'some of it keyword-only'}: pass "
                                 + (f"it by keyword (planned(..., {keyword_only[0]}=...))" if call else
                                    f"the inputs by name, as a dict of the forward's arguments "
                                    f"{{..., {keyword_only[0]!r}: ...}}"))
            raise ValueError(f"example_inputs has {len(inputs)} inputs, but the model's forward also needs "
                             f"{', '.join(repr(m) for m in missing)} (no default value): pass a tuple of all of "
                             f"the forward's positional inputs, in order ({names})")
    return env
