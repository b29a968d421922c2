"""The planned module: runs the traced forward with checkpoint regions as the plan says.

Each region of the plan runs through non-reentrant ``torch.utils.checkpoint.checkpoint`` (RNG state
preserved, so dropout draws the same masks when recomputed); everything outside regions runs as plain
PyTorch. Values are dropped from the interpreter's environment right after their last forward use, so the
module holds no more than plain PyTorch would.

Buffers that the forward pass writes (BatchNorm's and InstanceNorm's running statistics, the power-iteration
vectors of spectral normalization, a user's in-place counters) are updated once per step, by the forward
pass. A recomputation runs on scratch copies of them holding their values from the forward pass, so it
computes what the forward pass computed, never writes the model's buffers and never bumps the version
counters that autograd checks.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils import parametrize
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.checkpoint import checkpoint

from memfit.budget import fmt_bytes
from memfit.graph.attributes import (
    changed_attribute,
    changed_global,
    global_reads,
    has_hooks,
    has_own_hooks,
    is_plain,
)
from memfit.graph.bn_output import apply_bn_from_output, flagged_now, has_bn_from_output
from memfit.graph.calls import (
    bind_inputs,
    compute_nodes,
    input_values,
    map_tensors,
    mutable_containers,
    node_fn,
    node_inputs,
    node_ops,
    positional_inputs,
    same_fixed_value,
    tensor_paths,
    tensors_in,
)
from memfit.graph.capture import Captured
from memfit.graph.tiling import TiledBlock, apply_tiling, chain_blocks, is_tiled
from memfit.profile.buffers import (
    RESTORE,
    SCRATCH,
    STATEFUL,
    FindWrites,
    Slot,
    buffer_storages,
    by_storage,
    reachable_slots,
    storage_key,
)
from memfit.profile.costs import SPARSE_ADVICE
from memfit.profile.optimizer import new_state_bytes, optimizer_options
from memfit.profile.tracker import live_bytes
from memfit.runtime.direct_saves import DirectSaves
from memfit.runtime.offload import OffloadStep
from memfit.runtime.reshaped import traced_for
from memfit.runtime.stores import CopyEngine, DiskStore, HostStore, default_store
from memfit.solve.plan import Plan
from memfit.variants.bn_saved_stats import RecordStats, ReplayStats
from memfit.variants.versions import raise_if_changed, versions
from memfit.warn import warn_user

RESHAPED_KEPT = 8  # planned modules kept for other input shapes of a shape-specialized graph


@dataclass
class _Region:
    names: list[str]
    fns: list[Any]
    inputs: list[str]
    outputs: list[str]
    frees: list[list[str]]  # per node: local values to drop after it
    modules: list[nn.Module]  # every module (and submodule) its call_module nodes call: whose buffers it reads
    slots: list[Slot]  # the buffers it can reach: those of ``modules`` and of its get_attr nodes
    stats: list[bool]  # per node: recomputed from saved statistics (bn-saved-stats)


class _StepState:
    """The buffers one forward pass writes, by storage (``kinds``: storage key -> what a recomputation does
    with it; in the first training step every buffer is ``STATEFUL`` until the forward pass has shown which
    ones it writes), and the region calls made so far."""

    def __init__(self, kinds: dict[tuple, str], finder: FindWrites | None = None, modes: tuple = ()):
        self.kinds = kinds
        self.finder = finder  # the first training step's dispatch mode: memfit's own snapshots are not reads
        self.modes = modes  # the modules' modes in this step (PlannedModule._modes), which the kinds are for
        self.calls: list[_RegionCall] = []

    def kind(self, value) -> str | None:
        """What ``value`` is, if it is, or shares storage with, a buffer the step writes."""
        return self.kinds.get(storage_key(value)) if isinstance(value, torch.Tensor) else None


class _RegionCall:
    """One forward call of a region: the first call is the forward pass, later calls are recomputations.
    ``on_value(name, value)`` sees every value the forward pass computes (the offloader's prefetch triggers).

    ``side`` holds the region's inputs (by position) that are buffers, or views of buffers, the step writes:
    they are not given to ``checkpoint``, whose saved copy of its inputs would fail autograd's version check
    once the forward pass updates them in place (plain PyTorch saves nothing there).

    Buffers the step writes never change in a recomputation, and their version counters never move: the
    forward pass snapshots (clones) those whose values are read (``STATEFUL``: spectral normalization's
    vectors, InstanceNorm's statistics, a user's buffer read after or before its update), and the
    recomputation runs on fresh copies of the snapshots; it runs on a copy of the current value for those
    written by version-bumping operators and never read (``SCRATCH``: ``num_batches_tracked``, counters).
    The copies stand in for the buffers in the region's modules (``module._buffers``), inputs and get_attr
    values, and the model's buffers are put back afterwards (also when the recomputation stops early).
    BatchNorm running statistics (``RESTORE``) are updated by the recomputation in place, as plain
    PyTorch's kernel does without a version bump, and their values put back afterwards through ``.data``
    (no version bump either), so a module applied several times, inside and outside regions, keeps what
    autograd saved valid and needs no more memory than the buffers' size while it recomputes."""

    def __init__(self, region: _Region, on_value=None, state: _StepState | None = None,
                 side: dict[int, torch.Tensor] | None = None, direct: dict[int, torch.Tensor] | None = None,
                 watched: set[int] = frozenset()):
        self.region = region
        # storage pointer -> the parameter or input saved as itself; buffers' pointers (DirectSaves)
        self.direct = direct if direct is not None else {}
        self.watched = watched
        self.versions: list[tuple[torch.Tensor, int]] = []  # the region's parameters after its forward pass
        self.held: list[tuple[dict, str, torch.Tensor]] = []  # (module._parameters, name, the parameter read)
        self.calls = 0
        self.on_value = on_value
        self.state = state
        self.side = side or {}
        # id(tensor) -> (tensor, snapshot, storage key): the values the forward pass read
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor, tuple | None]] = {}
        # node name -> the batch-norm statistics its forward pass computed (bn-saved-stats), until recomputed
        self.stats: dict[str, list] = {}

    def _inputs(self, values) -> list:
        if not self.side:
            return list(values)
        rest = iter(values)
        return [self.side[i] if i in self.side else next(rest) for i in range(len(self.region.inputs))]

    def __call__(self, *values):
        region = self.region
        recompute = self.calls > 0
        self.calls += 1
        values = self._inputs(values)
        state = self.state
        if not recompute:
            if state is not None:
                self._snapshot(values)
                state.calls.append(self)
            out = self._run(values, None)
            # (a parameter changed before the recomputation, a bias no node saves, would silently give gradients
            # of neither its old nor its new value: a fresh user's were 5e-3 off where plain PyTorch's were exact)
            self.held = [(m._parameters, name, p) for m in region.modules for name, p in m._parameters.items()
                         if p is not None]
            self.versions = versions(p for _, _, p in self.held)
            # (and the buffers: a BatchNorm given its statistics by functional_call updated the model's own when
            # recomputed, after functional_call had put them back)
            self.held += [(m._buffers, name, b) for m in region.modules for name, b in m._buffers.items()
                          if b is not None]
            return out
        raise_if_changed(self.versions, "a checkpoint region")
        # the recomputation reads the parameter and buffer objects the forward pass read: torch.func.functional_call
        # puts the module's own back when its call returns, before the backward pass (a fresh user's recomputation
        # read those: PyTorch's CheckpointError, or other values where their metadata matched)
        replaced = [(table, name, name in table, table.get(name), p) for table, name, p in self.held
                    if table.get(name) is not p]
        try:
            for table, name, _, _, p in replaced:
                table[name] = p
            return self._recompute(values, state)
        finally:
            for table, name, had, now, _ in replaced:
                if had:
                    table[name] = now
                else:
                    table.pop(name, None)

    def _recompute(self, values: list, state: _StepState | None):
        """A recomputation of the region from its inputs ``values``, with the buffers as the forward pass read
        them (see the class)."""
        region = self.region
        if state is None:
            return self._run(values, None)
        scratch: dict[int, torch.Tensor] = {}
        restore: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            for i, (_, snap, _) in self.saved.items():
                scratch[i] = snap.clone()
            for t in [mod._buffers.get(name) for mod, name in region.slots] + list(self.side.values()):
                if t is None or id(t) in scratch or id(t) in restore:
                    continue
                kind = state.kind(t)
                if kind == RESTORE:
                    restore[id(t)] = (t, t.detach().clone())
                elif kind is not None:  # SCRATCH (a STATEFUL one always has its snapshot)
                    scratch[id(t)] = t.detach().clone()
        swapped = []
        try:
            for mod in region.modules:
                for name, buf in mod._buffers.items():
                    if buf is not None and id(buf) in scratch:
                        swapped.append((mod, name, buf))
                        mod._buffers[name] = scratch[id(buf)]
            values = [scratch.get(id(v), v) if isinstance(v, torch.Tensor) else v for v in values]
            return self._run(values, scratch)
        finally:
            for mod, name, buf in reversed(swapped):
                mod._buffers[name] = buf
            with torch.no_grad():
                for t, value in restore.values():
                    t.data.copy_(value)  # .data: a write that autograd's version counter does not see

    def _snapshot(self, values) -> None:
        state = self.state
        found = [mod._buffers.get(name) for mod, name in self.region.slots] + list(values)
        with torch.no_grad(), state.finder.paused() if state.finder is not None else contextlib.nullcontext():
            for t in found:
                if id(t) not in self.saved and state.kind(t) == STATEFUL:
                    self.saved[id(t)] = (t, t.detach().clone(), storage_key(t))

    def keep_only(self, keys: set[tuple]) -> None:
        """Drop the snapshots of tensors whose storage is not in ``keys`` (after the first step found the
        buffers whose values it reads)."""
        self.saved = {i: v for i, v in self.saved.items() if v[2] in keys}

    def _run(self, values, scratch):
        region = self.region
        recompute = self.calls > 1
        env = dict(zip(region.inputs, values))
        with DirectSaves(self.direct, self.watched):
            self._run_nodes(env, recompute, scratch)
        self.on_value = None  # needed in the forward pass only; it would keep the offloader alive
        return tuple(env[o] for o in region.outputs)

    def _run_nodes(self, env: dict, recompute: bool, scratch) -> None:
        region = self.region
        for name, fn, frees, from_stats in zip(region.names, region.fns, region.frees, region.stats):
            if not from_stats:
                value = fn(env)
            elif recompute:  # the statistics are released as autograd takes them over again
                with ReplayStats(self.stats.pop(name, [])):
                    value = fn(env)
            else:
                record = RecordStats()
                with record:
                    value = fn(env)
                self.stats[name] = record.stats
            if scratch and isinstance(value, torch.Tensor):
                value = scratch.get(id(value), value)  # a get_attr of a buffer the step writes
            env[name] = value
            if self.on_value is not None and not recompute:
                self.on_value(name, value)
            del value  # (else it held a value no later node reads through the next node's run)
            for f in frees:
                del env[f]


def conv_libraries() -> dict[str, bool]:
    """The switches of the vendor convolution libraries now: ``{"cudnn": torch.backends.cudnn.enabled,
    "mkldnn": torch.backends.mkldnn.enabled}`` (``Plan.conv_libraries``)."""
    return {"cudnn": bool(torch.backends.cudnn.enabled), "mkldnn": bool(torch.backends.mkldnn.enabled)}


AUTOCAST_CACHE_DIFFERS = (
    "with the cache on, the readers of a parameter share one lower-precision copy of it per forward; without it, "
    "each reader makes its own, so the planned memory figures do not hold.")


def autocast_dtype(inputs: tuple) -> str | None:
    """The dtype ``torch.autocast`` casts to on the inputs' device right now (``"torch.bfloat16"``), or ``None``
    outside autocast."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    device_type = tensors[0].device.type if tensors else "cpu"
    if not torch.is_autocast_enabled(device_type):
        return None
    return str(torch.get_autocast_dtype(device_type))


def memory_layout(t: torch.Tensor) -> str:
    """The memory layout of ``t``: ``"contiguous"``, ``"channels_last"`` (4-D) or ``"channels_last_3d"`` (5-D), or
    ``"strided"`` for any other strides. Activations and their gradients follow their inputs' layout, and a
    convolution run in another layout than profiled allocates other reordered copies (a CNN planned contiguous
    and trained channels-last measured 10% over its budget)."""
    if t.is_contiguous():
        return "contiguous"
    for name, fmt in (("channels_last", torch.channels_last), ("channels_last_3d", torch.channels_last_3d)):
        if t.dim() == (4 if fmt is torch.channels_last else 5) and t.is_contiguous(memory_format=fmt):
            return name
    return "strided"


def layouts_differ(tensors: list[torch.Tensor], recorded: list[str]) -> bool:
    """Whether a floating-point (or complex) tensor of ``tensors`` is in another :func:`memory_layout` than
    ``recorded`` (one per tensor, as a plan records them). Integer tensors (token ids, labels, indices) make no
    activations that follow their layout: a shorter batch of ids, ``ids[:, :20]``, was warned about."""
    return len(tensors) != len(recorded) or any(
        memory_layout(t) != made for t, made in zip(tensors, recorded) if t.is_floating_point() or t.is_complex())


def state_layouts(model: nn.Module) -> dict[str, str]:
    """:func:`memory_layout` of every tensor of ``model.state_dict()`` with four or more dimensions, by key."""
    return {k: memory_layout(v) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and v.dim() >= 4}


_TREE_VERSION = [0]  # bumped whenever any module anywhere registers a submodule, parameter or buffer
_WATCHING: list[bool] = []


def _bump(*_args) -> None:
    _TREE_VERSION[0] += 1  # (returns None: a registration hook's return value would replace what is registered)


def _drop_lost_inplace_forms(gm: fx.GraphModule, plan: Plan) -> list[tuple[str, str]]:
    """Remove from ``plan.variants`` the in-place forms that their nodes no longer have in ``gm`` (an activation set
    to ``inplace=True`` after planning has no in-place form of its own: the planned module runs it as PyTorch's own
    op, warned, and a copy built with the form was refused); ``[(node name, module path or "")]`` removed."""
    from memfit.variants import OPERAND, inplace_forms

    by_name = {n.name: n for n in gm.graph.nodes}
    dropped = []
    for name, variant in list(plan.variants.items()):
        node = by_name.get(name)
        if variant in OPERAND and node is not None and variant not in inplace_forms(gm, node):
            del plan.variants[name]
            dropped.append((name, node.target if node.op == "call_module" else ""))
    return dropped


def _setting_slots(module: nn.Module | None) -> list[tuple[dict, str]]:
    """``(instance dict, name)`` of the plain settings of ``module`` and its submodules (``negative_slope``,
    ``min_val``...), found once so that a training step only reads them."""
    if module is None:
        return []
    return [(vars(m), k) for m in module.modules() for k, v in vars(m).items() if not k.startswith("_") and is_plain(v)]


def _read(slots: list[tuple[dict, str]]) -> tuple:
    return tuple(d.get(k) for d, k in slots)


def _watch_tree() -> None:
    """Install, once per process, PyTorch's global registration hooks that count changes to any module tree, so
    that a planned module looks at its model's tree only after one (instead of walking it every training call)."""
    if not _WATCHING:
        from torch.nn.modules import module as torch_module

        torch_module.register_module_module_registration_hook(_bump)
        torch_module.register_module_parameter_registration_hook(_bump)
        torch_module.register_module_buffer_registration_hook(_bump)
        _WATCHING.append(True)


