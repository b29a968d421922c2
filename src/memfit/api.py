"""The public verbs: :func:`plan` solves, :func:`optimize` solves and wraps."""

from __future__ import annotations

import difflib
import functools
import os
import types
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from memfit.budget import Budget, fmt_bytes
from memfit.graph.attributes import collects_in_call
from memfit.graph.bn_output import (
    apply_bn_from_output,
    bn_activation_pairs,
    ran_in_half_precision,
    relu_conv_triples,
)
from memfit.graph.calls import (
    bind_inputs,
    check_var_positional,
    forward_arguments,
    forward_params,
    in_traced_order,
    input_values,
    map_tensors,
    node_inputs,
    node_ops,
    tensors_in,
)
from memfit.graph.capture import Captured, TraceError, capture, check_traced_outputs, refuse_decorated_forward
from memfit.graph.tiling import apply_tiling, chain_blocks
from memfit.profile.costs import SPARSE_ADVICE, Costs, profile_graph
from memfit.profile.link import measure_link
from memfit.profile.optimizer import (
    OptimizerCost,
    measure_optimizer,
    optimizer_options,
    optimizer_state_bytes,
)
from memfit.profile.tracker import live_bytes
from memfit.runtime.overhead import price_regions
from memfit.runtime.planned import (
    AUTOCAST_CACHE_DIFFERS,
    PlannedModule,
    autocast_dtype,
    conv_libraries,
    ddp_bucket_bytes,
    layouts_differ,
    memory_layout,
    state_layouts,
)
from memfit.runtime.stores import CopyEngine, HostStore, default_store
from memfit.solve.plan import Plan
from memfit.solve.strategies import OFFLOAD_STRATEGIES, InfeasibleBudgetError, make_plan, plan_at_floor
from memfit.solve.tiling import Option, best_plan_rounding, share_timings, tiling_candidates
from memfit.variants.bn_from_output import HALF_DTYPES
from memfit.warn import warn_user


def _shapes(inputs: tuple) -> list[list[int]]:
    return [list(t.shape) for t in inputs if isinstance(t, torch.Tensor)]


def _dtypes(inputs: tuple) -> list[str]:
    return [str(t.dtype) for t in inputs if isinstance(t, torch.Tensor)]


def _layouts(inputs: tuple) -> list[str]:
    return [memory_layout(t) for t in inputs if isinstance(t, torch.Tensor)]


def state_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Shape of each tensor of ``model.state_dict()`` (parameters and buffers), by key."""
    return {k: list(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def state_dtypes(model: nn.Module) -> dict[str, str]:
    """Dtype of each tensor of ``model.state_dict()``, by key (``"torch.float32"``)."""
    return {k: str(v.dtype) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def state_roles(model: nn.Module) -> dict[str, str]:
    """What each tensor of ``model.state_dict()`` is, by key: ``"trainable parameter"``, ``"frozen parameter"``
    or ``"buffer"``, or ``"tied to <key>"`` when it is the tensor of an earlier key (tied weights). Two models
    with the same shapes can differ here, and their gradients and optimizer state with it."""
    roles: dict[str, str] = {}
    first: dict[int, str] = {}
    params = {id(p) for p in model.parameters()}
    for k, v in model.state_dict(keep_vars=True).items():
        if not isinstance(v, torch.Tensor):
            continue
        if id(v) in first:
            roles[k] = f"tied to {first[id(v)]}"
            continue
        first[id(v)] = k
        roles[k] = ("trainable parameter" if v.requires_grad else "frozen parameter") if id(v) in params else "buffer"
    return roles


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"memfit plans a torch.nn.Module, not {type(model).__name__}: wrap the function in a module "
                        "(class Net(nn.Module) with the computation in forward and its weights as parameters)")
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        # (a fresh user's DataParallel model got fx's advice about iterating over traced values)
        kind = type(model).__name__
        raise TypeError(f"memfit plans the module a {kind} wraps, not the {kind} itself: plan model.module "
                        f"(planned = memfit.optimize(model.module, ...)) and wrap the planned module "
                        f"({kind}(planned)))")


def _require_training(model: nn.Module) -> None:
    if isinstance(model, PlannedModule):
        raise TypeError("this model is already planned (a PlannedModule): to plan again, for another budget or "
                         "strategy, pass the model it wraps, planned.model")
    nested = next((name for name, m in model.named_modules() if name and isinstance(m, PlannedModule)), None)
    if nested is not None:  # (fx traced into it: a TraceError about an InplaceProxy at memfit's own line)
        path = "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in nested.split("."))
        raise TypeError(f"the model's submodule {nested!r} is already planned (a PlannedModule): memfit plans the "
                        f"whole model at once. Put the module it wraps in its place ({path} = {path}.model, or "
                        "build the model from the unplanned module) and plan the model")
    if not model.training:
        raise ValueError("memfit plans a training step: call model.train() first")
    lazy = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
            if isinstance(t, torch.nn.parameter.UninitializedTensorMixin)]
    if lazy:
        raise ValueError(f"the model has lazy modules whose parameters are not initialized yet ({', '.join(lazy[:3])}"
                         f"{', ...' if len(lazy) > 3 else ''}): initialize them with one forward pass that changes nothing else "
                         "(model.eval(); with torch.no_grad(): model(example_batch); model.train()), then plan")


def _require_grad_mode() -> None:
    """Refuse to profile with gradients off: a fresh user's call under ``torch.no_grad()`` was told that nothing in
    the model trains, and to use ``no_grad``; under ``torch.inference_mode()`` PyTorch raised "Inference tensors do
    not track version counter"."""
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        where = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
        raise RuntimeError(f"memfit plans a training step, and gradients are off here (inside {where}, or after "
                           "torch.set_grad_enabled(False)): make the plan outside that context, where the training "
                           "step's backward pass runs")


def _first_difference(what: str, theirs: dict, mine: dict) -> str | None:
    for key in sorted(set(mine) | set(theirs)):
        a, b = theirs.get(key), mine.get(key)
        if a == b:
            continue
        if a is None:
            return f"{key} is in this model but not in the plan's"
        if b is None:
            return f"{key} is in the plan's model but not in this one"
        return f"{key} has {what} {a} in the plan's model and {b} in this one"
    return None


