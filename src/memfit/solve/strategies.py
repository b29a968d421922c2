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


def smallest_feasible(acc: Accounting, fixed: int, time_limit: float = 20.0) -> int:
    """The lowest simulated total peak among the plans memfit can make (bytes): the integer program
    minimizing the modelled peak, and the heuristic baselines."""
    peaks = [_replay(acc, legalize(acc, [(0, acc.n - 1)]), fixed).peak_bytes]
    res = solve_regions(acc, 0, time_limit=time_limit, minimize_peak=True)
    if res.spans is not None:
        peaks.append(_replay(acc, legalize(acc, res.spans), fixed).peak_bytes)
    peaks.append(_replay(acc, legalize(acc, chen_spans(acc)), fixed).peak_bytes)
    plain = _replay(acc, [], fixed).peak_bytes
    return min(peaks) + 3 * (plain - fixed) // 100 + 2**16


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
    # headroom for what the replay leaves out (the loss, allocator rounding): 3% of the activations + 64 KiB
    margin = 3 * (plain.peak_bytes - fixed) // 100 + 2**16
    if plain.peak_bytes <= budget_bytes - margin:
        return _finish(strategy, acc, names, [], fixed, budget_bytes, t0, gap=0.0)
    target = budget_bytes - fixed - margin
    for _ in range(6):
        if target <= 0:
            break
        res = solve_regions(acc, target, time_limit=time_limit)
        if res.spans is None:
            break
        plan = _finish(strategy, acc, names, res.spans, fixed, budget_bytes, t0, gap=res.mip_gap)
        if plan.predicted_peak_bytes <= budget_bytes - margin:
            return plan
        # the linearization is conservative, but workspace during recomputation is approximate: tighten
        target -= plan.predicted_peak_bytes - (budget_bytes - margin)
    raise InfeasibleBudgetError(budget_bytes, smallest_feasible(acc, fixed, time_limit), fixed)
