"""Wall-clock timing on the device: medians of repeated calls, synchronized on CUDA."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[..., object], device: torch.device, repeats: int,
                   setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` (seconds). With ``setup``, each call is
    ``fn(setup())`` and only ``fn`` is timed (e.g. copying the inputs an in-place function overwrites)."""
    times = []
    for _ in range(repeats):
        arg = setup() if setup is not None else None
        sync(device)
        t0 = time.perf_counter()
        fn(arg) if setup is not None else fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
