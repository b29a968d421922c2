"""Shared set-up of the tests that plan by hand: plain PyTorch's figures and a profiled, traced copy."""

import copy

import torch

from memfit.api import optimizer_state_bytes
from memfit.bench.harness import fresh_copy, measure_training
from memfit.graph import capture
from memfit.profile import profile_graph


def profiled(model, inputs: tuple, target, loss_fn, grads_exist: bool = True):
    """Measure plain PyTorch on a copy of ``model`` (one SGD step with momentum), then trace and profile another
    copy with ``loss_fn(out, target)``.

    Returns:
        ``(m, initial, base, captured, costs, fixed)``: the traced copy, its initial ``state_dict`` (to reset
        it between plans), plain PyTorch's :class:`StepFigures`, the capture, its costs, and the fixed bytes
        with SGD momentum.
    """
    base = measure_training(*[fresh_copy(model)] * 2, inputs, target, loss_fn, steps=1, grads_exist=grads_exist)
    m = fresh_copy(model)
    initial = copy.deepcopy(m.state_dict())
    captured = capture(m)
    costs = profile_graph(captured, inputs, loss_fn=lambda out: loss_fn(out, target), grads_exist=grads_exist)
    fixed = costs.fixed_bytes + optimizer_state_bytes(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                                      list(m.parameters()))
    return m, initial, base, captured, costs, fixed
