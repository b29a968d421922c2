"""DistributedDataParallel's gradient buckets beside a planned step: measured against the budget, for plans made
with and without ``ddp``.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/ddp_buckets.py resnet18:16:64 --budgets 100%,min

One process, one rank (gloo on loopback), SGD with momentum, one thread, memory retained. For each DDP mode (its
default, whose buckets copy the gradients, and ``gradient_as_bucket_view=True``), each budget and each plan (made
without ``ddp``, and with ``ddp=True`` / ``ddp="bucket-views"`` for that mode) it trains four steps in DDP and prints
each step's peak: what is live at its start (parameters, buffers, optimizer state, batch, and the buckets, which
hold the gradients with bucket views; ``zero_grad()`` set the others to None) plus its rise above that (:class:`memfit.profile.tracker.MemoryTracker`).
The second step is DDP's bucket rebuild.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.distributed as dist
from _spec import zoo_setup
from torch import nn

import memfit
from memfit.bench.harness import fresh_copy
from memfit.profile.tracker import MemoryTracker, live_bytes


def step_peaks(model, planned, opt, x, y, loss, view: bool, steps: int = 4) -> tuple[list[int], list[str]]:
    """Each step's peak (bytes) of ``planned`` inside DDP, and the warnings it gave."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    ddp = nn.parallel.DistributedDataParallel(planned, gradient_as_bucket_view=view)
    peaks = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            opt.zero_grad()
            # (the buckets, and no gradient: zero_grad() set them to None, or, with bucket views, they are the buckets)
            start = live_bytes([*model.parameters(), *(() if view else (p.grad for p in model.parameters())),
                                *model.buffers(), x, y, *(t for st in opt.state.values() for t in st.values())]) + nbytes
            with MemoryTracker(torch.device("cpu")) as tracker:
                loss(ddp(x), y).backward()
                opt.step()
            peaks.append(start + tracker.peak_bytes)
    return peaks, [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="resnet18:16:64", help="model:batch:image-size")
    ap.add_argument("--budgets", default="100%,min", help="comma-separated budgets")
    args = ap.parse_args()
    model, x, y, loss = zoo_setup(args.spec)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    print(f"{args.spec}, {platform.machine()}, 1 thread, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; buckets {nbytes} B", flush=True)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous", rank=0, world_size=1)
    try:
        print("| DDP mode | budget | plan's ddp | budget (B) | step peaks (B) | worst / budget | warned |")
        print("|---|---|---|---|---|---|---|")
        for view in (False, True):
            for budget in args.budgets.split(","):
                for ddp in (False, "bucket-views" if view else True):
                    m = fresh_copy(model)
                    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
                    planned = memfit.optimize(m, x, budget, optimizer=opt, loss_fn=lambda out: loss(out, y), ddp=ddp)
                    peaks, said = step_peaks(m, planned, opt, x, y, loss, view)
                    b = planned.plan.budget_bytes
                    print(f"| {'bucket views' if view else 'default'} | {budget} | {ddp!r} | {b} | "
                          f"{', '.join(map(str, peaks))} | {max(peaks) / b:.3f}x | {'yes' if said else 'no'} |",
                          flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
