"""The ``memfit`` command line: ``run``, ``plan`` and ``train`` (argparse + rich)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported: no busy-waiting threads

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from memfit.budget import fmt_bytes


def _common(p: argparse.ArgumentParser) -> None:
    from memfit import zoo
    from memfit.solve.strategies import STRATEGIES

    p.add_argument("--model", default="resnet18", choices=zoo.MODELS, help="model from the zoo")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: the model's CPU default)")
    p.add_argument("--image-size", type=int, default=None, help="image side in pixels")
    p.add_argument("--budget", default="min", help="total peak budget: '2GiB', '512MB', bytes, '40%%' of "
                   "the plain PyTorch total peak (fixed bytes included), or 'min' for the least memory memfit "
                   "can reach (default)")
    p.add_argument("--strategy", default="memfit", choices=STRATEGIES)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--time-limit", type=float, default=20.0, help="solver time limit, seconds")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--seed", type=int, default=0)


def _sizes(args) -> tuple[int, int]:
    from memfit import zoo

    batch, size = zoo.default_size(args.model)
    return args.batch or batch, args.image_size or size


def _report_table(r: dict) -> Table:
    t = Table(title=f"memfit run: {r['model']} batch {r['batch_size']} input {r['input_shape']} "
              f"on {r['device']}, strategy {r['strategy']}, budget {fmt_bytes(r['budget_bytes'])}")
    t.add_column("")
    t.add_column("plain PyTorch", justify="right")
    t.add_column("planned", justify="right")
    t.add_column("predicted", justify="right")
    b, p = r["baseline"], r["planned"]
    t.add_row("total peak", fmt_bytes(b["peak_bytes"]), fmt_bytes(p["peak_bytes"]),
              fmt_bytes(p["predicted_peak_bytes"]))
    t.add_row("fixed", fmt_bytes(b["fixed_bytes"]), fmt_bytes(b["fixed_bytes"]), "")
    t.add_row("activation peak", fmt_bytes(b["activation_peak_bytes"]), fmt_bytes(p["activation_peak_bytes"]),
              fmt_bytes(p["predicted_peak_bytes"] - b["fixed_bytes"]))
    t.add_row("step time", f"{b['step_seconds']:.3f} s", f"{p['step_seconds']:.3f} s",
              f"{p['predicted_step_seconds']:.3f} s")
    t.add_row("overhead", "1.00x", f"{r['overhead']:.2f}x", "")
    d = r["decisions"]
    t.add_row("decisions", "", f"keep {d['keep']} / recompute {d['recompute']} / offload {d['offload']}", "")
    gap = "-" if r["mip_gap"] is None else f"{r['mip_gap']:.3f}"
    t.add_row("solve", "", f"{r['solve_seconds']:.2f} s (gap {gap})", "")
    ok = "[green]match[/]" if r["gradients_match"] else "[red]DIFFER[/]"
    t.add_row("gradients", "", f"{ok} (max abs diff {r['max_abs_grad_diff']:.2e})", "")
    t.add_row("BatchNorm statistics", "", "[green]match[/]" if r["bn_stats_match"] else "[red]DIFFER[/]", "")
    return t


def cmd_run(args) -> int:
    from memfit.bench.job import run_job

    batch, size = _sizes(args)
    console = Console()
    with console.status(f"measuring plain PyTorch, profiling and solving {args.model} ..."):
        report = run_job(args.model, batch, size, args.budget, args.strategy, args.steps, args.device,
                         args.time_limit, args.seed)
    console.print(_report_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        console.print(f"wrote {args.json}")
    return 0 if report["gradients_match"] and report["bn_stats_match"] else 1


def cmd_plan(args) -> int:
    import torch

    from memfit import zoo
    from memfit.api import plan

    batch, size = _sizes(args)
    model = zoo.build_model(args.model, seed=args.seed).to(args.device).train()
    images, _ = zoo.example_batch(args.model, batch, size, device=args.device, seed=args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    result, _, _ = plan(model, (images,), args.budget, strategy=args.strategy, optimizer=opt,
                        time_limit=args.time_limit)
    result.save(args.out)
    c = result.counts()
    Console().print(f"{args.model} batch {batch} {size}x{size}: predicted peak "
                    f"{fmt_bytes(result.predicted_peak_bytes)} (fixed {fmt_bytes(result.fixed_bytes)}), "
                    f"step {result.predicted_step_seconds:.3f} s; keep {c['keep']}, recompute {c['recompute']};"
                    f" {len(result.regions)} checkpoint regions; wrote {args.out}")
    return 0


def cmd_train(args) -> int:
    from memfit.train import train_side_by_side

    return train_side_by_side(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``memfit`` command."""
    parser = argparse.ArgumentParser(prog="memfit", description="Fit deep-network training into a memory "
                                     "budget (recompute activations where it costs least).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="measure plain PyTorch, solve, train with the plan, compare")
    _common(p)
    p.add_argument("--steps", type=int, default=5, help="timed steps per setup (interleaved with plain)")
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("plan", help="solve only and save the plan as JSON")
    _common(p)
    p.add_argument("--out", default="plan.json")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("train", help="train on real images with the plan and plain PyTorch side by side")
    _common(p)
    p.add_argument("--data", default="digits", help="'digits' (embedded) or an image-folder path")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.set_defaults(func=cmd_train)
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from memfit.graph.capture import TraceError
    from memfit.solve.strategies import InfeasibleBudgetError

    try:
        return args.func(args)
    except (InfeasibleBudgetError, TraceError, ValueError, FileNotFoundError) as exc:
        Console(stderr=True).print(f"[red]memfit {args.command}: {exc}[/]")
        return 2


if __name__ == "__main__":
    sys.exit(main())
