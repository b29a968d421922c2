"""BatchNorm -> in-place activation pairs in a traced graph, and the graph with them run from BatchNorm's output.

PyTorch's BatchNorm saves its *input* (the convolution's output) for its backward pass, and torchvision writes
the activation after it in place over its output (``nn.ReLU(inplace=True)``, ``F.relu(x, inplace=True)``). A
checkpoint region that drops the convolution's output therefore starts at that input and normalizes it again
in the backward pass. In-place activated BatchNorm (Rota Bulo, Porzi, Kontschieder, CVPR 2018, section 3;
MONeT, Shah et al., ICLR 2021, section 4) computes BatchNorm's backward from its output instead
(:mod:`memfit.variants.bn_from_output`): keep the BatchNorm's output, run the activation out of place, and a
region can start after the BatchNorm and recompute only the activation. On MobileNet-V2 at 40% of its
activation peak that took a CPU step from 1.20x to 1.09x plain PyTorch's (BENCHMARKS.md).

That is not a per-node variant: the activation's output becomes a storage of its own instead of the
BatchNorm's, and the planner's accounting fixes each node's output storages. So, as with striped blocks
(:mod:`memfit.graph.tiling`), :func:`apply_bn_from_output` rewrites the graph and the planner profiles and
solves the rewritten graph beside the traced one (:func:`memfit.api.plan`), keeping the faster plan; the
plan names the BatchNorm nodes it rewrote (``Plan.bn_from_output``) and the planned module rewrites its graph
the same way. Node names do not change, but for the ReLUs of BatchNorm -> ReLU -> convolution triples (below),
which become part of the convolution's node.

A pair is a training-mode ``nn.BatchNorm1d/2d/3d`` node whose only reader is an in-place ``nn.ReLU6`` or
``nn.Hardtanh`` module or an ``F.hardtanh(x, ..., inplace=True)`` / ``F.relu6(x, inplace=True)`` call (or, as a
triple, an ``nn.ReLU`` / ``F.relu`` / ``torch.relu``, in place or not, whose only reader is an ``nn.Conv2d``
module with numeric zero padding called on it alone), none with hooks, and whose weight has no channel that is zero or tiny against its bias (BatchNorm's output then
does not give back its input to float32 rounding: a zero-initialized residual BatchNorm;
:func:`memfit.variants.bn_from_output.ill_conditioned`). A weight that becomes so during training makes that
BatchNorm run as PyTorch's own, with a warning (:class:`WeightCheck`: one synchronization per step on CUDA), and
so does a planned module made with such weights (a plan loaded onto other weights), when it is built. Half-precision
outputs (float16, bfloat16: a plain ``.to()`` or ``torch.autocast``) are left as traced: their rounding is 2**8 to
2**16 times float32's, so a bias larger than the weight already costs precision, and training soon makes one so
(:func:`memfit.variants.bn_from_output.condition_limit`). PyTorch's in-place ``hardtanh_`` saves a copy of its
input, so there the out-of-place form costs nothing and saves that copy. An in-place ``ReLU`` or ``LeakyReLU``
saves its result in its operand and allocates nothing: out of place it allocates and writes a tensor more, and on the CPU
that cost as much as the recomputation it spared (ResNet-50 and GoogLeNet, measured with
``benchmarks/bn_from_output_check.py``, which rewrites those too), so those pairs are left as traced.

Where such a ReLU's one reader is an ``nn.Conv2d`` (a bottleneck block's first two convolutions in ResNets, most
of GoogLeNet's and UNet's), :func:`apply_bn_from_output` can also run the ReLU and the convolution as one call,
:class:`ReluConvCall` (:mod:`memfit.variants.relu_conv`): it saves the BatchNorm's output (which that BatchNorm
saves anyway) instead of the ReLU's and computes the ReLU again in its backward pass, so one activation-sized
tensor is kept where PyTorch keeps two (the convolution's output before the BatchNorm, and the ReLU's), without
a checkpoint region. The planner does not offer it (``bn_activation_pairs(..., relu_conv=True)`` lists these
triples): on this project's CPU it cost more than the recomputation it spared. ResNet-50 (8 x 128) with every
triple rewritten (32) kept 83% of its activations with no recomputation at a step predicted 1.03x plain
PyTorch's, but its plans measured 1.18x at a third of the activation peak and 1.15x at 40%, against the traced
graph's 1.13x and 1.13x in the same process (2026-12-06); the convolution rewritten loses ``conv-native`` and
``conv-split-backward``, which set UNet's floor (2 x 96: 59% of its activation peak at 1.36x, against 45% at 1.08x).
``benchmarks/bn_from_output_check.py --graphs relu-conv`` measures it.

The rewritten calls read the model's own modules at every call (mode,
bounds), so ``model.eval()`` and changed settings carry over; a module hook added to one of them after planning makes
it run as PyTorch's own (the activation on a copy of its input), with a warning. Gradients equal PyTorch's to float32
rounding, not bit for bit: the normalized input comes back from the rounded output, with an error of about
``ulp(y) / |weight|`` per element.
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from memfit.graph.attributes import has_hooks
from memfit.graph.capture import Captured, graph_of
from memfit.variants.bn_from_output import (
    HALF_DTYPES,
    bn_from_output,
    condition_limit,
    ill_conditioned,
    ill_conditioned_channels,
)
from memfit.variants.relu_conv import relu_conv
from memfit.variants.replaceable import replaceable

__all__ = ["BFO_ATTR", "ReluConvCall", "apply_bn_from_output", "bn_activation_pairs", "flagged_now",
           "has_bn_from_output", "ran_in_half_precision", "relu_conv_triples"]

#: attribute of the rewritten GraphModule holding the rewritten calls
BFO_ATTR = "memfit_bn_from_output"
_ACTIVATIONS = (nn.ReLU6, nn.Hardtanh)
_FUNCTIONS = (F.hardtanh, F.relu6)
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_RELU_FUNCTIONS = (F.relu, torch.relu)


class WeightCheck:
    """Which of the rewritten BatchNorms ``bns`` have a weight that :func:`ill_conditioned` flags for the dtype of
    their output, looked at again whenever a weight changed (its tensor or its version counter: each optimizer
    step), for all of them at once: one host-device synchronization per training step on CUDA, none while no
    weight changed (a recomputation, a frozen model). ``dtypes`` collects the output dtypes it was asked about
    (the planner does not rewrite BatchNorms that ran in half precision: :func:`ran_in_half_precision`)."""

    def __init__(self, bns: list[nn.modules.batchnorm._BatchNorm]):
        self.bns = bns
        self.dtypes: set[torch.dtype] = set()
        self._key: tuple | None = None
        self._bad: dict[torch.dtype | None, list[bool]] = {}

    def bad(self, k: int, dtype: torch.dtype | None = None) -> bool:
        """Whether ``bns[k]``, with an output of ``dtype`` (its weight's by default), must run as PyTorch's own
        BatchNorm now. The weights are looked at when the first rewritten BatchNorm asks (each forward pass starts
        there), not at every call."""
        if not k or self._key is None:
            key = tuple((id(bn.weight), bn.weight._version) if bn.weight is not None else None for bn in self.bns)
            if key != self._key:
                self._bad = {}
                self._key = key
        if dtype is not None:
            self.dtypes.add(dtype)
        flags = self._bad.get(dtype)
        if flags is None:
            flags = self._bad[dtype] = self._flags(dtype)
        return flags[k]

    def _flags(self, dtype: torch.dtype | None) -> list[bool]:
        """:func:`ill_conditioned` of every BatchNorm for an output of ``dtype``, computed over the concatenated
        weights and biases of each device and weight dtype (a handful of kernels and one ``.tolist()`` however many
        BatchNorms there are; one call per BatchNorm cost 0.7 ms a step on MobileNet-V2's 52 on the CPU, and about
        300 kernel launches on CUDA)."""
        groups: dict[tuple, list[int]] = {}
        for k, bn in enumerate(self.bns):
            if bn.weight is not None:
                groups.setdefault((bn.weight.device, bn.weight.dtype), []).append(k)
        out = [False] * len(self.bns)
        for (device, wdtype), ks in groups.items():
            weights = [self.bns[k].weight for k in ks]  # shape (C,)
            biases = [bn.bias.to(device, wdtype) if (bn := self.bns[k]).bias is not None else torch.zeros_like(w)
                      for k, w in zip(ks, weights)]  # a zero bias flags what no bias does
            bad = ill_conditioned_channels(torch.cat(weights), torch.cat(biases), dtype)
            owner = torch.repeat_interleave(torch.arange(len(ks), device=device),
                                            torch.tensor([w.numel() for w in weights], device=device))
            flags = torch.zeros(len(ks), dtype=torch.int64, device=device).index_add_(0, owner, bad.long())
            for k, flag in zip(ks, flags.gt(0).tolist()):
                out[k] = flag
        return out


class BatchNormFromOutputCall(nn.Module):
    """The model's BatchNorm ``bn`` (read at every call: its mode, momentum, eps, parameters and buffers) run
    as :func:`memfit.variants.bn_from_output.bn_from_output`, with ``nn.BatchNorm``'s own bookkeeping
    (``num_batches_tracked``, ``momentum=None``). Input and output ``(N, C, *)``.

    It runs ``bn`` itself, PyTorch's own BatchNorm (which also saves its input, beyond the plan), with a warning,
    where a module hook was added to ``bn`` after planning, or where ``check`` (a :class:`WeightCheck` over every
    rewritten BatchNorm, ``bn`` its ``index``-th) finds a weight too small for the output to give back the input
    to the output dtype's rounding (a weight gradient 4.6x off at ``|weight| = 1e-7``: a fresh user's finding;
    :func:`memfit.variants.bn_from_output.condition_limit`). ``name``: ``bn``'s path in the model, for the
    warnings."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, check: WeightCheck | None = None, index: int = 0,
                 name: str = ""):
        super().__init__()
        self.bn = bn
        self.check = check if check is not None else WeightCheck([bn])
        self.index = index if check is not None else 0
        self.name = name
        self.warned = self.warned_hook = False

    def __call__(self, x: Tensor) -> Tensor:
        """``forward``, without ``nn.Module``'s hooks: a global module hook sees the model's BatchNorm, never this
        wrapper (a fresh user's hook on every ``BatchNorm2d`` was skipped, and logging hooks met modules that are not
        in the model)."""
        return self.forward(x)

    def forward(self, x: Tensor) -> Tensor:
        bn = self.bn
        if has_hooks([bn]):  # a hook (its own, or global) sees PyTorch's own BatchNorm (which saves its input)
            _warn_hooked(self, bn)
            return bn(x)
        if self.check.bad(self.index, x.dtype):
            if not self.warned:
                self.warned = True
                limit, dtype = condition_limit(x.dtype), str(x.dtype).removeprefix("torch.")
                warnings.warn(f"memfit: a channel of {_label(self.name, bn)}'s weight is 0, tiny, or below "
                              f"1/{limit:g} of its bias (the limit for a {dtype} output), so its backward "
                              "pass from the output would lose precision: it runs as PyTorch's own BatchNorm, which "
                              "also saves its input, so the step may go over the plan's peak. Plan again (the "
                              "planner leaves such BatchNorms as they are).", stacklevel=2)
            return bn(x)
        bn._check_input_dim(x)
        factor = 0.0 if bn.momentum is None else bn.momentum
        if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
            factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
        batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
        buffers = not bn.training or bn.track_running_stats
        return bn_from_output(x, bn.running_mean if buffers else None, bn.running_var if buffers else None,
                              bn.weight, bn.bias, batch_stats, factor, bn.eps)

    def node_op(self) -> str:
        """What :func:`memfit.graph.calls.node_ops` records for this node: the BatchNorm's settings."""
        return f"{type(self.bn).__name__}({self.bn.extra_repr()}) from its output"


