"""``memfit bench``: every strategy at every budget, and the peers, measured side by side in one process.

Budgets here are fractions of plain PyTorch's measured **activation** peak (not of the total peak, as in
``memfit run --budget 40%``): a fraction ``f`` becomes the total-peak bound
``fixed bytes + f * plain activation peak`` (bytes), which is what memfit's planner takes.

The model is profiled once per sweep; each strategy and budget is then only solved
(:func:`memfit.solve.strategies.make_plan`) and measured: memory and gradients with
:func:`~memfit.bench.harness.measure_training` (3 steps from the same initial weights as plain PyTorch),
time with :func:`~memfit.bench.harness.interleaved_step_seconds` against a fresh plain copy, so that
``overhead`` is a ratio of medians measured at the same time.

Each row of the result is the ``memfit run --json`` report (README) with these keys added:

* ``budget_fraction``: the fraction of plain PyTorch's activation peak the row was asked to fit
  (``null`` for strategies that do not read a budget: ``none``, ``chen``, ``checkpoint-all``, ``vdnn-all``,
  ``vdnn-conv``, measured once, and for the one row of a peer that cannot run here); for ``torch-budget`` rows it is the value
  of ``activation_memory_budget`` (PyTorch's own knob, a fraction of the activations its default
  partitioner saves) and ``budget_bytes`` is ``null``.
* ``backend``: ``eager`` (memfit's runtime: ``torch.utils.checkpoint`` regions),
  ``aot_eager_decomp_partition`` or ``inductor`` (``torch.compile`` backends of ``torch-budget``),
  ``rockmate``.
* ``error``: ``null``, or why the row has no measurement (e.g. an infeasible budget; then
  ``smallest_feasible_bytes`` and ``smallest_feasible_fraction`` say what would fit).
* ``under_budget``: measured total peak <= ``budget_bytes`` (``null`` without a byte budget).
* ``offload_store``: the host store offloaded activations went to (``"pinned"``, ``"disk:/path"``), or
  ``null`` when the row's plan could not offload; ``planned.host_peak_bytes`` is the most bytes it held at
  once during the measured steps (0 without a store, ``null`` for peers). One store serves the whole sweep;
  ``memfit`` offloads where ``memfit run`` would (CUDA, or ``offload_dir`` on the CPU), ``vdnn-all`` and
  ``vdnn-conv`` always (to a temporary disk store on the CPU when no ``offload_dir`` is named).
* ``grad_tolerance``: the absolute tolerance ``gradients_match`` used: 1e-5 for memfit's runtime (as
  ``memfit run``), 1e-4 for compiled code; ``max_rel_grad_diff`` is the largest difference relative to the
  largest plain gradient.
* ``grads_exist``: the sweep modelled a loop that keeps parameter gradients allocated
  (``zero_grad(set_to_none=False)``, gradient accumulation) instead of PyTorch's default ``zero_grad()``
  (``false``); plain PyTorch, every plan's profile and every row's measurement and timing use it alike.
* ``profile_seconds``: the one profile of the sweep (``profile_and_solve_seconds`` is it plus the solve);
  for ``torch-budget`` the solve is the compilation (first forward and backward), for ``rockmate`` its
  constructor.
* ``compiled_graphs``: graphs dynamo made (``torch-budget`` only; 1 = no graph break).
* ``one_step_grad_check`` (``torch-budget`` only): the gradients of ONE step from the initial weights
  against plain PyTorch's in float32 and float64 (:func:`memfit.bench.peers.one_step_check`):
  ``within_float32_noise`` says the compiled gradients are as close to float64 as plain float32's are
  (within 2x). The 3-step comparison above (``gradients_match``) cannot hold to 1e-4 on deep models at
  random initialisation, where float32 rounding alone moves gradients by more than that (ResNet-50 at
  batch 8, 128 px: about 0.3 after one step) and 3 SGD steps amplify it further.
* ``rounding_check`` (``memfit`` rows whose plan stripes blocks, ``tiled-chain``, or runs ``conv-native``
  convolutions: :func:`memfit.bench.job.rounds_differently`): the same one-step check
  (:func:`memfit.bench.job.rounding_check`), on the BatchNorm statistics too; ``gradients_match`` and
  ``bn_stats_match`` are its ``within_float32_noise`` and ``buffers_within_float32_noise`` there, and
  ``max_abs_grad_diff`` stays the 3-step difference.
"""

