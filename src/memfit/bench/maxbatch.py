"""``memfit max-batch``: the largest batch each strategy trains within a total-peak budget, by measuring.

For each strategy the batch size is searched exponentially (start, 2x start, 4x start, ... until a probe
does not fit) and then by bisection between the largest batch that fit and the smallest that did not; no
batch below the start is probed, and the start is at least 2 when the model has BatchNorm layers (training
BatchNorm needs more than one value per channel). A budget not above the model's fixed bytes (parameters,
gradients, buffers, optimizer state: :func:`model_fixed_bytes`) is refused before any probe
(:class:`BudgetBelowFixedError`).
Each probe builds the batch, plans (memfit strategies profile the model at that batch; for ``memfit`` the
plan must fit the budget, and :class:`~memfit.InfeasibleBudgetError` means the batch is too big; ``memfit``
also solves the graphs with blocks in row stripes, as :func:`memfit.api.plan` does), runs one
training step under :func:`~memfit.bench.harness.measure_training` (the same harness as ``memfit run`` and
``memfit bench``: 3 SGD steps, the second tracked) and checks that the measured total peak is within the
budget. The search assumes that a batch that does not fit is followed by no batch that does.

Strategies: ``plain`` (plain PyTorch, the reference; always measured), ``none``, ``chen``,
``checkpoint-all``, ``vdnn-all``, ``vdnn-conv``, ``remat-ilp``, ``memfit``, and ``torch-budget`` or ``torch-budget:K``
(``torch.compile`` with ``activation_memory_budget = K``, 0.0 by default -- the knob's least-memory end;
backend ``aot_eager_decomp_partition``, or ``inductor`` with ``--inductor``).

Offloading (``offload``, ``offload_dir``) follows :func:`memfit.api.plan`: ``memfit`` may offload on CUDA, and
on the CPU when an ``offload_dir`` names a disk store; ``vdnn-*`` always offload. Host bytes do not count
against the (device) budget; each probe records the most the store held at once (``host_peak_bytes``).

``grads_exist`` models a loop that keeps parameter gradients allocated (``zero_grad(set_to_none=False)``,
gradient accumulation) in every probe's profile, plan and measured step, plain PyTorch's included.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from memfit.api import offload_store, optimizer_state_bytes, tiled_options
from memfit.bench import peers
from memfit.bench.harness import fresh_copy, measure_training
from memfit.bench.sweep import Workload, zoo_workload
from memfit.budget import fmt_bytes
from memfit.graph.capture import TraceError, capture
from memfit.profile.costs import profile_graph
from memfit.profile.host import HostMemoryError, check_fits_host
from memfit.profile.link import measure_link
from memfit.profile.tracker import live_bytes
from memfit.runtime.overhead import price_regions
from memfit.runtime.planned import PlannedModule
from memfit.runtime.stores import CopyEngine, HostStore
from memfit.solve.plan import Plan
from memfit.solve.strategies import STRATEGIES, InfeasibleBudgetError, make_plan
from memfit.solve.tiling import Option, best_plan

#: strategies measured by default (``plain`` is always measured first, as the reference).
MAXBATCH_STRATEGIES = ("chen", "checkpoint-all", "memfit")


@dataclass
class Probe:
    """One measured batch size.

    Attributes:
        batch: the batch size.
        fits: the plan (if any) fits and the measured total peak is within the budget.
        peak_bytes, fixed_bytes, activation_peak_bytes: measured (``None`` if not measured); when the plan
            was infeasible, ``fixed_bytes`` is the fixed bytes it was planned with (batch included).
        predicted_peak_bytes: the plan's prediction (memfit strategies).
        reason: why it does not fit (``None`` when it fits).
        seconds: wall time of the probe.
        host_peak_bytes: most bytes the offload store held at once during the measured steps (``None``
            without a store).
    """

    batch: int
    fits: bool
    peak_bytes: int | None = None
    fixed_bytes: int | None = None
    activation_peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    reason: str | None = None
    seconds: float = 0.0
    host_peak_bytes: int | None = None


@dataclass
class SearchResult:
    """The answer for one strategy: ``max_batch`` fits (0: not even the first probe, ``start_batch``),
    ``next_batch`` (the smallest batch probed that does not fit; ``None`` if the search stopped at
    ``limit``), and every probe in the order made."""

    strategy: str
    backend: str
    max_batch: int
    next_batch: int | None
    probes: list[Probe] = field(default_factory=list)
    start_batch: int = 1

    def probe(self, batch: int | None) -> Probe | None:
        return next((p for p in self.probes if p.batch == batch), None)

    def why_not(self) -> str:
        """Why ``next_batch`` does not fit ("limit" when the search stopped at the limit); when not even the
        start batch fits, a sentence that says so and names the fixed bytes at that batch."""
        nxt = self.probe(self.next_batch)
        if nxt is None:
            return "limit" if self.next_batch is None else ""
        reason = nxt.reason or ""
        if self.max_batch:
            return reason
        why = f"batch {nxt.batch} does not fit: {reason}"
        if nxt.fixed_bytes is not None:
            why += f"; the fixed bytes alone are {fmt_bytes(nxt.fixed_bytes)}"
        return why

    def to_dict(self) -> dict:
        best, nxt = self.probe(self.max_batch), self.probe(self.next_batch)
        return {"strategy": self.strategy, "backend": self.backend, "max_batch": self.max_batch,
                "peak_bytes": best.peak_bytes if best else None,
                "activation_peak_bytes": best.activation_peak_bytes if best else None,
                "host_peak_bytes": best.host_peak_bytes if best else None,
                "next_batch": self.next_batch, "next_peak_bytes": nxt.peak_bytes if nxt else None,
                "next_reason": nxt.reason if nxt else None, "why_not": self.why_not(),
                "start_batch": self.start_batch, "probes": [asdict(p) for p in self.probes]}


class BudgetBelowFixedError(ValueError):
    """The budget is not above the model's fixed bytes (parameters, gradients, buffers, optimizer state),
    so no batch can fit whatever the strategy."""

    def __init__(self, budget_bytes: int, fixed_bytes: int, detail: str = ""):
        self.budget_bytes, self.fixed_bytes = budget_bytes, fixed_bytes
        super().__init__(
            f"budget {budget_bytes} bytes ({fmt_bytes(budget_bytes)}) is not above the model's fixed bytes, "
            f"{fixed_bytes} bytes ({fmt_bytes(fixed_bytes)}){' = ' + detail if detail else ''}, before any "
            "batch or activation: no batch fits; raise the budget above the fixed bytes")


#: the largest batch ``max-batch`` probes unless told (``--batch-limit``).
DEFAULT_BATCH_LIMIT = 4096


def min_batch(model: nn.Module) -> int:
    """The smallest batch worth probing: 2 when ``model`` has BatchNorm layers (training BatchNorm refuses a
    single value per channel, which batch 1 gives after global pooling), else 1."""
    return 2 if any(isinstance(m, _BatchNorm) for m in model.modules()) else 1


def model_fixed_bytes(model: nn.Module) -> tuple[int, str]:
    """Batch-independent fixed bytes of training ``model`` with SGD + momentum (as the harness does):
    parameters, buffers, one gradient and one momentum buffer per trainable parameter. Returns the total
    and its breakdown as text. A lower bound on every probe's fixed bytes (which add the batch)."""
    params = live_bytes(model.parameters())
    trainable = live_bytes(p for p in model.parameters() if p.requires_grad)
    buffers = live_bytes(model.buffers())
    detail = (f"parameters {fmt_bytes(params)} + gradients {fmt_bytes(trainable)} + optimizer state (SGD "
              f"momentum) {fmt_bytes(trainable)}" + (f" + buffers {fmt_bytes(buffers)}" if buffers else ""))
    return params + 2 * trainable + buffers, detail


