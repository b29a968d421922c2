"""BatchNorm run from its output, through a whole model: how far one step's weight gradient of a BatchNorm whose
``|bias| / |weight|`` is set after planning lands from float64's, against plain float32's. The measurements behind
:data:`memfit.variants.bn_from_output.CONDITION_LIMIT` (32).

A MobileNet-style net (four conv -> BatchNorm -> in-place ReLU6 blocks, 32 and 64 channels, a linear head;
batch 16 at 64 px), BatchNorm weights in [1, 2) and biases in [0, 0.5); a plan at 80% with every BatchNorm run
from its output (the 1% margin the planner asks of that graph lifted). Then the last BatchNorm's weight is set to
``w`` and its bias to ``ratio * w``, and the runtime's weight guard is lifted so that the rewritten BatchNorm runs
at every ratio (memfit itself runs it as PyTorch's own above the limit). One step from identical weights; the
relative distance (Frobenius norm) of that weight gradient to float64's, and plain float32's worst parameter.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bn_from_output_model_precision.py
"""

from __future__ import annotations

import copy
import os
import warnings
from unittest import mock

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

import memfit

CASES = ((0.1, 8), (0.1, 16), (0.01, 32), (0.01, 64), (0.01, 100), (0.01, 128), (1e-3, 500), (1e-3, 1020))


class _Block(nn.Sequential):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out),
                         nn.ReLU6(inplace=True))


class _Net(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.body = nn.Sequential(_Block(3, width, 1), _Block(width, width, 1), _Block(width, 2 * width, 2),
                                  _Block(2 * width, 2 * width, 1))
        self.fc = nn.Linear(2 * width, 10)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.body(x), 1).flatten(1))


def _grads(module: nn.Module, params: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    params.zero_grad(set_to_none=True)
    F.cross_entropy(module(x), y).backward()
    return {k: p.grad.double().clone() for k, p in params.named_parameters()}


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = _Net().train()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for bn in (m for m in base.modules() if isinstance(m, nn.BatchNorm2d)):
            bn.weight.copy_(1 + torch.rand(bn.num_features, generator=gen))
            bn.bias.copy_(0.5 * torch.rand(bn.num_features, generator=gen))
    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
    ours = copy.deepcopy(base)
    with mock.patch("memfit.api.BN_FROM_OUTPUT_MARGIN", -1.0):
        planned = memfit.optimize(ours, x, budget="80%", loss_fn=lambda out: F.cross_entropy(out, y))
    print("BatchNorms run from their output:", planned.plan.bn_from_output)
    last = base.body[3][1]
    table = Table(title="one step's weight gradient of body.3.1, relative distance to float64's")
    for col in ("weight", "|bias|/|weight|", "from output", "plain float32", "plain float32's worst parameter"):
        table.add_column(col, justify="right")
    with mock.patch("memfit.variants.bn_from_output.CONDITION_LIMIT", float("inf")), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for w, ratio in CASES:
            with torch.no_grad():
                last.weight.fill_(w)
                last.bias.fill_(w * ratio)
            ours.load_state_dict(base.state_dict())
            plain, f64 = copy.deepcopy(base), copy.deepcopy(base).double()
            g_ours, g_plain, g64 = _grads(planned, ours, x, y), _grads(plain, plain, x, y), _grads(f64, f64, x.double(), y)

            def rel(g, k, g64=g64):
                return float((g[k] - g64[k]).norm() / g64[k].norm())

            key = "body.3.1.weight"
            worst = max(rel(g_plain, k) for k in g64)
            table.add_row(f"{w:g}", f"{ratio:g}", f"{rel(g_ours, key):.2g}", f"{rel(g_plain, key):.2g}", f"{worst:.2g}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
