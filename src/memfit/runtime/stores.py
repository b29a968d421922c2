"""Host stores for offloaded activations, and the copy engine that moves them on a side stream.

A store hands out flat ``uint8`` host buffers and counts the bytes it holds (``live_bytes``, ``peak_bytes``),
separately from the device's own memory, which the memory tracker counts (DESIGN.md, "What memory means").

* :class:`PinnedStore` (CUDA): page-locked host memory from PyTorch's caching host allocator, a reusable pool,
  so that copies run asynchronously (vDNN, Rhu et al., MICRO 2016, section 4.1).
* :class:`DiskStore` (CPU or CUDA): memory-mapped files in a directory the user names. On the CPU, where
  "device" and host are the same RAM, it is what makes offloading lower the process's memory: the pages
  belong to the file and the kernel can write them back to disk. The files are unlinked at once, so nothing
  is left behind, even after a crash.

:class:`CopyEngine` runs the copies concurrently with compute: on a CUDA side stream with events, on the CPU on
one worker thread (PyTorch releases the GIL inside ``copy_``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch


class HostStore:
    """Base class: allocation of host buffers and their byte counts (bytes)."""

    kind = "host"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.total_bytes = 0  # bytes written since the last reset_peak()

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A 1-D ``uint8`` host tensor of ``nbytes`` bytes; its bytes count as live until it is freed."""
        buf = self._allocate(max(1, nbytes))
        with self._lock:
            self.live_bytes += nbytes
            self.total_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(buf, self._release, nbytes)
        return buf

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes

    def reset_peak(self) -> None:
        """Start a new measurement: the peak becomes what is live now."""
        with self._lock:
            self.peak_bytes = self.live_bytes
            self.total_bytes = 0

    def _allocate(self, nbytes: int) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> str:
        return self.kind


class PinnedStore(HostStore):
    """Page-locked host memory from PyTorch's caching host allocator (reused across steps). CUDA only."""

    kind = "pinned"

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class DiskStore(HostStore):
    """Memory-mapped files in ``directory`` (created if missing), one per offloaded storage, unlinked at once.

    Mappings are recycled by size (``cached_bytes`` counts them all; :meth:`clear_cache` drops the unused).

    Args:
        directory: where the files go. A local disk or SSD; a tmpfs directory (``/dev/shm``, and ``/tmp`` on
            some systems) keeps the pages in RAM and saves nothing.

    Raises:
        OSError: the directory cannot be created or written.
    """

    kind = "disk"

    def __init__(self, directory: str | os.PathLike, remove_when_done: bool = False) -> None:
        super().__init__()
        self._free: dict[int, list[np.memmap]] = {}
        self.cached_bytes = 0  # bytes of all mappings made, in use or waiting to be reused
        if str(directory) == "":
            raise OSError("memfit: the offload directory is empty; name a directory on a local disk")
        self.directory = Path(directory)
        self.remove_when_done = remove_when_done
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(f"memfit: cannot use {self.directory} as the offload directory ({exc.strerror}); "
                          "name a writable directory on a local disk") from exc
        if not self.directory.is_dir() or not os.access(self.directory, os.W_OK):
            raise OSError(f"memfit: the offload directory {self.directory} is not a writable directory; "
                          "name another one")
        try:  # a real write: permission bits do not stop root, but /sys or a read-only mount still refuse
            with tempfile.TemporaryFile(dir=self.directory) as probe:
                probe.write(b"\0")
                probe.flush()
        except OSError as exc:
            raise OSError(f"memfit: cannot write a file in the offload directory {self.directory} "
                          f"({exc.strerror}); name a writable directory on a local disk") from exc
        if _filesystem(self.directory) == "tmpfs":
            warnings.warn(f"memfit: the offload directory {self.directory} is on a tmpfs, which keeps its files "
                          "in RAM: offloading there saves no memory. Name a directory on a disk.", stacklevel=2)
        if remove_when_done:  # a temporary directory memfit made: remove it (it is empty) with the store
            weakref.finalize(self, shutil.rmtree, str(self.directory), True)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        # a file written before is ~9x faster to write again than a fresh one (no page allocation), so
        # mappings are recycled by size: steady-state training reuses the same files every step
        with self._lock:
            free = self._free.get(nbytes)
            mapped = free.pop() if free else None
        if mapped is None:
            fd, path = tempfile.mkstemp(prefix="memfit-offload-", suffix=".bin", dir=self.directory)
            try:
                os.ftruncate(fd, nbytes)
                mapped = np.memmap(path, dtype=np.uint8, mode="r+", shape=(nbytes,))
            finally:
                os.close(fd)
                os.unlink(path)
            with self._lock:
                self.cached_bytes += nbytes
        buf = torch.from_numpy(mapped)
        weakref.finalize(buf, self._recycle, nbytes, mapped)
        return buf

    def _recycle(self, nbytes: int, mapped: np.memmap) -> None:
        with self._lock:
            self._free.setdefault(nbytes, []).append(mapped)

    def clear_cache(self) -> None:
        """Drop the recycled mappings that are not in use (their files are already deleted)."""
        with self._lock:
            for free in self._free.values():
                self.cached_bytes -= sum(m.nbytes for m in free)
            self._free.clear()

    def describe(self) -> str:
        return f"disk:{self.directory}"


