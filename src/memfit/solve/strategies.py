"""Every strategy produces a :class:`Plan` for the same runtime (DESIGN.md, "Baselines are plans too")."""

from __future__ import annotations

import time

from memfit.budget import fmt_bytes
from memfit.graph.ir import Graph
from memfit.profile.costs import Costs
from memfit.solve.accounting import Accounting
from memfit.solve.baselines import block_spans, chen_spans
from memfit.solve.ilp import solve_regions
from memfit.solve.legal import legalize
from memfit.solve.plan import Plan
from memfit.solve.simulator import _replay

STRATEGIES = ("none", "chen", "checkpoint-all", "memfit")


class InfeasibleBudgetError(ValueError):
    """No plan fits the budget. ``smallest_feasible_bytes`` is the lowest peak memfit found a plan for."""

    def __init__(self, budget_bytes: int, smallest_feasible_bytes: int, fixed_bytes: int):
        self.budget_bytes = budget_bytes
        self.smallest_feasible_bytes = smallest_feasible_bytes
        self.fixed_bytes = fixed_bytes
        super().__init__(
            f"no plan fits a budget of {budget_bytes} bytes ({fmt_bytes(budget_bytes)}); the smallest "
            f"feasible budget is {smallest_feasible_bytes} bytes ({fmt_bytes(smallest_feasible_bytes)}), "
            f"of which {fixed_bytes} bytes ({fmt_bytes(fixed_bytes)}) are fixed (parameters, gradients, "
            "buffers, optimizer state, inputs). Raise the budget, or lower the batch size.")


def _finish(strategy, acc, names, spans, fixed, budget, t0, gap=None) -> Plan:
    spans = legalize(acc, spans)
    sim = _replay(acc, spans, fixed)
    return Plan.from_spans(strategy, names, spans, budget_bytes=budget, fixed_bytes=fixed,
                           predicted_peak_bytes=sim.peak_bytes, predicted_step_seconds=sim.step_seconds,
                           solve_seconds=time.perf_counter() - t0, mip_gap=gap)


def _low_memory_candidates(acc: Accounting, graph: Graph, time_limit: float) -> list[list[tuple[int, int]]]:
    """Region spans of the lowest-memory plans memfit knows: the integer program minimizing the modelled
    peak, one region per block, Chen's segments and a single region."""
    cands = [legalize(acc, chen_spans(acc)), legalize(acc, block_spans(graph)), legalize(acc, [(0, acc.n - 1)])]
    res = solve_regions(acc, 0, time_limit=time_limit, minimize_peak=True)
    if res.spans is not None:
        cands.insert(0, legalize(acc, res.spans))
    return cands


def smallest_feasible(acc: Accounting, graph: Graph, fixed: int, time_limit: float = 20.0) -> int:
    """The smallest budget (bytes) for which :func:`make_plan` finds a ``memfit`` plan: the lowest simulated
    peak among :func:`_low_memory_candidates`, plus the safety margin."""
    plain = _replay(acc, [], fixed).peak_bytes
    peaks = [_replay(acc, spans, fixed).peak_bytes for spans in _low_memory_candidates(acc, graph, time_limit)]
    return min(peaks) + _margin(plain - fixed)


