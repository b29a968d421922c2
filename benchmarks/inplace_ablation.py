"""Benchmark for issue 3: what the planner's in-place forms (memfit.variants.inplace) buy, as an ablation.

Run:  OMP_WAIT_POLICY=PASSIVE python benchmarks/inplace_ablation.py --model resnet50 --batch 16 --image-size 128
      add --relu-out-of-place to rebuild every nn.ReLU with inplace=False (a model written out of place)

One profile of the model (with every operator variant), then the same planner twice: with the in-place
forms offered, and with them removed from the profile (every other variant still offered). For each:

* the smallest feasible budget (the planner's floor), and a plan solved at it, measured: peak with the exact
  tracker, gradients and BatchNorm statistics against plain PyTorch;
* at the ablation's floor (the lowest budget both can meet), step times of both plans interleaved with
  plain PyTorch's (ratio of medians, ``--rounds``).

No offloading (CPU, no store): recomputation and operator variants only. Prints JSON lines and a markdown
table; writes --out (JSON).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from torch import nn

import memfit
from memfit import zoo
from memfit.api import optimizer_state_bytes
from memfit.bench.harness import compare, fresh_copy, interleaved_step_seconds, measure_training
from memfit.budget import fmt_bytes
from memfit.graph import capture
from memfit.profile import profile_graph
from memfit.solve.strategies import make_plan, smallest_feasible
from memfit.variants import INPLACE_VARIANTS


def _without_inplace(costs):
    out = copy.deepcopy(costs)
    for c in out.nodes:
        c.variants = {k: v for k, v in c.variants.items() if k not in INPLACE_VARIANTS}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--relu-out-of-place", action="store_true",
                    help="set inplace=False on every nn.ReLU (as models written with F.relu / x.relu() are)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = zoo.build_model(args.model).train()
    if args.relu_out_of_place:
        for mod in model.modules():
            if isinstance(mod, nn.ReLU):
                mod.inplace = False
    images, target = zoo.example_batch(args.model, args.batch, args.image_size)
    loss_fn = zoo.loss_for(args.model)
    label = args.model + (" (ReLUs out of place)" if args.relu_out_of_place else "")
    plain_model = fresh_copy(model)
    base = measure_training(plain_model, plain_model, (images,), target, loss_fn, steps=1)
    m = fresh_copy(model)
    initial = copy.deepcopy(m.state_dict())
    t0 = time.perf_counter()
    captured = capture(m)
    costs = profile_graph(captured, (images,), loss_fn=lambda out: loss_fn(out, target))
    profile_s = time.perf_counter() - t0
    fixed = costs.fixed_bytes + optimizer_state_bytes(torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                                                      list(m.parameters()))
    offered: dict[str, int] = {}
    for c in costs.nodes:
        for k in c.variants:
            if k in INPLACE_VARIANTS:
                offered[k] = offered.get(k, 0) + 1
    ablated = _without_inplace(costs)
    act = base.peak_bytes - fixed
    floors = {
        "with in-place forms": smallest_feasible(captured.graph, costs, fixed, args.time_limit, use_offload=False),
        "without in-place forms": smallest_feasible(captured.graph, ablated, fixed, args.time_limit,
                                                    use_offload=False),
    }
    profiles = {"with in-place forms": costs, "without in-place forms": ablated}

    def run(plan):
        m.load_state_dict(initial)
        for p in m.parameters():
            p.grad = None
        planned = memfit.PlannedModule(captured, plan)
        fig = measure_training(planned, planned, (images,), target, loss_fn, steps=1)
        return planned, fig

    rows = []
    for key, floor in floors.items():
        plan = make_plan("memfit", captured.graph, profiles[key], floor, fixed_bytes=fixed,
                         time_limit=args.time_limit)
        _, fig = run(plan)
        check = compare(base, fig)
        used = {}
        for v in plan.variants.values():
            if v != "default":
                used[v] = used.get(v, 0) + 1
        rows.append({"model": label, "planner": key, "budget": "its floor", "budget_bytes": floor,
                     "activation_budget_pct": round(100 * (floor - fixed) / act, 1),
                     "predicted_peak_bytes": plan.predicted_peak_bytes, "measured_peak_bytes": fig.peak_bytes,
                     "activation_pct": round(100 * (fig.peak_bytes - fixed) / act, 1),
                     "under_budget": fig.peak_bytes <= floor, "gradients_match": check["gradients_match"],
                     "bn_stats_match": check["bn_stats_match"], "variants": used,
                     "recomputed_nodes": sum(d == "recompute" for d in plan.decisions.values())})
        print(json.dumps(rows[-1]), flush=True)
    # the same budget for both: the ablation's floor; step times interleaved with plain PyTorch's
    budget = floors["without in-place forms"]
    setups, plans = [], {}
    for key in floors:
        plans[key] = make_plan("memfit", captured.graph, profiles[key], budget, fixed_bytes=fixed,
                               time_limit=args.time_limit)
    timing_model = fresh_copy(model)
    setups.append((timing_model, timing_model))
    for key, plan in plans.items():
        mm = fresh_copy(model)
        cap = capture(mm)
        planned = memfit.PlannedModule(cap, plan)
        setups.append((planned, planned))
    secs = interleaved_step_seconds(setups, (images,), target, loss_fn, rounds=args.rounds)
    for key, plan, s in zip(plans, plans.values(), secs[1:]):
        _, fig = run(plan)
        check = compare(base, fig)
        rows.append({"model": label, "planner": key, "budget": "ablation's floor", "budget_bytes": budget,
                     "activation_budget_pct": round(100 * (budget - fixed) / act, 1),
                     "predicted_peak_bytes": plan.predicted_peak_bytes, "measured_peak_bytes": fig.peak_bytes,
                     "activation_pct": round(100 * (fig.peak_bytes - fixed) / act, 1),
                     "under_budget": fig.peak_bytes <= budget, "gradients_match": check["gradients_match"],
                     "bn_stats_match": check["bn_stats_match"], "overhead": round(s / secs[0], 3),
                     "plain_step_seconds": round(secs[0], 4), "step_seconds": round(s, 4),
                     "predicted_step_seconds": plan.predicted_step_seconds,
                     "recomputed_nodes": sum(d == "recompute" for d in plan.decisions.values())})
        print(json.dumps(rows[-1]), flush=True)
    meta = {"model": label, "batch": args.batch, "image_size": args.image_size, "threads": args.threads,
            "plain_peak_bytes": base.peak_bytes, "fixed_bytes": fixed, "plain_activation_bytes": act,
            "inplace_forms_offered": offered, "profile_seconds": round(profile_s, 1),
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}
    print(f"\n{label}, batch {args.batch}, {args.image_size} px: plain activation peak {fmt_bytes(act)}; "
          f"in-place forms offered: {offered}\n")
    print("| planner | budget | activation budget | measured activation peak | overhead | gradients | variants |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['planner']} | {r['budget']} | {r['activation_budget_pct']}% | {r['activation_pct']}% "
              f"({fmt_bytes(r['measured_peak_bytes'] - fixed)}) | {r.get('overhead', '')} | "
              f"{'equal' if r['gradients_match'] and r['bn_stats_match'] else 'DIFFER'} | "
              f"{r.get('variants', '')} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