def check_plan_fits(plan_: Plan, model: nn.Module, example_inputs, grads_exist: bool = False) -> None:
    """Check that a saved plan was made for this model (parameter and buffer shapes, dtypes and roles: trainable,
    frozen, buffer, tied), these input dtypes and
    shapes, this gradient convention and this autocast state (the optimizer: :func:`_check_optimizer_state`).

    Raises:
        ValueError: any of those differs from the plan's (its memory figures would not hold); the message
            names the first difference.
    """
    _require_training(model)
    given = _as_tuple(example_inputs, model)
    here = autocast_dtype(given)
    if (plan_.autocast or None) != here:
        made = f"under torch.autocast({plan_.autocast})" if plan_.autocast else "outside torch.autocast"
        now = f"under torch.autocast({here})" if here else "outside torch.autocast"
        raise ValueError(f"the plan was made {made}, and this call is {now}: activations differ in size. "
                         "Apply it in the same autocast state as it was made (and train in it), or make a "
                         "new plan")
    if here and plan_.autocast_cache is not None and plan_.autocast_cache != torch.is_autocast_cache_enabled():
        raise ValueError(f"the plan was made under torch.autocast(cache_enabled={plan_.autocast_cache}), and this call "
                         f"is under cache_enabled={torch.is_autocast_cache_enabled()}: {AUTOCAST_CACHE_DIFFERS} Apply it with "
                         "the cache setting it was made with (and train with it), or make a new plan")
    if plan_.grads_exist != grads_exist:
        made = "keeps gradients allocated" if plan_.grads_exist else "sets gradients to None (zero_grad())"
        raise ValueError(f"the plan was made for a training loop that {made}: pass grads_exist="
                         f"{plan_.grads_exist} if yours does, or make a new plan")
    shapes = _shapes(given)
    if plan_.input_shapes and shapes != plan_.input_shapes:
        smaller = len(shapes) == len(plan_.input_shapes) and all(
            len(a) == len(b) and all(x <= y for x, y in zip(a, b)) for a, b in zip(shapes, plan_.input_shapes))
        raise ValueError(f"the plan was made for inputs of shape {plan_.input_shapes}, not {shapes}: its "
                         "memory figures would not hold; make a new plan for these shapes" + (
                             ", or apply this one with an example batch of its shapes (a batch of your data, or "
                             "zeros of those shapes and your inputs' dtypes) and then call the planned module with "
                             "these: it runs smaller inputs (a last short batch) under its budget" if smaller else ""))
    # a parameter trainable in the plan and frozen now needs no gradient the plan counted: freezing after planning
    # needs no new plan, nor does resuming such a run from a checkpoint (a fresh user's resume was refused)
    roles = {key: ("trainable parameter" if role == "frozen parameter"
                   and plan_.state_roles.get(key) == "trainable parameter" else role)
             for key, role in state_roles(model).items()}
    for what, theirs, mine in (("shape", plan_.state_shapes, state_shapes(model)),
                               ("dtype", plan_.state_dtypes, state_dtypes(model)),
                               ("memory layout", plan_.state_layouts, state_layouts(model)),
                               ("role", plan_.state_roles, roles)):
        diff = _first_difference(what, theirs, mine) if theirs else None
        if diff and what == "memory layout":
            raise ValueError(f"the plan was made for the model in another memory layout: {diff} "
                             "(model.to(memory_format=...)); convert it back or make a new plan")
        if diff:
            raise ValueError(f"the plan was made for another model: {diff}; make a new plan for this model")
    missing = [name for name, got in (("input_shapes", plan_.input_shapes), ("state_shapes", plan_.state_shapes),
                                      ("state_dtypes", plan_.state_dtypes)) if not got]
    if missing and state_shapes(model):
        warnings.warn(f"the plan records no {', '.join(missing)}: memfit cannot check that it was made for this model "
                      "and these inputs, and its figures hold only if it was", stacklevel=3)
    dtypes = _dtypes(given)
    if plan_.input_dtypes and dtypes != plan_.input_dtypes:
        raise ValueError(f"the plan was made for inputs of dtype {plan_.input_dtypes}, not {dtypes}: its memory "
                         "figures would not hold; make a new plan for these dtypes")
    layouts = _layouts(given)
    if plan_.input_layouts and layouts_differ([t for t in given if isinstance(t, torch.Tensor)], plan_.input_layouts):
        raise ValueError(f"the plan was made for inputs of memory layout {plan_.input_layouts}, not {layouts}: its "
                         "memory figures would not hold; convert the inputs as they were when it was made "
                         "(x.contiguous(memory_format=...)) or make a new plan")


def _private_copy(inputs: tuple) -> tuple:
    """``inputs`` with every tensor (also inside lists and dicts) copied, with its ``requires_grad`` and strides: a
    slice ``d[:, 1:]`` stays non-contiguous (``clone`` made it contiguous, and a forward whose ``targets.view(-1)``
    fails on the slice was planned, to fail at the first training call)."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        data = t.detach()
        try:
            out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device, layout=t.layout)
            out.copy_(data)
        except RuntimeError:  # (overlapping strides, an expanded tensor; a sparse one)
            out = data.clone()
        return out.requires_grad_(t.requires_grad)

    return map_tensors(copy, inputs)


def _as_tuple(example_inputs, model: nn.Module | None = None) -> tuple:
    """The example inputs as a tuple of the forward's positional inputs: a tuple or list as it is; a dict whose keys
    all name arguments of ``model``'s forward (a Hugging Face style batch, ``model(**batch)``) by those names,
    an argument left out before one given taking its default (a fresh user's ``{"input_ids": ..,
    "attention_mask": ..}`` was taken as one input); anything else as a single input.

    Raises:
        ValueError: a dict that leaves out an argument without a default, one whose keys name some of the
            forward's arguments and not others (a misspelt or extra key: it would otherwise be taken as one
            input, and the forward fail on it far from the cause), or one whose keys name none of them where the
            forward needs more than one input.
    """
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    if isinstance(example_inputs, Mapping) and not isinstance(example_inputs, dict) and model is not None:
        # a Hugging Face BatchEncoding (a tokenizer's or a data collator's batch) is a Mapping, not a dict: a fresh
        # user's was taken as one input; read as the forward's keyword arguments where its keys all name some
        names = {p.name for p in in_traced_order(forward_params(model))}
        if len(example_inputs) and all(isinstance(k, str) and k in names for k in example_inputs):
            example_inputs = dict(example_inputs)
    if isinstance(example_inputs, dict) and not example_inputs:
        raise ValueError("example_inputs is an empty dict: give the forward's inputs (a tensor, a tuple in order, or "
                         "a dict of them by the forward's argument names)")
    if isinstance(example_inputs, dict) and model is not None:
        params = forward_params(model)
        named = in_traced_order(params)
        names = [p.name for p in named]
        keys = [k for k in example_inputs if isinstance(k, str)]
        if all(isinstance(k, str) and k in names for k in example_inputs):
            missing = [p.name for p in named if p.name not in example_inputs and p.default is p.empty]
            if missing:
                raise ValueError(f"example_inputs is a dict of the forward's keyword arguments without "
                                 f"{', '.join(repr(m) for m in missing)}, which has no default: add "
                                 f"{'it' if len(missing) == 1 else 'them'}")
            last = max(names.index(k) for k in example_inputs)
            return tuple(example_inputs.get(p.name, p.default) for p in named[:last + 1])
        required = [p.name for p in named if p.default is p.empty]
        if len(required) > 1 and not any(k in names for k in keys):  # it cannot be the forward's one input
            raise ValueError(f"example_inputs is a dict none of whose keys ({', '.join(repr(k) for k in example_inputs)}) "
                             f"names an argument of the forward ({', '.join(names)}), which needs "
                             f"{', '.join(required)}: name its keys as the forward's arguments, or pass a tuple of "
                             f"the inputs in order ({', '.join(required)})")
        if any(k in names for k in keys):
            strays = [k for k in example_inputs if k not in names]
            which = (f"key {strays[0]!r} names" if len(strays) == 1 else
                     f"keys {', '.join(repr(k) for k in strays)} name")
            them = "it" if len(strays) == 1 else "them"
            if any(p.kind == p.VAR_KEYWORD for p in params):  # forward(x, **kwargs)
                raise ValueError(f"example_inputs is a dict whose {which} no argument of the forward "
                                 f"({', '.join(names)}): the forward would take {them} through **kwargs, which "
                                 f"torch.fx cannot trace. Give {them} a parameter of {'its' if len(strays) == 1 else 'their'} "
                                 f"own (def forward(self, {', '.join(names)}, {', '.join(map(str, strays))}=None, "
                                 f"**kwargs)), or plan a wrapper module that passes {them}")
            missing = [n for n in required if n not in example_inputs]
            close = {k: ([n for n in names if n.lower() == str(k).lower()]
                         or difflib.get_close_matches(str(k), missing or names, n=1)) for k in strays}
            spelt = "; ".join(f"{k!r} for {m[0]!r}?" for k, m in close.items() if m)
            one = (", or, for a forward that takes the dict itself, pass it inside a tuple: (batch,)"
                   if len(named) == 1 else "")
            raise ValueError(f"example_inputs is a dict whose {which} no argument of the forward "
                             f"({', '.join(names)}), and the others do: a dict is read as "
                             "the forward's keyword arguments only when every key names one"
                             f"{' (it still lacks ' + ', '.join(map(repr, missing)) + ', which has no default)' if missing else ''}"
                             f". Rename or drop {them}{' (' + spelt + ')' if spelt else ''}{one}")
    return (example_inputs,)


def _check_switches(**switches) -> None:
    """Refuse a switch (``variants``, ``grads_exist``, ``tiling``, ``offload``) that is not a boolean (``offload``
    may be ``None``): a fresh user's ``variants="no"`` was taken as true, silently."""
    for name, value in switches.items():
        if not (isinstance(value, bool) or type(value).__name__ == "bool_" or (name == "offload" and value is None)
                or (name == "variants" and value == "exact")):
            also = {"offload": " (or None: the default)", "variants": ' (or "exact": bit-exact ones only)'}.get(name, "")
            raise TypeError(f"{name} must be True or False{also}, got {value!r}")


