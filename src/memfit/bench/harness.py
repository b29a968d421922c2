"""The side-by-side harness: plain PyTorch and a planned module, measured the same way in one process.

Memory is the total of live tensor storage on the device during one training step (forward, loss,
backward, optimizer step): fixed bytes (parameters, gradients, buffers, optimizer state, the batch) are
counted from the live tensors before the step, and the activation part with :class:`MemoryTracker`
(every allocation, temporaries included). Gradients are allocated before the measured step so that the
fixed part does not move during it.
"""

from __future__ import annotations

import contextlib
import copy
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from memfit.profile.timing import median_seconds, sync
from memfit.profile.tracker import MemoryTracker, live_bytes


@dataclass
class StepFigures:
    """Measured figures of one training setup.

    Attributes:
        peak_bytes: total peak during one step (bytes).
        fixed_bytes: parameters, gradients, buffers, optimizer state and inputs (bytes).
        activation_peak_bytes: ``peak_bytes - fixed_bytes``.
        step_seconds: median step time (seconds).
        grads: gradients after the last step, by parameter name (for comparisons).
        buffers: buffers (BatchNorm statistics) after the last step, by name.
        losses: loss of every step, in order.
    """

    peak_bytes: int
    fixed_bytes: int
    activation_peak_bytes: int
    step_seconds: float
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    losses: list[float]


