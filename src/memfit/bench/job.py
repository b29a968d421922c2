"""The main job behind ``memfit run``: plain PyTorch vs a plan, measured side by side, as one JSON report."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from memfit import zoo
from memfit.api import offload_store
from memfit.api import plan as make_plan_for
from memfit.bench.harness import StepFigures, compare, fresh_copy, interleaved_step_seconds, measure_training
from memfit.graph.capture import capture
from memfit.runtime.planned import PlannedModule
from memfit.solve.strategies import make_plan
from memfit.variants import VARIANTS


def rounding_sources(plan) -> list[str]:
    """What makes a plan's gradients equal PyTorch's to float rounding only, not bit for bit, as text: each operator
    variant that is not bit-exact with its count (``VariantSpec.exact``: ``"conv-native x4"``, PyTorch's own
    convolution kernels instead of cuDNN's or oneDNN's), ``"blocks in row stripes"`` (``plan.tiled``) and
    ``"BatchNorm from its output xN"`` (``plan.bn_from_output``); empty for a bit-exact plan."""
    inexact = Counter(v for v in plan.variants.values() if v in VARIANTS and not VARIANTS[v].exact)
    bfo = getattr(plan, "bn_from_output", [])
    return ([f"{v} x{n}" for v, n in sorted(inexact.items())] + (["blocks in row stripes"] if plan.tiled else [])
            + ([f"BatchNorm from its output x{len(bfo)}"] if bfo else []))


def rounds_differently(plan) -> bool:
    """True for a plan whose gradients equal PyTorch's to float rounding only (:func:`rounding_sources`)."""
    return bool(rounding_sources(plan))


def measure_plain(model: nn.Module, inputs: tuple, target, loss_fn: Callable, seed: int = 0,
                  grads_exist: bool = False) -> StepFigures:
    """Plain PyTorch's figures (peak, fixed, gradients after 3 steps) on a copy of ``model``; ``grads_exist``
    as in :func:`~memfit.bench.harness.measure_training`."""
    plain = fresh_copy(model)
    return measure_training(plain, plain, inputs, target, loss_fn, steps=1, seed=seed, grads_exist=grads_exist)


def rounding_check(model: nn.Module, plan, inputs: tuple, target, loss_fn: Callable, seed: int = 0,
                   store=None, reference=None) -> dict:
    """For a plan whose gradients are not bit-for-bit PyTorch's (:func:`rounds_differently`: row stripes sum
    the weight gradients in another order, ``conv-native`` convolves with other kernels): one step's
    gradients and BatchNorm statistics from ``model``'s weights under the plan, compared with plain PyTorch's
    in float32 and float64 (:func:`memfit.bench.peers.one_step_check`). They match when they are as close
    to the float64 values as plain PyTorch's float32 ones (within 2x and 1e-5): several steps of training
    amplify float32 rounding (VGG-16 at batch 2, 128 px: plain PyTorch with 1 and with 2 threads differed
    by 0.019 after the harness's steps; a ResNet-50 at batch 2, 32 px, is so ill-conditioned that plain
    float32 is 3.7e8 from float64 after one step), so the bit-exact check cannot tell rounding from an error
    there. Where even that is exceeded (float32 amplified beyond its noise runs' spread), the step is run again in
    float64 under the plan and compared with plain PyTorch's float64 step, which decides
    (:func:`_float64_check`). ``reference``: :func:`memfit.bench.peers.reference_grads`, computed if ``None``.

    Returns:
        :func:`memfit.bench.peers.one_step_check`'s dict, the buffers' keys included, and the float64 run's keys
        where it ran; :func:`rounding_verdict` reads the verdict off it.
    """
    from memfit.bench import peers

    reference = reference or peers.reference_grads(model, inputs, target, loss_fn, seed)
    pm = PlannedModule(capture(fresh_copy(model)), plan, offload_store=store)
    buffers: dict[str, torch.Tensor] = {}
    grads = peers.one_step_grads(pm, pm, inputs, target, loss_fn, seed, buffers)
    out = peers.one_step_check(grads, reference, buffers)
    if not (out["within_float32_noise"] and out["buffers_within_float32_noise"]):
        out.update(_float64_check(model, plan, inputs, target, loss_fn, seed, store, reference))
    return out


