"""``memfit train``: train on real images with a plan and with plain PyTorch side by side."""

from __future__ import annotations

import math

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from memfit import zoo
from memfit.api import offload_store
from memfit.api import plan as make_plan
from memfit.bench.harness import fresh_copy
from memfit.bench.job import (
    rounding_check,
    rounding_rows,
    rounding_sources,
    rounding_verdict,
    rounds_differently,
)
from memfit.budget import fmt_bytes
from memfit.data import load_dataset, num_classes
from memfit.runtime.planned import PlannedModule


def train_side_by_side(args) -> int:
    """Train ``args.model`` for ``args.epochs`` on ``args.data`` twice from the same initial weights: with
    the plan and with plain PyTorch, on the same batches, and show that the loss curves match.

    Returns the process exit status: 0 when every step's loss matches within 1e-4 (relative), 1 otherwise. A plan
    whose values differ from PyTorch's by float rounding (``conv-native`` convolutions, blocks in row stripes:
    :func:`memfit.bench.job.rounds_differently`) is judged instead by one step from the initial weights against
    float64 (:func:`memfit.bench.job.rounding_check`, as ``memfit run`` judges it): over many steps training
    amplifies rounding, so the curves part (a ResNet-18 on ``digits`` at ``min``: 8.4e-6 after one step, the loss
    0.88 against 3.80 after 56; plain PyTorch with oneDNN off parts from itself with oneDNN on as far).
    """
    console = Console()
    if args.model in zoo.DENSE_MODELS:
        raise ValueError(f"--model {args.model} predicts a class per pixel, and train feeds image classification data "
                         f"(--data: one label per image): run it on synthetic per-pixel targets with memfit run "
                         f"--model {args.model}, or train a classifier ({', '.join(m for m in zoo.MODELS if m not in zoo.DENSE_MODELS)})")
    batch = 32 if args.batch is None else args.batch
    size = 32 if args.image_size is None else args.image_size
    dataset = load_dataset(args.data, size)
    if len(dataset) < batch:  # (every epoch drops its last partial batch: the plan is for one batch shape)
        raise ValueError(f"--data {args.data} has {len(dataset)} image(s), fewer than --batch {batch}: lower --batch "
                         "or add images")
    classes = num_classes(dataset)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(args.seed))
    model = zoo.build_model(args.model, num_classes=classes, seed=args.seed).to(device).train()
    plain = fresh_copy(model)
    images, labels = next(iter(loader))
    opt_plan = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    plan, captured, _ = make_plan(model, (images.to(device),), args.budget, strategy=args.strategy,
                                  optimizer=opt_plan, time_limit=args.time_limit, variants=not args.no_variants,
                                  grads_exist=args.grads_exist, offload=False if args.no_offload else None,
                                  offload_dir=args.offload_dir, tiling=not args.no_tiling)
    planned = PlannedModule(captured, plan, offload_dir=args.offload_dir)
    loss_fn = zoo.loss_for(args.model)
    one = None
    if rounds_differently(plan):  # (from the initial weights, before training moves them)
        store = offload_store((images,), args.strategy, False if args.no_offload else None,
                              args.offload_dir) if plan.offloads else None
        with console.status("checking one step against float64 (the plan rounds differently from PyTorch) ..."):
            one = rounding_verdict(rounding_check(plain, plan, (images.to(device),), labels.to(device), loss_fn,
                                                  args.seed, store))
    opt_plain = torch.optim.SGD(plain.parameters(), lr=args.lr, momentum=0.9)
    console.print(f"{args.model} on {args.data} ({len(dataset)} images, {classes} classes, {size}x{size}), "
                  f"batch {batch}: plan {plan.strategy}, predicted peak {fmt_bytes(plan.predicted_peak_bytes)}"
                  f" (budget {fmt_bytes(plan.budget_bytes)}), {len(plan.regions)} checkpoint region(s)"
                  f"{f', {len(plan.offloads)} offloaded node(s)' if plan.offloads else ''}"
                  f"{'; gradients kept allocated' if args.grads_exist else ''}")
    curve: list[tuple[int, float, float]] = []
    columns = (TextColumn("epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.4f} (plain {task.fields[plain]:.4f})"),
               TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        for epoch in range(args.epochs):
            task = progress.add_task("train", total=len(loader), epoch=epoch + 1, loss=0.0, plain=0.0)
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                rng = torch.get_rng_state()
                losses = []
                for module, opt in ((planned, opt_plan), (plain, opt_plain)):
                    torch.set_rng_state(rng)
                    opt.zero_grad(set_to_none=not args.grads_exist)
                    loss = loss_fn(module(x), y)
                    loss.backward()
                    opt.step()
                    losses.append(float(loss.detach()))
                curve.append((len(curve), losses[0], losses[1]))
                progress.update(task, advance=1, loss=losses[0], plain=losses[1])
    every = max(1, len(curve) // 10)
    table = Table(title=f"loss curve (every {every} step{'s' if every > 1 else ''}, and the last)")
    for col in ("step", "memfit", "plain PyTorch", "abs diff"):
        table.add_column(col, justify="right")
    shown = curve[::every] + ([curve[-1]] if (len(curve) - 1) % every else [])
    for step, a, b in shown:
        table.add_row(str(step), f"{a:.5f}", f"{b:.5f}", f"{abs(a - b):.1e}")
    console.print(table)
    diverged = next((step for step, a, b in curve if not (math.isfinite(a) and math.isfinite(b))), None)
    if diverged is not None:
        console.print(f"[red]the loss is not finite from step {diverged} on (memfit {curve[diverged][1]}, plain PyTorch "
                      f"{curve[diverged][2]}): training diverged, so the curves show nothing; lower --lr[/]")
        return 1
    worst = max(abs(a - b) / max(abs(b), 1e-8) for _, a, b in curve)
    ok = worst <= 1e-4
    if ok or one is None:
        console.print(("[green]loss curves match" if ok else "[red]loss curves differ") +
                      f"[/] (max relative difference {worst:.1e} over {len(curve)} steps)")
        return 0 if ok else 1
    ok = one["gradients_match"] and one["bn_stats_match"]
    figures = "; ".join(f"{label} {text}" for label, text in rounding_rows(one["rounding_check"]))
    console.print(f"loss curves differ (max relative difference {worst:.1e} over {len(curve)} steps): the plan runs "
                  f"{', '.join(rounding_sources(plan))}, whose float32 values differ from PyTorch's kernels' by "
                  "rounding, which training amplifies; judged by one step from the initial weights against float64 "
                  f"instead: {escape(figures)}")
    console.print("[green]match to float32 rounding[/]" if ok else
                  "[red]DIFFER beyond float32 rounding[/] (run again with --no-variants --no-tiling to compare bit "
                  "for bit)")
    return 0 if ok else 1