def _with_graph(tensors: list) -> list[torch.Tensor]:
    """The tensors among ``tensors`` that have an autograd graph (where a hook sees their gradient arrive)."""
    return [t for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]


class _Call:
    """One training call of a planned module: ``done`` once its backward pass reached the output."""

    __slots__ = ("__weakref__", "done")

    def __init__(self):
        self.done = False


def _autocast_on(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type`` in this thread."""
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # (torch before 2.4 takes no device type)
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def _within(shapes: list[list[int]], planned: list[list[int]]) -> bool:
    """Whether each shape has the planned one's dimensions, none of them larger."""
    return len(shapes) == len(planned) and all(len(a) == len(b) and all(x <= y for x, y in zip(a, b))
                                               for a, b in zip(shapes, planned))


@torch.compiler.disable  # (run as Python: the compiler cannot trace the warning's frame lookup)
def _warn_compiled(planned: PlannedModule) -> None:
    planned._warn_once("compile", "memfit: torch.compile of a planned module is not supported: the compiler fuses "
                       "and reorders the step, and the plan's peak and budget do not hold for that (a fresh user "
                       "measured 1.08x the budget with inductor). Train the planned module eagerly, or compile the "
                       "model without memfit.")


def _under_functorch(args: tuple, kwargs: dict, model: nn.Module) -> bool:
    """Whether this call runs inside a ``torch.func`` transform: an input or the model's first parameter is a
    functorch wrapper (a batched tensor of ``vmap``, a gradient-tracking one of ``grad``). An ordinary step, with no
    functorch interpreter active, answers at once; torch.compile's tracing has one active but no such wrappers."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    first = next(model.parameters(), None)
    return any(wrapped(t) for t in tensors_in((args, kwargs))) or (first is not None and wrapped(first))


def _parametrized(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The parametrized tensors' names of each parametrized submodule of ``model``, by its path."""
    return {path: tuple(sorted(m.parametrizations.keys())) for path, m in model.named_modules()
            if parametrize.is_parametrized(m)}


def _tensor_named(model: nn.Module, name: str) -> torch.Tensor | None:
    """The parameter or buffer ``name`` (a qualified name) of ``model``, ``None`` where it has none."""
    path, _, field = name.rpartition(".")
    try:
        owner = model.get_submodule(path)
    except AttributeError:
        return None
    return owner._parameters.get(field, owner._buffers.get(field))


def _graph_aliases(gm: fx.GraphModule, model: nn.Module) -> list[tuple[str, ...]]:
    """The names under which ``model`` holds one tensor (tied weights, a shared buffer), for each tensor the traced
    graph reads by a ``get_attr`` node (by one of those names)."""
    names: dict[int, list[str]] = {}
    for name, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                   model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(name)
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    return [tuple(group) for group in names.values() if len(group) > 1 and read & set(group)]


_STEPPED: weakref.WeakSet = weakref.WeakSet()  # planned modules whose optimizers' first steps are checked
_STEP_HOOK: list = []  # the handle of the hook that checks them (one per process)


def _watch_optimizer_steps(module: PlannedModule) -> None:
    """Check, before and after each optimizer's first step, that ``module``'s plan counted the state it keeps
    (:meth:`PlannedModule._check_optimizer`), with hooks PyTorch runs around every optimizer's step."""
    _STEPPED.add(module)
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_before_step))
        _STEP_HOOK.append(register_optimizer_step_post_hook(_after_step))


_STEP_DEPTH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its steps under way


def _before_step(optimizer, args, kwargs) -> None:
    # (an optimizer subclass whose step calls super().step() runs the global hooks around both: the outer step's
    # are the ones to check around, a fresh user's second buffer was made after the inner step's post-hook)
    depth = _STEP_DEPTH[optimizer] = _STEP_DEPTH.get(optimizer, 0) + 1
    if depth > 1:
        return
    try:
        for module in list(_STEPPED):
            module._check_optimizer(optimizer, before=True)
    except BaseException:  # (a warning raised as an error: the step does not run, nor its post-hooks)
        _STEP_DEPTH[optimizer] = 0
        raise


def _after_step(optimizer, args, kwargs) -> None:
    depth = _STEP_DEPTH[optimizer] = max(0, _STEP_DEPTH.get(optimizer, 0) - 1)
    if depth > 0:
        return
    for module in list(_STEPPED):
        module._check_optimizer(optimizer)


# bytes DistributedDataParallel allocates beside its buckets while it builds them again (its second step): 0 or 4 B
# measured on a small CNN, from run to run (tests/test_traps.py -k gradient_buckets)
DDP_OWN_BYTES = 1024


def ddp_bucket_bytes(trainable_bytes: int, views: bool, grads_exist: bool) -> int:
    """The bytes beside a step that ``DistributedDataParallel``'s gradient buckets need counted, for trainable
    parameters of ``trainable_bytes`` (P): 2P (a copy of the gradients, and another set while DDP builds them again in
    its second step), or P with bucket views (``gradient_as_bucket_view=True``: they are the gradients, which a plan
    with ``grads_exist`` counts already, and the second step's set); and :data:`DDP_OWN_BYTES`. Measured:
    ``benchmarks/ddp_buckets.py``."""
    return DDP_OWN_BYTES + (trainable_bytes if views and grads_exist else 2 * trainable_bytes)


