"""Measure what every node of a captured graph allocates, saves for backward, and costs in time.

The profile is the input of the solver. It records memory at the level of *storages* (one per allocation),
so that views and in-place operations, which share their input's storage, and tensors saved by several
nodes are counted once (DESIGN.md, "What memory means").
"""

from __future__ import annotations

import contextlib
import io
import itertools
import operator
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.graph.attributes import has_hooks, renormed_parameters
from memfit.graph.augmented import WRITE_LINE, check_out_of_place
from memfit.graph.calls import bind_inputs, call_name, compute_nodes, map_tensors, node_fn, tensors_in
from memfit.graph.capture import Captured
from memfit.profile.buffers import FindWrites, buffer_storages, by_storage, reachable_slots, storage_key
from memfit.profile.link import LinkCost
from memfit.profile.timing import median_seconds
from memfit.profile.tracker import MemoryTracker, is_out_of_memory
from memfit.variants.inplace import PLAIN_INPLACE

SPARSE_ADVICE = ("memfit plans steps on dense (strided) tensors only: it measures and places what a step saves by "
                 "the tensors' storage, which a sparse tensor does not expose. Make it dense (`.to_dense()`) where that "
                 "fits in memory, or keep the sparse operation out of the planned model (compute it before or after "
                 "the planned call)")


@dataclass
class Storage:
    """One device allocation seen during the profiled forward pass.

    Attributes:
        id: index into ``Costs.storages``.
        nbytes: size in bytes.
        producer: name of the node that allocated it, or ``None`` for a model input.
        kind: ``"input"`` (model input), ``"output"`` (a node's output), ``"internal"`` (a tensor that
            autograd saved but no node outputs, e.g. max-pool indices, dropout masks, BatchNorm statistics) or
            ``"cast"`` (under ``torch.autocast``: the lower-precision copy of a parameter that autocast makes at
            its first use and keeps in its cache until the autocast context exits, whether or not a node saves
            it; ``producer`` is the first node that reads it).
        requires_grad: whether the tensor in it takes part in the backward pass.
        param: for a ``"cast"``, the name of the parameter it copies (:func:`_param_names`); else ``None``.
    """

    id: int
    nbytes: int
    producer: str | None
    kind: str
    requires_grad: bool = False
    param: str | None = None


@dataclass
class VariantCost:
    """Measured costs of one memory-efficient implementation of a node (``memfit.variants``).

    Attributes:
        saves: storage ids it saves for backward (existing ids for the node's inputs and outputs).
        creates: storage ids of what it saves that nothing else holds (kind ``"variant"``: e.g. a packed
            1-bit mask); they exist only when the variant is chosen.
        fwd_seconds, bwd_seconds, fwd_workspace, bwd_workspace: as in :class:`NodeCost`; the times are at
            least 1.01x PyTorch's implementation's (a faster measurement is noise, see
            ``_no_faster_than_default``).
        inplace_of: for an in-place form (:mod:`memfit.variants.inplace`), the storage id of the operand
            it overwrites: the node then allocates no output, and its output (and every view of it) lives
            in that storage. ``saves`` names the node's own output id, as PyTorch's op would save it.
    """

    saves: list[int] = field(default_factory=list)
    creates: list[int] = field(default_factory=list)
    fwd_seconds: float = 0.0
    bwd_seconds: float = 0.0
    fwd_workspace: int = 0
    bwd_workspace: int = 0
    inplace_of: int | None = None


@dataclass
class NodeCost:
    """Measured costs of one node (all sizes in bytes, times in seconds, medians).

    Attributes:
        name: the node's name in the graph.
        outputs: storage ids of the node's output tensors (an existing id for views and in-place results).
        creates: storage ids the node allocates in the forward pass (new outputs, then internal saved tensors).
        saves: storage ids autograd saves for backward while the node runs (parameters and buffers excluded).
        mutates: storage ids the node modifies in place.
        grad_bytes: bytes of the gradient the backward pass materializes for this node's output (made by the
            output's reader; for a view too, whose backward passes it on to its input; 0 for outputs that need
            no gradient).
        fwd_seconds: forward time.
        bwd_seconds: backward time (gradients of inputs and parameters).
        fwd_workspace: bytes allocated transiently by the forward beyond what it keeps (its peak minus
            its net allocation), e.g. oneDNN reorders or cuDNN workspaces.
        bwd_workspace: bytes allocated transiently by the backward beyond the gradients of its activation
            inputs: temporaries and the parameter gradients before they are added into ``.grad``.
        bwd_workspace_grad_freed: ``bwd_workspace`` when autograd alone holds the output's gradient: a node whose
            backward runs several of autograd's functions one after the other (the math attention, an einsum)
            frees it once the first has consumed it, so the later ones run without it (``None``: the same as
            ``bwd_workspace``). The replay uses it where the node's backward is the gradient's last reader.
        bwd_sum_inputs: the inputs (by name) other nodes read too, where the node's backward runs several of
            autograd's functions: a reader later in forward order may have made their gradient before this
            backward starts, and autograd then adds this node's contribution as soon as the function making it
            returns, in the middle of the node's backward (``accumulate`` in torch/csrc/autograd/input_buffer.cpp).
        bwd_sum_workspaces: ``bwd_workspace`` measured where the gradients the node's contributions are added to
            exist first, as views of a larger gradient, so that each contribution is added into a new tensor beside
            what the backward's later functions allocate: ``"inputs"`` (those of ``bwd_sum_inputs``),
            ``"parameters"`` (those of its parameters other nodes read: a cell called per time step), ``"both"``;
            ``"parameters-inplace"`` and ``"both-inplace"``, where the parameters' gradients are tensors of their own
            (two contributions summed), into which autograd adds in place; each also with ``"-freed"``, as
            ``bwd_workspace_grad_freed`` (where that is measured). Measured only
            where the backward runs several functions (else the sums come once it has returned).
            Where the replay adds such a contribution, the case that applies is the node's workspace (a case
            measured only with the output's gradient held adds its excess over ``bwd_workspace`` where autograd
            frees that gradient once read, which can over-count by that gradient).
            ``nn.GRUCell`` called per time step, its states stacked: 64,000 B over a ``100%`` budget without the
            first; 48 KiB over-predicted (6.6%) at a small batch without the second.
        bwd_released_workspaces: where the backward runs several functions, its workspaces measured again with the
            inputs other nodes made held by the node's saved tensors alone, as in a step where the node is their last
            holder: each is freed once the last function that saved it has run, inside the backward (the measurement
            above holds them to its end). Keys: ``"plain"`` (``bwd_workspace``), ``"plain-freed"``
            (``bwd_workspace_grad_freed``) and those of ``bwd_sum_workspaces``. A ``GRUCell`` called per time step,
            whose input state is freed before its weight gradient's sum: one state (2%) over-predicted without it.
            Its outputs the node saves itself are held so too (an ``RNNCell``'s ``tanh`` output); where it also has
            such inputs, ``"out-"`` keys are its outputs alone held so (an RNN's input state stays held by the
            previous step's saved output: 3.6% over-predicted without them).
        grad_in_bytes: bytes the backward newly allocates for the gradients of its activation inputs.
        grad_alias: the backward passes its output's gradient on to its inputs without a copy (additions,
            views), so the inputs' gradients share that storage.
        returns_param: the output is a parameter itself, returned by a conversion that copies nothing
            (``w.float()`` of a float32 weight): its readers' backward passes make the parameter's contributions.
        view_output: an output is a view of another tensor (``Tensor._base``; a ``Linear``'s output on a 3-D input
            is one): an in-place update of it rewrites its base's history (``CopySlices``).
        grad_copies: with ``grad_alias``, the input nodes (by name) whose gradient is nevertheless a tensor of
            its own: under autocast, an input of another dtype than the output, whose gradient autograd casts
            (a float32 residual addition that reads a bfloat16 branch), or an input the addition broadcasts
            (its gradient is reduced).
        param_grad_bytes: bytes of the ``.grad`` of the parameters whose gradient first exists once this node's
            backward is done (the parameters it is the last node in forward order to use; further
            contributions are summed into it). When gradients are
            set to ``None`` before the step (PyTorch's ``optimizer.zero_grad()``), autograd makes the computed
            gradient itself the ``.grad``, so these bytes stay allocated from then on.
        param_sum_bytes: bytes of the parameters whose gradient this node's backward adds to a contribution an
            earlier backward step made (a parameter several nodes use: tied weights, a layer called twice).
            Autograd sums the two in its buffer for the parameter once the node's backward has returned: in place
            where the buffer holds a dense tensor of its own (``param_sum_inplace_bytes``), else into a new tensor
            beside both contributions (tied embedding and output weights, whose first contribution is a
            ``Linear``'s transposed view, measured one weight's size over the replay without this).
        param_sum_inplace_bytes: the part of ``param_sum_bytes`` added into autograd's buffer in place
            (``can_accumulate_inplace`` in ``torch/csrc/autograd/input_buffer.cpp``: the buffer holds a dense
            tensor with the only reference to its storage): a convolution's weight gradient, or the sum an earlier
            out-of-place addition made. A convolution encoder called twice was predicted 5 MiB, 10%, over its
            measured peak when every sum was counted out of place.
        param_sum_largest_bytes: the largest parameter whose contribution this node's backward sums out of place:
            the sums run one parameter after the other, as the node's backward makes each contribution, so one
            such tensor at a time is beside its workspace (a ``GRUCell`` called at each step of a sequence was
            predicted 12.8% over its measured peak when its four parameters' sums counted at once).
        param_buffer_bytes: bytes of the parameters several nodes use for which this node's backward makes the
            first contribution: autograd holds it in its buffer until the last contribution is added. With
            ``Costs.grads_exist`` that buffer is a tensor apart from ``.grad``, which it is added into when
            the last contribution arrives.
        param_buffer_end_bytes: bytes of the parameters several nodes use whose last contribution this node's
            backward makes (autograd's buffer for them is then released or becomes ``.grad``).
        param_grad_upcast_bytes: where several nodes read a parameter through one autocast cast (a layer called
            at each step, under ``torch.autocast``), autograd sums their contributions in the cast's dtype, in the
            buffer of the cast's backward (``ToCopyBackward0``), and makes the parameter's own gradient from the
            sum once the first reader's backward has returned: these bytes (the parameters' gradients less their
            casts') come into existence then, at the first reader; the last reader's ``param_grad_bytes`` (or
            ``param_buffer_bytes``) counts the casts' bytes.
        variants: operator variants that can replace this node, by name, with their measured costs.
        casts: storage ids of the autocast casts (kind ``"cast"``) this node reads: made by the first node that
            reads the parameter, then shared through autocast's cache until the forward pass ends; a
            recomputation under autocast makes its own (empty outside autocast).
        unmade_at_stop: storage ids this node creates after its last saved tensor: a recomputation that ends at
            this node stops there (the non-reentrant checkpoint stops at its last saved tensor), so it never
            makes them. A built-in operation saves its inputs before it computes (a convolution: all its
            outputs); a composite one may save what it made first and make its outputs last (the math
            attention saves its probabilities, then its last matrix product its operands before computing the
            output); a custom ``autograd.Function`` saves after its forward (none). Placed by the order of the
            saves among the operators of the node's forward (:class:`_SaveOrder`).
        stop_workspace: for a node with ``unmade_at_stop``, the bytes a recomputation that stops at it holds
            beyond what it makes before its last save: the forward's peak up to that save, minus what the forward
            keeps that is not in ``unmade_at_stop`` (0 when not measured). The replay takes the larger of this
            and ``fwd_workspace``: ``nn.MultiheadAttention``'s math path peaks while its output projection saves
            its input, before the projection's output exists, so the forward's workspace minus that output
            priced the stop one ``[B, T, D]`` tensor under its measured peak.
        bwd_held_at_unpack: bytes the node's backward has made (less what it freed) when it first unpacks a saved
            activation: where the node ends a checkpoint region, that unpack starts the recomputation, which runs
            beside them. ``nn.MultiheadAttention`` returning its averaged weights first runs the average's
            backward (a ``[N*heads, L, L]`` gradient) and only then its output projection's, the first to unpack
            (one such gradient, 442,368 B, was missing from a fresh user's recomputation: 1.05x the budget).
        bwd_held_at_unpack_grad_freed: the same when autograd alone holds the output's gradient (it frees it once
            read; ``None``: not measured, see ``bwd_workspace_grad_freed``).
        recomputable: a recomputation of this node gives what its forward gave. ``False`` for a node that
            modifies a parameter in place, directly or through ``.data`` (``nn.Embedding(max_norm=...)``
            renormalizes rows again, and the gradients differed by 1e-9; a momentum update of a frozen target
            network would run twice a step) and for randomized leaky ReLU (``nn.RReLU``, ``F.rrelu``:
            recomputed by PyTorch's own checkpoint, its gradients differed; under memfit's regions they were
            uninitialized memory), and for a draw from a ``torch.Generator`` of the user's own (``torch.randn(shape,
            generator=self.gen)``): ``torch.utils.checkpoint`` replays the global generators only, so a
            recomputation drew other noise (a fresh user's gradients 1.23 off, relative). Such a node always runs
            outside checkpoint regions.
        recompute_seconds: time of the node's recomputation when it reuses the statistics of its forward pass
            (``bn-saved-stats``: a BatchNorm in training mode normalizes without computing them again), or
            ``None`` where that does not apply (its recomputation then costs ``fwd_seconds``). Profiled with
            the variants, and used by ``memfit`` only.
        stats_bytes: bytes of those statistics (``2 * C`` values per BatchNorm call), which the runtime holds
            from the node's forward pass to its recomputation when the node is in a checkpoint region.
        buffers: names of the buffers the forward pass writes (``Costs.buffer_kinds``) that a checkpoint region
            holding this node can reach (its module's and submodules' buffers, a buffer it reads through
            ``get_attr`` or as an input): the region's recomputation copies each of them
            (:mod:`memfit.profile.buffers`).
        grad_storage_bytes: input nodes (by name) whose gradient this node's backward makes as a view of a
            larger new storage, and that storage's bytes: the real part of a complex tensor (``rfft2``'s
            backward, ``torch.complex``), held whole while the view lives.
        grad_views: input nodes (by name) whose gradient this node's backward makes as a view of another tensor
            (a ``Linear`` or ``matmul`` over a 3-d input reshapes a 2-d gradient; a ``view``, ``transpose`` or
            ``permute`` passes on a view of its own) or with overlapping or non-dense strides (an ``expand``).
            Autograd cannot add a further contribution into such a gradient in place (``can_accumulate_inplace``
            in ``torch/csrc/autograd/input_buffer.cpp`` wants the only reference to a dense storage), so the sum
            is a new tensor beside both (a frozen ``Linear`` and a LoRA adapter reading one activation: a third
            activation-sized tensor, 192,512 B missed on a small model).
        param_grad_views: the parameters (by name in the graph module) whose gradient this node's backward makes
            as a view, non-dense, or sharing its storage with another gradient it makes: where this node makes a
            shared parameter's first contribution, autograd cannot add the next into it in place.
        param_grad_storage_bytes: the parameters (by name in the graph module) whose gradient this node's backward
            makes in a storage smaller than theirs (bytes): an expanded scalar (``w.sum()``'s backward, 4 B).
        grad_copy_bytes: peak bytes of the copies ``AccumulateGrad`` makes of this node's parameter gradients that
            break the layout contract (an ``einsum`` weight's, transposed) before they become ``.grad`` (``.grad``
            unset), the CPU's transposing buffer included: made after the node's backward has returned, beside the
            gradients it made. 0 with ``Costs.grads_exist`` or where nothing is copied.
    """

    name: str
    outputs: list[int] = field(default_factory=list)
    creates: list[int] = field(default_factory=list)
    saves: list[int] = field(default_factory=list)
    mutates: list[int] = field(default_factory=list)
    grad_bytes: int = 0
    fwd_seconds: float = 0.0
    bwd_seconds: float = 0.0
    fwd_workspace: int = 0
    bwd_workspace: int = 0
    bwd_workspace_grad_freed: int | None = None
    grad_in_bytes: int = 0
    grad_alias: bool = False
    param_grad_bytes: int = 0
    param_sum_bytes: int = 0
    param_buffer_bytes: int = 0
    param_buffer_end_bytes: int = 0
    param_grad_upcast_bytes: int = 0
    variants: dict[str, VariantCost] = field(default_factory=dict)
    casts: list[int] = field(default_factory=list)
    unmade_at_stop: list[int] = field(default_factory=list)
    stop_workspace: int = 0
    bwd_held_at_unpack: int = 0
    bwd_held_at_unpack_grad_freed: int | None = None
    recomputable: bool = True
    grad_copies: list[str] = field(default_factory=list)
    recompute_seconds: float | None = None
    stats_bytes: int = 0
    buffers: list[str] = field(default_factory=list)
    grad_storage_bytes: dict[str, int] = field(default_factory=dict)
    grad_views: list[str] = field(default_factory=list)
    grad_copy_bytes: int = 0
    param_grad_views: list[str] = field(default_factory=list)
    param_grad_storage_bytes: dict[str, int] = field(default_factory=dict)
    param_sum_inplace_bytes: int = 0
    param_sum_largest_bytes: int = 0
    view_output: bool = False
    returns_param: bool = False
    bwd_sum_inputs: list[str] = field(default_factory=list)
    bwd_sum_workspaces: dict[str, int] = field(default_factory=dict)
    bwd_released_workspaces: dict[str, int] = field(default_factory=dict)