from __future__ import annotations

import csv
import gc
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.api import (
    BN_FROM_OUTPUT_MARGIN,
    autocast_dtype,
    bn_from_output_option,
    offload_store,
    optimizer_state_bytes,
    tiled_options,
)
from memfit.bench.harness import StepFigures, compare, fresh_copy, interleaved_step_seconds, measure_training
from memfit.bench.job import measure_plain, rounding_check, rounding_verdict, rounds_differently
from memfit.budget import fmt_bytes
from memfit.graph.capture import capture
from memfit.profile.costs import profile_graph
from memfit.profile.link import measure_link
from memfit.runtime.overhead import price_regions
from memfit.runtime.planned import PlannedModule
from memfit.runtime.stores import CopyEngine, HostStore
from memfit.solve.plan import Plan
from memfit.solve.strategies import OFFLOAD_STRATEGIES, STRATEGIES, InfeasibleBudgetError, make_plan
from memfit.solve.tiling import Option, best_plan_rounding

from . import peers

#: activation-peak fractions measured by default (``--budgets 100%,70%,50%,40%,33%,25%``).
BUDGETS = (1.0, 0.7, 0.5, 0.4, 0.33, 0.25)
#: strategies measured by default (plus :data:`OFFLOAD_STRATEGIES` where offloading is on: see
#: :func:`default_strategies`).
BENCH_STRATEGIES = ("none", "chen", "checkpoint-all", "memfit", "torch-budget")
#: every name ``--strategies`` accepts.
ALL_STRATEGIES = (*STRATEGIES, "torch-budget", "rockmate")
#: memfit strategies that ignore the budget: measured once, one row each.
BUDGET_FREE = ("none", "chen", "checkpoint-all", *OFFLOAD_STRATEGIES)
#: gradient tolerance of memfit's own runtime (the same as ``memfit run``).
RUNTIME_GRAD_TOLERANCE = 1e-5

Progress = Callable[[str, int, int], None]  # (what runs now, units done, units in all)


@dataclass
class Workload:
    """One training setup: the model (in train mode, on its device), one batch and the loss.

    Attributes:
        name: shown in reports (the zoo name, or any label).
        model: the model; it is never trained itself (copies are).
        inputs: the forward's positional inputs, e.g. ``(images [B, C, H, W],)``.
        target: the loss target, e.g. class indices ``[B]``.
        loss_fn: ``loss_fn(output, target) -> scalar``.
    """

    name: str
    model: nn.Module
    inputs: tuple
    target: Any
    loss_fn: Callable

    @property
    def batch_size(self) -> int:
        return int(self.inputs[0].shape[0])

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def default_strategies(device: str | torch.device = "cpu", offload_dir: str | None = None,
                       offload: bool | None = None) -> list[str]:
    """The strategies ``memfit bench`` measures by default: :data:`BENCH_STRATEGIES`, with ``vdnn-all`` and
    ``vdnn-conv`` before ``memfit`` where offloading is on (an ``offload_dir`` is named, or on CUDA, unless
    ``offload`` is False)."""
    names = list(BENCH_STRATEGIES)
    on = offload is not False and (offload_dir is not None or torch.device(device).type == "cuda")
    if on:
        names[names.index("memfit"):names.index("memfit")] = list(OFFLOAD_STRATEGIES)
    return names


def zoo_workload(name: str, batch_size: int, image_size: int, device: str = "cpu", seed: int = 0) -> Workload:
    """A :class:`Workload` from :mod:`memfit.zoo` (weights and batch from ``seed``)."""
    from memfit import zoo

    dev = torch.device(device)
    model = zoo.build_model(name, seed=seed).to(dev).train()
    images, target = zoo.example_batch(name, batch_size, image_size, device=dev, seed=seed)
    return Workload(name, model, (images,), target, zoo.loss_for(name))