class OutOfPlaceCall(nn.Module):
    """The model's in-place ``nn.Hardtanh`` / ``nn.ReLU6`` ``act`` (its bounds read at every call) run out of
    place: the same values and gradients, bit for bit, into a new tensor."""

    def __init__(self, act: nn.Module, name: str = ""):
        super().__init__()
        self.act = act
        self.name = name  # the activation's path in the model, for the warning
        self.warned_hook = False

    def __call__(self, x: Tensor) -> Tensor:
        """``forward``, without ``nn.Module``'s hooks (as :class:`BatchNormFromOutputCall`)."""
        return self.forward(x)

    def forward(self, x: Tensor) -> Tensor:
        if has_hooks([self.act]):  # a hook (its own, or global): the module itself, on a copy it may overwrite
            _warn_hooked(self, self.act)
            return self.act(x.clone())
        return F.hardtanh(x, self.act.min_val, self.act.max_val)  # (nn.ReLU6 is nn.Hardtanh(0, 6))

    def node_op(self) -> str:
        """What :func:`memfit.graph.calls.node_ops` records for this node: the activation's settings."""
        return f"{type(self.act).__name__}({self.act.extra_repr()}) out of place"


class ReluConvCall(nn.Module):
    """The model's convolution ``conv`` (an ``nn.Conv2d``, read at every call) of the ReLU ``act`` (the model's
    ``nn.ReLU``, or ``None`` for ``F.relu`` / ``torch.relu``) of a BatchNorm's output ``y``, run as
    :func:`memfit.variants.relu_conv.relu_conv`: it saves ``y``, which the BatchNorm run from its output saves
    anyway, instead of ``relu(y)``. Input ``[N, C_in, H, W]``, output ``[N, C_out, H_out, W_out]``; the same values
    and gradients, bit for bit, as ``conv(act(y))``.

    It runs the model's modules themselves (the ReLU on a copy of ``y``, which the BatchNorm still needs), saving
    ``relu(y)`` as well, beyond the plan, with a warning, where a module hook was added to either after planning,
    and without one where ``conv`` was changed to padding that is not numeric zeros. ``names``: the two modules'
    paths in the model, for the warning."""

    def __init__(self, conv: nn.Conv2d, act: nn.Module | None, names: tuple[str, str] = ("", "")):
        super().__init__()
        self.conv = conv
        self.act = act
        self.name, self.act_name = names
        self.warned_hook = False

    def __call__(self, y: Tensor) -> Tensor:
        """``forward``, without ``nn.Module``'s hooks (as :class:`BatchNormFromOutputCall`)."""
        return self.forward(y)

    def forward(self, y: Tensor) -> Tensor:
        conv, act = self.conv, self.act
        hooked = [m for m in (conv, act) if m is not None and has_hooks([m])]
        if hooked:
            _warn_hooked(self, hooked[0], self.name if hooked[0] is conv else self.act_name)
        if hooked or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            return conv(act(y.clone()) if act is not None else F.relu(y))
        return relu_conv(y, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)

    def node_op(self) -> str:
        """What :func:`memfit.graph.calls.node_ops` records for this node: the convolution's settings."""
        return f"{type(self.conv).__name__}({self.conv.extra_repr()}) of ReLU"


