"""What an out-of-place element-wise result costs on the CPU beyond the in-place form: the allocation, and, when
the allocator must take fresh memory from the system, its page faults.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/alloc_cost.py [--shape 8,256,32,32]

Times (median of 30, one thread) of ``a.add_(b)`` (in place), ``a + b`` whose result is freed at once (the
allocator recycles its memory), and ``a + b`` whose results are all kept (fresh memory each time), for the
residual addition of ResNet-50's first stage at batch 8, 128 px. The profile times each node in isolation,
where memory is recycled; in a training step it often is not. This is why ``memfit.profile.costs`` prices the
plain in-place forms at no more than the out-of-place op.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch


def median_ms(fn, n: int = 30) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8,256,32,32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = [int(s) for s in args.shape.split(",")]
    a, b = torch.randn(shape), torch.randn(shape)
    kept: list[torch.Tensor] = []
    mib = a.nbytes / 2**20
    print(f"float32 {shape} ({mib:.0f} MiB), torch {torch.__version__}, 1 thread")
    print(f"in place (a.add_(b)):               {median_ms(lambda: a.add_(b)):.2f} ms")
    print(f"out of place, memory recycled:      {median_ms(lambda: a + b):.2f} ms")
    print(f"out of place, fresh memory (kept):  {median_ms(lambda: kept.append(a + b)):.2f} ms")


if __name__ == "__main__":
    main()
