"""Replay a :class:`Plan` as an ordered list of allocations and frees, and predict its peak and time.

This is the single model of the runtime (DESIGN.md, "One model of the runtime, used three ways"): the
runtime (``memfit.runtime``) does what this replays, the integer program (``memfit.solve.ilp``) is a
conservative linearization of it, and tests compare its prediction with the measured peak.

The replay follows non-reentrant ``torch.utils.checkpoint``:

* forward: node ``i`` allocates its new outputs and internal saved tensors; a storage is freed after its
  last forward use unless something holds it for the backward pass: a kept node that saves it, or a
  checkpoint region that reads it as an input (the region keeps its inputs until its backward ends);
* backward, ``i`` from last to first: when ``i`` is the last node of a region that saves anything, the
  region's forward is rerun up to that node and every tensor its nodes save is rematerialized; then the
  node's backward allocates the gradients of its inputs, frees the gradient of its output, and frees every
  storage whose last holder has now finished its backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.graph.ir import Graph
from memfit.profile.costs import Costs
from memfit.solve.accounting import Accounting
from memfit.solve.plan import Plan


@dataclass
class Simulation:
    """Result of :func:`simulate`.

    Attributes:
        peak_bytes: predicted total peak (fixed + activation), bytes.
        fixed_bytes: fixed bytes the prediction assumed.
        activation_peak_bytes: predicted peak above the fixed bytes.
        step_seconds: predicted step time (plain forward + backward + recomputation), seconds.
        recompute_seconds: the recomputation part of ``step_seconds``.
        timeline: ``(event, activation bytes live after it)`` in replay order.
    """

    peak_bytes: int
    fixed_bytes: int
    activation_peak_bytes: int
    step_seconds: float
    recompute_seconds: float
    timeline: list[tuple[str, int]] = field(default_factory=list)


def region_of(n: int, spans: list[tuple[int, int]]) -> list[int]:
    """For every node index, the index of its region in ``spans``, or -1."""
    out = [-1] * n
    for r, (lo, hi) in enumerate(spans):
        for i in range(lo, hi + 1):
            out[i] = r
    return out


def simulate(graph: Graph, costs: Costs, plan: Plan, fixed_bytes: int | None = None) -> Simulation:
    """Predict the peak memory and step time of running ``plan``.

    Args:
        graph: the captured graph.
        costs: its profile.
        plan: the plan to replay (its ``nodes`` must be the graph's nodes).
        fixed_bytes: fixed bytes to add (defaults to ``costs.fixed_bytes``); pass the optimizer state too.

    Returns:
        :class:`Simulation`.

    Raises:
        ValueError: the plan or profile does not belong to the graph.
    """
    acc = Accounting.build(graph, costs)
    if plan.nodes != [n.name for n in graph.nodes]:
        raise ValueError("the plan was solved for another graph (node names differ); solve again")
    spans = plan.region_spans()
    fixed = costs.fixed_bytes if fixed_bytes is None else fixed_bytes
    return _replay(acc, spans, fixed)


def _replay(acc: Accounting, spans: list[tuple[int, int]], fixed: int) -> Simulation:
    n = acc.n
    reg = region_of(n, spans)
    # release[s]: node indices whose backward must finish before s can be freed (its holders)
    holders: dict[int, set[int]] = {s: set() for s in acc.activation}
    last_saver = []  # per region: the node whose backward triggers recomputation, and the frame's end
    for lo, hi in spans:
        savers = [i for i in range(lo, hi + 1) if acc.saves[i]]
        last_saver.append((max(savers), min(savers)) if savers else (None, lo))
    for s in acc.activation:
        for i in acc.savers[s]:
            if reg[i] < 0:
                holders[s].add(i)
        for i in acc.consumers[s]:
            r = reg[i]
            if r >= 0 and reg[acc.producer[s]] != r:
                holders[s].add(last_saver[r][1])
    live = 0  # held storages and rematerialized copies
    grad = 0  # gradients of activations (the same for every plan: Accounting.grad_before/grad_during)
    peak = 0
    timeline: list[tuple[str, int]] = []
    alive: set[int] = set()

    def alloc(nbytes, label):
        nonlocal live, peak
        live += nbytes
        peak = max(peak, live + grad)
        timeline.append((label, live + grad))

    def transient(nbytes, label):
        nonlocal peak
        if nbytes:
            peak = max(peak, live + grad + nbytes)
            timeline.append((label, live + grad + nbytes))

    def free(nbytes, label):
        nonlocal live
        live -= nbytes
        timeline.append((label, live + grad))

    # forward
    for i in range(n):
        for s in acc.creates[i]:
            alive.add(s)
            alloc(acc.nbytes[s], f"fwd {i} alloc {s}")
        transient(acc.fwd_ws[i], f"fwd {i} workspace")
        for s in list(alive):
            ended = acc.fwd_last[s] <= i
            if s in acc.internal[i] and reg[i] >= 0:
                ended = True
            if ended and not holders.get(s):
                alive.discard(s)
                free(acc.nbytes[s], f"fwd {i} free {s}")
    # the loss reads the outputs; backward starts with their gradients
    for s in list(alive):
        if s in acc.output_storages and not holders.get(s):
            alive.discard(s)
            free(acc.nbytes[s], f"loss free {s}")
    grad = acc.grad_before[n - 1] if n else 0
    # the loss: measured when profiled with one; else a log-softmax style loss, which keeps one
    # output-sized tensor and makes another in its backward
    loss = acc.loss_bytes if acc.loss_bytes is not None else 2 * sum(acc.nbytes[s] for s in acc.output_storages)
    transient(loss, "loss backward")
    recomputed: dict[int, set[int]] = {}  # region -> copies alive
    copy_holders: dict[tuple[int, int], set[int]] = {}
    recompute_seconds = 0.0
    for i in range(n - 1, -1, -1):
        grad = acc.grad_before[i]
        r = reg[i]
        if r >= 0 and last_saver[r][0] == i:
            lo, _ = spans[r]
            copies = set()
            for j in range(lo, i + 1):
                recompute_seconds += acc.fwd_seconds[j]
                for s in acc.creates[j]:
                    saved_in = {k for k in acc.savers[s] if reg[k] == r}
                    if saved_in:
                        copies.add(s)
                        copy_holders[(r, s)] = saved_in
                        alloc(acc.nbytes[s], f"recompute {j} {s}")
                    else:
                        transient(acc.nbytes[s], f"recompute {j} transient {s}")
                transient(acc.fwd_ws[j], f"recompute {j} workspace")
            recomputed[r] = copies
        grad = acc.grad_during[i]
        transient(acc.bwd_ws[i], f"bwd {i} workspace")
        grad = acc.grad_before[i - 1] if i > 0 else 0
        for s in list(alive):
            h = holders.get(s)
            if h and i in h:
                h.discard(i)
                if not h:
                    alive.discard(s)
                    free(acc.nbytes[s], f"bwd {i} free {s}")
        if r >= 0 and r in recomputed:
            for s in list(recomputed[r]):
                h = copy_holders[(r, s)]
                h.discard(i)
                if not h:
                    recomputed[r].discard(s)
                    free(acc.nbytes[s], f"bwd {i} free copy {s}")
    step = sum(acc.fwd_seconds) + sum(acc.bwd_seconds) + recompute_seconds
    return Simulation(peak_bytes=fixed + peak, fixed_bytes=fixed, activation_peak_bytes=peak,
                      step_seconds=step, recompute_seconds=recompute_seconds, timeline=timeline)
