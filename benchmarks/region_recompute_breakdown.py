"""What a ``memfit`` plan recomputes, region by region, from one profile.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/region_recompute_breakdown.py resnet50:8:128 --budget 33 [--costs FILE]

Solves ``memfit`` at ``--budget`` percent of plain PyTorch's activation peak (the traced graph, as
``overhead_split.py`` without the other graphs) and prints, per checkpoint region, its nodes with their operator
variant and forward time (ms, the profile's recomputation time where it has one), then the sum as a fraction of
plain PyTorch's predicted step and the plan's predicted overhead (lower than the sum: the early stop skips a
region's last convolution, saved statistics make BatchNorm cheaper) and its MIP gap. ``--costs``: a saved profile
(``Costs.to_dict`` JSON), read if it exists, else written.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from _spec import profiled_spec

from memfit.solve.strategies import make_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="model:batch:image-size, e.g. resnet50:8:128")
    ap.add_argument("--budget", type=float, default=33.0, help="activation budget, percent of plain PyTorch's")
    ap.add_argument("--costs", default=None, help="saved profile to read (or write)")
    ap.add_argument("--time-limit", type=float, default=20.0)
    args = ap.parse_args()
    captured, costs, plain, act = profiled_spec(args.spec, args.costs)
    plan = make_plan("memfit", captured.graph, costs, budget_bytes=int(costs.fixed_bytes + args.budget / 100 * act),
                     time_limit=args.time_limit, use_offload=False)
    base = plain.predicted_step_seconds
    by_name = {c.name: c for c in costs.nodes}

    def seconds(name: str) -> float:
        c = by_name[name]
        return c.recompute_seconds if c.recompute_seconds is not None else c.fwd_seconds

    total = 0.0
    for lo, hi in plan.region_spans():
        names = [n for n in plan.nodes[lo:hi + 1] if n in by_name]
        total += sum(seconds(n) for n in names)
        print(f"region {lo}-{hi} ({sum(seconds(n) for n in names) * 1e3:.1f} ms): "
              + " ".join(f"{n}[{plan.variants.get(n, 'default')}] {seconds(n) * 1e3:.1f}" for n in names))
    print(f"{args.spec} @ {args.budget}%: plain step {base:.3f} s predicted; regions' forward time {total * 1e3:.1f} ms "
          f"= {total / base:.3f}x of it; plan {plan.predicted_step_seconds / base:.4f}x predicted, activation "
          f"{(plan.predicted_peak_bytes - costs.fixed_bytes) / act:.3f}, MIP gap {plan.mip_gap}")


if __name__ == "__main__":
    main()
