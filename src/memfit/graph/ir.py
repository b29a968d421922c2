"""The graph IR: plain data, no torch objects, serializable to JSON.

A :class:`Graph` lists the compute nodes of one forward pass in the order ``torch.fx`` traced them
(a topological order of the data-flow DAG). Placeholders (model inputs) are named in ``Graph.inputs``;
the node names are the fx node names, which are stable across traces of the same model and are the
keys that profiles and plans use.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Node:
    """One compute node of the forward pass.

    Attributes:
        name: fx node name, the stable key used by ``Costs`` and ``Plan``.
        op: fx opcode: ``call_module``, ``call_function``, ``call_method`` or ``get_attr``.
        target: qualified module path for ``call_module``, else the function or method name.
        inputs: names of the nodes (or placeholders) whose values this node reads, in argument order.
        block: the enclosing top-level block (e.g. ``layer1.0`` in a ResNet), used by block-wise
            baselines such as ``checkpoint-all``.
        module_type: class name of the called module, or ``None``.
    """

    name: str
    op: str
    target: str
    inputs: list[str] = field(default_factory=list)
    block: str = ""
    module_type: str | None = None


@dataclass
class Graph:
    """A traced forward pass: ``nodes`` in forward (topological) order.

    Attributes:
        nodes: compute nodes in forward order.
        inputs: placeholder names, in the order of the model's positional arguments.
        outputs: names of the nodes whose values form the model output.
    """

    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]

    def index(self) -> dict[str, int]:
        """Map node name to its position in ``nodes``."""
        return {n.name: i for i, n in enumerate(self.nodes)}

    def consumers(self) -> dict[str, list[str]]:
        """Map each node or placeholder name to the names of the nodes that read it, in forward order."""
        out: dict[str, list[str]] = {name: [] for name in self.inputs}
        for n in self.nodes:
            out.setdefault(n.name, [])
            for src in n.inputs:
                if n.name not in out.setdefault(src, []):
                    out[src].append(n.name)
        return out

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Graph:
        return cls(nodes=[Node(**n) for n in d["nodes"]], inputs=list(d["inputs"]), outputs=list(d["outputs"]))