def _label(name: str, module: nn.Module) -> str:
    """``module`` for a warning: its path in the model and its settings (``blocks.0.bn1 (BatchNorm2d(64, ...))``)."""
    what = f"{type(module).__name__}({module.extra_repr()})"
    return f"{name} ({what})" if name else what


def _calls(captured: Captured) -> list[BatchNormFromOutputCall]:
    """The rewritten BatchNorm calls of ``captured`` (the output of :func:`apply_bn_from_output`), in order."""
    holder = getattr(captured.gm, BFO_ATTR, None)
    return [c for c in holder.children() if isinstance(c, BatchNormFromOutputCall)] if holder is not None else []


def ran_in_half_precision(captured: Captured) -> bool:
    """Whether a BatchNorm that ``captured`` (the output of :func:`apply_bn_from_output`) runs from its output has
    had a float16 or bfloat16 input, e.g. while it was profiled under ``torch.autocast``: there a weight is ill
    conditioned as soon as a bias outgrows it (:func:`memfit.variants.bn_from_output.condition_limit`), which
    training soon makes so, and the BatchNorm then runs as PyTorch's own, over the plan. (The calls share one
    :class:`WeightCheck`.)"""
    calls = _calls(captured)
    return bool(calls) and any(d in HALF_DTYPES for d in calls[0].check.dtypes)


