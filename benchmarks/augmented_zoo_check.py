"""torchvision models whose residual ``result += input`` now runs in place (as PyTorch runs it), against plain PyTorch.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/augmented_zoo_check.py

EfficientNet-B0 and ConvNeXt-Tiny (their ``+=`` follows StochasticDepth, which may return its input, so memfit
keeps it in place: :mod:`memfit.graph.augmented`), batch 2 at 32 px, planned at ``100%`` and ``min``: one SGD step
each, gradients compared with plain PyTorch's, the measured total peak (exact tracker) with the predicted one.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch
import torchvision

from _models import plain_and_planned
from memfit.bench.harness import compare


def main() -> None:
    torch.set_num_threads(1)
    print("| model | budget | gradients | max abs diff | measured peak | predicted peak | budget bytes |")
    print("|---|---|---|---|---|---|---|")
    for name in ("efficientnet_b0", "convnext_tiny"):
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(num_classes=10).train()
        x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
        for budget in ("100%", "min"):
            base, planned, fig = plain_and_planned(model, x, y, budget)
            check = compare(base, fig)
            print(f"| {name} | {budget} | {'equal' if check['gradients_match'] else 'DIFFER'} | "
                  f"{check['max_abs_grad_diff']:.1e} | {fig.peak_bytes} | {planned.plan.predicted_peak_bytes} | "
                  f"{planned.plan.budget_bytes} |", flush=True)


if __name__ == "__main__":
    main()
