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
from dataclasses import dataclass

import torch
from torch import nn

from memfit.bench.harness import StepFigures, fresh_copy, interleaved_step_seconds, measure_training
from memfit.variants.conv_split_backward import vendor_kernels_off

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


def one_step_grads(module: nn.Module, params_of: nn.Module, inputs: tuple, target, loss_fn,
                   seed: int, buffers: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """One forward and backward from the current weights (RNG seeded with ``seed``), then put the module back
    as it was (buffers restored, gradients ``None``). Returns the gradients by parameter name; if ``buffers``
    is a dict, it receives the floating-point buffers (BatchNorm statistics) as the step left them, by name."""
    saved = [(b, b.detach().clone()) for b in params_of.buffers()]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        loss = loss_fn(module(*inputs), target)
        loss.backward()
    del loss
    grads = {n: p.grad.detach().clone() for n, p in params_of.named_parameters() if p.grad is not None}
    if buffers is not None:
        buffers.update({n: b.detach().clone() for n, b in params_of.named_buffers() if b.is_floating_point()})
    with torch.no_grad():
        for buf, value in saved:
            buf.copy_(value)
    for p in params_of.parameters():
        p.grad = None
    return grads


#: plain float32 steps from inputs moved by float32's own precision, beside the plain one, whose distance from
#: float64 estimates float32's noise on the model (:func:`reference_grads`)
NOISE_RUNS = 3


@dataclass
class Reference:
    """Plain PyTorch's figures of one step from a model's weights (:func:`reference_grads`).

    Attributes:
        grads32, grads64: gradients by parameter name in float32 and float64.
        buffers32, buffers64: floating-point buffers (BatchNorm statistics) the step left, by name.
        grads_noise, buffers_noise: float32's own rounding noise on this model and batch: the largest max
            abs difference from the float64 figures among plain float32's step, :data:`NOISE_RUNS` more
            from inputs perturbed at float32's precision, and one with PyTorch's own kernels (cuDNN and oneDNN
            off).
    """

    grads32: dict[str, torch.Tensor]
    grads64: dict[str, torch.Tensor]
    buffers32: dict[str, torch.Tensor]
    buffers64: dict[str, torch.Tensor]
    grads_noise: float
    buffers_noise: float


def as_float64(inputs: tuple) -> tuple:
    """``inputs`` with every floating-point tensor in float64 (others as they are)."""
    return tuple(t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs)


def _perturbed(inputs: tuple, generator: torch.Generator) -> tuple:
    """The floating-point tensors of ``inputs`` each times ``1 + eps * N(0, 1)``, ``eps`` their dtype's machine
    epsilon: the same batch to within the rounding of one float32 operation."""
    def move(t):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            return t
        noise = torch.randn(t.shape, generator=generator, dtype=t.dtype, device="cpu").to(t.device)
        return (t.detach() * (1 + torch.finfo(t.dtype).eps * noise)).requires_grad_(t.requires_grad)
    return tuple(move(t) for t in inputs)


def reference_grads(model: nn.Module, inputs: tuple, target, loss_fn, seed: int = 0,
                    noise_runs: int = NOISE_RUNS) -> Reference:
    """Plain PyTorch's gradients of one step from ``model``'s weights, in float32 and in float64, the
    floating-point buffers (BatchNorm statistics) that step leaves, in both, and float32's noise.

    The float32 figures' distance from the float64 ones is float32's own rounding noise on this model. Deep
    networks at random initialisation amplify it (ResNet-50 at batch 8, 128 px: a max abs difference of about
    0.3 on gradients of up to 24), so code that merely sums in another order, as compiled code does, cannot
    match to 1e-4 there. One float32 run is one sample of that noise, and a lucky one can be far below the
    noise of float32 in general: where a ReLU's input is within rounding of zero, another summation order
    flips it and moves a gradient by a fixed amount (a UNet at batch 2, 32 px: plain float32 2.7e-8 from
    float64, the same float32 step with one convolution's output moved by 1e-7 relative 4.6e-5 in 5 tries of
    8). So the noise is the largest distance among plain float32's run, ``noise_runs`` more, each from the
    inputs moved by their dtype's machine epsilon (:func:`_perturbed`: the same batch to float32's precision),
    and one with cuDNN and oneDNN off: PyTorch's own float32 kernels, which sum in other orders (a
    1024-channel 3x3 convolution on 8 x 8 maps: a whole step 1.8e-4 from float64 with them, 7.4e-8 with
    oneDNN's).

    Returns:
        :class:`Reference`.
    """
    m32 = fresh_copy(model)
    b32: dict[str, torch.Tensor] = {}
    g32 = one_step_grads(m32, m32, inputs, target, loss_fn, seed, b32)
    m64 = fresh_copy(model).double()
    inputs64 = as_float64(inputs)
    b64: dict[str, torch.Tensor] = {}
    g64 = one_step_grads(m64, m64, inputs64, target, loss_fn, seed, b64)
    del m64
    g_noise, b_noise = _max_diff(g32, g64), _max_diff(b32, b64)
    generator = torch.Generator().manual_seed(seed + 1)
    for k in range(noise_runs + 1):
        b: dict[str, torch.Tensor] = {}
        if k < noise_runs:
            g = one_step_grads(m32, m32, _perturbed(inputs, generator), target, loss_fn, seed, b)
        else:  # PyTorch's own kernels, as float32 as the vendor libraries' (and less accurate on wide layers)
            with vendor_kernels_off(True):
                g = one_step_grads(m32, m32, inputs, target, loss_fn, seed, b)
        g_noise, b_noise = max(g_noise, _max_diff(g, g64)), max(b_noise, _max_diff(b, b64))
    return Reference(g32, g64, b32, b64, g_noise, b_noise)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a if k in b), default=0.0)