def flagged_now(captured: Captured) -> list[str]:
    """The BatchNorms (paths in the model) that ``captured`` (the output of :func:`apply_bn_from_output`) runs from
    their output but whose weight :func:`ill_conditioned` now flags (at its own dtype): weights loaded or
    changed after planning. They will run as PyTorch's own, which also saves their input."""
    return [c.name or type(c.bn).__name__ for c in _calls(captured) if c.check.bad(c.index)]


def _warn_hooked(call: nn.Module, module: nn.Module, name: str | None = None) -> None:
    """Warn (once per rewritten call: under ``warnings.simplefilter("always")`` it came every step) that ``module``
    (at path ``name``, by default ``call.name``) has a hook added after planning."""
    if call.warned_hook:
        return
    call.warned_hook = True
    warnings.warn(f"memfit: {_label(call.name if name is None else name, module)} has a module hook (its own, registered after planning, or a "
                  "global one: torch.nn.modules.module.register_module_forward_hook), so the plan runs it as PyTorch's "
                  "own so that the hook runs (BatchNorm then saves its input as well: the step may go over the plan). "
                  "Plan with its own hook registered; a global hook keeps it so.", stacklevel=3)


def _inplace_activation(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        act = gm.get_submodule(n.target)
        return type(act) in _ACTIVATIONS and act.inplace is True and replaceable(act)
    if n.op != "call_function" or n.target not in _FUNCTIONS:
        return False
    try:  # (F.hardtanh(x, 0.0, 6.0, True): the flag may come by position)
        bound = inspect.signature(n.target).bind(*n.args, **n.kwargs)
    except TypeError:
        return False
    return bound.arguments.get("inplace") is True


def _relu(gm: fx.GraphModule, n: fx.Node) -> bool:
    """``n`` is a ReLU of its one argument: an ``nn.ReLU`` module without hooks, or ``F.relu`` / ``torch.relu``
    (in place or not)."""
    if n.op == "call_module":
        return type(gm.get_submodule(n.target)) is nn.ReLU and replaceable(gm.get_submodule(n.target))
    if n.op != "call_function" or n.target not in _RELU_FUNCTIONS:
        return False
    if n.target is torch.relu:  # (a builtin: no signature to bind)
        return len(n.args) == 1 and not n.kwargs and isinstance(n.args[0], fx.Node)
    try:
        bound = inspect.signature(n.target).bind(*n.args, **n.kwargs)
    except (TypeError, ValueError):
        return False
    return len(bound.arguments) <= 2 and isinstance(n.args[0] if n.args else None, fx.Node)


def _conv_of(gm: fx.GraphModule, n: fx.Node) -> fx.Node | None:
    """The one reader of ``n`` if it is an ``nn.Conv2d`` module (exact type, no hooks, numeric zero padding)
    called on ``n`` alone, else ``None``."""
    if len(n.users) != 1:
        return None
    user = next(iter(n.users))
    if user.op != "call_module" or user.args != (n,) or user.kwargs:
        return None
    conv = gm.get_submodule(user.target)
    ok = (type(conv) is nn.Conv2d and replaceable(conv) and conv.padding_mode == "zeros"
          and not isinstance(conv.padding, str))
    return user if ok else None


def bn_activation_pairs(gm: fx.GraphModule, weights: bool = True, relu_conv: bool = False) -> list[str]:
    """The BatchNorm nodes of ``gm`` that :func:`apply_bn_from_output` can rewrite (see the module docstring),
    in graph order: those whose one reader is an in-place ReLU6 / Hardtanh, and, with ``relu_conv``, those whose
    one reader is a ReLU whose one reader is an ``nn.Conv2d`` (:func:`relu_conv_triples`; the planner does not
    offer these: see the module docstring); with ``weights``, only those whose weight :func:`ill_conditioned`
    does not flag."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_module" or not isinstance(n.target, str):
            continue
        bn = gm.get_submodule(n.target)
        if type(bn) not in _BATCHNORMS or not bn.training or not replaceable(bn) or len(n.users) != 1:
            continue
        if weights and bool(ill_conditioned(bn.weight, bn.bias)):
            continue
        act = next(iter(n.users))
        if _inplace_activation(gm, act) or (relu_conv and _relu(gm, act) and _conv_of(gm, act) is not None):
            out.append(n.name)
    return out


def relu_conv_triples(gm: fx.GraphModule, names: list[str]) -> dict[str, tuple[str, str]]:
    """Of the BatchNorm nodes ``names`` of ``gm``, those followed by a ReLU and a convolution (the ReLU's one
    reader, an ``nn.Conv2d`` called on it alone), each mapped to ``(relu node, convolution node)``:
    :func:`apply_bn_from_output` runs the two as one :class:`ReluConvCall`."""
    by_name = {n.name: n for n in gm.graph.nodes}
    out = {}
    for name in names:
        node = by_name.get(name)
        if node is None or len(node.users) != 1:
            continue
        act = next(iter(node.users))
        conv = _conv_of(gm, act) if _relu(gm, act) else None
        if conv is not None:
            out[name] = (act.name, conv.name)
    return out


def has_bn_from_output(captured: Captured) -> bool:
    """``captured`` is the output of :func:`apply_bn_from_output` (with at least one pair rewritten)."""
    return hasattr(captured.gm, BFO_ATTR)


def apply_bn_from_output(captured: Captured, names: list[str]) -> Captured:
    """A copy of ``captured`` whose BatchNorm nodes ``names`` run from their output
    (:class:`BatchNormFromOutputCall`) and whose activations after them run out of place
    (:class:`OutOfPlaceCall`, or the call with ``inplace=False``). The original ``captured`` is not changed;
    the copy shares the model's modules, parameters and buffers, and keeps every node name.

    Raises:
        ValueError: a name is not a BatchNorm node of this graph followed by an in-place activation
            (:func:`bn_activation_pairs`), or is given twice.
    """
    if not names:
        return captured
    gm = captured.gm
    # (a weight that became small runs as PyTorch's own; a plan made with ReLU -> convolution triples replays them)
    known = set(bn_activation_pairs(gm, weights=False, relu_conv=True))
    bad = [n for n in names if n not in known]
    if bad or len(set(names)) != len(names):
        by_name = {n.name: n for n in gm.graph.nodes}
        node = by_name.get(bad[0]) if bad else None
        module = gm.get_submodule(node.target) if node is not None and node.op == "call_module" else None
        if isinstance(module, _BATCHNORMS) and not module.training:
            raise ValueError(f"the plan runs BatchNorm {node.target!r} from its output (bn_from_output), which it made "
                             "with that BatchNorm in training mode, and it is in eval() now: put it back in training "
                             "mode (model.train()) before applying the plan, apply the plan first and call eval() on "
                             "it after (which needs no new plan), or make a plan with it in eval()")
        what = f"{bad[0]!r}, which is not" if bad else "a node twice; each must be"
        raise ValueError(f"plan runs BatchNorm from its output (bn_from_output) at {what} a training BatchNorm "
                         "whose only reader is an in-place ReLU6 or Hardtanh, or a ReLU read by a Conv2d only, in "
                         "this graph "
                         "(memfit.graph.bn_output.bn_activation_pairs lists those): make the plan for this model")
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    new = fx.GraphModule(gm, graph, type(gm).__name__)
    holder = nn.Module()
    new.add_module(BFO_ATTR, holder)
    by_name = {n.name: n for n in graph.nodes}
    check = WeightCheck([new.get_submodule(by_name[name].target) for name in names])
    triples = relu_conv_triples(gm, names)
    for k, name in enumerate(names):
        node = by_name[name]
        act = next(iter(node.users))
        holder.add_module(f"bn{k}", BatchNormFromOutputCall(new.get_submodule(node.target), check, k, node.target))
        # (the modules a call runs: the planned module's hook check treats them as called, not traced into)
        node.meta["memfit_module"], node.target = (node.target,), f"{BFO_ATTR}.bn{k}"
        if name in triples:  # ReLU -> Conv2d: one call reading the BatchNorm's output, the ReLU node gone
            conv = by_name[triples[name][1]]
            relu = new.get_submodule(act.target) if act.op == "call_module" else None
            paths = (conv.target, act.target if relu is not None else "")
            holder.add_module(f"conv{k}", ReluConvCall(new.get_submodule(conv.target), relu, paths))
            conv.meta["memfit_module"] = paths if relu is not None else paths[:1]  # (the paths of what it runs)
            conv.target, conv.args = f"{BFO_ATTR}.conv{k}", (node,)
            graph.erase_node(act)
        elif act.op == "call_module":
            holder.add_module(f"act{k}", OutOfPlaceCall(new.get_submodule(act.target), act.target))
            act.meta["memfit_module"], act.target = (act.target,), f"{BFO_ATTR}.act{k}"
        else:
            bound = inspect.signature(act.target).bind(*act.args, **act.kwargs)
            bound.arguments["inplace"] = False
            act.args, act.kwargs = bound.args, bound.kwargs
    new.recompile()
    return Captured(gm=new, graph=graph_of(new), model=captured.model, attributes=captured.attributes,
                    called=captured.called, fixed_args=captured.fixed_args, unread_args=captured.unread_args,
                    autocast_tests=captured.autocast_tests)
