"""The heuristics' plans with the regions a budget does not need dropped (``strategies._fewer_regions``), against
the heuristics' plans as they were (every region kept), solved from one saved profile in one process.

Where the integer program finds no plan in its time (MaxViT-T's 1,653 nodes at 80%, ``time_limit=30``), the plan
was a heuristic's, every node recomputed; with the regions dropped, it recomputes what the budget needs. Where the
program does find plans, the dropped-regions plan is its starting incumbent: this checks that the zoo's plans do not
get slower. Predicted figures only (the plans' step times are predicted by the replay; the measured ones follow
them within the usual error, BENCHMARKS.md).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/fewer_regions.py resnet50:8:128 --budgets 33,50
    OMP_WAIT_POLICY=PASSIVE python benchmarks/fewer_regions.py tv:maxvit_t:2:224 --budgets 50,60,80 --time-limit 30

``tv:NAME:B:PX`` is a torchvision classifier (10 classes, cross entropy) at batch ``B``, ``PX`` x ``PX``; other specs
are zoo models (``model:batch:image-size``). ``--costs FILE`` keeps the profile between runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F

import memfit
from memfit.solve import strategies
from memfit.solve.strategies import make_plan


def _torchvision_setup(spec: str, costs_file: str | None):
    import torchvision

    from memfit.graph.calls import forward_arguments
    from memfit.profile.costs import Costs

    _, name, batch, px = spec.split(":")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = getattr(torchvision.models, name)(num_classes=10).train()
    x, y = torch.randn(int(batch), 3, int(px), int(px)), torch.randint(0, 10, (int(batch),))
    captured = sys.modules["memfit.graph.capture"].capture(model, forward_arguments(model, (x,)))
    if costs_file and os.path.exists(costs_file):
        with open(costs_file) as f:
            costs = Costs.from_dict(json.load(f))
    else:
        _, _, costs = memfit.plan(model, x, "100%", loss_fn=lambda out: F.cross_entropy(out, y))
        if costs_file:
            with open(costs_file, "w") as f:
                json.dump(costs.to_dict(), f)
    plain = make_plan("none", captured.graph, costs)
    return captured, costs, plain, plain.predicted_peak_bytes - costs.fixed_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec")
    parser.add_argument("--budgets", default="33,50", help="percent of plain PyTorch's activation peak")
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--strategy", default="memfit")
    parser.add_argument("--costs", default=None, help="a JSON file of the profile, read where it exists")
    args = parser.parse_args()
    if args.spec.startswith("tv:"):
        captured, costs, plain, activation = _torchvision_setup(args.spec, args.costs)
    else:
        from _spec import profiled_spec

        captured, costs, plain, activation = profiled_spec(args.spec, args.costs)
    print(f"{args.spec}: {len(captured.graph.nodes)} nodes, plain activation peak {activation / 2**20:.1f} MiB, "
          f"step {plain.predicted_step_seconds:.3f} s predicted; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| budget | heuristics as they were | regions the budget does not need dropped |")
    print("|---|---|---|")
    for pct in [float(b) for b in args.budgets.split(",")]:
        budget = int(costs.fixed_bytes + pct / 100 * activation)
        cells = []
        for dropped in (False, True):
            patch = contextlib.nullcontext() if dropped else mock.patch.object(strategies, "_fewer_regions",
                                                                                 lambda *a: None)
            with patch:
                try:
                    p = make_plan(args.strategy, captured.graph, costs, budget_bytes=budget,
                                  time_limit=args.time_limit)
                except strategies.InfeasibleBudgetError:
                    cells.append("infeasible")
                    continue
            counts = p.counts()
            cells.append(f"{(p.predicted_peak_bytes - costs.fixed_bytes) / activation:.1%} at "
                         f"{p.predicted_step_seconds / plain.predicted_step_seconds:.3f}x, {counts['recompute']} of "
                         f"{counts['keep'] + counts['recompute']} nodes recomputed"
                         + (", program's" if p.mip_gap is not None else ", heuristic's or floor's"))
        print(f"| {pct:g}% | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