def _check_ddp(ddp) -> bool | str:
    """``ddp`` (:func:`plan`) as ``False``, ``True`` or ``"bucket-views"`` (``"copy"``, as :attr:`Plan.ddp` names
    DDP's default buckets, is ``True``); anything else is refused with ``ValueError``."""
    if ddp == "copy":
        return True
    if not (isinstance(ddp, bool) or ddp == "bucket-views"):
        raise ValueError(f'ddp must be False, True (DistributedDataParallel\'s default gradient buckets; "copy" '
                         f'too) or "bucket-views" (DistributedDataParallel(..., gradient_as_bucket_view=True)), got '
                         f'{ddp!r}')
    return ddp


def _ddp_bucket_bytes(model: nn.Module, ddp) -> int:
    """The bytes of ``DistributedDataParallel``'s gradient buckets a plan made with ``ddp`` (:func:`plan`) counts
    beside its step (:func:`memfit.runtime.planned.ddp_bucket_bytes`; ``"bucket-views"`` plans with ``grads_exist``),
    0 without."""
    if not ddp:
        return 0
    views = ddp == "bucket-views"
    return ddp_bucket_bytes(live_bytes(p for p in model.parameters() if p.requires_grad), views, views)


def _refuse_function_arguments(model: nn.Module, inputs: tuple) -> None:
    """Refuse a forward argument whose value (given, or its default) is a function (``act=F.gelu``): torch.fx
    cannot take one as a graph input (a fresh user was told about output types, inside fx's code)."""
    for name, value in forward_arguments(model, inputs).items():
        if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)):
            raise TraceError(
                f"the forward's argument {name!r} is a function ({getattr(value, '__name__', value)!r}), which "
                "torch.fx cannot take as a graph input. Keep it on the module (`self.act = act` in __init__, read "
                f"in forward), or plan a wrapper module whose forward calls yours with {name}=... (fx then traces "
                "into that function). Your model is as it was.")


