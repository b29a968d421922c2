"""Max-pooling on the CPU: PyTorch's own against ``maxpool-compact`` and ``maxpool-compact-cl`` (through channels-last).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/maxpool_channels_last.py

One thread, medians of 9 after a warm-up, forward (with the argmax: autograd records it) and backward, on the
max-pooling inputs of GoogLeNet at batch 16, 128 px (the stem's pools and an inception branch's pool per stage),
ResNet-50's stem at batch 8, 128 px, and VGG-16's first pool at batch 2, 128 px. Checks the three give the same
outputs and input gradients, bit for bit.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from torch import nn

from memfit.variants import VARIANTS

CASES = [  # (what, input shape, MaxPool2d arguments)
    ("GoogLeNet maxpool1", (16, 64, 64, 64), {"kernel_size": 3, "stride": 2, "ceil_mode": True}),
    ("GoogLeNet maxpool2", (16, 192, 32, 32), {"kernel_size": 3, "stride": 2, "ceil_mode": True}),
    ("GoogLeNet inception3a branch", (16, 192, 16, 16), {"kernel_size": 3, "stride": 1, "padding": 1, "ceil_mode": True}),
    ("GoogLeNet maxpool3", (16, 480, 16, 16), {"kernel_size": 3, "stride": 2, "ceil_mode": True}),
    ("GoogLeNet inception4a branch", (16, 480, 8, 8), {"kernel_size": 3, "stride": 1, "padding": 1, "ceil_mode": True}),
    ("GoogLeNet maxpool4", (16, 832, 8, 8), {"kernel_size": 2, "stride": 2, "ceil_mode": True}),
    ("GoogLeNet inception5a branch", (16, 832, 4, 4), {"kernel_size": 3, "stride": 1, "padding": 1, "ceil_mode": True}),
    ("ResNet-50 stem", (8, 64, 64, 64), {"kernel_size": 3, "stride": 2, "padding": 1}),
    ("VGG-16 pool1", (2, 64, 128, 128), {"kernel_size": 2, "stride": 2}),
]


def timed(module: nn.Module, x: torch.Tensor, g: torch.Tensor, rounds: int = 9):
    """Median forward and backward seconds, the output and the input gradient."""
    fwd, bwd = [], []
    for k in range(rounds + 1):
        leaf = x.detach().requires_grad_()
        t0 = time.perf_counter()
        y = module(leaf)
        t1 = time.perf_counter()
        (gx,) = torch.autograd.grad(y, leaf, g)
        t2 = time.perf_counter()
        if k:  # (the first round warms up)
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd), y.detach(), gx


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, 1 thread, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| pooling | input | PyTorch fwd / bwd | maxpool-compact fwd / bwd | maxpool-compact-cl fwd / bwd | equal |")
    print("|---|---|---|---|---|---|")
    for what, shape, kw in CASES:
        ref = nn.MaxPool2d(**kw)
        mods = [ref, VARIANTS["maxpool-compact"].make(ref), VARIANTS["maxpool-compact-cl"].make(ref)]
        x = torch.randn(shape)
        g = torch.randn_like(ref(x))
        res = [timed(m, x, g) for m in mods]
        equal = all(torch.equal(r[2], res[0][2]) and torch.equal(r[3], res[0][3]) for r in res[1:])
        cells = " | ".join(f"{1e3 * f:.1f} / {1e3 * b:.1f} ms" for f, b, _, _ in res)
        print(f"| {what} | `{list(shape)}` | {cells} | {equal} |", flush=True)


if __name__ == "__main__":
    main()
