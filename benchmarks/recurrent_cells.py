"""Recurrent cells called once per time step: predicted against measured peaks, and the budget.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/recurrent_cells.py [--budgets 100%,50%,min] [--cases gru:256,lstm:256:bf16,...]

A cell (``nn.GRUCell``, ``nn.LSTMCell``, ``nn.RNNCell``) called ``--steps`` times on a ``[steps, batch, 64]`` input, its
hidden states stacked and averaged for a linear head (cross-entropy), the last hidden state returned too. Each case is
``kind:batch[:bf16][:unread]`` (``bf16``: planned and trained under ``torch.autocast("cpu", dtype=torch.bfloat16)``;
``unread``: each step also computes ``h * 2.0``, which nothing reads, a leftover that plain PyTorch's peak does not
see). Per case
and budget, one SGD step (momentum 0.9) of the planned module is measured as memfit measures it
(:func:`memfit.bench.harness.measure_training`, the profiler's memory events on the CPU), and its gradients are
compared with plain PyTorch's on a copy. Prints the budget, the predicted and the measured peak (bytes), the
measured peak's difference from the prediction, and whether it is under the budget.
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


class CellLoop(nn.Module):
    """``kind`` cell (64 -> ``width``) called once per step of ``xs`` ``[steps, batch, 64]``; returns the head's
    logits ``[batch, 10]`` and the last hidden state ``[batch, width]``."""

    def __init__(self, kind: str, width: int, unread: bool = False):
        super().__init__()
        self.kind, self.unread = kind, unread
        cells = {"gru": nn.GRUCell, "lstm": nn.LSTMCell, "rnn": nn.RNNCell}
        self.cell = cells[kind](64, width)
        self.head = nn.Linear(width, 10)

    def forward(self, xs):
        h = xs.new_zeros(xs.shape[1], self.cell.hidden_size)
        c, outs = torch.zeros_like(h), []
        for x in xs.unbind(0):
            if self.kind == "lstm":
                h, c = self.cell(x, (h, c))
            else:
                h = self.cell(x, h)
            if self.unread:
                _ = h * 2.0
            outs.append(h)
        return self.head(torch.stack(outs).mean(0)), h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="gru:256,lstm:256:bf16,gru:8,lstm:8,rnn:64", help="kind:batch[:bf16][:unread], ...")
    ap.add_argument("--budgets", default="100%,50%,min")
    ap.add_argument("--steps", type=int, default=12, help="time steps")
    ap.add_argument("--width", type=int, default=128, help="hidden size")
    args = ap.parse_args()
    torch.set_num_threads(1)
    memfit.retain_freed_memory()
    warnings.simplefilter("ignore")

    def loss(out, target):
        return F.cross_entropy(out[0], target)

    for case in args.cases.split(","):
        kind, batch, *rest = case.split(":")
        dtype = torch.bfloat16 if "bf16" in rest else None
        torch.manual_seed(0)
        model = CellLoop(kind, args.width, "unread" in rest).train()
        xs, y = torch.randn(args.steps, int(batch), 64), torch.randint(0, 10, (int(batch),))
        against_plain(case, model, xs, y, loss, dtype, args.budgets.split(","))


if __name__ == "__main__":
    main()
