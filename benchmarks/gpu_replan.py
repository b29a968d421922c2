"""Plans solved here from a GPU profile, measured on the GPU: device time goes to measuring, not solving.

    # on any machine: solve from the costs that gpu_profile_dump.py saved on the GPU
    PYTHONPATH=src python benchmarks/gpu_replan.py solve --costs costs_resnet50_synchronized.json.gz \\
        --budgets-gb 10,8,6,5 --strategies memfit,remat-ilp --time-limit 60 --out benchmarks/results/gpu_plans
    # on the GPU: train with each plan beside plain PyTorch and report
    PYTHONPATH=src python benchmarks/gpu_replan.py measure --plans benchmarks/results/gpu_plans --out $OUT

This is the ``memfit plan`` / ``memfit train --plan`` split: the planner needs only the profile (graph and
costs), so the integer programs can run with long time limits on a machine without a GPU while the lease
measures. ``solve`` writes ``<model>_<strategy>_<GB>GB.json`` (the plan, :meth:`memfit.solve.plan.Plan.save`)
and ``<model>_setup.json`` (batch, image size). ``measure`` builds the zoo model on CUDA with the same seed,
checks that its traced graph is the plan's, and for each plan measures, as ``memfit bench`` does
(:func:`memfit.bench.sweep._measure_plan`): total peak (``torch.cuda.max_memory_allocated`` over the step plus
what was live before it), gradients and BatchNorm statistics against plain PyTorch, and the median step time
interleaved with plain PyTorch's. Offloading plans use a pinned host store. Rows go to
``<out>/gpu_replan.jsonl``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import torch

from memfit import zoo
from memfit.api import offload_store
from memfit.bench.job import measure_plain
from memfit.bench.sweep import RUNTIME_GRAD_TOLERANCE, _fill, _measure_plan, _row, zoo_workload
from memfit.graph.capture import capture
from memfit.profile.costs import Costs
from memfit.solve.plan import Plan
from memfit.solve.strategies import InfeasibleBudgetError, make_plan


def solve(args) -> None:
    with gzip.open(args.costs, "rt") as f:
        data = json.load(f)
    costs = Costs.from_dict(data["costs"])
    name = data["model"]
    captured = capture(zoo.build_model(name).train())
    if [n.name for n in captured.graph.nodes] != [c.name for c in costs.nodes]:
        raise SystemExit(f"{name}: the graph traced here is not the profiled one (other torchvision version?)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}_setup.json").write_text(json.dumps(
        {k: data[k] for k in ("model", "batch", "image_size", "device", "torch", "fixed_bytes",
                              "plain_peak_bytes", "plain_step_seconds", "predicted_plain_step_seconds")}))
    for gb in [float(g) for g in args.budgets_gb.split(",")]:
        for strategy in args.strategies.split(","):
            t0 = time.perf_counter()
            try:
                plan = make_plan(strategy, captured.graph, costs, int(gb * 1e9), fixed_bytes=data["fixed_bytes"],
                                 time_limit=args.time_limit)
            except InfeasibleBudgetError as exc:
                print(f"{name} {strategy} {gb:g} GB: {exc}", flush=True)
                continue
            plan.input_shapes = [[data["batch"], 3, data["image_size"], data["image_size"]]]
            plan.save(out / f"{name}_{strategy}_{gb:g}GB.json")
            print(f"{name} {strategy} {gb:g} GB: predicted {plan.predicted_peak_bytes / 1e9:.2f} GB, "
                  f"x{plan.predicted_step_seconds / data['predicted_plain_step_seconds']:.3f}, gap {plan.mip_gap}, "
                  f"{plan.counts()}, {time.perf_counter() - t0:.0f} s", flush=True)


def measure(args) -> None:
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True  # as when the costs were profiled (gpu_profile_dump.py)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for setup_file in sorted(Path(args.plans).glob("*_setup.json")):
        setup = json.loads(setup_file.read_text())
        name = setup["model"]
        work = zoo_workload(name, setup["batch"], setup["image_size"], device=args.device)
        baseline = measure_plain(work.model, work.inputs, work.target, work.loss_fn)
        names = [n.name for n in capture(work.model).graph.nodes]
        store = offload_store(work.inputs, "memfit", True, None)
        print(f"{name}: plain peak {baseline.peak_bytes / 1e9:.2f} GB, step {baseline.step_seconds * 1e3:.1f} ms",
              flush=True)
        for plan_file in sorted(Path(args.plans).glob(f"{name}_*GB.json")):
            plan = Plan.load(plan_file)
            if plan.nodes != names:
                print(f"{plan_file.name}: not this graph", flush=True)
                continue
            row = _row(work, baseline, plan.strategy, "eager", None, plan.budget_bytes)
            row["plan_file"] = plan_file.name
            use_store = store if plan.offloads else None
            try:
                figures, plain_s, planned_s, host_peak = _measure_plan(work, baseline, plan, args.steps, 0, use_store)
                _fill(row, figures, baseline, plain_s, planned_s, RUNTIME_GRAD_TOLERANCE, plan.predicted_peak_bytes,
                      plan.fixed_bytes, plan.predicted_step_seconds, host_peak)
                row.update(solve_seconds=plan.solve_seconds, mip_gap=plan.mip_gap, decisions=plan.counts())
                p = row["planned"]
                print(f"  {plan_file.name}: peak {p['peak_bytes'] / 1e9:.2f} GB (pred "
                      f"{p['predicted_peak_bytes'] / 1e9:.2f}) host {host_peak / 1e9:.2f} GB, "
                      f"{planned_s * 1e3:.1f} ms vs {plain_s * 1e3:.1f} ms: x{row['overhead']:.3f}, under "
                      f"{row['under_budget']}, grads {row['gradients_match']} (rel {row['max_rel_grad_diff']:.1e}), "
                      f"bn {row['bn_stats_match']}", flush=True)
            except torch.cuda.OutOfMemoryError as exc:
                row["error"] = "out of memory: " + str(exc).splitlines()[0]
                print(f"  {plan_file.name}: {row['error']}", flush=True)
            row["gpu"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
            with open(out / "gpu_replan.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            if args.device == "cuda":
                torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("solve")
    p.add_argument("--costs", required=True)
    p.add_argument("--budgets-gb", default="10,8,6,5")
    p.add_argument("--strategies", default="memfit,remat-ilp")
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--out", required=True)
    p = sub.add_parser("measure")
    p.add_argument("--plans", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the script itself")
    p.add_argument("--out", default=".")
    args = ap.parse_args()
    solve(args) if args.command == "solve" else measure(args)


if __name__ == "__main__":
    main()
