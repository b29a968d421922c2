"""Benchmark for issue 2: memfit vs chen vs checkpoint-all at activation budgets of 50% and 33% of plain.

Run:  OMP_WAIT_POLICY=PASSIVE python benchmarks/recompute_sweep.py --model resnet50 --batch 16 --image-size 128

Everything is measured in one process by the same harness (memfit.bench): plain PyTorch first, then each
strategy; the budget is fixed bytes + the given fraction of plain PyTorch's measured activation peak.
Prints one JSON line per row and a table; writes --out (JSON list).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from memfit import zoo  # noqa: E402
from memfit.api import plan as make_plan  # noqa: E402
from memfit.bench.harness import compare, fresh_copy, measure_training  # noqa: E402
from memfit.budget import fmt_bytes  # noqa: E402
from memfit.runtime.planned import PlannedModule  # noqa: E402
from memfit.solve.strategies import InfeasibleBudgetError  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--fractions", default="0.5,0.33")
    ap.add_argument("--strategies", default="chen,checkpoint-all,memfit")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = zoo.build_model(args.model).train()
    images, target = zoo.example_batch(args.model, args.batch, args.image_size)
    loss_fn = zoo.loss_for(args.model)
    base_model = fresh_copy(model)
    base = measure_training(base_model, base_model, (images,), target, loss_fn, args.steps)
    del base_model
    print(f"# {args.model} batch {args.batch} {args.image_size}px on {platform.processor() or platform.machine()}"
          f", {args.threads} thread(s), torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"# plain: peak {fmt_bytes(base.peak_bytes)}, fixed {fmt_bytes(base.fixed_bytes)}, activation "
          f"{fmt_bytes(base.activation_peak_bytes)}, step {base.step_seconds:.3f} s")
    rows = []
    for frac in [float(f) for f in args.fractions.split(",")]:
        budget = base.fixed_bytes + int(frac * base.activation_peak_bytes)
        for strategy in args.strategies.split(","):
            m = fresh_copy(model)
            opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
            try:
                plan, captured, _ = make_plan(m, (images,), budget, strategy=strategy, optimizer=opt)
            except InfeasibleBudgetError as exc:
                print(f"{frac} {strategy}: infeasible: {exc}")
                continue
            pm = PlannedModule(captured, plan)
            fig = measure_training(pm, pm, (images,), target, loss_fn, args.steps)
            row = {"model": args.model, "fraction": frac, "strategy": strategy, "budget_bytes": budget,
                   "activation_peak_bytes": fig.activation_peak_bytes, "peak_bytes": fig.peak_bytes,
                   "predicted_peak_bytes": plan.predicted_peak_bytes,
                   "activation_ratio": fig.activation_peak_bytes / base.activation_peak_bytes,
                   "overhead": fig.step_seconds / base.step_seconds, "step_seconds": fig.step_seconds,
                   "baseline_step_seconds": base.step_seconds, "solve_seconds": plan.solve_seconds,
                   "mip_gap": plan.mip_gap, "under_budget": fig.peak_bytes <= budget, **compare(base, fig)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n| budget (act. fraction) | strategy | activation peak | of plain | predicted err | overhead | "
          f"under budget | grads match |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        err = (r["predicted_peak_bytes"] - r["peak_bytes"]) / r["peak_bytes"]
        print(f"| {r['fraction']:.0%} | {r['strategy']} | {fmt_bytes(r['activation_peak_bytes'])} | "
              f"{r['activation_ratio']:.2f} | {err:+.1%} | {r['overhead']:.2f}x | {r['under_budget']} | "
              f"{r['gradients_match']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
