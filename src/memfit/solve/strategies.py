"""Every strategy produces a :class:`Plan` for the same runtime (DESIGN.md, "Baselines are plans too")."""

from __future__ import annotations

import copy
import time
import weakref
from dataclasses import dataclass

from memfit.budget import fmt_bytes
from memfit.graph.ir import Graph
from memfit.profile.costs import Costs
from memfit.solve.accounting import Accounting
from memfit.solve.baselines import block_spans, chen_spans
from memfit.solve.ilp import IlpResult, solve_regions
from memfit.solve.legal import legalize
from memfit.solve.offload import candidates, conv_input_producers, offload_waits
from memfit.solve.plan import Plan
from memfit.solve.simulator import _replay
from memfit.variants.inplace import PLAIN_INPLACE
from memfit.warn import warn_user

STRATEGIES = ("none", "chen", "checkpoint-all", "vdnn-all", "vdnn-conv", "remat-ilp", "memfit")
OFFLOAD_STRATEGIES = ("vdnn-all", "vdnn-conv")

Spans = list[tuple[int, int]]


class InfeasibleBudgetError(ValueError):
    """No plan fits the budget. ``smallest_feasible_bytes`` is the lowest peak memfit found a plan for; ``stopped_at``
    the time limit (seconds) that its search for it had and reached, or ``None`` (it ran to its node limit);
    ``optimizer`` the class name of the optimizer the plan was solved for (``"SGD"``, ``"Adam"``), or ``None``
    (not given), and ``optimizer_state_bytes`` the state it holds (bytes): the advice names an optimizer with
    less state only where one has less. ``input_bytes`` is the example batch's part of ``fixed_bytes``: where
    the budget is below the fixed bytes but above their part no batch size changes, the advice is a smaller
    batch. ``margin_bytes`` is the headroom ``smallest_feasible_bytes`` includes above its plan's peak; the advice
    blames the optimizer step's temporaries (``step_bytes``) only where that peak is the step's. ``batch``: the
    example batch's size (its first tensor's first dimension), where known: a smaller batch is advised only where
    one of at least 1 could fit."""

    def __init__(self, budget_bytes: int, smallest_feasible_bytes: int, fixed_bytes: int, step_bytes: int = 0,
                 stopped_at: float | None = None, optimizer: str | None = None, optimizer_state_bytes: int = 0,
                 input_bytes: int = 0, margin_bytes: int = 0, batch: int | None = None, buckets_bytes: int = 0):
        self.budget_bytes = budget_bytes
        self.buckets_bytes = buckets_bytes
        self.stopped_at = stopped_at
        self.smallest_feasible_bytes = smallest_feasible_bytes
        self.fixed_bytes = fixed_bytes
        self.step_bytes = step_bytes
        self.optimizer = optimizer
        self.optimizer_state_bytes = optimizer_state_bytes
        self.input_bytes = input_bytes
        self.margin_bytes = margin_bytes
        self.batch = batch
        # the optimizer step's temporaries set the floor (its peak, less the headroom ``margin_bytes``, is the step's:
        # the activations are gone by then): no plan changes them, and a smaller batch barely does. (Where the
        # backward pass sets it, a smaller batch does: a fresh user's ResNet-18 was told otherwise with 18 MiB of
        # AdamW temporaries under a floor 26.9 MB above the fixed bytes, which batch 16 met.)
        by_step = step_bytes > 0 and step_bytes >= 0.98 * (smallest_feasible_bytes - margin_bytes - fixed_bytes)
        below_fixed = budget_bytes < fixed_bytes
        if optimizer_state_bytes == 0:  # no state to lose (or no optimizer given): fewer trained parameters
            lighter = "fewer trainable parameters (a frozen one has no gradient, no state and no step)"
        elif optimizer == "SGD":  # its state is the momentum buffers
            lighter = (f"fewer trainable parameters, or SGD without momentum (no state; yours holds "
                       f"{fmt_bytes(optimizer_state_bytes)})")
        elif optimizer is not None:
            lighter = (f"fewer trainable parameters, or an optimizer with less state than {optimizer}'s "
                       f"{fmt_bytes(optimizer_state_bytes)}, such as SGD")
        else:  # (state counted for an optimizer not named)
            lighter = "fewer trainable parameters, or an optimizer with less state"
        model_bytes = fixed_bytes - input_bytes  # what no batch size changes
        in_batch = (f"the input batch is {input_bytes} bytes ({fmt_bytes(input_bytes)}) of them" if input_bytes
                    else "")
        # what a batch of 1 would need, where the input and the activations grow in proportion to the batch
        batch_of_one = model_bytes + (smallest_feasible_bytes - model_bytes) / batch if batch else 0
        if not below_fixed:
            smaller = (" (a batch of 1 example, as small as it gets)" if batch == 1 else
                       f" (a batch of 1 would need about {fmt_bytes(batch_of_one)})" if batch_of_one > budget_bytes
                       else ", or lower the batch size")
            hint = (f"; {step_bytes} bytes ({fmt_bytes(step_bytes)}) more are the optimizer step's temporaries, "
                    f"which set this floor: no plan and hardly any batch size changes them (a smaller model, "
                    f"{lighter}, does)" if by_step else f". Raise the budget{smaller}")
        elif budget_bytes < model_bytes:
            rest = f", all but the input batch's {input_bytes} bytes ({fmt_bytes(input_bytes)})" if input_bytes else ""
            hint = (f"; the budget is below the fixed bytes alone, which no plan lowers, and below the "
                    f"{model_bytes} bytes ({fmt_bytes(model_bytes)}) of them that no batch size changes{rest}: raise "
                    f"it, or make those smaller ({lighter})")
        elif batch and batch_of_one > budget_bytes:
            # (a fresh user's ViT at batch 2 was told to lower it to about 1% of that)
            smaller = ("a batch of 1 example, as small as it gets" if batch == 1 else
                       f"a smaller batch lowers both it and the activations, but not enough: a batch of 1 would need "
                       f"about {fmt_bytes(batch_of_one)} if they grow in proportion to it")
            hint = (f"; the budget is below the fixed bytes alone, which no plan lowers; {in_batch}, {smaller}. Raise "
                    f"the budget, or make the rest smaller ({lighter})")
        else:
            # the input and the activations grow with the batch, the rest does not: a rough target
            share = (budget_bytes - model_bytes) / max(1, smallest_feasible_bytes - model_bytes)
            hint = (f"; the budget is below the fixed bytes alone, which no plan lowers; {in_batch}, and a smaller "
                    f"batch lowers both it and the activations: lower the batch size (to about {share:.0%} of "
                    f"this one or less, if they grow in proportion to it), raise the budget, or make the rest "
                    f"smaller ({lighter})")
        stopped = ("" if stopped_at is None or below_fixed else
                   " (the search for the lowest-memory plan stopped at its time limit, so a longer time_limit / "
                   "--time-limit may find a lower one; a busy machine slows that search)")
        # (a fresh user measured the least-memory plan's peak and asked for it: refused, with no word of the headroom)
        floor = smallest_feasible_bytes - margin_bytes
        headroom = (f" The least-memory plan is predicted to peak at {floor} bytes ({fmt_bytes(floor)}), and a "
                    f"budget keeps {margin_bytes} bytes ({fmt_bytes(margin_bytes)}) of headroom above a plan's "
                    "predicted peak for what the prediction leaves out (the loss's scalars, checkpoint "
                    "bookkeeping); budget='min' picks that plan." if margin_bytes > 0 and budget_bytes >= floor else "")
        super().__init__(
            f"no plan fits a budget of {budget_bytes} bytes ({fmt_bytes(budget_bytes)}); the smallest "
            f"feasible budget is {smallest_feasible_bytes} bytes ({fmt_bytes(smallest_feasible_bytes)}, "
            f"{fmt_bytes(smallest_feasible_bytes - budget_bytes)} more){stopped}, "
            f"of which {fixed_bytes} bytes ({fmt_bytes(fixed_bytes)}) are fixed (parameters, gradients, "
            f"buffers, optimizer state, inputs"
            + (f", and {fmt_bytes(buckets_bytes)} of DistributedDataParallel's gradient buckets (ddp=)"
               if buckets_bytes else "") + f"){hint}.{headroom}")

    def for_optimizer(self, optimizer: str | None, state_bytes: int, batch: int | None = None,
                      buckets_bytes: int = 0) -> InfeasibleBudgetError:
        """The same error, its advice for ``optimizer`` (a class name, or ``None`` where none was given) holding
        ``state_bytes`` of state, and for a batch of ``batch`` examples; naming the ``buckets_bytes`` of
        DistributedDataParallel's gradient buckets the fixed bytes hold (``ddp=``)."""
        return InfeasibleBudgetError(self.budget_bytes, self.smallest_feasible_bytes, self.fixed_bytes,
                                     self.step_bytes, self.stopped_at, optimizer, state_bytes, self.input_bytes,
                                     self.margin_bytes, batch, buckets_bytes)