def parse_fractions(text: str | list, percent_only: bool = False) -> list[float]:
    """``"100%,70%,0.5"`` -> ``[1.0, 0.7, 0.5]``. Percentages or plain fractions, each above 0; a bare number
    above 1 (``"50"``) is refused, since it is almost surely a percentage without its ``%``. A repeated value is
    kept once, in its first place.

    Raises:
        ValueError: an entry is neither, or empty between commas, or above 100%, the list is empty, or
            (``percent_only``) an entry lacks ``%``.
    """
    if isinstance(text, (list, tuple)):
        items = list(text)
    else:
        items = str(text).split(",")
        if items and not items[-1].strip():  # a trailing comma
            items.pop()
        if any(not t.strip() for t in items):  # "50%,,30%": a budget left out by mistake, most likely
            raise ValueError(f"budgets {text!r}: an empty entry between commas; write e.g. 50%,40%,30%")
    out = []
    for item in items:
        s = str(item).strip()
        try:
            value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
        except ValueError:
            raise ValueError(f"budget {s!r}: expected a percentage of the activation peak such as '50%'"
                             + ("" if percent_only else " or a fraction such as 0.5")) from None
        if math.isnan(value) or value <= 0:  # (nan% was accepted, then failed after profiling)
            raise ValueError(f"budget {s!r}: a budget must be above 0%")
        if s.endswith("%") and value > 1:  # (as `memfit run` says: above plain PyTorch's peak nothing is planned)
            raise ValueError(f"budget {s!r}: a percentage must be in (0, 100]")
        if not s.endswith("%") and (percent_only or value > 1):
            pct = f"{value * 100:g}%" if value <= 1 else f"{s}%"
            raise ValueError(f"budget {s!r}: write budgets as percentages of the activation peak, e.g. '{pct}'")
        if value not in out:  # ("100%,100%" ran the same row twice)
            out.append(value)
    if not out:
        raise ValueError("no budgets given: pass e.g. --budgets 50%,33%")
    return out


def parse_knobs(text: str) -> list[float]:
    """``"1.0,0.5,0"`` -> ``[1.0, 0.5, 0.0]``: values of PyTorch's ``activation_memory_budget`` knob for
    ``torch-budget`` (``--torch-budgets``), each a plain number from 0 to 1.

    Raises:
        ValueError: an entry is not a number from 0 to 1 (a percentage among them), or the list is empty.
    """
    out = []
    for item in (t.strip() for t in str(text).split(",")):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            value = None
        if value is None or not 0 <= value <= 1:
            raise ValueError(f"--torch-budgets {item!r}: values of torch's activation_memory_budget are plain numbers "
                             "from 0 to 1 (1.0 keeps every activation, 0.0 recomputes all it can), e.g. 1.0,0.5,0.3")
        out.append(value)
    if not out:
        raise ValueError("--torch-budgets: no value given; pass e.g. 1.0,0.5,0.3")
    return out


def parse_strategies(text: str | list) -> list[str]:
    """``"none,chen,memfit"`` -> names, checked against :data:`ALL_STRATEGIES`, each once."""
    names = text if isinstance(text, (list, tuple)) else [t.strip() for t in str(text).split(",")]
    names = [n for n in names if n]
    if not names:
        raise ValueError(f"no strategies given: choose from {', '.join(ALL_STRATEGIES)}")
    for n in names:
        if n not in ALL_STRATEGIES:
            raise ValueError(f"unknown strategy {n!r}; choose from {', '.join(ALL_STRATEGIES)}")
    return list(dict.fromkeys(names))  # (each once, in its first place)


def activation_budget_bytes(baseline: StepFigures, fraction: float) -> int:
    """The total-peak bound (bytes) that leaves ``fraction`` of plain PyTorch's activation peak."""
    return baseline.fixed_bytes + int(fraction * baseline.activation_peak_bytes)


# --------------------------------------------------------------------------------------------------
# rows
# --------------------------------------------------------------------------------------------------


def _grad_figures(reference: StepFigures, other: StepFigures, tolerance: float) -> dict:
    check = compare(reference, other)
    strip = {k.removeprefix("gm.") for k in other.grads}
    same_names = strip == {k.removeprefix("gm.") for k in reference.grads}
    scale = max((float(g.abs().max()) for g in reference.grads.values() if g.numel()), default=0.0)
    check["gradients_match"] = same_names and check["max_abs_grad_diff"] <= tolerance
    check["grad_tolerance"] = tolerance
    check["max_rel_grad_diff"] = check["max_abs_grad_diff"] / scale if scale else 0.0
    return check


