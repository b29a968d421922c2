"""What a checkpoint region costs beyond the work it recomputes, measured on this machine.

Every region of a plan runs through non-reentrant ``torch.utils.checkpoint`` and memfit's region call: in the
forward pass a checkpoint frame, the RNG-state copy and a pack hook per saved tensor; in the backward pass the
unpack hooks, the frame of the recomputation and its early stop. That is Python work, paid per region and per
node inside one, whatever the tensors' sizes: about 0.5 ms per region and 50 us per node on a 2-core x86 VM
(``benchmarks/region_overhead.py``), 1-2% of a ResNet-50 step for a plan of 16 regions over 150 nodes. The
profile's per-node times do not hold it (each node is timed alone), so the simulator and the integer program
add it from these two figures (:class:`RegionOverhead`), and prefer fewer, longer regions where the
recomputation costs the same.

Measured by timing, round-robin, one training step of a chain of tiny layers (1x1 convolution, BatchNorm,
tanh on ``[2, 8, 4, 4]``) as plain PyTorch, as one region over everything, as one region per layer, and its
forward pass alone: ``region_seconds = (each - one) / (layers - 1)`` and ``node_seconds = (one - plain -
forward - region_seconds) / nodes``, medians, clamped at 0.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from memfit.graph.calls import compute_nodes
from memfit.graph.capture import capture
from memfit.profile.timing import sync
from memfit.solve.plan import Plan

__all__ = ["RegionOverhead", "measure_region_overhead", "price_regions", "region_overhead"]


@dataclass(frozen=True)
class RegionOverhead:
    """Fixed costs of checkpoint regions on one device.

    Attributes:
        region_seconds: time each region adds to a step, whatever it holds (seconds).
        node_seconds: time each node inside a region adds beyond its own recomputation (seconds).
    """

    region_seconds: float
    node_seconds: float


class _Chain(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(8, 8, 1) for _ in range(layers)])
        self.norms = nn.ModuleList([nn.BatchNorm2d(8) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, norm in zip(self.convs, self.norms):
            x = torch.tanh(norm(conv(x)))
        return x


def measure_region_overhead(device: torch.device | str = "cpu", layers: int = 16, rounds: int = 9) -> RegionOverhead:
    """Measure :class:`RegionOverhead` on ``device`` (about ``rounds * 30`` ms on a CPU).

    Args:
        device: where the chain runs.
        layers: layers of the chain (3 nodes each).
        rounds: round-robin rounds; each times the four setups once.

    Returns:
        :class:`RegionOverhead` (medians; each figure at least 0).
    """
    device = torch.device(device)
    with torch.autocast(device.type, enabled=False):
        return _measure(device, layers, rounds)


def _measure(device: torch.device, layers: int, rounds: int) -> RegionOverhead:
    from memfit.runtime.planned import PlannedModule  # planned imports this module's package

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        chain = _Chain(layers).to(device).train()
        x = torch.randn(2, 8, 4, 4, device=device)
    captured = capture(chain)
    names = [n.name for n in compute_nodes(captured.gm)]
    per = len(names) // layers
    spans = {"one": [[names[0], names[-1]]],
             "each": [[names[i * per], names[(i + 1) * per - 1]] for i in range(layers)]}
    modules = {"plain": chain}
    modules.update({k: PlannedModule(captured, Plan(strategy="overhead", nodes=names, regions=r))
                    for k, r in spans.items()})
    # the chain's BatchNorm statistics are its own: a copy, so that nothing here touches a user's model
    saved = {k: v.clone() for k, v in chain.state_dict().items()}

    def step(module: nn.Module) -> None:
        chain.zero_grad(set_to_none=True)
        module(x).sum().backward()

    def forward() -> None:
        chain(x)

    runs = {**{k: functools.partial(step, m) for k, m in modules.items()}, "forward": forward}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for run in runs.values():  # warm-up: the first steps build caches
        run()
        run()
    for _ in range(rounds):
        for k, run in runs.items():
            sync(device)
            t0 = time.perf_counter()
            run()
            sync(device)
            times[k].append(time.perf_counter() - t0)
    chain.load_state_dict(saved)
    med = {k: statistics.median(v) for k, v in times.items()}
    region = max(0.0, (med["each"] - med["one"]) / (layers - 1))
    node = max(0.0, (med["one"] - med["plain"] - med["forward"] - region) / len(names))
    return RegionOverhead(region_seconds=region, node_seconds=node)


@functools.cache
def region_overhead(device_type: str) -> RegionOverhead:
    """:func:`measure_region_overhead` once per process and device type (``"cpu"``, ``"cuda"``). Zero when the
    environment variable ``MEMFIT_REGION_OVERHEAD=0`` is set (plans then ignore these costs, as before)."""
    if os.environ.get("MEMFIT_REGION_OVERHEAD", "1") == "0":
        return RegionOverhead(0.0, 0.0)
    return measure_region_overhead(device_type)


def price_regions(costs) -> None:
    """Set ``costs.region_seconds`` and ``costs.region_node_seconds`` (:class:`memfit.profile.costs.Costs`) from
    :func:`region_overhead` for the profile's device."""
    o = region_overhead(torch.device(costs.device).type)
    costs.region_seconds, costs.region_node_seconds = o.region_seconds, o.node_seconds