def strip_names(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names as the plain model has them (a planned or compiled module's parameters are under ``gm.`` or
    ``_orig_mod.``)."""
    return {k.removeprefix("gm.").removeprefix("_orig_mod."): v for k, v in values.items()}


def one_step_check(grads: dict[str, torch.Tensor], reference: Reference,
                   buffers: dict[str, torch.Tensor] | None = None) -> dict:
    """Compare one step's gradients (and, if given, the buffers it left) with plain PyTorch's, taking float32's
    noise on the model into account.

    Args:
        grads: the gradients to check (one step from the initial weights).
        reference: :func:`reference_grads`.
        buffers: the floating-point buffers that step left (BatchNorm statistics), or ``None``.

    Returns:
        ``{"max_abs_grad_diff"`` (vs plain float32), ``"vs_float64"`` (vs plain float64),
        ``"float32_noise"`` (``reference.grads_noise``: plain float32 vs float64, the largest of its runs),
        ``"within_float32_noise"``: ``vs_float64 <= 2 * float32_noise + 1e-5``, i.e. as close to the float64
        gradients as plain PyTorch's own float32 ones, within a factor of 2 (and 1e-5)``}``; with
        ``buffers``, also ``"buffers_vs_float64"``, ``"buffers_float32_noise"`` and
        ``"buffers_within_float32_noise"``, the same test on the buffers.
    """
    g32, g64 = reference.grads32, reference.grads64
    grads = strip_names(grads)
    noise, vs64 = reference.grads_noise, _max_diff(grads, g64)
    out = {"max_abs_grad_diff": _max_diff(grads, g32), "vs_float64": vs64, "float32_noise": noise,
           "within_float32_noise": set(grads) == set(g32) and vs64 <= 2 * noise + 1e-5}
    if buffers is not None:
        buffers = strip_names(buffers)
        b_noise, b_vs64 = reference.buffers_noise, _max_diff(buffers, reference.buffers64)
        out.update(buffers_vs_float64=b_vs64, buffers_float32_noise=b_noise,
                   buffers_within_float32_noise=set(buffers) == set(reference.buffers32)
                   and b_vs64 <= 2 * b_noise + 1e-5)
    return out


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process (a running count, not cleared by dynamo's reset)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


@dataclass
class CompiledRun:
    """What :func:`measure_torch_budget` measured.

    Attributes:
        figures: :class:`StepFigures` from :func:`measure_training` (3 steps from the model's weights, as
            plain PyTorch's baseline).
        plain_seconds, compiled_seconds: interleaved median step times (``None`` without ``time_it``).
        compile_seconds: wall time of the first (compiling) forward and backward.
        graphs: graphs dynamo made (1 = no graph break).
        first_grads: gradients of that first step, from the initial weights (for :func:`one_step_check`).
    """

    figures: StepFigures
    plain_seconds: float | None
    compiled_seconds: float | None
    compile_seconds: float
    graphs: int
    first_grads: dict[str, torch.Tensor]


def measure_torch_budget(model: nn.Module, inputs: tuple, target, loss_fn, budget: float,
                         backend: str = AOT_EAGER, steps: int = 3, seed: int = 0,
                         time_it: bool = True, grads_exist: bool = False) -> CompiledRun:
    """Compile a copy of ``model`` with ``activation_memory_budget = budget`` and measure it with the same
    harness as everything else (the config is restored and dynamo reset afterwards).

    Args:
        model, inputs, target, loss_fn: the training setup (``model`` itself is not touched).
        budget: ``activation_memory_budget`` (0.0 .. 1.0).
        backend: ``aot_eager_decomp_partition`` or ``inductor``.
        steps: timed rounds, interleaved with a plain copy.
        seed: RNG seed.
        time_it: time the steps (``max-batch`` only needs the memory).
        grads_exist: gradients stay allocated between steps (as in
            :func:`~memfit.bench.harness.measure_training`), in the measured and the timed steps.
    """
    graphs_before = compiled_graph_count()
    with activation_memory_budget(budget):
        m = fresh_copy(model)
        compiled = torch.compile(m, backend=backend, dynamic=False)
        t0 = time.perf_counter()
        first = one_step_grads(compiled, m, inputs, target, loss_fn, seed)
        compile_s = time.perf_counter() - t0
        figures = measure_training(compiled, m, inputs, target, loss_fn, steps=1, seed=seed,
                                   grads_exist=grads_exist)
        plain_s = compiled_s = None
        if time_it:
            plain = fresh_copy(model)
            plain_s, compiled_s = interleaved_step_seconds([(plain, plain), (compiled, m)], inputs, target,
                                                           loss_fn, rounds=steps, grads_exist=grads_exist)
            del plain
        graphs = compiled_graph_count() - graphs_before
        del compiled, m
    return CompiledRun(figures, plain_s, compiled_s, compile_s, graphs, first)


# --------------------------------------------------------------------------------------------------
# Rockmate
# --------------------------------------------------------------------------------------------------


def rockmate_status(device: str | torch.device = "cpu") -> tuple[bool, str]:
    """Whether the Rockmate peer can run here, and why not (or its version).

    Returns:
        ``(runnable, text)``.
    """
    try:
        import rockmate
    except ImportError as exc:  # not installed, or a dependency (rkgb, pulp, configmypy) is missing
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
                     steps: int = 3, seed: int = 0, grads_exist: bool = False):
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
    figures: StepFigures = measure_training(rk, m, inputs, target, loss_fn, steps=1, seed=seed,
                                            grads_exist=grads_exist)
    plain = fresh_copy(model)
    plain_s, rk_s = interleaved_step_seconds([(plain, plain), (rk, m)], inputs, target, loss_fn, rounds=steps,
                                             grads_exist=grads_exist)
    return figures, plain_s, rk_s, solve_s