def _row(work: Workload, baseline: StepFigures, strategy: str, backend: str, fraction: float | None,
         budget_bytes: int | None, plain_predicted_s: float | None = None, grads_exist: bool = False) -> dict:
    """A row without a measurement yet (an error row as it stands)."""
    images = work.inputs[0]
    return {
        "model": work.name, "batch_size": int(images.shape[0]), "input_shape": list(images.shape),
        "device": work.device.type, "strategy": strategy, "budget_bytes": budget_bytes,
        "budget_fraction": fraction, "backend": backend, "grads_exist": grads_exist,
        "baseline": {"peak_bytes": baseline.peak_bytes, "fixed_bytes": baseline.fixed_bytes,
                     "activation_peak_bytes": baseline.activation_peak_bytes,
                     "step_seconds": baseline.step_seconds, "predicted_step_seconds": plain_predicted_s},
        "planned": None, "overhead": None, "solve_seconds": None, "profile_seconds": None,
        "profile_and_solve_seconds": None, "mip_gap": None, "decisions": None, "regions": None,
        "gradients_match": None, "max_abs_grad_diff": None, "bn_stats_match": None, "grad_tolerance": None,
        "max_rel_grad_diff": None, "under_budget": None, "offload_store": None, "error": None,
    }


def _fill(row: dict, figures: StepFigures, baseline: StepFigures, plain_s: float, other_s: float,
          tolerance: float, predicted_peak: int | None = None, predicted_fixed: int | None = None,
          predicted_s: float | None = None, host_peak: int | None = None) -> dict:
    row["baseline"]["step_seconds"] = plain_s
    row["planned"] = {
        "peak_bytes": figures.peak_bytes, "activation_peak_bytes": figures.activation_peak_bytes,
        "predicted_peak_bytes": predicted_peak, "step_seconds": other_s,
        "predicted_step_seconds": predicted_s,
        "predicted_activation_peak_bytes": (None if predicted_peak is None
                                            else predicted_peak - (predicted_fixed or 0)),
        "host_peak_bytes": host_peak,
    }
    row["overhead"] = other_s / plain_s
    row.update(_grad_figures(baseline, figures, tolerance))
    if row["budget_bytes"] is not None:
        row["under_budget"] = figures.peak_bytes <= row["budget_bytes"]
    return row


def _measure_plan(work: Workload, baseline: StepFigures, plan, steps: int, seed: int,
                  store: HostStore | None = None, grads_exist: bool = False):
    """Memory, gradients and step times of ``plan``; also the most bytes ``store`` held at once during the
    measured steps (0 without a store)."""
    pm = PlannedModule(capture(fresh_copy(work.model)), plan, offload_store=store)
    if store is not None:
        store.reset_peak()
    figures = measure_training(pm, pm, work.inputs, work.target, work.loss_fn, steps=1, seed=seed,
                               grads_exist=grads_exist)
    host_peak = store.peak_bytes if store is not None else 0
    plain = fresh_copy(work.model)
    plain_s, planned_s = interleaved_step_seconds([(plain, plain), (pm, pm)], work.inputs, work.target,
                                                  work.loss_fn, rounds=steps, grads_exist=grads_exist)
    return figures, plain_s, planned_s, host_peak


# --------------------------------------------------------------------------------------------------
# the sweep
# --------------------------------------------------------------------------------------------------


