"""Time of the 1-bit-mask activations (``relu-mask``) against PyTorch's own, forward and backward, on the CPU.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/mask_backward.py --shape 32,96,64,64 --repeats 9

One intra-op thread, freed memory retained (:func:`memfit.retain_freed_memory`, so no step pays page faults).
For ReLU, ReLU6 and LeakyReLU, prints the median forward and backward times (milliseconds) of PyTorch's op and
of the mask variant, and, for the backward, of the ``torch.where`` formulation the variant used before
(the mask unpacked whole), which is what it still falls back to for a tensor that cannot be chunked.
``[32, 96, 64, 64]`` is MobileNet-V2's widest activation at batch 32, 128 px.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F

import memfit
from memfit.profile.timing import median_seconds
from memfit.variants.relu_mask import _masked, hardtanh_mask, leaky_relu_mask, relu_mask, unpack_mask

KINDS = {  # name -> (PyTorch's op, the mask variant, the variant's kind for the torch.where backward)
    "relu": (torch.relu, relu_mask, "relu"),
    "relu6": (F.relu6, lambda x: hardtanh_mask(x, 0.0, 6.0), "hardtanh"),
    "leaky_relu": (F.leaky_relu, leaky_relu_mask, "leaky_relu"),
}


def median_ms(fn, repeats: int) -> float:
    """Median of ``repeats`` calls of ``fn`` after one warm-up call (milliseconds)."""
    fn()
    return 1e3 * median_seconds(fn, torch.device("cpu"), repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32,96,64,64", help="activation shape, comma-separated")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    memfit.retain_freed_memory()
    torch.manual_seed(0)
    shape = tuple(int(s) for s in args.shape.split(","))
    x = (torch.randn(shape) * 4).requires_grad_()
    g = torch.randn(shape)
    print(f"shape {list(shape)}, float32, 1 thread, torch {torch.__version__}")
    print("| activation | PyTorch forward | mask forward | PyTorch backward | mask backward | torch.where backward |")
    print("|---|---|---|---|---|---|")
    for name, (plain, variant, kind) in KINDS.items():
        times = row_ms(plain, variant, kind, x, g, args.repeats)
        print(f"| {name} | " + " | ".join(f"{t:.1f} ms" for t in times) + " |")


def row_ms(plain, variant, kind: str, x: torch.Tensor, g: torch.Tensor, repeats: int) -> list[float]:
    """Median milliseconds: PyTorch's forward, the variant's, PyTorch's backward, the variant's, and the
    ``torch.where`` backward from the variant's saved mask."""
    y_plain, y_mask = plain(x), variant(x)
    (packed,) = y_mask.grad_fn.saved_tensors  # the 1-bit mask, ceil(numel / 8) bytes

    def where_backward():
        return _masked(unpack_mask(packed, x.numel()).view(torch.bool).view(x.shape), g, kind, 0.01)

    return [median_ms(lambda: plain(x), repeats), median_ms(lambda: variant(x), repeats),
            median_ms(lambda: torch.autograd.grad(y_plain, x, g, retain_graph=True), repeats),
            median_ms(lambda: torch.autograd.grad(y_mask, x, g, retain_graph=True), repeats),
            median_ms(where_backward, repeats)]

if __name__ == "__main__":
    main()
