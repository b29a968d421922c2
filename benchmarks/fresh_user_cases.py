"""Measured against predicted total peak (bytes) for the cases fresh-user runs found on 2026-11-30, each
beside plain PyTorch's gradients: tied embedding/output weights (with gradients set to None and kept
allocated), a loss that builds a soft target from the model's output, and ``relu-mask`` on channels-last
activations. Each case is also a regression test in ``tests/test_traps.py``.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/fresh_user_cases.py
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.bench.harness import fresh_copy, measure_training
from memfit.solve.simulator import simulate
from memfit.solve.strategies import make_plan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _models import ChannelMix, TiedLM


def _max_diff(base, fig) -> float:
    return max((a - b).abs().max().item() for a, b in zip(base.grads.values(), fig.grads.values()))


def _row(case, fig, predicted, budget, base) -> None:
    print(f"| {case} | {fig.peak_bytes:,} | {predicted:,} | {budget:,} | {fig.peak_bytes - predicted:+,} | "
          f"{_max_diff(base, fig):.1e} |", flush=True)


def _planned_case(case, model, x, y, loss, budget, grads_exist=False) -> None:
    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, loss, steps=1, grads_exist=grads_exist)
    m = fresh_copy(model)
    planned = memfit.optimize(m, x, budget=budget, grads_exist=grads_exist,
                              optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                              loss_fn=lambda out: loss(out, y))
    fig = measure_training(planned, planned, (x,), y, loss, steps=1, grads_exist=grads_exist)
    _row(case, fig, planned.plan.predicted_peak_bytes, planned.plan.budget_bytes, base)


def main() -> None:
    torch.set_num_threads(1)
    print("| case | measured | predicted | budget | measured - predicted | max abs grad diff |")
    print("|---|---|---|---|---|---|")
    torch.manual_seed(0)
    lm = TiedLM().train()
    idx, target = torch.randint(0, 512, (4, 32)), torch.randint(0, 512, (4, 32))

    def lm_loss(out, t):
        return F.cross_entropy(out.flatten(0, 1), t.flatten())

    for grads_exist in (False, True):
        for budget in ("min", "100%"):
            _planned_case(f"tied embedding/output, grads_exist={grads_exist}, `memfit` at {budget}", lm, idx,
                          target, lm_loss, budget, grads_exist)

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 2048)).train()

    def soft_target_kl(out, _target=None):
        return F.kl_div(F.log_softmax(out, -1), torch.softmax(out.detach() * 2.0, -1), reduction="batchmean")

    _planned_case("KL to a sharpened softmax of the detached logits, `memfit` at min", mlp,
                  torch.randn(128, 64), None, soft_target_kl, "min")

    torch.manual_seed(0)
    mix = ChannelMix().train()
    x, y = torch.randn(8, 3, 24, 24), torch.randint(0, 10, (8,))
    base = measure_training(*[fresh_copy(mix)] * 2, (x,), y, F.cross_entropy, steps=1)
    m = fresh_copy(mix)
    _, captured, costs = memfit.plan(m, x, budget="100%", loss_fn=lambda out: F.cross_entropy(out, y))
    plan = make_plan("none", captured.graph, costs)
    plan.variants.update({c.name: "relu-mask" for c in costs.nodes if "relu-mask" in c.variants})
    fig = measure_training(memfit.optimize(m, x, plan_=plan), m, (x,), y, F.cross_entropy, steps=1)
    momentum = sum(p.numel() * p.element_size() for p in m.parameters())
    predicted = simulate(captured.graph, costs, plan, costs.fixed_bytes + momentum).peak_bytes
    _row("channels-last conv + ReLU after a chunk/cat mix, every ReLU `relu-mask`, no regions", fig, predicted,
         predicted, base)


if __name__ == "__main__":
    main()