def sweep(work: Workload, budgets=BUDGETS, strategies=BENCH_STRATEGIES, *, steps: int = 3,
          torch_budgets=peers.TORCH_BUDGETS, torch_backends=(peers.AOT_EAGER,), time_limit: float = 20.0,
          seed: int = 0, progress: Progress | None = None, offload: bool | None = None,
          offload_dir: str | None = None, grads_exist: bool = False,
          on_row: Callable[[dict], None] | None = None, tiling: bool = True) -> tuple[StepFigures, list[dict]]:
    """Measure plain PyTorch once, profile once, then every strategy at every budget.

    Args:
        work: the training setup.
        budgets: fractions of plain PyTorch's measured activation peak (1.0 = all of it).
        strategies: names from :data:`ALL_STRATEGIES`.
        steps: timed rounds per row (interleaved with plain PyTorch).
        torch_budgets: values of ``activation_memory_budget`` for ``torch-budget``.
        torch_backends: ``torch.compile`` backends for ``torch-budget`` (``aot_eager_decomp_partition``,
            ``inductor``).
        time_limit: solver time limit per plan (seconds).
        seed: RNG seed of every measured run.
        progress: called as ``progress(description, done, total)`` before each unit of work and at the end.
        offload, offload_dir: as in :func:`memfit.api.plan`: whether ``memfit`` may offload activations
            (``None``: on CUDA, or on the CPU when ``offload_dir`` names a disk store) and where. The
            ``vdnn-*`` strategies always offload. One store (:func:`memfit.api.offload_store`) is made for
            the sweep, its link measured once with the profile.
        grads_exist: model a loop that keeps parameter gradients allocated (``zero_grad(set_to_none=False)``
            or gradient accumulation) in plain PyTorch's baseline, the profile behind every plan, and every
            row's measured and timed steps (peers included); default: PyTorch's ``zero_grad()``.
        on_row: called with each row as soon as it is measured (e.g. to save partial results of a long
            sweep; an exception it raises stops the sweep).
        tiling: let ``memfit`` also solve the graphs with blocks run in row stripes, as
            :func:`memfit.api.plan` does (profiled once, with the plain profile).

    Returns:
        ``(baseline, rows)``: plain PyTorch's :class:`StepFigures` and the rows (module docstring).
    """
    budgets = [float(b) for b in budgets]
    strategies = parse_strategies(strategies)
    units = 2 + sum(
        1 if s in BUDGET_FREE else len(torch_budgets) * len(torch_backends) if s == "torch-budget"
        else len(budgets) for s in strategies)
    done = 0

    def tick(text: str) -> None:
        nonlocal done
        if progress:
            progress(text, done, units)
        done += 1

    tick(f"{work.name}: plain PyTorch")
    baseline = measure_plain(work.model, work.inputs, work.target, work.loss_fn, seed, grads_exist=grads_exist)
    rows: list[dict] = []

    def add(row: dict) -> None:
        rows.append(row)
        if on_row:
            on_row(row)

    planners = [s for s in strategies if s in STRATEGIES]
    captured = costs = plain_predicted = None
    options: list[Option] = []  # tiled graphs memfit also solves
    rounding: Option | None = None  # the graph with BatchNorm run from its output
    profile_s = 0.0
    fixed = 0
    plain_predicted_s = None
    reference = None  # plain PyTorch's one-step gradients in float32 and float64, for compiled peers
    # one host store for the sweep: memfit's (None when memfit may not offload), else the vDNN strategies'
    joint_store = offload_store(work.inputs, "memfit", offload, offload_dir) if "memfit" in planners else None
    store = joint_store
    if store is None and any(s in OFFLOAD_STRATEGIES for s in planners):
        store = offload_store(work.inputs, next(s for s in planners if s in OFFLOAD_STRATEGIES), offload,
                              offload_dir)
    tick(f"{work.name}: profiling")
    if planners:
        profiled = fresh_copy(work.model)
        t0 = time.perf_counter()
        captured = capture(profiled)
        # operator variants are profiled only for the strategy that can choose them (as memfit.api.plan does)
        costs = profile_graph(captured, work.inputs, with_variants="memfit" in planners, grads_exist=grads_exist)
        price_regions(costs)
        if store is not None:
            costs.link = measure_link(CopyEngine(store, work.device))
        profile_s = time.perf_counter() - t0
        probe = torch.optim.SGD(profiled.parameters(), lr=0.01, momentum=0.9)
        fixed = costs.fixed_bytes + optimizer_state_bytes(probe, list(profiled.parameters()))
        del probe
        plain_predicted = make_plan("none", captured.graph, costs, fixed_bytes=fixed)
        plain_predicted_s = plain_predicted.predicted_step_seconds
        if "memfit" in planners and tiling and autocast_dtype(work.inputs) is None:  # graphs with blocks in row stripes
            tick(f"{work.name}: profiling tiled blocks")
            options += tiled_options(captured, costs, work.inputs, grads_exist=grads_exist)
        if "memfit" in planners:  # the graph with BatchNorm run from its output, as memfit.plan solves it
            rounding = bn_from_output_option(captured, costs, work.inputs, grads_exist=grads_exist)
    for strategy in strategies:
        if strategy in STRATEGIES:
            cases = [None] if strategy in BUDGET_FREE else budgets
            for fraction in cases:
                budget = None if fraction is None else activation_budget_bytes(baseline, fraction)
                label = "" if fraction is None else f" at {fraction:.0%}"
                tick(f"{work.name}: {strategy}{label}")
                row = _row(work, baseline, strategy, "eager", fraction, budget, plain_predicted_s, grads_exist)
                row["profile_seconds"] = profile_s
                row_store = (store if strategy in OFFLOAD_STRATEGIES
                             else joint_store if strategy == "memfit" else None)
                row["offload_store"] = None if row_store is None else row_store.describe()
                t0 = time.perf_counter()
                def solve(option: Option, strategy=strategy, budget=budget, row_store=row_store) -> Plan:
                    return make_plan(strategy, option.captured.graph, option.costs, budget, fixed_bytes=fixed,
                                     time_limit=time_limit, use_offload=row_store is not None)
                try:
                    if strategy == "memfit" and budget < plain_predicted.predicted_peak_bytes:  # as memfit.plan
                        plan, _ = best_plan_rounding([Option(captured, costs), *options], rounding, solve,
                                                     minimum=False, margin=BN_FROM_OUTPUT_MARGIN)
                    else:
                        plan = solve(Option(captured, costs))
                except InfeasibleBudgetError as exc:
                    row["solve_seconds"] = time.perf_counter() - t0  # incl. finding the smallest feasible
                    row["error"] = str(exc)
                    row["smallest_feasible_bytes"] = exc.smallest_feasible_bytes
                    row["smallest_feasible_fraction"] = (
                        (exc.smallest_feasible_bytes - baseline.fixed_bytes) / baseline.activation_peak_bytes
                        if baseline.activation_peak_bytes else None)
                    add(row)
                    continue
                if hasattr(plan, "input_shapes"):  # as memfit.api.plan records them
                    plan.input_shapes = [list(t.shape) for t in work.inputs if isinstance(t, torch.Tensor)]
                figures, plain_s, planned_s, host_peak = _measure_plan(work, baseline, plan, steps, seed,
                                                                       row_store, grads_exist)
                _fill(row, figures, baseline, plain_s, planned_s, RUNTIME_GRAD_TOLERANCE,
                      plan.predicted_peak_bytes, plan.fixed_bytes, plan.predicted_step_seconds, host_peak)
                if rounds_differently(plan):  # float32 rounding: judged against float32's own noise
                    if reference is None:
                        reference = peers.reference_grads(work.model, work.inputs, work.target, work.loss_fn, seed)
                    one = rounding_check(work.model, plan, work.inputs, work.target, work.loss_fn, seed, row_store,
                                         reference)
                    row.update(rounding_verdict(one))
                row.update(solve_seconds=plan.solve_seconds,
                           profile_and_solve_seconds=profile_s + plan.solve_seconds, mip_gap=plan.mip_gap,
                           decisions=plan.counts(), regions=len(plan.regions))
                add(row)
                gc.collect()
        elif strategy == "torch-budget":
            if reference is None:
                reference = peers.reference_grads(work.model, work.inputs, work.target, work.loss_fn, seed)
            for backend in torch_backends:
                for knob in torch_budgets:
                    tick(f"{work.name}: torch-budget {knob:g} ({backend})")
                    add(_torch_budget_row(work, baseline, float(knob), backend, steps, seed,
                                                  reference, grads_exist))
                    gc.collect()
        elif strategy == "rockmate":
            runnable, why = peers.rockmate_status(work.device)
            for k, fraction in enumerate(budgets):
                tick(f"{work.name}: rockmate at {fraction:.0%}")
                if runnable:
                    add(_rockmate_row(work, baseline, fraction, steps, seed, grads_exist))
                elif k == 0:  # one row says why it cannot run
                    add(_row(work, baseline, "rockmate", "rockmate", None, None, grads_exist=grads_exist)
                                | {"error": why})
    if progress:
        progress(f"{work.name}: done", units, units)
    return baseline, rows


