"""What offloading a node means in the accounting, shared by the simulator, the integer program and the
baseline strategies (vDNN, Rhu et al., MICRO 2016, section 4: offload in the forward pass, prefetch one
layer ahead in the backward pass).

A node ``j`` the plan offloads has every storage it creates that is large enough (``MIN_OFFLOAD_BYTES``) and
saved for backward by some node outside a checkpoint region copied to the host store when it is first saved.
Its device copy is released after the node's wait point ``W_j`` (the last forward use of those storages).
In the backward pass the storage is prefetched when the backward of the *trigger* node starts: the next node
after its last saver (in forward order) that has a backward, i.e. the node whose backward runs just before
the saver's. The prefetched copy is freed when the first saver's backward is done.
"""

from __future__ import annotations

from memfit.graph.ir import Graph
from memfit.solve.accounting import Accounting
from memfit.solve.plan import MIN_OFFLOAD_BYTES

END = "<end>"  # wait point of storages that the loss reads: the end of the forward pass


def offloadable(acc: Accounting, j: int) -> list[int]:
    """Storages created by node ``j`` that offloading ``j`` would move (before regions are known). Autocast's
    casts of parameters are left out: its cache holds them on the device until the forward pass ends anyway
    (the runtime may still copy one out; the replay then counts it on the device, which is no less)."""
    return [s for s in acc.creates[j]
            if acc.nbytes[s] >= MIN_OFFLOAD_BYTES and acc.savers.get(s) and acc.producer.get(s) == j
            and s not in acc.casts]


def candidates(acc: Accounting) -> list[int]:
    """Nodes worth offloading: those that create at least one offloadable storage."""
    return [j for j in range(acc.n) if offloadable(acc, j)]


def wait_point(acc: Accounting, j: int) -> int:
    """Index of the node after which node ``j``'s offloaded storages leave the device (``acc.n``: the end of
    the forward pass)."""
    return max([acc.fwd_last[s] for s in offloadable(acc, j)] + [j])


def trigger(acc: Accounting, last_saver: int) -> int | None:
    """The node whose backward start prefetches what ``last_saver`` saved: the next node with a backward
    after it, else the saver itself; ``None`` when the saver has no backward (loaded at unpack)."""
    needs = acc.needs_grad or [True] * acc.n
    for k in range(last_saver + 1, acc.n):
        if needs[k]:
            return k
    return last_saver if needs[last_saver] else None


def offload_waits(acc: Accounting, names: list[str], offloads: list[int]) -> dict[str, str]:
    """The plan's ``offload_waits``: offloaded node name -> name of its wait-point node (or ``END``)."""
    out = {}
    for j in offloads:
        w = wait_point(acc, j)
        out[names[j]] = names[w] if w < acc.n else END
    return out


def conv_input_producers(graph: Graph, acc: Accounting) -> list[int]:
    """``vdnn-conv``: the nodes that produce what convolutions save (their inputs), as vDNN's ``conv``
    policy offloads only the inputs of convolution layers (Rhu et al., section 4.2)."""
    out = set()
    for q, node in enumerate(graph.nodes):
        if node.module_type and node.module_type.startswith("Conv"):
            for s in acc.saves[q]:
                p = acc.producer.get(s, -1)
                if p >= 0 and s in offloadable(acc, p):
                    out.add(p)
    return sorted(out)
