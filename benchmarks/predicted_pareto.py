"""Predicted activation memory against predicted overhead for ``remat-ilp`` and ``memfit`` (no offloading) on
one profile of a zoo model: both strategies solved from the same measured costs, so the comparison carries
no timing noise. Per budget: each plan's predicted activation peak (fraction of plain PyTorch's predicted
activation peak), predicted step time over plain PyTorch's, the operator variants it chose, and the forward
seconds it recomputes, by layer type (a BatchNorm that ``bn-saved-stats`` recomputes from its forward
pass's statistics at its recomputation time).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/predicted_pareto.py resnet50:8:128 --budgets 90,70,50,40,35
"""

import argparse
import collections

from _spec import profiled_spec

from memfit.solve.strategies import InfeasibleBudgetError, make_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="model:batch:image-size, e.g. resnet50:8:128")
    ap.add_argument("--budgets", default="90,80,70,60,50,45,40,35", help="activation budgets, percent")
    ap.add_argument("--time-limit", type=float, default=20.0)
    args = ap.parse_args()
    captured, costs, plain, act = profiled_spec(args.spec)
    graph, fixed = captured.graph, costs.fixed_bytes
    kind = [n.module_type or n.target for n in graph.nodes]
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    print(f"{args.spec}: plain activation peak {act / 2**20:.1f} MiB, predicted step {plain.predicted_step_seconds:.3f} s")
    for pct in [float(b) for b in args.budgets.split(",")]:
        row = [f"{pct:g}%"]
        for strategy in ("remat-ilp", "memfit"):
            try:
                p = make_plan(strategy, graph, costs, budget_bytes=int(fixed + pct / 100 * act),
                              time_limit=args.time_limit, use_offload=False)
            except InfeasibleBudgetError as exc:
                row.append(f"{strategy}: infeasible (floor {100 * (exc.smallest_feasible_bytes - fixed) / act:.1f}%)")
                continue
            chosen = p.counts()["variants"]
            from_stats = set(p.stats_recompute)
            recomputed: collections.Counter = collections.Counter()
            for lo, hi in p.regions:
                for i in range(index[lo], index[hi] + 1):
                    c = costs.nodes[i]
                    recomputed[kind[i]] += c.recompute_seconds if c.name in from_stats else c.fwd_seconds
            top = ", ".join(f"{k} {v:.3f}" for k, v in recomputed.most_common(3))
            row.append(f"{strategy}: {100 * (p.predicted_peak_bytes - fixed) / act:.1f}% "
                       f"{p.predicted_step_seconds / plain.predicted_step_seconds:.3f}x "
                       f"variants {dict(chosen) or '-'} recomputes {top or '-'} s")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