FLOAT64_RTOL = 1e-6


def _float64_check(model, plan, inputs, target, loss_fn, seed, store, reference) -> dict:
    """The plan's step run in float64, against plain PyTorch's float64 step (``reference``): the decisive test where
    float32's rounding is amplified beyond the noise runs' spread. The zoo's ResNet-50 at 2 x 32 px has gradients
    of 1e10 after one step; a correct plan measured 2.7x plain float32's largest distance from float64 there, and
    in float64 it equals plain PyTorch's float64 step to 0.0. Matches when every gradient and buffer is within
    ``FLOAT64_RTOL`` of the largest magnitude of its float64 value. Keys: ``float64_grads_rel``,
    ``float64_buffers_rel``, ``float64_gradients_match``, ``float64_buffers_match``, or ``float64_error`` where
    the plan does not run in float64."""
    from memfit.bench import peers

    def rel(got: dict, want: dict) -> float:
        return max((float((got[k].double() - want[k]).abs().max() / max(float(want[k].abs().max()), 1e-300))
                    for k in want if k in got), default=0.0)

    inputs64 = peers.as_float64(inputs)
    try:
        import warnings

        with warnings.catch_warnings():  # (the plan was made for float32: its figures do not hold, its values do)
            warnings.simplefilter("ignore")
            pm = PlannedModule(capture(fresh_copy(model).double()), plan, offload_store=store)
            buffers: dict[str, torch.Tensor] = {}
            grads = peers.one_step_grads(pm, pm, inputs64, target, loss_fn, seed, buffers)
    except Exception as exc:  # noqa: BLE001 - reported, and the float32 verdict stands
        return {"float64_error": f"{type(exc).__name__}: {exc}"[:300]}
    grads, buffers = peers.strip_names(grads), peers.strip_names(buffers)
    g_rel, b_rel = rel(grads, reference.grads64), rel(buffers, reference.buffers64)
    return {"float64_grads_rel": g_rel, "float64_buffers_rel": b_rel,
            "float64_gradients_match": set(grads) == set(reference.grads64) and g_rel <= FLOAT64_RTOL,
            "float64_buffers_match": b_rel <= FLOAT64_RTOL}


def rounding_rows(one: dict, buffers: bool = True) -> list[tuple[str, str]]:
    """``[(label, figures)]`` of a :func:`rounding_check`'s dict, for a report: the step against float64 beside plain
    PyTorch's float32 noise, its BatchNorm statistics likewise (with ``buffers``: the model has some), and the step
    in float64 where that ran."""
    rows = [("one step vs float64", (f"{one['vs_float64']:.2e} (plain PyTorch's float32 noise: "
                                    f"{one['float32_noise']:.2e})"))]
    if "buffers_vs_float64" in one and buffers:
        rows.append(("its BatchNorm statistics", (f"{one['buffers_vs_float64']:.2e} (plain PyTorch's float32 noise: "
                                                 f"{one['buffers_float32_noise']:.2e})")))
    if "float64_grads_rel" in one:  # float32 beyond its noise: the step in float64 under the plan decided
        rows.append(("the step in float64", (f"gradients {one['float64_grads_rel']:.1e}, BatchNorm statistics "
                                            f"{one['float64_buffers_rel']:.1e} (relative to plain PyTorch's float64 step)")))
    elif "float64_error" in one:
        rows.append(("the step in float64", f"did not run: {one['float64_error']}"))
    return rows