def measure_training(module: nn.Module, params_of: nn.Module, inputs: tuple, target, loss_fn: Callable,
                     steps: int = 3, seed: int = 0, lr: float = 0.01, grads_exist: bool = False,
                     autocast: torch.dtype | None = None) -> StepFigures:
    """Train ``module`` for ``1 + steps`` SGD steps (momentum 0.9) on one batch and measure it.

    Step 1 is the warm-up (it allocates the optimizer state); step 2 runs under the memory tracker; the time
    is the median of steps 2..``1 + steps`` measured without the tracker (step 2 is run again untracked for
    that). The RNG is seeded with ``seed`` first, so two modules that compute the same thing draw the same
    dropout masks. Every step starts with ``optimizer.zero_grad()`` (``.grad`` set to ``None``, PyTorch's
    default), or, with ``grads_exist``, ``zero_grad(set_to_none=False)`` on preallocated gradients.

    Memory: ``fixed_bytes`` is what is live before the tracked step (parameters, buffers, optimizer state,
    batch; gradients too when they exist) plus, when they do not exist yet, the bytes of the parameter
    gradients the step will create (DESIGN.md counts gradients as fixed); ``peak_bytes`` is what is live
    before the step plus the tracked peak above it.

    Args:
        module: the callable model (plain, or a :class:`~memfit.PlannedModule`).
        params_of: the module that owns the parameters and buffers (``module`` itself for plain PyTorch).
        inputs: positional inputs, e.g. ``(images [B, C, H, W],)``.
        target: passed to ``loss_fn(output, target)``.
        loss_fn: loss function.
        steps: timed steps (>= 1).
        seed: RNG seed.
        lr: SGD learning rate.
        grads_exist: keep gradients allocated between steps (``zero_grad(set_to_none=False)``).
        autocast: run the forward pass and the loss of every step inside one
            ``torch.autocast(device_type, dtype=autocast)`` context (e.g. ``torch.bfloat16``), and the backward
            pass and ``opt.step()`` outside it, as PyTorch's mixed-precision recipe does; ``None``: no autocast.

    Returns:
        :class:`StepFigures`.
    """
    steps = max(1, steps)
    device = next(params_of.parameters()).device
    torch.manual_seed(seed)
    opt = torch.optim.SGD(params_of.parameters(), lr=lr, momentum=0.9)
    losses: list[float] = []
    trainable = [p for p in params_of.parameters() if p.requires_grad]

    def zero() -> None:
        opt.zero_grad(set_to_none=not grads_exist)

    def step() -> None:
        with (torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()):
            out = module(*inputs)
            loss = loss_fn(out, target)
            del out
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))

    if grads_exist:
        for p in trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    zero()
    step()
    trainable = [p for p in trainable if p.grad is not None]  # (a parameter the step never reads gets none)
    zero()
    live = live_bytes(list(params_of.parameters()) + [p.grad for p in params_of.parameters()]
                      + list(params_of.buffers()) + [t for t in inputs if isinstance(t, torch.Tensor)]
                      + [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
                      + ([target] if isinstance(target, torch.Tensor) else []))
    fixed = live if grads_exist else live + sum(p.untyped_storage().nbytes() for p in trainable)
    with MemoryTracker(device) as tracker:
        step()

    def timed() -> None:
        zero()
        step()

    step_seconds = median_seconds(timed, device, steps)
    grads = {n: p.grad.detach().clone() for n, p in params_of.named_parameters() if p.grad is not None}
    buffers = {n: b.detach().clone() for n, b in params_of.named_buffers()}
    peak = live + tracker.peak_bytes
    return StepFigures(peak_bytes=peak, fixed_bytes=fixed, activation_peak_bytes=peak - fixed,
                       step_seconds=step_seconds, grads=grads, buffers=buffers, losses=losses)


def interleaved_step_seconds(setups: list[tuple[nn.Module, nn.Module]], inputs: tuple, target,
                             loss_fn: Callable, rounds: int = 5, lr: float = 0.01,
                             grads_exist: bool = False) -> list[float]:
    """Median step time (seconds) of several training setups, timed in rounds (one step of each, in an order
    shuffled per round with a fixed seed) so that machine noise hits them alike; compare them as ratios of these
    medians.

    Args:
        setups: ``(module, params_of)`` pairs, as in :func:`measure_training`. Each trains its own
            parameters with SGD (momentum 0.9); run them on copies you do not need afterwards.
        inputs, target, loss_fn: the batch and loss.
        rounds: timed steps per setup, after one untimed warm-up step each.
        grads_exist: zero gradients in place instead of setting them to ``None``.

    Returns:
        One median per setup, in order.
    """
    opts = [torch.optim.SGD(p.parameters(), lr=lr, momentum=0.9) for _, p in setups]
    device = next(setups[0][1].parameters()).device
    times: list[list[float]] = [[] for _ in setups]
    for r in range(rounds + 1):
        # each round in its own (seeded) order: a step's time depends on the allocator's state the step before it
        # left (on the CPU, memory given back to the system is paid for again in page faults), so no setup always
        # follows the same one (in a fixed order, plain PyTorch, always first, measured 7% slower than the same
        # graph kept whole by memfit's runtime, on ResNet-50)
        order = list(range(len(setups)))
        random.Random(r).shuffle(order)
        for k, (module, _), opt in ((k, setups[k], opts[k]) for k in order):
            sync(device)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=not grads_exist)
            loss = loss_fn(module(*inputs), target)
            loss.backward()
            opt.step()
            del loss
            sync(device)
            if r:
                times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def compare(reference: StepFigures, other: StepFigures) -> dict:
    """Gradient and BatchNorm-statistics agreement of ``other`` with ``reference`` (plain PyTorch).

    Returns:
        ``{"gradients_match", "max_abs_grad_diff", "bn_stats_match", "buffers_compared"}``; matching means max
        abs diff <= 1e-5 (float32) and the same parameter and buffer names; ``buffers_compared`` is how many of
        plain PyTorch's buffers were compared (0 for a model without any: ``bn_stats_match`` is then trivially
        true, and the report says so).
    """
    def strip(name: str) -> str:  # names as the plain model has them (torch.compile adds _orig_mod.)
        return name.removeprefix("gm.").removeprefix("_orig_mod.")

    ref_g = {strip(k): v for k, v in reference.grads.items()}
    oth_g = {strip(k): v for k, v in other.grads.items()}
    diff = max((float((_wide(ref_g[k]) - _wide(oth_g[k])).abs().max()) for k in ref_g if k in oth_g), default=0.0)
    ref_b = {strip(k): v for k, v in reference.buffers.items()}
    oth_b = {strip(k): v for k, v in other.buffers.items()}
    bn = set(ref_b) == set(oth_b) and all(
        float((ref_b[k].double() - oth_b[k].double()).abs().max()) <= 1e-5 if ref_b[k].numel() else True
        for k in ref_b)
    return {"gradients_match": set(ref_g) == set(oth_g) and diff <= 1e-5, "max_abs_grad_diff": diff,
            "bn_stats_match": bn, "buffers_compared": len(ref_b)}


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64, or complex128 for a complex tensor (``.float()`` would drop its imaginary part)."""
    return t.to(torch.complex128) if t.is_complex() else t.double()


def fresh_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` (same initial weights and buffers) for a side-by-side run."""
    return copy.deepcopy(model)
