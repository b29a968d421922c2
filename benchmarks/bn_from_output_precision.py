"""How far BatchNorm's gradients computed from its output are from float64's, against PyTorch's own, as the
ratio ``|bias| / |weight|`` grows, per output dtype: the measurements behind
:func:`memfit.variants.bn_from_output.condition_limit` (1024 for float32, 1 for float16 and bfloat16).

One training-mode BatchNorm2d (16 channels, input ``[8, 16, 16, 16]`` with mean 2 and standard deviation 3),
a random upstream gradient; weight and bias in float32 (autocast's mixed precision) for the half-precision
inputs. Prints, per dtype and ratio, the relative distance (Frobenius norm) of the input and weight gradients
to the float64 ones, for ``F.batch_norm`` (plain) and ``bn_from_output``; ``*`` marks ratios above the limit,
which memfit does not run from the output.

    python benchmarks/bn_from_output_precision.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from memfit.variants.bn_from_output import bn_from_output, condition_limit

RATIOS = (0.0, 1 / 64, 1 / 8, 1.0, 8.0, 64.0, 256.0, 1024.0, 4096.0)


def _grads(fn, dtype: torch.dtype, x64: torch.Tensor, dy: torch.Tensor, w64: torch.Tensor, b64: torch.Tensor):
    """Input and weight gradients of ``sum(fn(x) * dy)`` with ``x`` in ``dtype``, as float64."""
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    x = x64.to(dtype).detach().requires_grad_()
    w, b = w64.to(pdt).detach().requires_grad_(), b64.to(pdt).detach().requires_grad_()
    c = w.numel()
    out = fn(x, torch.zeros(c, dtype=pdt), torch.ones(c, dtype=pdt), w, b, True, 0.1, 1e-5)
    (out.double() * dy).sum().backward()
    return x.grad.double(), w.grad.double()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    x64 = torch.randn(8, 16, 16, 16, generator=gen, dtype=torch.float64) * 3 + 2
    dy = torch.randn(x64.shape, generator=gen, dtype=torch.float64)
    jitter = 1.0 + 0.1 * torch.rand(16, generator=gen, dtype=torch.float64)
    table = Table(title="relative distance to float64's gradients")
    for col in ("dtype", "|bias|/|weight|", "input: plain", "input: from output", "weight: plain",
                "weight: from output"):
        table.add_column(col, justify="right")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for ratio in RATIOS:
            w64 = jitter / ratio if ratio else jitter
            b64 = torch.full((16,), 1.0 if ratio else 0.0, dtype=torch.float64)
            exact = _grads(F.batch_norm, torch.float64, x64, dy, w64, b64)
            plain = _grads(F.batch_norm, dtype, x64, dy, w64, b64)
            ours = _grads(bn_from_output, dtype, x64, dy, w64, b64)

            def rel(a, b):
                return f"{float((a - b).norm() / b.norm()):.2g}"

            mark = "*" if ratio / float(jitter.min()) > condition_limit(dtype) else ""  # (|bias|/|weight| <= ratio)
            table.add_row(str(dtype).removeprefix("torch."), f"{ratio:g}{mark}", rel(plain[0], exact[0]),
                          rel(ours[0], exact[0]), rel(plain[1], exact[1]), rel(ours[1], exact[1]))
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
