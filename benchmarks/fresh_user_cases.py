"""Measured against predicted total peak (bytes) for the cases fresh-user runs found on 2026-11-30, each
beside plain PyTorch's gradients: tied embedding/output weights (with gradients set to None and kept
allocated), a loss that builds a soft target from the model's output, ``relu-mask`` on channels-last
activations, BatchNorms over 65536 channels and two values each, and bfloat16 autocast CNN and MLPs. Each case is
also a regression test (``tests/test_traps.py``, ``tests/test_stateful.py``, ``tests/test_autocast.py``).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/fresh_user_cases.py
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _models import ListOut, TiedLM, WideBN, channel_mix_with_relu_mask, plain_and_planned


def _max_diff(base, fig) -> float:
    return max((a - b).abs().max().item() for a, b in zip(base.grads.values(), fig.grads.values()))


def _row(case, fig, predicted, budget, base) -> None:
    print(f"| {case} | {fig.peak_bytes:,} | {predicted:,} | {budget:,} | {fig.peak_bytes - predicted:+,} | "
          f"{_max_diff(base, fig):.1e} |", flush=True)


def _planned_case(case, model, x, y, loss, budget, grads_exist=False, strategy="memfit") -> None:
    base, planned, fig = plain_and_planned(model, x, y, budget, loss=loss, grads_exist=grads_exist, strategy=strategy)
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

    torch.manual_seed(3)

    def saves_outputs(out, _target=None):
        return out[0].square().mean() + out[1].abs().mean() + out[2].sum() * 1e-3

    _planned_case("three ReLU outputs, a loss that saves two of them, `none`", ListOut().train(),
                  torch.randn(4, 3, 32, 32), None, saves_outputs, "100%", strategy="none")
    torch.manual_seed(3)
    _planned_case("the same, `remat-ilp` at min (one region over everything)", ListOut().train(),
                  torch.randn(4, 3, 32, 32), None, saves_outputs, "min", strategy="remat-ilp")

    base, fig, predicted, _ = channel_mix_with_relu_mask()
    _row("channels-last conv + ReLU after a chunk/cat mix, every ReLU `relu-mask`, no regions", fig, predicted,
         predicted, base)

    torch.manual_seed(0)
    wide = WideBN(65536).train()  # (the copies of its running statistics: half an activation)
    for strategy in ("remat-ilp", "memfit"):
        _planned_case(f"65536-channel BatchNorms at batch 2, `{strategy}` at min", wide,
                      torch.randn(2, 65536, 1, 1), torch.randn(2, 65536, 1, 1), F.mse_loss, "min", strategy=strategy)

    for budget in ("min", "70%"):
        _bf16_cnn_case(budget)

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                        nn.ReLU(), nn.Linear(1024, 10)).train()
    x = torch.randn(512, 256)
    _bf16_case("bf16 autocast MLP 256-1024-1024-1024-10, batch 512, `none`", mlp, x,
               torch.randint(0, 10, (512,)), F.cross_entropy, "100%", "none")
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(512, 2048), nn.BatchNorm1d(2048), nn.ReLU(), nn.Linear(2048, 2048),
                         nn.BatchNorm1d(2048), nn.LeakyReLU(0.1), nn.Linear(2048, 10)).train()
    _bf16_case("bf16 autocast BatchNorm1d head 512-2048-2048-10, batch 4, `none`", head, torch.randn(4, 512),
               torch.randint(0, 10, (4,)), F.cross_entropy, "100%", "none")


def _bf16_cnn_case(budget) -> None:
    """Five Conv-BatchNorm-ReLU blocks under bfloat16 autocast, planned by ``memfit`` (1-bit-mask ReLUs offered)."""
    torch.manual_seed(0)
    layers = []
    for i in range(5):
        layers += [nn.Conv2d(3 if i == 0 else 16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).train()

    def loss(out, target):
        return F.cross_entropy(out.float(), target)

    _bf16_case("bf16 autocast Conv-BN-ReLU CNN, `memfit` at " + budget, model, torch.randn(8, 3, 32, 32),
               torch.randint(0, 10, (8,)), loss, budget, "memfit")


def _bf16_case(case, model, x, y, loss, budget, strategy) -> None:
    """``case`` planned by ``strategy`` at ``budget`` under bfloat16 autocast (backward outside it)."""
    import memfit
    from memfit.bench.harness import fresh_copy, measure_training

    plain = fresh_copy(model)
    base = measure_training(plain, plain, (x,), y, loss, steps=1, autocast=torch.bfloat16)
    m = fresh_copy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        planned = memfit.optimize(m, x, budget=budget, strategy=strategy, loss_fn=lambda out: loss(out, y),
                                  optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
    fig = measure_training(planned, planned, (x,), y, loss, steps=1, autocast=torch.bfloat16)
    variants = ", ".join(f"{k} x{v}" for k, v in planned.plan.counts()["variants"].items()) or "none"
    _row(f"{case} (variants: {variants})", fig, planned.plan.predicted_peak_bytes, planned.plan.budget_bytes, base)


if __name__ == "__main__":
    main()