@dataclass
class Costs:
    """The profile of one training step of a captured graph on one device.

    Attributes:
        device: device type the costs were measured on (``"cpu"`` or ``"cuda"``).
        storages: every storage of the forward pass, inputs first.
        nodes: one :class:`NodeCost` per graph node, in forward order.
        fixed_bytes: parameters, their gradients and buffers plus the example inputs (optimizer state is
            added by whoever knows the optimizer).
        loss_bytes: transient bytes of the loss's forward and backward beyond the outputs' gradients, plus
            the outputs the loss saves for its backward, measured when a loss function was given; ``None`` means "assume a log-softmax style loss"
            (two output-sized tensors).
        loss_bytes_freed: ``loss_bytes`` where each output the loss saves is freed once the saver has run in its
            backward (the step's loop has dropped the outputs; ``None``: not measured, no output saved). The
            replay uses it where the model holds none of those outputs for its own backward: a loss reading two
            attention maps frees the first before the second's backward peaks (2 MiB over-predicted with
            ``loss_bytes``).
        output_ids: storage id of each tensor of the model's output, in :func:`tensors_in` order (``None`` for
            an input or a parameter passed through).
        loss_keeps: storage ids of the outputs the loss saves for its backward (``(out ** 2).mean()``,
            ``F.mse_loss``; ``F.cross_entropy`` saves its own log-softmax instead): they stay alive until the
            loss's backward, where the replay would otherwise free them once the loss has read them.
        loss_output: storage id of the output the loss value is, or a view of (a model returning its own loss, with
            ``loss_fn=lambda out: out``): the loop holds it to the end of the step, as ``loss_held_bytes`` counts;
            ``None`` where the loss is no output.
        loss_grads: storage ids of the outputs the loss's backward gives a gradient (those it reads on a path to the
            loss value), measured when a loss function was given; ``None`` (no loss function): every output. An
            output the loss does not read (hidden states returned beside the logits) gets none, and the replay once
            counted one for each (a fresh user's model returning four hidden states was predicted 27% high).
        loss_param_ptrs: storage data pointers (in this process) of the parameters the loss's backward gives a
            gradient, the model's (an L2 penalty, a head the forward never calls) and others (a head kept in the loss).
        loss_forward_bytes: bytes the loss's forward allocates at its peak beyond its arguments (the model's
            outputs, still alive then: the loss reads them) while the outputs' gradients do not exist yet
            (a loss that builds a soft target from the detached logits makes two logits-sized tensors
            there); 0 when no loss function was given.
        link: copy costs to the host store used for offloading, or ``None`` (no offloading).
        grads_exist: gradients are allocated when the backward pass starts (``zero_grad(set_to_none=False)``
            or gradient accumulation over micro-batches): each parameter gradient is then computed into a
            temporary and added into ``.grad``. ``False`` (the default, PyTorch's ``optimizer.zero_grad()``):
            ``.grad`` is ``None`` and becomes the computed gradient itself. Either way the gradients count in
            ``fixed_bytes``; with ``False`` they are not yet allocated during the forward pass.
        step_bytes: temporaries of ``optimizer.step()`` above the fixed bytes (set by whoever knows the
            optimizer: :func:`memfit.profile.optimizer.measure_optimizer`); 0 when unknown.
        loss_held_bytes: bytes the loss value itself keeps allocated (the training loop holds ``loss``
            through ``backward()`` and ``step()``): usually a few bytes, but in some builds a reduced loss
            (``F.mse_loss``) is a view of its whole element-wise buffer, and a loss that is one of the model's outputs
            (a model returning its own loss) holds that output's storage, which is then in ``loss_keeps`` too;
            plus the gradient ``loss.backward()``
            seeds the backward pass with (``ones_like(loss)``), alive until that pass ends. Measured with
            ``loss_bytes``.
        region_bytes: bytes each checkpoint region holds on the device from its forward pass until its backward
            pass is done, and allocates again while it is recomputed: the CPU random-number-generator state that
            ``torch.utils.checkpoint`` keeps to replay dropout (``preserve_rng_state``; 5056 bytes), on the CPU
            only (on CUDA it is host memory).
        buffer_kinds: every buffer the forward pass writes, by name (``"bn.running_mean"``), and what a
            recomputation does with it: ``"stateful"``, ``"scratch"`` or ``"restore"``
            (:mod:`memfit.profile.buffers`).
        buffer_bytes: the bytes of one copy of each of those buffers, by name.
        headroom_of: for the profile of a graph with blocks in row stripes (:mod:`memfit.solve.tiling`): the
            activation peak of plain PyTorch's graph, which the planner's headroom is a fraction of, and keeping
            everything then needs that headroom too (it is not plain PyTorch); ``None``: this graph is the
            model's own.
        region_seconds: time each checkpoint region adds to a step beyond the nodes it recomputes, seconds
            (:mod:`memfit.runtime.overhead`; 0 when not measured).
        region_node_seconds: time each node inside a checkpoint region adds beyond its own recomputation
            (saved-tensor hooks, the recomputation's interpreter), seconds; 0 when not measured.
        no_grad_params: names (in the traced graph) of trainable parameters the profiled step gives no gradient
            (a head whose output the loss does not read): no gradient and no optimizer state for them.
    """

    device: str
    storages: list[Storage]
    nodes: list[NodeCost]
    fixed_bytes: int
    loss_bytes: int | None = None
    loss_bytes_freed: int | None = None
    link: LinkCost | None = None
    grads_exist: bool = False
    step_bytes: int = 0
    loss_held_bytes: int = 0
    region_bytes: int = 0
    loss_forward_bytes: int = 0
    output_ids: list[int | None] = field(default_factory=list)
    loss_keeps: list[int] = field(default_factory=list)
    loss_output: int | None = None
    loss_grads: list[int] | None = None
    loss_param_ptrs: list[int] = field(default_factory=list)
    buffer_kinds: dict[str, str] = field(default_factory=dict)
    buffer_bytes: dict[str, int] = field(default_factory=dict)
    headroom_of: int | None = None
    region_seconds: float = 0.0
    region_node_seconds: float = 0.0
    no_grad_params: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Costs:
        nodes = []
        for n in d["nodes"]:
            n = dict(n)
            n["variants"] = {k: VariantCost(**v) for k, v in n.get("variants", {}).items()}
            nodes.append(NodeCost(**n))
        return cls(device=d["device"], storages=[Storage(**s) for s in d["storages"]], nodes=nodes,
                   fixed_bytes=d["fixed_bytes"], loss_bytes=d.get("loss_bytes"), loss_bytes_freed=d.get("loss_bytes_freed"),
                   link=LinkCost(**d["link"]) if d.get("link") else None, grads_exist=d.get("grads_exist", False),
                   step_bytes=d.get("step_bytes", 0), loss_held_bytes=d.get("loss_held_bytes", 0),
                   region_bytes=d.get("region_bytes", 0), loss_forward_bytes=d.get("loss_forward_bytes", 0),
                   output_ids=d.get("output_ids", []), loss_keeps=d.get("loss_keeps", []),
                   loss_output=d.get("loss_output"),
                   loss_grads=d.get("loss_grads"), loss_param_ptrs=d.get("loss_param_ptrs", []),
                   buffer_kinds=d.get("buffer_kinds", {}), buffer_bytes=d.get("buffer_bytes", {}),
                   headroom_of=d.get("headroom_of"), region_seconds=d.get("region_seconds", 0.0),
                   region_node_seconds=d.get("region_node_seconds", 0.0),
                   no_grad_params=d.get("no_grad_params", []))

    def with_variants(self, choice: dict[str, str]) -> Costs:
        """The costs of the graph with some nodes replaced by variants (``choice``: node name -> variant
        name, ``"default"`` for PyTorch's own): a copy in which those nodes save, allocate and cost what
        the variant does. An in-place form's output storage is merged into the operand's storage (every
        node's outputs, saves and views refer to the operand's id, and the dropped output has 0 bytes).
        The simulator and the program read plans through this.

        Raises:
            ValueError: a node has no such variant.
        """
        kinds = {s.id: s.kind for s in self.storages}
        merged: dict[int, int] = {}  # output storage of an in-place form -> the operand's storage
        picked: dict[str, VariantCost] = {}
        for c in self.nodes:
            name = choice.get(c.name, "default")
            if name == "default":
                continue
            if name not in c.variants:
                raise ValueError(f"node {c.name} has no variant {name!r} (it has: {', '.join(c.variants)})")
            v = picked[c.name] = c.variants[name]
            for sid in v.creates:
                kinds[sid] = "internal"
            if v.inplace_of is not None:
                for sid in c.creates:
                    if sid in c.outputs:
                        merged[sid] = v.inplace_of

        def res(sid: int) -> int:
            while sid in merged:
                sid = merged[sid]
            return sid

        def ids(xs) -> list[int]:
            out: list[int] = []
            for x in xs:
                if res(x) not in out:
                    out.append(res(x))
            return out

        readers = _cast_readers(self.nodes)
        nodes = []
        for c in self.nodes:
            v = picked.get(c.name)
            if v is None:
                nodes.append(replace(c, outputs=ids(c.outputs), creates=ids(c.creates), saves=ids(c.saves),
                                     mutates=ids(c.mutates), casts=list(c.casts), grad_copies=list(c.grad_copies),
                                     grad_storage_bytes=dict(c.grad_storage_bytes), grad_views=list(c.grad_views)))
                continue
            outs = set(c.outputs)
            # an autocast cast stays where another node reads it (it shares it through the cache) or the variant
            # saves it; a variant that casts a parameter itself (conv-split-backward) makes no cached one
            # (counting both measured 4608 B, a weight's bfloat16 copy, over per convolution)
            casts = [x for x in c.casts if readers[x] > 1 or x in v.saves]
            creates = ([x for x in c.creates if (x in outs and x not in merged) or x in casts] + list(v.creates))
            mutates = ids(c.mutates) + ([res(v.inplace_of)] if v.inplace_of is not None else [])
            nodes.append(replace(
                c, outputs=ids(c.outputs), creates=ids(creates), saves=ids(v.saves), mutates=ids(mutates),
                fwd_seconds=v.fwd_seconds, bwd_seconds=v.bwd_seconds, fwd_workspace=v.fwd_workspace,
                bwd_workspace=v.bwd_workspace, bwd_workspace_grad_freed=None, bwd_released_workspaces={},
                variants={}, casts=casts,
                unmade_at_stop=[], stop_workspace=0, bwd_held_at_unpack=0, bwd_held_at_unpack_grad_freed=None,
                grad_copies=list(c.grad_copies), grad_storage_bytes=dict(c.grad_storage_bytes),
                grad_views=list(c.grad_views)))
        storages = [Storage(id=s.id, nbytes=0 if s.id in merged else s.nbytes, producer=s.producer,
                            kind=kinds[s.id], requires_grad=s.requires_grad) for s in self.storages]
        return replace(self, storages=storages, nodes=nodes, loss_keeps=ids(self.loss_keeps),
                       loss_output=None if self.loss_output is None else res(self.loss_output),
                       loss_grads=None if self.loss_grads is None else ids(self.loss_grads),
                       output_ids=[None if x is None else res(x) for x in self.output_ids])

    def exact_variants_only(self) -> Costs:
        """A copy with only the operator variants whose gradients are bit for bit PyTorch's (``variants="exact"``):
        no ``conv-native`` (another convolution algorithm, float rounding), and BatchNorm recomputed as PyTorch's
        checkpoint does where ``bn-saved-stats`` is not checked bit for bit (CUDA's kernels)."""
        from memfit.variants import VARIANTS

        nodes = [replace(c, variants={k: v for k, v in c.variants.items() if k not in VARIANTS or VARIANTS[k].exact})
                 for c in self.nodes]
        out = replace(self, nodes=nodes)
        return out if self.device == "cpu" else out.recomputing_from_stats(set())

    def recomputing_from_stats(self, names: set[str] | None) -> Costs:
        """A copy in which only the nodes in ``names`` recompute from their saved statistics
        (``bn-saved-stats``); the others recompute as PyTorch's checkpoint does (``recompute_seconds`` None,
        no statistics held). ``None`` keeps every node that was measured doing so."""
        if names is None:
            return self
        nodes = [c if c.name in names else replace(c, recompute_seconds=None, stats_bytes=0) for c in self.nodes]
        return replace(self, nodes=nodes)

    @property
    def input_bytes(self) -> int:
        """Bytes of the example inputs' storages: the part of ``fixed_bytes`` that grows with the batch."""
        return sum(s.nbytes for s in self.storages if s.kind == "input")

    @property
    def step_seconds(self) -> float:
        """Sum of the nodes' forward and backward times: the modelled time of one plain training step."""
        return sum(n.fwd_seconds + n.bwd_seconds for n in self.nodes)


