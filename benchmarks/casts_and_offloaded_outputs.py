"""Predicted against measured peak for the thirty-third session's two replay fixes.

* ``bf16-lm``, ``bf16-lm-tied``: a language model's embedding and output head (4000 x 64; the second with two
  pre-norm encoder layers and the embedding tied to the head) under CPU bfloat16 autocast, AdamW, ``budget="min"``,
  the forward pass and the loss inside ``torch.autocast``, ``loss.backward()`` and ``opt.step()`` outside (PyTorch's
  recipe). The head is recomputed, so nothing kept saves its weight's bfloat16 copy, which autocast's cache frees
  as the context exits. Before the fix the replay kept it through the loss's backward pass, the step's peak.
* ``vdnn-all-maps``: two pre-norm attention blocks returning per-head maps the loss squares, every node offloaded
  to a disk store (``strategy="vdnn-all"``), ``100%``. The map is a model output its attention saves, so that node's
  offloaded tensors leave the device at the end of the forward pass; before the fix the replay never released them
  there and counted them beside their prefetched copies.

The peak is measured as a training loop sees it: the bytes of everything alive before the step (parameters,
buffers, optimizer state, the batch) plus the tracked step's peak above them; gradients are compared with a plain
PyTorch step from the same weights (under the same autocast).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/casts_and_offloaded_outputs.py
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
import warnings

import torch
import torch.nn.functional as F
from loss_reach_and_attention_weights import PerHeadMaps, step_peak
from torch import nn

import memfit

VOCAB, D = 4000, 64


class EmbeddingHead(nn.Module):
    """Embedding, ``blocks`` pre-norm encoder layers, output head (tied to the embedding if ``tie``)."""

    def __init__(self, blocks: int, tie: bool):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(D, 4, 128, 0.0, batch_first=True, norm_first=True)
                                     for _ in range(blocks)])
        self.head = nn.Linear(D, VOCAB, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def case(name: str):
    """(model, x, loss_fn, held tensors, budget, bf16, strategy)."""
    torch.manual_seed(0)
    if name.startswith("bf16-lm"):
        ids, y = torch.randint(0, VOCAB, (4, 64)), torch.randint(0, VOCAB, (4, 64))
        model = EmbeddingHead(2, True) if name == "bf16-lm-tied" else EmbeddingHead(0, False)
        return (model.train(), ids, lambda out: F.cross_entropy(out.float().flatten(0, 1), y.flatten()), [y], "min",
                True, "memfit")
    ids, y = torch.randint(0, 100, (8, 128)), torch.randint(0, 100, (8, 128))
    return (PerHeadMaps().train(), ids, lambda out: F.cross_entropy(out[0].flatten(0, 1), y.flatten())
            + 0.1 * sum((w ** 2).mean() for w in out[1]), [y], "100%", False, "vdnn-all")


def main() -> None:
    torch.set_num_threads(1)
    memfit.retain_freed_memory()
    print(f"{'case':14s} {'budget':>11s} {'predicted':>11s} {'measured':>11s} {'plain':>11s} {'meas/budget':>11s} "
          f"{'pred-meas':>10s}  gradients against plain PyTorch's")
    for name in ("bf16-lm", "bf16-lm-tied", "vdnn-all-maps"):
        model, x, loss_fn, held, budget, bf16, strategy = case(name)
        plain_model = copy.deepcopy(model)
        plain_peak, plain_grads = step_peak(plain_model, plain_model, x, loss_fn,
                                        torch.optim.AdamW(plain_model.parameters(), 1e-3), held, bf16)
        opt = torch.optim.AdamW(model.parameters(), 1e-3)
        with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="memfit_bench_") as store:
            warnings.simplefilter("ignore")  # (torch.nn's attention and encoder layers are one operation to fx)
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                planned = memfit.optimize(model, x, budget, strategy=strategy, optimizer=opt, loss_fn=loss_fn,
                                          time_limit=10, offload_dir=store if strategy == "vdnn-all" else None)
            peak, grads = step_peak(planned, model, x, loss_fn, opt, held, bf16)  # (its own autocast, per step)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, plain_grads, strict=True))
        p = planned.plan
        print(f"{name:14s} {p.budget_bytes:>11,d} {p.predicted_peak_bytes:>11,d} {peak:>11,d} {plain_peak:>11,d} "
              f"{peak / p.budget_bytes:>11.4f} {p.predicted_peak_bytes - peak:>+10,d}  "
              f"max |diff| {diff:.1e} ({strategy} at {budget}; {p.counts()})")


if __name__ == "__main__":
    main()