#: extra headroom on CUDA (bytes): on an H200, a ResNet-18 plan at batch 8, 64 px measured 2.0 MB above its
#: replay (plain PyTorch 1.0 MB), more than the 1% below (0.2 MB there); cause not established (cuDNN
#: workspaces in the step other than in the profile's isolated runs are the likely one). At full size the
#: replay was within 0.02 GB of 5-16 GB peaks, inside the 1%.
CUDA_MARGIN_BYTES = 4 << 20


_LOWS: dict[int, dict[tuple, dict]] = {}  # id(costs) -> options -> _Problem._lows


def _margin(activation_bytes: int, device: str = "cpu") -> int:
    """Headroom kept under the budget for what the replay leaves out (allocator rounding, small tensors of
    the loss and of checkpoint bookkeeping): 1% of plain PyTorch's activation peak plus 64 KiB, plus
    :data:`CUDA_MARGIN_BYTES` on CUDA."""
    return activation_bytes // 100 + 2**16 + (CUDA_MARGIN_BYTES if device == "cuda" else 0)


@dataclass
class _Lows:
    """Lowest-memory plans (:meth:`_Problem.low_memory_plans`), the time limit (seconds) that each program
    solving them had, and whether one stopped at it (a longer search may then find lower plans)."""

    plans: list[Plan]
    time_limit: float
    stopped: bool

    def could_improve(self, time_limit: float) -> bool:
        """Whether solving again with ``time_limit`` (seconds) could find lower plans."""
        return self.stopped and time_limit > self.time_limit


