"""A plan's overhead split into its operator variants and its checkpoint regions, predicted against measured.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/overhead_split.py mobilenet_v2:32:128 --budget 33 --rounds 10

Solves ``memfit`` at ``--budget`` percent of plain PyTorch's activation peak from one profile, over the graphs
:func:`memfit.plan` solves (as ``ab_overhead.py``: ``_spec.solve_as_planned``), then times, round-robin with plain PyTorch (:func:`memfit.bench.harness.interleaved_step_seconds`,
SGD with momentum, one intra-op thread, memory retained):

* ``plan``: the plan as solved;
* ``variants only``: its operator variants, no checkpoint region (nothing recomputed);
* ``regions only``: its regions (with ``bn-saved-stats`` where it chose them), every operator PyTorch's own;
* ``regions, stats recomputed``: its variants and regions, but each recomputed BatchNorm computing its
  statistics again (``stats_recompute`` empty).

For each it prints the predicted overhead (the simulator's step time over plain PyTorch's, with the same costs)
and the measured one (ratio of medians). Where the full plan's measured overhead exceeds its prediction, the
rows show which part the cost model underprices. Memory is not checked here (``ab_overhead.py`` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from _spec import memfit_options, profile_once, solve_as_planned, timed_plans, zoo_setup

from memfit.solve.simulator import simulate
from memfit.solve.strategies import make_plan


def parts(plan):
    """``[(name, plan)]``: the plan and its three parts described in the module docstring."""
    def edit(**kw):
        return dataclasses.replace(plan, decisions={}, solved_digest=None, **kw)

    default = {n: "default" for n in plan.nodes}
    return [("plan", plan),
            ("variants only", edit(regions=[], stats_recompute=[])),
            ("regions only", edit(variants=default)),
            ("regions, stats recomputed", edit(stats_recompute=[]))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="model:batch:image-size, e.g. mobilenet_v2:32:128")
    ap.add_argument("--budget", type=float, default=33.0, help="activation budget, percent of plain PyTorch's")
    ap.add_argument("--rounds", type=int, default=10, help="timed steps per setup, round-robin")
    ap.add_argument("--time-limit", type=float, default=20.0)
    args = ap.parse_args()
    model, x, y, loss = zoo_setup(args.spec)
    print(f"{args.spec} @ {args.budget}%, {platform.machine()}, 1 thread, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    captured, costs = profile_once(model, x, y, loss)
    graph, fixed = captured.graph, costs.fixed_bytes
    plain_plan = make_plan("none", graph, costs)
    act = plain_plan.predicted_peak_bytes - fixed
    options, rounding = memfit_options(model, x, y, loss, captured, costs)
    plan, option = solve_as_planned("memfit", options, rounding, int(fixed + args.budget / 100 * act),
                                    args.time_limit)
    rows = parts(plan)
    seconds = timed_plans(model, [p for _, p in rows], x, y, loss, args.rounds)
    print(f"plain PyTorch step {seconds[0]:.3f} s (median of {args.rounds}); plan: {len(plan.regions)} regions, "
          f"variants {plan.counts()['variants']}")
    print("| setup | predicted overhead | measured overhead | measured - predicted |")
    print("|---|---|---|---|")
    for k, (name, p) in enumerate(rows, start=1):
        pred = simulate(option.captured.graph, option.costs, p).step_seconds / plain_plan.predicted_step_seconds
        meas = seconds[k] / seconds[0]
        print(f"| {name} | {pred:.3f}x | {meas:.3f}x | {meas - pred:+.3f}x |", flush=True)


if __name__ == "__main__":
    main()
