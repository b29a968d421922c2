"""Smallest feasible activation budget of ``remat-ilp`` (recomputation only), ``memfit`` (with operator
variants, no offloading; first without ``conv-native``, the convolutions run with cuDNN or oneDNN off, then
with it) and ``memfit`` with blocks in row stripes too (``tiled-chain``, as ``budget="min"``
plans; for models without such blocks it equals the former) per zoo model, as a fraction of plain PyTorch's
predicted activation peak.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/floors.py resnet50:8:128 vgg16:2:128 unet:2:96
"""

import sys
import time

import torch
from _spec import without_variant

import memfit
from memfit import zoo
from memfit.solve.strategies import make_plan, smallest_feasible


def main(specs: list[str]) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    for spec in specs:
        name, batch, px = spec.split(":")
        model = zoo.build_model(name).train()
        x, y = zoo.example_batch(name, int(batch), int(px))
        loss = zoo.loss_for(name)
        t0 = time.time()
        _, captured, costs = memfit.plan(model, x, budget="100%", strategy="memfit",
                                         loss_fn=lambda out, y=y, loss=loss: loss(out, y))
        plain = make_plan("none", captured.graph, costs)
        act = plain.predicted_peak_bytes - costs.fixed_bytes
        row = [f"{name} {batch}x{px}: plain activation peak {act / 2**20:.1f} MiB"]
        no_native = without_variant(costs, "conv-native")
        for label, variants, cs in (("remat-ilp", False, costs), ("memfit without conv-native", True, no_native),
                                    ("memfit", True, costs)):
            floor = smallest_feasible(captured.graph, cs, cs.fixed_bytes, 20, use_variants=variants,
                                      use_offload=False)
            row.append(f"{label} floor {100 * (floor - costs.fixed_bytes) / act:.1f}%")
        low, _, _ = memfit.plan(model, x, budget="min", strategy="memfit", offload=False,
                                loss_fn=lambda out, y=y, loss=loss: loss(out, y))
        row.append(f"memfit with tiling floor {100 * (low.budget_bytes - costs.fixed_bytes) / act:.1f}%"
                   f" ({len(low.tiled)} block(s) striped)")
        print(", ".join(row), f"({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["resnet50:8:128", "vgg16:2:128", "unet:2:96", "googlenet:16:128", "mobilenet_v2:32:128"])
