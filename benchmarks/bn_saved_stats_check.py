"""Does ``bn-saved-stats`` reproduce PyTorch's training-mode BatchNorm output on this device, and how much
faster is it than computing the statistics again? (On the CPU: bit for bit; on CUDA it is not yet offered,
and this script is the check that would decide it.)

    PYTHONPATH=src python benchmarks/bn_saved_stats_check.py --device cuda     # through the device tool
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src python benchmarks/bn_saved_stats_check.py --device cpu

Per shape, layout and dtype: whether :func:`memfit.variants.bn_saved_stats.normalize` equals
``F.batch_norm(training=True)``'s output bit for bit (else the largest difference in ulps of the output's
dtype), and the median time of each (wall clock, synchronized on CUDA; one intra-op thread on the CPU), 20 runs.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from memfit.profile.timing import median_seconds
from memfit.variants.bn_saved_stats import normalize


def _time(fn, device: torch.device, runs: int = 20) -> float:
    fn()  # warm-up
    return median_seconds(fn, device, runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shapes = [(8, 256, 32, 32), (8, 64, 64, 64), (8, 1024, 8, 8), (3, 5, 7, 9), (64, 512), (4, 96, 33)]
    dtypes = [torch.float32, torch.float64] + ([torch.float16, torch.bfloat16] if device.type == "cuda" else [])
    if device.type == "cuda":
        print(torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version())
    for shape in shapes:
        for cl in (False, True) if len(shape) == 4 else (False,):
            for dtype in dtypes:
                x = (torch.randn(shape, device=device) * 3 + 1).to(dtype)
                if cl:
                    x = x.contiguous(memory_format=torch.channels_last)
                c = shape[1]
                w = torch.randn(c, device=device, dtype=dtype)
                b = torch.randn(c, device=device, dtype=dtype)
                _, mean, invstd, *_ = torch.ops.aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
                ref = F.batch_norm(x, None, None, w, b, training=True)
                y = normalize(x, w, b, mean, invstd).to(dtype)
                same = torch.equal(y, ref) and y.stride() == ref.stride()
                ulp = ((y.double() - ref.double()).abs() / torch.finfo(dtype).eps
                       / ref.double().abs().clamp_min(torch.finfo(dtype).tiny)).max().item()
                t_bn = _time(lambda x=x, w=w, b=b: F.batch_norm(x, None, None, w, b, training=True), device)
                t_n = _time(lambda x=x, w=w, b=b, m=mean, s=invstd: normalize(x, w, b, m, s), device)
                print(f"{device.type} {tuple(shape)} {'channels_last' if cl else 'contiguous'} {str(dtype)[6:]}: "
                      f"{'equal' if same else f'differs, max {ulp:.2f} ulp'}; batch_norm {t_bn * 1e3:.3f} ms, "
                      f"from saved statistics {t_n * 1e3:.3f} ms ({t_bn / t_n:.1f}x)", flush=True)


if __name__ == "__main__":
    main()