def default_store(device: torch.device, directory: str | os.PathLike | None = None) -> HostStore:
    """The store memfit uses on ``device``: a :class:`DiskStore` in ``directory`` when one is named, else
    pinned memory on CUDA and a :class:`DiskStore` in a fresh temporary directory on the CPU."""
    if directory is not None:
        return DiskStore(directory)
    if device.type == "cuda":
        return PinnedStore()
    _remove_stale_directories()
    return DiskStore(tempfile.mkdtemp(prefix=f"memfit-offload-{os.getpid()}-"), remove_when_done=True)


def _remove_stale_directories() -> None:
    """Remove the empty temporary store directories of processes that no longer run (a killed process cannot
    remove its own; its files were unlinked when mapped, so only the empty directory is left)."""
    if not Path("/proc/self").exists():  # no portable way to tell whether a process runs: leave them
        return
    for d in Path(tempfile.gettempdir()).glob("memfit-offload-*-*"):
        try:
            pid = int(d.name.split("-")[2])
        except (IndexError, ValueError):
            continue
        if pid == os.getpid() or Path(f"/proc/{pid}").exists():
            continue
        try:
            d.rmdir()  # only if empty
        except OSError:
            pass


def _filesystem(path: Path) -> str:
    """The type of the file system holding ``path`` (``"tmpfs"``, ``"ext4"``, ...), from /proc/mounts; ``""``
    where that cannot be read."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return ""
    target = str(path.resolve())
    best, kind = "", ""
    for point, fstype in mounts:
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, fstype
    return kind


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat ``uint8`` tensor (a view, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class CopyEngine:
    """Copies between the device and a :class:`HostStore`, concurrent with compute.

    ``offload(src)`` starts a device-to-host copy of the ``uint8`` tensor ``src`` into a new store buffer and
    returns a ticket; ``fetch(host, dst)`` starts a host-to-device copy into ``dst``. ``wait(ticket)`` makes
    the caller's stream (CUDA) or thread (CPU) wait for the copy and returns the destination. The source of
    an offload is referenced by the ticket until :meth:`wait` returns, so its device memory is released when
    the caller drops its own references after the wait, never before the copy has read it.
    """

    def __init__(self, store: HostStore, device: torch.device) -> None:
        self.store = store
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(device=device)
        else:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-offload")

    def _side_copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        """``dst.copy_(src)`` on the side stream, after the work queued so far; the event marks its end."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def offload(self, src: torch.Tensor):
        if self.cuda:
            host = self.store.allocate(src.numel())
            return [self._side_copy(host, src), host, src]

        # the source is released by wait(), on the caller's thread: the memory tracker (the profiler) records
        # the frees of the thread it runs on only. The job takes its reference out of a box and drops it before
        # it returns: the worker thread may hold the job until after the caller's wait() returns (the executor
        # deletes its work item only then), so a reference in the job itself (a closure, an argument) freed
        # the storage on the worker, later than the plan says and unseen by the tracker
        box = [src]

        def job() -> torch.Tensor:
            data = box.pop()
            host = self.store.allocate(data.numel())
            host.copy_(data)
            return host

        return [self.pool.submit(job), None, src]

    def fetch(self, host: torch.Tensor, dst: torch.Tensor):
        if self.cuda:
            return [self._side_copy(dst, host), dst, None]
        box = [(dst, host)]  # as in offload: the job keeps no reference once it has run

        def job() -> None:
            to, frm = box.pop()
            to.copy_(frm)

        return [self.pool.submit(job), dst, None]

    def wait(self, ticket) -> torch.Tensor:
        """Wait for the copy of ``ticket``; return its destination (the host buffer of an offload, the
        device tensor of a fetch)."""
        sync, dest, _ = ticket
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(sync)
            ticket[2] = None  # the source may be freed: later kernels on this stream run after the copy
            return dest
        result = sync.result()
        ticket[2] = None
        return dest if dest is not None else result
