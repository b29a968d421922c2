"""The integer program behind the ``memfit`` strategy, solved with HiGHS (``highspy``).

It chooses, per node, whether it runs inside a checkpoint region (its saved tensors are recomputed) and
where regions are cut, to minimize recomputation time under a peak-memory budget. It is a conservative
linearization of the simulator's accounting (``memfit.solve.simulator``): every storage a plan might keep
is counted from the first backward step that could still need it. Compared with the formulations of
Checkmate (Jain et al., MLSys 2020) and MONeT (Shah et al., ICLR 2021, section 3), which use O(n^2) binaries
(one per node and stage), it uses the forward order itself as the stage order: O(n) binaries (region
membership and region cuts) plus continuous variables for held storages and recomputed bytes, so
ResNet-50 solves in seconds.

Variables (``i`` node index in forward order, ``s`` storage):
  r_i in {0,1}   node i is inside a checkpoint region (recomputed);
  c_i in {0,1}   a region boundary lies just before node i (adjacent regions);
  h_s in [0,1]   storage s is held from the forward to the backward pass;
  z_pn in [0,1]  nodes p < n are in the same region (= AND of r_k, k in [p, n], and no cut in (p, n]);
  a_i >= 0       bytes rematerialized by i's region that are still alive at i's backward (with, under
                 autocast, the casts of parameters i saves: the recomputation makes its own).
  o_j in {0,1}   node j's saved tensors are offloaded to the host store (vDNN), only where r_j = 0;
  S_i, B_i >= 0  cumulative time the compute waits for offload copies up to forward node i / for prefetches
                 down to backward node i (the copy stream is serial).
  v_i^k in {0,1} node i uses operator variant k (at most one per node; none is PyTorch's own).
Constraints: h_s >= 1 - r_n - o_p for every node n that saves s (made by p); h_s >= r_n - z_pn for every
consumer n of s made by p (a region keeps its inputs); forward peak after each node and backward peak at
each node <= budget - fixed bytes, where an offloaded storage counts until its wait point in the forward pass
and from its prefetch to its first saver in the backward pass; an autocast cast of a parameter counts from its
first reader to the end of the forward pass, whatever the plan. Left to the replay, which checks every plan
(``memfit.solve.strategies``): transients of a recomputation (values read by a later recomputed node or
held until it stops, casts nothing saves), the loss, and the bytes each region keeps
(``Accounting.region_bytes``, the CPU RNG state: counted in the rows, they made the program infeasible at floors the replay reaches). An in-place form k of
node i, overwriting storage S made by p, removes S from i's forward row (operand and result are one storage) and requires
v_i^k + r_i - z_pi <= 1, v_i^k + o_i <= 1 and v_i^k + o_p <= 1. A node that makes a value nothing reads and no gradient reaches
(``Accounting.unread``) has r_i = r_(i-1) and c_i = 0: it saves nothing, in a region or out of one. A region
never reads a storage that is modified in place after the region starts (its recomputation would read the new value): for a reader q of
a storage made by p and modified by k, r_q <= z_pq if k >= q, and z_kq <= z_pq if k < q. Objective: minimize recomputation time (each
node in a region also pays ``Accounting.region_node_seconds``, each cut between adjacent regions
``Accounting.region_seconds``) plus the stalls of the copy stream (a linear bound of the simulator's critical path: copies up to each point take
no longer than the compute up to it plus the stall, POFO, Beaumont et al., NeurIPS 2021).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import highspy
import numpy as np

from memfit.solve.accounting import Accounting
from memfit.solve.offload import candidates, offloadable, trigger, wait_point

INF = highspy.kHighsInf
UNIT = 2.0**20  # bytes per MiB
# HiGHS options set on every program after memfit's own (name -> value), for experiments with the search
# (benchmarks/ilp_search.py); empty in normal use
HIGHS_OPTIONS: dict[str, object] = {}
# branch-and-bound nodes the peak-minimizing program may explore (``minimize_peak``): a node limit rather than the
# clock bounds that search, so that the floor found is repeatable. At least PEAK_SEARCH_NODES; on a graph of n nodes,
# PEAK_SEARCH_WORK // n where that is more: a small graph's nodes are cheap, and 300 left its search far from the
# optimum (a 12-step GRU cell loop: floor 2.7% above the optimum's, which 1,000 found in 2.7 s; the zoo's floors,
# ResNet-50 at 175 nodes to VGG-16 at 40, are those of 300 nodes, and ResNet-50's search at 1,000 took twice as long)
PEAK_SEARCH_NODES = 300
PEAK_SEARCH_WORK = 50_000


@dataclass
class IlpResult:
    """Region spans chosen by the integer program, with the solver's status, gap and wall time (seconds)."""

    spans: list[tuple[int, int]] | None
    status: str
    mip_gap: float | None
    seconds: float
    objective: float | None
    variants: dict[int, str] | None = None
    offloads: list[int] | None = None


