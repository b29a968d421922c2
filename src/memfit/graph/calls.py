"""Run single fx nodes: the one place that turns a traced node into a call (used by profile and runtime)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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

    def load(env):
        return fx.node.map_arg(args, lambda a: env[a.name]), fx.node.map_arg(kwargs, lambda a: env[a.name])
    return load


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The fx nodes that compute (not placeholders or the output), in forward order."""
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def tensors_in(value) -> list:
    """All tensors inside a (possibly nested) value: tuples, lists, dicts and namedtuples are searched."""
    import torch
    from torch.utils._pytree import tree_leaves

    return [v for v in tree_leaves(value) if isinstance(v, torch.Tensor)]
