"""How often the plan priced with a checkpoint region as dear as a whole step holds more regions than the
unpriced plan (tests/test_region_overhead.py's check, repeated; CI once failed it, 5 regions against 3).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/priced_regions_check.py --runs 40     # one process
    for k in 1 2 3; do OMP_WAIT_POLICY=PASSIVE python benchmarks/priced_regions_check.py --runs 40 & done; wait

Each run profiles the test's 12-layer MLP (Linear 64 + tanh, batch 256) afresh, as the test's fixture does, and
solves ``remat-ilp`` at 60% of the activation peak with the regions unpriced and priced at a whole step. Three
processes on two cores are the loaded machine on which the failure reproduced. Prints each failing run and the
count; nothing is trained.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from torch import nn

from memfit.graph import capture
from memfit.profile import profile_graph
from memfit.solve.strategies import make_plan


class Deep(nn.Module):
    """The test's model: twelve Linear + tanh layers, 64 wide, and a 10-way head."""

    def __init__(self, layers: int = 12, width: int = 64):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    bad = 0
    for run in range(args.runs):
        torch.manual_seed(0)
        captured = capture(Deep().train())
        costs = profile_graph(captured, (x,), loss_fn=lambda out: F.cross_entropy(out, y), grads_exist=False)
        plain = make_plan("none", captured.graph, costs)
        budget = int(costs.fixed_bytes + 0.6 * (plain.predicted_peak_bytes - costs.fixed_bytes))
        free = dataclasses.replace(costs, region_seconds=0.0, region_node_seconds=0.0)
        dear = dataclasses.replace(costs, region_seconds=plain.predicted_step_seconds, region_node_seconds=0.0)
        unpriced = make_plan("remat-ilp", captured.graph, free, budget)
        priced = make_plan("remat-ilp", captured.graph, dear, budget)
        if len(priced.regions) > len(unpriced.regions):
            bad += 1
            print(f"run {run}: priced {len(priced.regions)} regions, unpriced {len(unpriced.regions)}", flush=True)
    print(f"priced plan with more regions than the unpriced one: {bad} of {args.runs} runs")


if __name__ == "__main__":
    main()
