"""The link between the device and a host store: bandwidth each way and the fixed cost of one copy.

The simulator and the integer program price an offloaded activation with these figures (vDNN, Rhu et al.,
MICRO 2016, section 4; POFO, Beaumont et al., NeurIPS 2021): a copy of ``b`` bytes takes
``latency_seconds + b / bytes_per_second`` on the copy stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from memfit.profile.timing import sync


@dataclass
class LinkCost:
    """Measured copy costs between the device and one host store.

    Attributes:
        store: the store's description (``"pinned"``, ``"disk:/path"``).
        d2h_bytes_per_second: device-to-host (offload) bandwidth, bytes per second.
        h2d_bytes_per_second: host-to-device (prefetch) bandwidth, bytes per second.
        latency_seconds: fixed cost of one copy (allocation of the host buffer, launch), seconds.
    """

    store: str
    d2h_bytes_per_second: float
    h2d_bytes_per_second: float
    latency_seconds: float

    def d2h_seconds(self, nbytes: int) -> float:
        return self.latency_seconds + nbytes / self.d2h_bytes_per_second

    def h2d_seconds(self, nbytes: int) -> float:
        return self.latency_seconds + nbytes / self.h2d_bytes_per_second


def measure_link(engine, nbytes: int = 16 << 20, repeats: int = 7) -> LinkCost:
    """Time copies through ``engine`` (a :class:`memfit.runtime.stores.CopyEngine`): the fastest of
    ``repeats`` round trips of ``nbytes`` bytes, and of 4 KiB for the fixed cost.

    Returns:
        :class:`LinkCost`.
    """
    device = engine.device

    # the destination of a prefetch is allocated outside the timing: its first touch costs what allocating
    # the activation costs plain PyTorch in the forward pass, not something offloading adds
    buffers = {size: (torch.ones(size, dtype=torch.uint8, device=device), torch.zeros(size, dtype=torch.uint8,
                                                                                    device=device))
               for size in (nbytes, 4096)}

    def round_trip(size: int) -> tuple[float, float]:
        src, dst = buffers[size]
        sync(device)
        t0 = time.perf_counter()
        host = engine.wait(engine.offload(src))
        sync(device)
        t1 = time.perf_counter()
        engine.wait(engine.fetch(host, dst))
        sync(device)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    for _ in range(2):  # warm-up: first touch of the store's buffers, the worker thread, the CUDA stream
        round_trip(nbytes)
        round_trip(4096)
    big = [round_trip(nbytes) for _ in range(repeats)]
    small = [round_trip(4096) for _ in range(repeats)]
    # the fastest of the repeats: a copy slowed down by another process is noise, not the link (medians
    # of 5 varied 3x between runs on a shared 2-core machine)
    lat = min(a + b for a, b in small) / 2
    d2h = max(min(a for a, _ in big) - lat, 1e-9)
    h2d = max(min(b for _, b in big) - lat, 1e-9)
    engine.store.reset_peak()  # the probe's buffers are not part of any step
    return LinkCost(store=engine.store.describe(), d2h_bytes_per_second=nbytes / d2h,
                    h2d_bytes_per_second=nbytes / h2d, latency_seconds=lat)
