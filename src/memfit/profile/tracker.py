"""An exact device-memory tracker behind one interface.

On CUDA it reads the caching allocator's counters (``torch.cuda.max_memory_allocated``). On the CPU there is
no allocator counter, so it records every allocation and free through the PyTorch profiler's memory events
(``profile_memory=True``), temporaries inside operators included, and walks them in time order.
"""

from __future__ import annotations

import bisect

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function
from typing_extensions import Self

_MARK = "memfit.mark:"


def is_out_of_memory(exc: BaseException) -> bool:
    """``exc`` says an allocation failed: Python's ``MemoryError``, ``torch.OutOfMemoryError`` (CUDA), or the CPU
    allocator's ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory"; "not enough memory" on Windows)."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator" in text and (
        "can't allocate memory" in text or "not enough memory" in text)


def live_bytes(tensors) -> int:
    """Total storage bytes of ``tensors`` (any iterable, ``None`` entries skipped), each storage counted once."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class MemoryTracker:
    """Measure the peak of device memory allocated inside a ``with`` block.

    ``peak_bytes`` is the largest amount allocated during the block *above* what was allocated when it
    started (bytes, >= 0); ``net_bytes`` is what the block left allocated (on CUDA it may be negative). Add the
    bytes live at the start (e.g. :func:`live_bytes` of parameters, gradients, optimizer state and inputs) to
    get the absolute peak. On the CPU only the blocks allocated inside the block count, and their frees: a block
    allocated before it and freed inside is not subtracted (the profiler knows the size of some such blocks and
    not of others), so neither figure goes below what the block itself allocated.

    On the CPU the block runs under the PyTorch profiler, which slows it down: never time code inside a
    tracker. Nested CPU trackers are not supported (the profiler cannot nest).

    Args:
        device: ``"cpu"``, ``"cuda"`` or a ``torch.device``.
    """

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.peak_bytes = 0
        self.net_bytes = 0
        self.events: list[tuple[int, int]] = []  # (time ns, signed bytes), CPU only
        self._prof = None

    def __enter__(self) -> Self:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._start)
            self.net_bytes = torch.cuda.memory_allocated(self.device) - self._start
            return
        self._prof.__exit__(*exc)
        if exc[0] is not None:
            return
        raw: list[tuple[int, int, int]] = []  # (time ns, signed bytes, address)
        self.ranges: dict[str, tuple[int, int]] = {}
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                raw.append((e.start_time_ns, int(e.extra_fields.alloc_size), int(e.extra_fields.ptr)))
            elif e.name.startswith(_MARK):  # a label marked several times: its last mark
                label = e.name[len(_MARK):]
                if label not in self.ranges or e.start_time_ns > self.ranges[label][0]:
                    self.ranges[label] = (e.start_time_ns, e.end_time_ns)
            stack.extend(e.children)
        raw.sort(key=lambda x: x[0])
        # only blocks allocated inside the block count, also when they are freed: the profiler reports the free
        # of a block allocated under an earlier profiler session with its size, and one allocated before any
        # with none, so a block from before the start (garbage of an earlier profiled pass, collected in the
        # middle of a training step) once lowered a measured peak by half a megabyte
        events: list[tuple[int, int]] = []
        alive: dict[int, int] = {}
        for t, size, ptr in raw:
            if size > 0:
                alive[ptr] = alive.get(ptr, 0) + size
                events.append((t, size))
            elif size < 0 and alive.get(ptr, 0) >= -size:
                alive[ptr] -= -size
                if not alive[ptr]:
                    del alive[ptr]
                events.append((t, size))
        cur = peak = 0
        for _, size in events:
            cur += size
            peak = max(peak, cur)
        self.events, self.peak_bytes, self.net_bytes = events, peak, cur

    def peak_so_far(self) -> int:
        """CUDA only: the peak bytes allocated since the block started, relative to its start, up to now."""
        return max(0, torch.cuda.max_memory_allocated(self.device) - self._start)

    def net_so_far(self) -> int:
        """CUDA only: the bytes allocated now, relative to the block's start (may be negative)."""
        return torch.cuda.memory_allocated(self.device) - self._start

    def mark(self, label: str):
        """Context manager naming a part of the block; :meth:`range_peak` then gives that part's figures.

        On CUDA, ranges are not recorded (use one tracker per part there)."""
        return record_function(_MARK + label)

    def range_peak(self, label: str, until: str | None = None) -> tuple[int, int]:
        """``(peak, net)`` bytes allocated inside the part marked ``label``, relative to its start (CPU); with
        ``until``, only up to the start of the (last) part marked ``until``."""
        start, end = self.ranges[label]
        if until is not None:
            end = self.ranges[until][0]
        times = self._times if hasattr(self, "_times") else [t for t, _ in self.events]
        self._times = times
        cur = peak = 0
        for k in range(bisect.bisect_left(times, start), bisect.bisect_right(times, end)):
            cur += self.events[k][1]
            peak = max(peak, cur)
        return peak, cur
