"""The main job behind ``memfit run``: plain PyTorch vs a plan, measured side by side, as one JSON report."""

from __future__ import annotations

import time

import torch

from memfit import zoo
from memfit.api import plan as make_plan_for
from memfit.bench.harness import compare, fresh_copy, measure_training
from memfit.graph.capture import capture
from memfit.runtime.planned import PlannedModule


def run_job(model_name: str, batch_size: int, image_size: int, budget="50%", strategy: str = "memfit",
            steps: int = 3, device: str = "cpu", time_limit: float = 20.0, seed: int = 0,
            plan_out: str | None = None) -> dict:
    """Measure plain PyTorch, solve, train ``steps`` steps with the plan, check gradients.

    Args:
        model_name: a name from :data:`memfit.zoo.MODELS`.
        batch_size, image_size: the example batch (samples, pixels).
        budget: bytes or percentage of the plain peak (see :class:`memfit.Budget`).
        strategy: a name from :data:`memfit.STRATEGIES`.
        steps: timed steps per setup (after one warm-up step and one tracked step).
        device: ``cpu`` or ``cuda``.
        time_limit: solver time limit (seconds).
        seed: weights, batch and dropout seed.
        plan_out: also write the plan as JSON here.

    Returns:
        The report dict documented in the README (``memfit run --json``).
    """
    dev = torch.device(device)
    model = zoo.build_model(model_name, seed=seed).to(dev).train()
    images, target = zoo.example_batch(model_name, batch_size, image_size, device=dev, seed=seed)
    loss_fn = zoo.loss_for(model_name)
    inputs = (images,)
    baseline = measure_training(fresh := fresh_copy(model), fresh, inputs, target, loss_fn, steps, seed)
    del fresh
    planned_model = fresh_copy(model)
    captured = capture(planned_model)
    opt_probe = torch.optim.SGD(planned_model.parameters(), lr=0.01, momentum=0.9)
    t0 = time.perf_counter()
    plan, captured, _costs = make_plan_for(planned_model, inputs, budget, strategy=strategy, optimizer=opt_probe,
                                          time_limit=time_limit, _captured=captured)
    solve_wall = time.perf_counter() - t0
    del opt_probe
    if plan_out:
        plan.save(plan_out)
    planned = PlannedModule(captured, plan)
    figures = measure_training(planned, planned, inputs, target, loss_fn, steps, seed)
    check = compare(baseline, figures)
    return {
        "model": model_name, "batch_size": batch_size, "input_shape": list(images.shape),
        "device": dev.type, "strategy": strategy, "budget_bytes": plan.budget_bytes,
        "baseline": {"peak_bytes": baseline.peak_bytes, "fixed_bytes": baseline.fixed_bytes,
                     "activation_peak_bytes": baseline.activation_peak_bytes,
                     "step_seconds": baseline.step_seconds},
        "planned": {"peak_bytes": figures.peak_bytes, "activation_peak_bytes": figures.activation_peak_bytes,
                    "predicted_peak_bytes": plan.predicted_peak_bytes, "step_seconds": figures.step_seconds,
                    "predicted_step_seconds": plan.predicted_step_seconds},
        "overhead": figures.step_seconds / baseline.step_seconds,
        "solve_seconds": plan.solve_seconds, "profile_and_solve_seconds": solve_wall, "mip_gap": plan.mip_gap,
        "decisions": plan.counts(), **check,
    }
