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


def agrees_with_pytorch(base, fig, plan, model, inputs: tuple, target, loss_fn, store=None,
                        cache: dict | None = None) -> dict:
    """Assert that a plan's gradients and BatchNorm statistics are plain PyTorch's: to 1e-5 after the measured
    steps (``base`` against ``fig``), or, for a plan that rounds differently (``conv-native``, striped blocks:
    :func:`memfit.bench.job.rounds_differently`), over one step from ``model``'s current weights, within plain
    float32's own distance from float64 (the zoo's tiny models are ill-conditioned: ResNet-50 at 2 x 32 px,
    plain float32 is 3.7e8 from float64 after one step). ``cache``: a dict kept between calls for the same
    model, weights and batch, which then share plain PyTorch's reference steps. Returns the check's dict."""
    from memfit.bench import peers
    from memfit.bench.harness import compare
    from memfit.bench.job import rounding_check, rounding_verdict, rounds_differently

    if rounds_differently(plan):
        cache = {} if cache is None else cache
        if "reference" not in cache:
            cache["reference"] = peers.reference_grads(model, inputs, target, loss_fn)
        one = rounding_check(model, plan, inputs, target, loss_fn, store=store, reference=cache["reference"])
        verdict = rounding_verdict(one)
        assert verdict["gradients_match"] and verdict["bn_stats_match"], one
        return one
    check = compare(base, fig)
    assert check["gradients_match"] and check["bn_stats_match"], check
    assert check["max_abs_grad_diff"] <= 1e-5
    return check
