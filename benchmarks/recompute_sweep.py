"""Benchmark for issue 2: plain PyTorch vs chen, checkpoint-all and memfit at several activation budgets.

Run:  OMP_WAIT_POLICY=PASSIVE python benchmarks/recompute_sweep.py --model resnet50 --batch 16 --image-size 128

Everything is measured in one process by the same harness (memfit.bench): memory with the exact tracker,
gradients against plain PyTorch, and step times interleaved with plain PyTorch's (ratio of medians).
The budget is fixed bytes + the given fraction of plain PyTorch's measured activation peak.
Prints one JSON line per row and a markdown table; writes --out (JSON list).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from memfit import zoo
from memfit.bench.job import measure_plain, measure_strategy
from memfit.budget import fmt_bytes
from memfit.solve.strategies import InfeasibleBudgetError


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--image-size", type=int, default=None)
    ap.add_argument("--fractions", default="0.7,0.5,0.4,0.33")
    ap.add_argument("--strategies", default="chen,checkpoint-all,memfit")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batch, size = zoo.default_size(args.model)
    batch, size = args.batch or batch, args.image_size or size
    model = zoo.build_model(args.model).train()
    images, target = zoo.example_batch(args.model, batch, size)
    loss_fn = zoo.loss_for(args.model)
    base = measure_plain(model, (images,), target, loss_fn)
    print(f"# {args.model} batch {batch} {size}px, {platform.machine()}, {args.threads} thread(s), "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"# plain: peak {fmt_bytes(base.peak_bytes)}, fixed {fmt_bytes(base.fixed_bytes)}, activation "
          f"{fmt_bytes(base.activation_peak_bytes)}")
    rows = []
    for frac in [float(f) for f in args.fractions.split(",")]:
        budget = base.fixed_bytes + int(frac * base.activation_peak_bytes)
        for strategy in args.strategies.split(","):
            try:
                r = measure_strategy(model, (images,), target, loss_fn, base, strategy, budget, args.steps)
            except InfeasibleBudgetError as exc:
                r = {"strategy": strategy, "infeasible": str(exc),
                     "smallest_feasible_bytes": exc.smallest_feasible_bytes}
            r.update(model=args.model, fraction=frac, budget_bytes=budget)
            rows.append(r)
            print(json.dumps(r), flush=True)
    print("\n| act. budget | strategy | activation peak | of plain | under budget | predicted err | overhead "
          "| predicted overhead | solve s | grads, BN match |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "infeasible" in r:
            low = (r["smallest_feasible_bytes"] - base.fixed_bytes) / base.activation_peak_bytes
            print(f"| {r['fraction']:.0%} | {r['strategy']} | infeasible (smallest feasible: {low:.1%} of plain "
                  f"activation) | | | | | | | |")
            continue
        p = r["planned"]
        err = (p["predicted_peak_bytes"] - p["peak_bytes"]) / p["peak_bytes"]
        pred_over = p["predicted_step_seconds"] / r["baseline"]["predicted_step_seconds"]
        print(f"| {r['fraction']:.0%} | {r['strategy']} | {fmt_bytes(p['activation_peak_bytes'])} | "
              f"{p['activation_peak_bytes'] / base.activation_peak_bytes:.2f} | "
              f"{p['peak_bytes'] <= r['budget_bytes']} | {err:+.2%} | {r['overhead']:.2f}x | {pred_over:.2f}x | "
              f"{r['solve_seconds']:.1f} | {r['gradients_match'] and r['bn_stats_match']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
