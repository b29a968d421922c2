"""Profile zoo models on CUDA and save their costs, to study the planner on GPU costs without a GPU.

    PYTHONPATH=src python benchmarks/gpu_profile_dump.py --out $OUT

For each model (default: ResNet-18 at batch 8 and 64 px, ResNet-50 at batch 184 and VGG-16 at batch 176,
224 px) it measures plain PyTorch's step (peak and median time), profiles the captured graph with operator
variants and the pinned host store's link, as ``memfit bench --device cuda`` does, and writes
``<out>/costs_<model>_<cudnn>.json.gz``: ``{"model", "batch", "image_size", "fixed_bytes" (with SGD momentum),
"plain_peak_bytes", "plain_activation_peak_bytes", "plain_step_seconds", "predicted_plain_step_seconds",
"cudnn", "costs" (:meth:`memfit.profile.costs.Costs.to_dict`)}``. cuDNN runs in deterministic mode, as in
``gpu_check.py``'s default, unless ``--cudnn default``. Load a file with ``Costs.from_dict(data["costs"])`` and plan it against the graph
of ``memfit.graph.capture.capture`` of the same zoo model built on the CPU (``gpu_replan.py solve``).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import torch

from memfit.api import offload_store, optimizer_state_bytes
from memfit.bench.harness import fresh_copy
from memfit.bench.job import measure_plain
from memfit.bench.sweep import zoo_workload
from memfit.graph.capture import capture
from memfit.profile.costs import profile_graph
from memfit.profile.link import measure_link
from memfit.runtime.overhead import price_regions
from memfit.runtime.stores import CopyEngine
from memfit.solve.strategies import make_plan


def dump(name: str, batch: int, size: int, out: Path, device: str, cudnn: str = "deterministic") -> None:
    work = zoo_workload(name, batch, size, device=device)
    base = measure_plain(work.model, work.inputs, work.target, work.loss_fn)
    store = offload_store(work.inputs, "memfit", True if device == "cuda" else None, None)
    profiled = fresh_copy(work.model)
    captured = capture(profiled)
    costs = profile_graph(captured, work.inputs, with_variants=True)
    price_regions(costs)
    if store is not None:
        costs.link = measure_link(CopyEngine(store, work.device))
    probe = torch.optim.SGD(profiled.parameters(), lr=0.01, momentum=0.9)
    fixed = costs.fixed_bytes + optimizer_state_bytes(probe, list(profiled.parameters()))
    predicted = make_plan("none", captured.graph, costs, fixed_bytes=fixed).predicted_step_seconds
    print(f"{name} b{batch} {size}px: plain step {base.step_seconds * 1e3:.1f} ms measured, "
          f"{predicted * 1e3:.1f} ms predicted; variants offered: "
          f"{sum(len(c.variants) for c in costs.nodes)}", flush=True)
    for c in costs.nodes[:5]:
        print(f"  {c.name}: fwd {c.fwd_seconds * 1e6:.0f} us bwd {c.bwd_seconds * 1e6:.0f} us ws "
              f"{c.fwd_workspace / 1e6:.0f}/{c.bwd_workspace / 1e6:.0f} MB; " + "; ".join(
                  f"{k} {v.fwd_seconds * 1e6:.0f}/{v.bwd_seconds * 1e6:.0f} us ws "
                  f"{v.fwd_workspace / 1e6:.0f}/{v.bwd_workspace / 1e6:.0f} MB" for k, v in c.variants.items()),
              flush=True)
    data = {"model": name, "batch": batch, "image_size": size, "cudnn": cudnn, "fixed_bytes": fixed,
            "plain_peak_bytes": base.peak_bytes, "plain_activation_peak_bytes": base.activation_peak_bytes,
            "plain_step_seconds": base.step_seconds, "predicted_plain_step_seconds": predicted,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "costs": costs.to_dict()}
    with gzip.open(out / f"costs_{name}_{cudnn}.json.gz", "wt") as f:
        json.dump(data, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18:8:64,resnet50:184:224,vgg16:176:224", help="name:batch:px,...")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cudnn", choices=("deterministic", "default"), default="deterministic",
                    help="cuDNN's algorithm choice (it sets the convolutions' workspace)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = args.cudnn == "deterministic"
    for spec in args.models.split(","):
        name, batch, size = spec.split(":")
        dump(name, int(batch), int(size), out, args.device, args.cudnn)
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