def offload_store(inputs: tuple, strategy: str, offload: bool | None, offload_dir: str | None) -> HostStore | None:
    """The host store a plan may offload to, or ``None`` when offloading is off: ``offload=None`` turns it
    on for CUDA (pinned memory) and, on the CPU, when ``offload_dir`` names a directory for the disk store;
    the ``vdnn-*`` strategies always offload."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    if offload is False and offload_dir is not None:  # (the command line refuses --no-offload --offload-dir too)
        raise ValueError(f"offload=False and offload_dir={str(offload_dir)!r} contradict each other: drop "
                         "offload_dir to plan without offloading, or offload=False to offload there")
    if strategy in OFFLOAD_STRATEGIES:
        if offload is False:
            raise ValueError(f"the {strategy} strategy offloads activations; offload=False contradicts it "
                             "(choose another strategy, or drop offload=False)")
        offload = True
    if offload is None:
        offload = device.type == "cuda" or offload_dir is not None
    return default_store(device, offload_dir) if offload and strategy in ("memfit", *OFFLOAD_STRATEGIES) else None


def _share_figures(base: Costs, other: Costs, plain_activation: int) -> None:
    """Give ``other`` (the profile of a rewritten graph: striped blocks, BatchNorm from its output) what ``base``
    measured for the step as a whole: the copy link, the optimizer step's bytes, the loss's transient (the same
    output's loss, measured with the optimizers' view of existing gradients) and the region prices; and the model's
    own headroom, ``plain_activation`` bytes (:class:`memfit.solve.strategies._Problem`)."""
    other.link, other.step_bytes, other.loss_bytes = base.link, base.step_bytes, base.loss_bytes
    other.region_seconds, other.region_node_seconds = base.region_seconds, base.region_node_seconds
    other.headroom_of = plain_activation


def tiled_options(captured: Captured, costs: Costs, inputs: tuple, loss_fn: Callable | None = None,
                  grads_exist: bool = False) -> list[Option]:
    """The graphs with blocks run in row stripes that :func:`plan` also solves
    (:func:`memfit.solve.tiling.tiling_candidates`), each profiled, with the copy costs and optimizer step of
    ``costs`` and its times for the nodes they share (:func:`memfit.solve.tiling.share_timings`). Empty
    when the graph has no chain of convolutions, pooling and activations; a candidate whose profile raises
    (an input that is not ``[N, C, H, W]``) is left out."""
    out = []
    try:
        blocks = chain_blocks(captured.gm)
    except Exception as exc:  # noqa: BLE001 -- striping is an option: it must not stop the plan
        warnings.warn(f"memfit: looking for blocks to run in row stripes failed ({type(exc).__name__}: {exc}); "
                      "planning without them (tiling=False silences this; please report it)", stacklevel=3)
        return out
    blocks_of = tiling_candidates(blocks, costs)
    if not blocks_of:
        return out
    plain_activation = make_plan("none", captured.graph, costs).predicted_peak_bytes - costs.fixed_bytes
    for blocks in blocks_of:
        tiled = apply_tiling(captured, blocks)
        try:
            tiled_costs = profile_graph(tiled, inputs, with_variants=True, loss_fn=loss_fn, grads_exist=grads_exist)
        except ValueError:
            continue
        _share_figures(costs, tiled_costs, plain_activation)
        share_timings(costs, tiled_costs, blocks)
        out.append(Option(tiled, tiled_costs, blocks))
    return out


#: the least share of the step (or, at ``min``, of the activation peak) a plan with BatchNorm run from its output
#: must save over the bit-exact plan to be chosen instead: its gradients are PyTorch's to float32 rounding only
BN_FROM_OUTPUT_MARGIN = 0.01


def bn_from_output_option(captured: Captured, costs: Costs, inputs: tuple, loss_fn: Callable | None = None,
                          grads_exist: bool = False, relu_conv: bool = False) -> Option | None:
    """The graph with every BatchNorm -> in-place activation pair run from BatchNorm's output
    (:func:`memfit.graph.bn_output.apply_bn_from_output`), profiled, with the copy costs, optimizer step and
    region prices of ``costs`` and its times for the nodes the two graphs share; ``None`` where the graph has
    no such pair, its profile raises, or a rewritten BatchNorm ran in float16 or bfloat16 (a plain ``.to()`` or
    ``torch.autocast``): there the output gives back the input only while every bias stays below its weight,
    which training soon undoes (:func:`memfit.variants.bn_from_output.condition_limit`). ``relu_conv``: rewrite
    BatchNorm -> ReLU -> convolution triples too (:func:`memfit.graph.bn_output.bn_activation_pairs`; not offered by
    :func:`plan`, for ``benchmarks/bn_from_output_check.py``)."""
    if autocast_dtype(inputs) in {str(d) for d in HALF_DTYPES} or any(
            isinstance(t, torch.Tensor) and t.dtype in HALF_DTYPES for t in inputs):
        return None  # (ran_in_half_precision below catches a model that casts inside, after profiling it)
    names = bn_activation_pairs(captured.gm, relu_conv=relu_conv)
    if not names:
        return None
    rewritten = apply_bn_from_output(captured, names)
    try:
        with warnings.catch_warnings():  # (a BatchNorm in half precision after all: the option is dropped below)
            warnings.filterwarnings("ignore", message="memfit: a channel of")
            other = profile_graph(rewritten, inputs, with_variants=True, loss_fn=loss_fn, grads_exist=grads_exist)
    except ValueError:
        return None
    if ran_in_half_precision(rewritten):
        return None
    _share_figures(costs, other, make_plan("none", captured.graph, costs).predicted_peak_bytes - costs.fixed_bytes)
    users = [u.name for n in captured.gm.graph.nodes if n.name in set(names) for u in n.users]
    convs = [conv for _, conv in relu_conv_triples(captured.gm, names).values()]  # (now of the ReLU too)
    share_timings(costs, other, [], changed=tuple(names + users + convs))
    return Option(rewritten, other, bn_from_output=names)


def plan(model: nn.Module, example_inputs, budget="min", *, strategy: str = "memfit",
         optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None, time_limit: float = 20.0, variants: bool | str = True,
         loss_fn: Callable | None = None, offload: bool | None = None, offload_dir: str | None = None,
         grads_exist: bool = False, tiling: bool = True, ddp: bool | str = False, _captured: Captured | None = None,
         _store: HostStore | None = None) -> tuple[Plan, Captured, Costs]:
    """Capture, profile and solve: the plan for training ``model`` on batches like ``example_inputs``.

    Args:
        model: the model, in training mode, on its device. It is not modified (buffers such as BatchNorm
            statistics, parameters the forward updates in place and the RNG state are restored after
            profiling, also when it raises).
        example_inputs: a tensor or a tuple of the forward's positional inputs, e.g. images
            ``[B, C, H, W]``, on the model's device, or a dict of its keyword arguments (``model(**batch)``).
            Plans are specific to these shapes. Arguments left out take the forward's default values
            (``def forward(self, x, scale=2.0)``).
        budget: total peak bound: bytes (``"2GiB"``, ``"512MB"``, int) or a percentage of the plain
            PyTorch peak (``"40%"``), or ``"min"`` for the least memory memfit can reach.
            See :class:`memfit.Budget`.
        strategy: ``memfit`` (the integer program: recomputation, offloading and operator variants),
            ``remat-ilp`` (the integer program, recomputation only), ``chen``, ``checkpoint-all``,
            ``vdnn-all``, ``vdnn-conv`` (offloading) or ``none`` (README, "Strategies").
        optimizer: the optimizer you will train with: its state counts in the fixed bytes, and the temporaries
            of its ``step()`` (Adam: about twice the largest parameter) in the peak. Both are measured by
            running its class with your hyperparameters on scratch copies of the parameters (for a moment,
            about 4x the parameters' memory for Adam); your optimizer is not touched. Where parts of the model
            train with different optimizers, a list of them (``[body_opt, head_opt]``, stepped one after the
            other): their states add up, and the largest step's temporaries count. A trainable parameter in none
            of them is warned about (its state is not counted).
        time_limit: time limit of each integer program, in seconds. ``"min"`` and budgets near the smallest
            feasible one solve several programs, so the whole solve can take several times longer
            (``report["solve_seconds"]`` gives the total).
        variants: let ``memfit`` choose memory-efficient operator implementations (ReLU with a 1-bit
            mask, max-pooling with compact indices, convolution backward in two calls, ReLUs and additions
            written in place where autograd allows) jointly with recomputation (MONeT, Shah et al., ICLR
            2021, section 4). Some round differently from PyTorch's kernels (``conv-native``,
            ``bn-from-output``, ``tiled-chain``: gradients equal to float rounding); ``"exact"`` allows only
            those whose gradients are bit for bit PyTorch's.
        loss_fn: ``loss_fn(output) -> scalar``, your training loss as a closure over the targets, e.g.
            ``lambda out: F.cross_entropy(out, labels)``; its memory is then measured instead of assumed
            (without it memfit assumes a log-softmax style loss: two output-sized tensors), including the
            output if the loss saves it, the loss value's storage, and the closure's tensors (the targets,
            counted as fixed bytes).
        offload: let the plan move saved activations to host memory during the forward pass and prefetch
            them back during the backward pass (vDNN, Rhu et al., MICRO 2016), jointly with recomputation.
            ``None`` (default): on for CUDA (pinned host memory), and on the CPU when ``offload_dir`` is
            given. The copy bandwidth is measured for the plan.
        offload_dir: directory for the disk store (memory-mapped files, deleted as soon as they are made):
            on the CPU, the only store that lowers the process's memory.
        grads_exist: your loop keeps parameter gradients allocated when the backward starts
            (``optimizer.zero_grad(set_to_none=False)``, or accumulation over micro-batches). The default
            models PyTorch's ``optimizer.zero_grad()``, which sets them to ``None``: each gradient then
            appears when the backward completes it, and no temporary is added into an existing ``.grad``.
        tiling: let ``memfit`` (with ``variants``) also run the blocks of convolutions, pooling and
            activations with the largest activations in row stripes (``tiled-chain``,
            :mod:`memfit.variants.tiled`: a block's full-resolution tensors never exist, forward or
            backward; gradients equal PyTorch's to float32 rounding). Each candidate is profiled and solved
            (a few more profiles, only for models with such blocks and budgets below plain PyTorch's peak);
            the fastest plan that fits is kept. Under ``torch.autocast`` the stripes' recomputation runs in
            the forward pass's autocast state.
        ddp: the planned module will run inside ``DistributedDataParallel`` (``DistributedDataParallel(planned,
            ...)``), whose gradient buckets, the size of the trainable parameters' gradients (P bytes), are held
            beside the step; the plan counts them in its fixed bytes (and so do percentage budgets, of plain
            PyTorch's peak inside DDP). ``True``: DDP's default buckets, a copy of the gradients held through every
            step, and another P in DDP's second step, which builds them again: 2P. ``"bucket-views"``:
            ``gradient_as_bucket_view=True``, whose buckets are the gradients, existing from the start of each step
            (planned as with ``grads_exist=True``), and another P in the second step: P. ``False`` (default): no
            DDP; the planned module warns if one calls it.

    Returns:
        ``(plan, captured, costs)``: the :class:`Plan` (``plan.save(path)`` writes JSON), the traced model,
        and the profile, of the graph the plan was solved for (with its striped blocks, if ``plan.tiled``).

    Raises:
        memfit.TraceError: ``torch.fx`` cannot trace the model; the message names the line.
        memfit.InfeasibleBudgetError: no plan fits; the message names the smallest feasible budget.
        TypeError: ``model`` is not an ``nn.Module``, or is already a :class:`PlannedModule` (plan
            ``planned.model`` instead); ``optimizer``
            is not a ``torch.optim.Optimizer``.
        ValueError: bad budget text or strategy; an optimizer that holds none of the model's parameters;
            ``loss_fn`` fails on the model's output, returns more than one value or a loss that does not
            require grad though the output does; ``example_inputs`` has more inputs than the forward takes,
            leaves out an argument without a default, or leaves out one whose default the traced forward
            cannot run with (``mask=None`` when fx traced ``if mask is not None:`` as taken).
        RuntimeError: called with gradients off (inside ``torch.no_grad()`` or ``torch.inference_mode()``).
    """
    budget = Budget.parse(budget)
    _check_model(model)
    if not isinstance(model, PlannedModule):  # (refused as already planned, below)
        refuse_decorated_forward(model)  # (before the inputs are bound by its signature)
    _check_optimizer(optimizer, model, loss_fn)
    # (a string or None compared with 0 was a bare TypeError for a fresh user)
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not time_limit > 0:
        raise ValueError(f"time_limit must be a positive number of seconds (got {time_limit!r}); the default is 20")
    _check_switches(variants=variants, grads_exist=grads_exist, tiling=tiling, offload=offload)
    ddp = _check_ddp(ddp)
    grads_exist = grads_exist or ddp == "bucket-views"  # (the buckets are the gradients, from the step's start)
    # a copy: profiling runs the forward pass several times, and a forward that updates its input in place
    # (x.sub_(mean).div_(std)) changed a fresh user's example batch at each of them (its std went from 0.29 to 582)
    given = _as_tuple(example_inputs, model)
    if any(t.device.type == "meta" for t in tensors_in(given)):  # (PyTorch's "Cannot copy out of meta tensor")
        raise ValueError("example_inputs has a tensor on the meta device, which holds no data: memfit measures a real "
                         "training step, so give real tensors of the step's shapes, on the device you train on "
                         "(torch.randn(...), or a batch of your data)")
    inputs = _private_copy(given)
    _require_training(model)
    _require_grad_mode()
    _refuse_sparse_gradients(model)
    _refuse_sparse_tensors(model, given)
    _warn_hooks(model)
    if _captured is None:
        _refuse_function_arguments(model, given)
        captured = capture(model, forward_arguments(model, given))
        check_traced_outputs(model, captured.gm, lambda: _private_copy(inputs))
    else:
        captured = _captured
    if not isinstance(example_inputs, dict):  # (a dict binds by name: nothing of it falls into *args)
        check_var_positional(captured.gm, inputs)
    outside = _outside_params([model, captured.gm], _optimizers(optimizer))
    exact = variants == "exact"
    costs = profile_graph(captured, inputs, with_variants=bool(variants) and strategy == "memfit", loss_fn=loss_fn,
                          grads_exist=grads_exist, user_inputs=given, held=tuple(outside),
                          kept_grads=tuple(_own_optimizers_params([model, captured.gm], _optimizers(optimizer))
                                           + _loss_grads_now([model, captured.gm], loss_fn)))
    if exact:
        costs = costs.exact_variants_only()
    loss_ptrs = set(costs.loss_param_ptrs)
    if loss_fn is not None:
        _check_optimizer(optimizer, model, loss_fn, loss_ptrs)
    _check_something_trains(model, costs, inputs)
    price_regions(costs)
    store = _store or offload_store(inputs, strategy, offload, offload_dir)
    if store is not None:
        costs.link = measure_link(CopyEngine(store, torch.device(costs.device)))
    # (a parameter the step never reads, or whose output the loss does not read, gets no gradient, and no state)
    trained = [p for name, p in captured.gm.named_parameters() if name not in set(costs.no_grad_params)]
    # (parameters only the loss trains, a head of the model called in loss_fn or one kept there, and those an
    # optimizer trains outside the model: their state too)
    by_loss = _loss_trained(loss_fn, model, captured.gm, loss_ptrs)
    _warn_untrained_by_optimizers(model, _optimizers(optimizer), trained, by_loss)
    state, measured = _counted_state(optimizer, _state_params(trained, [p for _, p in by_loss], outside))
    if measured is not None:
        costs.step_bytes = measured.step_bytes
    buckets = _ddp_bucket_bytes(model, ddp)
    fixed = costs.fixed_bytes + state + buckets
    plain = make_plan("none", captured.graph, costs, fixed_bytes=fixed)
    floor = budget.minimum and strategy in ("memfit", "remat-ilp")  # that strategy's own floor
    budget_bytes = None if floor else budget.resolve(plain.predicted_peak_bytes, plain.predicted_peak_bytes)

    def solve(option: Option) -> Plan:
        if floor:
            return plan_at_floor(strategy, option.captured.graph, option.costs, fixed, time_limit,
                                 use_variants=variants, use_offload=store is not None)[1]
        return make_plan(strategy, option.captured.graph, option.costs, budget_bytes, fixed_bytes=fixed,
                         time_limit=time_limit, use_variants=variants)

    options = [Option(captured, costs)]
    below_plain = floor or budget_bytes < plain.predicted_peak_bytes
    # (striped blocks and BatchNorm from its output round differently from PyTorch: not with variants="exact")
    if tiling and strategy == "memfit" and variants and not exact and below_plain:
        options += tiled_options(captured, costs, inputs, loss_fn, grads_exist)
    other = (bn_from_output_option(captured, costs, inputs, loss_fn, grads_exist)
             if strategy == "memfit" and variants and not exact and below_plain else None)
    try:
        result, chosen = best_plan_rounding(options, other, solve, floor, BN_FROM_OUTPUT_MARGIN)
    except InfeasibleBudgetError as exc:  # its advice on the optimizer's state, for the one given, and the batch
        batch = next((t.shape[0] for t in tensors_in(inputs) if t.dim() > 0), None)
        if optimizer is None:
            raise exc.for_optimizer(exc.optimizer, exc.optimizer_state_bytes, batch, buckets) from None
        raise exc.for_optimizer(_optimizer_name(_optimizers(optimizer)), state, batch, buckets) from None
    captured, costs = chosen.captured, chosen.costs
    result.plain_step_seconds = plain.predicted_step_seconds
    if floor:
        _warn_min_above_plain(result, plain)
        if result.floor_stopped:  # (a fresh user's Qwen2-MoE at time_limit=5 got 1.21x the floor of time_limit=20)
            warn_user(f"memfit: budget='min': a search for the least memory stopped at its time limit "
                      f"(time_limit={time_limit:g} s per program), so the plan may not be the least memory memfit "
                      f"can reach: a longer time_limit may find a lower peak (e.g. time_limit={4 * time_limit:g}).")
    result.ddp = {True: "copy", "bucket-views": "bucket-views"}.get(ddp)
    result.ddp_bucket_bytes = buckets
    result.grads_exist = grads_exist  # (the loop's, also where the profile took an L2 penalty's gradients as preallocated)
    result.input_shapes = _shapes(inputs)
    nbytes = {st.id: st.nbytes for st in costs.storages}
    result.output_bytes = {c.name: sum(nbytes[sid] for sid in set(c.outputs)) for c in costs.nodes if c.outputs}
    result.input_dtypes = _dtypes(inputs)
    result.input_grads = [t.requires_grad for t in inputs if isinstance(t, torch.Tensor)]
    result.input_values = input_values([n for n in captured.gm.graph.nodes if n.op == "placeholder"],
                                       bind_inputs(captured.gm, inputs))
    result.state_shapes = state_shapes(model)
    result.state_dtypes = state_dtypes(model)
    result.input_layouts = _layouts(inputs)
    result.state_layouts = state_layouts(model)
    result.state_roles = state_roles(model)
    result.autocast = autocast_dtype(inputs)
    result.autocast_cache = torch.is_autocast_cache_enabled() if result.autocast else None
    result.conv_libraries = conv_libraries()
    result.threads = torch.get_num_threads() if costs.device == "cpu" else None
    result.optimizer = _optimizer_name(_optimizers(optimizer))
    result.optimizer_state_bytes = None if optimizer is None else state
    result.optimizer_step_bytes = None if measured is None else measured.step_bytes
    result.optimizer_options = optimizer_options(_optimizers(optimizer))
    result.buffer_kinds = dict(costs.buffer_kinds)
    result.buffer_kinds_known = True
    result.eval_modules = [path for path, module in model.named_modules() if not module.training]
    own = {id(p) for p in model.parameters()}
    result.loss_trained = [name for name, p in by_loss if id(p) in own]
    result.node_ops = node_ops(captured.gm)
    result.node_inputs = node_inputs(captured.gm)
    # (an output a node saves is held anyway, and the loss value's, which the plan counts held to the step's end: a
    # model returning its own loss was warned about as "held by the training loop" at each of a fresh user's steps)
    saved = {s for node in costs.nodes for s in node.saves} | {costs.loss_output}
    result.freed_outputs = [k for k, s in enumerate(costs.output_ids) if s is not None and s not in saved
                            and costs.storages[s].producer is not None]
    if costs.loss_grads is not None:
        result.ungraded_outputs = [k for k, s in enumerate(costs.output_ids) if s is not None
                                   and s not in costs.loss_grads and costs.storages[s].requires_grad
                                   and costs.storages[s].producer is not None]
    result.held_output_bytes = _held_output_bytes(captured.graph, costs, result.ungraded_outputs)
    result.solved_digest = result.decision_digest()
    return result, captured, costs


def _held_output_bytes(graph, costs: Costs, ungraded: list[int]) -> dict[str, int]:
    """``{position: bytes}`` for each output position of ``ungraded`` (:attr:`Plan.ungraded_outputs`): what a training
    loop holding that output through the backward pass keeps beyond the plan, which frees its autograd graph once the
    loss has run: its storage and those the nodes no gradient reaches on its path save (not parameters or inputs).
    A fresh user's detection head ``sigmoid(conv(h))``, kept for a metric: 1,114,112 B over the plan, the output's
    64 KiB and the 1 MiB ``h`` the convolution saved, unwarned."""
    from memfit.solve.accounting import Accounting

    if not ungraded:
        return {}
    acc = Accounting.build(graph, costs)
    index = graph.index()
    producer = {st.id: st.producer for st in costs.storages}
    out = {}
    for k in ungraded:
        sid = costs.output_ids[k]
        start = index.get(producer.get(sid))
        held, seen, todo = {sid}, set(), [start] if start is not None else []
        while todo:
            i = todo.pop()
            if i in seen or i not in acc.unreached:
                continue
            seen.add(i)
            held |= {s for s in costs.nodes[i].saves if producer.get(s) is not None}
            todo += [index[a] for a in graph.nodes[i].inputs if a in index]
        out[str(k)] = sum(costs.storages[s].nbytes for s in held)
    return out


def _warn_min_above_plain(result: Plan, plain: Plan) -> None:
    """Warn where ``budget="min"`` took a plan whose budget (its predicted peak plus the replay's headroom) is above
    keeping every activation's predicted peak, and which is predicted more than 10% slower: it saves less memory
    than the headroom, and a byte budget at that peak gets plain PyTorch's speed (a fresh user's deep-supervision
    MLP: 34 KB below plain PyTorch's peak at 2.1x its step time, silently)."""
    budget, peak = result.budget_bytes, plain.predicted_peak_bytes
    if budget is None or budget <= peak or result.predicted_step_seconds <= 1.1 * plain.predicted_step_seconds:
        return
    saved = peak - result.predicted_peak_bytes
    warn_user(f"memfit: budget='min' planned {fmt_bytes(max(saved, 0))} below keeping every activation "
              f"({fmt_bytes(peak)} predicted) at {result.predicted_step_seconds / plain.predicted_step_seconds:.2f}x "
              f"its predicted step time, and its budget, with the replay's headroom, is {fmt_bytes(budget)}, above "
              f"that peak. If speed matters more than those bytes, give budget={peak} (bytes): it keeps every "
              "activation and runs as plain PyTorch does.")


def _warn_hooks(model: nn.Module) -> None:
    """Warn that the plan cannot count what a forward hook keeps: a hook storing a module's output (a feature
    for a perceptual loss, Grad-CAM) holds it past where the plan frees it (a fresh user's feature loss measured
    1.21x its budget at ``min``)."""
    def users(hooks) -> bool:  # (spectral_norm's and weight_norm's pre-hooks recompute the weight and keep nothing;
        # Hugging Face's output recorder, installed by the model's first call, is traced into and counted)
        return any(not getattr(h, "__module__", type(h).__module__).startswith("torch.") and not collects_in_call(h)
                   for h in hooks.values())

    hooked = [name for name, m in model.named_modules()  # (the model's own are refused: capture)
              if name and (users(m._forward_hooks) or users(m._forward_pre_hooks))]
    if hooked:
        warn_user(f"memfit: {', '.join(hooked[:3])}{' ...' if len(hooked) > 3 else ''} "
                  f"{'have' if len(hooked) > 1 else 'has'} forward hooks: the plan runs them but cannot see what they "
                  "keep, so a tensor a hook stores (a feature for a loss, Grad-CAM) stays alive beyond the plan's "
                  "count and the step can go over the budget by its size. Leave that much headroom in the budget.")


def _optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """``optimizer=`` as a list: ``[]`` for ``None``, ``[opt]`` for one, the optimizers of a list or tuple (a model
    whose parts train with different ones: SGD for the body and Adam for the head), each once.

    Raises:
        TypeError: something else (``optimizer="sgd"`` failed with an AttributeError), or an empty list.
    """
    if optimizer is None:
        return []
    many = isinstance(optimizer, (list, tuple))
    opts = list({id(o): o for o in optimizer}.values()) if many else [optimizer]  # (one given twice: counted once)
    bad = [o for o in opts if not isinstance(o, torch.optim.Optimizer)]
    if bad or not opts:
        # (a tensor or a parameter, `optimizer=list(model.parameters())`, is named by kind and shape, not printed)
        got = (f"an empty {type(optimizer).__name__}" if not bad else
               f"a list of tensors ({type(bad[0]).__name__} of shape {list(bad[0].shape)} first): the parameters, "
               "not an optimizer built on them" if isinstance(bad[0], torch.Tensor) else
               f"{type(bad[0]).__name__} {bad[0]!r}")
        raise TypeError(f"optimizer must be the torch.optim.Optimizer you train with, built on the model's "
                        f"parameters (e.g. torch.optim.SGD(model.parameters(), lr=0.1)), a list of them where parts "
                        f"of the model train with different ones ([body_opt, head_opt]), or None; got "
                        f"{got}"[:400])
    return opts


def _optimizer_name(opts: list[torch.optim.Optimizer]) -> str | None:
    """``"SGD"``, ``"SGD+Adam"`` for a list, ``None`` for none: the plan's ``optimizer`` field."""
    return "+".join(type(o).__name__ for o in opts) or None


def _check_optimizer(optimizer, model: nn.Module, loss_fn=None, loss_ptrs: set[int] | None = None) -> None:
    """Refuse an ``optimizer`` that is not one, or a list of them (:func:`_optimizers`), or one that holds none of
    ``model``'s parameters (built on another model: its state would be counted, the model's not), unless it holds
    parameters ``loss_fn``'s backward gives a gradient (a head kept in the loss with an optimizer of its own, a
    GAN's discriminator): they then count with their state. With ``loss_fn`` and no ``loss_ptrs`` (the storage
    pointers of those parameters, :attr:`Costs.loss_param_ptrs`, known once the loss is profiled) such an
    optimizer passes, to be checked again with them (an optimizer of another model passed with a loss_fn was
    accepted, its parameters counted as the model's state)."""
    ours = {id(p) for p in model.parameters()}
    opts = _optimizers(optimizer)
    for k, opt in enumerate(opts):
        held = [p for group in opt.param_groups for p in group["params"]]
        if not held or any(id(p) in ours for p in held):
            continue
        if loss_fn is not None and (loss_ptrs is None or any(p.untyped_storage().data_ptr() in loss_ptrs
                                                             for p in held)):
            continue
        by_loss = ", nor any that loss_fn gives a gradient" if loss_fn is not None else ""
        which = f"optimizer[{k}] ({type(opt).__name__})" if len(opts) > 1 else f"the optimizer {type(opt).__name__}"
        raise ValueError(f"{which} holds {len(held)} parameter tensor(s), none of them the "
                         f"model's{by_loss}: build it on model.parameters() (the one you train this model with). If "
                         "it is meant (it trains another network, stepped apart), leave it out of optimizer=: its "
                         "parameters and state are then not counted in the budget")


def _state_params(trained: list[torch.Tensor], by_loss: list[torch.Tensor],
                  outside: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters whose optimizer state the step holds, each once: those it trains in the graph (``trained``),
    those only the loss trains (``by_loss``: a head of the model called in loss_fn) and those an optimizer trains
    outside the model that require grad (``outside``: a head kept in the loss)."""
    return list({id(t): t for t in [*trained, *by_loss, *(p for p in outside if p.requires_grad)]}.values())


def _loss_trained(loss_fn, model: nn.Module, gm: nn.Module, ptrs: set[int]) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` for the trainable parameters outside the traced graph that the loss's backward gives a
    gradient (``ptrs``: :attr:`Costs.loss_param_ptrs`): a head of the model the forward never calls but ``loss_fn``
    does, named as in the model, and the parameters of modules ``loss_fn`` holds (a head kept in the loss)."""
    from memfit.profile.costs import loss_held_modules

    graph = {id(p) for p in gm.parameters()}
    named = [*model.named_parameters(), *((f"(loss_fn's {type(m).__name__}).{n}", p)
                                          for m in loss_held_modules(loss_fn) for n, p in m.named_parameters())]
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for name, p in named:
        if p.requires_grad and id(p) not in graph and p.untyped_storage().data_ptr() in ptrs:
            found.setdefault(id(p), (name, p))
    return list(found.values())


def _warn_untrained_by_optimizers(model: nn.Module, opts: list[torch.optim.Optimizer],
                                  trained: list[torch.Tensor], by_loss: list[tuple[str, torch.Tensor]] = ()) -> None:
    """Warn where parameters that the step gives a gradient are in none of the optimizers given: their state is not
    counted (a fresh user's body with SGD, passed, and head with Adam, not passed, measured 1.18x the budget)."""
    if not opts:
        return
    held = {id(p) for opt in opts for group in opt.param_groups for p in group["params"]}
    stepped = {id(p) for p in trained}
    left = [(name, p) for name, p in model.named_parameters() if p.requires_grad and id(p) in stepped
            and id(p) not in held]
    listed = {id(p) for _, p in left}
    left += [(name, p) for name, p in by_loss if id(p) not in held and id(p) not in listed]
    if left:
        names = ", ".join(name for name, _ in left[:3]) + (" ..." if len(left) > 3 else "")
        nbytes = sum(p.untyped_storage().nbytes() for _, p in left)
        warn_user(f"memfit: {len(left)} trainable parameter tensor(s) ({names}; {fmt_bytes(nbytes)}) are in none of "
                  f"the optimizers given ({_optimizer_name(opts)}), so no optimizer state of theirs is counted: if "
                  "another optimizer trains them, the step can go over the budget by its state (2x those parameters "
                  "for Adam). Pass every optimizer you train with (optimizer=[opt1, opt2]), or freeze what none "
                  "trains (requires_grad_(False)).")


def _refuse_sparse_gradients(model: nn.Module) -> None:
    """Refuse trainable embeddings with sparse gradients: their gradient's size depends on the batch's indices,
    and the profile cannot measure it (a fresh user's ``nn.Embedding(sparse=True)`` failed with PyTorch's
    "Cannot access storage of SparseTensorImpl")."""
    sparse = [name or f"the model ({type(mod).__name__})" for name, mod in model.named_modules()
              if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse and mod.weight.requires_grad]
    if sparse:
        raise ValueError(f"{', '.join(sparse[:3])}{' ...' if len(sparse) > 3 else ''} "
                         f"{'has' if len(sparse) == 1 else 'have'} sparse=True: memfit does not plan sparse "
                         "gradients (their size depends on the indices of each batch). Build the embedding with "
                         "sparse=False (a dense gradient, which memfit counts; use an optimizer for dense "
                         "gradients, not SparseAdam), or freeze it")


def _refuse_sparse_tensors(model: nn.Module, given: tuple) -> None:
    """Refuse sparse (or other non-strided) tensors among the example inputs, the model's parameters and buffers and
    the tensors its modules keep as attributes, naming the first (a fresh user's sparse adjacency matrix failed with
    PyTorch's "Cannot access storage of SparseTensorImpl").

    Raises:
        ValueError: one is found; the message names it, its layout and what to change."""
    found = [(f"the input {name!r}", t) for name, value in forward_arguments(model, given).items()
             for t in tensors_in(value)]
    found += [(f"the parameter {name!r}", t) for name, t in model.named_parameters()]
    found += [(f"the buffer {name!r}", t) for name, t in model.named_buffers()]
    found += [(f"the attribute {f'{path}.{key}'.lstrip('.')!r}", value) for path, module in model.named_modules()
              for key, value in vars(module).items() if isinstance(value, torch.Tensor)]
    for what, t in found:
        if t.layout != torch.strided:
            raise ValueError(f"{what} is a {str(t.layout).removeprefix('torch.')} tensor: {SPARSE_ADVICE}")


def _check_something_trains(model: nn.Module, costs, inputs: tuple = ()) -> None:
    """Refuse a model whose output takes no part in a backward pass (every parameter frozen, or the trainable
    ones unread): a fresh user's plan was returned, and ``loss.backward()`` then raised autograd's "element 0 of
    tensors does not require grad". An empty example batch (``x[:0]``) makes every activation empty (no storage to
    plan), and is told so (a fresh user was told the parameters were not read).

    Raises:
        ValueError: nothing trains, or an input tensor is empty.
    """
    if any(costs.storages[s].requires_grad for s in costs.output_ids if s is not None):
        return
    if any(s.requires_grad for s in costs.storages):  # (an output that is a parameter or an input itself)
        return
    empty = [(k, list(t.shape)) for k, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.numel() == 0]
    if empty:
        k, shape = empty[0]
        raise ValueError(f"example input {k} is empty (shape {shape}): memfit measures the training step on the example "
                         "batch, and an empty one has no activations to plan. Plan with a batch of the size you "
                         "train with")
    _refuse_nothing_trains(model)


def _refuse_nothing_trains(model: nn.Module) -> None:
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if trainable:
        why = (f"the trainable parameters ({', '.join(trainable[:3])}{', ...' if len(trainable) > 3 else ''}) are "
               "not read on the way to the output")
    else:
        why = "every parameter has requires_grad=False" if next(model.parameters(), None) is not None else (
            f"the model ({type(model).__name__}) has no parameters")
    raise ValueError(f"nothing in this model trains: {why}, and no input requires grad, so the output does not "
                     "require grad and a training step's loss.backward() would raise 'element 0 of tensors does not "
                     "require grad'. Unfreeze the parameters to train (p.requires_grad_(True)) and plan again; a "
                     "model run without a backward pass (a frozen teacher) needs no plan: run it under "
                     "torch.no_grad()")


def _outside_params(modules: list[nn.Module], opts: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The parameters the optimizers ``opts`` hold that are none of ``modules``' (the model's and its traced graph's;
    a classification head kept in the loss, trained by the same optimizer), each once: they, their state and, where
    the loss gives them one, their gradient are part of the step's memory."""
    own = {id(p) for m in modules for p in m.parameters()}
    found: dict[int, torch.Tensor] = {}
    for opt in opts:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in own:
                    found.setdefault(id(p), p)
    return list(found.values())


def _own_optimizers_params(modules: list[nn.Module], opts: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The parameters of the optimizers in ``opts`` that hold none of ``modules``' (a GAN's discriminator optimizer,
    beside the generator's): a loop zeroes their gradients apart from the model's, or not at all before the
    model's step (PyTorch's DCGAN example zeroes only the generator's), so the step may find them."""
    own = {id(p) for m in modules for p in m.parameters()}
    groups = [[p for group in opt.param_groups for p in group["params"]] for opt in opts]
    return [p for params in groups if not any(id(p) in own for p in params) for p in params]


def _loss_grads_now(modules: list[nn.Module], loss_fn) -> list[torch.Tensor]:
    """The parameters of the modules ``loss_fn`` holds that are none of ``modules``' and have a ``.grad`` now (a GAN's
    discriminator after its own step, its optimizer not given): the step's backward adds into them (a fresh user's
    DCGAN generator step, only the generator's optimizer passed, measured 1.04x its budget when they were taken to
    be made by the step)."""
    from memfit.profile.costs import loss_held_modules

    own = {id(p) for m in modules for p in m.parameters()}
    return [p for m in loss_held_modules(loss_fn) for p in m.parameters()
            if id(p) not in own and p.requires_grad and p.grad is not None]


def _counted_state(optimizer, trained: list[torch.Tensor]):
    """``(state bytes, OptimizerCost or None)``: the optimizer state a training step of the parameters ``trained``
    holds (:func:`memfit.profile.optimizer.optimizer_state_bytes`), its new state measured on scratch copies. For a
    list of optimizers (stepped one after the other): their states added up, and the largest of their steps'
    temporaries (each step frees its own before the next runs); ``None`` where none could be measured."""
    state, costs = 0, []
    for opt in _optimizers(optimizer):
        measured = measure_optimizer(opt, {id(p) for p in trained})
        state += optimizer_state_bytes(opt, trained, None if measured is None else measured.state_by_param)
        if measured is not None:
            costs.append(measured)
    if not costs:
        return state, None
    return state, OptimizerCost(state_bytes=sum(c.state_bytes for c in costs),
                                step_bytes=max(c.step_bytes for c in costs),
                                state_by_param={k: v for c in costs for k, v in c.state_by_param.items()})


def _check_optimizer_state(plan_: Plan, optimizer, trained: list[torch.Tensor]) -> None:
    """Refuse a saved plan for an ``optimizer`` that will hold more state, or allocate more in its step, than the
    plan counted: the same class with other options (``AdamW(amsgrad=True)`` keeps a third tensor per parameter: a
    fresh user's reloaded plan measured 1.068x its budget), another class, parameters that have gained state since,
    or any optimizer with state where the plan was solved without one (it counted none). One that needs no more of
    either is accepted whatever its class (an Adam plan trains SGD with momentum). Warn where the plan counted an
    optimizer and none is given now: nothing checks the one trained with."""
    if not _optimizers(optimizer):
        # (either field: a hand-edited plan without its "optimizer" key loaded silently)
        if plan_.optimizer is not None or plan_.optimizer_state_bytes is not None:
            warnings.warn(f"memfit.optimize: the plan counted {plan_.optimizer_state_bytes} bytes of "
                          f"{plan_.optimizer or 'optimizer'} state and its step; pass optimizer= the optimizer you train with to have "
                          "it checked (one that keeps more state takes the step over the budget)", stacklevel=3)
        return
    name = _optimizer_name(_optimizers(optimizer))
    if plan_.optimizer and name != plan_.optimizer and plan_.optimizer_step_bytes is None:
        # a plan saved before its step's temporaries were recorded: the class decides
        raise ValueError(f"the plan counted the state and step of {plan_.optimizer}, not {name}: their memory "
                         "differs; make a new plan with optimizer= your optimizer")
    now, measured = _counted_state(optimizer, trained)
    if plan_.optimizer_state_bytes is None:
        if now > 0:
            raise ValueError(f"the plan was solved without an optimizer, so its budget counts no optimizer state and "
                             f"no optimizer step, and this {name} will keep {now} bytes of state: "
                             "the step would go over the plan's budget; make a new plan with optimizer= this "
                             "optimizer (or apply this one with optimizer=None, knowing that)")
        return
    if now > plan_.optimizer_state_bytes:
        why = ("other options, such as amsgrad or momentum, or more trainable parameters" if name == plan_.optimizer
               else f"{name} keeps other state than {plan_.optimizer}")
        raise ValueError(f"the plan counted {plan_.optimizer_state_bytes} bytes of {plan_.optimizer} state, and this "
                         f"{name} will keep {now} bytes ({why}): the step would go over the plan's budget by the "
                         "difference; make a new plan with optimizer= this optimizer")
    step = None if measured is None else measured.step_bytes
    if plan_.optimizer_step_bytes is None or (step is None and name == plan_.optimizer):  # (the class decides)
        return
    if step is None or step > plan_.optimizer_step_bytes:
        took = "could not be measured" if step is None else f"allocates {step} bytes"
        raise ValueError(f"the plan counted {plan_.optimizer_step_bytes} bytes of temporaries in {plan_.optimizer}'s "
                         f"step(), and this {name}'s step {took}: the step could go over the plan's budget; "
                         "make a new plan with optimizer= this optimizer")


def optimize(model: nn.Module, example_inputs, budget="min", *, strategy: str = "memfit",
             optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None, loss_fn: Callable | None = None,
             time_limit: float = 20.0, variants: bool | str = True, offload: bool | None = None,
             offload_dir: str | None = None, grads_exist: bool = False, plan_: Plan | None = None,
             tiling: bool = True, ddp: bool | str = False) -> PlannedModule:
    """Make ``model`` train under a memory budget.

    Example::

        planned = memfit.optimize(model, images, budget="2GiB")
        opt = torch.optim.SGD(planned.parameters(), lr=0.1)   # the same parameters as model's
        loss = F.cross_entropy(planned(images), labels); loss.backward(); opt.step()

    The returned module computes the same outputs, gradients and BatchNorm running statistics as
    ``model`` (it shares its parameters and buffers), with activations recomputed as the plan says so
    that the step's peak stays under the budget. ``planned.plan`` is the :class:`Plan`,
    ``planned.report`` the predicted figures (bytes, seconds).

    Args:
        model, example_inputs, budget, strategy, optimizer, time_limit, variants, loss_fn, offload,
            offload_dir, grads_exist, tiling, ddp: as in :func:`plan`.
        plan_: a saved plan to apply (``Plan.load(path)``) instead of solving; it must have been made for
            the same model and input shapes.

    Returns:
        :class:`PlannedModule`.

    Raises:
        as :func:`plan`; ``ValueError`` if ``plan_`` was made for another model (node names, parameter or
        buffer shapes or dtypes), other input shapes, another autocast state or another ``grads_exist``
        (see :func:`check_plan_fits`); ``TypeError`` if ``plan_`` is not a :class:`Plan` (a path: load it with
        ``Plan.load``).
    """
    _check_model(model)
    if not isinstance(model, PlannedModule):  # (refused as already planned, below)
        refuse_decorated_forward(model)  # (before the inputs are bound by its signature)
    _check_switches(variants=variants, grads_exist=grads_exist, tiling=tiling, offload=offload)
    ddp = _check_ddp(ddp)
    given = _as_tuple(example_inputs, model)
    if plan_ is not None and not isinstance(plan_, Plan):  # (a path gave "'str' object has no attribute 'autocast'")
        how = ("memfit.Plan.load(path)" if isinstance(plan_, (str, os.PathLike)) else
               "memfit.Plan.from_dict(d)" if isinstance(plan_, dict) else "memfit.Plan.load(path)")
        raise TypeError(f"plan_ must be a memfit.Plan, not {type(plan_).__name__}: pass {how}")
    if plan_ is not None:
        # (as solving does: an optimizer built on another model was accepted here with a warning alone)
        _check_optimizer(optimizer, model, loss_fn)
        made = {"copy": True, "bucket-views": "bucket-views"}.get(plan_.ddp, False)
        if ddp != made:
            raise ValueError(f"the plan was made with ddp={made!r} (DistributedDataParallel's gradient buckets "
                             f"{'counted' if made else 'not counted'}): pass ddp={made!r}, or make a new plan")
        check_plan_fits(plan_, model, example_inputs, grads_exist or ddp == "bucket-views")
        if budget != "min":
            warnings.warn(f"memfit.optimize: budget={budget!r} is ignored when plan_ is given (the plan was "
                          f"solved for {plan_.budget_bytes} bytes)", stacklevel=2)
        if strategy != "memfit" and strategy != plan_.strategy:
            warnings.warn(f"memfit.optimize: strategy={strategy!r} is ignored when plan_ is given (the plan was "
                          f"made by {plan_.strategy!r})", stacklevel=2)
        if plan_.offloads and offload is False:
            raise ValueError(f"the plan offloads {len(plan_.offloads)} nodes; offload=False contradicts it "
                             "(make a plan with offload=False instead)")
        on_cpu = all(t.device.type == "cpu" for t in given if isinstance(t, torch.Tensor))
        if plan_.offloads and offload_dir is None and offload is None and on_cpu:
            warnings.warn(f"memfit.optimize: the plan offloads {len(plan_.offloads)} nodes and no offload_dir is given: "
                          "their saved tensors go to a disk store in a fresh directory under tempfile.gettempdir() "
                          "(name one with offload_dir=..., or make a plan with offload=False)", stacklevel=2)
        if plan_.solved_digest is not None and plan_.solved_digest != plan_.decision_digest():
            warnings.warn(f"memfit.optimize: the plan was edited after it was solved (regions, offloads, variants, "
                          f"stats_recompute or tiled stripes differ): its predicted peak ({plan_.predicted_peak_bytes} bytes) and "
                          f"step time no longer hold, nor does its budget ({plan_.budget_bytes} bytes). Check it "
                          "by measuring a step, or solve again", stacklevel=2)
        if not any(p.requires_grad for p in model.parameters()) and not any(
                t.requires_grad for t in given if isinstance(t, torch.Tensor)):
            _refuse_nothing_trains(model)
        _refuse_function_arguments(model, given)
        captured = capture(model, forward_arguments(model, given))
        check_traced_outputs(model, captured.gm, lambda: _private_copy(given))
        _warn_untrained_by_optimizers(model, _optimizers(optimizer), list(captured.gm.parameters()))
        # (with the parameters it trains outside the model, a head kept in the loss: a plan made with that head
        # frozen was applied to a loop training it, 1.79x its budget)
        outside = _outside_params([model, captured.gm], _optimizers(optimizer))
        named = dict(model.named_parameters())  # (and a head of the model that only the loss trains)
        by_loss = [named[n] for n in plan_.loss_trained if n in named and named[n].requires_grad]
        _check_optimizer_state(plan_, optimizer, _state_params(list(captured.gm.parameters()), by_loss, outside))
        return PlannedModule(captured, plan_, report=_report(plan_), offload_dir=offload_dir)
    store = offload_store(given, strategy, offload, offload_dir)
    result, captured, _ = plan(model, example_inputs, budget, strategy=strategy, optimizer=optimizer,
                               variants=variants, loss_fn=loss_fn, time_limit=time_limit, grads_exist=grads_exist,
                               tiling=tiling, ddp=ddp, _store=store)
    return PlannedModule(captured, result, report=_report(result), offload_store=store)


def _report(p: Plan) -> dict:
    return {"strategy": p.strategy, "budget_bytes": p.budget_bytes, "fixed_bytes": p.fixed_bytes,
            "predicted_peak_bytes": p.predicted_peak_bytes,
            "predicted_activation_peak_bytes": p.predicted_peak_bytes - p.fixed_bytes,
            "predicted_step_seconds": p.predicted_step_seconds, "predicted_host_bytes": p.predicted_host_bytes,
            "solve_seconds": p.solve_seconds,
            "mip_gap": p.mip_gap, "decisions": p.counts()}
