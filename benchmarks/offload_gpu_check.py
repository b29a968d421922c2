"""GPU check for offloading (vDNN): run it through the device tool when a GPU is lent; it needs CUDA.

    python benchmarks/offload_gpu_check.py --out $OUT/offload.json
    python benchmarks/offload_gpu_check.py --device cpu --tiny --out /tmp/offload.json   # smoke test, < 1 min

VGG-16 at batch 256 and ResNet-50 at batch 184, 224x224, float32, SGD with momentum (the vDNN / MONeT
settings). For each strategy -- ``none``, ``chen``, ``vdnn-all``, ``vdnn-conv``, ``remat-ilp`` and ``memfit``
(recompute + offload + operator variants jointly, offloading to pinned host memory) -- it makes the plan with
``memfit.api.plan``, trains with ``PlannedModule`` and reports, for one training step:

* ``peak_bytes``: ``torch.cuda.max_memory_allocated`` during the step (absolute: the script keeps nothing else
  on the device; on the CPU the harness's exact tracker instead), with ``fixed_bytes`` (parameters,
  gradients, momentum, the batch) and the plan's ``predicted_peak_bytes``;
* ``host_peak_bytes``: the most bytes the offload store held at once during the step;
* ``step_seconds``: the median of ``--steps`` steps timed with CUDA events (``perf_counter`` on the CPU), and
  ``overhead`` against plain PyTorch's;
* ``gradients_match``: gradients after two steps from the same weights against plain PyTorch's (relative to the
  largest plain gradient: 1e-3 on CUDA, where cuDNN's kernels are not deterministic; 1e-5 on the CPU).

The integer programs (``remat-ilp``, ``memfit``) run at ``--budgets`` (default 25% and 100%) of plain
PyTorch's measured total peak; the other strategies read no budget and run once. If plain PyTorch runs out
of memory at the requested batch, its peak is measured at smaller batches and extrapolated linearly
(peak = fixed + slope x batch, from two batches), and the output says so. Rows that fail (out of memory, an
infeasible budget, anything else) are recorded with the error; the JSON is rewritten after every row, so a
run cut short keeps what it measured. Pass --models / --strategies / --budgets to shorten a run.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import tempfile
import time
import traceback

import torch

from memfit import zoo
from memfit.api import offload_store
from memfit.api import plan as make_plan
from memfit.budget import fmt_bytes
from memfit.profile.tracker import MemoryTracker, live_bytes
from memfit.runtime.planned import PlannedModule
from memfit.solve.strategies import OFFLOAD_STRATEGIES, STRATEGIES, InfeasibleBudgetError

#: strategies that read the budget (the others run once per model).
ILP_STRATEGIES = ("remat-ilp", "memfit")


def step_seconds(step, device: torch.device, steps: int) -> float:
    """Median time (seconds) of ``steps`` calls of ``step``: CUDA events on CUDA (as ``gpu_check.py``'s
    ``cuda_step_seconds``, but continuing the caller's optimizer), ``perf_counter`` on the CPU."""
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(module, params_of, inputs: tuple, target, loss_fn, device: torch.device, steps: int,
            store=None, seed: int = 0) -> dict:
    """One warm-up step (allocates gradients and momentum), one measured step, then ``steps`` timed ones.

    Returns:
        ``peak_bytes`` (absolute ``max_memory_allocated`` on CUDA), ``fixed_bytes``, ``activation_peak_bytes``,
        ``host_peak_bytes``, ``step_seconds`` and ``grads`` (after the measured step, on the CPU).
    """
    torch.manual_seed(seed)
    opt = torch.optim.SGD(params_of.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(module(*inputs), target)
        loss.backward()
        opt.step()

    for p in params_of.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    step()
    fixed = live_bytes(list(params_of.parameters()) + [p.grad for p in params_of.parameters()]
                       + list(params_of.buffers()) + list(inputs) + [target]
                       + [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)])
    if store is not None:
        store.reset_peak()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        with MemoryTracker(device) as tracker:
            step()
        start, peak = fixed, fixed + tracker.peak_bytes
    host = store.peak_bytes if store is not None else 0
    grads = {n.removeprefix("gm."): p.grad.detach().to("cpu", copy=True)
             for n, p in params_of.named_parameters() if p.grad is not None}
    seconds = step_seconds(step, device, steps)
    return {"peak_bytes": peak, "fixed_bytes": fixed, "activation_peak_bytes": peak - start,
            "host_peak_bytes": host, "step_seconds": seconds, "grads": grads}


def grad_check(reference: dict | None, grads: dict, rtol: float) -> dict:
    """Largest gradient difference, absolute and relative to the largest reference gradient."""
    if reference is None:
        return {"gradients_match": None, "max_abs_grad_diff": None, "max_rel_grad_diff": None}
    diff = max((float((reference[k] - grads[k]).abs().max()) for k in reference if k in grads), default=0.0)
    scale = max((float(g.abs().max()) for g in reference.values() if g.numel()), default=0.0) or 1.0
    return {"gradients_match": set(reference) == set(grads) and diff / scale <= rtol,
            "max_abs_grad_diff": diff, "max_rel_grad_diff": diff / scale}


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


class Check:
    """One model at one batch: the CPU master copy of the weights, the batch and the loss."""

    def __init__(self, name: str, batch: int, size: int, num_classes: int, device: torch.device, steps: int,
                 seed: int = 0, tiny: bool = False):
        self.name, self.batch, self.size, self.device, self.steps, self.seed = name, batch, size, device, steps, seed
        self.num_classes = num_classes
        self.master = zoo.build_model(name, num_classes=num_classes, seed=seed).train()  # stays on the CPU
        if tiny and name == "vgg16":  # the 134 M-parameter classifier alone takes ~0.5 s a step on a CPU
            torch.manual_seed(seed)
            self.master.classifier = torch.nn.Linear(self.master.classifier[0].in_features, num_classes)
        self.loss_fn = zoo.loss_for(name)

    def batch_of(self, b: int) -> tuple[tuple, torch.Tensor]:
        images, target = zoo.example_batch(self.name, b, self.size, num_classes=self.num_classes,
                                           device=self.device, seed=self.seed)
        return (images,), target

    def model(self):
        return copy.deepcopy(self.master).to(self.device).train()

    def plain(self, b: int) -> dict:
        inputs, target = self.batch_of(b)
        m = self.model()
        try:
            return measure(m, m, inputs, target, self.loss_fn, self.device, self.steps, seed=self.seed)
        finally:
            del m, inputs, target
            free(self.device)

    def planned(self, strategy: str, budget_bytes: int, time_limit: float, offload_dir: str | None) -> dict:
        inputs, target = self.batch_of(self.batch)
        m = self.model()
        # memfit jointly with offloading (pinned memory on CUDA); vdnn-* always offload; the others never
        offload = strategy == "memfit" or strategy in OFFLOAD_STRATEGIES
        offload_dir = offload_dir if offload else None
        store = offload_store(inputs, strategy, offload, offload_dir)
        try:
            opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
            # measure() keeps gradients allocated (zero_grad(set_to_none=False)): the plan counts that
            plan, captured, _ = make_plan(m, inputs, budget_bytes, strategy=strategy, optimizer=opt, grads_exist=True,
                                          time_limit=time_limit, loss_fn=lambda out, t=target: self.loss_fn(out, t),
                                          offload=offload, offload_dir=offload_dir, _store=store)
            del opt
            pm = PlannedModule(captured, plan, offload_store=store)
            fig = measure(pm, pm, inputs, target, self.loss_fn, self.device, self.steps, store, self.seed)
            fig.update(predicted_peak_bytes=plan.predicted_peak_bytes,
                       predicted_step_seconds=plan.predicted_step_seconds, solve_seconds=plan.solve_seconds,
                       mip_gap=plan.mip_gap, decisions=plan.counts(), regions=len(plan.regions),
                       offload_store=None if store is None else store.describe())
            del pm, captured, plan
            return fig
        finally:
            del m, inputs, target
            free(self.device)


def plain_reference(check: Check, notes: list[str]) -> tuple[dict | None, int, dict]:
    """Plain PyTorch at the check's batch: ``(figures or None, peak bytes, how it was found)``; on out of
    memory, the peak is extrapolated linearly from two smaller batches that fit."""
    try:
        fig = check.plain(check.batch)
        return fig, fig["peak_bytes"], {"plain_measured_at": [check.batch]}
    except Exception as exc:
        if not is_oom(exc):
            raise
    free(check.device)  # after the handler: the traceback no longer holds the step's tensors
    b, fits = check.batch // 2, []
    while b >= 1 and len(fits) < 2:
        try:
            fits.append((b, check.plain(b)["peak_bytes"]))
        except Exception as exc:
            if not is_oom(exc):
                raise
        free(check.device)
        b //= 2
    if len(fits) < 2:
        raise RuntimeError(f"{check.name}: plain PyTorch runs out of memory even at small batches")
    (b1, p1), (b2, p2) = fits
    slope = (p1 - p2) / (b1 - b2)
    peak = int(p1 + slope * (check.batch - b1))
    note = (f"{check.name}: plain PyTorch does not fit at batch {check.batch}; its peak {fmt_bytes(peak)} is "
            f"extrapolated linearly from batch {b1} ({fmt_bytes(p1)}) and batch {b2} ({fmt_bytes(p2)}); no "
            "gradient check against plain PyTorch for this model")
    print(note, flush=True)
    notes.append(note)
    return None, peak, {"plain_measured_at": [b1, b2], "plain_extrapolated": True}


def line(row: dict) -> str:
    """One printed line per row."""
    budget = "" if row["budget_fraction"] is None else f" @ {row['budget_fraction']:.0%}"
    head = f"{row['model']} b{row['batch']} {row['strategy']}{budget}:"
    if row.get("error"):
        return f"{head} [{row.get('wall_seconds', 0):.0f} s] ERROR {row['error'].splitlines()[0][:200]}"
    d = row.get("decisions") or {}
    over = f" {row['overhead']:.2f}x" if row.get("overhead") else ""
    grads = ("reference" if row["strategy"] == "plain" else
             {True: "grads match", False: "grads DIFFER", None: "no grad check"}[row.get("gradients_match")])
    pred = f" (predicted {fmt_bytes(row['predicted_peak_bytes'])})" if row.get("predicted_peak_bytes") else ""
    return (f"{head} [{row.get('wall_seconds', 0):.0f} s] peak {fmt_bytes(row['peak_bytes'])}{pred}, host {fmt_bytes(row.get('host_peak_bytes') or 0)}"
            f", step {row['step_seconds'] * 1000:.1f} ms{over}, {grads}; keep {d.get('keep', '-')} recompute "
            f"{d.get('recompute', '-')} offload {d.get('offload', '-')}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="vgg16:256,resnet50:184", help="name:batch, comma-separated")
    ap.add_argument("--batch", type=int, default=None, help="batch for every model, instead of --models'")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--strategies", default="none,chen,vdnn-all,vdnn-conv,remat-ilp,memfit",
                    help=f"comma-separated, from {', '.join(STRATEGIES)}")
    ap.add_argument("--budgets", default="25%,100%",
                    help="budgets of remat-ilp and memfit, as percentages of plain PyTorch's measured total peak")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row (median)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="solver time limit per plan, seconds")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--offload-dir", default=None,
                    help="offload to a disk store here instead of pinned memory (CPU default: a temporary directory, removed when done)")
    ap.add_argument("--tiny", action="store_true",
                    help="smoke test (for the CPU): batch 2 (unless --batch), 32x32 images, 10 classes, 1 timed step, and VGG-16's "
                    "classifier replaced by one linear layer")
    ap.add_argument("--out", default="offload_gpu_check.json")
    args = ap.parse_args(argv)
    for s in args.strategies.split(","):
        if s not in STRATEGIES:
            ap.error(f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")
    try:
        args.fractions = [float(b.rstrip("%")) / 100 for b in args.budgets.split(",") if b]
    except ValueError:
        ap.error(f"--budgets {args.budgets}: expected percentages such as 25%,100%")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu --tiny for the smoke test)")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.offload_dir is None and args.device == "cpu":  # a disk store in a directory removed when done
        with tempfile.TemporaryDirectory(prefix="memfit-offload-check-") as offload_dir:
            return run_checks(args, offload_dir)
    return run_checks(args, args.offload_dir)


