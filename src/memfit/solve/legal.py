"""Make region spans safe for the runtime: in-place operations must not touch a region's saved inputs."""

from __future__ import annotations

from memfit.solve.accounting import Accounting
from memfit.solve.simulator import region_of


def mutated_conflicts(acc: Accounting, spans: list[tuple[int, int]]) -> list[int]:
    """Region nodes that read a storage from outside their region that some node modifies in place after the
    region starts (inside the region, or after it). The region keeps that storage as a checkpoint input
    and its recomputation would read the modified value (for an input that requires grad, autograd's version
    check then fails the backward pass; for one that does not, the gradients would silently differ), so such
    nodes must run outside regions. A modification before the region
    starts is safe: the region keeps the modified value, and nothing changes it afterwards."""
    reg = region_of(acc.n, spans)
    mutated: dict[int, list[int]] = {}
    for i in range(acc.n):
        for s in acc.mutates[i]:
            mutated.setdefault(s, []).append(i)
    bad = set()
    for s, mutators in mutated.items():
        p = acc.producer[s]
        for i in acc.consumers.get(s, []):
            r = reg[i]
            if r < 0 or (p >= 0 and reg[p] == r):
                continue
            if any(k >= spans[r][0] for k in mutators):
                bad.add(i)
    return sorted(bad)


def unrecomputable(acc: Accounting, spans: list[tuple[int, int]]) -> list[int]:
    """Region nodes whose recomputation would not give what their forward gave (``Accounting.recomputable``)."""
    return [i for lo, hi in spans for i in range(lo, hi + 1) if acc.recomputable and not acc.recomputable[i]]


def legalize(acc: Accounting, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Split regions around conflicting nodes (:func:`mutated_conflicts`) and nodes that cannot be recomputed
    (:func:`unrecomputable`) until none is left; drop empty ones."""
    spans = sorted(spans)
    while True:
        bad = sorted(set(unrecomputable(acc, spans)) | set(mutated_conflicts(acc, spans)))
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
