"""The optimizer's memory: its state, and the temporaries of ``optimizer.step()``.

A training step's peak can be the optimizer step: after the backward pass every gradient exists, and
``Adam.step()`` allocates temporaries (``exp_avg_sq.sqrt()`` and the denominator: about twice the largest
parameter with the per-parameter implementation, a multiple of a whole parameter group with
``foreach=True``). In a model whose activations are small next to its parameters that is the step's peak,
and no plan lowers it; it still has to be inside the budget. Both figures are measured by running the
user's optimizer class, with the user's hyperparameters, on scratch copies of the parameters.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from memfit.profile.tracker import MemoryTracker, live_bytes


@dataclass
class OptimizerCost:
    """Measured memory of an optimizer (bytes).

    Attributes:
        state_bytes: the state it keeps between steps (e.g. ``exp_avg`` and ``exp_avg_sq`` for Adam).
        step_bytes: the most ``optimizer.step()`` allocates above that while it runs (freed when it returns).
        state_by_param: ``id()`` of each of the user's parameters measured -> the bytes of its state.
    """

    state_bytes: int = 0
    step_bytes: int = 0
    state_by_param: dict[int, int] = field(default_factory=dict)


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None, params: list[torch.Tensor],
                          measured: dict[int, int] | None = None) -> int:
    """Bytes of the optimizer state a training step holds: the state the optimizer keeps now (of every parameter
    it has stepped), plus the state its next step creates for the parameters in ``params`` (pass the ones the
    step gives a gradient) that the optimizer holds, that require grad and that have none yet: before its first
    step, or unfrozen or added with ``add_param_group`` since (counting only the state that existed put a fresh
    user's second fine-tuning stage 1.39x over its budget with AdamW). That new state is ``measured`` (parameter
    ``id()`` -> bytes, :attr:`OptimizerCost.state_by_param`) where given, else estimated: 2x the parameter for
    Adam-style optimizers (``exp_avg``, ``exp_avg_sq``; 3x with ``amsgrad``), 1x for RMSprop's ``square_avg`` plus
    1x each for its momentum and ``centered``, 2x for Adadelta, 1x in another group with momentum, 0 otherwise."""
    if optimizer is None:
        return 0
    return live_bytes(_state_tensors(optimizer)) + new_state_bytes(optimizer, params, measured)


def new_state_bytes(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                    measured: dict[int, int] | None = None) -> int:
    """Bytes of the state the next step of ``optimizer`` creates for the parameters of ``params`` it holds that
    require grad and have none yet (:func:`optimizer_state_bytes`, less the state it keeps now)."""
    have = {id(p) for p, st in optimizer.state.items()
            if any(isinstance(t, torch.Tensor) for t in st.values())}
    wanted = {id(p) for p in params if p.requires_grad} - have
    new = 0
    name = type(optimizer).__name__.lower()
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in wanted:
                continue
            wanted.discard(id(p))  # (once, if a parameter is in two groups)
            if measured is not None:
                new += measured.get(id(p), 0)
            else:  # (a fresh user's AdamW(amsgrad=True) was estimated 2x, RMSprop(momentum=0.9) 1x: 3x and 2x kept)
                momentum = 1 if g.get("momentum", 0) else 0
                copies = (2 + bool(g.get("amsgrad")) if "adam" in name else
                          1 + momentum + bool(g.get("centered")) if "rmsprop" in name else
                          2 if "adadelta" in name else momentum)
                new += copies * p.untyped_storage().nbytes()
    return new


@contextlib.contextmanager
def _no_global_step_hooks():
    """Without the hooks ``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``..._post_hook`` registered
    for every optimizer (a user's EMA update or step logger), which the scratch steps would otherwise run."""
    import torch.optim.optimizer as opt_module

    names = [n for n in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
             if isinstance(getattr(opt_module, n, None), dict)]
    saved = {n: dict(getattr(opt_module, n)) for n in names}
    try:
        for n in names:
            getattr(opt_module, n).clear()
        yield
    finally:
        for n in names:
            getattr(opt_module, n).update(saved[n])


def _attributes_differ(optimizer: torch.optim.Optimizer, twin: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` holds an attribute of its own that the rebuilt ``twin`` lacks or holds with another
    value (an optional constructor argument the user gave: ``AdamEMA(params, ema_decay=0.99)``)."""
    mine, theirs = vars(optimizer), vars(twin)
    for k, v in mine.items():
        if k.startswith("_") or k in ("state", "param_groups", "defaults", "step"):
            continue
        if k not in theirs:
            return True
        try:
            if not bool(theirs[k] == v):
                return True
        except Exception:  # noqa: BLE001 -- (a tensor, an array: compared by identity)
            if theirs[k] is not v:
                return True
    return False


def _copy_onto(optimizer: torch.optim.Optimizer, scratch_of: dict[int, torch.Tensor]) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` holding the scratch parameters, its state cleared: of the whole ``__dict__``
    (``copy.deepcopy(optimizer)`` goes through ``Optimizer.__getstate__``, which keeps only defaults, state and
    param_groups, and loses what the constructor set on self), without an instance ``step`` an LR scheduler
    wrapped (the copy's would step the user's optimizer: a fresh user's parameters moved by 0.04)."""
    twin = type(optimizer).__new__(type(optimizer))
    twin.__dict__.update(copy.deepcopy(optimizer.__dict__, memo=dict(scratch_of)))
    twin.state.clear()
    twin.__dict__.pop("step", None)
    return twin


def _advance_step_counts(optimizer: torch.optim.Optimizer) -> None:
    """Set every step counter in ``optimizer``'s state (``state["step"]``, a tensor or a number) far on."""
    for st in optimizer.state.values():
        v = st.get("step") if isinstance(st, dict) else None
        if isinstance(v, torch.Tensor):
            v.fill_(10**7)
        elif isinstance(v, int | float):
            st["step"] = type(v)(10**7)


def measure_optimizer(optimizer: torch.optim.Optimizer | None,
                      trained: set[int] | None = None) -> OptimizerCost | None:
    """Measure ``optimizer``'s state and step temporaries on scratch copies of its parameters.

    A new instance of ``type(optimizer)`` with the same parameter groups and hyperparameters runs two steps
    on zero-valued copies of the trainable parameters (same shapes, dtypes and device) with constant
    gradients; the second step runs under :class:`~memfit.profile.MemoryTracker`. An optimizer whose constructor
    takes arguments of its own is deep-copied instead, with the scratch copies in its parameters' place and its
    state cleared (and without an instance ``step`` an LR scheduler wrapped, which would step the user's). The
    user's optimizer and parameters are not touched, and no step hook runs (the optimizer's own or the global
    ones: a user's EMA update fired twice during planning). Needs, for a moment, the parameters' size again for the copies, their
    gradients and their state (4x the parameters for Adam).

    Args:
        optimizer: the optimizer the user trains with, or ``None``.
        trained: ``id()`` of the parameters the training step gives a gradient (``None``: every trainable one).
            PyTorch's optimizers make no state for a parameter whose gradient is ``None`` (an eval-only head:
            counting its state put a fresh user's plan 1 MiB above what the step measured).

    Returns:
        :class:`OptimizerCost`, or ``None`` when ``optimizer`` is ``None`` or cannot be rebuilt this way
        (a warning then says so, and the caller falls back to an estimate of the state and no step
        temporaries).
    """
    if optimizer is None:
        return None
    try:
        groups, device = [], None
        scratch_of: dict[int, torch.Tensor] = {}
        for g in optimizer.param_groups:
            scratch = []
            for p in g["params"]:
                if not p.requires_grad or (trained is not None and id(p) not in trained):
                    continue
                s = torch.zeros_like(p, memory_format=torch.preserve_format).requires_grad_()
                s.grad = torch.full_like(s, 1e-3)
                scratch.append(s)
                scratch_of[id(p)] = s
                device = p.device
            if scratch:
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": scratch})
        if not groups:
            return OptimizerCost()
        try:
            twin = type(optimizer)(groups, **optimizer.defaults)
        except TypeError:
            try:
                twin = type(optimizer)(groups)
            except TypeError:  # a constructor with arguments of its own: a copy holding the scratch parameters
                twin = None
        if twin is None or _attributes_differ(optimizer, twin):  # (an optional argument of its own, given:
            twin = _copy_onto(optimizer, scratch_of)             # AdamEMA(ema_decay=0.99) measured as Adam, 1.19x)
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):  # the user's, copied: an EMA
            if isinstance(getattr(twin, name, None), dict):
                setattr(twin, name, OrderedDict())
        with _no_global_step_hooks():
            twin.step()  # creates the state
            state = live_bytes(_state_tensors(twin))
            by_param = {pid: live_bytes([t for t in twin.state.get(s, {}).values() if isinstance(t, torch.Tensor)])
                        for pid, s in scratch_of.items()}
            step = 0
            # the second step; the step far on: RAdam rectifies from its 6th step, ASGD averages after t0 (1.37x,
            # 1.18x); and the one after it, which reads what that step derived from its count (ASGD's `mu`, set at
            # the end of a step from its count and read by the next: with t0=1, 1.037x from the 4th step, unwarned)
            for later in (False, True, None):
                if later:
                    _advance_step_counts(twin)
                before = live_bytes(_state_tensors(twin))
                with MemoryTracker(device) as tracker:
                    twin.step()
                # (state the step adds stays: counted as state. The tracker cannot subtract a block made before it
                # and freed inside, so its net figure would count a replaced state tensor twice: 1.19x over)
                grown = max(0, live_bytes(_state_tensors(twin)) - before)
                state += grown
                step = max(step, tracker.peak_bytes - grown)
        del twin, groups, scratch
        return OptimizerCost(state_bytes=state, step_bytes=step, state_by_param=by_param)
    except Exception as exc:  # noqa: BLE001 -- a custom optimizer can fail in many ways; planning must not
        params = [p for g in optimizer.param_groups for p in g["params"]]
        stepped = bool(_state_tensors(optimizer))
        guess = optimizer_state_bytes(optimizer, params)
        what = (f"its state is counted as it is now, with an estimate for parameters that have none yet ({guess} "
                "bytes)" if stepped else
                f"its state is estimated at {guess} bytes (2x the trainable parameters for Adam-style optimizers, "
                "1x with momentum, else 0), which can be too low: run one optimizer step before planning so that "
                "memfit counts the state it really keeps")
        warnings.warn(f"memfit could not measure {type(optimizer).__name__}.step()'s memory on scratch "
                      f"parameters ({type(exc).__name__}: {exc}); {what}, and the temporaries of its step are not "
                      "counted in the budget", stacklevel=3)
        return None


#: the options of ``torch.optim`` optimizers that choose their step's implementation (a loop over the parameters, one
#: ``_foreach_*`` call per operation, a fused kernel), and so the temporaries their ``step()`` allocates
IMPLEMENTATION_OPTIONS = ("foreach", "fused", "capturable", "differentiable")


def optimizer_options(optimizers: list) -> dict[str, dict]:
    """``{class name: {option: value}}``: the :data:`IMPLEMENTATION_OPTIONS` each optimizer of ``optimizers`` was
    built with (those in its ``defaults``; ``None`` is PyTorch's choice), for :attr:`memfit.Plan.optimizer_options`.
    A later optimizer of a class listed whose options differ allocates other temporaries in its step (AdamW on a
    ResNet-18: 12 B in a loop, 44.7 MB with ``foreach=True``)."""
    return {type(o).__name__: _resolved(o) for o in optimizers}


def _resolved(optimizer) -> dict:
    """``optimizer``'s :data:`IMPLEMENTATION_OPTIONS`, ``None`` (PyTorch's choice) resolved as ``torch.optim``'s
    optimizers resolve it (``_default_to_fused_or_foreach``: ``foreach`` on devices with its kernels, never
    ``fused``)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    options = {k: optimizer.defaults[k] for k in IMPLEMENTATION_OPTIONS if k in optimizer.defaults}
    if "foreach" in options and options["foreach"] is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        options["foreach"] = not options.get("fused") and _default_to_fused_or_foreach(
            params, bool(options.get("differentiable", False)))[1]
    if options.get("fused", False) is None:
        options["fused"] = False
    return options

