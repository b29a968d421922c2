"""Smaller inputs than planned (a last short batch, smaller images) through a planned zoo model: the measured peak
against the plan's budget and plain PyTorch's peak for those inputs, and the gradients against PyTorch's.

A plan's decisions applied to smaller tensors keep its schedule, so its peak should stay at or below the planned
one; the planned module does not warn about such inputs (only larger ones). Each model is planned at ``min`` with
SGD (momentum 0.9) and its own loss measured; one thread.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/smaller_inputs.py [--models resnet18:8:64,unet:2:64]
"""

from __future__ import annotations

import argparse
import warnings

import torch

import memfit
from memfit import zoo
from memfit.bench.harness import compare, fresh_copy, measure_training

SETUPS = "resnet18:8:64,mobilenet_v2:8:64,vgg16:2:64,unet:2:64"


def smaller(batch: int, size: int, step: int) -> list[tuple[int, int]]:
    """Smaller (batch, image size) pairs: one sample fewer, batch 2 (where it is smaller), and images ``step`` and
    ``2 * step`` smaller."""
    pairs = [(batch - 1, size), (2, size), (batch, size - step), (batch - 1, size - 2 * step)]
    return [(b, s) for b, s in pairs if b >= 1 and (b, s) != (batch, size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=SETUPS, help="comma-separated NAME:BATCH:IMAGE_SIZE")
    parser.add_argument("--budget", default="min")
    args = parser.parse_args()
    torch.set_num_threads(1)
    memfit.retain_freed_memory()
    warnings.simplefilter("ignore")
    loss = zoo.cross_entropy_loss
    print(f"{'model':13s} {'planned':>8s} {'run':>8s} {'budget B':>14s} {'measured B':>14s} {'of budget':>9s} "
          f"{'plain B':>14s} gradients")
    for setup in args.models.split(","):
        name, batch, size = setup.split(":")
        batch, size = int(batch), int(size)
        torch.manual_seed(0)
        model = zoo.build_model(name).train()
        x, y = zoo.example_batch(name, batch, size)
        m = fresh_copy(model)
        planned = memfit.optimize(m, x, args.budget, optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                                  loss_fn=lambda out, y=y: loss(out, y))
        budget = planned.plan.budget_bytes
        step = 16 if name == "unet" else 8  # (UNet's images are multiples of 16)
        for b, s in smaller(batch, size, step):
            x2, y2 = zoo.example_batch(name, b, s)
            base = measure_training(*[fresh_copy(m)] * 2, (x2,), y2, loss, steps=1)
            fig = measure_training(planned, planned, (x2,), y2, loss, steps=1)
            same = compare(base, fig)
            values = "equal" if same["gradients_match"] else f"DIFFER {same['max_abs_grad_diff']:.1e}"
            print(f"{name:13s} {batch:>3d}x{size:<4d} {b:>3d}x{s:<4d} {budget:>14,d} {fig.peak_bytes:>14,d} "
                  f"{fig.peak_bytes / budget:>9.3f} {base.peak_bytes:>14,d} {values}; "
                  f"{'UNDER' if fig.peak_bytes <= budget else 'OVER'} budget", flush=True)


if __name__ == "__main__":
    main()
