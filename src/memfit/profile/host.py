"""Will a training step fit in this machine's memory at all? Checked before running it on the CPU.

On Linux, the kernel grants any single allocation smaller than the machine (overcommit) and, once the pages are
touched and memory runs out, its OOM killer ends the process with SIGKILL: no Python exception, no message
(``memfit plan --batch 100000`` on a 24 GiB machine: exit 137 and nothing printed). A failing allocation that
memfit can catch happens only for a single allocation larger than the whole machine. So before profiling on
the CPU, the forward pass is run once on the ``meta`` device (shapes only, no data) and the bytes of every
output it makes are added up: memfit's profile holds each layer's output at once (it computes every value once,
in forward order), and plain PyTorch's step saves most of them. Where that sum is above the memory the kernel
says is available (``MemAvailable`` in ``/proc/meminfo``), the step is refused with the sizes and the flags to
lower.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit.budget import fmt_bytes


def available_host_bytes() -> int | None:
    """Bytes of host memory the kernel says can be allocated now without swapping (``MemAvailable`` in
    ``/proc/meminfo``), or ``None`` where that file is not there (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class _OutputBytes(TorchDispatchMode):
    """Adds up the bytes of the new tensors each ATen operation returns (views and in-place results aside)."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if all(r.alias_info is None for r in func._schema.returns):  # (a view or an in-place result aliases)
            self.nbytes += sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def forward_output_bytes(model: nn.Module, inputs: tuple) -> int:
    """Bytes of every tensor ``model``'s forward pass makes on ``inputs`` (views and in-place results aside),
    computed on the ``meta`` device: shapes only, no data, the model and its inputs untouched (its parameters and
    buffers are replaced by meta tensors for the call, ``torch.func.functional_call``).

    Args:
        model: any ``nn.Module``.
        inputs: the forward's positional arguments (tensors of any device; others passed as they are).

    Returns:
        The sum, in bytes, the inputs' bytes included.

    Raises:
        whatever the forward raises on meta tensors (an operation without a meta kernel, data-dependent code).
    """
    def meta(t):
        return torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t

    state = {name: meta(t) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    args = tuple(meta(a) for a in inputs)
    counter = _OutputBytes()
    with torch.no_grad(), counter:
        functional_call(model, state, args)
    return counter.nbytes + sum(a.numel() * a.element_size() for a in inputs if isinstance(a, torch.Tensor))


class HostMemoryError(ValueError):
    """A step whose forward outputs alone (:func:`forward_output_bytes`) are more than the host memory available
    (:func:`available_host_bytes`): running it would get the process killed by the kernel.

    Attributes:
        needed_bytes: the forward's output bytes.
        available_bytes: the host memory available.
    """

    def __init__(self, message: str, needed_bytes: int, available_bytes: int):
        super().__init__(message)
        self.needed_bytes, self.available_bytes = needed_bytes, available_bytes


def check_fits_host(model: nn.Module, inputs: tuple, lower: str = "the batch size") -> None:
    """Refuse a CPU training step that cannot fit in this machine's memory (module docstring).

    Args:
        model: the model (on the CPU).
        inputs: its example inputs.
        lower: what the message tells the user to lower (``"--batch or --image-size"``).

    Raises:
        HostMemoryError: the forward's outputs are more than the available host memory. Nothing is checked
            where the available memory is unknown or the forward does not run on the meta device.
    """
    available = available_host_bytes()
    if available is None:
        return
    try:
        needed = forward_output_bytes(model, inputs)
    except Exception:  # noqa: BLE001 -- (no meta kernel, data-dependent code: the real run tells)
        return
    if needed > available:
        raise HostMemoryError(
            f"the forward pass of {type(model).__name__} on this batch makes {fmt_bytes(needed)} of outputs, which "
            f"memfit's profile holds at once, more than the {fmt_bytes(available)} of memory this machine has "
            f"available: the kernel would kill the process (no error message). Lower {lower}.", needed, available)