def _torch_budget_row(work: Workload, baseline: StepFigures, knob: float, backend: str, steps: int,
                      seed: int, reference: peers.Reference, grads_exist: bool = False) -> dict:
    row = _row(work, baseline, "torch-budget", backend, knob, None, grads_exist=grads_exist)
    row["torch_activation_memory_budget"] = knob
    try:
        run = peers.measure_torch_budget(work.model, work.inputs, work.target, work.loss_fn, knob, backend,
                                         steps, seed, grads_exist=grads_exist)
    except Exception as exc:  # noqa: BLE001 - a peer that fails (compiler error...) is a finding, not a crash
        row["error"] = f"{type(exc).__name__}: {exc}".strip()[:2000]
        return row
    _fill(row, run.figures, baseline, run.plain_seconds, run.compiled_seconds, peers.COMPILED_GRAD_TOLERANCE)
    row.update(solve_seconds=run.compile_seconds, profile_and_solve_seconds=run.compile_seconds,
               compiled_graphs=run.graphs,
               one_step_grad_check=peers.one_step_check(run.first_grads, reference))
    return row


def _rockmate_row(work: Workload, baseline: StepFigures, fraction: float, steps: int, seed: int,
                  grads_exist: bool = False) -> dict:
    budget = activation_budget_bytes(baseline, fraction)
    row = _row(work, baseline, "rockmate", "rockmate", fraction, budget, grads_exist=grads_exist)
    why = peers.rockmate_status(work.device)[1]
    try:
        figures, plain_s, rk_s, solve_s = peers.measure_rockmate(
            work.model, work.inputs, work.target, work.loss_fn,
            int(fraction * baseline.activation_peak_bytes), steps, seed, grads_exist=grads_exist)
    except Exception as exc:  # noqa: BLE001 - as for torch-budget
        row["error"] = f"{why}: {type(exc).__name__}: {exc}"[:2000]
        return row
    _fill(row, figures, baseline, plain_s, rk_s, peers.COMPILED_GRAD_TOLERANCE)
    row.update(solve_seconds=solve_s, profile_and_solve_seconds=solve_s)
    return row


