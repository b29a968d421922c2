"""Predicted against measured peaks where a parameter's gradient is summed from several contributions.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/weight_sums.py [--cases tied-float,both:256,...] [--budgets 100%,min]

Each case plans one model at each budget, trains one SGD step with the plan and one with plain PyTorch (the same
autocast state), and prints the budget, the predicted and the measured peak (bytes), whether the gradients match and
the plan's decisions:

* ``tied-float[:bf16]``: a language model whose output layer reads the embedding's weight through ``.float()``
  (the parameter itself, for a float32 weight); vocabulary 8,000, width 256, 4 x 64 tokens.
* ``both:WIDTH``: under bf16 autocast, a ``Linear`` (WIDTH x WIDTH) applied three times as a module (autocast's cached
  copy of its weight) and three times through ``F.linear(h, self.lin.weight.to(torch.bfloat16))``; batch 256.
* ``gru-fp32-last``: under bf16 autocast, a ``GRUCell`` loop (batch 32, 12 steps) whose last step runs in float32
  inside ``torch.autocast(enabled=False)`` (a ``torch.fx.wrap`` function).
* ``wsum``: a ``Linear`` whose weight the forward also reads as ``self.lin.weight.sum()``; batch 256.
* ``rnn-last[:bf16]``: an ``nn.RNNCell`` loop (batch 64, 12 steps), the last state to a head.
"""

from __future__ import annotations

import argparse
import os
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from _spec import against_plain
from torch import nn

import memfit


class TiedFloat(nn.Module):
    def __init__(self, vocab=8000, width=256):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, ids):
        h = self.emb(ids)
        for _ in range(2):
            h = h + self.fc2(F.gelu(self.fc1(self.ln(h))))
        return F.linear(h, self.emb.weight.float())


class Both(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inp, self.lin, self.head = nn.Linear(64, width), nn.Linear(width, width), nn.Linear(width, 10)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(3):
            h = torch.tanh(self.lin(h))
            h = torch.tanh(F.linear(h, self.lin.weight.to(torch.bfloat16)))
        return self.head(h)


def float32_cell(cell, x, h):
    with torch.autocast("cpu", enabled=False):
        return cell(x.float(), h.float())


torch.fx.wrap("float32_cell")


class CellLoop(nn.Module):
    def __init__(self, kind, last_float32=False):
        super().__init__()
        self.last_float32 = last_float32
        self.cell = {"gru": nn.GRUCell, "rnn": nn.RNNCell}[kind](32, 128)
        self.head = nn.Linear(128, 10)

    def forward(self, xs):
        h = xs.new_zeros(xs.shape[1], 128)
        for t in range(xs.shape[0] - 1):
            h = self.cell(xs[t], h)
        h = float32_cell(self.cell, xs[-1], h) if self.last_float32 else self.cell(xs[-1], h)
        return self.head(h)


class WeightSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.lin, self.head = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x):
        return self.head(torch.relu(self.lin(self.inp(x)))) * self.lin.weight.sum()


def _token_loss(out, target):
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


def case(name: str):
    """``(model, inputs, targets, loss, autocast dtype)`` for a case name."""
    kind, *rest = name.split(":")
    gen = torch.Generator().manual_seed(0)
    if kind == "tied-float":
        ids = torch.randint(0, 8000, (4, 64), generator=gen)
        return TiedFloat(), ids, torch.randint(0, 8000, (4, 64), generator=gen), _token_loss, (
            torch.bfloat16 if rest else None)
    if kind == "both":
        return (Both(int(rest[0])), torch.randn(256, 64, generator=gen), torch.randint(0, 10, (256,), generator=gen),
                F.cross_entropy, torch.bfloat16)
    if kind in ("gru-fp32-last", "rnn-last"):
        xs = torch.randn(12, 32 if kind.startswith("gru") else 64, 32, generator=gen)
        model = CellLoop("gru", True) if kind.startswith("gru") else CellLoop("rnn")
        dtype = torch.bfloat16 if kind.startswith("gru") or rest else None
        return model, xs, torch.randint(0, 10, (xs.shape[1],), generator=gen), F.cross_entropy, dtype
    if kind == "wsum":
        return WeightSum(), torch.randn(256, 64, generator=gen), torch.randint(0, 10, (256,), generator=gen), \
            F.cross_entropy, None
    raise SystemExit(f"unknown case {name!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="tied-float,tied-float:bf16,both:256,both:1024,gru-fp32-last,wsum,rnn-last,"
                                       "rnn-last:bf16")
    ap.add_argument("--budgets", default="100%,min")
    args = ap.parse_args()
    torch.set_num_threads(1)
    memfit.retain_freed_memory()
    warnings.simplefilter("ignore")
    for name in args.cases.split(","):
        torch.manual_seed(0)
        model, x, y, loss, dtype = case(name)
        model.train()
        against_plain(name, model, x, y, loss, dtype, args.budgets.split(","))


if __name__ == "__main__":
    main()