def largest_fitting(fits: Callable[[int], bool], start: int = 1, limit: int = 4096) -> tuple[int, int | None]:
    """Exponential search, then bisection, for the largest ``b`` in ``[start, limit]`` with ``fits(b)``;
    no batch below ``start`` is probed.

    Returns:
        ``(largest fitting batch or 0, smallest probed batch that did not fit or None)``; ``(0, start)``
        when ``start`` does not fit.
    """
    start = max(1, min(start, limit))
    lo, hi = 0, None
    if fits(start):
        lo = start
        while hi is None and lo < limit:
            b = min(2 * lo, limit)
            if fits(b):
                lo = b
            else:
                hi = b
    else:
        return 0, start
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def parse_strategy(name: str) -> tuple[str, float | None]:
    """``"torch-budget:0.3"`` -> ``("torch-budget", 0.3)``; ``"torch-budget"`` -> knob 0.0; others -> None."""
    base, _, knob = name.partition(":")
    if base == "torch-budget":
        return base, float(knob) if knob else 0.0
    if knob or base not in ("plain", *STRATEGIES):
        raise ValueError(f"unknown max-batch strategy {name!r}; choose from plain, {', '.join(STRATEGIES)}, "
                         "torch-budget[:K]")
    return base, None


def probe_batch(work: Workload, strategy: str, budget_bytes: int, *, backend: str = peers.AOT_EAGER,
                time_limit: float = 20.0, seed: int = 0, profile_repeats: int = 1,
                store: HostStore | None = None, grads_exist: bool = False) -> Probe:
    """Plan and measure one training step of ``work`` with ``strategy``; does it fit ``budget_bytes``?

    ``profile_repeats`` is the timing repetitions of the profile behind memfit's plans (memory, which
    decides feasibility, is measured exactly either way). ``store`` is the host store the plan may offload
    to (:func:`memfit.api.offload_store`; required by ``vdnn-*``, lets ``memfit`` offload). ``grads_exist``:
    gradients stay allocated between steps, in the profile and the measured step alike (module docstring).
    """
    t0 = time.perf_counter()
    base, knob = parse_strategy(strategy)
    b = work.batch_size
    predicted = host_peak = None
    if work.device.type == "cpu":  # (a probe beyond the machine's memory got the process killed, no message)
        try:
            check_fits_host(work.model, work.inputs)
        except HostMemoryError as exc:
            return Probe(b, False, reason=f"not run: its forward makes {fmt_bytes(exc.needed_bytes)} of outputs, more "
                         f"than the {fmt_bytes(exc.available_bytes)} this machine has available",
                         seconds=time.perf_counter() - t0)
    try:
        if base == "plain":
            m = fresh_copy(work.model)
            figures = measure_training(m, m, work.inputs, work.target, work.loss_fn, steps=1, seed=seed,
                                       grads_exist=grads_exist)
        elif base == "torch-budget":
            figures = peers.measure_torch_budget(work.model, work.inputs, work.target, work.loss_fn, knob,
                                                 backend, steps=1, seed=seed, time_it=False,
                                                 grads_exist=grads_exist).figures
        else:
            m = fresh_copy(work.model)
            captured = capture(m)
            costs = profile_graph(captured, work.inputs, repeats=profile_repeats,
                                  with_variants=base == "memfit", grads_exist=grads_exist)
            price_regions(costs)
            if store is not None:
                costs.link = measure_link(CopyEngine(store, work.device))
            opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
            state = optimizer_state_bytes(opt, list(m.parameters()))
            fixed = costs.fixed_bytes + state
            del opt
            def solve(option: Option) -> Plan:
                found = make_plan(base, option.captured.graph, option.costs, budget_bytes, fixed_bytes=fixed,
                                  time_limit=time_limit, use_offload=store is not None)
                # (the momentum the measured steps keep, counted: the planned module checks it at their first step)
                found.optimizer, found.optimizer_state_bytes = "SGD", state
                return found

            options = [Option(captured, costs)]
            if base == "memfit" and budget_bytes < make_plan("none", captured.graph, costs,
                                                             fixed_bytes=fixed).predicted_peak_bytes:
                options += tiled_options(captured, costs, work.inputs, grads_exist=grads_exist)  # as memfit.plan
            try:
                plan, _ = best_plan(options, solve, minimum=False)
            except InfeasibleBudgetError as exc:
                return Probe(b, False, fixed_bytes=exc.fixed_bytes, reason=f"infeasible: smallest feasible "
                             f"budget {fmt_bytes(exc.smallest_feasible_bytes)}", seconds=time.perf_counter() - t0)
            predicted = plan.predicted_peak_bytes
            pm = PlannedModule(capture(fresh_copy(work.model)), plan, offload_store=store)
            if store is not None:
                store.reset_peak()
            figures = measure_training(pm, pm, work.inputs, work.target, work.loss_fn, steps=1, seed=seed,
                                       grads_exist=grads_exist)
            host_peak = store.peak_bytes if store is not None else None
    except TraceError:
        raise
    except (RuntimeError, ValueError) as exc:  # e.g. BatchNorm refusing one value per channel at batch 1
        return Probe(b, False, reason=f"{type(exc).__name__}: {str(exc)[:300]}",
                     seconds=time.perf_counter() - t0)
    finally:
        gc.collect()
    fits = figures.peak_bytes <= budget_bytes
    return Probe(b, fits, figures.peak_bytes, figures.fixed_bytes, figures.activation_peak_bytes, predicted,
                 None if fits else f"measured peak {fmt_bytes(figures.peak_bytes)} > budget "
                 f"{fmt_bytes(budget_bytes)}", time.perf_counter() - t0, host_peak)


