"""DistributedDataParallel's gradient buckets beside a planned step: measured against the budget, with and without
the advice the planned module's warning gives.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/ddp_buckets.py resnet18:4:64 --memory 200MB

One process, one rank (gloo on loopback), SGD with momentum, one thread, memory retained. For each DDP mode (its
default, whose buckets copy the gradients, and ``gradient_as_bucket_view=True``) and each plan (``100%`` of plain
PyTorch's predicted peak, as planned without DDP in mind; and the warning's advice for ``--memory`` N bytes: a budget
of N - 2 x buckets by default, N - buckets with ``grads_exist=True`` for bucket views) it trains four steps and prints
each step's peak: what is live at its start (parameters, gradients, buffers, optimizer state, batch, and the buckets,
which these do not hold in the default mode) plus its rise above that (:class:`memfit.profile.tracker.MemoryTracker`).
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
from memfit.budget import Budget
from memfit.profile.tracker import MemoryTracker, live_bytes


def step_peaks(model, planned, opt, x, y, loss, view: bool, steps: int = 4) -> tuple[list[int], list[str]]:
    """Each step's peak (bytes) of ``planned`` inside DDP, and the warnings it gave."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    ddp = nn.parallel.DistributedDataParallel(planned, gradient_as_bucket_view=view)
    peaks = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            opt.zero_grad(set_to_none=not view)
            start = live_bytes([*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(), x, y,
                                *(t for st in opt.state.values() for t in st.values())]) + (0 if view else nbytes)
            with MemoryTracker(torch.device("cpu")) as tracker:
                loss(ddp(x), y).backward()
                opt.step()
            peaks.append(start + tracker.peak_bytes)
    return peaks, [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="resnet18:4:64", help="model:batch:image-size")
    ap.add_argument("--memory", default="200MB", help="the memory N the advice fits the step in")
    args = ap.parse_args()
    model, x, y, loss = zoo_setup(args.spec)
    memory = Budget.parse(args.memory).resolve(0, 0)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    print(f"{args.spec}, {platform.machine()}, 1 thread, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; buckets {nbytes} B; N = {memory} B", flush=True)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous", rank=0, world_size=1)
    try:
        print("| DDP mode | plan | budget | step peaks (B) | worst / budget | warned |")
        print("|---|---|---|---|---|---|")
        for view in (False, True):
            for advised in (False, True):
                m = fresh_copy(model)
                opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
                budget = (memory - (nbytes if view else 2 * nbytes)) if advised else "100%"
                planned = memfit.optimize(m, x, budget, optimizer=opt, loss_fn=lambda out: loss(out, y),
                                          grads_exist=view and advised)
                peaks, said = step_peaks(m, planned, opt, x, y, loss, view)
                b = planned.plan.budget_bytes
                name = (f"N - {'' if view else '2 x '}buckets" + (", grads_exist" if view else "")) if advised else "100%"
                print(f"| {'bucket views' if view else 'default'} | {name} | {b} | {', '.join(map(str, peaks))} | "
                      f"{max(peaks) / b:.3f}x | {'yes' if said else 'no'} |", flush=True)
                if advised:
                    print(f"|  |  | N = {memory} | worst / N |  {max(peaks) / memory:.3f}x |  |")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