def run_checks(args: argparse.Namespace, offload_dir: str | None) -> list[dict]:
    """Every row of the check (see the module docstring), printed and written to ``args.out`` as made."""
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True
    size, classes, steps = (32, 10, 1) if args.tiny else (args.image_size, 1000, args.steps)
    rtol = 1e-3 if dev.type == "cuda" else 1e-5
    report = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "image_size": size, "tiny": args.tiny, "rows": [], "notes": []}
    rows, notes = report["rows"], report["notes"]

    def emit(row: dict) -> None:
        rows.append(row)
        print(line(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    t_start = time.time()
    for spec in args.models.split(","):
        name, _, batch = spec.partition(":")
        batch = args.batch or (2 if args.tiny else int(batch or 0))
        if batch < 1:
            raise SystemExit(f"--models {spec}: give name:batch (or --batch)")
        check = Check(name, batch, size, classes, dev, steps, tiny=args.tiny)
        base = {"model": name, "batch": batch, "image_size": size}
        t0 = time.perf_counter()
        plain, plain_peak, how = plain_reference(check, notes)
        plain_s = plain["step_seconds"] if plain else None
        ref = plain.pop("grads") if plain else None
        if plain:
            emit(base | {"strategy": "plain", "budget_fraction": None, "budget_bytes": None, **how, **plain,
                         "overhead": 1.0, "wall_seconds": time.perf_counter() - t0})
        cases = [(s, f) for s in args.strategies.split(",")
                 for f in (args.fractions if s in ILP_STRATEGIES else [None])]
        for strategy, fraction in cases:
            budget = int(plain_peak * (1.0 if fraction is None else fraction))
            row = base | {"strategy": strategy, "budget_fraction": fraction,
                          "budget_bytes": budget if fraction is not None else None,
                          "plain_peak_bytes": plain_peak, **how}
            t0 = time.perf_counter()
            try:
                fig = check.planned(strategy, budget, args.time_limit, offload_dir)
                row.update(grad_check(ref, fig.pop("grads"), rtol), **fig)
                row["overhead"] = fig["step_seconds"] / plain_s if plain_s else None
                if fraction is not None:
                    row["under_budget"] = fig["peak_bytes"] <= budget
            except InfeasibleBudgetError as exc:
                row.update(error=str(exc), smallest_feasible_bytes=exc.smallest_feasible_bytes)
            except Exception as exc:  # noqa: BLE001 - a failing row is a finding; keep measuring the others
                row["error"] = ("out of memory: " if is_oom(exc) else "") + "".join(
                    traceback.format_exception_only(type(exc), exc)).strip()[:2000]
            free(dev)
            row["wall_seconds"] = time.perf_counter() - t0
            emit(row)
        del check
        free(dev)
    print(f"done in {time.time() - t_start:.0f} s; wrote {args.out}", flush=True)
    return rows


if __name__ == "__main__":
    main()