def _active_ddp() -> nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` whose forward is running, as PyTorch records it for TorchDynamo (not with its
    experimental Python reducer), or ``None``."""
    return nn.parallel.DistributedDataParallel._get_active_ddp_module()


class PlannedModule(nn.Module):
    """An ``nn.Module`` that computes what the original model computes, under a memory plan.

    It shares parameters and buffers with the model it was traced from (``planned.parameters()`` are the
    model's own tensors, under the same ``state_dict()`` keys), so any optimizer built on either trains
    both, and checkpoints load into either. To save, save ``state_dict()`` (the module itself holds
    closures and does not pickle). ``copy.deepcopy(planned)`` deep-copies the model and gives an independent
    planned module over the copy's parameters and buffers, with the same plan (an EMA or teacher copy).

    The plan applies to training steps: in training mode with gradients enabled it runs the traced graph
    under the plan. In evaluation mode (of the planned module or of the model), or with gradients disabled
    (``torch.no_grad()``), it calls the model itself, which then computes exactly what it computes in that
    mode (functional dropout included, which the trace recorded with ``training=True``).
    ``planned.train(mode)`` and ``planned.eval()`` set the model's own mode (its ``train`` is called).

    Gradients and buffers are the same as plain PyTorch's. Every buffer the forward pass writes (running
    statistics of BatchNorm and InstanceNorm, spectral normalization's power-iteration vectors, in-place
    updates of a user's buffers) is written once per step, by the forward pass: a checkpoint region's
    recomputation runs on scratch copies of the buffers it can reach, holding their values from the forward
    pass, and never writes the model's buffers or bumps their version counters (a module applied several
    times, inside and outside regions, is fine). The plan names the written buffers (``Plan.buffer_kinds``,
    found by the profile under a ``TorchDispatchMode``: operators that declare a write, and batch-norm running
    statistics), and its replay counts the copies (:mod:`memfit.profile.buffers`). A plan that does not name
    them (an older plan file) has them found in the first training step, in which every reachable buffer is
    snapshotted, beyond what the plan counted.

    A graph traced with the example's shapes (a forward whose Python code reads sizes: :mod:`memfit.graph.sized`)
    holds for them only: a call with smaller inputs runs the plan on a trace of its own shapes where the forward takes
    the same path there (:mod:`memfit.runtime.reshaped`), and any other call runs the model as PyTorch does, with a
    warning. Smaller inputs of a graph traced without shapes run the plan as they are, under its budget.

    Nodes the plan offloads have their saved tensors copied to a host store (``offload_store``: pinned memory
    on CUDA, memory-mapped files in ``offload_dir`` otherwise) and prefetched back in the backward pass
    (:mod:`memfit.runtime.offload`); ``offload_store.peak_bytes`` is the host side's peak.

    Attributes:
        plan: the :class:`~memfit.solve.plan.Plan` it runs.
        report: figures from :func:`memfit.optimize` (predicted and measured), or ``None``.
        gm: the traced ``torch.fx.GraphModule``.
        offload_store: the :class:`~memfit.runtime.stores.HostStore` in use, once a step has offloaded.

    Raises:
        ValueError: (at construction) the plan was solved for another graph, or it asks for an operator
            variant or an in-place form that cannot apply here.
        TypeError: (when called in training mode with gradients) more inputs than the traced forward takes, an
            unknown keyword, or a left-out argument whose default the traced forward cannot run with (keyword
            arguments take their parameter's place, as in the model's own forward).
        RuntimeError: (likewise) a submodule of the model was replaced or removed after planning (plan again; a
            replaced parameter or buffer tensor is picked up instead).
    """

    def __init__(self, captured: Captured, plan: Plan, report: dict | None = None,
                 offload_dir: str | None = None, offload_store: HostStore | None = None):
        super().__init__()
        if plan.tiled and not is_tiled(captured):
            captured = apply_tiling(captured, [TiledBlock.from_dict(t) for t in plan.tiled])
        if plan.bn_from_output and not has_bn_from_output(captured):
            captured = apply_bn_from_output(captured, plan.bn_from_output)
        if plan.bn_from_output and (flagged := flagged_now(captured)):
            names = ", ".join(flagged[:3]) + (", ..." if len(flagged) > 3 else "")
            warnings.warn(f"memfit: the plan runs {len(flagged)} BatchNorm(s) from their output ({names}) whose "
                          "weight now has a channel at 0 or too small against its bias (weights loaded or changed after planning): they will run as PyTorch's "
                          "own BatchNorm, which also saves its input, so steps may go over the plan's peak. Plan "
                          "again with these weights.", stacklevel=2)
        self.__dict__["offload_store"] = offload_store
        self.__dict__["_engine"] = None
        self.__dict__["_reshaped"] = {}  # planned modules for smaller inputs, by their shapes (see _for_shapes)
        self.__dict__["_captured"] = captured
        self.offload_dir = offload_dir
        self.plan = plan
        self.report = report
        # the traced GraphModule runs the step but is not registered: the planned module registers the
        # model's own children, parameters and buffers instead, so state_dict() keys are the model's
        self.__dict__["gm"] = captured.gm
        root = captured.model if captured.model is not None else captured.gm
        # (one named as an attribute of the planned module, a wrapper's `self.model = hf_model`, goes into the
        # tables directly: add_module refused it, "attribute 'model' already exists"; planned.model is the user's
        # model, whose attribute it is)
        taken = set(dir(type(self))) | set(self.__dict__)
        for table, items in (("_modules", root.named_children()), ("_parameters", root.named_parameters(recurse=False)),
                             ("_buffers", root.named_buffers(recurse=False))):
            for name, value in items:
                if name in taken:
                    getattr(self, table)[name] = value
                elif table == "_modules":
                    self.add_module(name, value)
                elif table == "_parameters":
                    self.register_parameter(name, value)
                else:
                    self.register_buffer(name, value, persistent=name not in root._non_persistent_buffers_set)
        self.training = root.training
        self.__dict__["_held"] = self._own_tensors()  # (see _own_assignments)
        # (a graph traced with the example's shapes read the state's too, `for i in range(self.centers.shape[0])`:
        # checked at each call, `.data` replaced by another shape included)
        self.__dict__["_state_shapes_at_build"] = self._state_shapes() if captured.specialized else None
        self._grad_checks = 3  # backward passes left to look at .grad in (see _watch_step)
        self._accumulate_hooks: list = []  # (see _warn_if_accumulated)
        self._warned: set[str] = set()  # the warnings given, each once (see _warn_once)
        self._aliased: list[tuple] = []  # nodes found returning an input the plan writes into (see _fresh)
        self._last_call: weakref.ref | None = None  # the previous training call's _Call, while its graph lives
        self._build()
        _watch_optimizer_steps(self)

    @property
    def model(self) -> nn.Module:
        """The user's model (the traced ``GraphModule`` when the capture has none)."""
        captured = self.__dict__["_captured"]
        return captured.model if captured.model is not None else captured.gm

    def train(self, mode: bool = True) -> PlannedModule:
        """Set training mode here, on the traced graph and on the user's model (its own ``train(mode)``
        is called last, so an override of it, such as one that keeps BatchNorm frozen, has the last word)."""
        super().train(mode)
        gm = self.__dict__["gm"]
        gm.training = mode
        model = self.model
        if model is not gm:
            model.train(mode)
        return self

    def __deepcopy__(self, memo: dict) -> PlannedModule:
        """An independent planned module over a deep copy of the model (parameters, buffers, traced graph),
        with a copy of the plan and the same mode; its offload store is its own."""
        captured = self.__dict__["_captured"]
        model = copy.deepcopy(captured.model, memo) if captured.model is not None else None
        gm = copy.deepcopy(captured.gm, memo)  # after the model: its submodules map to the model's copies
        store = self.offload_store
        own_store = (DiskStore(store.directory) if isinstance(store, DiskStore) and not store.remove_when_done
                     else None)
        plan = copy.deepcopy(self.plan, memo)
        if plan.node_ops:  # (settings changed since planning, which this module runs with: Dropout's p; the copy
            plan.node_ops = node_ops(gm)  # was refused as "solved for a different graph", a fresh-user finding)
        dropped = _drop_lost_inplace_forms(gm, plan)
        # (every other field as it is: the copy of a graph traced with the example's shapes lost `specialized` and
        # ran its baked shapes for any input, a crash or silently wrong loop counts)
        new = PlannedModule(dataclasses.replace(captured, gm=gm, graph=copy.deepcopy(captured.graph, memo),
                                                model=model, attributes=copy.deepcopy(captured.attributes, memo)),
                            plan, copy.deepcopy(self.report, memo),
                            offload_dir=self.offload_dir, offload_store=own_store)
        memo[id(self)] = new
        for key, value in self.__dict__.items():  # hooks registered on the planned module itself
            if "hooks" in key and isinstance(value, dict):
                new.__dict__[key] = copy.deepcopy(value, memo)
        new._warned = set(self._warned)
        new._aliased = []
        if dropped:  # (what this module does at its next step; the copy was refused, a fresh-user finding)
            names = ", ".join(f"{n} (module {t!r})" if t else n for n, t in dropped)
            new._warn_once("copy: in-place forms", f"memfit: node {names} of the copy runs as PyTorch's own op: its "
                           "settings changed since planning (an activation set to inplace=True), and the plan's "
                           "in-place form does not apply to the new ones (the step may go over the plan). Plan again "
                           "for these settings.")
        # the copies of the model and of its submodules kept their own modes (a frozen BatchNorm in eval mode
        # inside a model in training mode stays so); train() would set them all
        new.training = self.training
        new.__dict__["gm"].training = self.__dict__["gm"].training
        return new

    def __copy__(self):
        """Refuse ``copy.copy(planned)``, which would share the model and the traced graph's state between two
        planned modules, with the way to copy (it went through :meth:`__reduce_ex__`, whose message named
        pickling and ``torch.save``, which a fresh user had not called)."""
        raise TypeError("copy.copy(planned) is not supported for a memfit PlannedModule (a shallow copy would share "
                        "the model and the traced graph's state with the original): use copy.deepcopy(planned), "
                        "which copies the model and keeps the plan, or plan a copy of the model")

    def __reduce_ex__(self, protocol):
        """Refuse pickling (``torch.save(planned)``) with the way to save: the planned module holds the traced
        graph's closures, and pickle failed with "Can't pickle <class 'torch.nn.modules.linear.Linear'>: it's not
        the same object as ...", which did not say what to do."""
        raise TypeError("a memfit PlannedModule does not pickle (torch.save(planned)): it holds the traced graph's "
                        "closures. Save the model and the plan instead: torch.save(planned.state_dict(), path) (the "
                        "model's own keys) or torch.save(planned.model, path), and planned.plan.save(plan_path); "
                        "rebuild with memfit.optimize(model, inputs, plan_=memfit.Plan.load(plan_path))")

    def _sync_graph_state(self) -> None:
        """Point the traced graph's ``get_attr`` reads at the model's tensors as they are now. ``torch.fx`` copies the
        buffers and parameters a graph reads by attribute (the model's own ``self.pos``, a buffer of a block it
        traced into) onto the ``GraphModule``: a buffer the user replaced after planning (``model.pos = ...``,
        ``model.to(torch.bfloat16)``) was still read as the old tensor (a fresh user's bfloat16 step crashed,
        gradients were 0.027 off after an assignment)."""
        gm, model = self.gm, self.model
        if model is gm:
            return
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            *path, field = node.target.split(".")
            try:
                owner = model.get_submodule(".".join(path))
                holder = gm.get_submodule(".".join(path))
            except AttributeError:
                continue
            if owner is holder:
                continue
            for table in ("_buffers", "_parameters"):
                if field in getattr(owner, table) and getattr(holder, table).get(field) is not getattr(owner, table)[field]:
                    getattr(holder, table)[field] = getattr(owner, table)[field]

    @property
    def _version(self) -> int:
        """The model's checkpoint format version, which ``state_dict()`` records and a class's own
        ``_load_from_state_dict`` reads to convert older checkpoints (torchvision's MNASNet read a planned module's 1
        as its own old layout, and a fresh MNASNet failed to load ``planned.state_dict()``); read at each call, as
        such a conversion may set the model's."""
        return getattr(self.model, "_version", 1)

    @_version.setter
    def _version(self, value: int) -> None:
        self.model._version = value

    def _mirror_model(self) -> None:
        """Hold the model's top-level children, parameters and buffers again, as the model holds them now (after a
        conversion replaced some: ``.to()``, ``load_state_dict(assign=True)``, a class's own loading of an older
        checkpoint that swaps a submodule)."""
        root = self.model
        for table in ("_modules", "_parameters", "_buffers"):
            mine = getattr(self, table)
            mine.clear()
            mine.update(getattr(root, table))
        self._non_persistent_buffers_set = set(root._non_persistent_buffers_set)
        self.__dict__["_held"] = self._own_tensors()

    def _own_tensors(self) -> dict[tuple[str, str], torch.Tensor | None]:
        """The planned module's own parameters and buffers (the model's top-level ones), by table and name."""
        return {(table, name): t for table in ("_parameters", "_buffers") for name, t in getattr(self, table).items()}

    @contextlib.contextmanager
    def _own_assignments(self):
        """For one call, the tensors set on the planned module itself since it last matched the model, set on the
        model (where the traced graph and the model's forward read them), and the model's put back after it.
        ``torch.func.functional_call(planned, params, x)`` swaps the planned module's own (the model's top-level
        parameters and buffers) for its call: they were not read (a fresh user's output was 0.42 off, the
        parameter without a gradient; per-sample gradients 1.0 off). A recomputation in the backward pass reads
        what the forward pass read (:class:`_RegionCall`)."""
        held, model = self.__dict__["_held"], self.model
        swapped = []
        for table in ("_parameters", "_buffers"):
            theirs = getattr(model, table)
            for name, t in getattr(self, table).items():
                if t is not held.get((table, name)) and theirs.get(name) is not t:
                    swapped.append((theirs, name, name in theirs, theirs.get(name)))
                    theirs[name] = t
        try:
            yield
        finally:
            for theirs, name, had, old in reversed(swapped):
                if had:
                    theirs[name] = old
                else:
                    theirs.pop(name, None)

    def _apply(self, fn, recurse: bool = True):
        """``planned.to(...)``, ``.double()``, ``.cuda()``: converted on the model itself (the planned module
        holds the model's own top-level parameters and buffers; converting its references only left the model's
        buffers as they were), then picked up again here."""
        model = self.model
        model._apply(fn, recurse)
        self.__dict__["_reshaped"].clear()  # (their traces read the model's tensors as they were)
        self._mirror_model()
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """The model's own (the planned module holds the model's parameters and buffers): a class that saves more
        or otherwise saves as its class does."""
        self.model._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """The model's own: a class that converts older checkpoints (by the version ``state_dict()`` recorded, as
        torchvision's MNASNet does) converts them for the planned module too. PyTorch then loads the children the
        planned module holds, which are the model's as its own loading left them (one that replaced a submodule
        had the old one loaded: "Missing key(s)", the model half loaded)."""
        self.model._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                         error_msgs)
        self._mirror_model()

    def _build(self) -> None:
        gm, plan = self.gm, self.plan
        nodes = compute_nodes(gm)
        if [n.name for n in nodes] != plan.nodes:
            hint = (" (striped blocks cannot be added to or removed from a plan's `tiled` by hand: the plan names "
                    "the graph with its blocks striped)" if chain_blocks(self.__dict__["_captured"].gm) else "")
            raise ValueError(f"the plan was solved for a different graph (node names differ){hint}; "
                             "solve it again for this model")
        ops = node_ops(gm)
        if plan.node_ops and ops != plan.node_ops:
            k = next(k for k, (a, b) in enumerate(zip(plan.node_ops, ops, strict=True)) if a != b)
            raise ValueError(f"the plan was solved for a different graph: its node {plan.nodes[k]} runs {plan.node_ops[k]}, "
                             f"this model's runs {ops[k]}; solve it again for this model")
        reads = node_inputs(gm)
        if plan.node_inputs and reads != plan.node_inputs:
            k = next(k for k, (a, b) in enumerate(zip(plan.node_inputs, reads, strict=True)) if a != b)
            raise ValueError(f"the plan was solved for a different graph: its node {plan.nodes[k]} reads "
                             f"{', '.join(plan.node_inputs[k]) or 'nothing'}, this model's reads "
                             f"{', '.join(reads[k]) or 'nothing'}; solve it again for this model")
        self._placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        # the arguments that were plain values at planning (looked at every training call: see _warn_values)
        self._value_args = [n for n in gm.graph.nodes if n.op == "placeholder" and str(n.target) in plan.input_values]
        _watch_tree()
        self._tree_version = _TREE_VERSION[0]
        self._modules_at_build = list(self.model.named_modules()) if self.model is not gm else []
        # (each submodule's slot in its parent: a bare `del model.fc` calls no registration hook, so these are
        # looked at every training call, a dictionary lookup per module)
        self._slots = [(parent._modules, name, child) for parent in dict(self._modules_at_build).values()
                       for name, child in parent._modules.items()]
        self._sync_graph_state()
        # each buffer's slot in its module: model.to(dtype) and .double() replace buffers without a registration
        # hook (parameters keep their objects), so these are looked at every training call too
        # (and each parameter's: torch.func.functional_call swaps them without a registration hook too)
        self._tensor_slots = [(table, name, t) for module in dict(self._modules_at_build).values()
                              for table in (module._buffers, module._parameters) for name, t in table.items()]
        self._state_at_build = self._state_now()
        if "_trainable_elements_at_plan" not in self.__dict__:  # (not again when a replaced parameter rebuilds it)
            self.__dict__["_trainable_elements_at_plan"] = self._trainable_elements()
            self.__dict__["_parametrized_at_plan"] = _parametrized(self.model)
            self.__dict__["_aliases_at_plan"] = _graph_aliases(gm, self.model)
        # the modules fx traced into (their code is in the graph; they are never called in a step), by path
        traced = {""} | {path for n in gm.graph.nodes for path in n.meta.get("nn_module_stack", {})
                         if not (n.op == "call_module" and path == n.target)}
        leaves = {n.target for n in gm.graph.nodes if n.op == "call_module"}
        leaves |= {p for n in gm.graph.nodes for p in n.meta.get("memfit_module", ())}  # (what rewritten calls run)
        self._traced_modules = [(p, m) for p, m in self.model.named_modules() if p in traced - leaves]
        # the modules the graph calls, and theirs: they read their own `training`, so what they write can change
        at_build = dict(self._modules_at_build)
        called = [p for p in at_build if p in leaves]  # (in the model's order: the warnings name the first)
        self._called_modules = [(p + ("." if p and q else "") + q, m) for p in called
                                for q, m in self.model.get_submodule(p).named_modules()]
        planned_eval = (set(plan.eval_modules) if plan.eval_modules is not None else
                        {p for p, m in self._called_modules if not m.training})
        self._planned_modes = tuple(p not in planned_eval for p, _ in self._called_modules)
        if "_hooked_at_plan" not in self.__dict__:  # (at planning: not again when a replaced tensor rebuilds it, as
            # spectral_norm's weight_orig does when registered after planning)
            self._hooked_at_plan = {p for p, m in self._called_modules if has_own_hooks(m)}
            self.__dict__["_buffers_at_plan"] = {p: set(m._buffers) for p, m in self._called_modules}
        # the buffers the forward pass writes, by the modes of the modules the graph calls (see _modes)
        self.__dict__["_kinds"] = {}
        self._first_parameter = next(iter(self.model.named_parameters()), None)
        # (the first whose layouts differ: a 1x1 convolution's weight is contiguous in both)
        self._first_weight = next(((k, p) for k, p in self.model.named_parameters()
                                   if p.dim() >= 4 and p.shape[1] > 1 and p.shape[2:].numel() > 1), None)
        self._attributes = [(path, self.model.get_submodule(path), name, kind, value)
                            for path, values in self.__dict__["_captured"].attributes.items()
                            for name, (kind, value) in values.items()]
        self._globals = global_reads(self.__dict__["_captured"].called)
        self._frozen_at_build = [(n, p) for n, p in self.model.named_parameters() if not p.requires_grad]
        self._warned.discard("unfrozen")  # (its parameters are looked at again)
        self._output = next(n for n in gm.graph.nodes if n.op == "output")
        spans = plan.region_spans()
        self._check_inplace(nodes, spans)
        from memfit.variants import OPERAND

        self._operand_of = {}  # node -> the node that writes into its output in place (the plan's in-place forms)
        for node in nodes:
            k = OPERAND.get(plan.variants.get(node.name, "default"))
            if k is not None and k < len(node.args) and isinstance(node.args[k], fx.Node):
                self._operand_of[node.args[k].name] = node.name
        self._check_stats(nodes)
        from memfit.variants import VARIANTS

        inexact = sorted({v for v in plan.variants.values() if v in VARIANTS and not VARIANTS[v].offered})
        if inexact:
            warnings.warn(f"the plan uses {', '.join(inexact)}, which memfit does not offer to its planner: its "
                          "gradients equal PyTorch's only to float32 rounding, not bit for bit (README, operator "
                          "variants)", stacklevel=3)
        region_at = {lo: hi for lo, hi in spans}
        # steps: ("node", name, fn) or ("region", _Region); compute last forward use of every value
        steps: list[tuple] = []
        i = 0
        while i < len(nodes):
            if i in region_at:
                hi = region_at[i]
                steps.append(("region", list(nodes[i:hi + 1])))
                i = hi + 1
            else:
                steps.append(("node", nodes[i]))
                i += 1
        reads: list[set[str]] = []  # per step: the values it reads from outside itself
        for kind, payload in steps:
            group = payload if kind == "region" else [payload]
            inside = {n.name for n in group}
            reads.append({a.name for n in group for a in n.all_input_nodes if a.name not in inside})
        keep_forever = {a.name for a in self._output.all_input_nodes}
        last_step: dict[str, int] = {}
        for k, r in enumerate(reads):
            for name in r:
                last_step[name] = k
        self._index = {n.name: i for i, n in enumerate(nodes)}
        self._larger_ratio = 0.0  # the largest output size ratio warned about (see _check_size)
        self._offloads = {self._index[name] for name in plan.offloads}
        step_of = {}
        for k, (kind, payload) in enumerate(steps):
            for n in (payload if kind == "region" else [payload]):
                step_of[n.name] = k
        self._releases: dict[int, list[int]] = {}
        for name in plan.offloads:
            wait = plan.offload_waits.get(name, "<end>")
            self._releases.setdefault(step_of.get(wait, len(steps)), []).append(self._index[name])
        self._steps = []
        from_stats = set(plan.stats_recompute)
        for k, (kind, payload) in enumerate(steps):
            frees = [name for name, last in last_step.items() if last == k and name not in keep_forever]
            if kind == "node" and payload.name not in last_step and payload.name not in keep_forever:
                # a value no later step reads, such as the result of an in-place method whose operand the code reads
                # on (`h.mul_(0.5); x = torch.tanh(h)`): dropped at once, or it would hold its storage to the end of
                # the forward pass (a fresh user's MLP: 0.77 MB over the prediction)
                frees.append(payload.name)
            if kind == "node":
                self._steps.append(("node", payload.name, self._fn(payload), frees))
                continue
            group = payload
            later = set().union(*reads[k + 1:]) if k + 1 < len(reads) else set()
            outputs = [n.name for n in group if n.name in later or n.name in keep_forever]
            local_last: dict[str, int] = {}
            for j, n in enumerate(group):
                for a in n.all_input_nodes:
                    local_last[a.name] = j
            frees_local = [[name for name, last in local_last.items() if last == j and name not in outputs]
                           for j in range(len(group))]
            # a value nothing reads is dropped at once, as outside regions (the region's run held it to its end: an
            # unused `torch.zeros_like(h)` beside recomputed GRU cells, 131,072 B over the prediction)
            for j, n in enumerate(group):
                if n.name not in local_last and n.name not in outputs:
                    frees_local[j].append(n.name)
            modules: dict[int, nn.Module] = {}
            slots: list[Slot] = []
            for n in group:
                slots += reachable_slots(gm, n)
                if n.op == "call_module":
                    for mod in gm.get_submodule(n.target).modules():
                        modules.setdefault(id(mod), mod)
            region = _Region(names=[n.name for n in group], fns=[self._fn(n) for n in group],
                             inputs=sorted(reads[k]), outputs=outputs, frees=frees_local,
                             modules=list(modules.values()), slots=slots,
                             stats=[n.name in from_stats for n in group])
            self._steps.append(("region", region, None, frees))
        self._has_regions = any(kind == "region" for kind, *_ in self._steps)

    def _check_stats(self, nodes: list[fx.Node]) -> None:
        """Refuse ``stats_recompute`` entries that are no BatchNorm call: nothing would be recomputed from
        statistics there, though the report would count it."""
        by_name = {n.name: n for n in nodes}
        for name in self.plan.stats_recompute:
            node = by_name[name]
            if node.op == "call_module":
                ok = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.gm.get_submodule(node.target).modules())
            else:
                ok = node.op == "call_function" and node.target in (F.batch_norm, torch.batch_norm)
            if not ok:
                raise ValueError(f"plan recomputes node {name} from saved BatchNorm statistics (stats_recompute), but "
                                 "it calls no BatchNorm: remove it from stats_recompute")

    def _check_inplace(self, nodes: list[fx.Node], spans: list[tuple[int, int]]) -> None:
        """Refuse an in-place form the node has not got; one whose operand another node reads (or the model
        returns, or that is an input, a parameter or a buffer: a hand-edited plan gave outputs 28 off, silently),
        or that the operand's producer saves under its variant (``bn-from-output``); and one inside a region that
        does not compute its operand: the region's recomputation would start from the overwritten value
        (autograd's version check catches that at backward when the operand requires grad; refusing it here
        names the node, before any step). Whether PyTorch's own op saves the operand is left to autograd's
        version check."""
        from memfit.variants import OPERAND, inplace_forms, saves_its_output

        region = {}
        for r, (lo, hi) in enumerate(spans):
            for i in range(lo, hi + 1):
                region[nodes[i].name] = r
        for node in nodes:
            name = self.plan.variants.get(node.name, "default")
            if name not in OPERAND:
                continue
            if name not in inplace_forms(self.gm, node):
                raise ValueError(f"plan asks for variant {name!r} on node {node.name}, which memfit cannot apply (it "
                                 "has no such in-place form): drop that variant")
            arg = node.args[OPERAND[name]] if OPERAND[name] < len(node.args) else None
            if not isinstance(arg, fx.Node) or arg.op in ("placeholder", "get_attr"):
                raise ValueError(f"the plan runs node {node.name} as {name!r}, writing into its operand, which is a "
                                 "model input, a parameter or a buffer: drop that variant")
            others = [u.name for u in arg.users if u is not node] + (
                [node.name] if sum(a is arg for a in node.args) > 1 else [])
            if not others and saves_its_output(self.gm, arg, self.plan.variants.get(arg.name, "default")):
                raise ValueError(f"the plan runs node {node.name} as {name!r}, writing into the output of node "
                                 f"{arg.name}, which the plan runs as {self.plan.variants[arg.name]!r}, saving that "
                                 "output for backward: autograd's version check would fail there. Drop one of the "
                                 "two variants")
            if others:
                what = "is the model's output" if others[0] == self._output.name else f"is read by node {others[0]} too"
                raise ValueError(f"the plan runs node {node.name} as {name!r}, writing into the output of node "
                                 f"{arg.name}, which {what}: that would see the overwritten value. Drop that variant "
                                 "(memfit offers an in-place form only where nothing else reads the operand)")
            if node.name not in region:
                continue
            if region.get(arg.name) != region[node.name]:
                raise ValueError(
                    f"the plan runs node {node.name} as {name!r} (writing into its operand) inside a checkpoint "
                    "region that does not compute that operand, so recomputing the region would read the "
                    "overwritten value; make the plan with memfit (it keeps such nodes outside or with their "
                    "operand) or drop that variant")

    def _fn(self, node: fx.Node):
        """The call for ``node``: PyTorch's module, or the operator variant the plan chose for it (built on
        the same parameters and buffers), guarded against what changed since (:meth:`_guarded`, :meth:`_fresh`)."""
        fn = self._variant_fn(node)
        writer = self._operand_of.get(node.name)
        return fn if writer is None else self._fresh(node, writer, fn)

    def _variant_fn(self, node: fx.Node):
        from memfit.variants.tiled import TiledChain

        variant = self.plan.variants.get(node.name, "default")
        module = self.gm.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, TiledChain):
            return self._guarded_stripes(node, module, node_fn(self.gm, node))
        if variant == "default":
            return node_fn(self.gm, node)
        from memfit.variants import variant_call

        try:
            fn = variant_call(self.gm, node, variant)
        except ValueError as e:
            if "_trainable_elements_at_plan" not in self.__dict__:  # (the first build: the plan itself is wrong)
                raise ValueError(f"plan asks for variant {variant!r} on node {node.name}, which memfit cannot apply "
                                 f"({e})") from None
            # rebuilt after the model changed (torch.nn.utils.prune on a split convolution: a fresh user's step
            # failed with this planning error): the node runs as PyTorch's own
            self._warn_once(f"variant lost {node.name}", f"memfit: node {node.name} can no longer run as the plan's "
                            f"{variant!r} ({e}): something changed its module after planning (a hook, a "
                            "parametrization, torch.nn.utils.prune). It runs as PyTorch's own: results are "
                            "correct, but the step can exceed the plan's figures. Plan again for the model as it "
                            "is now.")
            return node_fn(self.gm, node)
        return self._guarded(node, variant, module, fn)

    def _guarded(self, node: fx.Node, variant: str, module: nn.Module | None, fn):
        """``fn`` (``node`` as ``variant``), or PyTorch's own call while a hook was added after planning where the
        variant would not run it: on the node's module (a variant calls PyTorch's kernels, not the module: a
        fresh user's perceptual-loss hook on a split convolution never ran), or on the module whose output an
        in-place form overwrites (a hook may keep it: a kept BatchNorm output read 4.19 off). A variant built from
        a layer whose settings changed since (``negative_slope``) is built again."""
        from memfit.variants import OPERAND, variant_call

        arg = node.args[OPERAND[variant]] if variant in OPERAND and OPERAND[variant] < len(node.args) else None
        producer = self.gm.get_submodule(arg.target) if isinstance(arg, fx.Node) and arg.op == "call_module" else None
        watched = [m for top in (module, producer) if top is not None for m in top.modules()]
        if not watched:
            return fn
        default = node_fn(self.gm, node)
        slots = _setting_slots(module)
        current = [fn, _read(slots)]

        def guarded(env):
            if has_hooks(watched):
                where = node.target if module is not None and has_hooks(list(module.modules())) else arg.target
                glob = not any(has_own_hooks(m) for m in watched)  # (then a global module hook)
                what = ("a global module hook exists (torch.nn.modules.module.register_module_forward_hook)" if glob
                        else f"{where!r} has a module hook (or a forward of its own instance) that was not there "
                             "when the plan was made")
                nodes = f"node {node.name} (and any other)" if glob else f"node {node.name}"
                self._warn_once("hooked: global" if glob else f"hooked {where}", f"memfit: {what}; {nodes}, which the "
                                f"plan runs as {variant!r}, runs as PyTorch's own so that the hook runs and sees "
                                "PyTorch's values (the step may go over the plan). Plan with the hook registered"
                                f"{' on the module instead' if glob else ''}.")
                return default(env)
            if slots and _read(slots) != current[1]:  # (model.act.negative_slope = 0.5)
                try:
                    current[:] = [variant_call(self.gm, node, variant), _read(slots)]
                except ValueError:  # the variant does not apply to the new settings (a negative slope in place)
                    self._warn_once(f"variant {node.name}", f"memfit: node {node.name}'s settings changed since planning "
                                    f"(module {node.target!r}), and the plan's {variant!r} does not apply to the new ones: it runs "
                                    "as PyTorch's own op (the step may go over the plan). Plan again for these settings.")
                    current[:] = [default, _read(slots)]
            return current[0](env)

        return guarded

    def _fresh(self, node: fx.Node, writer: str, fn):
        """``fn`` (``node``, whose output node ``writer`` overwrites in place), copying that output when it shares
        memory with one of the node's inputs. The plan offered the in-place form because the output was a fresh
        tensor when it was profiled; an operation that returns its input (or a view of it) only in another
        setting makes it an alias of a value read later: ``nn.Dropout`` after ``eval()`` or with ``p = 0``,
        ``.contiguous()`` or ``.float()`` for another input shape or dtype. Written in place, that value changed
        under its later readers (a fresh user's outputs 23 off, silently)."""
        from memfit.variants import OPERAND

        k = OPERAND.get(self.plan.variants.get(node.name, "default"))
        own = node.args[k] if k is not None and k < len(node.args) else None  # it writes in place itself
        sources = [a.name for a in node.all_input_nodes if a is not own]

        def fresh(env):
            out = fn(env)
            if not isinstance(out, torch.Tensor) or out.numel() == 0:
                return out
            ptr = out.untyped_storage().data_ptr()
            shared = next((a for a in sources for t in tensors_in(env[a]) if isinstance(t, torch.Tensor)
                           and t.numel() and t.untyped_storage().data_ptr() == ptr), None)
            if shared is None and out._base is None:
                return out
            if f"alias {node.name}" not in self._warned:
                self._warned.add(f"alias {node.name}")
                self._aliased.append((node.name, shared, writer, out.untyped_storage().nbytes()))
            return out.clone()

        return fresh

    def _guarded_stripes(self, node: fx.Node, chain: nn.Module, fn):
        """``fn`` (a striped block), refused while one of its layers has a hook: the stripes call no layer."""
        layers = [m for m in chain.modules() if m is not chain]

        def guarded(env):
            if has_hooks(layers):
                paths = {id(m): p for p, m in self.model.named_modules()}
                hooked = next((m for m in layers if has_own_hooks(m)), None)
                which = (f"the model's submodule {paths[id(hooked)]!r} ({type(hooked).__name__})" if id(hooked) in paths
                         else "a layer")
                what = (f"{which} has a module hook that was not there when the plan was made, and the plan runs it"
                        if hooked is not None else "a global module hook (torch.nn.modules.module."
                        "register_module_forward_hook) was registered after planning, and the plan runs layers")
                raise RuntimeError(f"{what} inside a striped block (node {node.name}); the stripes run the layers' "
                                   "kernels, not the modules, so the hook would not run. Plan again with the hook "
                                   "registered (a layer with hooks is not striped), or with tiling=False")
            return fn(env)

        return guarded

    def forward(self, *args, **kwargs):
        """The model's forward pass (its arguments and outputs), run under the plan when it is a training step
        (training mode, gradients on); otherwise the model's own. Raises what the model raises, and
        ``RuntimeError`` where the model changed after planning in a way the plan cannot follow (a submodule
        replaced, a parametrization added, tied weights untied that the graph reads as one)."""
        with self._own_assignments():
            return self._forward(*args, **kwargs)

    def _forward(self, *args, **kwargs):
        model = self.model
        if self.training != model.training:
            # the model's own mode rules: planned.eval() sets both, and a loop that then calls model.train() (on the
            # model it built, as most loops do) trains (a fresh user's steps ran without the plan: 1.43x the budget)
            self.training = self.__dict__["gm"].training = model.training
        if not (model.training and torch.is_grad_enabled()):
            out = model(*args, **kwargs)  # no training step, no plan: what the model computes in this mode
            if torch.is_grad_enabled() and "eval" not in self._warned:
                self._watch_eval(out)
            return out
        # inside a torch.func transform (vmap, grad): the plan's autograd.Functions and checkpoint hooks do not
        # support them (a fresh user's per-sample gradients failed with internal errors)
        if _under_functorch(args, kwargs, model):
            self._warn_once("functorch", "memfit: the planned module was called inside a torch.func transform (vmap, "
                            "grad, jacrev, ...), which the plan's operator variants and checkpoints do not support: "
                            "it runs your model as PyTorch does there, unplanned (the values are PyTorch's; the "
                            "budget does not hold).")
            return model(*args, **kwargs)
        if torch.compiler.is_compiling():  # (True while torch.compile traces this forward)
            _warn_compiled(self)
        self._check_modules()
        self._check_attributes()
        self._check_hooks()
        self._warn_new_hooks()
        ddp = _active_ddp()  # (the DistributedDataParallel whose forward calls this one, if any)
        if ddp is not None:
            self._check_ddp(ddp)
        given = (args, kwargs)
        args = positional_inputs(self.gm, args, kwargs)
        try:  # arguments left out take the forward's defaults
            env: dict[str, Any] = bind_inputs(self.gm, args, call=True)
        except ValueError as exc:
            raise TypeError(str(exc).replace("example_inputs has", "the planned module was called with")
                            .replace("pass a tuple of all of the forward's positional inputs, in order (",
                                     "pass each, by position or by keyword (the forward takes ")
                            .replace("pass a tuple of the forward's positional inputs, in order",
                                     "pass only the forward's arguments")) from None
        # an argument given at planning and None now (left out, or passed as None): the traced forward took the
        # branch for a value, silently wrong where it tests `mask is None` as a value (a fresh user's
        # `is_causal=mask is None` ran unmasked attention, gradients 2.2e-3 off, with warnings saying results were
        # correct); refused before it runs, a graph traced with the example's shapes too (it ran unplanned, 1.58x the
        # budget, where the README says TypeError)
        fixed, unread = self.__dict__["_captured"].fixed_args, self.__dict__["_captured"].unread_args
        unset_now = [name for name in self._placeholders if name in env and env[name] is None
                     and name not in fixed and name not in unread and not str(name).startswith("*")]
        if unset_now:
            name = next(str(n.target) for n in self.gm.graph.nodes if n.op == "placeholder" and n.name == unset_now[0])
            raise TypeError(
                f"the planned module was called with {name!r} None (left out, or passed as None), but the plan was "
                f"made with a value for it, and torch.fx recorded the path that value took (a test such as "
                f"`{name} is None` ran once, while tracing): pass it as at planning time, or plan with {name} left "
                f"out too and keep a planned module for each case")
        changed = [name for name, value in fixed.items() if name in env and not same_fixed_value(value, env[name])]
        if changed:  # (the graph was traced for the planned value: another would go unread, silently)
            name = changed[0]
            value, now = fixed[name], env[name]
            if value is None:
                raise TypeError(f"the planned module was called with {name!r} set, but it was planned with "
                                f"{name}=None (left out or None in example_inputs), and its forward was traced "
                                f"for None (`{name} is None` true): plan with a {name} in example_inputs, or "
                                f"keep a planned module for each case")
            raise TypeError(f"the planned module was called with {name}={now!r}, but it was planned with "
                            f"{name}={value!r} (in example_inputs, or its default), and its forward was traced for "
                            f"that value (Python code read it once, while tracing: "
                            f"{'`range(' + name + ')` or `if ' + name + ' > 2:`' if type(value) in (int, float) else '`if ' + name + ':`'}"
                            f"; the graph does not read it): call it with {name}={value!r}, or plan with {name}={now!r} "
                            "in example_inputs and keep a planned module for each value")
        # a graph traced with the example's shapes (Python code read a size: memfit.graph.sized) holds for them only
        specialized = self.__dict__["_captured"].specialized
        if specialized is not None and (outside := self._outside_specialized(env)) is not None:
            kind, why = outside
            key = kind
            if kind == "shapes":  # no larger: the plan's decisions on a trace of this call's shapes, where they apply
                found = self._for_shapes(args, env, why)
                if isinstance(found, PlannedModule):
                    return found(*given[0], **given[1])
                reason, words = found
                key, why = f"shapes {reason}", f"{why}; {words}"
            # (another path: a fresh user planned with the longest sequence, as the first advice told, and a loop over
            # its length took another path for every shorter one)
            shapes = ("Pad batches to the planned shape (no smaller shape runs the plan where the code takes another "
                      "path for it: a loop over this size), or plan for this one too (a planned module per shape)."
                      if key.startswith("shapes trace") else
                      "Plan with the largest shapes you train with (smaller ones then run the plan on a trace of their "
                      "own, where the forward's code takes the same path), pad batches to the planned shape, or plan "
                      "for this one too (a planned module per shape).")
            advice = {"autocast": "Plan inside the autocast context you train in (a planned module per state).",
                      "dtype": "Plan the model as it is now.",
                      "state": "Plan the model as it is now.",
                      "dtypes": "Plan with the inputs' dtypes you train with (a planned module per dtype).",
                      "structure": "Plan with the arguments' structure you train with (a planned module per "
                                   "structure).",
                      "shapes": shapes}[kind]
            # (once per kind: a last batch of another path, then bf16 autocast, then a longer sequence; a fresh user's
            # longer sequence went 2.2x over the budget unwarned, after a bool mask had taken the one warning)
            self._warn_once(f"specialized {key}", (
                f"memfit: {type(model).__name__}'s forward pass reads the sizes of its inputs in Python code "
                f"({specialized.line}), so memfit traced it for the planned shapes, dtypes and autocast state only; "
                f"this call differs ({why}), and runs your model as PyTorch does, unplanned (the values are "
                f"PyTorch's; the budget does not hold). {advice}"))
            return model(*given[0], **given[1])
        values = input_values(self._value_args, env)  # (before the run, which frees env's entries)
        # fewer tensors than at planning time: some argument is None now (left out, taking its default, or passed
        # as None), which the traced forward may not run with
        if sum(isinstance(a, torch.Tensor) for a in args) < len(self.plan.input_shapes or []):
            odd = [(name, env[name]) for name in self._placeholders if name in env and name not in
                   self.plan.input_values and env[name] is not None and not isinstance(env[name], torch.Tensor)
                   and not (isinstance(env[name], (dict, tuple)) and not env[name])]  # (not *args, **kwargs)
            if odd:  # (a fresh user's planned(x.numpy()) was told an argument " is None")
                name, value = odd[0]
                name = next(str(n.target) for n in self.gm.graph.nodes if n.op == "placeholder" and n.name == name)
                raise TypeError(f"the planned module was called with {type(value).__module__}.{type(value).__name__} "
                                f"for {name!r}, where the plan's example inputs had a tensor: pass a torch.Tensor "
                                "(torch.as_tensor(...)), as at planning time")
            unset = [name for name in self._placeholders if env.get(name) is None]
            out = self._run_checked(env, args, unset or self._placeholders[len(args):])
        else:
            out = self._run(env, args)
        self._warn_inputs(args)  # after it ran: if it failed, its error says why
        self._warn_values(values)
        out = self._watch_ungraded(out)
        self._watch_step(out)
        return out

    def _watch_ungraded(self, out):
        """``out`` with each output tensor that the ``loss_fn`` given at planning gave no gradient
        (``Plan.ungraded_outputs``: hidden states returned beside the logits) replaced by an alias of it
        (``t.view_as(t)``, the same storage), watched by a hook until the first warning: a training loss that reads
        one runs a backward the plan does not count (a fresh user's feature regularizer on a returned feature map
        measured 1.18x the budget, unwarned). The alias is what tells the loss's reads apart from the model's own:
        a hook on the tensor itself fires when a later layer of the model reads it too."""
        ungraded = set(self.plan.ungraded_outputs)
        if not ungraded or "ungraded" in self._warned or torch.compiler.is_compiling():
            return out
        position = itertools.count()
        paths: list[str] = []  # (named only where an alias is made)

        def alias(t: torch.Tensor) -> torch.Tensor:
            k = next(position)
            # (not one whose .grad the model asked for, h.retain_grad(): the alias's would be set instead)
            if k not in ungraded or not t.requires_grad or t.layout != torch.strided or t.retains_grad or t.is_leaf:
                return t
            view = t.view_as(t)
            paths[:] = paths or tensor_paths(out, "output")
            where = paths[k] if k < len(paths) else f"output {k}"
            view.register_hook(functools.partial(self._on_ungraded_grad, where, tuple(t.shape)))
            return view

        return map_tensors(alias, out)

    def _watch_step(self, out) -> None:
        """Warn (once each) where the training loop runs a step the plan does not count, as each shows:

        * the previous training call's graph is still waiting for its backward pass (``d(real)``, then ``d(fake)``,
          then one backward): both calls' saved activations are held at once, the plan counts one call;
        * the backward pass adds into parameter gradients that existed as it reached the output
          (``zero_grad(set_to_none=False)``, or accumulation over several backward passes) in a plan made for
          gradients set to ``None`` (:meth:`_warn_if_accumulated`);
        * the loop holds an output through the backward pass that the plan counts as freed once the loss read it
          (``out = planned(x); loss = crit(out, y); loss.backward()``), and it does not fit in the budget's room.

        The last two are looked at when the output's gradient arrives, by a hook on the output: after the loss's
        backward released what the loss saved, and after the loop's ``zero_grad()`` wherever it calls it."""
        tensors = tensors_in(out)
        anchors = _with_graph(tensors)
        if not anchors:
            return
        name = type(self.model).__name__
        last = self._last_call() if self._last_call is not None else None
        if last is not None and not last.done:
            # (two nn.Sequential of a GAN are told apart by the inputs they were planned for)
            shapes = ", ".join(str(list(s)) for s in self.plan.input_shapes) if self.plan.input_shapes else ""
            planned_for = f" (planned for inputs {shapes})" if shapes else ""
            self._warn_once("twice", f"memfit: {name}{planned_for} was called again in training before the backward pass of its "
                            "previous call (a discriminator on a real and a fake batch, two augmented views): both "
                            "calls' saved activations are held at once, but the plan counts one call, so the step "
                            "can exceed its budget by up to a whole call's activations. Run backward after each call (the "
                            "second adds into the gradients of the first: plan with grads_exist=True), or pass the "
                            "batches as one (torch.cat) to a module planned for that shape.")
        call = _Call()
        self._last_call = weakref.ref(call)  # alive while the hooks below are, that is while the graph is
        plan, budget = self.plan, self.plan.budget_bytes
        room = None if budget is None or plan.predicted_peak_bytes > budget else budget - plan.predicted_peak_bytes
        # the outputs' storages, not the tensors: a detached copy kept for metrics (`logits = out.detach()`) holds the
        # storage as much as `out` does (a fresh user's 1.19 MB over the budget was not warned)
        # (not while torch.compile traces the call: dynamo makes a bare StorageWeakRef to probe the class, whose
        # __del__ then printed "Exception ignored ... _free_weak_ref" several times a step)
        # (and the outputs the loss gives no gradient: their storage, whatever holds it, and what their graph keeps,
        # held while the tensor itself is, a detached copy holding the storage alone: a detection head's box output
        # kept for a metric held the 1 MiB feature map its convolution saved, 1.08x the budget, unwarned)
        held = {int(k): b for k, b in (plan.held_output_bytes or {}).items()}
        watching = room is not None and not torch.compiler.is_compiling()
        watched = [(StorageWeakRef(tensors[k].untyped_storage()), tensors[k].untyped_storage().nbytes())
                   for k in sorted(set(plan.freed_outputs) | set(held)) if k < len(tensors)] if watching else []
        graphs = [(weakref.ref(tensors[k]), held[k] - tensors[k].untyped_storage().nbytes())
                  for k in held if k < len(tensors) and held[k] > tensors[k].untyped_storage().nbytes()] \
            if watching else []
        del tensors

        def on_grad(grad, call=call):
            if call.done:  # a second backward pass through this call's graph (retain_graph=True, a second loss)
                self._check_grads_exist(name)  # (the first made them: this one adds into them, unless zero_grad())
                return
            call.done = True
            if _autocast_on(grad.device.type):  # (on the CPU the backward runs in the thread that called it)
                self._warn_once("autocast-backward", f"memfit: the backward pass through {name} ran inside "
                                "torch.autocast: its own operations are autocast too and make lower-precision copies "
                                "the plan does not count (a small transformer measured 2.4 MB over its budget), and "
                                "an optimizer.step() inside the same context trains on stale weight casts. Call "
                                "loss.backward() and optimizer.step() outside the autocast context, as PyTorch's "
                                "autocast documentation recommends.")
            self._check_grads_exist(name)
            in_graphs = sum(size for ref, size in graphs if ref() is not None)
            nbytes = sum(size for ref, size in watched if not ref.expired()) + in_graphs
            # (not for a classifier's few logits at 100%, nor a fresh user's 192-byte output, "0.0 MiB")
            if room is not None and nbytes > room + max(budget // 1000, 4096):
                self._warn_once("held", f"memfit: the training loop holds {name}'s output ({fmt_bytes(nbytes)}"
                                + (", with what the autograd graph of an output the loss does not read keeps alive"
                                   if in_graphs else "") + ") "
                                "through the backward pass, but the plan counts it as freed once the loss read it, and "
                                f"the budget leaves {fmt_bytes(room)} above the predicted peak: the step can "
                                "exceed its budget by up to that output. Compute the loss from the call (loss = "
                                "crit(planned(x), y)), or `del out` (and any out.detach() kept, which shares its "
                                "memory) before loss.backward()" + (
                                    "; of an output the loss does not read, keep a .detach()ed one, which holds "
                                    "no graph." if in_graphs else "."))

        for t in anchors:
            t.register_hook(on_grad)

    def _on_ungraded_grad(self, where: str, shape: tuple, grad) -> None:
        """Warn once: the training loss gave a gradient to the output at ``where`` (``output['aux']``, of ``shape``),
        which the ``loss_fn`` given at planning did not read."""
        name = type(self.model).__name__
        self._warn_once("ungraded", f"memfit: the training loss gives a gradient to {name}'s {where} (shape "
                        f"{list(shape)}), which the loss_fn given at planning did not read (nor, maybe, other outputs "
                        "it reads: this is said once): the backward pass through it, and its gradient, are not in the "
                        "plan, so the step can exceed its budget (a feature regularizer on a returned feature map "
                        "measured 1.18x). Plan with loss_fn computing the loss you train with, auxiliary terms "
                        "included.")

    def _watch_eval(self, out) -> None:
        """Warn once if a backward pass runs through a call made in eval mode with gradients on: the planned module
        ran the model without the plan (a fine-tuning loop that freezes BatchNorm with ``model.eval()`` measured
        1.9x its budget, plain PyTorch's peak)."""
        name = type(self.model).__name__

        def on_grad(grad):
            self._warn_once("eval", f"memfit: a backward pass ran through {name} called in eval mode, where the planned "
                            "module runs the model as it is, without the plan: that step's memory is plain PyTorch's. "
                            "To train with some modules frozen in eval mode (BatchNorm statistics), keep the planned "
                            "module in train mode and set only those modules to eval mode (model.bn.eval()), before "
                            "planning.")

        for t in _with_graph(tensors_in(out)):
            t.register_hook(on_grad)

    def _check_grads_exist(self, name: str) -> None:
        """As a backward pass reaches the output, in the first few (``_grad_checks``) of a plan made for gradients set
        to ``None``: watch the parameter gradients that exist already (:meth:`_warn_if_accumulated`)."""
        if self._grad_checks <= 0 or self.plan.grads_exist:
            return
        self._grad_checks -= 1
        existing = [p for p in self.parameters() if p.requires_grad and p.grad is not None]
        if existing:
            self._warn_if_accumulated(existing, name)

    def _warn_if_accumulated(self, existing: list[nn.Parameter], name: str) -> None:
        """Warn once if this backward pass adds into one of the ``existing`` gradients, as it accumulates it: a
        backward pass that computes no parameter gradient (``torch.autograd.grad(loss, x)`` for an adversarial
        example) leaves them alone, and was warned about before."""
        for handle in self._accumulate_hooks:
            handle.remove()
        before = {id(p): weakref.ref(p.grad) for p in existing}  # (weak: zero_grad() must free them)

        def accumulated(param):
            for handle in self._accumulate_hooks:
                handle.remove()
            self._accumulate_hooks = []
            if param.grad is not before[id(param)]():  # set to None since (zero_grad()), then made anew: fine
                return
            self._grad_checks = 0
            self._warn_once("grads", f"memfit: {name}'s parameter gradients existed as its backward pass started "
                            "(zero_grad(set_to_none=False), or gradients accumulated over several backward passes), "
                            "but the plan was made for gradients set to None (PyTorch's zero_grad()): each backward "
                            "pass then adds into them through temporaries the plan did not count, and the step can "
                            "exceed its budget. Make the plan with grads_exist=True (--grads-exist).")

        self._accumulate_hooks = [p.register_post_accumulate_grad_hook(accumulated) for p in existing]

    def _check_optimizer(self, optimizer: torch.optim.Optimizer, before: bool = False) -> None:
        """Around ``optimizer``'s first step (each optimizer once): warn where it keeps more state for this module's
        parameters than the plan counted (:attr:`Plan.optimizer_state_bytes`): a fresh user planned without
        ``optimizer=`` and then trained with AdamW, 1.53x the budget at every step after the first, unwarned.
        ``before``: before the step, with the state it will make estimated (Adam-style optimizers 2x the
        parameters, momentum 1x: :func:`memfit.profile.optimizer.optimizer_state_bytes`), so that the warning
        comes before a step that runs out of memory; after it, with the state it made (again where that is more
        than the estimate: AdamW with ``amsgrad``, RMSprop with momentum, were estimated short)."""
        checked = self.__dict__.setdefault("_optimizers_prechecked" if before else "_optimizers_checked",
                                           weakref.WeakKeyDictionary())
        # (again where it holds more parameters since: a fresh user's add_param_group(body) after planning with the
        # head's AdamW alone measured 2.01x the budget, unwarned, the optimizer having been checked once)
        held = sum(len(group["params"]) for group in optimizer.param_groups)
        if checked.get(optimizer) == held:
            return
        own = {id(p) for p in self.parameters()}
        if before and optimizer not in checked and any(id(p) in own for g in optimizer.param_groups for p in g["params"]):
            self._check_optimizer_options(optimizer)  # (of this module's optimizers: another model's may be any)
        checked[optimizer] = held
        if optimizer in self.__dict__.get("_state_estimated", {}):
            self._warned.discard("optimizer state")  # (a new group is looked at as a first step is)
        state = live_bytes([t for p, st in optimizer.state.items() if id(p) in own
                            for t in st.values() if isinstance(t, torch.Tensor)])
        if before:  # (the estimate of the state its step makes for this module's parameters that have none yet)
            state += new_state_bytes(optimizer, [p for p in self.parameters() if p.grad is not None])
        counted = self.plan.optimizer_state_bytes
        if counted is None:  # (a plan solved by make_plan itself, bench's: its fixed bytes may hold the state)
            params = list(self.parameters())
            counted = max(0, (self.plan.fixed_bytes or 0) - live_bytes(params) - live_bytes(list(self.buffers()))
                          - sum(p.untyped_storage().nbytes() for p in params if p.requires_grad))
        if state <= 1.01 * counted + 65536:
            return
        estimated = self.__dict__.setdefault("_state_estimated", weakref.WeakKeyDictionary())
        if before:
            estimated[optimizer] = state
        elif optimizer in estimated:  # (warned before the step: again only where the estimate fell short)
            if state <= 1.01 * estimated[optimizer] + 65536:
                return
            self._warned.discard("optimizer state")
        if self.plan.optimizer_state_bytes is not None:
            what = f"the plan counted {fmt_bytes(counted)} (for {self.plan.optimizer})"
        else:
            what = "the plan counted none (planned without optimizer=)"
        keeps = (f"will keep about {fmt_bytes(state)}" if before else f"keeps {fmt_bytes(state)}" + (
            f" (more than the {fmt_bytes(estimated[optimizer])} estimated before its first step)"
            if optimizer in estimated else ""))
        self._warn_once("optimizer state", (
            f"memfit: {type(optimizer).__name__} {keeps} of state for {type(self.model).__name__}'s "
            f"parameters, and {what}: {'from its first step' if before else 'from now on'} a training step can peak "
            f"about {fmt_bytes(state - counted)} above the plan's "
            + (f"budget of {fmt_bytes(self.plan.budget_bytes)}" if self.plan.budget_bytes is not None else
               f"predicted peak of {fmt_bytes(self.plan.predicted_peak_bytes)}")
            + ", and more while its step() runs, whose temporaries"
            + (" (Adam's: up to about the parameters' size)" if "adam" in type(optimizer).__name__.lower() else "")
            + " the plan did not count either. Make the optimizer first and plan with it, memfit.optimize(model, example, budget, "
            "optimizer=opt) (an optimizer of the model's parameters trains the planned module too), so the budget "
            "counts its state and its step."))

    def _check_optimizer_options(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn where ``optimizer`` is of a class the plan was made with but chooses another implementation of its
        step (:data:`memfit.profile.optimizer.IMPLEMENTATION_OPTIONS`): the plan counted the temporaries of the one
        it was made with (a fresh user's AdamW planned as a loop, 12 B, and trained with ``foreach=True``, 44.7 MB:
        1.13x the budget, unwarned; with ``fused=True`` at planning, 1.19x). A saved plan applied with such an
        optimizer is refused (its step is measured then: ``memfit.api._check_optimizer_state``)."""
        name = type(optimizer).__name__
        planned = (self.plan.optimizer_options or {}).get(name)
        now = optimizer_options([optimizer])[name]
        if planned is None or planned == now:
            return
        differ = ", ".join(f"{k}={now.get(k)!r} (planned with {planned.get(k)!r})" for k in sorted(set(planned) | set(now))
                           if planned.get(k) != now.get(k))
        self._warn_once(f"optimizer options {name}", (
            f"memfit: this {name} steps with {differ}: another implementation of its step() than the plan counted "
            "the temporaries of, which can take the step over the budget (AdamW on a ResNet-18: 12 B in a loop, "
            "44.7 MB with foreach=True). Plan with the optimizer you train with (optimizer=opt)."))

    def _check_ddp(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Warn where the ``DistributedDataParallel`` whose forward calls this module holds more beside the step than
        the plan counted (:func:`ddp_bucket_bytes`), once per DDP: its gradient buckets hold the trainable parameters'
        gradients of every module it wraps (this one, or one holding it). By default they are a copy, held through
        every step; with ``gradient_as_bucket_view=True`` they are the gradients, which then exist from the start of
        each step, as a plan made with ``grads_exist=True`` counts them. In either mode DDP builds its buckets again in
        its second step, holding another set then. Measured (a small CNN, one gloo process): each step's rise above its
        start is the same in every step but the second, which rises by the buckets' size more; ResNet-18 at ``100%``
        measured 1.32x its budget in that step. A plan made with :func:`memfit.plan`'s ``ddp`` for this DDP's mode
        counts them, unwarned. Then, once, a call inside ``no_sync()`` (:meth:`_warn_ddp_no_sync`)."""
        seen = self.__dict__.get("_ddp_seen")
        if seen is None or seen[0]() is not ddp:
            nbytes = live_bytes(p for p in ddp.module.parameters() if p.requires_grad)
            self.__dict__["_ddp_seen"] = (weakref.ref(ddp), nbytes)
            self._warn_ddp_buckets(ddp, nbytes)
        if not ddp.require_backward_grad_sync and "ddp no_sync" not in self._warned:
            self._warn_ddp_no_sync(self.__dict__["_ddp_seen"][1])

    def _warn_ddp_buckets(self, ddp: nn.parallel.DistributedDataParallel, nbytes: int) -> None:
        """The warning of :meth:`_check_ddp` for ``ddp``'s buckets of ``nbytes`` (the trainable parameters' bytes)."""
        views = bool(getattr(ddp, "gradient_as_bucket_view", False))
        # (a plan for DDP's default buckets counts enough for bucket views too: 0.94x its budget, a fresh user's)
        if self.plan.ddp is not None and self.plan.ddp_bucket_bytes >= ddp_bucket_bytes(nbytes, views,
                                                                                        self.plan.grads_exist):
            return
        mode = "bucket-views" if views else "copy"
        if views:
            what = ("the gradients themselves, from the start of each step" + (
                "" if self.plan.grads_exist else ", where this plan, made with grads_exist=False, counts them only "
                "from where the backward pass makes them") + f", and another {fmt_bytes(nbytes)} in its second step, "
                "which builds them again")
            fix = 'plan with ddp="bucket-views" (memfit.optimize(..., ddp="bucket-views")), which counts them'
        else:
            what = (f"a copy of the gradients, held through every step, and another {fmt_bytes(nbytes)} in its second "
                    "step, which builds them again")
            fix = "plan with ddp=True (memfit.optimize(..., ddp=True)), which counts them"
        made = ("counts none of it" if not self.plan.ddp else
                f"counts {fmt_bytes(self.plan.ddp_bucket_bytes)} of them, for this module alone" if self.plan.ddp == mode
                else f"counts DDP's {'default' if self.plan.ddp == 'copy' else 'bucket-view'} buckets, not these")
        warn_user(f"memfit: DistributedDataParallel wraps this planned module: its gradient buckets hold "
                  f"{fmt_bytes(nbytes)} beside the step ({what}); the plan ({fmt_bytes(self.plan.budget_bytes)} "
                  f"budget) {made}, so the step can go over it. To fit, {fix}.")

    def _warn_ddp_no_sync(self, nbytes: int) -> None:
        """Warn, once, for a training call inside ``no_sync()`` (gradient accumulation) where the plan counted less
        than DDP's default buckets with ``grads_exist`` (of ``nbytes``, the trainable parameters' bytes): the
        accumulation passes make the gradients as tensors of their own beside the buckets, even with
        ``gradient_as_bucket_view=True`` (a fresh user's ``ddp="bucket-views"`` plan measured 1.18x its budget in such
        a loop; ``ddp=True`` with ``grads_exist=True`` fitted, 0.995x)."""
        if self.plan.grads_exist and self.plan.ddp_bucket_bytes >= ddp_bucket_bytes(nbytes, False, True):
            return
        self._warn_once("ddp no_sync", (
            f"memfit: this training call runs inside DistributedDataParallel's no_sync() (gradient accumulation): its "
            f"backward passes make the gradients, {fmt_bytes(nbytes)}, as tensors of their own beside DDP's buckets "
            f"(with bucket views too), and the gradients then exist when each later backward starts; the plan "
            f"({fmt_bytes(self.plan.budget_bytes)} budget) counts "
            + (f"{fmt_bytes(self.plan.ddp_bucket_bytes)} of buckets" if self.plan.ddp else "no buckets")
            + (", and gradients made by the backward pass" if not self.plan.grads_exist else "")
            + ", so the step can go over it. To fit, plan with ddp=True and grads_exist=True."))

    def _warn_once(self, key: str, message: str) -> None:
        """``message`` as a warning at the user's line, unless the warning ``key`` names was given already."""
        if key not in self._warned:
            self._warned.add(key)
            warn_user(message)

    def _run_checked(self, env: dict[str, Any], args: tuple, unset: list[str]):
        """:meth:`_run`, with a failure explained when the call has fewer tensors than the plan's example inputs:
        ``unset`` names the arguments that are ``None`` now (left out or passed as ``None``), which may take a path
        the traced forward does not have."""
        try:
            return self._run(env, args)
        except Exception as exc:
            plural = len(unset) > 1
            raise TypeError(
                f"the planned module was called with fewer tensors than the plan was made with "
                f"({sum(isinstance(a, torch.Tensor) for a in args)} instead of {len(self.plan.input_shapes)}): "
                f"{', '.join(repr(d) for d in unset)} {'are' if plural else 'is'} None (left out, or passed as None), "
                f"but the forward traced at planning time fails with that ({type(exc).__name__}: {exc}): torch.fx "
                "recorded the path the example inputs took. Pass the same arguments as at planning time, or plan for "
                "the call you make") from exc

    def _state_shapes(self) -> list[torch.Size]:
        """The shapes of the model's parameters and buffers, in order."""
        root = self.model
        return [t.shape for t in itertools.chain(root.parameters(), root.buffers())]

    def _state_now(self) -> list[tuple[str, int]]:
        """``(name, id)`` of the model's parameters and buffers, as the planned module's operator variants hold them."""
        model = self.model
        return [(n, id(t)) for n, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                                      model.named_buffers(remove_duplicate=False))]

    def _trainable_elements(self) -> int:
        """Elements of the model's trainable parameters, a storage shared by several (tied weights) counted once:
        elements, not bytes, so that a dtype conversion (``model.double()``, warned about as such) does not read
        as weights untied."""
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() // p.element_size()
                    for _, p in self.model.named_parameters(remove_duplicate=False) if p.requires_grad}
        return sum(storages.values())

    def _check_modules(self) -> None:
        """Refuse to run when a submodule of the model was replaced or removed after planning (seen after any
        module registered a submodule, parameter or buffer, or a submodule was deleted): the traced graph
        still calls the old one, so training would silently compute something else than the model. A parameter or
        buffer replaced by a new tensor (``model.fc.weight = nn.Parameter(...)``) rebuilds the operator variants,
        which hold the tensors they were built with."""
        if not self._modules_at_build or (_TREE_VERSION[0] == self._tree_version
                                          and all(d.get(name) is child for d, name, child in self._slots)
                                          and all(d.get(name) is t for d, name, t in self._tensor_slots)):
            return  # no module anywhere registered anything since the last look, and none was deleted
        version = _TREE_VERSION[0]
        now = dict(self.model.named_modules())
        for name, module in self._modules_at_build:
            if now.get(name) is not module:
                what = (f"replaced ({type(module).__name__} -> {type(now[name]).__name__})" if name in now
                        else "removed")
                raise RuntimeError(f"the model's submodule {name!r} was {what} after planning; the planned module "
                                   "runs the graph traced then, which still calls the old one. Plan the model again "
                                   "(memfit.optimize(model, ...))")
        self._refuse_rebound_reads()
        if self._state_now() != self._state_at_build:
            root = self.model
            self._mirror_model()
            self._build()
            shapes = {k: list(v.shape) for k, v in root.state_dict().items() if isinstance(v, torch.Tensor)}
            more = self._trainable_elements() - self.__dict__["_trainable_elements_at_plan"]
            if self.plan.state_shapes and shapes != self.plan.state_shapes:
                warnings.warn("memfit: a parameter or buffer of the model was replaced by one of another shape after "
                              "planning; results are correct but the planned memory figures do not hold. Make a "
                              "plan for the model as it is now.", stacklevel=4)
            elif more > 0:  # (a fresh user's GPT, its head untied from the embedding: 1.22x its budget, silently)
                warnings.warn(f"memfit: the model's trainable parameters now hold {more:,} more elements than when "
                              "the plan was made (a parameter replaced by a new tensor where two shared one, as when "
                              "tied weights are untied: model.head.weight = nn.Parameter(...)): results are correct, "
                              "but their gradients and optimizer state are not in the plan, so the step can exceed "
                              "its budget. Make a plan for the model as it is now.", stacklevel=4)
        self._tree_version = version  # (after the checks: a refused tree is refused again at the next call)

    def _refuse_rebound_reads(self) -> None:
        """Refuse to run where the graph's reads of the model's tensors no longer mean what they did at planning
        (after any module registered a submodule, parameter or buffer):

        * a parametrization registered or removed since (``torch.nn.utils.parametrize``,
          ``parametrizations.weight_norm``, a LoRA delta): the graph reads the plain tensor it traced (a fresh
          user's weight-norm parameters got no gradient, losses drifted from step 1, "results are correct" said);
        * tensors that were one at planning (tied weights, a buffer registered in two blocks) and are not now:
          ``torch.fx`` reads them by one of their names (``F.linear(h, self.head.weight)`` read ``emb.weight``
          after ``head.weight`` was untied: 0.8% off, the head without a gradient).

        Raises:
            RuntimeError: naming the module or tensors, and that the model needs a new plan.
            ValueError: a parameter or buffer is sparse now (memfit plans dense tensors only)."""
        model = self.model
        for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, t in items:  # (a buffer replaced by a sparse one: PyTorch's "Cannot access storage" before)
                if t.layout != torch.strided:
                    raise ValueError(f"the model's {kind} {name!r} is now a {str(t.layout).removeprefix('torch.')} "
                                     f"tensor: {SPARSE_ADVICE}")
        now = _parametrized(model)
        if now != self.__dict__["_parametrized_at_plan"]:
            before = self.__dict__["_parametrized_at_plan"]
            path = next(p for p in sorted(set(now) | set(before)) if now.get(p) != before.get(p))
            what = "registered on" if set(now.get(path, ())) - set(before.get(path, ())) else "removed from"
            raise RuntimeError(f"a parametrization was {what} the model's submodule {path!r} after planning "
                               "(torch.nn.utils.parametrize, parametrizations.weight_norm, a LoRA delta); the planned "
                               "module runs the graph traced then, which reads that module's tensors as they were. "
                               "Plan the model again (memfit.optimize(model, ...))")
        for names in self.__dict__["_aliases_at_plan"]:
            tensors = [_tensor_named(model, n) for n in names]
            # (buffers of equal values are read as one correctly: model.double() converts a shared buffer once per
            # module that holds it, as PyTorch does; not parameters, whose gradients would go to one of them)
            if any(t is not tensors[0] for t in tensors) and not (
                    all(t is not None and not isinstance(t, nn.Parameter) for t in tensors)
                    and all(t.shape == tensors[0].shape and t.dtype == tensors[0].dtype and torch.equal(t, tensors[0])
                            for t in tensors)):
                raise RuntimeError(f"the model's {' and '.join(repr(n) for n in names)} were one tensor when the plan "
                                   "was made (tied weights, a shared buffer), and the traced graph reads them as one; "
                                   "one was replaced by another tensor since. Plan the model again "
                                   "(memfit.optimize(model, ...)), or keep them tied")

    def _check_hooks(self) -> None:
        """Refuse to train when a module that fx traced into (its code is in the graph, so it is never called)
        has a hook that was not there when the plan was made: the hook would not run (a fresh user's Grad-CAM
        on ResNet's ``layer4``, registered after planning, captured nothing, and a hook that changed an output
        was ignored). A module with hooks at planning time is kept whole and its hooks run."""
        for path, module in self._traced_modules:
            if getattr(module, "_compiled_call_impl", None) is not None:  # module.compile() after planning
                self._warn_once(f"compiled {path}", f"memfit: {f'the submodule {path!r}' if path else 'the model'} "
                                f"({type(module).__name__}) was compiled in place (module.compile()) after planning, "
                                "which has no effect on the planned step: memfit traced into it, and the planned "
                                "module runs its operations from that trace, with PyTorch's eager kernels, which "
                                "the plan's figures are for. Drop the .compile() call to silence this.")
            if has_own_hooks(module):
                where = (f"the model's submodule {path!r} ({type(module).__name__})" if path else
                         f"the model itself ({type(module).__name__})")
                fix = ("register it on the planned module instead (its hooks run around each call)" if not path else
                       "plan again with the hook registered: memfit then keeps that module whole and runs its hooks")
                raise RuntimeError(f"{where} has a hook that was registered after planning; memfit traced into it, "
                                   f"so the planned step never calls it and the hook would not run: {fix}")

    def _warn_new_hooks(self) -> None:
        """Warn once when modules the graph calls have a hook that was not there when the plan was made: the hooks
        run, but whatever they keep (a feature map stored for a loss or a visualization) is in no figure of the
        plan (a fresh user's hooks keeping 5 convolutions' outputs took a step at 70% to 1.32x the budget, warned
        only for the one the plan ran as a variant)."""
        if "new hooks" in self._warned:
            return
        new = [p for p, m in self._called_modules if p not in self._hooked_at_plan and has_own_hooks(m)]
        # (a hook of a module the plan recomputes runs again in the backward pass, as torch.utils.checkpoint runs it:
        # one that came with buffers of its own updates them twice a step; spectral_norm registered after planning
        # ran its power iteration twice, a fresh user's weight_u 0.27 off after one step)
        recomputed = {id(m) for kind, region, _, _ in self._steps if kind == "region" for m in region.modules}
        at_plan = self.__dict__["_buffers_at_plan"]
        again = [(p, sorted(set(m._buffers) - at_plan.get(p, set()))) for p, m in self._called_modules
                 if p in new and id(m) in recomputed and set(m._buffers) - at_plan.get(p, set())]
        if again:
            path, names = again[0]
            raise RuntimeError(
                f"the model's submodule {path!r} has a hook registered after planning, with buffers of its own "
                f"({', '.join(names)}), and the plan recomputes that module in the backward pass, where the hook runs "
                "a second time and would update them twice a step (torch.nn.utils.spectral_norm's power iteration); "
                "PyTorch updates them once. Plan the model again with the hook registered (memfit.optimize(model, "
                "...)), which keeps such a module whole and runs it once.")
        if new:
            self._warn_once("new hooks", f"memfit: {len(new)} module(s) the plan calls have a hook (or a forward of "
                            "their own instance, layer.forward = f) registered after planning "
                            f"({', '.join(repr(p) for p in new[:3])}{', ...' if len(new) > 3 else ''}): "
                            "they run and results are correct, but tensors they keep are not in the plan's "
                            "memory figures, so the step can exceed its budget. Plan with them registered.")

    def _check_attributes(self) -> None:
        """Refuse to train when a plain Python attribute that the traced forward pass read has changed since
        (``self.route``, ``self.scale``, a dropout probability kept as a number): the graph holds the value it
        had then, so the planned module would train another function than the model (a fresh user's scale
        changed from 1 to 3: gradients off by 0.23, silently). :mod:`memfit.graph.attributes`."""
        changed = changed_global(self._globals)
        if changed is not None:
            label, then, now = changed
            raise RuntimeError(
                f"the global {label} that {type(self.model).__name__}'s forward reads was {then} when memfit traced "
                f"the model and is {now} now. torch.fx records what forward read as constants, so the planned module "
                f"still computes with {then}. Plan the model again after changing it (memfit.optimize(model, ...)); a "
                "value that changes during training can instead live in a tensor that forward reads "
                "(register_buffer), or be passed to forward as an argument.")
        changed = changed_attribute(self._attributes)
        if changed is not None:
            label, then, now = changed
            mode = " (the module's mode: eval() or train() on it)" if label.rsplit(".", 1)[-1] == "training" else ""
            raise RuntimeError(
                f"{type(self.model).__name__}.{label} was {then} when memfit traced the model and is {now} "
                f"now{mode}. torch.fx records what forward read as constants, so the planned module still computes "
                f"with {then}. "
                "Plan the model again after changing it (memfit.optimize(model, ...)); a number that changes "
                "during training can instead live in a tensor that forward reads (register_buffer).")

    def _differences(self, args: tuple) -> tuple[list | None, list | None, tuple[str, str] | None]:
        """``(input shapes, input dtypes, (planned, current) parameter dtype)``, each ``None`` where it is as the
        plan was made for."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        shapes = [list(a.shape) for a in tensors]
        dtypes = [str(a.dtype) for a in tensors]
        converted = None
        if self._first_parameter is not None:
            key, param = self._first_parameter
            made = self.plan.state_dtypes.get(key)
            if made is not None and str(param.dtype) != made:
                converted = (made, str(param.dtype))
        return (shapes if self.plan.input_shapes and shapes != self.plan.input_shapes else None,
                dtypes if self.plan.input_dtypes and dtypes != self.plan.input_dtypes else None, converted)

    def _for_shapes(self, args: tuple, env: dict[str, Any], why: str) -> PlannedModule | tuple[str, str]:
        """The planned module for a call of a shape-specialized graph with inputs of other shapes (positional
        ``args``; ``env`` bound by node name; ``why``: how they differ, for the warning): the plan's decisions on a
        trace of their shapes (:func:`memfit.runtime.reshaped.traced_for`), kept for the last
        :data:`RESHAPED_KEPT` shapes; else why they cannot apply, ``(kind, words)``, the kind ``"larger ..."`` (with the
        dimensions that grew) or ``"trace ..."`` (with the shapes; the call then runs unplanned)."""
        specialized = self.__dict__["_captured"].specialized
        named = self._named(env)
        grown = specialized.larger(named)
        if grown:  # (each set of dimensions that grew warned once: a batch, a sequence)
            return f"larger {grown}", "it is larger than planned in some dimension"
        kept = self.__dict__["_reshaped"]
        key = specialized.shapes(named)
        if key in kept:
            kept[key] = kept.pop(key)  # (the most recent last)
            return kept[key]
        started = time.perf_counter()
        found = traced_for(self.model, self.__dict__["_captured"], self.plan, args)
        if isinstance(found, str):  # (warned once per shape: each runs unplanned, over the budget; a fresh user's
            # loop over time, planned for 16 steps, went 1.42x and 1.28x over it at 14 and 12 steps unwarned after 15's)
            found = (f"trace {key}", found)
        else:
            captured, plan = found
            found = PlannedModule(captured, plan, report=self.report, offload_dir=self.offload_dir,
                                  offload_store=self.offload_store)
            found._warned = self._warned  # (each warning once, whichever shape gives it)
            self._warn_once("reshaped", (
                f"memfit: {type(self.model).__name__}'s forward pass reads the sizes of its inputs in Python code "
                f"({specialized.line}), so memfit traced it for the planned shapes; this call's are smaller "
                f"({why}), so memfit traced the forward again for them ({time.perf_counter() - started:.2f} s) and "
                "runs the plan's decisions on that graph, whose tensors are no larger than the planned ones: the "
                f"step's peak stays at most the planned one. Each new shape is traced once (the last "
                f"{RESHAPED_KEPT} are kept)."))
        kept[key] = found
        if len(kept) > RESHAPED_KEPT:
            kept.pop(next(iter(kept)))
            self._warn_once("reshaped: many shapes", (
                f"memfit: {type(self.model).__name__} was called with more than {RESHAPED_KEPT} input shapes since "
                f"planning, each traced again at its first call ({time.perf_counter() - started:.2f} s this one) and "
                "again once it is no longer among the last kept: batches of many lengths (dynamic padding) spend "
                "that time in most steps. Pad batches to a few fixed lengths (bucketing), or to the planned shape."))
        return found

    def _named(self, env: dict[str, Any]) -> dict[str, Any]:
        """The bound arguments ``env`` (by node name) by the forward's argument names."""
        return {str(n.target).lstrip("*"): env.get(n.name) for n in self.gm.graph.nodes if n.op == "placeholder"}

    def _outside_specialized(self, env: dict[str, Any]) -> tuple[str, str] | None:
        """``(kind, words)`` where this call (its bound arguments ``env``, by node name) is not what a graph traced
        with the example's shapes holds for: other inputs or autocast state (:meth:`Specialized.differs`), the model
        converted to another dtype (``"dtype"``) or a parameter or buffer of another shape (``"state"``); else
        ``None``."""
        found = self.__dict__["_captured"].specialized.differs(self._named(env))
        if found is not None:
            return found
        converted = self._differences(())[2]
        if converted is not None:
            return "dtype", f"the parameters are {converted[1]} (planned: {converted[0]})"
        if self._state_shapes() != self.__dict__["_state_shapes_at_build"]:
            return "state", "a parameter or buffer was replaced by one of another shape"
        return None

    def _as_planned(self, args: tuple) -> bool:
        """Whether the inputs have the plan's shapes and dtypes and the parameters its dtype."""
        return not any(d is not None for d in self._differences(args))

    def _check_size(self, name: str, value) -> None:
        """Warn when node ``name``'s output lives in more memory than when the plan was made
        (``Plan.output_bytes``): a size set by the data (``h = emb(ids)[mask]``, planned on a batch with fewer valid
        tokens: a fresh user's step measured 4.7x its budget, silently) or by a layer setting changed since
        planning (``model.up.scale_factor = 3``: 2.0x). Results stay correct. Again each time a node's output grows
        to 1.5x the largest ratio warned about (a 205-row batch warned, then one of 1850 rows ran at 4.4x the budget
        silently; with a cap of three warnings, a fourth growth ran at 11.7x silently)."""
        planned = self.plan.output_bytes.get(name)
        if planned is None:
            return
        seen: dict[int, int] = {}
        for t in tensors_in(value):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.layout == torch.strided:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        now = sum(seen.values())
        if now > planned and self.__dict__.get("_grown_first") is None:
            self.__dict__["_grown_first"] = name
        if now <= planned + max(4096, planned // 100) or now < 1.5 * self._larger_ratio * planned:
            return
        again = self._larger_ratio > 0
        self._larger_ratio = now / planned
        node = next((n for n in self.gm.graph.nodes if n.name == name), None)
        first = self.__dict__.get("_grown_first")
        cause = "a size set by the data, such as a boolean mask's selection, or by a setting changed since planning"
        if first is not None and first != name:  # (a fresh user's `emb(ids)[mask]`: the Linear after it was blamed)
            where = f" (it grew with node {first}'s output, larger than planned first in this step: {cause})"
        elif node is not None and node.op == "call_module":
            where = f" (module {node.target!r}: did one of its settings change since planning?)"
        else:
            where = f" ({cause})"
        warn_user(f"memfit: node {name}'s output takes {fmt_bytes(now)} in this step and took {fmt_bytes(planned)} "
                  f"when the plan was made{where}; results are correct, but the planned memory figures do not hold "
                  "and the step can exceed its budget. Plan with the largest such batch (or the settings as they "
                  "are now)." + (" (Warned again: larger than before.)" if again else ""))

    def _check_unfrozen(self) -> None:
        """Warn once when a parameter that was frozen at planning time now requires grad: its gradient (and the
        backward work to make it) is in no account of the plan (a fresh user's unfrozen backbone: 3.2x the budget)."""
        if "unfrozen" in self._warned:
            return
        names = [n for n, p in self._frozen_at_build if p.requires_grad]
        if names:
            self._warn_once("unfrozen", f"memfit: {len(names)} parameter(s) frozen when the plan was made now "
                            f"require grad ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): results "
                            "are correct, but their gradients are not in the plan, so the step can exceed its "
                            "budget. Make a plan for the model as it is now.")

    def _warn_values(self, now: dict[str, str]) -> None:
        """Warn (twice at most) that the forward's plain-value arguments (``now``, :func:`input_values`) differ from
        the plan's (``planned(x, 3.0)`` for a plan made with ``scale=1.0``: a fresh user's upsampling step measured
        6.3x its budget, silently)."""
        unread = self.__dict__["_captured"].unread_args  # (another value of those changes nothing)
        changed = [f"{k}={now[k]} (planned with {v})" for k, v in self.plan.input_values.items()
                   if k in now and now[k] != v and k not in unread]
        if changed and sum(key.startswith("values ") for key in self._warned) < 2:
            self._warn_once(f"values {changed}", f"memfit: the plan was made for other values of the forward's "
                            f"arguments: {', '.join(changed[:3])}; results are correct, but where such an argument "
                            "sets sizes (a scale factor, a number of steps) the planned memory figures do not hold. "
                            "Make a plan for these values.")

    def _warn_inputs(self, args: tuple) -> None:
        """Warn (once per kind) that the plan's figures do not hold for these inputs: other shapes, or another
        autocast state."""
        shapes, dtypes, converted = self._differences(args)
        # (no larger in any dimension, a last short batch: the plan's decisions on smaller tensors, whose peak is no
        # higher than the planned one; ResNet-18, MobileNet-V2, VGG-16 and UNet at smaller batches and images measured
        # 0.74-0.9996 of the budget. Only larger shapes are warned about)
        if shapes is not None and not _within(shapes, self.plan.input_shapes):
            # once per shape: dynamic padding warns once per length, then once that shapes vary
            others = sum(key.startswith("shape ") for key in self._warned)
            if others < 2:
                self._warn_once(f"shape {shapes}", f"memfit: the plan was made for inputs of shape "
                                f"{self.plan.input_shapes}, called with {shapes}, larger in some dimension; results "
                                "are correct but the planned memory figures do not hold (the step can exceed the "
                                "budget). Make a plan for the largest shapes you train with (smaller ones stay "
                                "under its budget).")
            elif f"shape {shapes}" not in self._warned:  # (dynamic padding warned once per length: 24 times)
                self._warned.add(f"shape {shapes}")
                self._warn_once("shape many", f"memfit: the planned module was called with a third input shape "
                                f"larger than the plan's {self.plan.input_shapes} in some dimension ({shapes}); shapes "
                                "that vary (dynamic padding, a variable sequence length) are not warned about any "
                                "more. Plan for the largest shape you train with: smaller ones stay under its "
                                "budget.")
        if converted is not None:  # (model.double() / .half() after planning: 4.4x over, silently)
            made, now_dtype = converted
            self._warn_once(f"parameters {now_dtype}", f"memfit: the plan was made for {made} parameters and "
                            f"the model's are now {now_dtype} (model.to(dtype), .double() or .half() after "
                            "planning); results are correct but the planned memory figures do not hold. Make a "
                            "plan for the model as it is now.")
        elif dtypes is not None:  # (inputs converted with the model: one warning)
            self._warn_once(f"dtype {dtypes}", f"memfit: the plan was made for inputs of dtype "
                            f"{self.plan.input_dtypes}, called with {dtypes}; results are correct but "
                            "activations differ in size, so the planned memory figures do not hold. Make a "
                            "plan for these inputs.")
        made, now = self.plan.state_layouts, None
        if made and self._first_weight is not None and self._first_weight[0] in made:
            key, weight = self._first_weight
            now = memory_layout(weight)
            if now != made[key]:  # (model.to(memory_format=torch.channels_last) after planning: 10% over, silently)
                self._warn_once(f"weights {now}", f"memfit: the plan was made for {made[key]} weights and the "
                                f"model's are now {now} (model.to(memory_format=...) after planning); results are "
                                "correct but convolutions allocate other copies in another layout, so the planned "
                                "memory figures do not hold. Make a plan for the model as it is now.")
        if self.plan.input_layouts:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            layouts = [memory_layout(a) for a in tensors]
            if layouts_differ(tensors, self.plan.input_layouts) and f"weights {now}" not in self._warned:
                self._warn_once(f"layout {layouts}", f"memfit: the plan was made for inputs of memory layout "
                                f"{self.plan.input_layouts}, called with {layouts}; results are correct but "
                                "activations (and convolutions' copies) follow the input's layout, so the planned "
                                "memory figures may not hold. Make a plan for these inputs (or convert them as the "
                                "example was: x.contiguous(memory_format=...)).")
        if self.plan.input_grads and "input grad" not in self._warned:
            grads = [a.requires_grad for a in args if isinstance(a, torch.Tensor)]
            new = [k for k, (now, made) in enumerate(zip(grads, self.plan.input_grads)) if now and not made]
            if new and torch.is_grad_enabled():
                self._warn_once("input grad", f"memfit: input {new[0]} requires grad, and the plan was made with an "
                                "example that did not (a discriminator called on a generator's output, D(G(z))): the "
                                "backward pass computes its gradient too, which the plan does not count, so the step "
                                "can exceed its budget. Plan with an example that requires grad (x.requires_grad_()).")
        made = self.plan.conv_libraries
        if made and self._first_parameter is not None:  # (oneDNN switched after planning: 6.6% over, silently)
            k = "cudnn" if self._first_parameter[1].is_cuda else "mkldnn"  # (cuDNN has no say on the CPU)
            now = conv_libraries()[k]
            if k in made and made[k] != now:
                flag = f"torch.backends.{k}.enabled"
                self._warn_once(f"library {k} {now}", f"memfit: the plan was made with {flag}={made[k]} and it "
                                f"is now {now}: results are correct but every convolution runs other kernels "
                                "with other workspaces, so the planned memory figures do not hold. Make the plan "
                                f"with the {flag} you train with.")
        made = self.plan.threads
        if made and self._first_parameter is not None and not self._first_parameter[1].is_cuda:
            now = torch.get_num_threads()
            if now != made:  # (a ResNet-18 planned with one thread, trained with two: 26% over, silently)
                self._warn_once(f"threads {now}", f"memfit: the plan was made with torch.get_num_threads()={made} and "
                                f"the step runs with {now}: results are correct but CPU kernels keep per-thread "
                                "scratch buffers, so the planned memory figures do not hold (a ResNet-18 planned "
                                "with one thread went 26% over its budget with two). Make the plan with the "
                                "thread count you train with (torch.set_num_threads, memfit's --threads).")
        here = autocast_dtype(args)
        if (self.plan.autocast or None) != here:
            made = f"under torch.autocast({self.plan.autocast})" if self.plan.autocast else "outside torch.autocast"
            tests = self.__dict__["_captured"].autocast_tests
            if tests:  # (the graph holds the planning state's branch: another state would run the wrong one)
                raise TypeError(
                    f"the plan was made {made} and the planned module is called "
                    f"{f'under torch.autocast({here})' if here else 'outside torch.autocast'}, but the forward reads "
                    f"the autocast state ({tests[0]}), and torch.fx ran that test once, while tracing: the graph "
                    "holds the branch for the planning state. Make a plan in the autocast state you train in (call "
                    "memfit.optimize inside the same torch.autocast context), one per state if you use both.")
            self._warn_once(f"autocast {here}", f"memfit: the plan was made {made} and is called "
                            f"{f'under torch.autocast({here})' if here else 'outside torch.autocast'}: activations "
                            "differ in size, so the planned memory figures do not hold. Make a plan in the autocast state "
                            "you train in.")
        elif here and self.plan.autocast_cache not in (None, torch.is_autocast_cache_enabled()):
            # (planned with the cache on, trained with cache_enabled=False: a GRU loop measured 1.51x its budget)
            now = torch.is_autocast_cache_enabled()
            self._warn_once(f"autocast cache {now}", "memfit: the plan was made under torch.autocast(cache_enabled="
                            f"{self.plan.autocast_cache}) and is called under cache_enabled={now}: "
                            f"{AUTOCAST_CACHE_DIFFERS} Make the plan with the cache setting you train with.")

    def _warn_aliased(self) -> None:
        """One warning for the nodes :meth:`_fresh` found returning an input (or a view) since the last one."""
        if not self._aliased:
            return
        found, self._aliased = self._aliased, []
        names = ", ".join(f"{n} (its input {s!r})" if s else f"{n} (a view)" for n, s, _, _ in found[:4])
        writers = ", ".join(w for _, _, w, _ in found[:4])
        more = f" and {len(found) - 4} more" if len(found) > 4 else ""
        warn_user(f"memfit: node{'s' if len(found) > 1 else ''} {names}{more} returned what {'they' if len(found) > 1 else 'it'} "
                  f"read, and the plan writes into {'their results' if len(found) > 1 else 'its result'} in place "
                  f"(at {writers}{' ...' if more else ''}), which needs a tensor of its own there; memfit copies "
                  f"{'them' if len(found) > 1 else 'it'} first so that the values stay PyTorch's, and the step may go "
                  f"over the plan by up to {fmt_bytes(sum(b for *_, b in found))}. This happens when a layer returns "
                  "its input in a setting it was not planned in (nn.Dropout after eval() or with p=0; .contiguous(), "
                  ".float() or .reshape() for another input shape or dtype): plan again in that setting; or where a "
                  "plan edited by hand names an in-place form after a view (permute, transpose), which memfit's "
                  "planner does not offer there.")

    def _run(self, env: dict[str, Any], args: tuple):
        try:
            return self._run_step(env, args)
        finally:
            self._warn_aliased()

    def _run_step(self, env: dict[str, Any], args: tuple):
        self._check_unfrozen()
        off = self._offload_step(args) if self._offloads else None
        hooks = (torch.autograd.graph.saved_tensors_hooks(off.pack, off.unpack) if off is not None
                 else contextlib.nullcontext())
        state, finder = self._step_state()
        index = self._index
        # (held by autograd itself inside the regions, not through the checkpoint: DirectSaves; the regions hold the
        # inputs to the end of their backward, so that no tensor a recomputation makes takes an input's address)
        direct = ({t.untyped_storage().data_ptr(): t for t in [*self.gm.parameters(), *(
                   t for a in args for t in tensors_in(a) if isinstance(t, torch.Tensor))]}
                  if state is not None else {})
        watched = {b.untyped_storage().data_ptr() for b in self.gm.buffers()} if state is not None else frozenset()
        sized = (self._check_size if self.plan.output_bytes
                 and self._as_planned(args) else None)  # (other inputs or parameters are warned about as such)
        self.__dict__["_grown_first"] = None  # the first node whose output is larger than planned, this step
        on_value = (lambda name, value: off.produced(index[name], tensors_in(value))) if off else None
        if sized is not None:
            on_value = sized if on_value is None else (lambda name, value, f=on_value: (f(name, value),
                                                                                          sized(name, value)))
        if off is not None:
            off.produced(-1, [t for a in args for t in tensors_in(a)])  # model inputs: never offloaded
        output_bytes = self.plan.output_bytes
        with hooks, finder if finder is not None else contextlib.nullcontext():
            for k, (kind, a, b, frees) in enumerate(self._steps):
                if kind == "node":
                    if off is not None:
                        off.current = index[a]
                    env[a] = b(env)
                    if off is not None:
                        off.produced(index[a], tensors_in(env[a]))
                    if sized is not None and (planned := output_bytes.get(a)) is not None:
                        # (this runs for every node of every step: where its tensors' own bytes are within the planned
                        # storage bytes, none of them grew but as a view of a larger tensor, which its node was
                        # checked for; a tensor of a grown input, the inputs' check warns about)
                        v = env[a]
                        if type(v) is torch.Tensor:
                            grown = v.layout != torch.strided or v.nbytes > planned
                        elif type(v) in (tuple, list):
                            grown = any(type(x) is not torch.Tensor or x.layout != torch.strided for x in v) or \
                                sum(x.nbytes for x in v) > planned
                        else:
                            grown = True
                        if grown:
                            sized(a, v)
                        # (else it held the value through the next node's run: an LSTM cell's last cell state, which
                        # no node reads, was alive during the stack of its hidden states, 131,072 B over the budget)
                        del v
                else:
                    values = [env[n] for n in a.inputs]
                    side = {i: v for i, v in enumerate(values) if state.kind(v) is not None}
                    outs = checkpoint(_RegionCall(a, on_value, state, side, direct, watched),
                                      *[v for i, v in enumerate(values) if i not in side],
                                      use_reentrant=False, preserve_rng_state=True)
                    del values, side
                    env.update(zip(a.outputs, outs))
                    del outs  # the environment alone holds the outputs, so each goes after its last use
                if off is not None:
                    for j in self._releases.get(k, []):
                        off.check_versions(j)
                    off.check_dropped([t for f in frees for t in tensors_in(env[f]) if isinstance(t, torch.Tensor)])
                for f in frees:
                    del env[f]
                if off is not None:
                    for j in self._releases.get(k, []):
                        off.release(j)
        if finder is not None:  # the first training step (in these modes): now the written buffers are known
            self.__dict__["_kinds"][state.modes] = finder.kinds()
            state.kinds = by_storage(finder.kinds())
            state.finder = None
            keep = {key for key, kind in state.kinds.items() if kind == STATEFUL}
            for call in state.calls:
                call.keep_only(keep)
        if state is not None:
            state.calls.clear()
        if off is not None:
            off.finish_forward()
        return mutable_containers(fx.node.map_arg(self._output.args[0], lambda n: env[n.name]))

    def _modes(self) -> tuple[bool, ...]:
        """``training`` of every module the graph calls (and of their submodules), in ``_called_modules`` order."""
        return tuple(m.training for _, m in self._called_modules)

    def _plan_kinds(self) -> dict[Slot, str] | None:
        """The written buffers the plan names (``Plan.buffer_kinds``, from the profile), or ``None`` when it
        names one this graph does not have, or names none and does not know that none is written
        (``Plan.buffer_kinds_known``). The first training step then finds them under a dispatch mode, which under
        autocast ran other bfloat16 kernels (a fresh user's first step: gradients 0.0046 off)."""
        kinds = {}
        for name, kind in self.plan.buffer_kinds.items():
            path, _, attr = name.rpartition(".")
            try:
                owner = self.gm.get_submodule(path)
            except AttributeError:
                return None
            if owner._buffers.get(attr) is None or kind not in (STATEFUL, SCRATCH, RESTORE):
                return None
            kinds[(owner, attr)] = kind
        return kinds if kinds or self.plan.buffer_kinds_known else None

    def _step_state(self) -> tuple[_StepState | None, FindWrites | None]:
        """What the regions of this step do with buffers; and, in the first training step of a plan that does
        not name the written buffers, or the first step in which a module the graph calls is in another mode
        than when the plan was made (a BatchNorm planned in ``eval()`` and trained: a fresh user's running
        statistics were updated twice per step), the dispatch mode that finds the buffers the forward pass writes
        and reads (every buffer is snapshotted in that step)."""
        if not self._has_regions:
            return None, None
        modes = self._modes()
        found = self.__dict__["_kinds"]
        if modes != self._planned_modes:
            self._warn_modes(modes)
        elif modes not in found:
            plan_kinds = self._plan_kinds()
            if plan_kinds is not None:
                found[modes] = plan_kinds
        if modes in found:
            return _StepState(by_storage(found[modes]), modes=modes), None
        storages = buffer_storages(self.gm)
        if not storages:  # no buffer to find: no dispatch mode either (under autocast, a fresh user's first step
            found[modes] = {}  # ran other bfloat16 kernels with it: a weight gradient 1 ulp off)
            return _StepState({}, modes=modes), None
        finder = FindWrites(storages)
        return _StepState(dict.fromkeys(storages, STATEFUL), finder, modes), finder

    def _warn_modes(self, modes: tuple[bool, ...]) -> None:
        """Warn once that a module the graph calls is in training mode and was in evaluation mode when the plan was
        made (a BatchNorm planned frozen, then trained): what it saves in training mode is not in the plan's
        figures. A module put in ``eval()`` after planning (frozen for fine-tuning) saves no more than the plan
        counted, so that needs no new plan and gets no warning (README: Limitations)."""
        woken = [(p, m) for (p, m), now, then in zip(self._called_modules, modes, self._planned_modes, strict=True)
                 if now and not then]
        if not woken:
            return
        path, module = woken[0]
        more = f" and {len(woken) - 1} more" if len(woken) > 1 else ""
        self._warn_once("modes", f"memfit: the model's submodule {path!r} ({type(module).__name__}){more} "
                        f"{'are' if more else 'is'} in training mode and {'were' if more else 'was'} in evaluation "
                        "mode when the plan was made: results are correct (memfit finds the "
                        "buffers it writes in this step, so running statistics move once per step), but what it "
                        "saves in training mode (a Dropout mask, batch statistics) is not in the plan's figures, so "
                        "the step may go over the budget. Plan again with the modules in the modes you train with.")

    def _offload_step(self, args) -> OffloadStep:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        device = tensors[0].device if tensors else next(self.gm.parameters()).device
        engine = self._engine
        if engine is None or engine.device != device:
            store = self.offload_store or default_store(device, self.offload_dir)
            engine = CopyEngine(store, device)
            self.__dict__["_engine"] = engine
            self.__dict__["offload_store"] = store
        fixed = {t.untyped_storage().data_ptr() for t in list(self.gm.parameters()) + list(self.gm.buffers())}
        return OffloadStep(engine, self._offloads, self.plan.nodes, fixed)