def _stopped_at_limit(res: IlpResult) -> bool:
    """Whether a solve stopped at its time limit."""
    return "time limit" in res.status.lower()


class _Problem:
    """One planning problem: the graph, its profile, the fixed bytes and the variants allowed."""

    def __init__(self, strategy: str, graph: Graph, costs: Costs, fixed: int, budget: int | None,
                 use_variants: bool, use_offload: bool = False):
        self.t0 = time.perf_counter()
        # the lowest-memory plans, shared by every problem on this profile with the same options: the floor an
        # InfeasibleBudgetError names is then the floor a later call at that budget reaches (solved again,
        # HiGHS's time-limited search once ended one region's RNG state higher, and the named budget failed)
        per_profile = _LOWS.get(id(costs))
        if per_profile is None:
            per_profile = _LOWS[id(costs)] = {}
            weakref.finalize(costs, _LOWS.pop, id(costs), None)
        key = (strategy, fixed, bool(use_variants), bool(use_offload), costs.step_bytes, costs.link is not None)
        lows = per_profile.setdefault(key, {})
        if not use_variants:  # BatchNorm recomputed as PyTorch's checkpoint does (bn-saved-stats is memfit's)
            costs = costs.recomputing_from_stats(set())
        self.strategy, self.graph, self.costs, self.fixed, self.budget = strategy, graph, costs, fixed, budget
        self.acc = Accounting.build(graph, costs)
        self.names = [n.name for n in graph.nodes]
        self.options = [c.variants for c in costs.nodes] if use_variants else None
        self.offload = use_offload and costs.link is not None
        self.plain = _replay(self.acc, [], fixed)
        # a graph with blocks in row stripes keeps the headroom of the model's own graph, and keeping
        # everything in it is a plan like any other, not plain PyTorch (whose peak the replay predicts exactly)
        self.exact_plain = costs.headroom_of is None
        activation = self.plain.peak_bytes - fixed if self.exact_plain else costs.headroom_of
        self.margin = _margin(activation, costs.device)
        self._lows: dict[tuple, _Lows] = lows  # (recompute_only, fastest) -> the lowest-memory plans

    def keep_everything(self) -> Plan:
        """Keeping every activation: plain PyTorch's plan, or, where the variants are allowed, that plan with
        every plain in-place form (:mod:`memfit.variants.inplace`) where the profile offers one (what code
        written in place by hand, ``out += identity``, runs: ``torch.fx`` traces it out of place) and every
        variant that runs a faster kernel of PyTorch's (``VariantSpec.faster_kernel``: the channels-last pooling)
        where it was measured faster, if its replayed peak is no higher. In-place forms are priced below
        PyTorch's op (``costs._no_faster_than_default``)."""
        from memfit.variants import VARIANTS

        plain = self.finish([], gap=0.0)
        choice = {i: next(name for name in PLAIN_INPLACE if name in opts)
                  for i, opts in enumerate(self.options or []) if any(name in opts for name in PLAIN_INPLACE)}
        for i, opts in enumerate(self.options or []):
            c = self.costs.nodes[i]
            for name, v in opts.items():
                if (i not in choice and name in VARIANTS and VARIANTS[name].faster_kernel
                        and v.fwd_seconds + v.bwd_seconds < c.fwd_seconds + c.bwd_seconds):
                    choice[i] = name
        if not choice:
            return plain
        in_place = self.finish([], gap=0.0, variants=choice)
        return in_place if in_place.predicted_peak_bytes <= plain.predicted_peak_bytes else plain

    def finish(self, spans: Spans, gap: float | None = None, variants: dict[int, str] | None = None,
               offloads: list[int] | None = None) -> Plan:
        """Legalize, replay and package a plan."""
        choice = {self.names[i]: name for i, name in (variants or {}).items()}
        acc = Accounting.build(self.graph, self.costs.with_variants(choice)) if choice else self.acc
        spans = legalize(acc, spans)  # with the chosen in-place forms' writes
        inside = {i for lo, hi in spans for i in range(lo, hi + 1)}
        # an in-place form moves its output into its operand's storage: neither node is offloaded with it
        # (the integer program never combines them; heuristics might)
        tied: set[int] = set()
        for i, name in (variants or {}).items():
            vc = self.costs.nodes[i].variants.get(name)
            if vc is not None and vc.inplace_of is not None:
                tied |= {i, self.acc.producer[vc.inplace_of]}
        offloads = sorted(j for j in (offloads or []) if j not in inside and j not in tied)
        sim = _replay(acc, spans, self.fixed, offloads)
        from_stats = [i for i in sorted(inside) if self.costs.nodes[i].recompute_seconds is not None]
        if from_stats:  # bn-saved-stats holds 2 x C values per BatchNorm, which the program does not count
            kept = Accounting.build(self.graph, self.costs.recomputing_from_stats(set()).with_variants(choice))
            without = _replay(kept, spans, self.fixed, offloads)
            limit = None if self.budget is None else self.budget - self.margin
            if without.peak_bytes < sim.peak_bytes and (limit is None or sim.peak_bytes > limit):
                sim, from_stats = without, []  # (seen: BatchNorms of 65536 channels over 8 values, 7% above)
        plan = Plan.from_spans(self.strategy, self.names, spans, budget_bytes=self.budget, fixed_bytes=self.fixed,
                               predicted_peak_bytes=sim.peak_bytes, predicted_step_seconds=sim.step_seconds,
                               solve_seconds=time.perf_counter() - self.t0, mip_gap=gap,
                               offloads=[self.names[j] for j in offloads], predicted_host_bytes=sim.host_peak_bytes,
                               offload_waits=offload_waits(acc, self.names, offloads),
                               grads_exist=self.costs.grads_exist)
        plan.variants.update(choice)
        plan.stats_recompute = [self.names[i] for i in from_stats]
        return plan

    def start_of(self, plan: Plan | None) -> dict:
        """``solve_regions``'s starting-point arguments for a known plan (none for ``None``)."""
        if plan is None:
            return {}
        index = {name: i for i, name in enumerate(self.names)}
        return {"start_spans": plan.region_spans(),
                "start_variants": {index[n]: v for n, v in plan.variants.items() if v != "default"},
                "start_offloads": [index[n] for n in plan.offloads]}

    def low_memory_plans(self, time_limit: float, recompute_only: bool = False, fastest: bool = False) -> list[Plan]:
        """The lowest-memory plans memfit knows: the integer program minimizing the modelled peak, one region
        per block, Chen's segments and a single region (with ``recompute_only``: the program without variants
        and offloading). With ``fastest``, each peak-minimizing solve is followed by the time-minimizing
        program at the peak it reached (:meth:`fastest_at`), whose plan is listed too.

        Solved once per profile and options (``_LOWS``), shared by later problems and calls (a call without
        ``fastest`` gets those with it, when known), so that ``budget="min"`` does not solve them again for
        the plan after the floor, and the floor an :class:`InfeasibleBudgetError` names is one a later call
        reaches. Except: where a peak-minimizing solve stopped at its time limit and this call gives a longer
        one, they are solved again with it, and the plans known before are kept beside the new ones (the
        budgeted search asks with what is left of its time, down to 1 s: with ``time_limit=8`` ResNet-50 at
        8 x 128 and 33% was refused naming a floor of 41.7%, Chen's, where the floor is 29.5%)."""
        for key in ((recompute_only, fastest), (recompute_only, True)):
            known = self._lows.get(key)
            if known is not None and not known.could_improve(time_limit):
                return copy.deepcopy(known.plans)  # (callers set a plan's budget and solve time)
        known = self._lows.get((recompute_only, fastest))
        plans, stopped = self._solve_lows(time_limit, recompute_only, fastest)
        lows = self._lows[recompute_only, fastest] = _Lows(plans + (known.plans if known else []), time_limit, stopped)
        return copy.deepcopy(lows.plans)

    def _solve_lows(self, time_limit: float, recompute_only: bool, fastest: bool) -> tuple[list[Plan], bool]:
        """The lowest-memory plans, and whether a peak-minimizing program stopped at its time limit (before its
        node limit: the floor found may then be above the one a longer search would find)."""
        # (a model with no operations, `return x`, has no node to make a region of: a fresh user's IndexError)
        plans = [self.finish(chen_spans(self.acc)), self.finish(block_spans(self.graph)),
                 self.finish([(0, self.acc.n - 1)] if self.acc.n else [])]
        if recompute_only:
            res = solve_regions(self.acc, 0, time_limit=time_limit, minimize_peak=True)
            if res.spans is None:
                return plans, _stopped_at_limit(res)
            lows = [self.finish(res.spans)]
            lows = self.next_lows(res, lows[0], None, False, time_limit) + lows
            if fastest:
                lows += self.fastest_at(res, None, False, time_limit)
            return [*lows, *plans], _stopped_at_limit(res)
        if self.offload:
            plans.append(self.finish([], offloads=candidates(self.acc)))
        # with offloading, or with the in-place forms (whose legality rows tie regions together), the search
        # space is larger and the node-limited search may end higher: solve without them too, so that
        # allowing them never raises the floor (seen: ResNet-50 with out-of-place ReLUs, 34% with the forms
        # against 31% without)
        # (the restricted search runs first, and its answer is the full search's starting point)
        option_sets = [self.options]
        if self.options and any(vc.inplace_of is not None for opts in self.options for vc in opts.values()):
            option_sets.insert(0, [{k: vc for k, vc in opts.items() if vc.inplace_of is None}
                                   for opts in self.options])
        # each program is also solved without a starting point: with one, HiGHS (1.16) has returned a
        # "solution" that ignored every in-place form and reported a peak below the program's optimum (a
        # one-ReLU model: budget="min" got plain PyTorch's 51.1 MB, a 40 MB budget a 35.7 MB plan)
        stopped = False
        for offload in sorted({False, self.offload}):
            start = None
            for options in option_sets:
                for begin in ([None, start] if start is not None else [None]):
                    res = solve_regions(self.acc, 0, time_limit=time_limit, minimize_peak=True, variants=options,
                                        offload=offload, start_spans=begin and begin.spans,
                                        start_variants=begin and begin.variants,
                                        start_offloads=begin and begin.offloads)
                    stopped |= _stopped_at_limit(res)
                    if res.spans is not None:
                        plans.insert(0, self.finish(res.spans, variants=res.variants, offloads=res.offloads))
                        if fastest:
                            plans[1:1] = self.fastest_at(res, options, offload, time_limit)
                        start = res
                        plans[:0] = self.next_lows(res, plans[0], options, offload, time_limit)
        return plans, stopped

    def next_lows(self, res: IlpResult, plan: Plan, options, offload: bool, time_limit: float,
                  tries: int = 3) -> list[Plan]:
        """Where the peak-minimizing solution ``res`` replays (``plan``) well above its modelled peak, the program's
        next best solutions, each excluded in turn (up to ``tries``, a sixth of ``time_limit`` each): the
        program leaves a recomputation's transients to the replay, and its optimum can carry large ones. A fresh
        user's MLP returning ``l1``'s output beside the logits: the optimum recomputed that output beside the
        region's values (9.97 MB replayed, 7.86 MB modelled), and ``budget="min"`` came out 17% above a plan an
        80% budget found (7.87 MB); the error of a lower budget named that too-high floor."""
        out: list[Plan] = []
        exclude = [res.spans]
        best = plan.predicted_peak_bytes - self.fixed
        for _ in range(tries):
            if res.objective is None or best - res.objective <= self.margin // 4:
                break
            res = solve_regions(self.acc, 0, time_limit=max(1.0, time_limit / 6), minimize_peak=True,
                                variants=options, offload=offload, exclude=exclude)
            if res.spans is None:
                break
            out.append(self.finish(res.spans, variants=res.variants, offloads=res.offloads))
            exclude.append(res.spans)
            best = min(best, out[-1].predicted_peak_bytes - self.fixed)
        return out

    def stopped_at(self) -> float | None:
        """The longest time limit (seconds) at which a lowest-memory search stopped, or ``None``."""
        return max((lows.time_limit for lows in self._lows.values() if lows.stopped), default=None)

    def fastest_at(self, low: IlpResult, options, offload: bool, time_limit: float) -> list[Plan]:
        """The time-minimizing program at the modelled peak of the peak-minimizing solution ``low``, started
        from it, with a quarter of ``time_limit`` (seconds): the fastest plan the program knows at that peak
        (``[]`` if the solve finds none).

        The peak-minimizing program ignores time, so at the smallest feasible budget its plan can recompute
        more than that peak needs. The budgeted program cannot be used there instead: its peak rows are a
        conservative linearization of the replay, so at a budget equal to the replayed floor it can be
        infeasible (seen: ResNet-18 at batch 8, 96 px, ``remat-ilp`` at its floor 5% slower than 1 KiB
        above it)."""
        res = solve_regions(self.acc, int(low.objective) + 1, time_limit=max(1.0, time_limit / 4), variants=options,
                            offload=offload, start_spans=low.spans, start_variants=low.variants,
                            start_offloads=low.offloads)
        if res.spans is None:
            return []
        return [self.finish(res.spans, gap=res.mip_gap, variants=res.variants, offloads=res.offloads)]

    def smallest_feasible(self, time_limit: float, lows: list[Plan] | None = None) -> int:
        """The smallest budget (bytes) with a plan: the lowest simulated peak of ``lows`` (default: the
        lowest-memory plans, solved now) plus the headroom, or keeping everything (which needs no headroom:
        plain PyTorch's own peak is what the replay predicts exactly)."""
        low = min(p.predicted_peak_bytes for p in (lows or self.low_memory_plans(time_limit)))
        if not self.exact_plain:
            return min(low, self.plain.peak_bytes) + self.margin
        return min(low + self.margin, self.plain.peak_bytes)


