"""Predicted against measured peak for in-place patterns of the user's own code, against plain PyTorch.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/view_update_patterns.py

Each pattern sits between two 3x3 convolutions on a ``[4, 16, 32, 32]`` activation (a view of it read after the
second convolution, where the gradient autograd makes for it is alive through that convolution's backward), planned
at ``100%`` (keeping everything: the prediction needs no headroom) and ``min``: one SGD step each, gradients compared
with plain PyTorch's, the measured total peak (exact tracker) with the predicted one and the budget. Patterns: a view
read after its base was updated in place (autograd regenerates its backward as AsStridedBackward0,
:func:`memfit.solve.accounting.regenerated_views`), an update through another view (the base's CopySlices), and
``g.add_(h)`` (a method call the name is not rebound to: :func:`memfit.solve.accounting.updated_in_place`), and
assignments into part of a tensor (``h[:, :4] = t``, ``h[h < 0] = 0``, zeros padded into: ``tests/_models.SLICE_ASSIGNMENTS``,
traced as :func:`memfit.graph.augmented.assign_into`).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch

from _models import SLICE_ASSIGNMENTS, BetweenConvolutions, plain_and_planned
from memfit.bench.harness import compare


def _slice(h, conv):
    v = h[:, :8]
    h += 1.0
    return conv(h), v.mean()


def _transpose(h, conv):
    v = h.transpose(2, 3)
    h *= 2.0
    return conv(h), v.sum() * 1e-3


def _read_before_and_after(h, conv):
    v = h[:, :8]
    s = v.mean()
    h += 1.0
    return conv(h), s + v.mean()


def _two_updates_between_reads(h, conv):
    v = h[:, :8]
    h += 1.0
    a = v.mean()
    h *= 0.5
    return conv(h), a + v.mean()


def _view_of_a_view(h, conv):
    w = h[:, :8][:, :, 1:]
    h += 1.0
    return conv(h), torch.sigmoid(w).mean()


def _update_through_another_view(h, conv):
    w = h[:, 8:]
    w *= 2.0
    return conv(h), torch.tanh(h).mean()


def _method_call_add_(h, conv):
    g = conv(h)
    g.add_(h)
    return g, 0.0


def main() -> None:
    torch.set_num_threads(1)
    print("| pattern | budget | gradients | measured peak | predicted peak | measured - predicted | budget bytes |")
    print("|---|---|---|---|---|---|---|")
    for body in (_slice, _transpose, _read_before_and_after, _two_updates_between_reads, _view_of_a_view,
                 _update_through_another_view, _method_call_add_, *SLICE_ASSIGNMENTS):
        for budget in ("100%", "min"):
            torch.manual_seed(0)
            model, x, y = BetweenConvolutions(body).train(), torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
            base, planned, fig = plain_and_planned(model, x, y, budget, strategy="none" if budget == "100%" else "memfit")
            pred = planned.plan.predicted_peak_bytes
            print(f"| {body.__name__.strip('_')} | {budget} | {'equal' if compare(base, fig)['gradients_match'] else 'DIFFER'}"
                  f" | {fig.peak_bytes} | {pred} | {fig.peak_bytes - pred:+d} | {planned.plan.budget_bytes} |", flush=True)


if __name__ == "__main__":
    main()
