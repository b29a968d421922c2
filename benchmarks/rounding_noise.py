"""How far plain PyTorch's gradients move from themselves after the harness's training steps, for the
gradient checks of plans that are exact only to float32 rounding (``tiled-chain``): the same model and batch
trained by :func:`memfit.bench.harness.measure_training` with 1 and with 2 intra-op threads, and in float64.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/rounding_noise.py vgg16:2:128
"""

import sys

import torch

from memfit import zoo
from memfit.bench.harness import compare, fresh_copy, measure_training


def main(spec: str) -> None:
    name, batch, px = spec.split(":")
    model = zoo.build_model(name).train()
    x, y = zoo.example_batch(name, int(batch), int(px))
    loss = zoo.loss_for(name)
    runs = {}
    for label, threads, double in (("1 thread", 1, False), ("2 threads", 2, False), ("float64", 1, True)):
        torch.set_num_threads(threads)
        m = fresh_copy(model)
        inputs = (x,)
        if double:
            m, inputs = m.double(), (x.double(),)
        runs[label] = measure_training(m, m, inputs, y, loss, steps=1)
    for other in ("2 threads", "float64"):
        diff = compare(runs["1 thread"], runs[other])["max_abs_grad_diff"]
        print(f"{spec}: plain PyTorch, 1 thread against {other}: max abs gradient difference {diff:.2e}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "vgg16:2:128")
