"""The early stop of a region's recomputation (non-reentrant ``torch.utils.checkpoint``): a region whose last
saver is a convolution never runs that convolution again, so the replay and the integer program price it at
nothing (``Accounting.stop_seconds``), and PyTorch indeed does not run it."""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memfit
from _profiled import profiled
from memfit.bench.harness import compare, measure_training
from memfit.solve.accounting import Accounting
from memfit.solve.ilp import solve_regions
from memfit.solve.plan import Plan
from memfit.solve.simulator import simulate


class ReluConv(nn.Module):
    """conv -> ReLU -> conv -> ReLU -> conv, on ``[4, 8, 16, 16]``."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.c3 = (nn.Conv2d(8, 8, 3, padding=1) for _ in range(3))

    def forward(self, x):
        return self.c3(torch.relu(self.c2(torch.relu(self.c1(x)))))


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _setup():
    torch.manual_seed(0)
    x, y = torch.randn(4, 8, 16, 16), torch.randn(4, 8, 16, 16)
    return (x, y, *profiled(ReluConv(), (x,), y, F.mse_loss, grads_exist=False))


def test_a_region_ending_at_a_convolution_does_not_run_it_again_and_is_priced_so():
    x, y, m, initial, base, captured, costs, _ = _setup()
    names = [n.name for n in captured.graph.nodes]
    relu, conv = names.index("relu"), names.index("c2")
    acc = Accounting.build(captured.graph, costs)
    assert acc.stop_seconds[conv] == 0.0 and acc.recompute_seconds[conv] > 0
    assert acc.stop_seconds[relu] == acc.recompute_seconds[relu]  # ReLU saves its output: it computes first
    free = dataclasses.replace(costs, region_seconds=0.0, region_node_seconds=0.0)
    plan = Plan.from_spans("test", names, [(relu, conv)])
    assert simulate(captured.graph, free, plan).recompute_seconds == acc.recompute_seconds[relu]
    # PyTorch: the backward under the plan runs the ReLU again but no convolution forward
    m.load_state_dict(initial)
    planned = memfit.PlannedModule(captured, plan)
    loss = F.mse_loss(planned(x), y)
    with _Count() as seen:
        loss.backward()
    assert seen.ops.count("relu") == 1, seen.ops
    assert "convolution" not in seen.ops and "conv2d" not in seen.ops, seen.ops
    # and the plan trains as PyTorch does
    m.load_state_dict(initial)
    planned = memfit.PlannedModule(captured, plan)
    assert compare(base, measure_training(planned, planned, (x,), y, F.mse_loss, steps=1))["gradients_match"]


def test_the_program_prices_the_stop_as_the_replay_does():
    captured, costs = _setup()[5:7]
    names = [n.name for n in captured.graph.nodes]
    relu, conv = names.index("relu"), names.index("c2")
    free = dataclasses.replace(costs, region_seconds=0.0, region_node_seconds=0.0)
    acc = Accounting.build(captured.graph, free)
    for spans in ([(relu, conv)], [(relu, relu)], [(0, conv)]):
        res = solve_regions(acc, 10**12, fix_spans=spans)
        sim = simulate(captured.graph, free, Plan.from_spans("test", names, spans))
        assert abs(res.objective - sim.recompute_seconds) <= 1e-5 + 1e-9 * len(names), (spans, res.objective,
                                                                                      sim.recompute_seconds)
