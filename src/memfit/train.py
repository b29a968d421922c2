"""``memfit train``: train on real images with a plan and with plain PyTorch side by side."""

from __future__ import annotations

import math

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from memfit import zoo
from memfit.api import plan as make_plan
from memfit.bench.harness import fresh_copy
from memfit.budget import fmt_bytes
from memfit.data import load_dataset, num_classes
from memfit.runtime.planned import PlannedModule


def train_side_by_side(args) -> int:
    """Train ``args.model`` for ``args.epochs`` on ``args.data`` twice from the same initial weights: with
    the plan and with plain PyTorch, on the same batches, and show that the loss curves match.

    Returns the process exit status: 0 when every step's loss matches within 1e-4 (relative), 1 otherwise.
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
    images, _ = next(iter(loader))
    opt_plan = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    plan, captured, _ = make_plan(model, (images.to(device),), args.budget, strategy=args.strategy,
                                  optimizer=opt_plan, time_limit=args.time_limit, variants=not args.no_variants,
                                  grads_exist=args.grads_exist, offload=False if args.no_offload else None,
                                  offload_dir=args.offload_dir, tiling=not args.no_tiling)
    planned = PlannedModule(captured, plan, offload_dir=args.offload_dir)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = zoo.loss_for(args.model)
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
    console.print(("[green]loss curves match" if ok else "[red]loss curves differ") +
                  f"[/] (max relative difference {worst:.1e} over {len(curve)} steps)")
    return 0 if ok else 1
