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


_RETAINED: list[bool] = []


def retain_freed_memory() -> bool:
    """Make the C allocator keep the memory PyTorch frees on the CPU, so that after the first steps a training
    step takes no fresh memory from the system, as a step on CUDA takes none past PyTorch's caching allocator.

    By default glibc gives every allocation over its mmap threshold (128 KiB at first, at most 32 MiB) its own
    mapping and returns it to the system when freed, so each step pays page faults again for the activations it
    allocates: plain MobileNet-V2 at batch 32, 128 px, took 200,000 page faults and 0.6-0.9 s of system time a step,
    1.6-2.0 s in all; with this, from its third step, none, and 1.1-1.2 s, its user time (``python
    benchmarks/steady_steps.py mobilenet_v2:32:128``, 2-core VM). The faults also
    flatter a plan: it allocates less, so it pays fewer of them (MobileNet-V2's plans at 40% and 33% of the
    activation peak measured 1.01x and 1.13x with them, 1.16x and 1.33x without: ``benchmarks/ab_overhead.py``
    with ``MEMFIT_SYSTEM_ALLOCATOR=1`` and without). ``memfit run``, ``bench``, ``train``, ``plan`` and ``max-batch`` call this on the CPU
    (``--system-allocator`` to leave the allocator as it is), so that their timings, the profile's included,
    count computation as on CUDA; the memory figures are tensor storages and do not change.

    It sets ``mallopt(M_MMAP_MAX, 0)`` (no mappings of their own: every block comes from the heap, which is
    reused) and ``mallopt(M_TRIM_THRESHOLD, 2**31 - 1)`` (the heap's top is given back only beyond 2 GiB free),
    for the rest of the process; the process's resident memory then stays near its largest step's. Calling
    it again does nothing.

    Returns:
        ``True`` where the C library is glibc and took both settings, ``False`` elsewhere (macOS, musl,
        Windows: there the allocator is left as it is).
    """
    if _RETAINED:
        return _RETAINED[0]
    ok = False
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt"):
            m_trim_threshold, m_mmap_max = -1, -4  # glibc's malloc.h
            ok = bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except OSError:
        ok = False
    _RETAINED.append(ok)
    return ok


def cpu_allocator() -> str:
    """How this process's C allocator treats freed memory, for reports: ``"retains freed memory"`` after
    :func:`retain_freed_memory` took effect, else ``"system default"``."""
    return "retains freed memory" if _RETAINED and _RETAINED[0] else "system default"