def plan_at_floor(strategy: str, graph: Graph, costs: Costs, fixed_bytes: int, time_limit: float = 20.0,
                  use_variants: bool = True, use_offload: bool = True) -> tuple[int, Plan]:
    """``(smallest feasible budget in bytes, the fastest plan found under it)`` for ``remat-ilp`` or ``memfit``
    (``budget="min"``): as :func:`smallest_feasible` then :func:`make_plan` at that budget, but the
    lowest-memory plans are solved once for both (a small transformer at ``min`` took 43 s with
    ``time_limit=5`` before, solving them three times).

    Raises:
        ValueError: another strategy.
    """
    if strategy not in ("remat-ilp", "memfit"):
        raise ValueError(f"plan_at_floor plans remat-ilp or memfit, not {strategy!r}")
    joint = strategy == "memfit"
    prob = _Problem(strategy, graph, costs, fixed_bytes, None, use_variants and joint, use_offload and joint)
    lows = prob.low_memory_plans(time_limit, fastest=True)
    floor = prob.smallest_feasible(time_limit, lows)
    lowest = min(p.predicted_peak_bytes for p in lows)
    below = prob.exact_plain and lowest < prob.plain.peak_bytes <= floor
    if below:  # the least memory is a plan below keeping everything, which needs its headroom (more than keeping
        floor = lowest + prob.margin  # everything's budget); keeping everything, which fits that, is not chosen
        # (a fresh user's small CNN got plain PyTorch's 258,080 B plan with a budget of 298,193 B)
    prob.budget = floor
    plan = _solve(prob, floor, time_limit, keep_everything=not below)
    plan.budget_bytes = floor  # (a lowest-memory plan was made before the budget was known)
    plan.floor_stopped = any(known.stopped for key, known in prob._lows.items() if key[0] is False)
    return floor, plan


