"""Replay a :class:`Plan` as an ordered list of allocations and frees, and predict its peak and time.

This is the single model of the runtime (DESIGN.md, "One model of the runtime, used three ways"): the
runtime (``memfit.runtime``) does what this replays, the integer program (``memfit.solve.ilp``) is a
conservative linearization of it, and tests compare its prediction with the measured peak.

The replay follows non-reentrant ``torch.utils.checkpoint``:

* forward: node ``i`` allocates its new outputs and internal saved tensors; a storage is freed after its
  last forward use unless something holds it for the backward pass: a kept node that saves it, or a
  checkpoint region that reads it as an input (the region keeps its inputs until its backward ends);
* backward, ``i`` from last to first: when ``i`` is the last node of a region that saves anything, the
  region's forward is rerun up to that node (beside what ``i``'s backward made before it first unpacks a saved
  activation, ``NodeCost.bwd_held_at_unpack``) and every tensor its nodes save is rematerialized (it stops at
  that node's last save: what that node makes after it, ``NodeCost.unmade_at_stop``, is not made: all the
  outputs of a built-in operation, which saves its inputs before computing). A storage an earlier node of the
  rerun makes that is read after that node, through any view (a region output, or a value of a later node of
  the region), is held by the rerun's frame until it stops, as are that node's own unsaved outputs (made before what it saves
  last); one read only by rerun nodes is freed after its last reader. Then the node's backward allocates the
  gradients of its inputs, frees the gradient of its output, and frees every storage whose last holder has
  now finished its backward;
* a region costs ``Accounting.region_seconds`` plus ``Accounting.region_node_seconds`` per node it spans
  beyond the nodes it recomputes (checkpoint frames and saved-tensor hooks, :mod:`memfit.runtime.overhead`);
* a region holds the CPU RNG state (``Costs.region_bytes``) from its forward pass until its last holder's
  backward, and a second copy while it is recomputed (``torch.random.fork_rng``); it holds a snapshot of each
  buffer it can reach whose value the forward pass reads and writes as long, and copies every written buffer it
  can reach while it is recomputed (``Accounting.region_buffer_bytes``, :mod:`memfit.profile.buffers`);
* under ``torch.autocast``, the cast of a parameter (``Accounting.casts``) lives from its first reader to the
  end of the forward pass and the loss's forward (autocast's cache, cleared as the context exits, before
  ``loss.backward()``), and then as long as a kept node saves it; a
  region's recomputation runs under autocast too and makes its own casts, which live until the
  recomputation ends, or until their saver's backward.

Offloaded storages (``memfit.solve.offload``) are copied on a copy stream that runs concurrently with compute:
a copy starts when the stream is free and the storage has been saved, takes the link's measured time, and
the compute waits for it at the storage's wait point (forward) or before its saver's backward (prefetch).
The step time is the critical path of compute and those waits, as in vDNN and POFO.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.graph.ir import Graph
from memfit.profile.costs import Costs
from memfit.solve.accounting import Accounting
from memfit.solve.offload import offloadable, trigger, wait_point
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
        offload_stall_seconds: time the compute waits for copies to or from the host store.
        host_peak_bytes: bytes held in the host store at once (every offloaded storage).
        timeline: ``(event, activation bytes live after it)`` in replay order.
    """

    peak_bytes: int
    fixed_bytes: int
    activation_peak_bytes: int
    step_seconds: float
    recompute_seconds: float
    offload_stall_seconds: float = 0.0
    host_peak_bytes: int = 0
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
    costs = costs.recomputing_from_stats(set(plan.stats_recompute))
    acc = Accounting.build(graph, costs)
    if plan.nodes != [n.name for n in graph.nodes]:
        raise ValueError("the plan was solved for another graph (node names differ); solve again")
    spans = plan.region_spans()
    fixed = costs.fixed_bytes if fixed_bytes is None else fixed_bytes
    # variants the profile measured (a plan may name others; they are then replayed at PyTorch's costs)
    profiled = {c.name: c.variants for c in costs.nodes}
    choice = {k: v for k, v in plan.variants.items() if v != "default" and v in profiled.get(k, {})}
    if choice:
        acc = Accounting.build(graph, costs.with_variants(choice))
    index = {name: i for i, name in enumerate(plan.nodes)}
    return _replay(acc, spans, fixed, [index[name] for name in plan.offloads])


@dataclass
class _Offloaded:
    """One offloaded storage in the replay."""

    kept: list[int]  # savers outside regions, forward order
    wait: int  # node after which the device copy goes (acc.n: end of forward)
    trigger: int | None  # node whose backward start prefetches it


