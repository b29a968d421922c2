"""The equal-overhead comparison of issue 3 (memfit.bench.frontier): a strategy's memory read off its rows."""

from hypothesis import given
from hypothesis import strategies as st

from memfit.bench.frontier import frontier, memory_at_overhead

# remat-ilp on ResNet-50 8 x 128, measured in one process (BENCHMARKS.md, 2026-12-04, twenty-first session)
ROWS = [(1.184, 31.1), (1.165, 34.7), (1.148, 38.6), (1.124, 43.6), (1.119, 48.6)]


def test_a_row_beaten_in_both_is_not_on_the_frontier():
    assert frontier(ROWS + [(1.15, 50.0)]) == sorted(ROWS)
    assert memory_at_overhead(ROWS + [(1.15, 50.0)], 1.15) == memory_at_overhead(ROWS, 1.15)


def test_the_memory_between_two_rows_is_on_the_line_between_them():
    # memfit's 31.7% at 1.128x: between remat-ilp's 43.6% at 1.124x and 38.6% at 1.148x
    assert abs(memory_at_overhead(ROWS, 1.128) - (43.6 - 5.0 * 0.004 / 0.024)) < 1e-9
    assert memory_at_overhead(ROWS, 1.124) == 43.6
    assert memory_at_overhead(ROWS, 1.184) == 31.1


def test_no_figure_outside_the_measured_overheads():
    assert memory_at_overhead(ROWS, 1.10) is None  # faster than any row
    assert memory_at_overhead(ROWS, 1.25) is None  # slower: only an upper bound is known
    assert memory_at_overhead([], 1.1) is None
    assert memory_at_overhead([(1.1, 5.0)], 1.1) == 5.0


@given(st.lists(st.tuples(st.floats(1.0, 2.0), st.floats(0.01, 1.0)), min_size=1, max_size=12),
       st.floats(1.0, 2.0), st.floats(1.0, 2.0))
def test_more_time_never_needs_more_memory(points, a, b):
    lo, hi = sorted((a, b))
    m_lo, m_hi = memory_at_overhead(points, lo), memory_at_overhead(points, hi)
    if m_lo is not None and m_hi is not None:
        assert m_hi <= m_lo + 1e-12
    front = frontier(points)
    for m in (m_lo, m_hi):  # within the frontier's memories
        if m is not None:
            assert front[-1][1] - 1e-12 <= m <= front[0][1] + 1e-12