def smallest_feasible(graph: Graph, costs: Costs, fixed: int, time_limit: float = 20.0,
                      use_variants: bool = True, use_offload: bool = True) -> int:
    """The smallest budget (bytes) for which :func:`make_plan` finds a ``memfit`` plan (``remat-ilp`` with
    ``use_variants=False`` and ``use_offload=False``): the lowest simulated peak among the lowest-memory
    plans memfit knows plus the safety margin, or plain PyTorch's simulated peak, whichever is lower."""
    return _Problem("memfit", graph, costs, fixed, None, use_variants, use_offload).smallest_feasible(time_limit)


def make_plan(strategy: str, graph: Graph, costs: Costs, budget_bytes: int | None = None,
              fixed_bytes: int | None = None, time_limit: float = 20.0, use_variants: bool = True,
              use_offload: bool = True) -> Plan:
    """Make a plan with one strategy.

    Args:
        strategy: ``none`` (keep everything), ``chen`` (sqrt(n) segments, Chen et al. 2016),
            ``checkpoint-all`` (each block its own checkpoint region), ``vdnn-all`` / ``vdnn-conv``
            (offload every saved activation / the inputs of convolutions, vDNN, Rhu et al., MICRO 2016),
            ``remat-ilp`` (the integer program, recomputation only, Checkmate-like) or ``memfit`` (the
            integer program choosing recomputation, offloading and operator variants jointly).
        graph, costs: the captured graph and its profile.
        budget_bytes: total-peak budget in bytes (the integer programs need it; heuristics only record it).
        fixed_bytes: fixed bytes (default ``costs.fixed_bytes``; add optimizer state).
        time_limit: time limit of each integer program (seconds); the budgeted search keeps to about this in
            all, but near the smallest feasible budget, where the lowest-memory programs are solved too, the
            whole solve can take several times longer.
        use_variants: let ``memfit`` use operator variants.
        use_offload: let ``memfit`` offload activations (needs ``costs.link``, the measured copy costs).

    Returns:
        :class:`Plan` with predicted peak and step time.

    Raises:
        ValueError: unknown strategy, an integer program without a budget, or an offloading strategy
            without measured copy costs (profile with an offload store).
        InfeasibleBudgetError: no plan under the budget; names the smallest feasible one.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    fixed = costs.fixed_bytes if fixed_bytes is None else fixed_bytes
    if strategy in OFFLOAD_STRATEGIES and costs.link is None:
        raise ValueError(f"the {strategy} strategy offloads: profile with an offload store (memfit.plan(..., "
                         "offload=True) or --offload-dir) so that the copy costs are measured")
    joint = strategy == "memfit"
    prob = _Problem(strategy, graph, costs, fixed, budget_bytes, use_variants and joint, use_offload and joint)
    if strategy == "none":
        return prob.finish([])
    if strategy == "chen":
        return prob.finish(chen_spans(prob.acc))
    if strategy == "checkpoint-all":
        return prob.finish(block_spans(graph))
    if strategy == "vdnn-all":
        return prob.finish([], offloads=candidates(prob.acc))
    if strategy == "vdnn-conv":
        return prob.finish([], offloads=conv_input_producers(graph, prob.acc))
    if budget_bytes is None:
        raise ValueError(f"the {strategy} strategy needs a budget (bytes or a percentage)")
    return _solve(prob, budget_bytes, time_limit)


def _fewer_regions(prob: _Problem, plan: Plan, limit: int, until: float) -> Plan | None:
    """A heuristic's plan (Chen's segments, a region per block) with as many regions dropped as still fit: each
    region in turn, the one whose recomputation costs most first, is kept as plain PyTorch keeps it (its
    activations saved) where the replayed peak stays within ``limit`` (bytes; the most of the costliest at once,
    by bisection, then each of the others), until the clock reaches ``until``
    (``time.perf_counter()``). ``None`` where the heuristic's own plan does not fit.

    Where the integer program finds nothing in its time (a 1,653-node MaxViT-T at 80% of its activation peak,
    ``time_limit=30``), the plan was one of those heuristics', every node recomputed (1.50x plain's step
    predicted); this one recomputes what the budget needs, and starts the program's search."""
    if plan.predicted_peak_bytes > limit:
        return None
    acc = prob.acc
    order = sorted(plan.region_spans(), key=lambda s: -sum(acc.recompute_seconds[s[0]:s[1] + 1]))  # (legalized)
    # the most of the costliest that can go at once, by bisection (a replay of a large graph takes a fraction of a
    # second: MaxViT-T's 0.2-0.6 s), then each of the others in turn
    lo, hi = 0, len(order)
    while lo < hi and time.perf_counter() < until:
        mid = (lo + hi + 1) // 2
        trial = prob.finish(order[mid:])
        if trial.predicted_peak_bytes <= limit:
            lo, plan = mid, trial
        else:
            hi = mid - 1
    kept = order[lo:]
    for span in order[lo:]:
        if time.perf_counter() > until:
            break
        trial = prob.finish([s for s in kept if s != span])
        if trial.predicted_peak_bytes <= limit:
            kept = [s for s in kept if s != span]
            plan = trial
    return plan


