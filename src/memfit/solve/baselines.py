"""Heuristic strategies, each returning region spans for the same runtime as the integer program."""

from __future__ import annotations

import math

from memfit.graph.ir import Graph
from memfit.solve.accounting import Accounting


def chen_spans(acc: Accounting) -> list[tuple[int, int]]:
    """Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost", section 4.1): split the forward
    order into about sqrt(n) segments of equal length and checkpoint each one, so only segment inputs are
    kept. The segment length counts nodes that save tensors, so views and additions do not skew it."""
    heavy = [i for i in range(acc.n) if acc.saves[i]]
    if not heavy:
        return []
    k = max(1, round(math.sqrt(len(heavy))))
    per = math.ceil(len(heavy) / k)
    spans = []
    start = 0
    for j in range(per, len(heavy) + per, per):
        end = heavy[j] - 1 if j < len(heavy) else acc.n - 1
        if end >= start:
            spans.append((start, end))
        start = end + 1
    return spans


def block_spans(graph: Graph) -> list[tuple[int, int]]:
    """``checkpoint-all``: every block (a top-level child or a numbered stage such as ``layer1.0``) of the
    model is its own checkpoint region, as users do with ``torch.utils.checkpoint`` around each block."""
    spans = []
    start = 0
    for i in range(1, len(graph.nodes) + 1):
        if i == len(graph.nodes) or graph.nodes[i].block != graph.nodes[start].block:
            spans.append((start, i - 1))
            start = i
    return spans
