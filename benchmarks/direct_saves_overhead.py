"""The step time of a plan's regions with and without ``DirectSaves`` (parameters and inputs saved as themselves).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/direct_saves_overhead.py resnet50:8:128 --budget 33 --rounds 11

Solves ``memfit`` at ``--budget`` percent of plain PyTorch's activation peak over the graphs :func:`memfit.plan`
solves (``_spec.solve_as_planned``, as ``overhead_split.py``), then times plain PyTorch and the planned module twice, round-robin
(:func:`memfit.bench.harness.interleaved_step_seconds`, one intra-op thread): once as it runs
(``memfit.runtime.direct_saves.DirectSaves`` wraps the checkpoint's saved-tensor hooks in every region) and once
with that wrapper replaced by a no-op (every saved tensor through the checkpoint, as before it). Prints the medians
and their ratios; ``DirectSaves`` costs a Python call and a set lookup per tensor saved in a region.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from _spec import memfit_options, profile_once, solve_as_planned, zoo_setup
from torch import nn

import memfit
import memfit.runtime.planned as planned_module
from memfit.bench.harness import fresh_copy, interleaved_step_seconds
from memfit.graph import capture
from memfit.solve.strategies import make_plan


class _Toggled(nn.Module):
    """Runs ``planned`` with ``DirectSaves`` as given; it stays so through the backward pass that follows (the
    timing loop runs each setup's forward and backward before the next setup's)."""

    def __init__(self, planned: nn.Module, direct):
        super().__init__()
        self.planned = planned
        self.direct = direct

    def forward(self, *args):
        planned_module.DirectSaves = self.direct
        return self.planned(*args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="model:batch:image-size, e.g. resnet50:8:128")
    ap.add_argument("--budget", type=float, default=33.0, help="activation budget, percent of plain PyTorch's")
    ap.add_argument("--rounds", type=int, default=11, help="timed steps per setup, round-robin")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, x, y, loss = zoo_setup(args.spec)
    print(f"{args.spec} @ {args.budget}%, {platform.processor() or platform.machine()}, 1 thread, torch "
          f"{torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    on = planned_module.DirectSaves
    captured, costs = profile_once(model, x, y, loss)
    fixed = costs.fixed_bytes
    act = make_plan("none", captured.graph, costs).predicted_peak_bytes - fixed
    options, rounding = memfit_options(model, x, y, loss, captured, costs)
    plan, _ = solve_as_planned("memfit", options, rounding, int(fixed + args.budget / 100 * act), 20.0)
    planned = memfit.PlannedModule(capture(fresh_copy(model)), plan)
    print(f"plan: {len(plan.regions)} regions, variants {plan.counts()['variants']}", flush=True)
    # (one planned module serves both timed setups: the wrapper decides per step)
    setups = [(plain := fresh_copy(model), plain),
              (_Toggled(planned, on), planned),
              (_Toggled(planned, lambda *_: contextlib.nullcontext()), planned)]
    try:
        seconds = interleaved_step_seconds(setups, (x,), y, loss, rounds=args.rounds)
    finally:
        planned_module.DirectSaves = on
    plain_s, with_s, without_s = seconds
    print("| setup | median step (s) | over plain PyTorch |")
    print("|---|---|---|")
    print(f"| plain PyTorch | {plain_s:.4f} | 1.000x |")
    print(f"| planned, DirectSaves | {with_s:.4f} | {with_s / plain_s:.3f}x |")
    print(f"| planned, no DirectSaves | {without_s:.4f} | {without_s / plain_s:.3f}x |")
    print(f"DirectSaves / none: {with_s / without_s:.4f}")


if __name__ == "__main__":
    main()
