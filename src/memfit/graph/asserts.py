"""Messages of ``torch._assert`` calls that name traced values, as PyTorch would write them.

``torch.fx`` records ``torch._assert(cond, msg)`` as a graph node, but the message is written by the forward's Python
code while tracing, so an f-string names fx's stand-in where eager PyTorch names the value: torchvision's
VisionTransformer called with another image size raised ``Wrong image height! Expected 64 but got
Proxy(getitem_2)!`` where plain PyTorch says ``... but got 56!``. :func:`with_assert_values` makes such a node call
:func:`assert_traced`, which writes each stand-in's value at that call into the message before it raises.
"""

from __future__ import annotations

import re

import torch
from torch import fx

_STAND_IN = re.compile(r"Proxy\((\w+)\)")


def assert_traced(condition, message: str, values: dict):
    """``torch._assert(condition, message)``, where ``message`` says ``Proxy(name)`` for each value in ``values``
    (node name -> its value at this call), replaced by that value as ``str`` writes it (as an f-string does).

    Raises:
        AssertionError: ``condition`` is false, with the message written so.
    """
    if not condition:
        for name, value in values.items():
            message = message.replace(f"Proxy({name})", str(value))
    return torch._assert(condition, message)


def with_assert_values(gm: fx.GraphModule) -> None:
    """Make each ``torch._assert`` node of ``gm`` whose message names a node of the graph (``Proxy(name)``) call
    :func:`assert_traced` with those nodes' values; recompiles ``gm`` where one changed."""
    nodes = {node.name: node for node in gm.graph.nodes}
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch._assert or len(node.args) < 2:
            continue
        message = node.args[1]
        named = {name: nodes.get(name) for name in _STAND_IN.findall(message)} if isinstance(message, str) else {}
        named = {name: n for name, n in named.items() if n is not None and n is not node}
        if named:
            node.target, node.args = assert_traced, (node.args[0], message, named)
            changed = True
    if changed:
        gm.recompile()
