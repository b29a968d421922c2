"""One convolution's backward peak (exact tracker) and forward/backward time, oneDNN against PyTorch's own kernels
(``conv-native`` on the CPU), for the shapes BENCHMARKS.md quotes: the wide, small-image layers where oneDNN's
weight reorders set the peak, and a full-resolution one where the native im2col columns do.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/conv_native_cpu.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F

from memfit.profile.timing import median_seconds
from memfit.profile.tracker import MemoryTracker
from memfit.variants.conv_split_backward import vendor_kernels_off

#: (N, C_in, C_out, H = W, kernel): a UNet bottleneck, ResNet-50's layer4 at 128 px, a UNet full-resolution layer
SHAPES = [(2, 1024, 1024, 6, 3), (8, 512, 512, 4, 3), (8, 2048, 512, 4, 1), (2, 64, 64, 96, 3)]


def _one(x, w, native: bool) -> tuple[float, float, int]:
    pad = w.shape[-1] // 2
    with vendor_kernels_off(native):
        y = F.conv2d(x, w, None, 1, pad)
        g = torch.randn_like(y)
        with MemoryTracker("cpu") as t:
            torch.autograd.grad(y, (x, w), g, retain_graph=True)
        cpu = torch.device("cpu")
        fwd = median_seconds(lambda: F.conv2d(x.detach(), w.detach(), None, 1, pad), cpu, 7)
        bwd = median_seconds(lambda: torch.autograd.grad(y, (x, w), g, retain_graph=True), cpu, 7)
    return fwd, bwd, t.peak_bytes


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print("| convolution, input | oneDNN backward peak | native backward peak | native time fwd / bwd |")
    print("|---|---|---|---|")
    for n, ci, co, h, k in SHAPES:
        x = torch.randn(n, ci, h, h, requires_grad=True)
        w = torch.randn(co, ci, k, k, requires_grad=True)
        (f0, b0, p0), (f1, b1, p1) = _one(x, w, False), _one(x, w, True)
        print(f"| {ci} -> {co}, {k}x{k}, `[{n}, {ci}, {h}, {h}]` | {p0 / 2**20:.1f} MiB | {p1 / 2**20:.1f} MiB "
              f"| {f1 / f0:.2f}x / {b1 / b0:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
