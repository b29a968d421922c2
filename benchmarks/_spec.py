"""Setup shared by the benchmark scripts that take a ``model:batch:image-size`` spec (e.g. ``resnet50:8:128``)."""

from __future__ import annotations

import contextlib
import copy
import os

import torch

import memfit
from memfit import zoo
from memfit.bench.harness import compare, fresh_copy, measure_training
from memfit.profile.timing import retain_freed_memory


def zoo_setup(spec: str):
    """Seed 0, one intra-op thread and a C allocator that keeps freed memory
    (:func:`memfit.profile.timing.retain_freed_memory`, unless ``MEMFIT_SYSTEM_ALLOCATOR=1``), then the zoo model of ``spec`` in training mode, its example batch
    ``x`` (``[batch, 3, size, size]``), targets ``y`` and loss ``loss(out, y)``: ``(model, x, y, loss)``."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if os.environ.get("MEMFIT_SYSTEM_ALLOCATOR") != "1":
        retain_freed_memory()
    name, batch, px = spec.split(":")
    model = zoo.build_model(name).train()
    x, y = zoo.example_batch(name, int(batch), int(px))
    return model, x, y, zoo.loss_for(name)


def measured_setup(spec: str):
    """:func:`zoo_setup`, a header line for the run (spec, machine, torch, UTC time) printed, and plain PyTorch's
    figures from one measured step (:func:`memfit.bench.harness.measure_training`): ``(model, x, y, loss, base)``."""
    import platform
    import time

    from memfit.bench.harness import measure_training

    model, x, y, loss = zoo_setup(spec)
    print(f"{spec}, {platform.machine()}, 1 thread, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    plain = fresh_copy(model)
    return model, x, y, loss, measure_training(plain, plain, (x,), y, loss, steps=1)


def without_variant(costs, name: str):
    """A copy of ``costs`` in which no node offers operator variant ``name`` (e.g. ``"conv-native"``)."""
    out = copy.deepcopy(costs)
    for c in out.nodes:
        c.variants.pop(name, None)
    return out


def profile_once(model, x, y, loss):
    """One profile of a copy of ``model`` as ``memfit`` makes it (operator variants included), from which every
    strategy can be solved: ``(captured, costs)``."""
    _, captured, costs = memfit.plan(fresh_copy(model), x, budget="100%", strategy="memfit",
                                     loss_fn=lambda out: loss(out, y))
    return captured, costs


def memfit_options(model, x, y, loss, captured, costs):
    """The graphs :func:`memfit.plan` solves for the ``memfit`` strategy besides the traced one (blocks in row
    stripes, :func:`memfit.api.tiled_options`; BatchNorm run from its output, :func:`memfit.api.bn_from_output_option`),
    profiled once from ``captured`` and its profile ``costs``: ``(options, rounding)``, ``options`` starting with the
    traced graph itself, ``rounding`` ``None`` where the model has no BatchNorm -> in-place activation pair."""
    from memfit.api import bn_from_output_option, tiled_options
    from memfit.solve.tiling import Option

    def loss_fn(out):
        return loss(out, y)

    options = [Option(captured, costs), *tiled_options(captured, costs, (x,), loss_fn)]
    return options, bn_from_output_option(captured, costs, (x,), loss_fn)


def solve_as_planned(strategy: str, options, rounding, budget_bytes: int, time_limit: float, edit=None):
    """Solve ``strategy`` at ``budget_bytes`` as :func:`memfit.plan` does without offloading: ``memfit`` over every
    graph of ``options`` and ``rounding`` (:func:`memfit_options`; the fastest plan, the rounding one only where it
    is :data:`memfit.api.BN_FROM_OUTPUT_MARGIN` faster), any other strategy over the traced graph (``options[0]``)
    alone. ``edit(costs) -> costs`` changes every graph's profile for the solve (an ablation). Returns ``(plan,
    option)``, the option being the graph the plan runs with its profile as measured, not edited (simulate the plan
    with its ``captured.graph`` and ``costs`` for the plan's predicted time).

    Raises:
        InfeasibleBudgetError: as :func:`memfit.solve.strategies.make_plan`.
    """
    import dataclasses

    from memfit.api import BN_FROM_OUTPUT_MARGIN
    from memfit.solve.strategies import make_plan
    from memfit.solve.tiling import best_plan_rounding

    measured = {}  # id of an edited option -> the option as profiled

    def edited(option):
        if edit is None or option is None:
            return option
        out = dataclasses.replace(option, costs=edit(option.costs))
        measured[id(out)] = option
        return out

    def solve(option):
        return make_plan(strategy, option.captured.graph, option.costs, budget_bytes=budget_bytes,
                         time_limit=time_limit, use_offload=False)

    if strategy != "memfit":
        return solve(edited(options[0])), options[0]
    plan, option = best_plan_rounding([edited(o) for o in options], edited(rounding), solve, False,
                                      BN_FROM_OUTPUT_MARGIN)
    return plan, measured.get(id(option), option)


def profiled_spec(spec: str, costs_file: str | None = None):
    """:func:`zoo_setup` and :func:`profile_once` of ``spec``, with plain PyTorch's plan: ``(captured, costs, plain,
    activation)``, ``activation`` being plain PyTorch's predicted activation peak (bytes) that budgets in percent
    are fractions of. ``costs_file``: a JSON file of the profile (``Costs.to_dict``), read instead of profiling
    where it exists and written after profiling where it does not, so that runs at two commits solve the same
    measured costs."""
    import json

    from memfit.graph import capture
    from memfit.profile.costs import Costs
    from memfit.solve.strategies import make_plan

    model, x, y, loss = zoo_setup(spec)
    if costs_file and os.path.exists(costs_file):
        captured = capture(fresh_copy(model))
        with open(costs_file) as f:
            costs = Costs.from_dict(json.load(f))
    else:
        captured, costs = profile_once(model, x, y, loss)
        if costs_file:
            with open(costs_file, "w") as f:
                json.dump(costs.to_dict(), f)
    plain = make_plan("none", captured.graph, costs)
    return captured, costs, plain, plain.predicted_peak_bytes - costs.fixed_bytes


def timed_plans(model, plans, x, y, loss, rounds: int) -> list[float]:
    """Median step seconds of plain PyTorch and of each plan of ``plans`` (each run on its own copy of ``model``),
    taken round-robin (:func:`memfit.bench.harness.interleaved_step_seconds`): ``[plain, *plans]``."""
    from memfit.bench.harness import fresh_copy, interleaved_step_seconds
    from memfit.graph import capture

    setups = [(plain := fresh_copy(model), plain)]
    for plan in plans:
        m = memfit.PlannedModule(capture(fresh_copy(model)), plan)
        setups.append((m, m))
    return interleaved_step_seconds(setups, (x,), y, loss, rounds=rounds)


def against_plain(case: str, model, x, y, loss, dtype, budgets: list[str]) -> None:
    """Plan ``model`` at each budget (SGD with momentum, under ``torch.autocast`` to ``dtype`` unless ``None``),
    train one step with the plan and one with plain PyTorch, and print per budget: the budget, the predicted and the
    measured peak (bytes, the README's measurement), whether the step stayed under the budget, whether the gradients
    match, and the plan's decisions."""
    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, loss, steps=1, autocast=dtype)
    for budget in budgets:
        m = fresh_copy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        try:
            with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
                planned = memfit.optimize(m, x, budget, optimizer=opt, loss_fn=lambda out, y=y: loss(out, y))
        except memfit.InfeasibleBudgetError as e:
            print(f"{case} @ {budget}: infeasible, smallest feasible {e.smallest_feasible_bytes} B")
            continue
        fig = measure_training(planned, planned, (x,), y, loss, steps=1, autocast=dtype)
        plan = planned.plan
        print(f"{case} @ {budget}: plain {base.peak_bytes} B; budget {plan.budget_bytes} B; predicted "
              f"{plan.predicted_peak_bytes} B; measured {fig.peak_bytes} B "
              f"({fig.peak_bytes / plan.predicted_peak_bytes - 1:+.2%} of predicted; "
              f"{'under' if fig.peak_bytes <= plan.budget_bytes else 'OVER'} the budget); "
              f"gradients match: {compare(base, fig)['gradients_match']}; {plan.counts()}", flush=True)
