"""The planned module: runs the traced forward with checkpoint regions as the plan says.

Each region of the plan runs through non-reentrant ``torch.utils.checkpoint.checkpoint`` (RNG state
preserved, so dropout draws the same masks when recomputed); everything outside regions runs as plain
PyTorch. Values are dropped from the interpreter's environment right after their last forward use, so the
module holds no more than plain PyTorch would.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from memfit.graph.calls import compute_nodes, node_fn, tensors_in
from memfit.graph.capture import Captured
from memfit.runtime.offload import OffloadStep
from memfit.runtime.stores import CopyEngine, HostStore, default_store
from memfit.solve.plan import Plan


@dataclass
class _Region:
    names: list[str]
    fns: list[Any]
    inputs: list[str]
    outputs: list[str]
    frees: list[list[str]]  # per node: local values to drop after it
    buffers: list[torch.Tensor] = field(default_factory=list)  # BatchNorm buffers to restore on recompute


class _RegionCall:
    """One forward call of a region: the first call is the forward pass, later calls are recomputations.
    ``on_value(name, value)`` sees every value the forward pass computes (the offloader's prefetch triggers)."""

    def __init__(self, region: _Region, on_value=None):
        self.region = region
        self.calls = 0
        self.on_value = on_value

    def __call__(self, *values):
        region = self.region
        recompute = self.calls > 0
        self.calls += 1
        snapshot = [b.clone() for b in region.buffers] if recompute else None
        env = dict(zip(region.inputs, values))
        try:
            for name, fn, frees in zip(region.names, region.fns, region.frees):
                env[name] = fn(env)
                if self.on_value is not None and not recompute:
                    self.on_value(name, env[name])
                for f in frees:
                    del env[f]
            self.on_value = None  # needed in the forward pass only; it would keep the offloader alive
            return tuple(env[o] for o in region.outputs)
        finally:
            # running statistics are updated once per step, in the forward pass, never by a recomputation
            if snapshot is not None:
                with torch.no_grad():
                    for buf, saved in zip(region.buffers, snapshot):
                        buf.copy_(saved)


class PlannedModule(nn.Module):
    """An ``nn.Module`` that computes what the original model computes, under a memory plan.

    It shares parameters and buffers with the model it was traced from (``planned.parameters()`` are the
    model's own tensors, under the same ``state_dict()`` keys), so any optimizer built on either trains
    both, and checkpoints load into either. To save, save ``state_dict()`` (the module itself holds
    closures and does not pickle). Gradients and BatchNorm running
    statistics are the same as plain PyTorch's: BatchNorm buffers touched by a recomputation are restored
    to their value from the forward pass.

    Nodes the plan offloads have their saved tensors copied to a host store (``offload_store``: pinned memory
    on CUDA, memory-mapped files in ``offload_dir`` otherwise) and prefetched back in the backward pass
    (:mod:`memfit.runtime.offload`); ``offload_store.peak_bytes`` is the host side's peak.

    Attributes:
        plan: the :class:`~memfit.solve.plan.Plan` it runs.
        report: figures from :func:`memfit.optimize` (predicted and measured), or ``None``.
        gm: the traced ``torch.fx.GraphModule``.
        offload_store: the :class:`~memfit.runtime.stores.HostStore` in use, once a step has offloaded.
    """

    def __init__(self, captured: Captured, plan: Plan, report: dict | None = None,
                 offload_dir: str | None = None, offload_store: HostStore | None = None):
        super().__init__()
        self.__dict__["offload_store"] = offload_store
        self.__dict__["_engine"] = None
        self.offload_dir = offload_dir
        # the traced GraphModule runs the step but is not registered: the planned module registers the
        # model's own children, parameters and buffers instead, so state_dict() keys are the model's
        self.__dict__["gm"] = captured.gm
        root = captured.model if captured.model is not None else captured.gm
        for name, child in root.named_children():
            self.add_module(name, child)
        for name, p in root.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in root.named_buffers(recurse=False):
            self.register_buffer(name, b)
        self.plan = plan
        self.report = report
        self._warned_shapes: set[str] = set()
        self._build()

    def _build(self) -> None:
        gm, plan = self.gm, self.plan
        nodes = compute_nodes(gm)
        if [n.name for n in nodes] != plan.nodes:
            raise ValueError("the plan was solved for a different graph (node names differ); "
                             "solve it again for this model")
        self._placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self._output = next(n for n in gm.graph.nodes if n.op == "output")
        spans = plan.region_spans()
        self._check_inplace(nodes, spans)
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
        for k, (kind, payload) in enumerate(steps):
            frees = [name for name, last in last_step.items() if last == k and name not in keep_forever]
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
            buffers = [b for n in group if n.op == "call_module"
                       and isinstance(gm.get_submodule(n.target), _BatchNorm)
                       for b in gm.get_submodule(n.target).buffers()]
            region = _Region(names=[n.name for n in group], fns=[self._fn(n) for n in group],
                             inputs=sorted(reads[k]), outputs=outputs, frees=frees_local, buffers=buffers)
            self._steps.append(("region", region, None, frees))

    def _check_inplace(self, nodes: list[fx.Node], spans: list[tuple[int, int]]) -> None:
        """Refuse an in-place form inside a region that does not compute its operand: the region's
        recomputation would start from the overwritten value (autograd's version check catches that at
        backward when the operand requires grad; refusing it here names the node, before any step)."""
        from memfit.variants import OPERAND

        region = {}
        for r, (lo, hi) in enumerate(spans):
            for i in range(lo, hi + 1):
                region[nodes[i].name] = r
        for node in nodes:
            name = self.plan.variants.get(node.name, "default")
            if name not in OPERAND or node.name not in region:
                continue
            arg = node.args[OPERAND[name]] if OPERAND[name] < len(node.args) else None
            if not isinstance(arg, fx.Node) or region.get(arg.name) != region[node.name]:
                raise ValueError(
                    f"the plan runs node {node.name} as {name!r} (writing into its operand) inside a checkpoint "
                    "region that does not compute that operand, so recomputing the region would read the "
                    "overwritten value; make the plan with memfit (it keeps such nodes outside or with their "
                    "operand) or drop that variant")

    def _fn(self, node: fx.Node):
        """The call for ``node``: PyTorch's module, or the operator variant the plan chose for it (built on
        the same parameters and buffers)."""
        variant = self.plan.variants.get(node.name, "default")
        if variant == "default":
            return node_fn(self.gm, node)
        from memfit.variants import variant_call

        try:
            return variant_call(self.gm, node, variant)
        except ValueError as e:
            raise ValueError(f"plan asks for variant {variant!r} on node {node.name}, which memfit cannot apply "
                             f"({e})") from None

    def forward(self, *args):
        if len(args) != len(self._placeholders):
            raise TypeError(f"expected {len(self._placeholders)} positional inputs "
                            f"({', '.join(self._placeholders)}), got {len(args)}")
        if self.plan.input_shapes and torch.is_grad_enabled() and self.training:  # the figures are a training step's
            shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
            key = repr(shapes)
            if shapes != self.plan.input_shapes and key not in self._warned_shapes:
                self._warned_shapes.add(key)  # once per shape: a last short batch each epoch warns once
                warnings.warn(f"memfit: the plan was made for inputs of shape {self.plan.input_shapes}, "
                              f"called with {shapes}; results are correct but the planned memory figures do "
                              "not hold. Make a plan for these shapes.", stacklevel=2)
        env: dict[str, Any] = dict(zip(self._placeholders, args))
        off = self._offload_step(args) if self._offloads and torch.is_grad_enabled() else None
        hooks = (torch.autograd.graph.saved_tensors_hooks(off.pack, off.unpack) if off is not None
                 else contextlib.nullcontext())
        index = self._index
        on_value = (lambda name, value: off.produced(index[name], tensors_in(value))) if off else None
        if off is not None:
            off.produced(-1, [t for a in args for t in tensors_in(a)])  # model inputs: never offloaded
        with hooks:
            for k, (kind, a, b, frees) in enumerate(self._steps):
                if kind == "node":
                    if off is not None:
                        off.current = index[a]
                    env[a] = b(env)
                    if off is not None:
                        off.produced(index[a], tensors_in(env[a]))
                else:
                    outs = checkpoint(_RegionCall(a, on_value), *[env[n] for n in a.inputs], use_reentrant=False,
                                      preserve_rng_state=True)
                    env.update(zip(a.outputs, outs))
                    del outs  # the environment alone holds the outputs, so each goes after its last use
                if off is not None:
                    for j in self._releases.get(k, []):
                        off.check_versions(j)
                for f in frees:
                    del env[f]
                if off is not None:
                    for j in self._releases.get(k, []):
                        off.release(j)
        if off is not None:
            off.finish_forward()
        return fx.node.map_arg(self._output.args[0], lambda n: env[n.name])

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
