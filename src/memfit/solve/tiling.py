"""Which blocks to run in row stripes (:mod:`memfit.variants.tiled`), chosen by solving each candidate.

A tiled block is a rewrite of the graph (:func:`memfit.graph.tiling.apply_tiling`), so it is not a per-node
choice of the integer program: each candidate set of tiled blocks is profiled as its own graph and solved
under the same budget, and the fastest plan that fits wins (at ``budget="min"``: the least memory, then the
fastest). Candidates are the blocks with the largest activations (at least half the model's largest output,
at most three), tiled the largest first: 1, 2, ... of them, in 4 and in 8 stripes (on VGG-16 at batch 2, 128 px, its first two
blocks in 8 stripes: a predicted floor of 29% of plain PyTorch's activation peak at 1.02x its step time;
tiling the third block too, with 16x more weight gradient per stripe and wider halos, raised the floor
to 37% at 1.30x). The untiled graph is always a candidate, so tiling never makes a plan worse by the
replay's figures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from memfit.graph.capture import Captured
from memfit.graph.tiling import TiledBlock
from memfit.profile.costs import Costs
from memfit.solve.plan import Plan
from memfit.solve.strategies import InfeasibleBudgetError

__all__ = ["Option", "best_plan", "best_plan_rounding", "share_timings", "tiling_candidates"]

STRIPES = (4, 8)
MAX_BLOCKS = 3  # at most 6 candidates, each a profile of the whole model


@dataclass
class Option:
    """One graph to plan: ``captured`` and its profile ``costs``, with the blocks ``tiled`` in it and the BatchNorm
    nodes it runs from their output (``bn_from_output``, :func:`memfit.graph.bn_output.apply_bn_from_output`)."""

    captured: Captured
    costs: Costs
    tiled: list[TiledBlock] = field(default_factory=list)
    bn_from_output: list[str] = field(default_factory=list)


def tiling_candidates(blocks: list[list[str]], costs: Costs) -> list[list[TiledBlock]]:
    """Candidate sets of tiled blocks (see the module docstring) for the chain ``blocks`` of a graph
    (:func:`memfit.graph.tiling.chain_blocks`) and its untiled profile ``costs`` (sizes in bytes)."""
    size = {n.name: max((costs.storages[i].nbytes for i in n.outputs), default=0) for n in costs.nodes}
    sized = sorted(((max(size.get(n, 0) for n in b), k) for k, b in enumerate(blocks)), reverse=True)
    if not sized or sized[0][0] == 0:
        return []
    # (at least half the model's largest output, not only the largest block's: a fresh user's EfficientNet-B0 and
    # MobileNet-V3 got their squeeze-excitation blocks, convolutions on 1x1 maps, striped, a profile each for nothing)
    largest = max(size.values(), default=0)
    chosen = [blocks[k] for s, k in sized if 2 * s >= largest][:MAX_BLOCKS]
    return [[TiledBlock(tuple(b), stripes) for b in chosen[:k]] for k in range(1, len(chosen) + 1)
            for stripes in STRIPES]


def share_timings(base: Costs, other: Costs, tiled: list[TiledBlock], changed: tuple[str, ...] = ()) -> None:
    """Give ``other``'s nodes that are also in ``base`` (all but the tiled blocks' nodes and those named in
    ``changed``) ``base``'s measured times, so that plans of the two graphs differ in time only where the graphs
    do, not by timing noise between the two profiles (medians of a few runs each, +-5% per node on a shared
    CPU)."""
    tiled_names = {b.nodes[-1] for b in tiled} | set(changed)
    mine = {n.name: n for n in base.nodes}
    for n in other.nodes:
        ref = mine.get(n.name)
        if ref is None or n.name in tiled_names:
            continue
        n.fwd_seconds, n.bwd_seconds, n.recompute_seconds = ref.fwd_seconds, ref.bwd_seconds, ref.recompute_seconds
        for name, v in n.variants.items():
            if name in ref.variants:
                v.fwd_seconds, v.bwd_seconds = ref.variants[name].fwd_seconds, ref.variants[name].bwd_seconds


def best_plan(options: list[Option], solve: Callable[[Option], Plan], minimum: bool) -> tuple[Plan, Option]:
    """Solve every option and keep the fastest plan (``minimum``: the one with the smallest budget, then the
    fastest), with ``plan.tiled`` set to its option's striped blocks and ``plan.bn_from_output`` to its BatchNorm
    nodes run from their output. ``solve(option)`` returns a plan or
    raises :class:`InfeasibleBudgetError`.

    Raises:
        InfeasibleBudgetError: no option has a plan; it names the smallest feasible budget of them all.
    """
    found: list[tuple[Plan, Option]] = []
    errors: list[InfeasibleBudgetError] = []
    for option in options:
        try:
            found.append((solve(option), option))
        except InfeasibleBudgetError as exc:
            errors.append(exc)
    if not found:
        raise min(errors, key=lambda e: e.smallest_feasible_bytes)
    if minimum:
        plan, option = min(found, key=lambda f: (f[0].budget_bytes, f[0].predicted_step_seconds))
    else:
        plan, option = min(found, key=lambda f: f[0].predicted_step_seconds)
    plan.tiled = [b.to_dict() for b in option.tiled]
    plan.bn_from_output = list(option.bn_from_output)
    return plan, option


def best_plan_rounding(options: list[Option], rounding: Option | None, solve: Callable[[Option], Plan], minimum: bool,
                       margin: float) -> tuple[Plan, Option]:
    """:func:`best_plan` over ``options``, then ``rounding`` (a graph whose gradients equal PyTorch's to float32
    rounding only, such as BatchNorm run from its output) solved too and kept only where it pays for that:
    its plan faster by ``margin`` of the step, or, with ``minimum``, a budget smaller by ``margin`` of the other
    plan's activation part (or where ``options`` have no plan).

    Raises:
        InfeasibleBudgetError: no graph has a plan; it names the smallest feasible budget of them all.
    """
    result: tuple[Plan, Option] | None = None
    errors: list[InfeasibleBudgetError] = []
    for group in ([options, [rounding]] if rounding is not None else [options]):
        try:
            found = best_plan(group, solve, minimum)
        except InfeasibleBudgetError as exc:
            errors.append(exc)
            continue
        if result is None:
            result = found
            continue
        plan, exact = found[0], result[0]
        if minimum:
            pays = plan.budget_bytes < exact.budget_bytes - margin * (exact.budget_bytes - exact.fixed_bytes)
        else:
            pays = plan.predicted_step_seconds < (1 - margin) * exact.predicted_step_seconds
        if pays:
            result = found
    if result is None:
        raise min(errors, key=lambda e: e.smallest_feasible_bytes)
    return result
