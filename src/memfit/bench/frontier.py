"""Two strategies compared at equal measured overhead: the memory one needs where the other's time is.

Issue 3's second target reads "at equal measured overhead, ``memfit`` needs at least 1.2x less activation
memory than ``remat-ilp``". Measured rows never land on the same overhead, so the comparison reads the other
strategy's memory off its measured trade-off curve: the Pareto frontier of its ``(overhead, activation
peak)`` rows (rows that another row beats in both are dropped), linearly interpolated between the two
frontier rows whose overheads bracket the one asked for. Outside the measured range there is no figure: a
frontier is not extrapolated.

This is the comparison of MONeT (Shah et al., ICLR 2021, section 5, Figure 3: memory ratio against
Checkmate at equal compute overhead), on measured instead of predicted overheads.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


def frontier(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The Pareto frontier of ``(overhead, memory)`` points: those no other point beats in both (lower
    overhead and lower memory), sorted by overhead, memory falling as overhead rises.

    Args:
        points: ``(overhead, memory)`` pairs; overhead as a ratio to plain PyTorch's step time (``1.12``),
            memory in any unit (bytes, or a fraction of plain PyTorch's activation peak).
    """
    out: list[tuple[float, float]] = []
    for t, m in sorted(points):
        if not out or m < out[-1][1]:
            out.append((t, m))
    return out


def memory_at_overhead(points: Iterable[tuple[float, float]], overhead: float) -> float | None:
    """The memory a strategy needs at ``overhead``, read off its measured frontier (:func:`frontier`).

    Args:
        points: that strategy's measured ``(overhead, memory)`` rows.
        overhead: the overhead to read the frontier at (ratio to plain PyTorch's step time).

    Returns:
        The frontier's memory there, interpolated linearly between the two frontier points around
        ``overhead`` (the point itself where one lies on it), in the unit of ``points``; ``None`` outside the
        frontier's overheads: below its fastest point no row measured is that fast, and above its slowest
        the strategy's memory is only known to be at most that point's (the frontier is not extrapolated
        either way).
    """
    front = frontier(points)
    if not front or not front[0][0] <= overhead <= front[-1][0]:
        return None
    times = [t for t, _ in front]
    k = bisect.bisect_left(times, overhead)  # times[k] >= overhead, and k > 0 unless it is equal
    if times[k] == overhead:
        return front[k][1]
    (t0, m0), (t1, m1) = front[k - 1], front[k]
    return m0 + (m1 - m0) * (overhead - t0) / (t1 - t0)
