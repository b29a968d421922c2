"""``remat-ilp`` against ``memfit`` at chosen activation budgets, timed round-robin with plain PyTorch.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/ab_overhead.py resnet50:8:128 \
        --setups remat-ilp@60,remat-ilp@50,remat-ilp@40,memfit@50,memfit@40 --rounds 15

Issue 3 compares the two at equal measured overhead. ``memfit bench`` times each row against its own plain
PyTorch run, and on the shared development machine plain PyTorch's median moved by up to 10% between rows,
as much as the difference being measured. Here every plan comes from one profile (with the operator
variants, as ``memfit`` profiles; ``remat-ilp`` ignores them; ``memfit`` setups are solved, as :func:`memfit.plan`
solves them, over the graphs with blocks in row stripes and with BatchNorm run from its output too, profiled once:
``_spec.solve_as_planned``), and plain PyTorch and every plan of
``--setups`` (``strategy@activation budget in percent``; ``strategy-unpriced@...`` solves with the checkpoint
regions' own cost left out, as before :mod:`memfit.runtime.overhead`; ``strategy-nonative@...`` without the
``conv-native`` variant (``strategy-nopoolcl@...``: without ``maxpool-compact-cl``); ``strategy-nostop@...`` solved as before the early stop was priced: a region's last
convolution charged its forward time, which the non-reentrant checkpoint never spends; ``strategy-regionN@...``
solved with each checkpoint region priced at ``N`` ms, the per-node price unchanged) take one training step each in turn (SGD with
momentum, gradients set to ``None``) for ``--rounds`` rounds after a warm-up
(:func:`memfit.bench.harness.interleaved_step_seconds`): the overheads are ratios of medians taken in the
same minutes, so plans can be compared with each other directly. Memory (exact tracker), gradients and
BatchNorm statistics come from one step of each plan from the same weights as plain PyTorch
(:func:`measure_training`); a plan that rounds differently (``conv-native``) is judged by the one-step
float64 check instead (:func:`memfit.bench.job.rounding_check`: ``float32 rounding`` in the last column).

Prints one row per setup: measured activation peak (fraction of plain PyTorch's), predicted and measured
overhead, the operator variants, and whether gradients and BatchNorm statistics match plain PyTorch's. With
both ``memfit`` and ``remat-ilp`` setups it then reads, for each ``memfit`` row, ``remat-ilp``'s activation peak
at the same measured overhead off its measured rows (:mod:`memfit.bench.frontier`), and the ratio of the two.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from contextlib import nullcontext
from unittest import mock

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from _spec import measured_setup, memfit_options, profile_once, solve_as_planned, without_variant

import memfit
from memfit.bench.frontier import memory_at_overhead
from memfit.bench.harness import compare, fresh_copy, interleaved_step_seconds, measure_training
from memfit.bench.job import rounding_check, rounding_verdict, rounds_differently
from memfit.graph import capture
from memfit.solve.simulator import simulate
from memfit.solve.strategies import InfeasibleBudgetError, make_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="model:batch:image-size, e.g. resnet50:8:128")
    ap.add_argument("--setups", default="remat-ilp@60,remat-ilp@50,remat-ilp@40,memfit@50,memfit@40",
                    help="strategy@activation budget (percent of plain PyTorch's), comma-separated")
    ap.add_argument("--rounds", type=int, default=15, help="timed steps per setup, round-robin")
    ap.add_argument("--time-limit", type=float, default=20.0)
    args = ap.parse_args()
    model, x, y, loss, base = measured_setup(args.spec)
    captured, costs = profile_once(model, x, y, loss)
    graph, fixed = captured.graph, costs.fixed_bytes
    options, rounding = memfit_options(model, x, y, loss, captured, costs)
    plain_plan = make_plan("none", graph, costs)
    act = plain_plan.predicted_peak_bytes - fixed
    print(f"plain PyTorch: activation peak {base.activation_peak_bytes / 2**20:.1f} MiB measured, "
          f"{act / 2**20:.1f} MiB predicted", flush=True)
    rows, setups = [], [(plain := fresh_copy(model), plain)]
    for setup in args.setups.split(","):
        strategy, pct = setup.split("@")

        def priced(c, strategy=strategy):  # the setup's ablation of a profile
            if strategy.endswith("-unpriced"):
                c = dataclasses.replace(c, region_seconds=0.0, region_node_seconds=0.0)
            if (m := re.search(r"-region([0-9.]+)$", strategy)):
                c = dataclasses.replace(c, region_seconds=float(m[1]) * 1e-3)
            if strategy.endswith("-nonative"):
                c = without_variant(c, "conv-native")
            if strategy.endswith("-nopoolcl"):
                c = without_variant(c, "maxpool-compact-cl")
            return c

        # (the ablation of the early stop's price: every node's recomputation charged in full again)
        nostop = (mock.patch("memfit.solve.accounting._saves_before_computing", return_value=False)
                  if strategy.endswith("-nostop") else nullcontext())
        base_strategy = re.sub(r"-region[0-9.]+$", "", strategy)
        for suffix in ("-unpriced", "-nonative", "-nopoolcl", "-nostop"):
            base_strategy = base_strategy.removesuffix(suffix)
        try:
            with nostop:  # (memfit over the graphs memfit.plan solves: row stripes, BatchNorm from its output)
                plan, option = solve_as_planned(base_strategy, options, rounding, int(fixed + float(pct) / 100 * act),
                                                args.time_limit, edit=priced)
        except InfeasibleBudgetError as exc:
            print(f"{setup}: infeasible (smallest feasible {100 * (exc.smallest_feasible_bytes - fixed) / act:.1f}%)")
            continue
        planned = memfit.PlannedModule(capture(fresh_copy(model)), plan)
        fig = measure_training(planned, planned, (x,), y, loss, steps=1)
        timed = memfit.PlannedModule(capture(fresh_copy(model)), plan)
        setups.append((timed, timed))
        rows.append((strategy, pct, plan, fig, option))
    seconds = interleaved_step_seconds(setups, (x,), y, loss, rounds=args.rounds)
    print(f"plain PyTorch step {seconds[0]:.3f} s (median of {args.rounds}); a region costs "
          f"{costs.region_seconds * 1e3:.2f} ms + {costs.region_node_seconds * 1e3:.3f} ms per node")
    def free(c):  # a profile without the regions' own cost
        return dataclasses.replace(c, region_seconds=0.0, region_node_seconds=0.0)

    plain_free = simulate(graph, free(costs), plain_plan).step_seconds
    print("| strategy | budget | activation peak | predicted overhead (without the regions' own cost) | measured overhead "
          "| regions (nodes) | variants | gradients |")
    print("|---|---|---|---|---|---|---|---|")
    for k, (strategy, pct, plan, fig, option) in enumerate(rows, start=1):
        check = compare(base, fig)
        g, c = option.captured.graph, option.costs  # (the graph the plan runs, its profile as measured)
        if rounds_differently(plan):
            one = rounding_check(model, plan, (x,), y, loss)
            check = rounding_verdict(one) | {"max_abs_grad_diff": one["vs_float64"]}
        print(f"| {strategy} | {pct}% | {100 * fig.activation_peak_bytes / base.activation_peak_bytes:.1f}% "
              f"| {simulate(g, c, plan).step_seconds / plain_plan.predicted_step_seconds:.3f}x "
              f"({simulate(g, free(c), plan).step_seconds / plain_free:.3f}x) "
              f"| {seconds[k] / seconds[0]:.3f}x | {len(plan.regions)} ({sum(hi - lo + 1 for lo, hi in plan.region_spans())}) "
              f"| {plan.counts()['variants'] or '-'} "
              f"| {'equal' if check['gradients_match'] and check['bn_stats_match'] else 'DIFFER'}"
              f"{' to float32 rounding' if 'rounding_check' in check else ''} ({check['max_abs_grad_diff']:.1e}) |",
              flush=True)
    measured = {}  # strategy -> [(measured overhead, activation peak as a fraction of plain PyTorch's)]
    for k, (strategy, _, _, fig, _) in enumerate(rows, start=1):
        measured.setdefault(strategy, []).append((seconds[k] / seconds[0],
                                                  fig.activation_peak_bytes / base.activation_peak_bytes))
    print_equal_overhead(measured)


def print_equal_overhead(measured: dict[str, list[tuple[float, float]]]) -> None:
    """Issue 3's second target: each ``memfit`` row against ``remat-ilp`` at the same measured overhead, its
    activation peak read off ``remat-ilp``'s measured frontier (:func:`memfit.bench.frontier.memory_at_overhead`:
    linear between the rows around it, never extrapolated)."""
    others = measured.get("remat-ilp", [])
    if not others or not measured.get("memfit"):
        return
    print("\nAt equal measured overhead (remat-ilp's activation peak interpolated on its measured frontier):")
    for overhead, peak in sorted(measured["memfit"]):
        other = memory_at_overhead(others, overhead)
        if other is None:
            lo, hi = min(t for t, _ in others), max(t for t, _ in others)
            print(f"  memfit {100 * peak:.1f}% at {overhead:.3f}x: remat-ilp not measured at that overhead "
                  f"(its rows: {lo:.3f}x-{hi:.3f}x)")
        else:
            print(f"  memfit {100 * peak:.1f}% at {overhead:.3f}x: remat-ilp {100 * other:.1f}%, "
                  f"{other / peak:.2f}x memfit's")


if __name__ == "__main__":
    main()
