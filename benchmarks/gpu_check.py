"""GPU check for issues 2-3 (run it through the device tool when a GPU is lent; it needs CUDA).

    python benchmarks/gpu_check.py --out $OUT/gpu.json

ResNet-50 at batch 184 and VGG-16 at batch 176, 224x224, float32, under the budgets of MONeT's table
(10, 8, 6, 5 GB total peak): for each strategy (none, chen, checkpoint-all, remat-ilp, memfit) it reports
``torch.cuda.max_memory_allocated`` for one training step (SGD with momentum) and the median step time
measured with CUDA events, and whether gradients match plain PyTorch. Rows that do not fit are recorded
with the error (out of memory, or memfit's InfeasibleBudgetError naming the smallest feasible budget).
Keep the whole run under about 8 minutes: pass --models / --budgets to shorten it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from memfit import zoo
from memfit.api import plan as make_plan
from memfit.bench.harness import compare, fresh_copy, measure_training
from memfit.runtime.planned import PlannedModule
from memfit.solve.strategies import InfeasibleBudgetError


def cuda_step_seconds(module, inputs, target, loss_fn, steps: int) -> float:
    """Median step time (seconds) with CUDA events."""
    opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    times = []
    for k in range(steps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.zero_grad(set_to_none=False)
        loss_fn(module(*inputs), target).backward()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        if k:
            times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet50:184,vgg16:176")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--budgets-gb", default="10,8,6,5")
    ap.add_argument("--strategies", default="none,chen,checkpoint-all,remat-ilp,memfit")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="gpu_check.json")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this check needs a CUDA device"
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    rows = []
    t_start = time.time()
    for spec in args.models.split(","):
        name, batch = spec.split(":")
        batch = int(batch)
        model = zoo.build_model(name, num_classes=1000).to(dev).train()
        images, target = zoo.example_batch(name, batch, args.image_size, num_classes=1000, device=dev)
        loss_fn = zoo.loss_for(name)
        try:
            base_model = fresh_copy(model)
            base = measure_training(base_model, base_model, (images,), target, loss_fn, steps=1)
            base_s = cuda_step_seconds(base_model, (images,), target, loss_fn, args.steps)
            del base_model
        except torch.cuda.OutOfMemoryError as exc:
            base, base_s = None, None
            print(f"{name}: plain PyTorch does not fit: {exc}".splitlines()[0])
        torch.cuda.empty_cache()
        for gb in [float(g) for g in args.budgets_gb.split(",")]:
            budget = int(gb * 10**9)
            for strategy in args.strategies.split(","):
                row = {"model": name, "batch": batch, "budget_bytes": budget, "strategy": strategy,
                       "plain_peak_bytes": base and base.peak_bytes, "plain_step_seconds": base_s}
                try:
                    m = fresh_copy(model)
                    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
                    plan, captured, _ = make_plan(m, (images,), budget, strategy=strategy, optimizer=opt)
                    pm = PlannedModule(captured, plan)
                    fig = measure_training(pm, pm, (images,), target, loss_fn, steps=1)
                    row.update(peak_bytes=fig.peak_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
                               under_budget=fig.peak_bytes <= budget,
                               step_seconds=cuda_step_seconds(pm, (images,), target, loss_fn, args.steps),
                               decisions=plan.counts(), solve_seconds=plan.solve_seconds)
                    if base is not None:
                        row.update(compare(base, fig))
                        row["overhead"] = row["step_seconds"] / base_s
                    del pm, captured, m
                except InfeasibleBudgetError as exc:
                    row["error"] = str(exc)
                except torch.cuda.OutOfMemoryError as exc:
                    row["error"] = "out of memory: " + str(exc).splitlines()[0]
                torch.cuda.empty_cache()
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)
    print(f"done in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
