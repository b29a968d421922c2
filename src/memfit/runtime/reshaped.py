"""A plan's decisions applied to a trace of smaller inputs (a short last batch, a shorter sequence).

A forward whose Python code reads sizes (Hugging Face's mask preparation) is traced with the example's shapes
(:mod:`memfit.graph.sized`), so its graph holds for them only. For a call whose tensors are no larger in any
dimension, :func:`traced_for` traces the forward again with that call's shapes. Where the new graph has the same
nodes, reading the same nodes, as the planned one (the Python code took the same path: no loop ran another number
of times) and no node's output is larger (by the fake tensors' shapes), the plan's decisions (what to keep,
recompute or offload, which operator variant) apply to it unchanged: each tensor of the schedule is then no larger
than the one the plan counted, so its peak is no higher than the planned one. No profile or solve runs, so the
step's other tensors (the loss's targets) need not have the new shapes at planning time.
"""

from __future__ import annotations

import copy
import warnings
from itertools import zip_longest

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from memfit.graph.bn_output import apply_bn_from_output
from memfit.graph.calls import forward_arguments, node_ops
from memfit.graph.capture import Captured, capture
from memfit.graph.sized import FAKE
from memfit.solve.plan import Plan


def _nbytes(value) -> int:
    """Bytes of the tensors in a node's value on fake tensors."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def mismatch(planned: fx.GraphModule, traced: fx.GraphModule) -> str | None:
    """Why the plan's decisions for ``planned`` cannot apply to ``traced`` (a trace of the same model with smaller
    inputs), or ``None`` where they can: same nodes in the same order (name, kind, target), each reading the same
    nodes, and no node's value larger than the planned one (``node.meta[FAKE]``; a node whose planned size is known
    must have its new one known too). Constant arguments may differ (``.view(b, s, 4, 8)`` with the new sizes)."""
    for old, new in zip_longest(planned.graph.nodes, traced.graph.nodes):
        if old is None or new is None or (old.name, old.op, old.target) != (new.name, new.op, new.target) or [
                n.name for n in old.all_input_nodes] != [n.name for n in new.all_input_nodes]:
            where = f"from its node {old.name} on" if old is not None else "past the planned graph's end"
            return (f"the forward's Python code took another path for these shapes ({where}: a loop over a size ran "
                    "another number of times, or a test of a size went the other way)")
        if FAKE not in old.meta:
            continue
        if FAKE not in new.meta:
            return f"the size of {new.name} is not known for these shapes"
        if _nbytes(new.meta[FAKE]) > _nbytes(old.meta[FAKE]):
            return f"{new.name} is larger for these shapes than planned"
    return None


def traced_for(model: nn.Module, planned: Captured, plan: Plan, args: tuple) -> tuple[Captured, Plan] | str:
    """``model`` traced for the positional inputs ``args`` (no larger than the plan's example), with the plan's
    graph rewrites applied, and the plan for it (its decisions unchanged, its input shapes and operations those of
    the new trace), where the decisions apply (:func:`mismatch`); else why not, in words for a warning.

    The trace leaves the model, its buffers and the random generators as they were (a training step is under way).
    Warnings of the trace itself are dropped: the planning trace gave them already."""
    if plan.tiled:  # (its stripes were sized for the planned shapes)
        return "the plan stripes blocks of the graph for the planned shapes"
    devices = sorted({t.device.index or 0 for t in tree_leaves(list(args)) if isinstance(t, torch.Tensor)
                      and t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            captured = capture(model, forward_arguments(model, args))
    except Exception as exc:  # noqa: BLE001 -- any failure of the trace: the call runs unplanned
        return f"the forward could not be traced for these shapes ({type(exc).__name__})"
    if plan.bn_from_output:
        captured = apply_bn_from_output(captured, plan.bn_from_output)
    why = mismatch(planned.gm, captured.gm)
    if why is not None:
        return why
    reshaped = copy.copy(plan)
    reshaped.input_shapes = [list(t.shape) for t in args if isinstance(t, torch.Tensor)]
    if plan.node_ops:
        reshaped.node_ops = node_ops(captured.gm)
    return captured, reshaped