# --------------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------------


def _flatten(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "variants":
            out.update(_flatten(v, key + "."))
        elif isinstance(v, (list, dict)):
            out[key] = json.dumps(v)
        else:
            out[key] = v
    return out


def write_csv(rows: list[dict], path: str | Path) -> None:
    """The rows as CSV: nested keys joined with ``.`` (``planned.peak_bytes``), lists and ``variants`` as
    JSON text, a missing value as an empty cell."""
    flat = [_flatten(r) for r in rows]
    columns: list[str] = []
    for f in flat:
        columns += [k for k in f if k not in columns]
    # a row without a measurement has planned = None: give it the measured rows' columns
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns, restval="")
        w.writeheader()
        for f in flat:
            w.writerow({k: ("" if v is None else v) for k, v in f.items()})


def write_results(rows: list[dict], baseline: StepFigures, out_dir: str | Path, title: str = "") -> dict:
    """Write ``results.json`` (the rows), ``results.csv`` and ``pareto.png`` into ``out_dir``.

    Returns:
        ``{"json": path, "csv": path, "png": path}``.
    """
    from memfit.bench.plots import pareto_plot

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "csv": out / "results.csv", "png": out / "pareto.png"}
    with open(paths["json"], "w") as fh:
        json.dump(rows, fh, indent=1)
    write_csv(rows, paths["csv"])
    pareto_plot(rows, baseline, paths["png"], title=title)
    return paths


def machine_line() -> str:
    """Where the figures come from: processor, threads, the C allocator's setting
    (:func:`memfit.profile.timing.cpu_allocator`), torch version, date."""
    from memfit.profile.timing import cpu_allocator

    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s), "
            f"C allocator {cpu_allocator()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")


def _short_error(r: dict) -> str:
    if r.get("smallest_feasible_fraction") is not None:
        return (f"infeasible: smallest feasible {fmt_bytes(r['smallest_feasible_bytes'])} "
                f"(= {r['smallest_feasible_fraction']:.0%} of the activation peak)")
    text = r["error"] or ""
    return text.split(";")[0].split(" (")[0][:70]


def _one_step_note(r: dict) -> str:
    c = r.get("one_step_grad_check")
    rc = r.get("rounding_check")
    if rc:  # a memfit plan that rounds differently: judged by one step against float64
        verdict = "[green]within[/]" if rc["within_float32_noise"] else "[red]beyond[/]"
        bn = ""
        if "buffers_vs_float64" in rc:
            ok = "[green]within[/]" if rc["buffers_within_float32_noise"] else "[red]beyond[/]"
            bn = f"; BN statistics {rc['buffers_vs_float64']:.1e}, {ok} f32 noise {rc['buffers_float32_noise']:.1e}"
        f64 = ""
        if "float64_grads_rel" in rc:
            ok = "[green]equal[/]" if rc["float64_gradients_match"] and rc["float64_buffers_match"] else "[red]differ[/]"
            f64 = f"; in float64 {ok} ({rc['float64_grads_rel']:.1e} relative)"
        return (f"; 1 step vs float64: {rc['vs_float64']:.1e}, {verdict} f32 noise {rc['float32_noise']:.1e}" + bn
                + f64)
    if not c:
        return ""
    verdict = "[green]within[/]" if c["within_float32_noise"] else "[red]beyond[/]"
    return f"; 1 step: {c['max_abs_grad_diff']:.1e}, {verdict} f32 noise {c['float32_noise']:.1e}"


