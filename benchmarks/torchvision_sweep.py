"""torchvision classification models outside the zoo at ``budget="min"``: predicted against measured peak, and
gradients and BatchNorm statistics against plain PyTorch's.

Each model (10 classes) at batch 2, 64 x 64 (ViT-B/16 built for 64 px, Inception-V3 at 96 px, GoogLeNet and
Inception-V3 without their auxiliary heads), SGD with momentum, one step beside plain PyTorch from the same weights
(``memfit.bench.harness``). A plan with a variant that rounds differently from PyTorch's kernels
(``conv-native``, striped blocks: :func:`memfit.bench.job.rounds_differently`) is judged as ``memfit bench`` judges
it: its step must be as close to float64 as plain PyTorch's float32 step (:func:`memfit.bench.job.rounding_check`;
these ill-conditioned small-batch steps amplify rounding to 1e1 after one step).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/torchvision_sweep.py [--models efficientnet_b0,swin_t]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn.functional as F
import torchvision.models as tvm

import memfit
from memfit.bench.harness import compare, fresh_copy, measure_training
from memfit.bench.job import rounding_check, rounding_verdict, rounds_differently

MODELS = ("efficientnet_b0,efficientnet_v2_s,regnet_y_400mf,regnet_x_400mf,densenet121,shufflenet_v2_x0_5,"
          "squeezenet1_0,vit_b_16,swin_t,mnasnet0_5,resnext50_32x4d,alexnet,vgg11_bn,mobilenet_v3_large,"
          "inception_v3,googlenet")


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model (train mode) and a batch of two images."""
    kw: dict = {"num_classes": 10}
    size = 64
    if name.startswith("vit"):
        kw["image_size"] = 64
    if name in ("inception_v3", "googlenet"):
        kw.update(aux_logits=False, init_weights=True)
        size = 96 if name == "inception_v3" else 64
    return getattr(tvm, name)(**kw).train(), torch.randn(2, 3, size, size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS, help="comma-separated torchvision model names")
    args = parser.parse_args()
    torch.set_num_threads(1)
    memfit.retain_freed_memory()
    warnings.simplefilter("ignore")
    print(f"{'model':20s} {'budget':>14s} {'predicted':>14s} {'measured':>14s} {'pred-meas':>9s} values")
    for name in args.models.split(","):
        start = time.time()
        torch.manual_seed(0)
        model, x = build(name)
        y = torch.randint(0, 10, (2,))
        base = measure_training(*[fresh_copy(model)] * 2, (x,), y, F.cross_entropy, steps=1)
        m = fresh_copy(model)
        plan, captured, _ = memfit.plan(m, x, "min", optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                                        loss_fn=lambda out, y=y: F.cross_entropy(out, y), time_limit=10)
        planned = memfit.PlannedModule(captured, plan)
        fig = measure_training(planned, planned, (x,), y, F.cross_entropy, steps=1)
        same = compare(base, fig)
        if same["gradients_match"] and same["bn_stats_match"]:
            values = "equal to PyTorch's (1e-5)"
        elif rounds_differently(plan):
            verdict = rounding_verdict(rounding_check(model, plan, (x,), y, F.cross_entropy))
            values = ("as close to float64 as PyTorch's" if verdict["gradients_match"] and verdict["bn_stats_match"]
                      else "DIFFER beyond rounding")
        else:
            values = f"DIFFER ({same['max_abs_grad_diff']:.1e})"
        variants = ",".join(f"{k}:{v}" for k, v in plan.counts()["variants"].items())
        print(f"{name:20s} {plan.budget_bytes:>14,d} {plan.predicted_peak_bytes:>14,d} {fig.peak_bytes:>14,d} "
              f"{plan.predicted_peak_bytes - fig.peak_bytes:>+9,d} {values}; {plan.counts()['recompute']} recomputed, "
              f"{variants or 'no variants'}; {'UNDER' if fig.peak_bytes <= plan.budget_bytes else 'OVER'} budget; "
              f"{time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
