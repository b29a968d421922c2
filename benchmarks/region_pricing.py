"""Plans solved with and without the checkpoint regions' own cost (``memfit.runtime.overhead``), from one profile.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/region_pricing.py resnet50:8:128 --budgets 45,40,35 --repeats 2

For each activation budget (percent of plain PyTorch's predicted activation peak), ``memfit`` (no offloading)
is solved with the measured region costs and with them set to 0; each plan's predicted overhead is then read
with the costs, so the two are compared on one model of the step. Prints activation peak, regions, MIP gap and
predicted overhead per plan; nothing is run. ``--repeats`` solves each pair again (the time-limited search
varies from run to run).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from _spec import profiled_spec

from memfit.solve.simulator import simulate
from memfit.solve.strategies import InfeasibleBudgetError, make_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="model:batch:image-size, e.g. resnet50:8:128")
    ap.add_argument("--budgets", default="45,40,35", help="activation budgets, percent, comma-separated")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=20.0)
    args = ap.parse_args()
    captured, costs, plain, act = profiled_spec(args.spec)
    graph, fixed = captured.graph, costs.fixed_bytes
    print(f"{args.spec}: a region costs {costs.region_seconds * 1e3:.2f} ms + {costs.region_node_seconds * 1e3:.3f} ms "
          "per node", flush=True)
    setups = {"unpriced": dataclasses.replace(costs, region_seconds=0.0, region_node_seconds=0.0), "priced": costs}
    print("| budget | solved | activation peak | regions | MIP gap | predicted overhead (with region costs) | solve |")
    print("|---|---|---|---|---|---|---|")
    for _ in range(args.repeats):
        for pct in (float(b) for b in args.budgets.split(",")):
            for name, c in setups.items():
                t0 = time.perf_counter()
                try:
                    p = make_plan("memfit", graph, c, budget_bytes=int(fixed + pct / 100 * act),
                                  time_limit=args.time_limit, use_offload=False)
                except InfeasibleBudgetError:
                    print(f"| {pct:g}% | {name} | infeasible | | | | |", flush=True)
                    continue
                step = simulate(graph, costs, p).step_seconds / plain.predicted_step_seconds
                print(f"| {pct:g}% | {name} | {100 * (p.predicted_peak_bytes - fixed) / act:.1f}% | {len(p.regions)} "
                      f"| {'-' if p.mip_gap is None else f'{p.mip_gap:.3f}'} | {step:.4f}x | {time.perf_counter() - t0:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
