"""``memfit.profile.timing.retain_freed_memory``: after it, freeing and allocating a large tensor again takes no
page faults (glibc's default maps and unmaps it each time). Each check runs in a fresh interpreter: the setting
holds for the rest of a process."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_PROBE = """
import resource, sys
import torch
if sys.argv[1] == "retain":
    from memfit.profile.timing import cpu_allocator, retain_freed_memory
    assert retain_freed_memory() is True and retain_freed_memory() is True
    assert cpu_allocator() == "retains freed memory"
for _ in range(6):  # 64 MiB, written, freed, allocated again (the heap settles within 2 rounds)
    t = torch.empty(16 * 2**20)
    t.fill_(1.0)
    del t
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    t = torch.empty(16 * 2**20)
    t.fill_(1.0)
    del t
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="the setting is glibc's (elsewhere it returns False)")


def _faults(setting: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, setting], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@glibc
def test_retained_memory_is_reused_without_page_faults():
    pages = 5 * 64 * 2**20 // 4096  # what the five 64 MiB tensors fault on fresh memory
    assert _faults("system") > pages // 2  # the default maps each one anew (else this test proves nothing)
    # (the best of three runs: under load, twice in a fresh clone's suite, one of the five faulted anew, 16384 pages,
    # in one run of two)
    assert min(_faults("retain") for _ in range(3)) < pages // 100


def test_cpu_allocator_says_system_default_until_retained(monkeypatch):
    from memfit.profile import timing

    monkeypatch.setattr(timing, "_RETAINED", [])
    assert timing.cpu_allocator() == "system default"
    monkeypatch.setattr(timing, "_RETAINED", [False])
    assert timing.cpu_allocator() == "system default"