def rounding_verdict(one: dict) -> dict:
    """The report keys a :func:`rounding_check` decides: ``gradients_match`` and ``bn_stats_match`` (its
    ``within_float32_noise`` and ``buffers_within_float32_noise``, or, where float32 is beyond them, the float64
    run's ``float64_gradients_match`` and ``float64_buffers_match``), and ``rounding_check`` itself."""
    return {"gradients_match": bool(one["within_float32_noise"] or one.get("float64_gradients_match")),
            "bn_stats_match": bool(one["buffers_within_float32_noise"] or one.get("float64_buffers_match")),
            "rounding_check": one}


def measure_strategy(model: nn.Module, inputs: tuple, target, loss_fn: Callable, baseline: StepFigures,
                     strategy: str, budget, steps: int = 5, time_limit: float = 20.0, seed: int = 0,
                     plan_out: str | None = None, variants: bool = True, offload: bool | None = None,
                     offload_dir: str | None = None, grads_exist: bool = False, tiling: bool = True) -> dict:
    """Solve ``strategy`` for ``budget`` on a copy of ``model``, train with the plan, and report.

    Memory and gradients come from :func:`measure_training` (3 steps from the same initial weights as
    ``baseline``); the step times of plain PyTorch and of the plan come from
    :func:`interleaved_step_seconds` over ``steps`` rounds, so ``overhead`` is a ratio of medians measured
    at the same time.

    ``variants=False`` keeps the ``memfit`` strategy from using operator variants, ``tiling=False`` from
    running blocks in row stripes (as in :func:`memfit.api.plan`). ``offload`` and
    ``offload_dir`` are as in :func:`memfit.api.plan`: one host store is made for the job
    (:func:`memfit.api.offload_store`) and used by the planner (its link is measured) and by both planned
    modules, so that ``planned.host_peak_bytes`` counts the bytes it held at once during the measured steps.

    ``grads_exist`` (as in :func:`memfit.api.plan`) is used for the profile, the measured steps and the
    timing alike; ``baseline`` must have been measured with the same value (:func:`measure_plain`).

    Returns:
        The report dict of ``memfit run --json`` (see the README).

    Raises:
        memfit.InfeasibleBudgetError: no plan fits ``budget``.
    """
    device = next(model.parameters()).device
    planned_model = fresh_copy(model)
    captured = capture(planned_model)
    opt_probe = torch.optim.SGD(planned_model.parameters(), lr=0.01, momentum=0.9)
    t0 = time.perf_counter()
    store = offload_store(inputs, strategy, offload, offload_dir)
    plan, captured, costs = make_plan_for(planned_model, inputs, budget, strategy=strategy,
                                          optimizer=opt_probe, time_limit=time_limit, variants=variants,
                                          loss_fn=lambda out: loss_fn(out, target), offload=offload,
                                          offload_dir=offload_dir, grads_exist=grads_exist, _captured=captured,
                                          _store=store, tiling=tiling)
    # plain PyTorch's prediction is of the model's own graph (``captured`` may have blocks in row stripes)
    plain_predicted_s = plan.plain_step_seconds
    if plain_predicted_s is None:
        plain_predicted_s = make_plan("none", captured.graph, costs, fixed_bytes=plan.fixed_bytes).predicted_step_seconds
    solve_wall = time.perf_counter() - t0
    del opt_probe
    if plan_out:
        plan.save(plan_out)
    planned = PlannedModule(captured, plan, offload_store=store)
    if store is not None:
        store.reset_peak()  # the link measurement of the profile is not part of the step
    figures = measure_training(planned, planned, inputs, target, loss_fn, steps=1, seed=seed,
                               grads_exist=grads_exist)
    host_peak = store.peak_bytes if store is not None else 0
    check = compare(baseline, figures)
    if rounds_differently(plan):
        check.update(rounding_verdict(rounding_check(model, plan, inputs, target, loss_fn, seed, store)))
    del planned, captured, planned_model
    plain_copy, timed_copy = fresh_copy(model), fresh_copy(model)
    timed = PlannedModule(capture(timed_copy), plan, offload_store=store)
    plain_s, planned_s = interleaved_step_seconds([(plain_copy, plain_copy), (timed, timed)], inputs, target,
                                                  loss_fn, rounds=steps, grads_exist=grads_exist)
    images = inputs[0]
    return {
        "model": type(model).__name__, "batch_size": int(images.shape[0]), "input_shape": list(images.shape),
        "device": device.type, "strategy": strategy, "budget_bytes": plan.budget_bytes,
        "grads_exist": grads_exist,
        "baseline": {"peak_bytes": baseline.peak_bytes, "fixed_bytes": baseline.fixed_bytes,
                     "activation_peak_bytes": baseline.activation_peak_bytes, "step_seconds": plain_s,
                     "predicted_step_seconds": plain_predicted_s},
        "planned": {"peak_bytes": figures.peak_bytes, "activation_peak_bytes": figures.activation_peak_bytes,
                    "predicted_peak_bytes": plan.predicted_peak_bytes, "step_seconds": planned_s,
                    "predicted_step_seconds": plan.predicted_step_seconds, "host_peak_bytes": host_peak},
        "overhead": planned_s / plain_s, "offload_store": None if store is None else store.describe(),
        "solve_seconds": plan.solve_seconds, "profile_and_solve_seconds": solve_wall, "mip_gap": plan.mip_gap,
        "decisions": plan.counts(), "regions": len(plan.regions), **check,
    }


