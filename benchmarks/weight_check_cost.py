"""What the BatchNorm-from-output weight guard costs a training step: :class:`memfit.graph.bn_output.WeightCheck`
over every BatchNorm of a torchvision model, timed after a weight change (each optimizer step: every weight's
version counter moves) and without one (a recomputation, a frozen model). Median of 50, one thread.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/weight_check_cost.py [--model mobilenet_v2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torchvision

from memfit.graph.bn_output import WeightCheck


def _median_ms(fn, rounds: int = 50) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v2", help="a torchvision.models builder")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = getattr(torchvision.models, args.model)()
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    check = WeightCheck(bns)

    def forward_pass():  # what the rewritten BatchNorms ask in one forward pass
        for k in range(len(bns)):
            check.bad(k)

    def after_a_step():
        with torch.no_grad():
            for bn in bns:
                bn.weight.add_(0)  # moves the version counter, as an optimizer step does
        forward_pass()

    forward_pass()
    print(f"{args.model}: {len(bns)} BatchNorms; a forward pass's checks after a weight change "
          f"{_median_ms(after_a_step):.3f} ms (the in-place add of each weight included), "
          f"without one {_median_ms(forward_pass):.3f} ms")


if __name__ == "__main__":
    main()