def _solve(prob: _Problem, budget_bytes: int, time_limit: float, keep_everything: bool = True) -> Plan:
    """The integer program, checked by the replay (``keep_everything=False``: not plain PyTorch's plan, even
    where it fits, for ``budget="min"`` when the least memory is a plan below it).

    The program is a conservative linearization of the replay: solve, replay, and move the program's budget
    by the replay's error (down when over the limit, up to use slack), bisecting between the largest program
    budget that replayed under the limit and the smallest that did not. Where that gives no plan under the
    limit in time (near the smallest feasible budget), the lowest-memory plans, replayed exactly, are
    candidates too, and the search goes on from the best of them. The fastest plan that fits wins.

    ``memfit`` first solves the recompute-only program (``remat-ilp``'s, a smaller search) for 40% of the
    time and starts the joint program (variants, offloading) from the best plan so far, so that the joint
    plan is never slower than the recompute-only one. Without that, a time-limited joint search ended far
    from the optimum on an H200's costs: ResNet-50 at batch 184, 5 GB, 3.5x predicted against 1.27x.

    The bisection's program prices a cut between adjacent regions but not a region that starts after a kept
    node; the program that found the best plan is then bisected again, from that plan and its program budget,
    with every region priced (``solve_regions(price_region_starts=True)``, the last 20% of ``time_limit``).
    ResNet-50 at batch 8, 128 px: ``remat-ilp`` at 40% predicted 1.128x instead of 1.144x; a 12-layer MLP with
    a region as dear as a step got 3 regions where 2 fit in 6 runs of 60 before, 0 of 60 after one priced
    solve, and more regions than the unpriced program's plan in 3 runs of 120 on a loaded machine with one
    priced solve (its plan replayed over the limit), 0 of 120 with the priced bisection.
    """
    acc, fixed, margin = prob.acc, prob.fixed, prob.margin
    limit = budget_bytes - margin  # what the simulated peak may reach
    # keeping everything is the fastest plan, and plain PyTorch's peak (exactly what the replay predicts) needs no
    # headroom: at budget "100%" a fresh user got two BatchNorms recomputed, 8% slower
    if keep_everything and prob.plain.peak_bytes <= (budget_bytes if prob.exact_plain else limit):
        return prob.keep_everything()
    deadline = time.perf_counter() + time_limit
    best: Plan | None = None
    best_from: tuple | None = None  # (program budget, variant options, offload) of the program that found best
    fallbacks: set[int] = set()  # ids of lowest-memory plans taken as candidates (solved for another program)

    def consider_low(plan: Plan) -> None:
        plan.mip_gap = None  # its gap is the floor program's, not this budget's
        fallbacks.add(id(plan))
        consider(plan)

    solved = False  # (whether a budgeted program found a plan)
    timed_out = False  # (whether one ran out of time without a plan, rather than being infeasible)

    def consider(plan: Plan, found_by: tuple | None = None) -> bool:
        nonlocal best, best_from, solved
        solved = solved or found_by is not None
        fits = plan.predicted_peak_bytes <= limit
        if fits and (best is None or plan.predicted_step_seconds < best.predicted_step_seconds):
            best, best_from = plan, found_by
        return fits

    def search(options, offload: bool, until: float, priced: bool = False, target: int | None = None) -> None:
        """Bisect the program's budget (from ``target``, bytes above the fixed ones) until ``until``. When a
        solve runs out of time without any solution, the lowest-memory plans become candidates and the next
        solve starts from the best plan so far; they are candidates too when the search ends without beating
        the plan it started from. ``priced``: every region priced (``price_region_starts``), and no
        lowest-memory plans (the search refines a plan already found)."""
        nonlocal timed_out
        # (a quarter of the margin below the limit: the program's plans replayed up to 22 KB over it on ResNet-50, and
        # the solves at 64 KiB lower targets, with half the time each, then ended without a plan: 1.24x, not 1.11x;
        # where that is infeasible, at the smallest feasible budget, the limit itself is tried next)
        top = limit - fixed
        target = (top - margin // 4) if target is None else target
        ok_target, bad_target = None, None
        plan: Plan | None = None
        lows_tried = priced
        recompute_only = options is None and not offload
        start = best
        for _ in range(8):
            remaining = until - time.perf_counter()
            if target <= 0 or remaining <= 0.5:
                break
            res = solve_regions(acc, target, time_limit=max(1.0, remaining / 2), variants=options,
                                offload=offload, price_region_starts=priced, **prob.start_of(best))
            if res.spans is None:
                if "nfeasible" not in res.status:  # out of time without a solution
                    timed_out = True
                    if lows_tried:
                        break
                    lows_tried = True
                    for low in prob.low_memory_plans(max(1.0, (until - time.perf_counter()) / 2), recompute_only,
                                                      fastest=True):
                        consider_low(low)
                    continue
                if plan is None and target < top:  # the first solve, below the limit
                    target = top
                    continue
                bad_target = target
            else:
                plan = prob.finish(res.spans, gap=res.mip_gap, variants=res.variants, offloads=res.offloads)
                if consider(plan, (target, options, offload)):
                    ok_target = target
                    if limit - plan.predicted_peak_bytes <= margin // 2:
                        break
                else:
                    bad_target = target
            if ok_target is None:
                step = (plan.predicted_peak_bytes - limit) if res.spans is not None else target // 4
                target -= max(step, 2**16)
            elif bad_target is None:
                target = ok_target + max(limit - plan.predicted_peak_bytes, 2**16)
            elif bad_target - ok_target <= margin // 2:
                break
            else:
                target = (ok_target + bad_target) // 2
        if best is start and not lows_tried:  # (seen on an H200: a poor incumbent at 6 GB, Chen's plan kept)
            for low in prob.low_memory_plans(max(1.0, until - time.perf_counter()), recompute_only, fastest=True):
                consider_low(low)

    # cheap incumbents to start the search from, with the regions the budget does not need dropped (on a graph too
    # large for the program, MaxViT-T's 1,653 nodes, a replay takes 0.2-0.6 s: a quarter of the time for both)
    until = time.perf_counter() + 0.25 * time_limit
    for spans in (block_spans(prob.graph), chen_spans(acc)):
        heuristic = prob.finish(spans)
        consider(heuristic)
        fewer = _fewer_regions(prob, heuristic, limit, until)
        if fewer is not None:
            consider(fewer)
    if prob.offload:  # so the joint plan is never slower than offloading alone
        consider(prob.finish([], offloads=candidates(acc)))
        consider(prob.finish([], offloads=conv_input_producers(prob.graph, acc)))
    # (seen on an H200 without the lowest-memory plans as candidates: ResNet-50 at 6 GB got Chen's segments at
    # 1.33x, at 5 GB vDNN's offloading at 7x, where the peak-minimizing program found a plan at 1.28x)
    if prob.options or prob.offload:  # the recompute-only program first
        search(None, False, time.perf_counter() + 0.4 * time_limit)
    search(prob.options, prob.offload, deadline - 0.2 * time_limit)
    if best_from is not None and deadline - time.perf_counter() > 0.5:
        # the program that found the best plan, solved again from it with every region priced (a region after a
        # kept node included), and bisected on its own: the bisection's program leaves those unpriced, and its
        # plans could hold three regions where two fit (tests/test_region_overhead.py, 1 run in 10); solved
        # once at that plan's program budget, the priced plan could replay over the limit and was dropped
        # (5 regions where the unpriced program's plan had 3, 3 runs in 120 on a loaded machine)
        target, options, offload = best_from
        search(options, offload, deadline, priced=True, target=target)
    lows: list[Plan] = []
    if best is None:
        # the floor's own plans, solved as smallest_feasible solves them (with the whole time limit): the
        # time-limited searches above can miss them on a loaded machine, and budget="min" then failed with
        # "no plan fits a budget of X; the smallest feasible budget is X" (EfficientNet-B0, 1 run in 5)
        lows = prob.low_memory_plans(time_limit)
        for low in lows:
            consider_low(low)
    if best is not None:
        best.solve_seconds = time.perf_counter() - prob.t0
        best.budget_bytes = budget_bytes  # (a lowest-memory plan carries the budget of the call that first solved it)
        # (a fallback, or a heuristic's incumbent the searches never beat: a fresh user's DenseNet-121 at 90% with
        # time_limit=10 got a region per block, 1.4-1.6x plain's step at 43% of the budget's activation bytes, unwarned)
        # (and a heuristic's plan whenever no program found one: MaxViT-T's 1,653 nodes at 80%, time_limit=30)
        low = best.predicted_peak_bytes < fixed + 0.8 * (limit - fixed)
        # (a program infeasible at every budget tried, whose peak rows are more conservative than the replay, is
        # not warned about unless the plan recomputes more than the budget needs: at budget="min" a conv encoder
        # called twice got the heuristic's floor plan, and a warning to give a longer time limit, which changes
        # nothing)
        if best_from is None and (low or (id(best) not in fallbacks and not solved and timed_out)):
            what = ("a lowest-memory one" if id(best) in fallbacks else "a heuristic's (a region per block or Chen's "
                    "segments, less the regions the budget does not need)")
            why = (f"within time_limit={time_limit:g} s" if timed_out else
                   "(its memory model is more conservative than the replay near the smallest feasible budget)")
            advice = ("Give a longer time_limit (--time-limit) for a faster plan." if timed_out else
                      "A slightly larger budget may give a faster plan.")
            warn_user(f"memfit: the integer program found no plan for this budget {why}, "
                      f"so the plan is {what}{', which recomputes more than this budget needs' if low else ''} (its "
                      f"peak is {fmt_bytes(best.predicted_peak_bytes)} of {fmt_bytes(budget_bytes)}, its step "
                      f"{best.predicted_step_seconds / prob.plain.step_seconds:.2f}x plain PyTorch's, predicted). "
                      f"{advice}")
        return best
    if keep_everything and prob.exact_plain and prob.plain.peak_bytes <= budget_bytes:  # it fits without headroom
        return prob.keep_everything()
    floor = prob.smallest_feasible(time_limit, lows)
    raise InfeasibleBudgetError(budget_bytes, floor, fixed, acc.step_bytes, prob.stopped_at(),
                                input_bytes=prob.costs.input_bytes,
                                margin_bytes=prob.margin if floor < prob.plain.peak_bytes else 0)