def results_table(rows: list[dict], baseline: StepFigures, title: str | None = None):
    """A rich table of the rows, plain PyTorch first; errors too long for a cell become numbered notes
    in the caption."""
    from rich.table import Table

    act = baseline.activation_peak_bytes
    r0 = rows[0] if rows else {"model": "?", "input_shape": "?", "device": "?"}
    title = title or (f"memfit bench: {r0['model']} input {r0['input_shape']} on {r0['device']}; "
                      f"budgets are % of plain PyTorch's ACTIVATION peak ({fmt_bytes(act)}; fixed "
                      f"{fmt_bytes(baseline.fixed_bytes)}): budget total = fixed + % x activation peak")
    t = Table(title=title, caption_justify="left")
    for col, just in [("strategy", "left"), ("backend", "left"), ("budget", "right"),
                      ("budget total", "right"),
                      ("total peak", "right"), ("act. peak", "right"), ("of plain", "right"),
                      ("predicted act.", "right"), ("step", "right"), ("overhead", "right"),
                      ("solve", "right"), ("gradients / note", "left")]:
        t.add_column(col, justify=just)
    # plain PyTorch's step: the median of its interleaved timings (each row times a plain copy beside it)
    plain_times = [r["baseline"]["step_seconds"] for r in rows if r["planned"] is not None]
    plain_s = statistics.median(plain_times) if plain_times else baseline.step_seconds
    # each row's overhead is against the plain steps timed in alternation with it (its own "plain" figure),
    # so noise between rows does not enter the ratio; the plain row shows the median of those
    t.add_row("plain PyTorch", "eager", "", "", fmt_bytes(baseline.peak_bytes), fmt_bytes(act), "100%", "",
              f"{plain_s:.3f} s (median)", "1.00x", "", "reference", style="bold")
    notes: list[str] = []
    for r in rows:
        if r["strategy"] == "torch-budget":
            budget = f"knob {r['budget_fraction']:g}"
        elif r["budget_fraction"] is None:
            budget = "any"
        else:
            budget = f"{r['budget_fraction']:.0%}"
        total = fmt_bytes(r["budget_bytes"]) if r["budget_bytes"] is not None else ""
        if r["error"] or r["planned"] is None:
            note = _short_error(r)
            if r.get("smallest_feasible_fraction") is None and r["error"]:
                if r["error"] not in notes:
                    notes.append(r["error"])
                note += f" [{notes.index(r['error']) + 1}]"
            t.add_row(r["strategy"], r["backend"], budget, total, *[""] * 7, f"[yellow]{note}[/]")
            continue
        p = r["planned"]
        over = r["under_budget"] is False
        peak = fmt_bytes(p["peak_bytes"])
        pred = "" if p.get("predicted_activation_peak_bytes") is None else fmt_bytes(
            p["predicted_activation_peak_bytes"])
        ok = "[green]match[/]" if r["gradients_match"] else "[red]DIFFER[/]"
        if r.get("rounding_check"):  # (the figure in brackets stays the difference after the measured steps)
            ok = ("[green]match to float32 rounding[/]" if r["gradients_match"] and r["bn_stats_match"]
                  else "[red]DIFFER beyond float32 rounding[/]")
        host = f"; host {fmt_bytes(p['host_peak_bytes'])}" if p.get("host_peak_bytes") else ""
        solve = "" if r["solve_seconds"] is None else f"{r['solve_seconds']:.2f} s"
        if r["strategy"] == "torch-budget":
            solve = f"compile {solve}"
        t.add_row(r["strategy"], r["backend"], budget, total, f"[red]{peak}[/]" if over else peak,
                  fmt_bytes(p["activation_peak_bytes"]),
                  f"{p['activation_peak_bytes'] / act:.0%}" if act else "",
                  pred, f"{p['step_seconds']:.3f} s",
                  f"{r['overhead']:.2f}x (plain {r['baseline']['step_seconds']:.3f} s)", solve,
                  f"{ok} ({r['max_abs_grad_diff']:.1e})" + host + _one_step_note(r))
    if notes:
        t.caption = "\n".join(f"[{k + 1}] {n}" for k, n in enumerate(notes))
    return t
