"""Make region spans safe for the runtime: in-place operations must not touch a region's saved inputs."""

from __future__ import annotations

from memfit.solve.accounting import Accounting
from memfit.solve.simulator import region_of


def mutated_conflicts(acc: Accounting, spans: list[tuple[int, int]]) -> list[int]:
    """Region nodes that read a storage some node modifies in place while the storage comes from outside
    the node's region. The region would keep that storage as a checkpoint input, and the in-place update
    would make its recomputation fail PyTorch's version check, so such nodes must run outside regions."""
    reg = region_of(acc.n, spans)
    mutated: dict[int, list[int]] = {}
    for i in range(acc.n):
        for s in acc.mutates[i]:
            mutated.setdefault(s, []).append(i)
    bad = set()
    for s in mutated:
        p = acc.producer[s]
        for i in acc.consumers.get(s, []):
            if reg[i] >= 0 and (p < 0 or reg[p] != reg[i]):
                bad.add(i)
    return sorted(bad)


def legalize(acc: Accounting, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Split regions around conflicting nodes (:func:`mutated_conflicts`) until none is left; drop empty ones."""
    spans = sorted(spans)
    while True:
        bad = mutated_conflicts(acc, spans)
        if not bad:
            return spans
        i = bad[0]
        out = []
        for lo, hi in spans:
            if lo <= i <= hi:
                if lo <= i - 1:
                    out.append((lo, i - 1))
                if i + 1 <= hi:
                    out.append((i + 1, hi))
            else:
                out.append((lo, hi))
        spans = out
