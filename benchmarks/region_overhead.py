"""Time each checkpoint region costs beyond the work it recomputes: a chain of ``--layers`` tiny
Conv2d(8, 8, 1) (+ BatchNorm2d with ``--batchnorm``) + tanh layers, timed round-robin as plain PyTorch, one
region over everything, one region per layer, and PyTorch's own non-reentrant ``torch.utils.checkpoint`` per
layer. ``(each - one) / layers`` is memfit's per-region cost; ``(raw - none) / layers`` PyTorch's own.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/region_overhead.py [--batchnorm] [--rounds 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import memfit
from memfit.graph import capture
from memfit.graph.calls import compute_nodes
from memfit.solve.plan import Plan


class Chain(nn.Module):
    def __init__(self, layers: int, batchnorm: bool):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(8, 8, 1) for _ in range(layers)])
        self.norms = nn.ModuleList([nn.BatchNorm2d(8) if batchnorm else nn.Identity() for _ in range(layers)])

    def forward(self, x):
        for conv, norm in zip(self.convs, self.norms):
            x = torch.tanh(norm(conv(x)))
        return x


class RawCheckpoint(nn.Module):
    """The same chain with ``torch.utils.checkpoint`` around each layer."""

    def __init__(self, chain: Chain):
        super().__init__()
        self.chain = chain

    def forward(self, x):
        for conv, norm in zip(self.chain.convs, self.chain.norms):
            x = checkpoint(lambda v, c=conv, n=norm: torch.tanh(n(c(v))), x, use_reentrant=False)
        return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--batchnorm", action="store_true")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    chain = Chain(args.layers, args.batchnorm).train()
    x = torch.randn(2, 8, 4, 4)
    names = [n.name for n in compute_nodes(capture(chain).gm)]
    per = len(names) // args.layers
    regions = {"none": [], "one": [[names[0], names[-1]]],
               "each": [[names[i * per], names[i * per + per - 1]] for i in range(args.layers)]}
    setups = {k: memfit.PlannedModule(capture(chain), Plan(strategy="test", nodes=names, regions=r))
              for k, r in regions.items()}
    setups["raw"] = RawCheckpoint(chain)

    def step(module):
        chain.zero_grad(set_to_none=True)
        module(x).sum().backward()

    times: dict[str, list[float]] = {k: [] for k in setups}
    for module in setups.values():
        step(module)
        step(module)
    for _ in range(args.rounds):
        for k, module in setups.items():
            t = time.perf_counter()
            step(module)
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.layers} layers{' with BatchNorm' if args.batchnorm else ''}, torch {torch.__version__}, "
          f"median of {args.rounds} round-robin steps")
    for k, v in med.items():
        print(f"  {k:5s} {v * 1e3:8.3f} ms")
    print(f"  memfit per region (each - one) / layers: {(med['each'] - med['one']) / args.layers * 1e3:.3f} ms")
    print(f"  torch.utils.checkpoint per layer (raw - none) / layers: "
          f"{(med['raw'] - med['none']) / args.layers * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
