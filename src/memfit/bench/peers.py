"""Peers: other systems' answers to the same question, measured with the same harness as memfit's plans.

* ``torch-budget`` -- PyTorch's own compile-time activation budget: ``torch.compile`` with
  ``torch._functorch.config.activation_memory_budget = b``. AOTAutograd's min-cut partitioner then decides
  which forward values the backward graph saves and which it recomputes, so that the saved activations stay
  near ``b`` times what the default partitioner would save (1.0 = the default, 0.0 = recompute everything
  it is allowed to). Backends: ``aot_eager_decomp_partition`` (decomposition and partitioning without code
  generation; runs anywhere) and ``inductor`` (generated C++/OpenMP kernels on CPU; needs a C++ compiler and
  minutes of compilation for a ResNet).
* ``rockmate`` -- Rockmate 2.0 (Zhao et al., ICML 2023; ``pip install rockmate``), if it can be imported.
  It is an optional peer, not a dependency. Rockmate 2.0.0 hard-codes ``torch.device("cuda")`` and CUDA
  streams in ``Rockmate.__init__``, so on a CPU it records why it cannot run.

Every function returns a row of ``memfit bench`` (the ``memfit run --json`` report plus ``budget_fraction``
and ``backend``); failures are recorded in the row's ``error`` instead of raised.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from memfit.bench.harness import StepFigures, fresh_copy, interleaved_step_seconds, measure_training

#: knob values of ``activation_memory_budget`` measured by default.
TORCH_BUDGETS = (1.0, 0.5, 0.3, 0.1, 0.0)
#: the backend that partitions with the min-cut solver but generates no code (works on any CPU).
AOT_EAGER = "aot_eager_decomp_partition"
INDUCTOR = "inductor"
#: gradient agreement asked of compiled code: decompositions and fused kernels reorder floating-point sums.
COMPILED_GRAD_TOLERANCE = 1e-4


@contextlib.contextmanager
def activation_memory_budget(budget: float):
    """Set ``torch._functorch.config.activation_memory_budget`` inside the block, restore it after, and reset
    dynamo's caches on both sides (the budget is not part of dynamo's guards: a cached graph compiled under
    another budget would otherwise be reused)."""
    import torch._dynamo
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    try:
        with functorch_config.patch(activation_memory_budget=float(budget)):
            yield
    finally:
        torch._dynamo.reset()


def _compile_now(compiled: nn.Module, params_of: nn.Module, inputs: tuple, target, loss_fn) -> float:
    """Run one forward and backward so that the forward and backward graphs are compiled, then put the
    module back as it was (buffers restored, gradients ``None``). Returns the wall time (seconds)."""
    saved = [(b, b.detach().clone()) for b in params_of.buffers()]
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        loss = loss_fn(compiled(*inputs), target)
        loss.backward()
    seconds = time.perf_counter() - t0
    del loss
    with torch.no_grad():
        for buf, value in saved:
            buf.copy_(value)
    for p in params_of.parameters():
        p.grad = None
    return seconds


def compiled_graph_count() -> int:
    """Graphs dynamo compiled since its last reset (1 means the whole model became one graph)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def measure_torch_budget(model: nn.Module, inputs: tuple, target, loss_fn, budget: float,
                         backend: str = AOT_EAGER, steps: int = 3, seed: int = 0):
    """Compile a copy of ``model`` with ``activation_memory_budget = budget`` and measure it.

    Returns:
        ``(figures, plain_seconds, compiled_seconds, compile_seconds, graphs)``: :class:`StepFigures` of the
        compiled module from :func:`measure_training` (3 steps from ``model``'s weights, as plain PyTorch's
        baseline), the interleaved median step times of plain PyTorch and of the compiled module over
        ``steps`` rounds, the wall time of the first (compiling) forward and backward, and the number of
        graphs dynamo made.
    """
    with activation_memory_budget(budget):
        m = fresh_copy(model)
        compiled = torch.compile(m, backend=backend, dynamic=False)
        compile_s = _compile_now(compiled, m, inputs, target, loss_fn)
        figures = measure_training(compiled, m, inputs, target, loss_fn, steps=1, seed=seed)
        plain = fresh_copy(model)
        plain_s, compiled_s = interleaved_step_seconds([(plain, plain), (compiled, m)], inputs, target,
                                                       loss_fn, rounds=steps)
        graphs = compiled_graph_count()
        del compiled, m, plain
    return figures, plain_s, compiled_s, compile_s, graphs


# --------------------------------------------------------------------------------------------------
# Rockmate
# --------------------------------------------------------------------------------------------------


def rockmate_status(device: str | torch.device = "cpu") -> tuple[bool, str]:
    """Whether the Rockmate peer can run here, and why not (or its version).

    Returns:
        ``(runnable, text)``.
    """
    try:
        import rockmate  # noqa: F401
    except Exception as exc:  # not installed, or its dependencies (rkgb, pulp, configmypy) fail to import
        return False, (f"rockmate cannot be imported ({type(exc).__name__}: {exc}); it is an optional peer: "
                       "`pip install rockmate` (2.0.0 on PyPI, an sdist that pulls rkgb, pulp==2.7.0 and "
                       "configmypy and compiles a C extension)")
    version = getattr(rockmate, "__version__", "?")
    if torch.device(device).type != "cuda":
        return False, (f"rockmate {version} is installed but needs CUDA: Rockmate.__init__ hard-codes "
                       "torch.device('cuda'), profiles through rkgb on CUDA and schedules with CUDA streams; "
                       "it cannot run on the CPU")
    return True, f"rockmate {version}"


def measure_rockmate(model: nn.Module, inputs: tuple, target, loss_fn, activation_budget_bytes: int,
                     steps: int = 3, seed: int = 0):
    """Rockmate's module for an activation budget (bytes), measured like everything else (CUDA only).

    Untested here (no CUDA on the machines this was written on): it follows Rockmate 2.0's README
    (``Rockmate(model, sample, budget)``); the module keeps the original model's parameters.

    Returns:
        ``(figures, plain_seconds, rockmate_seconds, solve_seconds)``.
    """
    from rockmate import Rockmate

    m = fresh_copy(model)
    t0 = time.perf_counter()
    rk = Rockmate(m, inputs, budget=int(activation_budget_bytes))
    solve_s = time.perf_counter() - t0
    figures: StepFigures = measure_training(rk, m, inputs, target, loss_fn, steps=1, seed=seed)
    plain = fresh_copy(model)
    plain_s, rk_s = interleaved_step_seconds([(plain, plain), (rk, m)], inputs, target, loss_fn, rounds=steps)
    return figures, plain_s, rk_s, solve_s
