"""The ``memfit`` command line: ``run``, ``plan``, ``train``, ``bench`` and ``max-batch`` (argparse + rich)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported: no busy-waiting threads

import argparse
import json
import math
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memfit.budget import BYTE_UNITS, byte_unit, fmt_bytes


def _common(p: argparse.ArgumentParser) -> None:
    """Model, size, budget, strategy and solver flags of ``run``, ``plan`` and ``train`` (each also takes
    ``--offload-dir``/``--no-offload``, which the ``--no-variants`` help refers to)."""
    from memfit import zoo
    from memfit.solve.strategies import STRATEGIES

    p.add_argument("--model", default="resnet18", choices=zoo.MODELS, help="model from the zoo")
    p.add_argument("--batch", type=_positive, default=None,
                   help="batch size (default: the model's CPU default; 32 for train)")
    p.add_argument("--image-size", type=_positive, default=None,
                   help="image side in pixels (default: the model's CPU default; 32 for train)")
    p.add_argument("--budget", default="min", help="total peak budget: '2GiB', '512MB', bytes, '40%%' of "
                   "the plain PyTorch total peak (fixed bytes included), or 'min' for the least memory memfit "
                   "can reach (default)")
    p.add_argument("--strategy", default="memfit", choices=STRATEGIES, help="what decides each activation: memfit "
                   "(recompute, offload and operator variants, chosen by an integer program; default), remat-ilp "
                   "(recompute only), none (plain PyTorch), chen, checkpoint-all, vdnn-all, vdnn-conv (fixed rules)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model trains (default: cpu)")
    p.add_argument("--time-limit", type=float, default=20.0, help="solver time limit, seconds")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--no-variants", action="store_true", help=(
        "memfit strategy: turn off operator variants (the memory-efficient ReLU, max-pool and convolution "
        "implementations, in-place ReLUs and additions, and BatchNorm recomputed from saved statistics); "
        "recomputation stays, and so does offloading where "
        "a store exists (on CUDA, or with --offload-dir); with --no-offload as well it equals the remat-ilp "
        "strategy (recomputation only)"))
    which.add_argument("--exact-variants", action="store_true", help=(
        "memfit strategy: only operator variants whose gradients are bit for bit PyTorch's (no conv-native, no "
        "BatchNorm from its output, no row stripes, which round differently)"))
    p.add_argument("--no-tiling", action="store_true", help=(
        "memfit strategy: never run blocks of convolutions, pooling and activations in row stripes "
        "(tiled-chain; on by default with variants, for models with such blocks)"))
    p.add_argument("--threads", type=_positive, default=None, help="torch intra-op threads (CPU)")
    _allocator_flag(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initial weights and the example batch")


def _allocator_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system-allocator", action="store_true", help=(
        "CPU: leave the C allocator as it is. By default memfit keeps the memory PyTorch frees in the process "
        "(glibc: no mmap per allocation, no trimming), so that steps pay no page faults, as on CUDA with its "
        "caching allocator; with this flag a step's time includes them (a third of plain MobileNet-V2's)"))


def _offload_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--offload-dir", default=None, metavar="DIR",
                   help="directory for the disk store of offloaded activations (memory-mapped files, deleted "
                   "as soon as made; created if missing). On the CPU this turns offloading on (vDNN); use a "
                   "real disk, not tmpfs")
    g.add_argument("--no-offload", action="store_true",
                   help="never offload activations (on CUDA memfit otherwise may, to pinned host memory)")


def _grads_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grads-exist", action="store_true",
                   help="model a loop that keeps gradients allocated (optimizer.zero_grad(set_to_none=False) or "
                   "gradient accumulation); default: PyTorch's zero_grad(), which sets them to None")


def _offload(args) -> bool | None:
    """``offload`` for :func:`memfit.api.plan`: False with ``--no-offload``, else None (the default rule)."""
    return False if getattr(args, "no_offload", False) else None


def _check_offload_dir(path: str) -> str | None:
    """Why ``path`` cannot hold the disk store (``None`` if it can); creates the directory if missing."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"--offload-dir {path}: not a directory (it is a file); name a directory (created if missing)"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"--offload-dir {path}: cannot create the directory ({exc.strerror})"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"--offload-dir {path}: the directory is not writable; name another one"
    return None