def max_batch(make_work: Callable[[int], Workload], budget_bytes: int, strategies=MAXBATCH_STRATEGIES, *,
              start: int = 1, limit: int = 4096, backend: str = peers.AOT_EAGER, time_limit: float = 20.0,
              seed: int = 0, profile_repeats: int = 1, offload: bool | None = None,
              offload_dir: str | None = None, grads_exist: bool = False,
              progress: Callable[[str], None] | None = None) -> list[SearchResult]:
    """The largest batch each strategy trains within ``budget_bytes`` (total peak), plain PyTorch first.

    Args:
        make_work: ``batch -> Workload`` (same model weights for every batch).
        budget_bytes: total-peak bound (bytes).
        strategies: see the module docstring; ``plain`` is added first if missing.
        start: first (and smallest) batch probed, raised to 2 when the model has BatchNorm
            (:func:`min_batch`); limit: largest batch probed.
        backend: ``torch.compile`` backend of ``torch-budget``.
        time_limit: solver time limit per plan (seconds).
        seed: RNG seed.
        profile_repeats: see :func:`probe_batch`.
        offload, offload_dir: as in :func:`memfit.api.plan` (module docstring); one store per strategy,
            made once for its whole search.
        grads_exist: see the module docstring.
        progress: called with a description before each probe.

    Returns:
        One :class:`SearchResult` per strategy.

    Raises:
        BudgetBelowFixedError: ``budget_bytes`` is not above the model's fixed bytes
            (:func:`model_fixed_bytes`), checked before any probe.
    """
    names = list(strategies)
    if "plain" not in names:
        names.insert(0, "plain")
    for n in names:
        parse_strategy(n)
    first = make_work(max(1, start))
    fixed, detail = model_fixed_bytes(first.model)
    if budget_bytes <= fixed:
        raise BudgetBelowFixedError(budget_bytes, fixed, detail)
    start = max(start, min_batch(first.model))
    if limit < start:
        raise ValueError(f"batch limit {limit} is below the start batch {start}"
                         f"{' (models with BatchNorm start at 2)' if start == min_batch(first.model) > 1 else ''}")
    results = []
    for name in names:
        probes: list[Probe] = []
        base = parse_strategy(name)[0]
        store = (offload_store(first.inputs, base, offload, offload_dir)  # (inputs: for the device)
                 if base in STRATEGIES else None)

        def fits(b: int, name=name, probes=probes, store=store) -> bool:
            if progress:
                progress(f"{name}: batch {b}")
            p = probe_batch(make_work(b), name, budget_bytes, backend=backend, time_limit=time_limit,
                            seed=seed, profile_repeats=profile_repeats, store=store, grads_exist=grads_exist)
            probes.append(p)
            return p.fits

        lo, hi = largest_fitting(fits, start, limit)
        be = backend if name.startswith("torch-budget") else "eager"
        results.append(SearchResult(name, be, lo, hi, probes, start_batch=start))
    return results