def _offloaded(acc: Accounting, reg: list[int], offloads) -> dict[int, _Offloaded]:
    out = {}
    for j in offloads:
        if reg[j] >= 0:
            continue
        w = wait_point(acc, j)
        for s in offloadable(acc, j):
            kept = sorted(q for q in acc.savers[s] if reg[q] < 0)
            if kept:
                out[s] = _Offloaded(kept=kept, wait=w, trigger=trigger(acc, kept[-1]))
    return out


def _replay(acc: Accounting, spans: list[tuple[int, int]], fixed: int, offloads=()) -> Simulation:
    n = acc.n
    reg = region_of(n, spans)
    off = _offloaded(acc, reg, offloads) if acc.link is not None else {}
    link = acc.link
    # release[s]: node indices whose backward must finish before s can be freed (its holders)
    holders: dict[int, set[int]] = {s: set() for s in acc.activation}
    last_saver = []  # per region: the node whose backward triggers recomputation, and the frame's end
    for lo, hi in spans:
        savers = [i for i in range(lo, hi + 1) if acc.saves[i]]
        last_saver.append((max(savers), min(savers)) if savers else (None, lo))
    for s in acc.activation:
        for i in acc.savers[s]:
            if reg[i] < 0 and s not in off:
                holders[s].add(i)
        for i in acc.consumers[s]:
            r = reg[i]
            # a region that saves nothing is never recomputed: torch.utils.checkpoint then keeps no reference to
            # its inputs (a frozen prefix under checkpoint-all was over-predicted by 2 MB, 25%)
            if r >= 0 and reg[acc.producer[s]] != r and last_saver[r][0] is not None:
                holders[s].add(last_saver[r][1])
    live = 0  # held storages and rematerialized copies
    grad = acc.fwd_offset  # gradients of activations and parameters (the same for every plan: Accounting.grad_before/grad_during)
    peak = 0
    timeline: list[tuple[str, int]] = []
    alive: set[int] = set()

    def alloc(nbytes, label):
        nonlocal live, peak
        live += nbytes
        peak = max(peak, live + grad)
        timeline.append((label, live + grad))

    def transient(nbytes, label):
        # the peak is checked even without a workspace: during a backward step both the gradient of the
        # node's output and the one it makes for its input are alive (``grad`` is then grad_during)
        nonlocal peak
        peak = max(peak, live + grad + nbytes)
        timeline.append((label, live + grad + nbytes))

    def free(nbytes, label):
        nonlocal live
        live -= nbytes
        timeline.append((label, live + grad))

    clock = 0.0  # compute time so far
    stream = 0.0  # when the copy stream is free
    stall = 0.0
    done: dict[int, float] = {}

    def wait_for(t: float) -> None:
        nonlocal clock, stall
        if t > clock:
            stall += t - clock
            clock = t

    starts = {lo: r for r, (lo, _) in enumerate(spans)}
    buffer_copies, snapshots = zip(*(acc.region_buffer_bytes(lo, hi) for lo, hi in spans)) if spans else ((), ())
    held = [acc.region_bytes + b for b in snapshots]  # from a region's forward pass until its backward pass
    # forward
    for i in range(n):
        if i in starts:  # the checkpoint keeps the RNG state (and buffer snapshots) until the region's backward
            alloc(held[starts[i]], f"fwd {i} region {starts[i]} rng state and buffer snapshots")
        for s in acc.creates[i]:
            alive.add(s)
            alloc(acc.nbytes[s], f"fwd {i} alloc {s}")
        transient(acc.fwd_ws[i], f"fwd {i} workspace")
        if reg[i] >= 0:  # bn-saved-stats: the statistics are kept for the recomputation
            alloc(acc.stats_bytes[i], f"fwd {i} statistics")
        clock += acc.fwd_seconds[i]
        for s, o in off.items():
            if o.kept[0] == i:  # saved for the first time: the copy to the host starts
                stream = max(stream, clock) + link.d2h_seconds(acc.nbytes[s])
                done[s] = stream
        for s, o in off.items():
            if o.wait == i:
                wait_for(done[s])
        for s in list(alive):
            ended = acc.fwd_last[s] <= i if s not in off else off[s].wait <= i
            if s in acc.internal[i] and reg[i] >= 0 and s not in acc.casts:
                ended = True
            if ended and not holders.get(s):
                alive.discard(s)
                free(acc.nbytes[s], f"fwd {i} free {s}")
        if reg[i] >= 0 and spans[reg[i]][1] == i and last_saver[reg[i]][0] is None:
            free(held[reg[i]], f"fwd {i} region {reg[i]} rng state")  # nothing saved: nothing holds it
    for s, o in off.items():
        if o.wait >= n:
            wait_for(done[s])
    for s in list(alive):  # the end of the forward pass is the wait point of a node that made a model output it
        # saves (a per-head attention map the loss reads): its other offloaded storages leave the device there
        if s in off and off[s].wait >= n and acc.fwd_last[s] < n and not holders.get(s):
            alive.discard(s)
            free(acc.nbytes[s], f"end of forward free offloaded {s}")
    # the loss reads the outputs (alive while it runs its forward: they are its arguments); backward starts with
    # their gradients
    transient(acc.loss_forward_bytes, "loss forward")
    for s in list(alive):
        if s in acc.output_storages and not holders.get(s) and s not in acc.loss_keeps:
            alive.discard(s)
            free(acc.nbytes[s], f"loss free {s}")
    # autocast's cache is cleared when its context exits, after the loss's forward: `loss.backward()` runs outside
    # it (as PyTorch recommends; the planned module warns where it does not)
    for s in list(alive):
        if s in acc.casts and not holders.get(s):
            alive.discard(s)
            free(acc.nbytes[s], f"loss free cast {s}")
    grad = acc.grad_before[n - 1] if n else 0
    # the loss: measured when profiled with one; else a log-softmax style loss, which keeps one
    # output-sized tensor and makes another in its backward
    loss = acc.loss_bytes if acc.loss_bytes is not None else 2 * sum(acc.nbytes[s] for s in acc.output_storages)
    if acc.loss_bytes_freed is not None and not any(holders.get(s) for s in acc.loss_keeps):
        loss = acc.loss_bytes_freed  # (what the loss saved is freed as its backward goes: nothing else holds it)
    transient(loss, "loss backward")
    for s in list(alive):  # outputs the loss saved: released by its backward
        if s in acc.loss_keeps and not holders.get(s):
            alive.discard(s)
            free(acc.nbytes[s], f"loss backward free {s}")
    alloc(acc.loss_held_bytes, "loss value")  # held by the training loop until the step ends
    recomputed: dict[int, set[int]] = {}  # region -> copies alive
    copy_holders: dict[tuple[int, int], set[int]] = {}
    recompute_seconds = 0.0
    ready: dict[int, float] = {}
    fetched: dict[int, set[int]] = {}  # offloaded storage -> savers still to run their backward
    for i in range(n - 1, -1, -1):
        grad = acc.grad_before[i]
        r = reg[i]
        for s, o in off.items():
            if o.trigger == i:  # the backward pre-hook one node ahead starts the prefetch
                alloc(acc.nbytes[s], f"prefetch {i} {s}")
                stream = max(stream, clock) + link.h2d_seconds(acc.nbytes[s])
                ready[s] = stream
                fetched[s] = set(o.kept)
        if r >= 0 and last_saver[r][0] == i:
            lo, _ = spans[r]
            copies = set()
            read_until: dict[int, list[int]] = {}  # recomputed node -> unsaved storages its run is the last to read
            to_end = 0  # unsaved storages the recomputation holds until it stops (read after node i)
            # fork_rng's copy of the current state, and the copies of the written buffers the region reaches
            alloc(acc.region_bytes + buffer_copies[r], f"recompute {i} rng state and buffer copies")
            # the node's backward ran up to its first unpack before the recomputation started: what it made is alive
            held_grads = acc.held_at_unpack[i] if acc.held_at_unpack else 0
            alloc(held_grads, f"recompute {i} what its backward made before its first unpack")
            cast: set[int] = set()  # casts of this recomputation (autocast's cache, cleared when it ends)
            unsaved_casts = 0
            spent = sum(acc.recompute_seconds[lo:i]) + acc.stop_seconds[i]  # (the early stop: node i's saves)
            recompute_seconds += spent
            for j in range(lo, i + 1):
                free(acc.stats_bytes[j], f"recompute {j} statistics")  # now its saved statistics again
                for s in acc.cast_uses[j]:
                    if s in cast:
                        continue
                    cast.add(s)
                    saved_in = {k for k in acc.savers[s] if reg[k] == r}
                    alloc(acc.nbytes[s], f"recompute {j} cast {s}")
                    if saved_in:
                        copies.add(s)
                        copy_holders[(r, s)] = saved_in
                    else:
                        unsaved_casts += acc.nbytes[s]
                # the recomputation stops once the last tensor is saved (early stop): what the last saver makes
                # after its last save never exists here (a convolution's output; the math attention's output,
                # made by a matrix product that saves its operands first). Its workspace, from operations before
                # the last save, is still counted, and the forward's peak up to that save (NodeCost.stop_workspace)
                unmade = acc.unmade_at_stop[i] if j == i else ()
                for s in acc.creates[j]:
                    if s in acc.casts or s in unmade:
                        continue
                    saved_in = {k for k in acc.savers[s] if reg[k] == r}
                    last_read = max((k for k in acc.consumers[s] if j < k <= i), default=j)
                    if saved_in:
                        copies.add(s)
                        copy_holders[(r, s)] = saved_in
                        alloc(acc.nbytes[s], f"recompute {j} {s}")
                    elif j == i or s in acc.output_storages or any(k > i for k in acc.consumers[s]):
                        # read after the last saver (a region output, or a value of a later node of the
                        # region), through any view: the recomputation's frame holds it until it stops; so are
                        # the last saver's own outputs, made before what it saves last (BatchNorm's output,
                        # then its statistics, measured alive through its workspace)
                        to_end += acc.nbytes[s]
                        alloc(acc.nbytes[s], f"recompute {j} {s} (held to the stop)")
                    elif last_read > j:  # not saved, but read by a later recomputed node: alive until then
                        alloc(acc.nbytes[s], f"recompute {j} {s} (read by {last_read})")
                        read_until.setdefault(last_read, []).append(s)
                    else:
                        transient(acc.nbytes[s], f"recompute {j} transient {s}")
                transient(acc.stop_ws[j] if j == i else acc.fwd_ws[j], f"recompute {j} workspace")
                for s in read_until.pop(j, []):
                    free(acc.nbytes[s], f"recompute {j} free {s}")
            free(unsaved_casts + to_end + acc.region_bytes + buffer_copies[r] + held_grads, f"recompute {i} end")
            recomputed[r] = copies
            clock += spent
        if r >= 0 and i == spans[r][0]:  # the region's own cost (checkpoint frames, hooks), paid once per step
            extra = acc.region_seconds + acc.region_node_seconds * (spans[r][1] - spans[r][0] + 1)
            clock += extra
            recompute_seconds += extra
        for s, o in off.items():
            if i in o.kept:
                if s in fetched:
                    wait_for(ready[s])
                else:  # no prefetch: loaded when unpacked, and freed with this saver's backward
                    alloc(acc.nbytes[s], f"load {i} {s}")
                    stream = max(stream, clock) + link.h2d_seconds(acc.nbytes[s])
                    wait_for(stream)
                    fetched[s] = {i}
        grad = acc.grad_during[i]
        # where this node is the last holder of every storage it saves (those another node made, and its outputs), those
        # are freed inside its backward, as the functions that saved them run (Accounting.bwd_ws_released); where it
        # is the last holder of its own only, those (bwd_ws_released_out)
        def last(saved: list[int], i: int = i, r: int = r) -> bool:
            return all(copy_holders[(r, s)] == {i} if r >= 0 and s in recomputed.get(r, ()) else
                       fetched[s] == {i} if s in fetched else s in alive and holders.get(s) == {i} for s in saved)
        inputs = [s for s in acc.saves[i] if acc.producer.get(s, -1) not in (-1, i) and s not in acc.casts]
        own = [s for s in acc.saves[i] if acc.producer.get(s, -1) == i and s not in acc.casts]
        ws = acc.bwd_ws[i]
        if acc.bwd_ws_released and (inputs or own) and last(inputs) and last(own):
            ws = acc.bwd_ws_released[i]
        elif acc.bwd_ws_released_out and own and last(own):
            ws = acc.bwd_ws_released_out[i]
        transient(ws, f"bwd {i} workspace")
        clock += acc.bwd_seconds[i]
        grad = acc.grad_before[i - 1] if i > 0 else 0
        for s in list(alive):
            h = holders.get(s)
            if h and i in h:
                h.discard(i)
                if not h:
                    alive.discard(s)
                    free(acc.nbytes[s], f"bwd {i} free {s}")
        if r >= 0 and last_saver[r][0] is not None and last_saver[r][1] == i:
            free(held[r], f"bwd {i} region {r} rng state")
        if r >= 0 and r in recomputed:
            for s in list(recomputed[r]):
                h = copy_holders[(r, s)]
                h.discard(i)
                if not h:
                    recomputed[r].discard(s)
                    free(acc.nbytes[s], f"bwd {i} free copy {s}")
        for s in list(fetched):
            fetched[s].discard(i)
            if not fetched[s]:
                del fetched[s]
                free(acc.nbytes[s], f"bwd {i} free prefetched {s}")
        if acc.grad_sum and acc.grad_sum[i] is not None:  # a contribution summed out of place, after the node
            grad = acc.grad_sum[i]
            transient(0, f"bwd {i} gradient sum")
            grad = acc.grad_before[i - 1] if i > 0 else 0
    # the optimizer step: every gradient exists (in the fixed bytes), the activations are gone
    transient(acc.step_bytes, "optimizer step")
    return Simulation(peak_bytes=fixed + peak, fixed_bytes=fixed, activation_peak_bytes=peak,
                      step_seconds=clock, recompute_seconds=recompute_seconds, offload_stall_seconds=stall,
                      host_peak_bytes=sum(acc.nbytes[s] for s in off), timeline=timeline)