def run_job(model_name: str, batch_size: int, image_size: int, budget="50%", strategy: str = "memfit",
            steps: int = 5, device: str = "cpu", time_limit: float = 20.0, seed: int = 0,
            plan_out: str | None = None, variants: bool = True, offload: bool | None = None,
            offload_dir: str | None = None, grads_exist: bool = False, tiling: bool = True) -> dict:
    """``memfit run``: measure plain PyTorch, solve, train with the plan, check gradients.

    Args:
        model_name: a name from :data:`memfit.zoo.MODELS`.
        batch_size, image_size: the example batch (samples, pixels).
        budget: bytes or percentage of the plain peak (see :class:`memfit.Budget`).
        strategy: a name from :data:`memfit.STRATEGIES`.
        steps: timed steps per setup.
        device: ``cpu`` or ``cuda``.
        time_limit: solver time limit (seconds).
        seed: weights, batch and dropout seed.
        plan_out: also write the plan as JSON here.
        variants: let ``memfit`` use operator variants.
        tiling: let ``memfit`` run blocks of convolutions, pooling and activations in row stripes.
        offload: offload activations to a host store (``None``: on for CUDA, and on the CPU when
            ``offload_dir`` is given; the ``vdnn-*`` strategies always offload). See :func:`memfit.api.plan`.
        offload_dir: directory of the disk store (memory-mapped files) for offloaded activations.
        grads_exist: model a loop that keeps parameter gradients allocated (``zero_grad(set_to_none=False)``
            or gradient accumulation) in the profile, the plan and every measurement; default: PyTorch's
            ``zero_grad()``, which sets them to ``None``.

    Returns:
        The report dict documented in the README (``memfit run --json``).
    """
    dev = torch.device(device)
    model = zoo.build_model(model_name, seed=seed).to(dev).train()
    images, target = zoo.example_batch(model_name, batch_size, image_size, device=dev, seed=seed)
    loss_fn = zoo.loss_for(model_name)
    baseline = measure_plain(model, (images,), target, loss_fn, seed, grads_exist=grads_exist)
    report = measure_strategy(model, (images,), target, loss_fn, baseline, strategy, budget, steps, time_limit,
                              seed, plan_out, variants, offload=offload, offload_dir=offload_dir,
                              grads_exist=grads_exist, tiling=tiling)
    report["model"] = model_name
    if dev.type == "cpu":
        from memfit.profile.timing import cpu_allocator

        report["cpu_allocator"] = cpu_allocator()
    return report
