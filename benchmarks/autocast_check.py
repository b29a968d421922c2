"""Predicted against measured peak under bfloat16 autocast (CPU) for small attention models.

For each configuration (width d, sequence length s, dropout p, LayerNorm, scaled_dot_product_attention)
it measures plain PyTorch under autocast, plans with each strategy under the same autocast (backward
outside it, as the README advises), and measures the plan: budget, predicted and measured total peak
(bytes), and whether the gradients equal plain PyTorch's.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/autocast_check.py [config index ...]
"""
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.bench.harness import compare, fresh_copy, measure_training

torch.set_num_threads(1)

class Block(nn.Module):
    def __init__(self, d, p, ln, sdpa):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.drop = nn.Dropout(p)
        self.ln = nn.LayerNorm(d) if ln else nn.Identity()
        self.sdpa, self.p = sdpa, p
        self.scale = d ** -0.5
        self.ff1, self.ff2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
    def forward(self, x):
        h = self.ln(x)
        if self.sdpa:
            a = F.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h), dropout_p=self.p if self.training else 0.0)
        else:
            a = (self.q(h) @ self.k(h).transpose(-2, -1)) * self.scale
            a = self.drop(a.softmax(-1)) @ self.v(h)
        x = x + self.o(a)
        return x + self.ff2(F.gelu(self.ff1(x)))

class Attn(nn.Module):
    def __init__(self, d=64, layers=2, p=0.0, ln=False, sdpa=False):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d, p, ln, sdpa) for _ in range(layers)])
        self.head = nn.Linear(d, 10)
    def forward(self, x):
        return self.head(self.blocks(x).mean(1))

def run(name, model, x, y, loss_fn, runs, dtype=torch.bfloat16):
    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, loss_fn, steps=1, autocast=dtype)
    worst = 0
    for strategy, budget in runs:
        m = fresh_copy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            plan, captured, _ = memfit.plan(m, x, budget, strategy=strategy, optimizer=opt,
                                            loss_fn=lambda out: loss_fn(out, y))
        planned = memfit.PlannedModule(captured, plan)
        fig = measure_training(planned, planned, (x,), y, loss_fn, steps=1, autocast=dtype)
        c = compare(base, fig)
        pred, meas = plan.predicted_peak_bytes, fig.peak_bytes
        worst = max(worst, meas - pred)
        print(f"{name:28s} {strategy:14s} {budget:4s} budget={plan.budget_bytes} pred={pred} meas={meas} "
              f"meas-pred={meas - pred} ({100 * (meas - pred) / pred:+.2f}%) meas-budget={meas - (plan.budget_bytes or 0)} "
              f"plain={base.peak_bytes} grads={c['gradients_match']} regions={len(plan.regions)}", flush=True)
    return worst

RUNS = [("none", "100%"), ("chen", "100%"), ("checkpoint-all", "100%"), ("memfit", "min"), ("remat-ilp", "min"), ("memfit", "80%")]
if __name__ == "__main__":
    torch.manual_seed(0)
    cfgs = [{"d": 64, "s": 128}, {"d": 128, "s": 64}, {"d": 128, "s": 128, "p": 0.1}, {"d": 64, "s": 64, "ln": True},
            {"d": 128, "s": 64, "sdpa": True}, {"d": 96, "s": 100, "ln": True, "p": 0.1}]
    only = [int(a) for a in sys.argv[1:]]
    for k, c in enumerate(cfgs):
        if only and k not in only:
            continue
        c = dict(c); s = c.pop("s")
        x, y = torch.randn(8, s, c["d"]), torch.randint(0, 10, (8,))
        run(f"{k}:{c}|s={s}", Attn(**c).train(), x, y, F.cross_entropy, RUNS)