class _Model:
    def __init__(self):
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.cost: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[float, float, dict[int, float]]] = []

    def var(self, lb=0.0, ub=1.0, cost=0.0, integer=False) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.cost.append(cost)
        if integer:
            self.integer.append(len(self.lb) - 1)
        return len(self.lb) - 1

    def row(self, terms: dict[int, float], lo=-INF, hi=INF) -> None:
        self.rows.append((lo, hi, terms))


def _quiet_highs() -> highspy.Highs:
    """A HiGHS instance that prints nothing (its banner is written by C code at construction)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            hs = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    hs.setOptionValue("output_flag", False)
    return hs


def solve_regions(acc: Accounting, activation_budget: int, time_limit: float = 20.0,
                  mip_gap: float = 0.01, minimize_peak: bool = False,
                  fix_spans: list[tuple[int, int]] | None = None,
                  start_spans: list[tuple[int, int]] | None = None,
                  start_variants: dict[int, str] | None = None, start_offloads: list[int] | None = None,
                  variants: list[dict[str, object]] | None = None, offload: bool = False,
                  price_region_starts: bool = False,
                  exclude: list[list[tuple[int, int]]] | None = None) -> IlpResult:
    """Solve the integer program.

    Args:
        acc: accounting of the profiled graph.
        activation_budget: bytes available above the fixed bytes.
        time_limit: HiGHS time limit in seconds; the best plan found by then is returned with its gap.
        mip_gap: relative gap at which HiGHS stops.
        minimize_peak: ignore the budget and minimize the modelled peak instead (to find the smallest
            feasible budget).
        fix_spans: pin the regions to these spans (to read the program's modelled peak of a given plan).
        start_spans: a known plan to start the search from (HiGHS completes the other variables).
        start_variants, start_offloads: that plan's variant choices (node index -> name) and offloaded
            nodes, when it has them (with ``start_spans``).
        variants: per node, the operator variants it may use (name -> :class:`VariantCost`); ``None``
            plans recomputation only. A variant changes what the node saves, allocates and costs
            (MONeT, section 4); the program picks at most one per node, jointly with the regions.
        offload: also choose which nodes' saved tensors to offload to the host store, priced with the
            profile's link costs (``acc.link``; ignored when it is ``None``).
        price_region_starts: also price a region that starts after a kept node (or at the first node) at
            ``acc.region_seconds``, as the replay does; without it only a cut between two adjacent regions is
            priced (n more variables and rows, which slow the search near the floor).
        exclude: region sets (spans): the solution may not hold every region of one of them (nor regions that
            contain them): the peak-minimizing program asked again after its answer replayed well above its
            modelled peak (the recomputation's transients are left to the replay).

    Returns:
        :class:`IlpResult`; ``spans`` is ``None`` when no plan fits (status says why).
    """
    t0 = time.perf_counter()
    n = acc.n
    m = _Model()
    # a region's own costs (memfit.runtime.overhead): each node in one pays region_node_seconds, and a cut between
    # two adjacent regions adds a region. A region after a gap is priced only with price_region_starts (counting
    # region starts takes n more rows and variables, and the time-limited search near the floor then ended on
    # slower plans: ResNet-50 at 35%, 1.19x against 1.14x predicted); the replay prices every region, and the
    # plans are compared by it.
    r = [m.var(integer=True, cost=acc.recompute_seconds[i] + acc.region_node_seconds + 1e-9) for i in range(n)]
    c = [m.var(integer=True, cost=acc.region_seconds + 1e-7) for i in range(n)]
    if fix_spans is not None:
        inside = {i for lo, hi in fix_spans for i in range(lo, hi + 1)}
        starts = {lo for lo, _ in fix_spans}
        for i in range(n):
            m.lb[r[i]] = m.ub[r[i]] = float(i in inside)
            m.lb[c[i]] = m.ub[c[i]] = float(i in starts and i - 1 in inside)
    else:
        for k in range(n):
            if acc.recomputable and not acc.recomputable[k]:  # (randomized leaky ReLU, in-place parameter writes)
                m.ub[r[k]] = 0.0
        # a value computed and never read goes with the node before it: it saves nothing, in a region or out of
        # one, and free, its two binaries widened the node-limited search (a GRU cell loop with `c = h * 2.0` beside
        # each step: budget="min" 13% higher than without the line). Only one that makes a tensor: an unread view or
        # item of a tuple (an LSTM's last cell state) is left free, as before (tied, that one moved an LSTM loop's
        # floor 1.1% up, through the search alone)
        for k in sorted(acc.unread):
            if k > 0 and acc.creates[k] and (not acc.recomputable or acc.recomputable[k]):
                m.row({r[k]: 1.0, r[k - 1]: -1.0}, lo=0.0, hi=0.0)
                m.ub[c[k]] = 0.0
    if price_region_starts and fix_spans is None and not minimize_peak:
        for i in range(n):  # starts_i >= r_i - r_(i-1): a region begins at i after a kept node (or at node 0)
            m.row({m.var(cost=acc.region_seconds + 1e-7): 1.0, r[i]: -1.0, **({r[i - 1]: 1.0} if i else {})}, lo=0.0)
    for spans in exclude or ():  # not every one of these regions (or a region containing it): for each, a node
        inside = {i for lo, hi in spans for i in range(lo, hi + 1)}  # out of regions or a cut inside it
        joints = [i for lo, hi in spans for i in range(lo + 1, hi + 1)]
        m.row({**{r[i]: -1.0 for i in inside}, **{c[i]: 1.0 for i in joints}}, lo=1.0 - len(inside))
    peak = m.var(lb=0, ub=INF, cost=1.0) if minimize_peak else None
    if minimize_peak:  # memory only, so that the answer does not depend on noisy timings
        for i in range(n):
            m.cost[r[i]] = 0.0
            m.cost[c[i]] = 0.0
    # operator variants: v[i][name] in {0,1}, at most one per node; "default" is implied by none
    options = variants or [{} for _ in range(n)]
    v: list[dict[str, int]] = []
    for i in range(n):
        v.append({})
        base_t = acc.fwd_seconds[i] + acc.bwd_seconds[i]
        for name, vc in options[i].items():
            dt = vc.fwd_seconds + vc.bwd_seconds - base_t
            v[i][name] = m.var(integer=True, cost=0.0 if minimize_peak else dt + 1e-6)
        if v[i]:
            m.row({x: 1.0 for x in v[i].values()}, hi=1.0)
    # the early stop: a region whose last node saves before it computes (a convolution) never runs that node's
    # forward again (acc.stop_seconds); e_i <= r_i, e_i <= 1 - r_(i+1) + c_(i+1) (the region ends at i), and
    # PyTorch's own implementation (a variant's autograd.Function saves after its forward)
    if not minimize_peak:
        for i in range(n):
            gain = acc.recompute_seconds[i] - acc.stop_seconds[i] if acc.stop_seconds else 0.0
            if gain <= 0:
                continue
            e = m.var(cost=-gain)
            m.row({e: 1.0, r[i]: -1.0}, hi=0.0)
            if i + 1 < n:
                m.row({e: 1.0, r[i + 1]: 1.0, c[i + 1]: -1.0}, hi=1.0)
            if v[i]:
                m.row({e: 1.0, **{x: 1.0 for x in v[i].values()}}, hi=1.0)
    link = acc.link if offload else None
    o: dict[int, int] = {}
    off_of: dict[int, int] = {}  # offloadable storage -> its node
    if link is not None:
        for j in candidates(acc):
            o[j] = m.var(integer=True, cost=0.0)
            m.row({o[j]: 1.0, r[j]: 1.0}, hi=1.0)
            for s_ in offloadable(acc, j):
                off_of[s_] = j
        if fix_spans is not None:  # a fixed plan is read without offloading
            for x in o.values():
                m.ub[x] = 0.0
    variant_storage = {sid: (i, name) for i in range(n) for name, vc in options[i].items() for sid in vc.creates}
    acts = [s for s in acc.activation] + sorted(variant_storage)
    h = {s: m.var() for s in acts}
    z: dict[tuple[int, int], int] = {}

    def same_region(p: int, q: int) -> int:
        if (p, q) not in z:
            v = m.var()
            z[(p, q)] = v
            for k in range(p, q + 1):
                m.row({v: 1.0, r[k]: -1.0}, hi=0.0)
            for k in range(p + 1, q + 1):
                m.row({v: 1.0, c[k]: 1.0}, hi=1.0)
            # lower bound: z >= 1 - sum(1 - r_k) - sum(c_k), so z is exactly the AND
            terms = {v: 1.0}
            for k in range(p, q + 1):
                terms[r[k]] = terms.get(r[k], 0.0) - 1.0
            for k in range(p + 1, q + 1):
                terms[c[k]] = terms.get(c[k], 0.0) + 1.0
            m.row(terms, lo=-(q - p))
        return z[(p, q)]

    mutators: dict[int, list[int]] = {}
    for i in range(n):
        for s in acc.mutates[i]:
            mutators.setdefault(s, []).append(i)
    # a node that saves s under its chosen implementation holds s unless it is recomputed
    for q in range(n):
        default = set(acc.saves[q])
        every = default.union(*[set(vc.saves) for vc in options[q].values()])
        for s in every:
            if s not in h:
                continue
            terms = {h[s]: 1.0, r[q]: 1.0}
            for name, vc in options[q].items():
                if s in default and s not in vc.saves:
                    terms[v[q][name]] = 1.0
                elif s not in default and s in vc.saves:
                    terms[v[q][name]] = -1.0
            if s in off_of:
                terms[o[off_of[s]]] = terms.get(o[off_of[s]], 0.0) + 1.0
            m.row(terms, lo=1.0 if s in default else 0.0)
    for s in acts:
        p = acc.producer[s]
        for q in acc.consumers[s]:
            if q == p:
                continue
            zv = same_region(p, q)
            m.row({h[s]: 1.0, r[q]: -1.0, zv: 1.0}, lo=0.0)
            _no_stale_region_input(m, mutators.get(s, []), q, r, same_region, zv)
    for s in acc.nbytes:
        if acc.producer[s] < 0 and s in mutators:
            for q in acc.consumers[s]:
                _no_stale_region_input(m, mutators[s], q, r, same_region, None)
    # in-place forms (memfit.variants.inplace): node i overwrites storage S made by p, so its output T is S
    overwrites: dict[int, int] = {}  # x -> S for the variable x of an in-place choice
    for i in range(n):
        for name, vc in options[i].items():
            if vc.inplace_of is None:
                continue
            x, s_op = v[i][name], vc.inplace_of
            overwrites[x] = s_op
            p = acc.producer[s_op]
            # the node runs where its operand was made: a region must not overwrite one of its inputs. (A region
            # reading its output is then safe: if the node is in that region, so is the operand's producer.)
            m.row({x: 1.0, r[i]: 1.0, same_region(p, i): -1.0}, hi=1.0)
            # offloading is keyed by the storage's producer, which the in-place form changes: not both
            for j in (i, p):
                if j in o:
                    m.row({x: 1.0, o[j]: 1.0}, hi=1.0)
    # bytes enter the program in MiB: coefficients near 1 keep HiGHS numerically sound
    nb = {s: acc.nbytes[s] / UNIT for s in acc.nbytes}
    budget = activation_budget / UNIT
    waits = {j: wait_point(acc, j) for j in o}
    # prefetch window of an offloaded storage: from its trigger (one node ahead) to its first saver
    window = {}
    for s_, j in off_of.items():
        t = trigger(acc, max(acc.savers[s_]))
        window[s_] = (min(acc.savers[s_]), t if t is not None else max(acc.savers[s_]))
    # forward peak at node i
    internal_of = [set(acc.internal[i]) for i in range(n)]
    for i in range(n):
        const = (acc.fwd_ws[i] + acc.fwd_offset) / UNIT  # parameter gradients do not exist yet
        terms: dict[int, float] = {}
        for name, vc in options[i].items():  # the chosen implementation's workspace
            terms[v[i][name]] = (vc.fwd_workspace - acc.fwd_ws[i]) / UNIT
            if v[i][name] in overwrites:  # the operand (alive until here) and the output are one storage
                terms[v[i][name]] -= acc.nbytes[overwrites[v[i][name]]] / UNIT
        for s in acts:
            p = acc.producer[s] if s not in variant_storage else variant_storage[s][0]
            if p > i:
                continue
            if p == i and s in variant_storage:  # exists only if its variant is chosen
                x = v[i][variant_storage[s][1]]
                terms[x] = terms.get(x, 0.0) + nb[s]
            elif s in acc.casts:  # autocast's cache holds it to the end of the forward pass, whatever the plan
                const += nb[s]
            elif p == i and s in internal_of[i] and v[i]:  # a default internal: gone with any variant
                const += nb[s]
                for x in v[i].values():
                    terms[x] = terms.get(x, 0.0) - nb[s]
            elif s not in variant_storage and acc.fwd_last[s] >= i:
                const += nb[s]
            else:
                terms[h[s]] = terms.get(h[s], 0.0) + nb[s]
                if s in off_of and i <= waits[off_of[s]]:  # its copy to the host is still being made
                    terms[o[off_of[s]]] = terms.get(o[off_of[s]], 0.0) + nb[s]
        if minimize_peak:
            terms[peak] = -1.0
            m.row(terms, hi=-const)
        else:
            m.row(terms, hi=budget - const)
    # backward peak at node i
    first_holder = {}
    for s in acts:
        if s in variant_storage:
            first_holder[s] = variant_storage[s][0]
            continue
        cands = [acc.producer[s] + 1] + list(acc.savers[s])
        cands += [q for q in (acc.producer[s],) if q >= 0 and any(s in vc.saves for vc in options[q].values())]
        first_holder[s] = min(cands)
    a = [m.var(lb=0.0, ub=INF) for _ in range(n)]
    cum = 0.0  # big-M of row i: everything a region ending at i could have rematerialized
    copies_at: list[list[int]] = [[] for _ in range(n)]
    for s in acts:
        if acc.savers[s] and s not in acc.casts:
            copies_at[min(acc.savers[s])].append(s)
    for i in range(n):
        own = {}
        # a recomputation under autocast casts the parameters again: what node i saves of them is counted until
        # its backward (each saver its own, conservatively; unsaved casts live only during the recomputation)
        own_const = sum(nb[s] for s in acc.cast_uses[i] if i in acc.savers[s])
        for s in copies_at[i]:
            p = acc.producer[s]
            if p == i:
                own_const += nb[s]
            elif p >= 0:
                zv = same_region(p, i)
                own[zv] = own.get(zv, 0.0) + nb[s]
        # a variant rematerializes what it saves of its own making instead of what the default does
        delta: dict[int, float] = {}
        default = set(acc.saves[i])
        for name, vc in options[i].items():
            made = {x for x in vc.saves if x in variant_storage or acc.producer.get(x) == i}
            dropped = sum(nb[x] for x in default - set(vc.saves) if acc.producer.get(x) == i and x in copies_at[i])
            delta[v[i][name]] = sum(nb[x] for x in made - default) - dropped
        cum += own_const + sum(own.values()) + max([0.0] + list(delta.values()))
        big = cum + 1.0
        # a_i >= a_{i-1} + own - big (1 - r_i) - big c_i
        terms = {a[i]: 1.0, r[i]: -big, c[i]: big}
        for x, b in list(own.items()) + list(delta.items()):
            terms[x] = terms.get(x, 0.0) - b
        if i > 0:
            terms[a[i - 1]] = -1.0
        m.row(terms, lo=own_const - big)
        # a_i >= own (region start)
        terms = {a[i]: 1.0, r[i]: -big}
        for x, b in list(own.items()) + list(delta.items()):
            terms[x] = terms.get(x, 0.0) - b
        m.row(terms, lo=own_const - big)
        # (a recomputation stopping at i may peak above its forward's workspace: Accounting.stop_ws, counted
        # wherever i is recomputed, which only errs on the safe side where i is inside a region; the recomputation
        # runs beside what i's backward made before its first unpack, which this row's backward part (its
        # workspace, and the gradients during it) covers unless it is larger: Accounting.held_at_unpack)
        held = acc.held_at_unpack[i] if acc.held_at_unpack else 0
        beyond = max(0, held + acc.grad_before[i] - acc.grad_during[i] - acc.bwd_ws[i])
        terms = {a[i]: 1.0, r[i]: (acc.stop_ws[i] + beyond) / UNIT}
        for name, vc in options[i].items():
            terms[v[i][name]] = (vc.bwd_workspace - acc.bwd_ws[i]) / UNIT
        for s in acts:
            if first_holder[s] <= i:
                terms[h[s]] = terms.get(h[s], 0.0) + nb[s]
        for s_, (lo_w, hi_w) in window.items():
            if lo_w <= i <= hi_w:
                x = o[off_of[s_]]
                terms[x] = terms.get(x, 0.0) + nb[s_]
        const = (acc.grad_during[i] + acc.bwd_ws[i]) / UNIT
        rows = [(terms, const)]
        if acc.grad_sum and acc.grad_sum[i] is not None:
            # autograd sums a contribution out of place once the node's backward has returned: its workspace is
            # gone, what it saved is counted still (released by then; kept here, which only errs on the safe side)
            after = {x: b for x, b in terms.items() if x != r[i]}
            for name in options[i]:
                after.pop(v[i][name], None)
            rows.append((after, acc.grad_sum[i] / UNIT))
        for terms, const in rows:
            if minimize_peak:
                terms[peak] = -1.0
                m.row(terms, hi=-const)
            else:
                m.row(terms, hi=budget - const)
    if o and not minimize_peak:
        _copy_stream_time(m, acc, o, off_of, window, link)
    hs = _quiet_highs()
    hs.setOptionValue("time_limit", float(time_limit))
    hs.setOptionValue("mip_rel_gap", float(mip_gap))
    hs.setOptionValue("threads", 1)
    if minimize_peak:  # a node limit rather than the clock bounds the search, so the result is repeatable
        hs.setOptionValue("mip_max_nodes", max(PEAK_SEARCH_NODES, PEAK_SEARCH_WORK // max(1, n)))
    for name, value in HIGHS_OPTIONS.items():
        hs.setOptionValue(name, value)
    nv = len(m.lb)
    hs.addVars(nv, np.array(m.lb), np.array(m.ub))
    hs.changeColsCost(nv, np.arange(nv, dtype=np.int32), np.array(m.cost))
    if m.integer:
        idx = np.array(m.integer, dtype=np.int32)
        hs.changeColsIntegrality(len(idx), idx, np.array([highspy.HighsVarType.kInteger] * len(idx)))
    lo = np.array([row[0] for row in m.rows])
    hi = np.array([row[1] for row in m.rows])
    starts, indices, values = [], [], []
    for _, _, terms in m.rows:
        starts.append(len(indices))
        for k, coef in terms.items():
            if coef != 0.0:
                indices.append(k)
                values.append(coef)
    hs.addRows(len(m.rows), lo, hi, len(indices), np.array(starts, dtype=np.int32),
               np.array(indices, dtype=np.int32), np.array(values))
    if start_spans is not None:
        inside = {i for lo, hi in start_spans for i in range(lo, hi + 1)}
        starts = {lo for lo, _ in start_spans}
        cols = r + c
        vals = ([float(i in inside) for i in range(n)]
                + [float(i in starts and i - 1 in inside) for i in range(n)])
        if start_variants is not None:
            for i in range(n):
                for name, x in v[i].items():
                    cols.append(x)
                    vals.append(float(start_variants.get(i) == name))
        if start_offloads is not None:
            for j, x in o.items():
                cols.append(x)
                vals.append(float(j in start_offloads))
        hs.setSolution(len(cols), np.array(cols, dtype=np.int32), np.array(vals))
    hs.run()
    status = hs.modelStatusToString(hs.getModelStatus())
    info = hs.getInfo()
    seconds = time.perf_counter() - t0
    if info.primal_solution_status != 2:  # no feasible solution (status tells infeasible or out of time)
        return IlpResult(spans=None, status=status, mip_gap=None, seconds=seconds, objective=None)
    sol = np.array(hs.getSolution().col_value)
    rv = [sol[r[i]] > 0.5 for i in range(n)]
    cv = [sol[c[i]] > 0.5 for i in range(n)]
    spans = []
    start = None
    for i in range(n):
        if rv[i] and (start is None or cv[i]):
            if start is not None:
                spans.append((start, i - 1))
            start = i
        elif not rv[i] and start is not None:
            spans.append((start, i - 1))
            start = None
    if start is not None:
        spans.append((start, n - 1))
    chosen = {i: name for i in range(n) for name, x in v[i].items() if sol[x] > 0.5}
    offloads = [j for j, x in o.items() if sol[x] > 0.5 and not rv[j]]
    return IlpResult(spans=spans, status=status, mip_gap=float(info.mip_gap), seconds=seconds, variants=chosen,
                     offloads=offloads,
                     objective=float(info.objective_function_value) * (UNIT if minimize_peak else 1.0))


def _no_stale_region_input(m: _Model, mutators: list[int], q: int, r: list[int], same_region, zpq: int | None) -> None:
    """Rows keeping a checkpoint region from reading a storage that is modified in place after the region
    starts (``memfit.solve.legal``): node ``q`` reads the storage, made by ``p`` (``zpq`` = p and q share a
    region; ``None`` for a model input, never in a region). A mutator ``k >= q`` requires ``r_q <= z_pq``; a
    mutator ``k < q`` in q's region requires the producer there too: ``z_kq <= z_pq``."""
    if any(k >= q for k in mutators):
        m.row({r[q]: 1.0} if zpq is None else {r[q]: 1.0, zpq: -1.0}, hi=0.0)
    for k in mutators:
        if k < q:
            m.row({same_region(k, q): 1.0} if zpq is None else {same_region(k, q): 1.0, zpq: -1.0}, hi=0.0)


def _copy_stream_time(m: _Model, acc: Accounting, o: dict[int, int], off_of: dict[int, int],
                      window: dict[int, tuple[int, int]], link) -> None:
    """Price offloading in the objective (seconds): each offloaded node pays its prefetch time beyond the
    backward of the node that triggers it (the copy cannot start earlier) plus a small per-copy overhead on
    the compute thread, and the serial copy stream adds cumulative stalls: the copies that must be done by
    forward node i take no longer than the forward compute up to i plus S_i, and the prefetches needed by
    backward node i no longer than the backward compute after it plus B_i."""
    n = acc.n
    by_node: dict[int, list[int]] = {}
    for s, j in off_of.items():
        by_node.setdefault(j, []).append(s)
    for j, x in o.items():
        local = 0.0
        for s in by_node[j]:
            hi_w = window[s][1]
            ahead = acc.bwd_seconds[hi_w] if hi_w != max(acc.savers[s]) else 0.0
            local += max(0.0, link.h2d_seconds(acc.nbytes[s]) - ahead) + 2e-5
        m.cost[x] += local
    d2h = {j: sum(link.d2h_seconds(acc.nbytes[s]) for s in ss) for j, ss in by_node.items()}
    waits = {j: wait_point(acc, j) for j in o}
    prev = None
    t = 0.0
    for i in range(n):
        t += acc.fwd_seconds[i]
        due = [j for j in o if waits[j] <= i]
        if not due:
            continue
        stall = m.var(lb=0.0, ub=INF)
        terms = {o[j]: d2h[j] for j in due}
        terms[stall] = -1.0
        m.row(terms, hi=t)
        if prev is not None:
            m.row({stall: 1.0, prev: -1.0}, lo=0.0)
        prev = stall
    if prev is not None:
        m.cost[prev] += 1.0
    prev = None
    t = 0.0
    for i in range(n - 1, -1, -1):
        needed = [s for s in off_of if max(acc.savers[s]) >= i]
        if needed:
            stall = m.var(lb=0.0, ub=INF)
            terms: dict[int, float] = {stall: -1.0}
            for s in needed:
                x = o[off_of[s]]
                terms[x] = terms.get(x, 0.0) + link.h2d_seconds(acc.nbytes[s])
            m.row(terms, hi=t)
            if prev is not None:
                m.row({stall: 1.0, prev: -1.0}, lo=0.0)
            prev = stall
        t += acc.bwd_seconds[i]
    if prev is not None:
        m.cost[prev] += 1.0