def _positive(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _learning_rate(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a learning rate, a finite number > 0, got {text!r}")
    return value


def _sizes(args) -> tuple[int, int]:
    from memfit import zoo

    batch, size = zoo.default_size(args.model)
    return (batch if args.batch is None else args.batch), (size if args.image_size is None else args.image_size)


def _report_table(r: dict, budget: str | None = None) -> Table:
    """``memfit run``'s table of the report ``r``; ``budget`` is the budget as given (``"min"``, ``"90%"``)."""
    given = fmt_bytes(r["budget_bytes"])
    if budget is not None and budget.strip().replace(" ", "").lower() != given.replace(" ", "").lower():
        given = f"{budget.strip()} = {given}"  # "min = 136.5 MiB", "90% = 208.0 MiB"
    if r["strategy"] not in ("memfit", "remat-ilp"):
        given += f" (not read by {r['strategy']})"
    t = Table(title=f"memfit run: {r['model']} batch {r['batch_size']} input {r['input_shape']} "
              f"on {r['device']}, strategy {r['strategy']}, budget {given}"
              f"{', gradients kept allocated' if r.get('grads_exist') else ''}")
    t.add_column("")
    t.add_column("plain PyTorch", justify="right")
    t.add_column("planned", justify="right")
    t.add_column("predicted", justify="right")
    b, p = r["baseline"], r["planned"]
    # the totals in their own unit, with the decimals that resolve the activation peak: a 40 MiB saving on a
    # 1.5 GiB total read "1.5 GiB" twice; the activation rows in theirs
    unit = byte_unit(b["peak_bytes"])
    smallest = max(1, min(b["activation_peak_bytes"], p["activation_peak_bytes"])) / 1024 ** BYTE_UNITS.index(unit)
    decimals = max(1, min(4, 1 - math.floor(math.log10(smallest))))

    def total(n):
        return fmt_bytes(n, unit, decimals)
    over = p["peak_bytes"] > r["budget_bytes"]  # (the heuristics only record the budget; the programs keep under it)
    t.add_row("total peak", total(b["peak_bytes"]), f"[red]{total(p['peak_bytes'])} (over the budget)[/]" if over
              else total(p["peak_bytes"]), total(p["predicted_peak_bytes"]))
    t.add_row("fixed", total(b["fixed_bytes"]), total(b["fixed_bytes"]), "")
    t.add_row("activation peak", fmt_bytes(b["activation_peak_bytes"]), fmt_bytes(p["activation_peak_bytes"]),
              fmt_bytes(p["predicted_peak_bytes"] - b["fixed_bytes"]))
    host = p.get("host_peak_bytes") or 0
    if host:
        t.add_row("host peak (offload)", "", fmt_bytes(host), "")
    t.add_row("step time", f"{b['step_seconds']:.3f} s", f"{p['step_seconds']:.3f} s",
              f"{p['predicted_step_seconds']:.3f} s")
    notes: list[str] = []
    plain_predicted = b.get("predicted_step_seconds")
    predicted_overhead = (f"{p['predicted_step_seconds'] / plain_predicted:.2f}x" if plain_predicted else "")
    t.add_row("overhead", "1.00x", f"{r['overhead']:.2f}x", predicted_overhead)
    if plain_predicted and not 0.8 <= b["step_seconds"] / plain_predicted <= 1.25:
        # fresh-user finding: on a loaded machine the predicted seconds were far below the measured ones
        notes.append(f"plain PyTorch's step measured {b['step_seconds'] / plain_predicted:.2f}x its profiled time "
                     f"({plain_predicted:.3f} s): the machine ran at another speed than when profiled (other work "
                     "on its cores?), so compare the overheads rather than the seconds")
    if over:  # a fresh user's --strategy none --budget 1% exited 0 with nothing flagged
        notes.append(f"the planned step's peak is over the {fmt_bytes(r['budget_bytes'])} budget"
                     + (f": the {r['strategy']} strategy does not plan to a budget (memfit and remat-ilp do)"
                        if r["strategy"] not in ("memfit", "remat-ilp") else ""))
    if b["fixed_bytes"] > 0.9 * b["peak_bytes"]:  # a fresh user's VGG-16 saved 1.6 of 1539.6 MiB, unexplained
        notes.append(f"the fixed bytes are {b['fixed_bytes'] / b['peak_bytes']:.1%} of plain PyTorch's peak: a plan "
                     f"can save only from the {fmt_bytes(b['activation_peak_bytes'])} of activations (a larger "
                     "batch or image size has more)")
    if notes:
        t.caption = "; ".join(notes)
    if r.get("cpu_allocator"):
        t.add_row("CPU allocator", r["cpu_allocator"], r["cpu_allocator"], "")
    d = r["decisions"]
    t.add_row("decisions", "", f"keep {d['keep']} / recompute {d['recompute']} / offload {d['offload']}", "")
    if d["variants"]:
        t.add_row("operator variants", "", ", ".join(f"{k} x{v}" for k, v in sorted(d["variants"].items())), "")
    if r.get("offload_store"):
        t.add_row("offload store", "", r["offload_store"], "")
    gap = "-" if r["mip_gap"] is None else f"{r['mip_gap']:.3f}"
    t.add_row("solve", "", f"{r['solve_seconds']:.2f} s (gap {gap})", "")
    ok = "[green]match[/]" if r["gradients_match"] else "[red]DIFFER[/]"
    if "rounding_check" in r:
        ok = "[green]match to float32 rounding[/]" if r["gradients_match"] else "[red]DIFFER beyond float32 rounding[/]"
    t.add_row("gradients", "", f"{ok} (max abs diff {r['max_abs_grad_diff']:.2e}"
              f"{' after the measured steps; judged by the one step below' if 'rounding_check' in r else ''})", "")
    if "rounding_check" in r:  # row stripes or conv-native: float32 rounding, judged against a float64 step
        from memfit.bench.job import rounding_rows

        for label, figures in rounding_rows(r["rounding_check"], buffers=bool(r.get("buffers_compared", 1))):
            t.add_row(f"  {label}", "", escape(figures), "")
    if r.get("buffers_compared", 1) == 0:  # nothing to compare: "match" would claim a check that never ran
        t.add_row("BatchNorm statistics", "", "none (the model has no buffers)", "")
    else:
        t.add_row("BatchNorm statistics", "", "[green]match[/]" if r["bn_stats_match"] else "[red]DIFFER[/]", "")
    return t


def _variants(args) -> bool | str:
    """The ``variants`` argument of ``--no-variants`` and ``--exact-variants`` (one or neither)."""
    return "exact" if args.exact_variants else not args.no_variants


def cmd_run(args) -> int:
    from memfit.bench.job import run_job

    batch, size = _sizes(args)
    console = Console()
    with console.status(f"measuring plain PyTorch, profiling and solving {args.model} ..."):
        report = run_job(args.model, batch, size, args.budget, args.strategy, args.steps, args.device,
                         args.time_limit, args.seed, variants=_variants(args), offload=_offload(args),
                         offload_dir=args.offload_dir, grads_exist=args.grads_exist, tiling=not args.no_tiling)
    console.print(_report_table(report, args.budget))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        console.print(f"wrote {args.json}")
    return 0 if report["gradients_match"] and report["bn_stats_match"] else 1


def cmd_plan(args) -> int:
    import torch

    from memfit import zoo
    from memfit.api import offload_store, plan
    from memfit.profile.timing import cpu_allocator

    batch, size = _sizes(args)
    model = zoo.build_model(args.model, seed=args.seed).to(args.device).train()
    images, target = zoo.example_batch(args.model, batch, size, device=args.device, seed=args.seed)
    loss = zoo.loss_for(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    store = offload_store((images,), args.strategy, _offload(args), args.offload_dir)
    # the loss `memfit run` trains with (its targets count as fixed bytes there too): the same figures and floor
    result, _, _ = plan(model, (images,), args.budget, strategy=args.strategy, optimizer=opt,
                        time_limit=args.time_limit, variants=_variants(args), offload=_offload(args),
                        offload_dir=args.offload_dir, grads_exist=args.grads_exist, _store=store,
                        loss_fn=lambda out: loss(out, target), tiling=not args.no_tiling)
    result.save(args.out)
    c = result.counts()
    Console().print(f"{args.model} batch {batch} {size}x{size}: predicted peak "
                    f"{fmt_bytes(result.predicted_peak_bytes)} (fixed {fmt_bytes(result.fixed_bytes)}), "
                    f"step {result.predicted_step_seconds:.3f} s; keep {c['keep']}, recompute {c['recompute']},"
                    f" offload {c['offload']}{'' if store is None else ' (to ' + store.describe() + ')'};"
                    f" {len(result.regions)} checkpoint region(s)"
                    f"{f'; {len(result.tiled)} block(s) in row stripes' if result.tiled else ''}"
                    f"{f'; {len(result.bn_from_output)} BatchNorm(s) from their output' if result.bn_from_output else ''}"
                    f"{'; gradients kept allocated' if args.grads_exist else ''}"
                    f"{'; CPU allocator ' + cpu_allocator() if args.device == 'cpu' else ''}; wrote {args.out}")
    return 0


def cmd_train(args) -> int:
    from memfit.train import train_side_by_side

    return train_side_by_side(args)


def _wide_console() -> Console:
    """A console for wide tables: the terminal's width, or 200 columns when writing to a file or pipe."""
    probe = Console()
    return probe if probe.is_terminal else Console(width=200)


def cmd_bench(args) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from memfit.bench import peers
    from memfit.bench.sweep import (
        default_strategies,
        parse_fractions,
        parse_knobs,
        parse_strategies,
        results_table,
        sweep,
        write_results,
        zoo_workload,
    )

    batch, size = _sizes(args)
    budgets = parse_fractions(args.budgets, percent_only=True)
    torch_budgets = parse_knobs(args.torch_budgets)
    out = args.out or f"bench-{args.model}-b{batch}-{size}px"
    try:  # fail now, not after the sweep
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, ".memfit-write-test")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write there ({exc.strerror})") from None
    backends = [peers.AOT_EAGER] + ([peers.INDUCTOR] if args.inductor else [])
    strategies = (parse_strategies(args.strategies) if args.strategies is not None  # (before the progress bar)
                  else default_strategies(args.device, args.offload_dir, _offload(args)))
    _check_vdnn(strategies, args)
    console = _wide_console()
    work = zoo_workload(args.model, batch, size, args.device, args.seed)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("memfit bench", total=None)

        def progress(text: str, done: int, total: int) -> None:
            bar.update(task, description=text, completed=done, total=total)

        baseline, rows = sweep(work, budgets, strategies, steps=args.steps,
                               torch_budgets=torch_budgets, torch_backends=backends, time_limit=args.time_limit,
                               seed=args.seed, progress=progress, offload=_offload(args),
                               offload_dir=args.offload_dir, grads_exist=args.grads_exist,
                               tiling=not args.no_tiling)
    from memfit.bench.sweep import machine_line

    paths = write_results(rows, baseline, out, title=f"{args.model} batch {batch} {size}x{size} on {args.device}"
                          f" ({machine_line()})")
    console.print(results_table(rows, baseline))
    console.print(f"{machine_line()}; wrote {paths['json']}, {paths['csv']}, {paths['png']}")
    own = [r for r in rows if r["backend"] == "eager" and r["planned"] is not None]
    return 0 if all(r["gradients_match"] and r["bn_stats_match"] for r in own) else 1


def cmd_max_batch(args) -> int:
    from memfit import zoo
    from memfit.bench import peers
    from memfit.bench.maxbatch import (
        DEFAULT_BATCH_LIMIT,
        max_batch_table,
        min_batch,
        parse_strategy,
        plain_peak_bytes,
        zoo_max_batch,
    )
    from memfit.budget import Budget

    size = args.image_size or zoo.default_size(args.model)[1]
    console = _wide_console()
    strategies = [s for s in args.strategies.split(",") if s]
    _check_vdnn(strategies, args)
    for s in strategies:  # (torch-budget:7 ran, failed inside torch.compile and reported max batch 0, exit 0)
        if s.startswith("torch-budget:"):
            from memfit.bench.sweep import parse_knobs

            try:
                parse_knobs(s.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"--strategies {s!r}: K in torch-budget:K is torch's activation_memory_budget, a plain "
                                 "number from 0 to 1 (1.0 keeps every activation, 0.0 recomputes all it can), e.g. "
                                 "torch-budget:0.5") from None
    for s in strategies:  # (an unknown one was refused only after plain PyTorch was measured)
        parse_strategy(s)
    if (args.budget is None) == (args.budget_from_batch is None):
        raise ValueError("give exactly one of --budget (bytes, e.g. '2GiB') and --budget-from-batch N")
    if args.budget_from_batch is not None and args.budget_from_batch < 1:
        raise ValueError(f"--budget-from-batch {args.budget_from_batch}: the batch whose plain PyTorch peak is the "
                         "budget must be >= 1")
    # (before plain PyTorch is measured for --budget-from-batch; a model with BatchNorm starts at 2)
    start = max(args.start_batch, min_batch(zoo.build_model(args.model)))
    if args.batch_limit < start:
        default = " (its default)" if args.batch_limit == DEFAULT_BATCH_LIMIT else ""
        why = f"--start-batch {args.start_batch}: raise --batch-limit or lower --start-batch" \
            if start == args.start_batch else \
            f"the start batch {start} ({args.model} has BatchNorm, which needs 2 in training): raise --batch-limit"
        raise ValueError(f"--batch-limit {args.batch_limit}{default} is below {why}")
    if args.budget is not None:
        budget = Budget.parse(args.budget)
        if budget.nbytes is None:
            given = "'min'" if budget.minimum else "a percentage"
            raise ValueError(f"max-batch needs a budget in bytes ('2GiB', '512MB'), not {given}: it finds the largest "
                             "batch that fits a fixed amount of memory (--budget-from-batch N takes plain PyTorch's "
                             "peak at batch N)")
        budget_bytes = budget.nbytes
    else:
        if args.device == "cpu":  # (a fresh user's --budget-from-batch 100000 ran 50 s at 20 GB before failing)
            _check_host_memory(args, args.budget_from_batch, size, "--budget-from-batch or --image-size")
        with console.status(f"measuring plain PyTorch at batch {args.budget_from_batch} ..."):
            budget_bytes = plain_peak_bytes(args.model, args.budget_from_batch, size, args.device, args.seed,
                                            grads_exist=args.grads_exist)
        console.print(f"budget = plain PyTorch's measured total peak at batch {args.budget_from_batch}: "
                      f"{budget_bytes} bytes ({fmt_bytes(budget_bytes)})")
    backend = peers.INDUCTOR if args.inductor else peers.AOT_EAGER
    with console.status("searching ...") as status:
        results = zoo_max_batch(args.model, size, budget_bytes, strategies,
                                device=args.device, seed=args.seed, start=args.start_batch,
                                limit=args.batch_limit, backend=backend, time_limit=args.time_limit,
                                offload=_offload(args), offload_dir=args.offload_dir,
                                grads_exist=args.grads_exist, progress=lambda text: status.update(f"{args.model} {size}px: {text}"))
    console.print(max_batch_table(results, budget_bytes, title=f"memfit max-batch: {args.model} {size}x{size} "
                                  f"on {args.device}, budget {fmt_bytes(budget_bytes)} (total peak, measured)"))
    start = results[0].start_batch if results else args.start_batch
    if start > args.start_batch:
        console.print(f"note: {args.model} has BatchNorm layers, which need batch >= 2 in training; the search "
                      f"started at batch {start}, not {args.start_batch}")
    for r in results:
        if r.max_batch == 0:
            console.print(f"[yellow]{r.strategy}: {escape(r.why_not())}[/]")
    if args.json:
        report = {"model": args.model, "image_size": size, "device": args.device, "budget_bytes": budget_bytes,
                  "budget_from_batch": args.budget_from_batch, "offload_dir": args.offload_dir,
                  "grads_exist": args.grads_exist,
                  "results": [r.to_dict() for r in results]}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        console.print(f"wrote {args.json}")
    return 0


def _check_vdnn(strategies: list[str], args) -> None:
    """``--no-offload`` contradicts the vDNN strategies, which always offload."""
    from memfit.solve.strategies import OFFLOAD_STRATEGIES

    clash = [s for s in strategies if s.partition(":")[0] in OFFLOAD_STRATEGIES]
    if clash and getattr(args, "no_offload", False):
        raise ValueError(f"--no-offload contradicts --strategies {','.join(clash)}: the vDNN strategies always "
                         "offload; drop one of the two")


def _bench_run_flags(p: argparse.ArgumentParser) -> None:
    """Device, solver, thread, seed, offload and gradient flags of ``bench`` and ``max-batch`` (one thread by
    default, for stable CPU timings)."""
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model trains (default: cpu)")
    p.add_argument("--time-limit", type=float, default=20.0, help="solver time limit per plan, seconds")
    p.add_argument("--threads", type=_positive, default=1, help="torch intra-op threads (CPU; default 1)")
    _allocator_flag(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initial weights and the example batch")
    _offload_flags(p)
    _grads_flag(p)


def _add_bench_commands(sub) -> None:
    from memfit import zoo
    from memfit.bench.maxbatch import DEFAULT_BATCH_LIMIT, MAXBATCH_STRATEGIES
    from memfit.bench.sweep import ALL_STRATEGIES, BENCH_STRATEGIES
    from memfit.solve.strategies import OFFLOAD_STRATEGIES, STRATEGIES

    p = sub.add_parser("bench", help="sweep strategies x budgets (and PyTorch's own budget) and measure each "
                       "one; budgets are %% of plain PyTorch's ACTIVATION peak",
                       description="Measure every strategy at every budget side by side with plain PyTorch. "
                       "Budgets are percentages of plain PyTorch's measured ACTIVATION peak, not of the total "
                       "peak as in `memfit run --budget`: a budget f becomes the total-peak bound fixed bytes "
                       "+ f x plain activation peak. Writes results.json, results.csv and pareto.png to --out.")
    p.add_argument("--model", default="resnet50", choices=zoo.MODELS, help="model from the zoo")
    p.add_argument("--batch", type=_positive, default=None, help="batch size (default: the model's CPU default)")
    p.add_argument("--image-size", type=_positive, default=None, help="image side in pixels")
    p.add_argument("--budgets", default="100%,70%,50%,40%,33%,25%",
                   help="percentages of plain PyTorch's ACTIVATION peak (total = fixed + %% x activation peak)")
    p.add_argument("--strategies", default=None,
                   help=f"comma-separated, from {', '.join(ALL_STRATEGIES)} (default {','.join(BENCH_STRATEGIES)}"
                   f", plus {','.join(OFFLOAD_STRATEGIES)} with --offload-dir or on CUDA)")
    p.add_argument("--torch-budgets", default="1.0,0.5,0.3,0.1,0.0",
                   help="values of torch._functorch.config.activation_memory_budget for torch-budget")
    p.add_argument("--inductor", action="store_true",
                   help="also run torch-budget with torch.compile's inductor backend (minutes of compiling)")
    p.add_argument("--out", default=None, help="output folder (default bench-MODEL-bBATCH-SIZEpx)")
    p.add_argument("--steps", type=_positive, default=3, help="timed rounds per row, interleaved with plain PyTorch")
    p.add_argument("--no-tiling", action="store_true",
                   help="memfit strategy: never run blocks of convolutions, pooling and activations in row stripes")
    _bench_run_flags(p)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("max-batch", help="the largest batch each strategy trains within a total-peak budget, "
                       "found by measuring")
    p.add_argument("--model", default="resnet50", choices=zoo.MODELS, help="model from the zoo")
    p.add_argument("--image-size", type=_positive, default=None, help="image side in pixels")
    p.add_argument("--budget", default=None, help="total peak bound in bytes: '2GiB', '512MB', 1000000")
    p.add_argument("--budget-from-batch", type=int, default=None, metavar="N",
                   help="instead of --budget: plain PyTorch's measured total peak at batch N")
    p.add_argument("--strategies", default=",".join(MAXBATCH_STRATEGIES),
                   help=f"comma-separated: {', '.join(STRATEGIES)}, torch-budget[:K] (plain PyTorch is always "
                   "measured as the reference)")
    p.add_argument("--inductor", action="store_true", help="torch-budget with the inductor backend")
    p.add_argument("--start-batch", type=_positive, default=2, help="first and smallest batch probed (raised to "
                   "2 for models with BatchNorm, which needs 2 in training)")
    p.add_argument("--batch-limit", type=_positive, default=DEFAULT_BATCH_LIMIT, help="largest batch probed")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    _bench_run_flags(p)
    p.set_defaults(func=cmd_max_batch)


_BUDGET_FLAGS = ("--budget", "--budgets")


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written (checked before a solve of minutes, not after), or ``None``: it is opened for
    appending, and removed again if it did not exist."""
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    if not existed:
        os.remove(path)
    return None


def _glue_negative_budgets(argv: list[str]) -> list[str]:
    """``--budget -5MiB`` as ``--budget=-5MiB``: argparse takes a value that starts with ``-`` for a flag and
    would say only "expected one argument"; glued, the budget's own check says what is wrong with it."""
    out: list[str] = []
    k = 0
    while k < len(argv):
        if argv[k] in _BUDGET_FLAGS and k + 1 < len(argv) and argv[k + 1][:1] == "-" and argv[k + 1][1:2].isdigit():
            out.append(f"{argv[k]}={argv[k + 1]}")
            k += 2
            continue
        out.append(argv[k])
        k += 1
    return out


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The ``memfit`` command's parser and its subcommands' (``run``, ``plan``, ``train``, ``bench``, ...)."""
    parser = argparse.ArgumentParser(prog="memfit", description="Fit deep-network training into a memory "
                                     "budget (recompute activations where it costs least).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="measure plain PyTorch, solve, train with the plan, compare")
    _common(p)
    p.add_argument("--steps", type=_positive, default=5, help="timed steps per setup (interleaved with plain)")
    p.add_argument("--json", default=None, help="write the report as JSON here")
    _offload_flags(p)
    _grads_flag(p)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("plan", help="solve only and save the plan as JSON")
    _common(p)
    _offload_flags(p)
    _grads_flag(p)
    p.add_argument("--out", default="plan.json", help="where to write the plan (JSON; load it with "
                   "memfit.Plan.load, or give it to memfit.optimize as plan_)")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("train", help="train on real images with the plan and plain PyTorch side by side")
    _common(p)
    _offload_flags(p)
    p.add_argument("--data", default="digits", help="'digits' (embedded) or an image-folder path")
    p.add_argument("--epochs", type=_positive, default=1, help="passes over the data (default: 1)")
    p.add_argument("--lr", type=_learning_rate, default=0.05, help="SGD learning rate, momentum 0.9 (default: 0.05)")
    _grads_flag(p)
    p.set_defaults(func=cmd_train)
    _add_bench_commands(sub)
    return parser, sub


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``memfit`` command."""
    from memfit.solve.strategies import OFFLOAD_STRATEGIES

    parser, sub = build_parser()
    args = parser.parse_args(_glue_negative_budgets(sys.argv[1:] if argv is None else list(argv)))
    command = sub.choices.get(args.command, parser)  # (its usage line in the error, not the top level's)
    if getattr(args, "device", "cpu") == "cuda":
        import torch

        if not torch.cuda.is_available():
            command.error("--device cuda: no CUDA device is available on this machine (use --device cpu)")
    if getattr(args, "offload_dir", None) is not None:
        why = _check_offload_dir(args.offload_dir)
        if why:
            command.error(why)
    if getattr(args, "no_offload", False) and getattr(args, "strategy", None) in OFFLOAD_STRATEGIES:
        command.error(f"--no-offload contradicts --strategy {args.strategy}: the vDNN strategies always offload")
    for flag in ("json", "out") if args.command == "plan" else ("json",):
        path = getattr(args, flag, None)
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            command.error(f"--{flag} {path}: the folder {os.path.dirname(os.path.abspath(path))} does not exist")
        if path and (os.path.isdir(path) or path.endswith(("/", os.sep))):
            example = "plan.json" if flag == "out" else f"{args.command}.json"  # (a run's report was offered plan.json)
            command.error(f"--{flag} {path} names a folder: name a file in it, e.g. {os.path.join(path, example)}")
        if path:
            why = _unwritable(path)
            if why:
                command.error(f"--{flag} {path}: cannot write there ({why}); name a file in a folder you can write to")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cpu" and not args.system_allocator:
        from memfit.profile.timing import retain_freed_memory

        retain_freed_memory()
    from memfit.graph.capture import TraceError
    from memfit.solve.strategies import InfeasibleBudgetError

    try:
        _check_host_memory(args)
        return args.func(args)
    except (InfeasibleBudgetError, TraceError, ValueError, FileNotFoundError) as exc:
        hint = ""
        if "more than 1 value per channel" in str(exc):  # PyTorch's BatchNorm on one value per channel
            hint = (" (BatchNorm in training needs more than one value per channel: give --batch 2 or more, or a "
                    "larger --image-size)")
        if isinstance(exc, InfeasibleBudgetError) and ("fixed bytes alone" in str(exc) or "temporaries" in str(exc)):
            # (the advice names an optimizer with less state, which the command line does not let you choose)
            batch = "lower --batch, " if "lower the batch size" in str(exc) else ""
            hint = (f" (the command line always trains the whole model with SGD and momentum 0.9: {batch}raise "
                    "--budget, or plan through the Python API, memfit.optimize(model, batch, budget, optimizer=...), "
                    "with frozen layers or another optimizer)")
        Console(stderr=True).print(f"[red]memfit {args.command}: {escape(str(exc))}{escape(hint)}[/]")
        return 2
    except (MemoryError, RuntimeError) as exc:
        from memfit.profile.tracker import is_out_of_memory

        if not is_out_of_memory(exc):
            raise
        Console(stderr=True).print(f"[red]memfit {args.command}: {escape(_out_of_memory(exc, args))}[/]")
        return 2


def _check_host_memory(args, batch: int | None = None, size: int | None = None,
                       lower: str = "--batch or --image-size") -> None:
    """On the CPU, refuse a batch whose forward outputs alone are more than this machine's available memory
    (:mod:`memfit.profile.host`): the kernel would kill the process without a message. ``batch`` and ``size``:
    those of the command's ``--batch`` and ``--image-size`` unless given; ``lower``: the flags the message names."""
    if getattr(args, "device", "cpu") != "cpu" or not hasattr(args, "model") or (
            batch is None and not hasattr(args, "batch")):
        return
    import torch

    from memfit import zoo
    from memfit.profile.host import check_fits_host

    if batch is None:
        batch, size = (args.batch or 32, args.image_size or 32) if args.command == "train" else _sizes(args)
    images = torch.empty(batch, 3, size, size, device="meta")  # (zoo.example_batch's shape)
    with torch.device("meta"):  # (shapes only: VGG-16's 0.5 GB of weights are not initialised for this)
        model = zoo.build_model(args.model)
    check_fits_host(model, (images,), lower)


def _out_of_memory(exc: BaseException, args) -> str:
    """The message for an allocation that failed (:func:`memfit.profile.tracker.is_out_of_memory`): its size where
    the allocator says it, and the flags that set the batch's size."""
    import re

    text = str(exc)
    tried = re.search(r"tried to allocate (\d+) bytes", text)  # (the CPU allocator's; CUDA's gives a size)
    cuda = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    size = f" of {fmt_bytes(int(tried.group(1)))}" if tried else f" of {cuda.group(1)}" if cuda else ""
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    first = re.split(r":? you tried to allocate|\. Tried to allocate", first[first.find("DefaultCPUAllocator"):]
                     if "DefaultCPUAllocator" in first else first)[0]
    names = [name for name in ("batch", "image_size") if hasattr(args, name)]
    given = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in names if getattr(args, name) is not None]
    return (f"out of memory: an allocation{size} failed on {getattr(args, 'device', 'cpu')} ({first}). "
            f"memfit runs the model on its example batch to measure it, and this batch"
            f"{' (' + ', '.join(given) + ')' if given else ''} needs more memory than the machine has: lower "
            f"{' or '.join('--' + name.replace('_', '-') for name in names) or 'the batch size'}")


if __name__ == "__main__":
    sys.exit(main())