def zoo_max_batch(model: str, image_size: int, budget_bytes: int, strategies=MAXBATCH_STRATEGIES,
                  device: str = "cpu", seed: int = 0, **kw) -> list[SearchResult]:
    """:func:`max_batch` for a zoo model (the same weights at every batch)."""
    from memfit import zoo

    model_obj = zoo.build_model(model, seed=seed).to(device).train()

    def make_work(b: int) -> Workload:
        images, target = zoo.example_batch(model, b, image_size, device=device, seed=seed)
        return Workload(model, model_obj, (images,), target, zoo.loss_for(model))

    return max_batch(make_work, budget_bytes, strategies, seed=seed, **kw)


def plain_peak_bytes(model: str, batch: int, image_size: int, device: str = "cpu", seed: int = 0,
                     grads_exist: bool = False) -> int:
    """Measured total peak of plain PyTorch at ``batch`` (for ``--budget-from-batch``)."""
    from memfit.bench.job import measure_plain

    w = zoo_workload(model, batch, image_size, device, seed)
    return measure_plain(w.model, w.inputs, w.target, w.loss_fn, seed, grads_exist=grads_exist).peak_bytes


def max_batch_table(results: list[SearchResult], budget_bytes: int, title: str = ""):
    """A rich table: per strategy the max batch, its measured peak, the next probe and why it failed."""
    from rich.table import Table

    t = Table(title=title or f"max batch within {fmt_bytes(budget_bytes)} (measured total peak)")
    host = any(p.host_peak_bytes for r in results for p in r.probes)  # a column only when something offloaded
    for col in ("strategy", "backend", "max batch", "vs plain", "total peak", "act. peak",
                *(("host peak",) if host else ()), "next", "why not", "probes", "time"):
        t.add_column(col, justify="left" if col in ("strategy", "backend", "why not") else "right")
    plain = next((r.max_batch for r in results if r.strategy == "plain"), None)
    for r in results:
        best = r.probe(r.max_batch)
        t.add_row(r.strategy, r.backend, str(r.max_batch),
                  f"{r.max_batch / plain:.2f}x" if plain else "",
                  fmt_bytes(best.peak_bytes) if best else "",
                  fmt_bytes(best.activation_peak_bytes) if best else "",
                  *((fmt_bytes(best.host_peak_bytes) if best and best.host_peak_bytes else "",) if host else ()),
                  "" if r.next_batch is None else str(r.next_batch), r.why_not(),
                  str(len(r.probes)), f"{sum(p.seconds for p in r.probes):.0f} s")
    return t