def _state_snapshot(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The model's buffers and copies of their values, but for expanded ones (a stride of 0: a tensor constant
    `mask.expand(b, -1, -1)` of a graph traced with the example's shapes, Mistral's sliding window), which no
    in-place operation can write and no copy can be written back into."""
    return [(b, b.detach().clone()) for b in model.buffers()
            if not any(stride == 0 and size > 1 for stride, size in zip(b.stride(), b.shape))]


def _restore(snapshot: list[tuple[torch.Tensor, torch.Tensor]], flags: list[tuple[torch.Tensor, bool]]) -> None:
    """Copy the saved values back into the model's buffers and parameters, and put back their
    ``requires_grad``."""
    with torch.no_grad():
        for t, saved in reversed(snapshot):  # (a storage copied twice: its first copy, the value before, last)
            t.copy_(saved)
    for t, rg in flags:
        if t.requires_grad != rg:
            t.requires_grad_(rg)


def profile_graph(captured: Captured, example_inputs: tuple, repeats: int = 3,
                  with_variants: bool = True, loss_fn=None, grads_exist: bool = False,
                  user_inputs: tuple = (), held: tuple = (), kept_grads: tuple = ()) -> Costs:
    """Profile one training step of ``captured`` on the device of ``example_inputs``.

    Runs the traced forward node by node in training mode with a saved-tensor pack hook
    (``torch.autograd.graph.saved_tensors_hooks``) to see what autograd keeps for each node, then times
    each node's forward and backward in isolation (median of ``repeats``). BatchNorm running statistics,
    other buffers, parameters the forward modifies in place and the RNG state are restored afterwards, also
    when profiling raises, so the model is left as it was; so are the buffers of the modules ``loss_fn`` holds
    (a discriminator in a generator's loss).

    Only what requires grad in the model's own forward pass takes part in the backward passes measured here:
    values computed from parameters that require grad (and inputs that do). Buffers, frozen parameters, the
    inputs and integer or boolean values do not (a node reading only those computes no gradient in PyTorch,
    and none is counted).

    Called inside ``torch.autocast``, it profiles the step that context makes: forward passes under it,
    backward passes outside it (as PyTorch's mixed-precision recipe runs them), and each lower-precision
    copy of a parameter that autocast keeps in its cache becomes a storage of kind ``"cast"`` (see
    :class:`Storage`). Autocast's cache is cleared before and after profiling.

    Args:
        captured: the output of :func:`memfit.graph.capture`.
        example_inputs: the model's positional inputs (tensors on the target device), e.g. a batch
            ``[B, C, H, W]``; arguments left out take the forward's default values.
        repeats: timing repetitions per node (the median is kept).
        with_variants: also profile the memory-efficient operator variants that apply to each node
            (``memfit.variants``; MONeT, Shah et al., ICLR 2021, section 4), and the in-place forms of
            element-wise nodes where autograd and the graph allow them (``memfit.variants.inplace``).
        loss_fn: ``loss_fn(output) -> scalar tensor``, the training loss (a closure over the targets); when
            given, its memory is measured instead of assumed.
        grads_exist: parameter gradients are allocated when the backward starts (see :class:`Costs`); also
            taken as true where ``loss_fn`` gives the model's parameters gradients (an L2 penalty).
        user_inputs: the caller's own input tensors, when ``example_inputs`` are copies of them: a tensor
            ``loss_fn`` holds that is one of them (an autoencoder's ``F.mse_loss(out, x)``) is counted once, as
            an input (a fresh user's 4 MiB input was counted twice).
        held: tensors the training step holds outside the model and ``loss_fn`` (the parameters an optimizer
            trains besides the model's): counted once each in the fixed bytes.
        kept_grads: parameters outside the model whose ``.grad`` may exist when the step starts (those of an
            optimizer of their own, a GAN's discriminator): where ``loss_fn`` trains them, its backward is measured
            also adding into existing gradients, and the larger transient is kept.

    The fixed bytes also count what ``loss_fn`` holds (its targets, and the parameters and buffers of the modules
    it calls: a classification head kept in the loss, a teacher, a GAN's discriminator) and the gradients its
    backward gives parameters outside the model (a head's: a fresh user's 41 MB ArcFace-style head in the loss
    measured 6.2x the budget, its weights, gradient and momentum uncounted).

    Returns:
        :class:`Costs`.
    """
    gm = captured.gm
    inputs = tuple(example_inputs)
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    loss_param_grads = 0  # gradients the loss's backward gives parameters outside the model (bytes)
    loss_reads: set[int] = set()  # data pointers of the storages the loss reads
    device = tensors[0].device if tensors else torch.device("cpu")
    params = list(gm.parameters())
    fixed_ptrs = {t.untyped_storage().data_ptr() for t in list(gm.parameters()) + list(gm.buffers())}
    # the modules loss_fn calls (a GAN generator's loss runs the discriminator): profiling calls it several times
    # in training mode, which moved a fresh user's discriminator's BatchNorm statistics (num_batches_tracked +2)
    snapshot = _state_snapshot(gm) + [s for m in _closure_values(loss_fn) if isinstance(m, nn.Module)
                                      for s in _state_snapshot(m)]
    snapshot += [(p, p.detach().clone()) for p in renormed_parameters(gm, gm)]
    flags = [(t, t.requires_grad) for t in [*gm.parameters(), *gm.buffers()]]
    requires: dict[str, list[bool]] = {}
    devices = [device.index or 0] if device.type == "cuda" else []
    cast_dtype = _autocast_cache_dtype(device)
    if cast_dtype is not None:
        torch.clear_autocast_cache()
    # a generator of the user's own (torch.randn(..., generator=self.gen)) is drawn from by every profiling run: put
    # back as it was, as fork_rng puts back the global ones (a fresh user's first steps drew other noise than PyTorch's)
    generators = [(g, g.get_state()) for g in _generators(gm, gm.graph.nodes)]
    try:
        with torch.random.fork_rng(devices=devices):
            costs = _structure(gm, inputs, fixed_ptrs, with_variants, cast_dtype, requires, snapshot)
            _time_nodes(gm, inputs, costs, device, repeats, requires, saved_stats=with_variants)
            _no_faster_than_default(costs)
            formats, no_grad, received, unread = _grad_formats(gm, inputs, loss_fn, requires)
            for c in costs.nodes:  # an output nothing reads gets no gradient in the step
                c.grad_bytes = max(0, c.grad_bytes - unread.get(c.name, 0))
            if loss_fn is not None:
                (costs.loss_bytes, costs.loss_held_bytes, costs.loss_forward_bytes, kept, graded,
                 loss_param_grads, costs.loss_param_ptrs, loss_reads, is_output) = _measure_loss(
                    gm, inputs, loss_fn, device, requires, kept_grads)
                costs.loss_keeps = sorted({costs.output_ids[k] for k in kept if k < len(costs.output_ids)
                                           and costs.output_ids[k] is not None})
                if is_output is not None and is_output < len(costs.output_ids):
                    costs.loss_output = costs.output_ids[is_output]
                if costs.loss_keeps:  # (again, each saved output freed as the loss's backward releases it)
                    costs.loss_bytes_freed = min(costs.loss_bytes, _measure_loss(
                        gm, inputs, loss_fn, device, requires, kept_grads, free_outputs=True)[0])
                costs.loss_grads = sorted({costs.output_ids[k] for k in graded if k < len(costs.output_ids)
                                           and costs.output_ids[k] is not None})
            # the loss's backward gives the model's parameters gradients before the model's backward pass runs (an
            # L2 penalty): that pass then adds into them, as into preallocated ones (a fresh user's ResNet-18 with
            # an L2 penalty measured 1.14x a 100% budget profiled as set to None; exact as preallocated). Only
            # those: a penalty on the last layer alone, profiled as if every gradient existed, was predicted 1.15x
            # what ResNet-18 measured at 100%
            # (a parameter the step gives no gradient, a head whose output the loss does not read, has none: a fresh
            # user's floor was 1.5x what plain PyTorch measured): data pointer -> bytes
            trained = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                       for p in params if p.requires_grad and id(p) not in no_grad}
            existing = set(trained) if grads_exist else set(trained) & set(costs.loss_param_ptrs)
            grads_exist = grads_exist or (bool(trained) and existing == set(trained))
            _measure_workspace(gm, inputs, costs, device, requires, formats, existing, received)
    finally:
        _restore(snapshot, flags)
        for g, state in generators:
            g.set_state(state)
        if cast_dtype is not None:
            torch.clear_autocast_cache()  # the copies profiling made (and of the isolated runs' inputs)
    # every parameter and buffer of the model is allocated, also those the training step never reads (an
    # eval-only head, a leftover mask table): the graph's own hold only the ones it reads (a fresh user's 1 MiB
    # unused buffer went over a 100% budget by its size); a storage shared by several tensors counts once
    owner = captured.model if captured.model is not None else gm
    state = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
             for t in itertools.chain(owner.parameters(), owner.buffers(), gm.parameters(), gm.buffers())}
    for node in gm.graph.nodes:  # what a module's own hook keeps between steps (old-style spectral_norm's weight)
        if node.op == "call_module":
            for t in module_held(gm.get_submodule(node.target)):
                state.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    grad_bytes = sum(trained.values())
    costs.no_grad_params = [name for name, p in gm.named_parameters() if id(p) in no_grad]
    costs.fixed_bytes = (sum(state.values()) + grad_bytes + costs.input_bytes + loss_param_grads
                         + _closure_bytes(loss_fn, fixed_ptrs | set(state), tuple(inputs) + tuple(user_inputs), held,
                                          device, loss_reads))
    costs.device = device.type
    costs.grads_exist = grads_exist
    # torch.utils.checkpoint(preserve_rng_state=True) keeps torch.get_rng_state(), a CPU tensor
    costs.region_bytes = torch.get_rng_state().untyped_storage().nbytes() if device.type == "cpu" else 0
    _param_grads(gm, costs, no_grad, _reached(gm, requires), existing)
    return costs


def module_held(module: nn.Module) -> list[torch.Tensor]:
    """The tensors ``module`` holds as plain attributes (neither parameters nor buffers) on its real device.

    A module called whole by the graph (one with hooks) can set them in its forward: old-style
    ``torch.nn.utils.spectral_norm`` / ``weight_norm`` pre-hooks compute ``weight`` from ``weight_orig`` before
    each call and keep it as ``module.weight`` until the next call replaces it. Such a tensor is alive across
    steps, so it is counted with the parameters (fixed bytes), not as an activation of the node that made it
    (it was freed after that node's backward in the count: a fresh user's spectral-normed MLP measured 5.5%
    over its predicted peak)."""
    return [v for v in vars(module).values() if isinstance(v, torch.Tensor) and v.device.type != "meta"]


def _autocast_cache_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts to on ``device`` when its cache of parameter casts is on, else ``None``
    (outside autocast, or with ``cache_enabled=False``)."""
    if not torch.amp.is_autocast_available(device.type) or not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_cache_enabled() else None


def _no_autocast(device: torch.device):
    """Autocast off for a backward pass, as a training loop runs it (``loss.backward()`` outside the autocast
    context); a nested context, so autocast's cache is kept. A no-op outside autocast."""
    if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class _CastRecorder(TorchDispatchMode):
    """Records the copies autocast makes of float32 leaf tensors that require grad (the parameters), the ones
    its cache keeps until the autocast context exits (``cached_cast`` in ATen's ``autocast_mode.cpp``):
    ``casts`` lists ``(address of the leaf's storage, the copy)``. An explicit ``.to(dtype)`` of a parameter
    looks the same here and is counted as cached too (a conservative error)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.casts: list[tuple[int, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args and isinstance(args[0], torch.Tensor) \
                and isinstance(out, torch.Tensor):
            a = args[0]
            if (a.dtype == torch.float32 and out.dtype == self.dtype and a.requires_grad and a.is_leaf
                    and not a._is_view()):
                self.casts.append((a.untyped_storage().data_ptr(), out))
        return out


class _ExplicitCasts(TorchFunctionMode):
    """Records ``ptrs``, the storage addresses of the leaf tensors that require grad (the parameters) that the model's
    own code converts (``w.to(torch.bfloat16)``, ``.bfloat16()``, ``.half()``, ``.type(...)``, ``.type_as(x)``): each
    such call makes a copy of its own, which :class:`_CastRecorder` cannot tell from autocast's cached one;
    ``recent``, those converted since it was last cleared (by the node running now)."""

    CONVERSIONS = frozenset({"to", "type", "type_as", "bfloat16", "half", "float", "double"})

    def __init__(self):
        super().__init__()
        self.ptrs: set[int] = set()
        self.recent: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.CONVERSIONS and args and isinstance(args[0], torch.Tensor) \
                and args[0].is_leaf and args[0].requires_grad and args[0].device.type != "meta":
            self.ptrs.add(args[0].untyped_storage().data_ptr())
            self.recent.add(args[0].untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))


FASTER_KERNEL_MARGIN = 0.8  # a faster-kernel variant's time is kept below the default's only under this fraction


def _no_faster_than_default(costs: Costs) -> None:
    """Raise each variant's forward and backward times to at least PyTorch's, plus 1%; lower those of each plain
    in-place form (``inplace``, ``inplace-rhs``) to at most PyTorch's (forward: 0.99x PyTorch's).

    Every other variant calls PyTorch's own kernels and adds work (packing a mask, a second convolution
    call), so a variant measured faster than the default is timing noise. A variant that runs another of
    PyTorch's kernels (``VariantSpec.faster_kernel``: the channels-last pooling) keeps its measured times where
    they are clearly faster (forward and backward together at most :data:`FASTER_KERNEL_MARGIN` of the default's),
    so that timing noise does not flip the choice between two profiles of the same model (``memfit plan`` and
    ``memfit run`` at 100% disagreed on a ResNet-18 at 32 px, whose pooling is 1.15x slower through channels-last). Left as measured, the solver would
    pick such variants where memory does not need them (seen: split convolutions chosen at 15 nodes of
    MobileNet-V2 with no memory to save, 10-30% slower in the measured step on a busy machine); the 1%
    also breaks ties towards PyTorch's implementation.

    A plain in-place form is the reverse: the same kernel writing into its operand, without allocating its
    result (on the CPU a fresh 8 MiB result costs page faults as well: an out-of-place addition of two
    ``8 x 256 x 32 x 32`` tensors took 5.8 ms into fresh memory, 1.6 ms into recycled memory and 0.8 ms in
    place). Measured slower, it is noise; the 1% breaks ties towards it, as PyTorch code written in place
    by hand (``out += identity``, which ``torch.fx`` traces as ``out + identity``) would run."""
    from memfit.variants import VARIANTS

    for c in costs.nodes:
        for name, v in c.variants.items():
            if (name in VARIANTS and VARIANTS[name].faster_kernel
                    and v.fwd_seconds + v.bwd_seconds <= FASTER_KERNEL_MARGIN * (c.fwd_seconds + c.bwd_seconds)):
                continue  # (another kernel of PyTorch's, clearly faster: kept as measured)
            if name in PLAIN_INPLACE:
                v.fwd_seconds = min(v.fwd_seconds, 0.99 * c.fwd_seconds)
                v.bwd_seconds = min(v.bwd_seconds, c.bwd_seconds)
                continue
            v.fwd_seconds = max(v.fwd_seconds, 1.01 * c.fwd_seconds)
            v.bwd_seconds = max(v.bwd_seconds, 1.01 * c.bwd_seconds)


def _reached(gm: fx.GraphModule, requires: dict[str, list[bool]]) -> set[str]:
    """The nodes a gradient from the model's outputs can reach: back from the outputs through values that require
    grad (not through ``h.detach()``, whose value needs none)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    todo, seen = list(out.all_input_nodes), set()
    while todo:
        k = todo.pop()
        flags = requires.get(k.name)
        if k.name in seen or (flags is not None and not any(flags)):
            continue
        seen.add(k.name)
        todo += k.all_input_nodes
    return seen


def _param_grads(gm: fx.GraphModule, costs: Costs, no_grad: set[int] = frozenset(),
                 reached: set[str] | None = None, existing: set[int] | None = None) -> None:
    """Assign each trainable parameter's gradient bytes to the last node in forward order that uses it: its
    gradient exists from that node's backward on. A parameter used by several nodes (a layer called twice,
    tied weights) has its gradient summed from the first contribution on, in autograd's buffer for it,
    not only once its last contribution arrives (an MLP calling one Linear four times measured 1 MiB, that
    weight's gradient, over its replay before this); each further contribution is summed into that buffer
    (``param_sum_bytes``; in place unless the buffer holds a view, ``param_sum_inplace_bytes``), and the buffer
    is held from the first contribution to the last
    (``param_buffer_bytes`` / ``param_buffer_end_bytes``). Only nodes a gradient reaches (``reached``, node names;
    all when ``None``) count as users: a second call of an encoder whose output is ``.detach()``ed (MoCo's key
    branch) got its parameters' gradients, 465,152 B, counted from the start of the backward pass.

    ``existing``: data pointers of the parameters whose ``.grad`` exists when the model's backward starts (all of
    them with ``Costs.grads_exist``; else those an L2 penalty in the loss gave one; ``None``: all). Only those
    parameters get autograd's buffer (``param_buffer_bytes``), added into ``.grad`` when the last contribution
    arrives; where ``.grad`` does not exist, the buffer becomes it (``param_grad_bytes``). With
    ``Costs.grads_exist``, ``param_grad_bytes`` still names every parameter's gradient."""
    uses: dict[int, list[int]] = {}  # parameter id -> nodes using it, in backward order
    sizes: dict[int, int] = {}
    ptrs: dict[int, int] = {}
    nodes = list(zip(compute_nodes(gm), costs.nodes))
    index = {node.name: k for k, (node, _) in enumerate(nodes)}
    for k in range(len(nodes) - 1, -1, -1):
        node = nodes[k][0]
        if reached is not None and node.op != "get_attr" and node.name not in reached:
            continue
        params = _params_read(gm, node)
        if node.op == "get_attr":
            # its readers' backward passes make the contributions (each reader's workspace holds its own): a
            # positional embedding added twice had its first contribution held in no account until the second
            users = sorted({index[u.name] for u in node.users if u.name in index
                            and (reached is None or u.name in reached)}, reverse=True) or [k]
        else:
            users = [k] if params else []
        for p in params:
            for u in users:
                if p.requires_grad and id(p) not in no_grad and u not in uses.setdefault(id(p), []):
                    uses[id(p)].append(u)
                    sizes[id(p)] = p.untyped_storage().nbytes()
                    ptrs[id(p)] = p.untyped_storage().data_ptr()
    names = _param_names(gm)
    casts = {st.param: st for st in costs.storages if st.kind == "cast" and st.param is not None}
    for pid, ks in uses.items():
        ks.sort(reverse=True)
        b = sizes[pid]
        exists = costs.grads_exist or existing is None or ptrs[pid] in existing
        # under autocast, a parameter every user reads through one cast has its contributions summed in the cast's
        # dtype, and its own gradient made from the sum after the first user's backward (a Linear called twice
        # under bfloat16 was predicted one bfloat16 copy of its weight, 10%, over its measured peak when the sum
        # was counted in float32 from the last call on)
        cast = casts.get(names.get(pid))
        group = [k for k in ks if cast is not None and cast.id in nodes[k][1].casts]
        if 1 < len(group) < len(ks):
            # readers of autocast's cached copy beside readers of the parameter itself (the forward's own
            # `w.to(torch.bfloat16)` per call): the copy's readers sum their contributions in its dtype, in the buffer
            # of its backward, held from the first of them to the last, whose backward then makes one float32
            # contribution. Their sums are counted as where every reader reads the copy (below), the buffer as one of
            # its own. A Linear read both ways measured one bfloat16 copy of its weight, 7%, over its `min` budget
            # when every reader was counted as a float32 contribution.
            nodes[group[0]][1].param_buffer_bytes += cast.nbytes
            nodes[group[-1]][1].param_buffer_end_bytes += cast.nbytes
            _count_sums(names.get(pid), b, [nodes[k][1] for k in group])
            ks = [k for k in ks if k not in group[:-1]]
        summed = b
        if len(ks) > 1 and cast is not None and all(cast.id in nodes[k][1].casts for k in ks):
            summed = cast.nbytes
            if not costs.grads_exist and not exists:
                nodes[ks[-1]][1].param_grad_upcast_bytes += b - summed
        # (a first contribution in a smaller storage, `w.sum()`'s expanded scalar, is autograd's buffer until the
        # second is summed with it into a tensor of the parameter's size: counted whole from the first, a weight read
        # by `w.sum()` and its layer was predicted one weight, 14.5%, above its measured peak)
        small = nodes[ks[0]][1].param_grad_storage_bytes.get(names.get(pid))
        if not costs.grads_exist and not exists and small is not None and len(ks) > 1 and summed == b:
            nodes[ks[0]][1].param_grad_bytes += small
            nodes[ks[1]][1].param_grad_bytes += b - small
        elif costs.grads_exist or not exists:
            nodes[ks[0]][1].param_grad_bytes += summed if not costs.grads_exist else b
        if len(ks) > 1 and exists:
            nodes[ks[0]][1].param_buffer_bytes += summed
            nodes[ks[-1]][1].param_buffer_end_bytes += summed
        # (where the first user returns the parameter itself, `F.linear(h, self.emb.weight.float())`, its reader's
        # backward makes that contribution: a view for a linear's weight; a float32 tied LM's floor measured the
        # out-of-place sum, an embedding-sized 4% over its budget, when it was counted in place)
        first, first_cost = nodes[ks[0]]
        _count_sums(names.get(pid), b, [c for _, c in (nodes[k] for k in ks)], first_cost.returns_param and any(
            first.name in nodes[index[u.name]][1].grad_views for u in first.users if u.name in index))


def _count_sums(name: str | None, nbytes: int, users: list[NodeCost], first_view: bool = False) -> None:
    """``param_sum_bytes`` of the users of parameter ``name`` (``nbytes``), in backward order: each contribution
    after the first is summed into autograd's buffer. The first contribution is that buffer: a view (a Linear's
    transposed weight gradient; ``first_view``, or in the first user's ``param_grad_views``) makes the first sum a
    new tensor, into which the later ones are added in place."""
    first_view = first_view or name in users[0].param_grad_views
    for j, cost in enumerate(users[1:]):
        cost.param_sum_bytes += nbytes
        if j > 0 or not first_view:
            cost.param_sum_inplace_bytes += nbytes
        else:
            cost.param_sum_largest_bytes = max(cost.param_sum_largest_bytes, nbytes)


def _param_names(gm: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` for every parameter of ``gm`` (a tied one by its first name)."""
    out: dict[int, str] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), name)
    return out


def _attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _describe(value) -> str:
    """``value`` in a line: a tensor as ``float32[4, 1, 16, 16]``, containers element by element."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in value.items()) + "}"
    return type(value).__name__


def _where(gm: fx.GraphModule, node: fx.Node) -> str:
    """``node`` as a message names it: ``module 'layer1.0' (Bottleneck)`` or ``[method ]name()``."""
    if node.op == "call_module":
        return f"module {node.target!r} ({type(gm.get_submodule(node.target)).__name__})"
    line = node.meta.get(WRITE_LINE)  # an in-place write: the user's line says more than assign_into()
    return f"{'method ' if node.op == 'call_method' else ''}{call_name(node)}(){f' at {line}' if line else ''}"


def _failed_on_inputs(gm: fx.GraphModule, node: fx.Node, inputs: tuple, exc: Exception) -> str:
    """The message for a model whose forward pass fails on ``example_inputs``: where (module path and type,
    or function) and what it was given, PyTorch's own error, and what to change."""
    where = _where(gm, node)
    call = "model(*example_inputs)"
    whole = ""
    if len(inputs) == 1 and isinstance(inputs[0], dict):  # a dict none of whose keys names an argument
        names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        call = "model(example_inputs)"
        whole = (f" example_inputs is a dict none of whose keys ({', '.join(repr(k) for k in inputs[0])}) names an "
                 f"argument of the forward ({', '.join(names)}), so it was passed whole, as the forward's one "
                 "input: to pass its entries as the forward's arguments, give them the forward's names.")
    return (f"the model's forward pass fails on example_inputs {_describe(inputs)} at {where} (fx node "
            f"{node.name}): {type(exc).__name__}: {exc}.{whole} Give memfit a batch the model trains on (its "
            f"shapes, dtypes and device). If {call} runs without memfit, this is a memfit bug: please report it.")


def _alone_failed(gm: fx.GraphModule, node: fx.Node, exc: Exception) -> str:
    """The message for a node that runs in the model's forward pass but fails run on its own, on detached
    copies of its inputs (how memfit times it and how a recomputation would run it): it needs the autograd graph
    of the operations before it (``torch.autograd.grad(u, x)`` in forward, a physics-informed network's
    derivative: a fresh user got PyTorch's bare "appears to not have been used in the graph")."""
    where = _where(gm, node)
    return (f"memfit cannot plan the model: {where} (fx node {node.name}) runs in the forward pass but fails run on "
            f"its own inputs, detached ({type(exc).__name__}: {exc}). memfit profiles and recomputes each operation "
            "apart from the ones before it, so an operation that differentiates through them (torch.autograd.grad "
            "of an earlier value in forward) cannot be planned. Compute it outside the planned module: in loss_fn, "
            "which receives the model's output, or plan only the network it differentiates "
            "(memfit.optimize(model.net, ...)) and call torch.autograd.grad on the planned network's output.")


def _call_loss(loss_fn: Callable, out: Any) -> torch.Tensor:
    """``loss_fn(out)``, checked: a failure or a result that is not a one-element tensor becomes a ``ValueError``
    that names ``loss_fn`` and what it was given (fresh users got PyTorch's bare "Expected input batch_size (8) to
    match target batch_size (3)" and "grad can be implicitly created only for scalar outputs")."""
    usage = ("loss_fn is called as loss_fn(output) on the model's output for example_inputs and must return the "
             "training loss as a one-element tensor, with this batch's targets bound, e.g. "
             "loss_fn=lambda out: F.cross_entropy(out, y)")
    try:
        loss = loss_fn(out)
    except Exception as exc:
        raise ValueError(f"loss_fn failed on the model's output {_describe(out)} "
                         f"({type(exc).__name__}: {exc}). {usage}") from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn returned {got}. {usage}")
    return loss


def _structure(gm: fx.GraphModule, inputs: tuple, fixed_ptrs: set[int], with_variants: bool = True,
               cast_dtype: torch.dtype | None = None, requires: dict[str, list[bool]] | None = None,
               snapshot: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Costs:
    """One forward pass, node by node, holding every value: storages, outputs and saved tensors per node.

    ``requires`` (filled in when given): for each placeholder, node and the output node (by name), whether each
    tensor of its value (in :func:`tensors_in` order) requires grad in this pass, which runs as the model's
    own forward does. ``snapshot`` (appended to when given): ``(parameter, its value before)`` for each
    parameter a node modified in place, copied before the node ran.

    With ``cast_dtype`` (under autocast, its cache on), autocast's cache is cleared before each node, so that
    every node's casts of parameters are seen (:class:`_CastRecorder`); all casts of one parameter are one
    storage of kind ``"cast"``, made by its first reader, as autocast's cache shares it in a real step."""
    keep_alive: list = []
    try:
        return _structure_pass(gm, inputs, fixed_ptrs, with_variants, cast_dtype, requires, snapshot, keep_alive)
    finally:
        _break_cycles(keep_alive)


class _SaveOrder(TorchDispatchMode):
    """Places a node's saved tensors among the operators its forward runs: ``made`` maps the address of each
    storage an operator allocates (a result that is no view of, or in-place write to, an argument) to the
    operator's position, and ``last_save`` is the number of operators run when autograd last saved a tensor
    (:func:`_recording` sets it). Autograd saves a built-in operation's inputs before the operation runs below
    it, and its outputs after, so a storage made at a position ``>= last_save`` is made after the last save."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.made: dict[int, int] = {}
        self.last_save = -1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for k, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            aliased = k < len(returns) and returns[k].alias_info is not None
            if isinstance(t, torch.Tensor) and not aliased and t.device.type != "meta" and t.layout == torch.strided:
                self.made[t.untyped_storage().data_ptr()] = self.ops  # (a sparse one is refused: see register)
        self.ops += 1
        return out


def _recording(saved: list[torch.Tensor], order: _SaveOrder | None = None, direct: set[int] = frozenset()):
    """Saved-tensor hooks that append each tensor autograd saves to ``saved`` (and mark the save in ``order``,
    unless the tensor's storage pointer is in ``direct``: the parameters and inputs a checkpoint region holds
    without its hooks, :mod:`memfit.runtime.direct_saves`, so its recomputation stops at the last other save).
    The hook hands autograd a detached alias: handing it the tensor itself makes a cycle through autograd's C++
    graph, which Python's garbage collector cannot see, for every tensor its own node saves (a ReLU's output)."""

    def pack(t):
        saved.append(t)
        if order is not None and not (direct and t.untyped_storage().data_ptr() in direct):
            order.last_save = order.ops
        return t.detach()

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _break_cycles(keep_alive: list) -> None:
    """Empty the lists of saved tensors in ``keep_alive``: each is held by the saved-tensor hook of the graph its
    tensors belong to (through autograd's C++ graph), a cycle Python's garbage collector cannot see, which kept
    every activation of the profiled forward pass, the example inputs and the model alive to the end of the
    process (found by a fresh user: one batch per memfit.optimize call)."""
    for item in keep_alive:
        for part in item if isinstance(item, tuple) else (item,):
            if isinstance(part, list):
                part.clear()


def _structure_pass(gm: fx.GraphModule, inputs: tuple, fixed_ptrs: set[int], with_variants: bool,
                    cast_dtype: torch.dtype | None, requires: dict[str, list[bool]] | None,
                    snapshot: list[tuple[torch.Tensor, torch.Tensor]] | None, keep_alive: list) -> Costs:
    """:func:`_structure`'s pass; what must stay alive to its end goes in ``keep_alive``."""
    storages: list[Storage] = []
    by_ptr: dict[int, int] = {}
    env: dict[str, object] = {}
    cast_of: dict[int, int] = {}  # storage address of a parameter -> storage id of its autocast cast
    explicit = _ExplicitCasts()
    own_copies: set[int] = set()  # parameters a leaf module's own code converts (not the graph's nodes)

    def register(t: torch.Tensor, producer, kind) -> int | None:
        if t.device.type == "meta":
            return None
        if t.layout != torch.strided:  # (the inputs, parameters and buffers were checked: memfit.api)
            raise ValueError(f"the forward pass makes a {str(t.layout).removeprefix('torch.')} tensor (fx node "
                             f"{producer}): {SPARSE_ADVICE}")
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr in fixed_ptrs or s.nbytes() == 0:
            return None
        if ptr not in by_ptr:
            by_ptr[ptr] = len(storages)
            storages.append(Storage(id=len(storages), nbytes=s.nbytes(), producer=producer, kind=kind,
                                    requires_grad=t.requires_grad))
        return by_ptr[ptr]

    requires = {} if requires is None else requires
    env.update(bind_inputs(gm, inputs))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    defaulted = {ph.name: ph for ph in placeholders[len(inputs):]}  # arguments left out: their defaults
    # arguments given as None (a dict's key left out before one given takes its default, often None): the same
    # trap as a default, `if labels is not None:` traced as taken
    given_none = {ph.name: ph for ph, value in zip(placeholders, inputs) if value is None}
    from_default = {name: [name] for name in (*defaulted, *given_none)}  # value -> the arguments it depends on
    for ph in placeholders:
        requires[ph.name] = [t.requires_grad for t in tensors_in(env[ph.name])]
        for t in tensors_in(env[ph.name]):
            register(t, None, "input")
    param_ids = {id(p) for p in gm.parameters()}
    direct = {t.untyped_storage().data_ptr() for t in [*gm.parameters(), *tensors_in(inputs)]
              if isinstance(t, torch.Tensor) and t.device.type != "meta"}
    # (by storage: a write through `.data` reaches a parameter by an alias with a version counter of its own)
    param_ptrs = {p.untyped_storage().data_ptr() for p in gm.parameters() if p.device.type != "meta"}
    kept_params = {t.untyped_storage().data_ptr() for t, _ in snapshot or ()}
    nodes: list[NodeCost] = []
    finder = FindWrites(buffer_storages(gm))
    reach: list[set[tuple]] = []  # per node: storage keys of the buffers a region holding it copies
    shared = _readers_under_autocast(gm) if with_variants else {}
    for node in compute_nodes(gm):
        cost = NodeCost(name=node.name)
        saved: list[torch.Tensor] = []
        ins = [t for a in node.all_input_nodes for t in tensors_in(env[a.name])]
        versions = [t._version for t in ins]
        stop_fns = [t.grad_fn for t in ins]  # (before it runs: an in-place node replaces its input's)
        # parameters the node could modify in place (a frozen one updated like a buffer): copied before it runs,
        # the copy kept only when the node did modify it (buffers are all copied before profiling)
        touched = list(dict.fromkeys([t for t in ins if id(t) in param_ids or (
            t.device.type != "meta" and t.untyped_storage().data_ptr() in param_ptrs)] + (
            list(gm.get_submodule(node.target).parameters()) if node.op == "call_module" else [])))
        versions_before = [t._version for t in touched]
        before = [(p, p._version, p.detach().clone()) for p in touched
                  if snapshot is not None and p.untyped_storage().data_ptr() not in kept_params]
        recorder = _CastRecorder(cast_dtype) if cast_dtype is not None else None
        if recorder is not None:
            torch.clear_autocast_cache()
        explicit.recent.clear()
        try:
            order = _SaveOrder()
            with recorder or contextlib.nullcontext(), explicit if recorder else contextlib.nullcontext(), finder, \
                    _recording(saved, order, direct), order:
                out = node_fn(gm, node)(env)
        except Exception as exc:
            args = list(dict.fromkeys(d for a in node.all_input_nodes for d in from_default.get(a.name, [])))
            if not args:
                if is_out_of_memory(exc):
                    raise
                raise ValueError(_failed_on_inputs(gm, node, inputs, exc)) from exc
            # a default of None is the likelier culprit (`if mask is not None:` traced as true) than a number
            culprit = min(args, key=lambda d: d not in given_none and defaulted[d].args[0] is not None)
            if culprit in given_none:
                name = given_none[culprit].target  # (the argument's own name; fx may rename the node)
                raise ValueError(
                    f"the model's forward argument {name!r} is None in example_inputs (given as None, or a dict's "
                    f"key left out before a later one given, which takes its default), and the traced forward "
                    f"fails with it at node {node.name} ({type(exc).__name__}: {exc}): torch.fx traced the forward "
                    f"with {name!r} given (a test such as `if {name} is not None:` was taken as true), so the graph "
                    f"needs it. Pass a value for {name!r}, or leave out the later keys too, or plan a wrapper that "
                    "does not take it") from exc
            ph = defaulted[culprit]
            if ph.meta.get("memfit_kind") == "KEYWORD_ONLY":  # (example_inputs are positional)
                raise ValueError(
                    f"the model's forward argument {ph.target!r} is keyword-only and not in example_inputs, so it "
                    f"takes its default {ph.args[0]!r}, but the traced forward fails with that "
                    f"value at node {node.name} ({type(exc).__name__}: {exc}): torch.fx traced the forward with "
                    f"{ph.target!r} given (`if {ph.target} is not None:` was taken as true), so the graph "
                    f"needs it: give it by name, in example_inputs as a dict of the forward's arguments "
                    f"({{..., {ph.target!r}: ...}}) and to the planned module by keyword (planned(..., "
                    f"{ph.target}=...)), or write the forward without that test") from exc
            raise ValueError(
                f"the model's forward argument {ph.target!r} is not in example_inputs, so it takes its default "
                f"{ph.args[0]!r}, but the traced forward fails with that value at node {node.name} "
                f"({type(exc).__name__}: {exc}). torch.fx traced the forward with {ph.target!r} given (a test "
                f"such as `if {ph.target} is not None:` was taken as true), so the graph needs it: pass "
                f"{ph.target!r} in example_inputs (and to the planned module), or write the forward without "
                "that argument") from exc
        finally:
            for p, version, copy in before:
                if p._version != version:
                    snapshot.append((p, copy))
                    kept_params.add(p.untyped_storage().data_ptr())
            # (a recomputation would write it again: a momentum update of a frozen target network twice a step)
            cost.recomputable = all(t._version == v for t, v in zip(touched, versions_before))
            del before
        if node.op == "call_module":  # (kept by the module, like a parameter: not this step's activation)
            fixed_ptrs.update(t.untyped_storage().data_ptr() for t in module_held(gm.get_submodule(node.target)))
        depends = list(dict.fromkeys(d for a in node.all_input_nodes for d in from_default.get(a.name, [])))
        if depends:
            from_default[node.name] = depends
        check_out_of_place(node, env, out)  # (`h += t` traced out of place: PyTorch's shape and dtype kept?)
        env[node.name] = out
        requires[node.name] = [t.requires_grad for t in tensors_in(out)]
        saved += _saved_scalars(tensors_in(out), stop_fns) + _scalars_behind_copy_slices(gm, node, env, ins, versions)
        keep_alive.append(saved)
        reach.append({storage_key(mod._buffers[name]) for mod, name in reachable_slots(gm, node)
                      if mod._buffers[name] is not None} | {storage_key(t) for t in ins})

        def created(t, kind, node=node, cost=cost):
            """``register`` for this node; a storage seen for the first time is one it creates."""
            n_before = len(storages)
            sid = register(t, node.name, kind)
            if sid is not None and len(storages) > n_before:
                cost.creates.append(sid)
            return sid
        returned = {x.untyped_storage().data_ptr() for x in tensors_in(out) if isinstance(x, torch.Tensor)
                    and x.layout == torch.strided and x.device.type != "meta"} if recorder is not None else set()
        for src, t in recorder.casts if recorder is not None else ():
            keep_alive.append(t)  # every address registered stays taken
            if src in explicit.ptrs and t.untyped_storage().data_ptr() in returned:
                continue  # (the node's output, `w.to(torch.bfloat16)`: a copy of its own, not the cache's)
            if src in explicit.recent:  # (a module's own code converting its weight: a copy per call too)
                own_copies.add(src)
            sid = cast_of.get(src)
            if sid is None:
                sid = created(t, "cast")
                if sid is None:
                    continue
                cast_of[src] = sid
            else:  # a later reader: in a real step, autocast's cache hands it the first reader's copy
                by_ptr[t.untyped_storage().data_ptr()] = sid
            if sid not in cost.casts:
                cost.casts.append(sid)
        for t, v in zip(ins, versions):
            if t._version != v:
                sid = register(t, None, "input")
                if sid is not None and sid not in cost.mutates:
                    cost.mutates.append(sid)
        for t in tensors_in(out):
            sid = created(t, "output")
            if sid is None:
                # a view of a parameter (`self.w.unsqueeze(1)` in a broadcast matmul): its reader's backward makes a
                # gradient for it that lives until the view's backward (a fresh user's 1 MiB was missed); the
                # parameter read itself (get_attr) is its readers' workspace
                # (and so is the parameter itself, returned by a conversion that copies nothing, `w.float()` of a
                # float32 weight: its readers' contributions are made before they are summed into its gradient; a fresh
                # user's `(w.float() ** 2).mean()` went 6% over a `100%` budget without it)
                if node.op != "get_attr" and isinstance(t, torch.Tensor) and t.requires_grad and _differentiable(t) \
                        and (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
                    cost.grad_bytes += t.numel() * t.element_size()
                    cost.returns_param |= isinstance(t, nn.Parameter)
                continue
            cost.outputs.append(sid)
            cost.view_output |= isinstance(t, torch.Tensor) and t._base is not None
            # views included (nn.Identity, flatten): the reader's backward makes a full gradient for the view,
            # which the view's backward then passes on to its input (an MLP with an nn.Identity measured 1 MiB
            # over its replay when views counted 0 here)
            if t.requires_grad and _differentiable(t):
                cost.grad_bytes += t.numel() * t.element_size()
            storages[sid].requires_grad |= t.requires_grad
        for t in saved:
            sid = created(t, "internal")
            if sid is None:
                continue
            if sid not in cost.saves:
                cost.saves.append(sid)
        if order.last_save >= 0 and not cost.mutates:
            late = {by_ptr[ptr] for ptr, at in order.made.items() if at >= order.last_save and ptr in by_ptr}
            cost.unmade_at_stop = [sid for sid in cost.creates if sid in late and sid not in cost.saves]
        if with_variants and node.op == "call_module" and not _shares_parameters(gm, node, shared):
            _profile_variants(gm, node, env, cost, storages, by_ptr, register, keep_alive)
        if _is_rrelu(gm, node) or _generators(gm, [node]):
            cost.recomputable = False
        nodes.append(cost)
    for node, cost in zip(compute_nodes(gm), nodes):
        # a value made without a gradient and then written with one through a view of it (`out = h.new_empty(..)`,
        # `out[:, :8].copy_(h)`: the method does not rebind `out`, so later nodes read it): autograd rewrote its
        # history (CopySlices), and its readers' backward makes it a gradient (DeepSeek-V3's key assembly: 262,144 B
        # under the measured peak of a step with two such copies)
        if cost.grad_bytes == 0 and cost.mutates == [] and node.op != "get_attr":
            cost.grad_bytes = sum(t.numel() * t.element_size() for t in tensors_in(env[node.name])
                                  if t.requires_grad and _differentiable(t) and by_ptr.get(
                                      t.untyped_storage().data_ptr()) in cost.outputs)
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = tensors_in(fx.node.map_arg(output_node.args, lambda a: env[a.name]))
    requires[output_node.name] = [t.requires_grad for t in outs]
    output_ids = [by_ptr.get(t.untyped_storage().data_ptr()) for t in outs]  # (the order the loss sees)
    mutated = {sid for c in nodes for sid in c.mutates}
    for c in nodes:  # backward from the output fails if a later in-place op rewrites that output
        if "bn-from-output" in c.variants and mutated & set(c.outputs):
            del c.variants["bn-from-output"]
    if with_variants:
        _profile_inplace(gm, env, nodes, storages, by_ptr, register, keep_alive)
    # a cast autocast's cache shares names its parameter; one the model's code makes (`w.to(torch.bfloat16)`: a copy
    # per call, each with a backward of its own) does not (see _param_grads); the graph's own conversions are their
    # nodes' outputs, so a parameter they read can have autocast's copy beside them
    names = _param_names(gm)
    for p in gm.parameters():
        ptr = p.untyped_storage().data_ptr()
        if ptr in cast_of and ptr not in own_copies:
            storages[cast_of[ptr]].param = names[id(p)]
    costs = Costs(device="", storages=storages, nodes=nodes, fixed_bytes=0, output_ids=output_ids)
    _written_buffers(gm, finder, reach, costs)
    return costs


def _written_buffers(gm: fx.GraphModule, finder: FindWrites, reach: list[set[tuple]], costs: Costs) -> None:
    """Fill in ``Costs.buffer_kinds`` / ``buffer_bytes`` and each node's ``buffers`` from what ``finder`` saw
    the forward pass do (a buffer on several registrations is named by its first, in ``gm.modules()`` order)."""
    kinds = by_storage(finder.kinds())
    paths = {}
    for path, mod in gm.named_modules(remove_duplicate=False):
        paths.setdefault(id(mod), path)
    names: dict[tuple, str] = {}
    for key, slots in finder.storages.items():
        if key in kinds:
            mod, attr = slots[0]
            name = f"{paths[id(mod)]}.{attr}".lstrip(".")
            names[key] = name
            buf = mod._buffers[attr]
            costs.buffer_kinds[name] = kinds[key]
            costs.buffer_bytes[name] = buf.numel() * buf.element_size()
    for c, keys in zip(costs.nodes, reach):
        c.buffers = sorted(names[k] for k in keys if k in names)


def _cast_readers(nodes: list[NodeCost]) -> dict[int, int]:
    """Autocast cast storage id -> how many nodes read it (``NodeCost.casts``)."""
    readers: dict[int, int] = {}
    for c in nodes:
        for sid in c.casts:
            readers[sid] = readers.get(sid, 0) + 1
    return readers


def _is_rrelu(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` is a randomized leaky ReLU (``nn.RReLU``, ``F.rrelu``, ``torch.rrelu``), which a
    recomputation does not reproduce (see :class:`NodeCost`)."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), nn.RReLU)
    if node.op == "call_function":
        return getattr(node.target, "__name__", "") in ("rrelu", "rrelu_", "rrelu_with_noise", "rrelu_with_noise_")
    return node.op == "call_method" and node.target in ("rrelu", "rrelu_")


def _generators(gm: fx.GraphModule, nodes) -> list[torch.Generator]:
    """The ``torch.Generator`` objects that ``nodes`` draw from, each once: given as an argument
    (``torch.randn(shape, generator=self.gen)``), which torch.fx keeps as an attribute of ``gm`` read by a
    ``get_attr`` node (``_opaque_obj0``), or in the node itself."""
    found: dict[int, torch.Generator] = {}

    def visit(v):
        if isinstance(v, fx.Node) and v.op == "get_attr":
            try:
                v = operator.attrgetter(str(v.target))(gm)
            except AttributeError:
                return v
        if isinstance(v, torch.Generator):
            found.setdefault(id(v), v)
        return v

    for node in nodes:
        fx.node.map_aggregate((node.args, node.kwargs), visit)
    return list(found.values())


def _profile_inplace(gm, env, nodes: list[NodeCost], storages: list[Storage], by_ptr, register, keep_alive) -> None:
    """Offer the in-place forms of element-wise nodes (:mod:`memfit.variants.inplace`) where autograd and
    the graph allow them, with what they save.

    A form of node ``i`` that overwrites operand ``x`` (storage ``S``, made by node ``p``) is legal when:
    ``S`` is a storage ``p`` allocated for its output; no node but ``i`` reads any value living in ``S`` (so
    no later reader sees the overwritten value, and no view of it exists elsewhere); no other node saves
    ``S`` for backward under any implementation (autograd's version check would fail); no node modifies ``S``
    in place; ``S`` is not a model output; ``x`` covers ``S`` with the result's shape, dtype and
    strides (so later nodes see the same tensor layout); and ``x`` is not a view (autograd would rewrite its
    base's history, and copy the gradient in backward)."""
    from memfit.variants import OPERAND, inplace_forms

    fx_nodes = compute_nodes(gm)

    def sid_of(t) -> int | None:
        return by_ptr.get(t.untyped_storage().data_ptr()) if isinstance(t, torch.Tensor) else None

    readers: dict[int, set[int]] = {}
    for i, node in enumerate(fx_nodes):
        for a in node.all_input_nodes:
            for t in tensors_in(env[a.name]):
                sid = sid_of(t)
                if sid is not None:
                    readers.setdefault(sid, set()).add(i)
    savers: dict[int, set[str]] = {}  # storage -> nodes saving it under some implementation
    for c in nodes:
        for x in set(c.saves).union(*[v.saves for v in c.variants.values()]):
            savers.setdefault(x, set()).add(c.name)
    mutated = {x for c in nodes for x in c.mutates}
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    model_outputs = {sid_of(t) for a in output_node.all_input_nodes for t in tensors_in(env[a.name])}
    creators = {sid: c.name for c in nodes for sid in c.creates}
    for i, (node, cost) in enumerate(zip(fx_nodes, nodes)):
        forms = inplace_forms(gm, node)
        out = env[node.name]
        if not forms or not isinstance(out, torch.Tensor):
            continue
        t_out = sid_of(out)
        if t_out is None or t_out not in cost.creates:
            continue
        for name, fn in forms.items():
            arg = node.args[OPERAND[name]] if OPERAND[name] < len(node.args) else None
            if not isinstance(arg, fx.Node) or arg.op in ("placeholder", "get_attr") \
                    or sum(a is arg for a in node.args) != 1:  # x + x: both arguments are the operand
                continue
            if arg.op == "call_module" and has_hooks(list(gm.get_submodule(arg.target).modules())):
                continue  # its hook may keep the output (a feature loss, Grad-CAM)
            x = env[arg.name]
            s = sid_of(x)
            if s is None or storages[s].kind != "output" or creators.get(s) != arg.name:
                continue
            # the node's own default may save its operand (LeakyReLU saves its input): the form replaces it
            if readers.get(s) != {i} or savers.get(s, set()) - {node.name} or s in mutated or s in model_outputs:
                continue
            if (x.shape != out.shape or x.dtype != out.dtype or x.stride() != out.stride()
                    or x.storage_offset() != 0 or x.numel() * x.element_size() != storages[s].nbytes
                    or storages[s].nbytes != storages[t_out].nbytes or (x.requires_grad and x.grad_fn is None)
                    or x._base is not None):
                # (a view, e.g. a Linear's output on a 3-D input: written in place, autograd rewrites its base's
                # history (CopySlices), whose backward copies the whole gradient; a fresh-user run measured a
                # ReLU form there 1.3 MB over its plain PyTorch peak)
                continue
            vc = _variant_cost(node, fn, env, cost, storages, register, keep_alive, by_ptr, (arg.name,))
            vc.inplace_of = s
            cost.variants[name] = vc
            # a form that saves its result (``relu_``, ``leaky_relu_``) saves this node's output: a later form
            # must not overwrite it (with both chosen, autograd's version check fails at backward)
            for x in vc.saves:
                savers.setdefault(x, set()).add(node.name)


def _differentiable(t: torch.Tensor) -> bool:
    """Whether autograd can make a gradient for ``t``: floating point or complex (an FNO's spectral weights
    and activations; complex activations' gradients were counted 0 bytes, 12% under a 100% budget)."""
    return t.is_floating_point() or t.is_complex()


def _closure_values(loss_fn) -> list:
    """What ``loss_fn`` holds: its closure cells, the module-level names the function reads, default arguments
    and ``functools.partial`` arguments, two functions deep (functions are searched, not returned); see
    :func:`_reach`."""
    return _reach(loss_fn)[0]


def _reach(loss_fn) -> tuple[list, list]:
    """``(held, through_objects)``: what ``loss_fn`` holds (:func:`_closure_values`), and the tensors, containers and
    modules among the attributes of the plain objects it holds (a criterion object with ``__call__``, a bound
    method's object, a ``SimpleNamespace`` or dataclass of targets), two levels deep. The latter may hold anything (a
    trainer's other models): only what the loss reads of them is its (:func:`_closure_bytes`). Python modules,
    classes and optimizers are not searched."""
    import functools
    import types

    found: list = []
    via: list = []
    visited: set[int] = set()

    def attributes(obj) -> list:  # a plain object's attributes (a Python module, a class or an optimizer: none)
        if isinstance(obj, (type, types.ModuleType, torch.optim.Optimizer, torch.Tensor, nn.Module)):
            return []
        return list(getattr(obj, "__dict__", {}).values())

    def visit(obj, depth, through):
        if id(obj) in visited:
            return
        visited.add(id(obj))
        if isinstance(obj, functools.partial):
            for v in list(obj.args) + list(obj.keywords.values()) + [obj.func]:
                visit(v, depth, through)
            return
        if isinstance(getattr(obj, "__self__", None), nn.Module):  # a module's bound method (``crit.forward``)
            (via if through else found).append(obj.__self__)
        elif isinstance(obj, types.MethodType) and depth < 2:  # a bound method of a plain object: its attributes
            visit(obj.__self__, depth + 1, True)
        if callable(obj) and not isinstance(obj, (torch.Tensor, nn.Module, type)) and depth < 2:
            cells = [c.cell_contents for c in (getattr(obj, "__closure__", None) or ()) if _filled(c)]
            # module-level names the function reads (``y`` in ``lambda out: F.mse_loss(out, y)`` at top level)
            code, glob = getattr(obj, "__code__", None), getattr(obj, "__globals__", None) or {}
            names = [glob[n] for n in (code.co_names if code is not None else ()) if n in glob]
            for v in cells + list(getattr(obj, "__defaults__", None) or ()) + names:
                visit(v, depth + 1, through)
            if not isinstance(obj, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
                for v in attributes(obj):  # (a criterion object: the loss itself)
                    visit(v, depth + 1, True)
            return
        if isinstance(obj, (torch.Tensor, list, tuple, dict, nn.Module)):
            (via if through else found).append(obj)
        elif depth < 2:  # (a config object, a namespace of targets: `lambda out: F.mse_loss(out, cfg.target)`)
            for v in attributes(obj):
                visit(v, depth + 1, True)

    if loss_fn is not None:
        visit(loss_fn, 0, False)
    return found, via


def loss_held_modules(loss_fn) -> list[nn.Module]:
    """The modules ``loss_fn`` holds (in its closure, default or ``functools.partial`` arguments, the module-level
    names it reads, or ``loss_fn`` itself: a head kept in the loss, a teacher, a discriminator), each once."""
    return list({id(m): m for m in _closure_values(loss_fn) if isinstance(m, nn.Module)}.values())


def _closure_bytes(loss_fn, fixed_ptrs: set[int], inputs: tuple, held: tuple = (),
                   device: torch.device | None = None, read: set[int] = frozenset()) -> int:
    """Bytes of the tensors ``loss_fn`` holds (the targets of ``lambda out: F.cross_entropy(out, labels)``, and the
    parameters and buffers of the modules it calls: a head, a teacher, a discriminator) and of ``held``: they are
    alive for the whole step, like the inputs (:func:`_closure_values`); of those it reaches through plain objects
    (:func:`_reach`), the ones whose storage it reads (``read``, data pointers: a criterion object's target, not a
    trainer's other model; both were left out, 2.24x a budget). The model's parameters and buffers and the inputs are
    not counted again, nor is a storage twice, nor one on another device type than ``device`` (a dataset's CPU
    tensors a CUDA step's loss reads)."""
    seen = set(fixed_ptrs) | {t.untyped_storage().data_ptr() for t in tensors_in(inputs)}
    total = 0
    found, via = _reach(loss_fn)
    for obj, through in [*((o, False) for o in [*found, *held]), *((o, True) for o in via)]:
        if isinstance(obj, nn.Module):  # (and tensors kept as plain attributes: a style loss's ``self.target``)
            obj = [*obj.parameters(), *obj.buffers(),
                   *(v for m in obj.modules() for v in vars(m).values() if isinstance(v, torch.Tensor))]
        for t in tensors_in(obj):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen and t.device.type != "meta" and (device is None or t.device.type == device.type) \
                    and (not through or ptr in read):
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
    return total


class _Reads(TorchDispatchMode):
    """Records the data pointers of the storages every ATen operation reads (its tensor arguments)."""

    def __init__(self):
        super().__init__()
        self.ptrs: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tensors_in((args, kwargs or {})):
            if t.device.type != "meta":
                self.ptrs.add(t.untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))


def _filled(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell (a variable not yet assigned)
        return False
    return True


def _measure_loss(gm: fx.GraphModule, inputs: tuple, loss_fn, device: torch.device,
                  requires: dict[str, list[bool]] | None = None, kept_grads: tuple = (), free_outputs: bool = False
                  ) -> tuple[int, int, int, list[int], list[int], int, list[int], set[int], int | None]:
    """``(loss_bytes, loss_held_bytes, loss_forward_bytes, kept, graded, param_grads, param_ptrs, read, is_output)``
    (see :class:`Costs`; ``read``: the data pointers of the storages the loss's forward reads; ``is_output``: the
    position of the output whose storage the loss value is, ``None`` for none;
    ``param_grads``: bytes of the gradients the loss's backward gives parameters outside the model, a head or a
    discriminator the loss calls, which the step keeps as ``.grad``): transient bytes of
    ``loss_fn`` forward and backward on the model's output, beyond the output's gradient (which the replay
    counts as an activation gradient); the bytes the loss value's own storage keeps; the peak of the loss's
    forward alone, while the outputs are alive and their gradients are not; and the positions (in
    :func:`tensors_in` order) of the outputs the loss saves for its backward (``Costs.loss_keeps``; they were
    added to ``loss_bytes`` before, which counted them twice where a node of the model saves them too: the
    replay of a model returning its ReLU outputs was 22% above the measured peak); and the positions of the
    outputs the loss's backward gives a gradient (``Costs.loss_grads``). Where it trains parameters of
    ``kept_grads``, the transient is the larger of the backward making their gradients and adding into existing
    ones (:func:`_loss_adding_into_grads`).

    Outputs that require grad in the model's forward (``requires``, by the output node's name; without it,
    floating ones) stand in as leaves requiring grad; the others (an ``argmax``, a detached tensor, an input
    passed through) as they are. The backward computes the gradients of those leaves only
    (``torch.autograd.grad``), and those of the leaves outside the model the loss reaches (a head's weight):
    a loss that reads the model's parameters adds nothing to their ``.grad``."""
    model_out = _value(lambda _: gm(*inputs), {})
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    values = tensors_in(model_out)
    flags = (requires or {}).get(output_node.name)
    if flags is None or len(flags) != len(values):
        flags = [_differentiable(t) for t in values]
    fixed = {t.untyped_storage().data_ptr() for t in [*tensors_in(inputs), *gm.parameters(), *gm.buffers()]}
    # outputs with a dense storage of their own stand in as copies that only what the loss saves holds, made inside
    # the tracker: the loss's backward frees each once its saver has run, as in a step, where the loop has dropped
    # the output (a loss reading two attention maps freed the first before the second's backward peaked: 2 MiB
    # over-predicted); their gradients are kept, as autograd keeps them for the model's backward
    loose = _loose_outputs(values, flags, fixed) if free_outputs else set()
    sink: dict[int, torch.Tensor] = {}
    anchor = torch.zeros((), device=device, requires_grad=True) if loose else None
    stand_ins = [t.detach().requires_grad_(True) if f and k not in loose else t
                 for k, (t, f) in enumerate(zip(values, flags))]
    leaves = [t for k, (t, f) in enumerate(zip(stand_ins, flags)) if f and k not in loose]
    kept: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in out_storages:
            kept[ptr] = out_storages[ptr]
        return t.detach()  # (not t itself: a saved output would hold its own graph, see _recording)

    out_storages: dict[int, int] = {}  # storage's data pointer -> bytes

    # one tracker for the loss's forward and backward on the CPU, where a tracker does not subtract the frees of
    # blocks allocated before it: a backward tracked apart kept what the loss's forward saved for it (a GAN
    # generator's loss running its discriminator was predicted 1.06-1.17x the measured peak)
    cpu = device.type != "cuda"
    with MemoryTracker(device) if cpu else contextlib.nullcontext() as tracker:
        for k in loose:
            stand_ins[k] = _StandIn.apply(anchor, values[k].detach(), sink, k)
        copies = sum(stand_ins[k].untyped_storage().nbytes() for k in loose)  # (allocated first, in the tracker)
        ptr_of = [t.untyped_storage().data_ptr() for t in stand_ins]
        out_storages.update({p: t.untyped_storage().nbytes() for p, t in zip(ptr_of, stand_ins) if p not in fixed})
        it = iter(stand_ins)
        out = map_tensors(lambda v: next(it), model_out)
        reads = _Reads()
        with (tracker.mark("loss:f") if cpu else MemoryTracker(device)) as forward, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), reads:
            loss = _call_loss(loss_fn, out)
        del out, it
        for k in loose:  # held by what the loss saved alone from here on (the others stay: the step frees them
            if ptr_of[k] in kept:  # once the loss has read them, which the replay counts before the loss's backward)
                stand_ins[k] = None
        if (leaves or loose) and not loss.requires_grad:
            raise ValueError("loss_fn returned a loss that does not require grad, though the model's output does (a "
                             "`.detach()`, a `torch.no_grad()` or a tensor made from `.item()` inside loss_fn): its "
                             "backward pass would compute nothing (PyTorch's loss.backward() raises 'element 0 of "
                             "tensors does not require grad'). Return the loss computed from the output.")
        # leaves outside the model that the loss reaches (the stand-ins stop the walk at the model's outputs)
        own = {id(t) for t in [*stand_ins, *gm.parameters()]}
        reached = [t for t in _loss_leaves(loss) if not any(t is s for s in stand_ins) and t is not anchor]
        outside = [t for t in reached if id(t) not in own]
        # (the model's own parameters the loss reads, an L2 penalty: their gradients are fixed bytes, the scalars
        # and temporaries of computing them are the loss's)
        inside = [t for t in reached if id(t) in own]
        with tracker.mark("loss:b") if cpu else MemoryTracker(device) as backward:
            grads_of: tuple = ()
            anchors = [anchor] if loose else []
            if (leaves or anchors or outside or inside) and loss.requires_grad:
                with _no_autocast(device):
                    grads_of = torch.autograd.grad(loss, leaves + outside + inside + anchors, allow_unused=True)
                grads_of = grads_of[:len(grads_of) - len(anchors)]
            # (a loss that is an output, or a view of one, ``loss_fn=lambda out: out``: the loop holds that
            # output's storage to the end of the step, so it is kept through the loss's backward and held after;
            # counted as freed once the loss had read it, a model returning its own loss measured 4 B over a 100%
            # budget)
            ptr = loss.untyped_storage().data_ptr()
            is_output = ptr_of.index(ptr) if ptr in out_storages else None
            if ptr in out_storages:
                kept[ptr] = out_storages[ptr]
            held = loss.untyped_storage().nbytes()
            # ``loss.backward()`` seeds the backward pass with ``torch.ones_like(loss)``, which it holds until the
            # whole backward pass is done (counted here through the optimizer step too: a few bytes over)
            if loss.requires_grad:
                held += loss.numel() * loss.element_size()
            del loss
    if cpu:  # (the loose copies were allocated in the tracker before the loss ran: the step's outputs already)
        forward_peak, during = tracker.range_peak("loss:f")[0], tracker.peak_bytes - copies
    else:
        forward_peak = forward.peak_bytes
        during = max(forward.peak_bytes, forward.net_bytes + backward.peak_bytes)
    # the outputs' gradients (activation gradients to the replay) by position
    out_grads = dict(zip([k for k, f in enumerate(flags) if f and k not in loose], grads_of[:len(leaves)]))
    out_grads.update({k: sink.get(k) for k in loose})
    # (the outputs' gradients are activation gradients to the replay, the others' fixed bytes: neither transient)
    # (each storage once: the gradients of outputs a loss concatenated, torch.cat(out) or torch.stack, are views of
    # the concatenation's one gradient; counted per output, a SimCLR-style loss was predicted a concatenation short)
    grads = sum({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                 for g in [*out_grads.values(), *grads_of[len(leaves):]] if g is not None}.values())
    param_grads = sum(g.untyped_storage().nbytes() for g in grads_of[len(leaves):len(leaves) + len(outside)]
                      if g is not None)
    transient = during - grads
    may_exist = {id(t) for t in kept_grads}
    graded_outside = [t for t, g in zip(outside, grads_of[len(leaves):len(leaves) + len(outside)])
                      if g is not None and id(t) in may_exist]
    if graded_outside:
        fresh = [t.detach().requires_grad_(True) if f else t for t, f in zip(values, flags)]
        it = iter(fresh)
        transient = max(transient, _loss_adding_into_grads(
            map_tensors(lambda v: next(it), model_out), loss_fn, device,
            [t for t, f in zip(fresh, flags) if f] + inside, graded_outside))
    positions = [k for k, p in enumerate(ptr_of) if p in kept]
    graded = sorted(k for k, g in out_grads.items() if g is not None)
    return (max(0, transient), held, forward_peak, positions, graded, param_grads,
            sorted({t.untyped_storage().data_ptr() for t in reached}), reads.ptrs, is_output)


def _loss_adding_into_grads(out: Any, loss_fn, device: torch.device, made: list[torch.Tensor],
                            added: list[torch.Tensor]) -> int:
    """Transient bytes of ``loss_fn(out)``'s forward and backward where the leaves ``added`` (parameters outside the
    model that the loss trains: a discriminator's) have a ``.grad`` already, which the backward adds into: a
    temporary gradient per parameter. The gradients of ``made`` (the stand-ins of the model's outputs, the model's
    own parameters the loss reads) are made new and not counted, as in :func:`_measure_loss`. A GAN loop that zeroes
    only the generator's gradients (PyTorch's DCGAN example) keeps the discriminator's from its own step: measured
    138,624 B (0.9%) over a ``100%`` budget profiled without them. Every ``.grad`` is put back after."""
    leaves = made + added
    before = [t.grad for t in leaves]
    for t in made:
        t.grad = None
    for t in added:
        t.grad = torch.zeros_like(t)  # (allocated before the tracker: the loop's gradients, fixed bytes)
    try:
        with MemoryTracker(device) as tracker:
            loss = _call_loss(loss_fn, out)
            with _no_autocast(device):  # (backward(inputs=...): autograd.grad never adds into a .grad)
                torch.autograd.backward(loss, inputs=leaves)
            del loss
            new = sum(t.grad.untyped_storage().nbytes() for t in made if t.grad is not None)
        return tracker.peak_bytes - new
    finally:
        for t, g in zip(leaves, before):
            t.grad = g


def _loss_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors requiring grad that ``loss``'s autograd graph reaches (its ``AccumulateGrad`` nodes'
    variables), each once, in the order found."""
    found: dict[int, torch.Tensor] = {}
    todo, seen = [loss.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        variable = getattr(fn, "variable", None)
        if isinstance(variable, torch.Tensor):
            found.setdefault(id(variable), variable)
        todo += [f for f, _ in fn.next_functions]
    return list(found.values())


def _params_read(gm: fx.GraphModule, node: fx.Node) -> list[nn.Parameter]:
    """The parameters ``node`` reads: its module's (``call_module``), or the one or the module's a ``get_attr``
    fetches (a module read as a value is passed to a function, a ``torch.fx.wrap`` one: its readers' backward passes
    make its parameters' gradients; they were counted as there from the backward's start, a packed LSTM's 4 MB over
    the measured peak)."""
    if node.op == "call_module":
        return list(gm.get_submodule(node.target).parameters())
    if node.op == "get_attr":
        value = _attr(gm, node.target)
        return ([value] if isinstance(value, nn.Parameter) else list(value.parameters())
                if isinstance(value, nn.Module) else [])
    return []


def _parameter_readers(gm: fx.GraphModule) -> dict[int, int]:
    """``id(parameter) -> how many nodes read it`` (:func:`_params_read`)."""
    counts: dict[int, int] = {}
    for node in gm.graph.nodes:
        for pid in {id(p) for p in _params_read(gm, node)}:
            counts[pid] = counts.get(pid, 0) + 1
    return counts


def _readers_under_autocast(gm: fx.GraphModule) -> dict[int, int]:
    """Under ``torch.autocast`` with its cache on, ``id(parameter) -> how many nodes read it``; ``{}`` elsewhere.
    PyTorch's layers reading one parameter share autocast's one cached lower-precision copy of it, whose gradient
    autograd sums in that precision before casting it back, where a variant casts the weight itself and its
    contributions are summed in float32 (a fresh user's encoder applied to three views, bfloat16: gradients 2.2e-3
    off, with ``variants="exact"``): a layer whose parameters other nodes read keeps PyTorch's implementation
    there (:func:`_shares_parameters`)."""
    device = next((p.device for p in gm.parameters()), torch.device("cpu"))
    return {} if _autocast_cache_dtype(device) is None else _parameter_readers(gm)


def _shares_parameters(gm: fx.GraphModule, node: fx.Node, readers: dict[int, int]) -> bool:
    """``node`` (a module call) reads a parameter that other nodes read too (``readers``:
    :func:`_readers_under_autocast`)."""
    return bool(readers) and any(readers.get(id(p), 0) > 1 for p in _params_read(gm, node))


def _profile_variants(gm, node, env, cost: NodeCost, storages, by_ptr, register, keep_alive) -> None:
    """What each applicable operator variant of ``node`` saves, in the storage ids of the default run."""
    from memfit.variants import variant_call, variants_for

    module = gm.get_submodule(node.target)
    args = tuple(env.get(a.name) if isinstance(a, fx.Node) else a for a in node.args)
    for spec in variants_for(module):
        if not spec.offered:  # bn-from-output: its rounding is amplified over steps (VariantSpec.offered)
            continue
        if spec.pays is not None and not spec.pays(module, args):  # conv-native on a full-resolution layer
            continue
        inplace = bool(getattr(spec.make(module), "inplace", False))
        overwrite = tuple(a.name for a in node.all_input_nodes) if inplace else ()
        try:
            cost.variants[spec.name] = _variant_cost(node, variant_call(gm, node, spec.name), env, cost, storages,
                                                     register, keep_alive, by_ptr, overwrite)
        except (RuntimeError, ValueError, TypeError, IndexError):
            # a variant that cannot run these inputs is not offered here (a Conv2d called on an unbatched
            # [C, H, W] image, which PyTorch's own module accepts: planning failed inside conv-split-backward)
            continue


def _variant_cost(node, fn, env, cost: NodeCost, storages, register, keep_alive, by_ptr,
                  overwrite: tuple[str, ...] = ()) -> VariantCost:
    """Run ``fn`` (an implementation of ``node``) once under the saved-tensor hook and map what it saves to
    the default run's storage ids. The inputs named in ``overwrite`` are given as copies (the function
    writes into them); a copy stands for the storage of the value it copies, and the result for the node's
    outputs."""
    local = dict(env)
    alias: dict[int, int] = {}
    for a in overwrite:
        v = local[a]
        if isinstance(v, torch.Tensor):
            copy = v.detach().clone().requires_grad_(v.requires_grad)
            copy = copy.clone() if copy.requires_grad else copy  # a non-leaf can be updated in place
            alias[copy.untyped_storage().data_ptr()] = by_ptr.get(v.untyped_storage().data_ptr(), -1)
            local[a] = copy
    saved: list[torch.Tensor] = []
    with _recording(saved):
        out = fn(local)
    for t, sid in zip(tensors_in(out), cost.outputs):
        alias[t.untyped_storage().data_ptr()] = sid
    vc = VariantCost()
    for t in saved:
        ptr = t.untyped_storage().data_ptr()
        if ptr in alias:
            sid = alias[ptr]
        else:
            n_before = len(storages)
            sid = register(t, node.name, "variant")
            if sid is not None and len(storages) > n_before:
                vc.creates.append(sid)
        if sid is not None and sid >= 0 and sid not in vc.saves:
            vc.saves.append(sid)
    keep_alive.append((saved, out, local))
    return vc


def _isolated(gm: fx.GraphModule, inputs: tuple, requires: dict[str, list[bool]] | None = None):
    """Yield ``(node, fn, make_env, params)`` for each node; ``make_env()`` returns an environment in which the
    node's inputs that require grad in the model's forward pass (``requires``, from :func:`_structure`; without
    it, every floating input) are fresh leaves requiring grad, and the list of those leaves
    (``make_env(names=[])`` appends the input nodes' names to that list, in the leaves' order). With
    ``clone=True`` (the node updates an input in place) every tensor input is a copy. With ``release=[]``, each
    input that requires grad and lives in a storage another node made (not the model's inputs, parameters or
    buffers) is a copy of its leaf, held by the environment alone, and its name is appended to that list
    (``NodeCost.bwd_released_workspaces``). Other inputs (buffers,
    frozen parameters, the model's inputs, integer values) are given as they are: PyTorch computes no gradient
    for them, and neither may the measured backward. Values are computed once, without grad, in forward order.

    Under autocast the node reads views of the leaves: autocast caches its casts of leaves that require
    grad until the context exits, and the activations these leaves stand for are no leaves (their casts are
    transient or saved, not cached)."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    uncached = _autocast_cache_dtype(tensors[0].device if tensors else torch.device("cpu")) is not None
    env: dict[str, object] = dict(bind_inputs(gm, inputs))
    # storages the step holds whatever the nodes do: the model's inputs, parameters and buffers
    kept = {t.untyped_storage().data_ptr() for t in itertools.chain(
        tensors_in(list(env.values())), gm.parameters(), gm.buffers()) if t.device.type != "meta"}
    for node in compute_nodes(gm):
        fn = node_fn(gm, node)
        params = [p for p in (gm.get_submodule(node.target).parameters() if node.op == "call_module" else [])
                  if p.requires_grad]
        # a module passed as an argument (`run_rnn(self.rnn, h, lengths)`, a torch.fx.wrap function): its
        # parameters get their gradients from this node's backward
        for a in node.all_input_nodes:
            if isinstance(env.get(a.name), nn.Module):
                params += [p for p in env[a.name].parameters() if p.requires_grad and all(p is not q for q in params)]

        def make_env(node=node, clone=False, names=None, release=None):
            local = dict(env)
            leaves = []
            for a in node.all_input_nodes:
                v = local[a.name]
                if not isinstance(v, torch.Tensor):
                    continue
                flags = requires.get(a.name) if requires is not None else None
                if not (flags[0] if flags else _differentiable(v)):
                    if clone:  # the node may write into it: a copy, not the model's buffer or an earlier value
                        local[a.name] = v.detach().clone()
                    continue
                leaf = v.detach().requires_grad_(True)
                leaves.append(leaf)
                if names is not None:
                    names.append(a.name)
                if release is not None and not clone and v.untyped_storage().data_ptr() not in kept:
                    # (a copy that only `local` and the node's saved tensors hold, once `local` is cleared: an
                    # activation another node made, whose last holder in the backward pass is this node)
                    local[a.name] = leaf.clone()
                    release.append(a.name)
                    continue
                local[a.name] = _operand_copy(v, leaf) if clone else leaf.view_as(leaf) if uncached else leaf
            return local, leaves

        yield node, fn, make_env, params
        env[node.name] = _value(fn, env)


def _value(fn, env: dict):
    """``fn(env)`` without autograd's graph. Under ``torch.no_grad()``, unless that fails: a module hook of the
    user's may call ``output.register_hook`` or ``retain_grad()``, which refuse a tensor that does not require
    grad (a fresh user's feature hook crashed planning); then with grad, detached, and if the node itself calls
    them (``h.retain_grad()`` in forward, a hook added by an ``fx.wrap`` function), on inputs that require grad."""
    printed = io.StringIO()  # (a failing GraphModule call prints its generated code to stderr: kept if it runs)
    try:
        with torch.no_grad(), contextlib.redirect_stderr(printed):
            out = fn(env)
        sys.stderr.write(printed.getvalue())
        return out
    except RuntimeError:
        pass
    with torch.enable_grad():
        try:
            return map_tensors(lambda v: v.detach(), fn(env))
        except RuntimeError:  # (the node itself calls h.retain_grad() or h.register_hook: h must require grad)
            def leaf(v):
                return v.detach().requires_grad_() if v.is_floating_point() or v.is_complex() else v
            return map_tensors(lambda v: v.detach(), fn({k: map_tensors(leaf, v) for k, v in env.items()}))


def _operand_copy(value: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """A copy of ``leaf`` (standing for ``value``) for a node that writes its input in place, laid out as ``value``
    is in the model: a view when ``value`` is one, so that the node's backward runs through autograd's
    ``CopySlices`` as in a real step, which clones the gradient of the view's base (a fresh user's ``masked_fill_``
    on a 3-D ``nn.Linear`` output, itself a view: 1 MiB predicted, 3 MiB measured). A view of part of a larger
    base is copied into a copy of that base: its backward then also runs the copy's, a base-sized gradient more
    than the real step (on the safe side). A view whose elements overlap (an ``expand``) cannot be written in place
    (PyTorch refuses), so the node only reads it: ``leaf`` itself stands for it (DeepSeek-V3 copies an expanded key
    into a slice of another tensor)."""
    base = value._base
    if any(stride == 0 and size > 1 for stride, size in zip(value.stride(), value.size())):
        return leaf
    if base is None:
        return leaf.clone()
    if base.numel() == value.numel():
        return leaf.clone().view(leaf.shape)
    with torch.no_grad():
        whole = torch.empty_strided(base.size(), base.stride(), dtype=base.dtype, device=base.device)
        whole.copy_(base)
    part = whole.as_strided(value.size(), value.stride(), value.storage_offset() - base.storage_offset())
    part.copy_(leaf)
    return part


def _implementations(gm: fx.GraphModule, node: fx.Node, fn, cost: NodeCost) -> list[tuple[str, object, object, bool]]:
    """``(label, fn, record, writes_inputs)`` for PyTorch's implementation of ``node`` and each profiled
    variant; measured times and workspaces are written to ``record`` (the :class:`NodeCost` or its
    :class:`VariantCost`); ``writes_inputs``: it modifies its inputs in place (so it runs on copies)."""
    out = [("", fn, cost, bool(cost.mutates))]
    if cost.variants:
        from memfit.variants import variant_call

        for name, vc in cost.variants.items():
            out.append((f":{name}", variant_call(gm, node, name), vc,
                        bool(cost.mutates) or vc.inplace_of is not None))
    return out


def _format_of(g: torch.Tensor) -> torch.memory_format | tuple[int, ...] | None:
    """The memory format of a dense gradient, or its strides where it is dense in another order (an ``einsum``'s
    backward hands on a permuted gradient: started from a contiguous one, the isolated backward of the node
    before it missed the copy the permuted one costs, 295 KB on a fresh user's two-einsum MoE), or with gaps (a
    ``cat``'s backward hands each input a slice of its gradient, which an embedding's backward copies: one
    ``[B, 32]`` tensor missed on a fresh user's recommender); ``None``: another layout (overlapping, expanded)."""
    for fmt in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d):
        if (g.dim() == 4 or fmt is not torch.channels_last) and (g.dim() == 5 or fmt is not torch.channels_last_3d) \
                and g.is_contiguous(memory_format=fmt):
            return fmt
    return tuple(g.stride()) if _dense(g) or _non_overlapping(g) else None


def _non_overlapping(t: torch.Tensor) -> bool:
    """No two elements of ``t`` share memory (strides with gaps allowed)."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    reach = 1
    for st, n in dims:
        if st < reach:
            return False
        reach = st * n
    return True


def _seed(t: torch.Tensor, fmt, device: torch.device | None = None) -> torch.Tensor:
    """Ones of ``t``'s shape in the layout :func:`_format_of` gave (``t``'s own for ``None``); strides with gaps
    leave the storage larger than ``t``, as the slice of a larger gradient it stands for. On ``device`` (``t``'s
    by default: ``t`` may be a meta tensor standing for it)."""
    if isinstance(fmt, tuple):
        return torch.empty_strided(t.shape, fmt, dtype=t.dtype, device=device or t.device).fill_(1)
    return torch.ones_like(t, device=device or t.device, memory_format=fmt or torch.preserve_format)


def _grad_formats(gm: fx.GraphModule, inputs: tuple, loss_fn, requires: dict[str, list[bool]]
                  ) -> tuple[dict, set[int]]:
    """``{node name: [memory format of the gradient each tensor output receives, or None]}`` in one real
    forward and backward pass (``loss_fn`` on the output, or ones as the output's gradient), so that the
    isolated backward passes start from the layouts the step gives them: a gradient need not have its
    output's layout (a mean's backward makes a contiguous gradient for a channels-last activation).
    Parameters' ``.grad`` are not touched (``torch.autograd.grad``); the caller restores buffers and RNG. Also
    the ``id()`` of the trainable parameters that pass gives no gradient (empty when it gives none at all),
    ``{node name: [whether each tensor output received a gradient]}`` (``None`` where no backward pass ran), and
    ``{node name: bytes of the outputs it makes that received none}`` for the nodes some of whose outputs did
    (``a, _ = attn(h, h, h)``: MultiheadAttention's averaged weights, B*T*T*4 bytes, get no gradient)."""
    env: dict[str, object] = dict(bind_inputs(gm, inputs))
    formats: dict[str, list] = {}
    received: dict[str, list[bool]] = {}

    def record(fs: list, got: list, k: int):
        def hook(g):
            if g is not None:  # (an output nothing reads, `a, _ = h.chunk(2, 1)`: autograd calls its hook with None)
                fs[k] = _format_of(g)
                got[k] = True
        return hook

    # bytes of each node's gradient-needing outputs it makes itself (as :func:`_structure` counts its grad_bytes)
    seen = {t.untyped_storage().data_ptr() for t in [*tensors_in(inputs), *gm.parameters(), *gm.buffers()]
            if isinstance(t, torch.Tensor)}
    own: dict[str, list[int]] = {}
    with torch.enable_grad():
        for node in compute_nodes(gm):
            out = node_fn(gm, node)(env)
            env[node.name] = out
            ts = [t for t in tensors_in(out) if isinstance(t, torch.Tensor)]
            fs = formats[node.name] = [None] * len(ts)
            got = received[node.name] = [False] * len(ts)
            own[node.name] = [t.numel() * t.element_size() if t.requires_grad and _differentiable(t)
                              and t.untyped_storage().data_ptr() not in seen else 0 for t in ts]
            seen.update(t.untyped_storage().data_ptr() for t in ts)
            for k, t in enumerate(ts):
                if t.requires_grad and t.grad_fn is not None:
                    t.register_hook(record(fs, got, k))
        output_node = next(n for n in gm.graph.nodes if n.op == "output")
        out = fx.node.map_arg(output_node.args[0], lambda a: env[a.name])
        wrt = [p for p in gm.parameters() if p.requires_grad]
        wrt += [t for t in tensors_in(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if loss_fn is not None:
            roots, seeds = [_call_loss(loss_fn, out)], None
        else:
            roots = [t for t in tensors_in(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            seeds = [torch.ones_like(t) for t in roots]
        roots_ok = [r for r in roots if isinstance(r, torch.Tensor) and r.requires_grad]
        no_grad: set[int] = set()
        ran = False
        if wrt and roots_ok and len(roots_ok) == len(roots):
            grads = torch.autograd.grad(roots, wrt, seeds, allow_unused=True)
            ran = True
            if any(g is not None for g in grads):
                no_grad = {id(p) for p, g in zip(wrt, grads) if g is None and isinstance(p, nn.Parameter)}
    unread = {name: sum(b for b, g in zip(own[name], got) if not g) for name, got in received.items()
              if ran and any(got)}
    return formats, no_grad, received if ran else None, unread


def _scalars_behind_copy_slices(gm: fx.GraphModule, node: fx.Node, env: dict, ins: list,
                                versions: list[int]) -> list[torch.Tensor]:
    """The numbers an in-place update through a view saves (``w = h[:, 8:]; w *= 2.0``): autograd wraps the
    update's backward node in the base's ``CopySlices``, whose saved values Python cannot reach, so
    :func:`_saved_scalars` misses them (8 B over a ``min`` budget). The node is run once more on a copy of the view
    that is no view, and what that run saves is returned (its 0-d tensors: the same count and sizes). Only for
    functions and methods, under a forked RNG state (a module could update its state twice)."""
    if node.op not in ("call_function", "call_method"):
        return []
    mutated = {id(t) for t, v in zip(ins, versions) if t._version != v and t._base is not None and t.requires_grad}
    if not mutated:
        return []
    swap = {a.name: v for a in node.all_input_nodes if isinstance(v := env[a.name], torch.Tensor) and id(v) in mutated}
    if not swap:
        return []
    probes = {k: v.detach().clone().requires_grad_() * 1 for k, v in swap.items()}  # (not a leaf: in place allowed)
    stop_fns = [t.grad_fn for t in probes.values()]  # (before the update replaces them)
    devices = [t.device for t in probes.values() if t.device.type == "cuda"]
    with torch.random.fork_rng(devices=devices):
        out = node_fn(gm, node)({**env, **probes})
    return _saved_scalars(tensors_in(out), stop_fns)


def _saved_scalars(outs: list, stop_fns: list) -> list[torch.Tensor]:
    """The Python numbers a node's operations save as tensors for backward (``h / 8``, ``h * scale``: autograd
    wraps the number in a 0-d tensor of its own device's memory on the CPU, 8 bytes, and saves it without calling
    the saved-tensor hooks), found on the autograd graph between the node's outputs and its inputs' backward
    nodes as they were before it ran (``stop_fns``: an in-place ``h *= 2.0`` makes its own the input's, and its
    saved 2.0 was missed, 8 B over a ``min`` budget). A LoRA model scaling every adapter measured 160 B over a
    ``100%`` budget while they were missed."""
    stop = {fn for fn in stop_fns if fn is not None}
    device = next((t.device for t in outs if isinstance(t, torch.Tensor)), None)
    found: list[torch.Tensor] = []
    seen: set = set()
    stack = [t.grad_fn for t in outs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen or fn in stop or not hasattr(fn, "next_functions"):
            continue
        seen.add(fn)
        for name in dir(fn):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(fn, name)
            except RuntimeError:  # (freed, or a custom Function's hook)
                continue
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, torch.Tensor) and v.dim() == 0 and v.device == device:
                    found.append(v)
        stack.extend(f for f, _ in fn.next_functions)
    return found


def _dense(t: torch.Tensor) -> bool:
    try:
        from torch._prims_common import is_non_overlapping_and_dense_or_false
    except ImportError:  # (a private helper: the common layouts otherwise)
        return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
    return bool(is_non_overlapping_and_dense_or_false(t))


def _copied_into_grad(g: torch.Tensor, param: torch.Tensor, shared: set[int]) -> bool:
    """Whether autograd's ``AccumulateGrad`` copies ``g`` before making it ``param.grad`` (``.grad`` unset): where
    ``g`` breaks the gradient layout contract (strides other than the parameter's: an ``einsum`` or broadcast
    ``matmul`` weight gradient comes out transposed) or another gradient this backward makes shares its storage
    (``shared``: an addition hands one tensor to its input and to a parameter of the same shape). The copy
    and ``g`` then exist together (torch/csrc/autograd/functions/accumulate_grad.h; a fresh user's 1 MiB einsum
    expert weight measured 0.9 MB over a 100% budget)."""
    if g.is_sparse or param.is_sparse:
        return False
    if g.untyped_storage().data_ptr() in shared:
        return True
    if _dense(param):
        return any((n != 1 and a != b) or (n == 1 and a == 0) for n, a, b in zip(g.shape, g.stride(), param.stride()))
    return not g.is_contiguous()


def _grad_copy(g: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The copy of ``g`` that ``AccumulateGrad`` makes into ``param``'s layout (``clone_obey_contract`` in
    torch/csrc/autograd/functions/utils.h): strided like ``param`` where it is dense, else contiguous."""
    if _dense(param):
        return torch.empty_strided(param.shape, param.stride(), dtype=g.dtype, device=g.device).copy_(g)
    return g.clone(memory_format=torch.contiguous_format)


def _received_outputs(received: dict[str, list[bool]] | None, name: str, count: int) -> list[bool]:
    """Which of node ``name``'s ``count`` tensor outputs to start its isolated backward from: those that received a
    gradient in :func:`_grad_formats`'s step where some did (MultiheadAttention's averaged weights, discarded,
    were started from ones: B*T*T*4 bytes over the measured peak), else all (a node none of whose outputs got
    one there, whatever the reason, is measured as before)."""
    got = (received or {}).get(name)
    if not got or len(got) != count or not any(got):
        return [True] * count
    return list(got)


def _noting_saves(note, fixed: set[int], unpacked=None, direct: set[int] = frozenset()):
    """Saved-tensor hooks that call ``note()`` (when given) each time autograd saves a tensor whose storage's data
    pointer is not in ``fixed`` (the parameters, which a checkpoint region holds without its hooks: its
    recomputation stops at the last other save), and ``unpacked()`` (when given) the first time the backward pass
    unpacks a saved tensor whose storage is in neither ``fixed`` nor ``direct`` (the model's inputs): where a
    region's recomputation starts (:mod:`memfit.runtime.direct_saves`). Hands autograd a detached alias (see
    :func:`_recording`)."""
    first = [unpacked is not None]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if note is not None and ptr not in fixed:
            note()
        return t.detach(), ptr not in fixed and ptr not in direct

    def unpack(packed):
        t, starts = packed
        if starts and first[0]:
            first[0] = False
            unpacked()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _instant(ctx) -> None:
    """Enter and leave the context manager ``ctx`` (a tracker's mark of one instant)."""
    with ctx:
        pass


def _stop_workspace(costs: Costs, cost: NodeCost, peak_at_last_save: int, net: int) -> int:
    """``NodeCost.stop_workspace``: the forward's peak up to its last save (bytes, relative to its start), minus
    what the forward kept (``net``) that a recomputation stopping there makes too (all but ``unmade_at_stop``)."""
    unmade = sum(costs.storages[s].nbytes for s in cost.unmade_at_stop)
    return max(0, peak_at_last_save - (net - unmade))


def _measure_workspace(gm: fx.GraphModule, inputs: tuple, costs: Costs, device: torch.device,
                       requires: dict[str, list[bool]] | None = None, formats: dict | None = None,
                       existing: set[int] = frozenset(), received: dict[str, list[bool]] | None = None) -> None:
    """Transient bytes of each node's forward and backward (and of its variants'), run in isolation under
    the memory tracker; each backward starts from gradients of the layouts ``formats`` (see
    :func:`_grad_formats`) gives, for the outputs that receive one in the step (``received``: where a node's
    outputs receive some, the others are unread, `a, _ = attn(h, h, h)`: no gradient starts there). A parameter gradient that autograd copies into a ``.grad`` that does not exist
    yet (:func:`_copied_into_grad`; its storage's data pointer not in ``existing``) is made as autograd makes it,
    and the peak of making it (its bytes, and the 14,400 B buffer of a transposing copy on the CPU) is the node's
    ``grad_copy_bytes``."""
    cpu = device.type != "cuda"
    outer = MemoryTracker(device) if cpu else contextlib.nullcontext()
    leaf_bytes: dict[str, int] = {}
    copies: dict[str, int] = {}  # label -> peak bytes of AccumulateGrad's copies of its parameter gradients
    seed_bytes: dict[str, int] = {}  # label -> bytes of the output gradients its second backward made
    sum_bases: dict[tuple[str, str], int] = {}  # (label, case) -> bytes of the earlier gradients made while measured
    released_bases: dict[tuple[str, str], int] = {}  # the same, measured with the inputs released (rel-)
    records: list[tuple[str, object]] = []
    readers = _cast_readers(costs.nodes)
    param_readers = _parameter_readers(gm)
    placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    param_names = _param_names(gm)
    with outer as tracker:
        for (node, fn0, make_env, params), cost in zip(_isolated(gm, inputs, requires), costs.nodes):
            # under autocast, a cast of a parameter only this node reads is held by its saved tensors alone in a
            # real step (autocast's cache is cleared when the forward pass ends): the backward frees it once
            # the node's own gradient function has run, before the cast of its weight gradient back to float32
            # (a bfloat16 MLP was predicted 3 MiB over when the cache kept it alive here)
            own_casts = bool(cost.casts) and all(readers[sid] == 1 for sid in cost.casts)
            for suffix, fn, record, clone in _implementations(gm, node, fn0, cost):
                label = node.name + suffix
                records.append((label, record))
                names: list[str] = []
                local, leaves = make_env(clone=clone, names=names)
                part = tracker.mark(f"{label}:f") if cpu else MemoryTracker(device)
                at_save: list[int] = []  # (CUDA) the forward's peak so far at its last save
                backward: list = []  # (CUDA) the backward's tracker, once it runs
                at_unpack: list[int] = []  # (CUDA) the backward's net bytes at its first unpack
                note = None if not cost.unmade_at_stop else (
                    (lambda label=label: _instant(tracker.mark(f"{label}:s"))) if cpu else
                    (lambda part=part, at_save=at_save: at_save.append(part.peak_so_far())))
                unpacked = ((lambda label=label: _instant(tracker.mark(f"{label}:u"))) if cpu else
                            (lambda backward=backward, at_unpack=at_unpack: at_unpack.append(
                                backward[-1].net_so_far())))
                fixed = {p.untyped_storage().data_ptr() for p in params}
                direct = {v.untyped_storage().data_ptr() for a, v in local.items()
                          if a in placeholders and isinstance(v, torch.Tensor)}
                saves = _noting_saves(note, fixed, unpacked, direct) if record is cost else contextlib.nullcontext()
                with part, saves:
                    outs = [t for t in tensors_in(fn(local)) if isinstance(t, torch.Tensor)]
                if not cpu:
                    record.fwd_workspace = max(0, part.peak_bytes - part.net_bytes)
                    if at_save:
                        cost.stop_workspace = _stop_workspace(costs, cost, at_save[-1], part.net_bytes)
                if own_casts:
                    torch.clear_autocast_cache()
                fmts = (formats or {}).get(node.name) or []
                fmts = fmts if len(fmts) == len(outs) else [None] * len(outs)
                wanted = _received_outputs(received, node.name, len(outs))
                fmts = [f for t, f, w in zip(outs, fmts, wanted) if t.requires_grad and w]
                outs = [t for t, w in zip(outs, wanted) if t.requires_grad and w]
                if not outs or not (leaves or params):  # e.g. a get_attr of a parameter: nothing to do
                    continue
                # the layout the real backward hands this node (a channels-last pooling fed by a mean's
                # contiguous gradient reorders it: 0.66 MB missed on a small CNN when every seed kept its output's)
                seeds = [_seed(t, f) for t, f in zip(outs, fmts)]
                part = tracker.mark(f"{label}:b") if cpu else MemoryTracker(device)
                backward.append(part)
                with part, _no_autocast(device):
                    grads = torch.autograd.grad(outs, leaves + params, seeds, allow_unused=True)
                if at_unpack and record is cost:
                    cost.bwd_held_at_unpack = max(0, at_unpack[0])
                seed_ptrs = {t.untyped_storage().data_ptr() for t in seeds}
                fresh = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                         for g in grads[:len(leaves)] if g is not None}
                # a parameter read through get_attr (``self.w`` in an einsum) has no gradient of its own in the
                # replay until its .grad exists: its gradient stays in this node's workspace (a fresh user's 1 MiB
                # einsum weight's gradient and AccumulateGrad's copy of it were both missed)
                by_name = {a.name: a for a in node.all_input_nodes}
                weights = [(g, w) for a, g in zip(names, grads) if g is not None and by_name[a].op == "get_attr"
                           and isinstance(w := _attr(gm, by_name[a].target), nn.Parameter)]
                weight_ptrs = {g.untyped_storage().data_ptr() for g, _ in weights}
                grad_in = sum(b for ptr, b in fresh.items() if ptr not in seed_ptrs and ptr not in weight_ptrs)
                # the gradient of a model input that requires grad is no node's output gradient, so the replay
                # has no other place for it: it stays in the workspace (a block in row stripes holds it from the
                # start of its backward: 98,304 B under on a small CNN)
                batch = sum(g.untyped_storage().nbytes() for a, g in zip(names, grads) if a in placeholders
                            and g is not None and g.untyped_storage().data_ptr() not in seed_ptrs)
                ptrs = [g.untyped_storage().data_ptr() for g in grads if g is not None]
                shared = {x for x in ptrs if ptrs.count(x) > 1}
                copied = [(g, p) for g, p in weights + list(zip(grads[len(leaves):], params)) if g is not None
                          and p.untyped_storage().data_ptr() not in existing and _copied_into_grad(g, p, shared)]
                if copied:  # made as AccumulateGrad makes them: a CPU copy of a transposed one takes 14,400 B more
                    copying = tracker.mark(f"{label}:c") if cpu else MemoryTracker(device)
                    with copying:
                        made = [_grad_copy(g, p) for g, p in copied]
                    del made
                    if not cpu:  # (on the CPU, read from the tracker's range once it has stopped)
                        copies[label] = copying.peak_bytes
                if record is cost:
                    cost.grad_alias = any(ptr in seed_ptrs for ptr in fresh)
                    cost.grad_in_bytes = grad_in
                    # inputs whose gradient is not the passed-on one: of another dtype than the output (a float32
                    # addition of a bfloat16 branch under autocast: autograd casts it), or broadcast (reduced)
                    cost.grad_copies = [a for a, g in zip(names, grads) if g is not None and cost.grad_alias
                                        and g.untyped_storage().data_ptr() not in seed_ptrs]
                    cost.grad_storage_bytes = {
                        a: g.untyped_storage().nbytes() for a, g in zip(names, grads)
                        if g is not None and g.untyped_storage().data_ptr() not in seed_ptrs
                        and g.untyped_storage().nbytes() > g.numel() * g.element_size()}
                    cost.grad_views = [a for a, g in zip(names, grads)
                                       if g is not None and (g._is_view() or not _dense(g))]
                    cost.param_grad_storage_bytes = {
                        param_names[id(p)]: g.untyped_storage().nbytes()
                        for g, p in weights + list(zip(grads[len(leaves):], params)) if g is not None
                        and id(p) in param_names and g.untyped_storage().nbytes() < p.untyped_storage().nbytes()}
                    cost.param_grad_views = sorted({
                        param_names[id(p)] for g, p in weights + list(zip(grads[len(leaves):], params))
                        if g is not None and id(p) in param_names and (
                            g._is_view() or not _dense(g) or g.untyped_storage().data_ptr() in shared)})
                if not cpu:
                    record.bwd_workspace = max(0, part.peak_bytes - grad_in + batch)
                # (a seed with gaps stands for a slice of a larger gradient, which others hold)
                several = record is cost and _backward_functions(outs, leaves) > 1
                chain = several and all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in seeds)
                del grads, outs, seeds, local, leaves
                leaf_bytes[label] = grad_in - batch
                # inputs and parameters other nodes read too: a gradient of one may exist before this node's backward
                # starts; measured again with them made first, as views
                shared_inputs = [a for a in names if len(by_name[a].users) > 1] if several else []
                shared_params = [p for p in params if param_readers.get(id(p), 0) > 1] if several else []
                if several:
                    cost.bwd_sum_inputs = shared_inputs
                for case in SUM_CASES:
                    ins = shared_inputs if case.startswith(("inputs", "both")) else []
                    ps = shared_params if not case.startswith("inputs") else []
                    if not (ins and ps) if case.startswith("both") else not (ins or ps):
                        continue
                    # (and with the output's gradient held by autograd alone, where bwd_workspace_grad_freed is measured)
                    for key in (case, f"{case}-freed") if chain else (case,):
                        names_m: list[str] = []
                        local, leaves = make_env(clone=clone, names=names_m)
                        held = [leaf for a, leaf in zip(names_m, leaves) if a in ins]
                        part = tracker.mark(f"{label}:sum-{key}") if cpu else MemoryTracker(device)
                        sum_bases[label, key] = _backward_with_earlier_grads(
                            local, leaves, held, ps, params, fn, wanted, fmts, own_casts, fixed, part, device,
                            seeds_freed=key.endswith("-freed"), taken_owned="-inplace" in key)
                        del local, leaves, held
                        if not cpu:
                            cost.bwd_sum_workspaces[key] = max(
                                0, part.peak_bytes - sum_bases[label, key] - leaf_bytes[label])
                # (and its outputs: one the node saves itself, `nn.RNNCell`'s `tanh` output, is freed once the function
                # that saved it has run, before the weight gradients' sums, where a cell's backward peaks)
                # (not where it writes into its input: an in-place ReLU's output is its input's copy, held so already)
                own_saved = not clone and bool(set(cost.outputs) & set(cost.saves))
                # again, each with the inputs other nodes made held by the saved tensors alone (not where an input's
                # gradient exists first: the copy's backward, made before the node's, runs after all of them, and the
                # sum into that gradient with it, where autograd sums as soon as the contribution is made)
                for key in (["plain", "plain-freed"] if chain else ["plain"] if several else []) + [
                        k for (lb, k) in sum_bases if lb == label and k.startswith("parameters")]:
                    ps = shared_params if key.startswith("parameters") else []
                    names_m, copied = [], []
                    local, leaves = make_env(clone=clone, names=names_m, release=copied)
                    if not copied and not own_saved:  # (nothing another node made, no output saved: none to release)
                        break
                    # (and, where it has both, its outputs alone: its inputs may be held by others, an RNN's by the
                    # previous step's saved output)
                    for name in [key] + ([f"out-{key}"] if copied and own_saved else []):
                        if name != key:
                            local, leaves = make_env(clone=clone)
                        part = tracker.mark(f"{label}:rel-{name}") if cpu else MemoryTracker(device)
                        released_bases[label, name] = _backward_with_earlier_grads(
                            local, leaves, [], ps, params, fn, wanted, fmts, own_casts, fixed, part, device,
                            seeds_freed=key.endswith("-freed"), taken_owned="-inplace" in key, release=True)
                        del local, leaves
                        if not cpu:
                            cost.bwd_released_workspaces[name] = max(
                                0, part.peak_bytes - released_bases[label, name] - leaf_bytes[label])
                if chain:  # again, with the output's gradient held by autograd alone
                    local, leaves = make_env(clone=clone)
                    at_unpack.clear()
                    unpacked = ((lambda label=label: _instant(tracker.mark(f"{label}:v"))) if cpu else
                                (lambda backward=backward, at_unpack=at_unpack: at_unpack.append(
                                    backward[-1].net_so_far())))
                    with _noting_saves(None, fixed, unpacked, direct):
                        outs = [t for t, w in zip([t for t in tensors_in(fn(local)) if isinstance(t, torch.Tensor)],
                                                  wanted) if t.requires_grad and w]
                    if own_casts:
                        torch.clear_autocast_cache()
                    root, one = _Seeded.apply(lambda outs=outs, fmts=fmts: [_seed(t, f) for t, f in zip(outs, fmts)],
                                              *outs), torch.ones((), device=device)
                    seed_bytes[label] = sum(t.numel() * t.element_size() for t in outs)
                    part = tracker.mark(f"{label}:r") if cpu else MemoryTracker(device)
                    backward.append(part)
                    with part, _no_autocast(device):
                        grads = torch.autograd.grad(root, leaves + params, one, allow_unused=True)
                    if not cpu:
                        cost.bwd_workspace_grad_freed = min(cost.bwd_workspace, max(
                            0, part.peak_bytes - leaf_bytes[label] - seed_bytes[label]))
                        if at_unpack:
                            cost.bwd_held_at_unpack_grad_freed = max(0, at_unpack[0] - seed_bytes[label])
                    del grads, outs, root, local, leaves
    if cpu:
        for label, record in records:
            peak, net = tracker.range_peak(f"{label}:f")
            record.fwd_workspace = max(0, peak - net)
            if f"{label}:s" in tracker.ranges:
                record.stop_workspace = _stop_workspace(
                    costs, record, tracker.range_peak(f"{label}:f", until=f"{label}:s")[0], net)
            if f"{label}:b" in tracker.ranges:
                peak, _ = tracker.range_peak(f"{label}:b")
                record.bwd_workspace = max(0, peak - leaf_bytes.get(label, 0))
                if f"{label}:c" in tracker.ranges:
                    copies[label] = tracker.range_peak(f"{label}:c")[0]
                for key in (case + freed for case in SUM_CASES for freed in ("", "-freed")):
                    if f"{label}:sum-{key}" in tracker.ranges:
                        record.bwd_sum_workspaces[key] = max(0, tracker.range_peak(f"{label}:sum-{key}")[0]
                                                             - sum_bases[label, key] - leaf_bytes.get(label, 0))
                for (lb, key), base in released_bases.items():
                    if lb == label:
                        record.bwd_released_workspaces[key] = max(0, tracker.range_peak(f"{label}:rel-{key}")[0]
                                                                  - base - leaf_bytes.get(label, 0))
                if f"{label}:r" in tracker.ranges:
                    record.bwd_workspace_grad_freed = min(record.bwd_workspace, max(
                        0, tracker.range_peak(f"{label}:r")[0] - leaf_bytes.get(label, 0) - seed_bytes[label]))
                if f"{label}:u" in tracker.ranges:
                    record.bwd_held_at_unpack = max(0, tracker.range_peak(f"{label}:b", until=f"{label}:u")[1])
                if f"{label}:v" in tracker.ranges:
                    record.bwd_held_at_unpack_grad_freed = max(0, tracker.range_peak(
                        f"{label}:r", until=f"{label}:v")[1] - seed_bytes[label])
    for label, record in records:
        # AccumulateGrad copies once the node's backward has returned (its output's gradient and what it saved
        # released): the replay places the node's own copies there; a variant's stay in its workspace
        if isinstance(record, NodeCost):
            record.grad_copy_bytes = copies.get(label, 0)
        else:
            record.bwd_workspace += copies.get(label, 0)


class _StandIn(torch.autograd.Function):
    """A copy of a model output for :func:`_measure_loss`: made from ``anchor`` (a scalar leaf requiring grad), held by
    nothing but what the loss saves, and its gradient kept in ``sink[k]`` (as autograd keeps an output's gradient for
    the model's backward)."""

    @staticmethod
    def forward(ctx, anchor, value, sink, k):
        ctx.sink, ctx.k = sink, k
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.sink[ctx.k] = grad
        return None, None, None, None


def _loose_outputs(values: list, flags: list[bool], fixed: set[int]) -> set[int]:
    """Positions of the differentiable outputs in ``values`` whose storage is dense, their own (no other output, input,
    parameter or buffer shares it: a copy would free what the step keeps) and whose copy has its strides."""
    ptrs = [t.untyped_storage().data_ptr() for t in values]
    return {k for k, (t, f) in enumerate(zip(values, flags))
            if f and ptrs.count(ptrs[k]) == 1 and ptrs[k] not in fixed and t.is_floating_point()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.is_contiguous()}


class _Seeded(torch.autograd.Function):
    """A scalar whose backward makes the gradients of ``outs`` (``make()``, one per output) and hands them on, so that
    autograd holds them alone and frees each once consumed, as in a real step, where no Python name holds an
    output's gradient (an isolated backward started from Python-held gradients keeps them to its end)."""

    @staticmethod
    def forward(ctx, make, *outs):
        ctx.make = make
        return torch.zeros((), device=outs[0].device)  # (real, whatever the outputs' dtype)

    @staticmethod
    def backward(ctx, _):
        return (None, *ctx.make())


# the cases NodeCost.bwd_sum_workspaces measures (each also with "-freed")
SUM_CASES = ("inputs", "parameters", "both", "parameters-inplace", "both-inplace")


def _backward_with_earlier_grads(local: dict, leaves: list, held: list, taken: list, params: list, fn,
                                 wanted: list[bool], fmts: list, own_casts: bool, fixed: set[int], part,
                                 device: torch.device, seeds_freed: bool = False, taken_owned: bool = False,
                                 release: bool = False) -> int:
    """Run a node's isolated forward and, under ``part`` (a tracker or a tracker's mark), its backward, where the
    tensors in ``held`` and ``taken`` (leaves, parameters) already have a gradient when it starts, made as a view of a
    larger one by a reader later in forward order, whose backward ran first. Autograd adds each of the node's
    contributions to them into a new tensor as soon as the function making it returns (``accumulate`` in
    torch/csrc/autograd/input_buffer.cpp): inside a backward that runs several functions (``nn.GRUCell``'s), beside
    what the later ones allocate. For ``held``, the larger gradient stays (``torch.stack`` of RNN states: the others'
    slices hold it); it is made before the measured part. For ``taken``, the view is all that holds it (a
    parameter's first contribution, a ``Linear``'s transposed weight gradient): made in the measured part, by
    autograd, which frees it once the sum replaces it. With ``taken_owned``, their gradient is a tensor of its own
    instead (a parameter's sum of two contributions or more), into which autograd adds each contribution in place,
    freeing the contribution. With ``seeds_freed``, the output's gradients are made there
    too, held by autograd alone (see :class:`_Seeded`). With ``release``, ``local`` is cleared before the backward,
    so that the inputs ``make_env(release=[])`` copied are held by the saved tensors alone, and so are the node's
    outputs: one root hands on their gradients (made there, or the ones held) and holds no output (see
    ``NodeCost.bwd_released_workspaces``). Returns the bytes made in the measured part before the
    node's backward, which the caller takes off its peak. ``local`` and ``leaves`` are ``make_env``'s, the other
    arguments as the node's first backward had them."""
    with _noting_saves(None, fixed):
        outs = [t for t, w in zip([t for t in tensors_in(fn(local)) if isinstance(t, torch.Tensor)], wanted)
                if t.requires_grad and w]
    if own_casts:
        torch.clear_autocast_cache()
    with _no_autocast(device):
        # made after the node's outputs, so that autograd runs their backward first
        ahead = [torch.stack([t]) for t in held]
        later = [t.add(0) if taken_owned else torch.stack([t]) for t in taken]  # (AddBackward passes the seed on)
        made = (outs if seeds_freed else []) + later
        if release:  # (the outputs too: one root hands on their gradients, held or made there, and holds no output)
            metas = [torch.empty_like(t, device="meta") for t in outs]  # (shapes, dtypes and strides)
            kept = [] if seeds_freed else [_seed(t, f) for t, f in zip(outs, fmts)]

            def make(metas=metas, kept=kept, later=later):
                return (kept or [_seed(m, f, device) for m, f in zip(metas, fmts)]) + [
                    torch.zeros_like(t) for t in later]
            roots, seeds = ahead, [torch.zeros_like(t) for t in ahead]
            if outs or later:
                roots.append(_Seeded.apply(make, *outs, *later))
                seeds.append(torch.ones((), device=device))
        else:
            roots = ([] if seeds_freed else outs) + ahead
            seeds = ([] if seeds_freed else [_seed(t, f) for t, f in zip(outs, fmts)]) + [
                torch.zeros_like(t) for t in ahead]
            if made:
                def make(outs=outs, later=later):
                    return ([_seed(t, f) for t, f in zip(outs, fmts)] if seeds_freed else []) + [
                        torch.zeros_like(t) for t in later]
                roots.append(_Seeded.apply(make, *made))
                seeds.append(torch.ones((), device=device))
    nbytes = sum(t.numel() * t.element_size() for t in made)
    if release:
        local.clear()
        del outs, made
    with part, _no_autocast(device):
        grads = torch.autograd.grad(roots, leaves + params, seeds, allow_unused=True)
    del grads
    return nbytes


def _backward_functions(outs: list[torch.Tensor], leaves: list[torch.Tensor]) -> int:
    """How many of autograd's functions (``AccumulateGrad`` aside) run between ``outs`` and ``leaves``: a node's
    backward that runs more than one may free its output's gradient before its end."""
    stack, seen = [t.grad_fn for t in outs if t.grad_fn is not None], set()
    while stack:
        f = stack.pop()
        if f is None or f in seen or type(f).__name__ == "AccumulateGrad":
            continue
        seen.add(f)
        stack.extend(g for g, _ in f.next_functions)
    return len(seen)


def _time_stats_recompute(cost: NodeCost, forward, setup, device: torch.device, repeats: int) -> None:
    """``cost.recompute_seconds`` and ``cost.stats_bytes`` of a node whose batch-norm calls
    ``bn-saved-stats`` applies to (every call; a node with none, or with one it does not apply to, keeps
    ``None``). A node in a region pays the recording in its forward pass too, so ``recompute_seconds`` is the
    replay's time plus what recording adds to the forward; where that is not below ``fwd_seconds`` the node
    keeps ``None`` (tiny BatchNorms, where the Python around the replay outweighs the statistics)."""
    from memfit.variants.bn_saved_stats import RecordStats, ReplayStats

    rec = RecordStats()
    with rec:
        forward(setup())
    if not rec.stats or None in rec.stats:
        return

    def record(env_leaves):
        with RecordStats():
            return forward(env_leaves)

    def replay(env_leaves):
        with ReplayStats(list(rec.stats)):
            return forward(env_leaves)

    extra = max(0.0, median_seconds(record, device, repeats, setup=setup) - cost.fwd_seconds)
    seconds = median_seconds(replay, device, repeats, setup=setup) + extra
    if seconds < cost.fwd_seconds:
        cost.recompute_seconds = seconds
        cost.stats_bytes = rec.nbytes


def _time_nodes(gm: fx.GraphModule, inputs: tuple, costs: Costs, device: torch.device, repeats: int,
                requires: dict[str, list[bool]] | None = None, saved_stats: bool = False) -> None:
    """Median forward and backward time of each node (and of its variants), run in isolation on detached
    copies of its inputs (made outside the timed part: an in-place implementation runs on a fresh copy).
    With ``saved_stats``, also the time of the recomputation of each node that ``bn-saved-stats`` applies to
    (``NodeCost.recompute_seconds``, at most its forward time) and the bytes of the statistics it keeps."""
    for (node, fn0, make_env, params), cost in zip(_isolated(gm, inputs, requires), costs.nodes):
        for _, fn, record, clone in _implementations(gm, node, fn0, cost):

            def setup(make_env=make_env, clone=clone):
                return make_env(clone=clone)

            def forward(env_leaves, fn=fn):
                return fn(env_leaves[0])

            try:
                record.fwd_seconds = median_seconds(forward, device, repeats, setup=setup)
            except RuntimeError as exc:
                if is_out_of_memory(exc):  # (PyTorch's own error: no fault of the node's)
                    raise
                raise ValueError(_alone_failed(gm, node, exc)) from exc
            if saved_stats and record is cost:
                _time_stats_recompute(cost, forward, setup, device, repeats)
            if not any(t.requires_grad for t in tensors_in(forward(setup()))) or not (params or make_env()[1]):
                continue

            def backward(env_leaves, fn=fn, params=params):
                local, leaves = env_leaves
                outs = [t for t in tensors_in(fn(local)) if t.requires_grad]
                with _no_autocast(device):
                    torch.autograd.grad(outs, leaves + params, [torch.ones_like(t) for t in outs],
                                        allow_unused=True)

            record.bwd_seconds = max(0.0, median_seconds(backward, device, repeats, setup=setup) - record.fwd_seconds)
