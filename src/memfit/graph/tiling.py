"""Chains of spatially local layers in a traced graph, and the graph with some of them run in row stripes.

A *block* is a run of nodes, each reading only the one before it, whose layers (:func:`layer_of`: modules,
or functional forms such as ``F.relu(x)`` made into modules) pass
:func:`memfit.variants.tiled.chain_layer_ok` (convolutions, max-pooling, pointwise activations), and whose
values other than the last are read by no other node: VGG's ``conv -> relu -> conv -> relu -> pool``.
Blocks end after each max-pooling, so one stripe's halo stays small. :func:`apply_tiling` replaces each
chosen block by one node running :class:`~memfit.variants.tiled.TiledChain` over its modules; that node
keeps the name of the block's last node, so the rest of the graph, and a plan's node names, are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from memfit.graph.capture import Captured, graph_of
from memfit.variants.replaceable import replaceable
from memfit.variants.tiled import TiledChain, chain_layer_ok

__all__ = ["TiledBlock", "apply_tiling", "chain_blocks", "is_tiled", "layer_of"]

#: attribute of the rewritten GraphModule holding the tiled chains
TILED_ATTR = "memfit_tiled"


@dataclass(frozen=True)
class TiledBlock:
    """A block run in row stripes: ``nodes`` (names, forward order) and the number of ``stripes``."""

    nodes: tuple[str, ...]
    stripes: int

    def to_dict(self) -> dict:
        return {"nodes": list(self.nodes), "stripes": self.stripes}

    @classmethod
    def from_dict(cls, d: dict) -> TiledBlock:
        """Raises ``ValueError`` unless ``d`` is ``{"nodes": [names], "stripes": int >= 1}``."""
        if (not isinstance(d, dict) or set(d) != {"nodes", "stripes"} or not isinstance(d["nodes"], list)
                or not d["nodes"] or not all(isinstance(n, str) for n in d["nodes"])
                or not isinstance(d["stripes"], int) or d["stripes"] < 1):
            raise ValueError(f'plan tiled entries must be {{"nodes": [node names], "stripes": int >= 1}}, not {d!r}')
        return cls(tuple(d["nodes"]), d["stripes"])


# functional forms of the chain's layers: (function or method name) -> module class, with the call's other
# arguments passed to the class (keyword names as the function's, normalized by fx)
_FUNCTIONS: dict[object, type[nn.Module]] = {
    F.relu: nn.ReLU, torch.relu: nn.ReLU, F.relu6: nn.ReLU6, F.leaky_relu: nn.LeakyReLU, F.hardtanh: nn.Hardtanh,
    F.silu: nn.SiLU, F.gelu: nn.GELU, torch.sigmoid: nn.Sigmoid, torch.tanh: nn.Tanh, F.max_pool2d: nn.MaxPool2d,
}
_METHODS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}
_DROP = {"inplace", "input", "self"}  # (the chain decides where it writes in place)


def layer_of(gm: fx.GraphModule, n: fx.Node) -> nn.Module | None:
    """The module node ``n`` runs, if it can be part of a chain: its own submodule for ``call_module``; for
    a functional form (``F.relu(x)``, ``x.relu()``, ``F.max_pool2d(x, 2)``, ...) a new module of the matching
    class, made from the call's constant arguments. ``None`` otherwise (a value other than the first argument
    comes from the graph, the module fails :func:`memfit.variants.tiled.chain_layer_ok`, has hooks, ...)."""
    if not n.args or not isinstance(n.args[0], fx.Node):
        return None
    if any(isinstance(a, fx.Node) for a in [*n.args[1:], *n.kwargs.values()]):
        return None
    if n.op == "call_module":
        m = gm.get_submodule(n.target)
        return m if len(n.args) == 1 and not n.kwargs and chain_layer_ok(m) and replaceable(m) else None
    if n.op == "call_method" and n.target in _METHODS and len(n.args) == 1 and not n.kwargs:
        return _METHODS[n.target]()
    cls = _FUNCTIONS.get(n.target) if n.op == "call_function" else None
    if cls is None:
        return None
    if len(n.args) == 1 and not n.kwargs:
        return cls()
    try:  # (fx cannot always tell an overload: torch.tanh's number schemas made it raise)
        normalized = n.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
    except Exception:  # noqa: BLE001 -- any failure means: not a layer we can rebuild
        return None
    if normalized is None:
        return None
    kwargs = {k: v for k, v in normalized.kwargs.items() if k not in _DROP}
    try:
        m = cls(**kwargs)
    except TypeError:  # an argument the module does not take
        return None
    return m if chain_layer_ok(m) else None


def _chain_node(gm: fx.GraphModule, n: fx.Node) -> bool:
    return n.op in ("call_module", "call_function", "call_method") and layer_of(gm, n) is not None


def chain_blocks(gm: fx.GraphModule) -> list[list[str]]:
    """The blocks of ``gm`` (see the module docstring) with a convolution and another convolution or a
    pooling, in forward order: lists of node names. (A lone convolution run in stripes still holds its input
    and both gradients at full size: on UNet, whose BatchNorms leave only such blocks, striping them lowered
    no floor.)"""
    blocks: list[list[str]] = []
    run: list[fx.Node] = []

    def close() -> None:  # a block worth striping drops a full-size value: two windowed layers, one a convolution
        mods = [layer_of(gm, n) for n in run]
        windowed = [m for m in mods if isinstance(m, nn.Conv2d | nn.MaxPool2d)]
        if len(windowed) >= 2 and any(isinstance(m, nn.Conv2d) for m in windowed):
            blocks.append([n.name for n in run])
        run.clear()

    outputs = {a for n in gm.graph.nodes if n.op == "output" for a in n.all_input_nodes}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        follows = bool(run) and n.args and n.args[0] is run[-1] and len(run[-1].users) == 1 \
            and run[-1] not in outputs
        if not (_chain_node(gm, n) and (follows or not run)):
            close()
            if not _chain_node(gm, n):
                continue
        run.append(n)
        if isinstance(layer_of(gm, n), nn.MaxPool2d):
            close()
    close()
    return blocks


def is_tiled(captured: Captured) -> bool:
    """``captured`` is the output of :func:`apply_tiling` (with at least one tiled block)."""
    return hasattr(captured.gm, TILED_ATTR)


def apply_tiling(captured: Captured, tiled: list[TiledBlock]) -> Captured:
    """A copy of ``captured`` whose graph runs each block of ``tiled`` as one node (named as the block's last
    node) calling a :class:`~memfit.variants.tiled.TiledChain` over the block's modules. The original
    ``captured`` is not changed; the copy shares the model's modules, parameters and buffers.

    Raises:
        ValueError: an entry of ``tiled`` is not a block of this graph (see :func:`chain_blocks`).
    """
    if not tiled:
        return captured
    gm = captured.gm
    known = {tuple(b) for b in chain_blocks(gm)}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    new = fx.GraphModule(gm, graph, type(gm).__name__)
    by_name = {n.name: n for n in graph.nodes}
    holder = nn.Module()
    seen: set[str] = set()
    for block in tiled:
        if seen & set(block.nodes):
            raise ValueError(f"plan tiles {list(block.nodes)} twice, or overlapping another entry: list each block "
                             "once")
        seen |= set(block.nodes)
        if tuple(block.nodes) not in known:
            raise ValueError(f"plan tiles {list(block.nodes)}, which is not a chain of convolutions, pooling and "
                             "activations in this graph (memfit.graph.tiling.chain_blocks lists those)")
        first, last = by_name[block.nodes[0]], by_name[block.nodes[-1]]
        name = f"b{len(holder._modules)}"
        holder.add_module(name, TiledChain([layer_of(gm, by_name[n]) for n in block.nodes],
                                           block.stripes))
        last.op, last.target = "call_module", f"{TILED_ATTR}.{name}"
        last.args, last.kwargs = (first.args[0],), {}
        for n in reversed(block.nodes[:-1]):
            graph.erase_node(by_name[n])
    new.add_module(TILED_ATTR, holder)
    new.recompile()
    return Captured(gm=new, graph=graph_of(new), model=captured.model, attributes=captured.attributes,
                    called=captured.called, fixed_args=captured.fixed_args, unread_args=captured.unread_args,
                    autocast_tests=captured.autocast_tests)
