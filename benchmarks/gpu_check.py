"""GPU check for issues 3 and 4: run it through the device tool when a GPU is lent (it needs CUDA).

    PYTHONPATH=src python benchmarks/gpu_check.py --out $OUT

ResNet-50 at batch 184 and VGG-16 at batch 176, 224x224, float32, SGD with momentum, under the budgets of
MONeT's table (10, 8, 6 and 5 GB of total peak, parameters, gradients, momentum and the batch included).
Each model is measured with :func:`memfit.bench.sweep.sweep` (what ``memfit bench --device cuda`` runs):
plain PyTorch once, one profile (operator variants and the host link included), then every strategy --
``none``, ``memfit`` (recompute + operator variants + offloading to pinned host memory), ``remat-ilp``
(recompute only), ``chen``, ``vdnn-conv``, ``vdnn-all``, ``checkpoint-all`` -- solved, trained and timed
side by side with plain PyTorch. Each row holds:

* ``planned.peak_bytes``: the step's total peak, i.e. ``torch.cuda.max_memory_allocated`` over the step
  (the allocator's peak counter is reset before it) plus what was live before it; ``predicted_peak_bytes``
  is the plan's;
* ``planned.host_peak_bytes``: the most bytes the pinned host store held at once;
* ``overhead``: median step time over plain PyTorch's, the two timed in alternation (synchronized
  wall clock);
* ``gradients_match`` (absolute 1e-5) and ``max_rel_grad_diff`` (relative to the largest plain gradient)
  after a step from the same weights; BatchNorm statistics in ``bn_stats_match``.

The budgets in GB become fractions of plain PyTorch's activation peak (``(GB - fixed) / activation
peak``), measured first. cuDNN runs in deterministic mode (``--cudnn deterministic``, so that recomputation
reproduces the same values) unless ``--cudnn default`` (PyTorch's default heuristics) or ``benchmark`` is given;
the algorithm choice changes the convolutions' workspace, which the profile measures. A short smoke run (ResNet-18, batch 8, 64 px, at 50% and 30% of its
activation peak) goes first unless ``--no-smoke``; ``--device cpu`` only tries the script itself. Every row is appended to ``<out>/gpu_check.jsonl`` as soon as it is measured, and each model
stops starting new rows after ``--model-seconds``, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import traceback
from pathlib import Path

import torch

from memfit.bench.job import measure_plain
from memfit.bench.sweep import sweep, zoo_workload


class OutOfTime(Exception):
    """The model's share of the run is spent."""


def short(row: dict) -> str:
    """One line per row: strategy, budget, measured and predicted peak (GB), overhead, gradients."""
    gb = 1e9
    budget = "-" if row.get("budget_bytes") is None else f"{row['budget_bytes'] / gb:.2f}"
    head = f"{row['model']:9s} {row['strategy']:14s} budget {budget:>5s} GB"
    if row.get("error"):
        return f"{head}  ERROR {row['error'].splitlines()[0][:160]}"
    p = row["planned"]
    pred = "-" if p.get("predicted_peak_bytes") is None else f"{p['predicted_peak_bytes'] / gb:.2f}"
    host = p.get("host_peak_bytes") or 0
    return (f"{head}  peak {p['peak_bytes'] / gb:.2f} (pred {pred}) host {host / gb:.2f}  "
            f"{p['step_seconds'] * 1e3:.0f} ms x{row['overhead']:.2f}  under {row['under_budget']}  "
            f"grads {row['gradients_match']} rel {row['max_rel_grad_diff']:.1e} bn {row['bn_stats_match']}  "
            f"solve {row['solve_seconds'] or 0:.1f}s {json.dumps(row.get('decisions'))}")


def run_model(name: str, batch: int, image_size: int, budgets_gb: list[float] | None, strategies: list[str],
              steps: int, time_limit: float, seconds: float, out: Path, device: str = "cuda") -> None:
    """Sweep one zoo model, appending rows to ``out / gpu_check.jsonl``; ``budgets_gb=None`` runs at 50% and
    30% of plain PyTorch's activation peak instead."""
    t0 = time.perf_counter()
    work = zoo_workload(name, batch, image_size, device=device)
    base = measure_plain(work.model, work.inputs, work.target, work.loss_fn)
    fractions = ([0.5, 0.3] if budgets_gb is None
                 else [(gb * 1e9 - base.fixed_bytes) / base.activation_peak_bytes for gb in budgets_gb])
    print(f"{name} b{batch} {image_size}px: plain peak {base.peak_bytes / 1e9:.2f} GB, fixed "
          f"{base.fixed_bytes / 1e9:.2f} GB, activations {base.activation_peak_bytes / 1e9:.2f} GB, step "
          f"{base.step_seconds * 1e3:.0f} ms; budgets as activation fractions "
          + ", ".join(f"{f:.3f}" for f in fractions), flush=True)

    def progress(what: str, done: int, total: int) -> None:
        elapsed = time.perf_counter() - t0
        print(f"  [{elapsed:5.0f} s] {what}", flush=True)
        if elapsed > seconds and done < total:
            raise OutOfTime(f"{name}: stopped after {elapsed:.0f} s, before '{what}'")

    def on_row(row: dict) -> None:
        row["budget_gb"] = None if row.get("budget_bytes") is None else round(row["budget_bytes"] / 1e9, 3)
        row["gpu"] = torch.cuda.get_device_name() if device == "cuda" else platform.processor()
        with open(out / "gpu_check.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print("  " + short(row), flush=True)

    sweep(work, fractions, strategies, steps=steps, time_limit=time_limit, progress=progress, on_row=on_row)
    print(f"{name}: done in {time.perf_counter() - t0:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50:184,vgg16:176", help="name:batch,...")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--budgets-gb", default="10,8,6,5")
    ap.add_argument("--strategies", default="none,memfit,remat-ilp,chen,vdnn-conv,vdnn-all,checkpoint-all")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row")
    ap.add_argument("--time-limit", type=float, default=10.0, help="solver time limit per plan (s)")
    ap.add_argument("--model-seconds", type=float, default=200.0,
                    help="start no new row of a model after this many seconds")
    ap.add_argument("--cudnn", choices=("deterministic", "default", "benchmark"), default="deterministic",
                    help="cuDNN's algorithm choice: deterministic (recomputation reproduces the same values), "
                         "PyTorch's default heuristics, or benchmark (timed search)")
    ap.add_argument("--no-smoke", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to try the script itself")
    ap.add_argument("--out", default=".", help="folder for gpu_check.jsonl")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA device")
    torch.backends.cudnn.benchmark = args.cudnn == "benchmark"
    torch.backends.cudnn.deterministic = args.cudnn == "deterministic"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {gpu}, python {platform.python_version()}, "
          f"cudnn {args.cudnn}", flush=True)
    strategies = args.strategies.split(",")
    budgets = [float(g) for g in args.budgets_gb.split(",")]
    jobs = [] if args.no_smoke else [("resnet18", 8, 64, None, 60.0)]
    for spec in args.models.split(","):
        name, batch = spec.split(":")
        jobs.append((name, int(batch), args.image_size, budgets, args.model_seconds))
    t_start = time.perf_counter()
    for name, batch, size, gbs, seconds in jobs:
        try:
            run_model(name, batch, size, gbs, strategies, args.steps, args.time_limit, seconds, out, args.device)
        except OutOfTime as exc:
            print(exc, flush=True)
        except Exception:  # noqa: BLE001 -- keep going: the next model may still run
            traceback.print_exc()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(f"all done in {time.perf_counter() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