def make_plan(strategy: str, graph: Graph, costs: Costs, budget_bytes: int | None = None,
              fixed_bytes: int | None = None, time_limit: float = 20.0) -> Plan:
    """Make a plan with one strategy.

    Args:
        strategy: ``none`` (keep everything), ``chen`` (sqrt(n) segments, Chen et al. 2016),
            ``checkpoint-all`` (each block its own checkpoint region), or ``memfit`` (the integer program).
        graph, costs: the captured graph and its profile.
        budget_bytes: total-peak budget in bytes (``memfit`` needs it; heuristics only record it).
        fixed_bytes: fixed bytes (default ``costs.fixed_bytes``; add optimizer state).
        time_limit: solver time limit (seconds).

    Returns:
        :class:`Plan` with predicted peak and step time.

    Raises:
        ValueError: unknown strategy, or ``memfit`` without a budget.
        InfeasibleBudgetError: ``memfit`` found no plan under the budget; names the smallest feasible one.
    """
    t0 = time.perf_counter()
    acc = Accounting.build(graph, costs)
    names = [n.name for n in graph.nodes]
    fixed = costs.fixed_bytes if fixed_bytes is None else fixed_bytes
    if strategy == "none":
        return _finish(strategy, acc, names, [], fixed, budget_bytes, t0)
    if strategy == "chen":
        return _finish(strategy, acc, names, chen_spans(acc), fixed, budget_bytes, t0)
    if strategy == "checkpoint-all":
        return _finish(strategy, acc, names, block_spans(graph), fixed, budget_bytes, t0)
    if strategy != "memfit":
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if budget_bytes is None:
        raise ValueError("the memfit strategy needs a budget (bytes or a percentage)")
    plain = _replay(acc, [], fixed)
    margin = _margin(plain.peak_bytes - fixed)
    limit = budget_bytes - margin  # what the simulated peak may reach
    if plain.peak_bytes <= limit:
        return _finish(strategy, acc, names, [], fixed, budget_bytes, t0, gap=0.0)
    # The program is a conservative linearization of the replay: solve, replay, and move the program's
    # budget by the replay's error (down when over the limit, up to use slack), bisecting between the
    # largest program budget that replayed under the limit and the smallest that did not.
    deadline = time.perf_counter() + time_limit
    best: Plan | None = None
    for spans in (chen_spans(acc), block_spans(graph)):  # cheap incumbents to start the search from
        plan = _finish(strategy, acc, names, spans, fixed, budget_bytes, t0)
        if plan.predicted_peak_bytes <= limit and (best is None or
                                                   plan.predicted_step_seconds < best.predicted_step_seconds):
            best = plan
    target, ok_target, bad_target = limit - fixed, None, None
    for _ in range(8):
        remaining = deadline - time.perf_counter()
        if target <= 0 or remaining <= 0.5:
            break
        res = solve_regions(acc, target, time_limit=max(1.0, remaining / 2),
                            start_spans=best.region_spans() if best is not None else None)
        if res.spans is None:
            if "nfeasible" not in res.status:
                break  # out of time without a solution: keep what we have
            bad_target = target
        else:
            plan = _finish(strategy, acc, names, res.spans, fixed, budget_bytes, t0, gap=res.mip_gap)
            if plan.predicted_peak_bytes <= limit:
                if best is None or plan.predicted_step_seconds < best.predicted_step_seconds:
                    best = plan
                ok_target = target
                if limit - plan.predicted_peak_bytes <= margin // 2:
                    break
            else:
                bad_target = target
        if ok_target is None:
            step = (plan.predicted_peak_bytes - limit) if res.spans is not None else target // 4
            target -= max(step, 2**16)
        elif bad_target is None:
            target = ok_target + max(limit - plan.predicted_peak_bytes, 2**16)
        elif bad_target - ok_target <= margin // 2:
            break
        else:
            target = (ok_target + bad_target) // 2
    if best is None:
        # near the smallest feasible budget the conservative program may find nothing: fall back to the
        # lowest-memory plans, replayed exactly, and take the fastest that fits
        fits = []
        for spans in _low_memory_candidates(acc, graph, max(1.0, deadline - time.perf_counter())):
            plan = _finish(strategy, acc, names, spans, fixed, budget_bytes, t0)
            fits += [plan] if plan.predicted_peak_bytes <= limit else []
        best = min(fits, key=lambda p: p.predicted_step_seconds, default=None)
    if best is not None:
        best.solve_seconds = time.perf_counter() - t0
        return best
    raise InfeasibleBudgetError(budget_bytes, smallest_feasible(acc, graph, fixed, time_limit), fixed)


def _margin(activation_bytes: int) -> int:
    """Headroom kept under the budget for what the replay leaves out (allocator rounding, small tensors of
    the loss and of checkpoint bookkeeping): 1% of plain PyTorch's activation peak plus 64 KiB."""
    return activation_bytes // 100 + 2**16
