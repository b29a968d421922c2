"""What ``bn-from-output`` buys the planner, per kind of activation: the traced graph against one rewritten by hand.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bn_from_output_check.py mobilenet_v2:32:128 --budgets 33,40 --rounds 10

At a third of the activation peak, most of what ``memfit`` recomputes on MobileNet-V2 and GoogLeNet is
BatchNorm followed by its activation: a region starts at the BatchNorm's input (the convolution's output,
which BatchNorm's backward needs) and normalizes it again. With in-place activated BatchNorm (Rota Bulo et
al., CVPR 2018; MONeT section 4), BatchNorm's backward reads its *output* instead, so a region can start
after it and recompute only the activation. The planner does not offer it: torchvision writes the
activation in place over that output (``nn.ReLU(inplace=True)``), and a node's outputs are fixed storages in
the accounting, so "the same activation out of place" is not a per-node variant it can express: ``memfit``
solves the rewritten graph beside the traced one (:mod:`memfit.graph.bn_output`), for ReLU6 and Hardtanh only.
This script measured why: it rewrites ReLU and LeakyReLU pairs too, and there the out-of-place activation
cost as much as it spared (ResNet-50, GoogLeNet; BENCHMARKS.md, 2026-12-04).

``--graphs`` picks the graphs: ``traced``, ``bn-from-output`` (the hand rewrite below) and ``relu-conv``
(:func:`memfit.graph.bn_output.apply_bn_from_output` with every BatchNorm -> ReLU -> ``nn.Conv2d`` triple run as
one call that saves the BatchNorm's output instead of the ReLU's, :mod:`memfit.variants.relu_conv`, beside the
ReLU6 / Hardtanh pairs the planner rewrites; its profile shares the traced graph's times for the nodes the two
graphs share, as the planner's does):

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bn_from_output_check.py resnet50:8:128 --graphs traced,relu-conv \
        --budgets 33,40 --rounds 12

It makes the rewrite by hand, as a second graph: every BatchNorm whose only reader is an in-place
ReLU / ReLU6 / LeakyReLU / Hardtanh (module or ``F.relu(x, inplace=True)``) runs as
:class:`memfit.variants.BatchNorm2dFromOutput` (sharing the parameters and buffers) and the activation out of
place. It profiles both graphs, solves ``memfit`` (no offloading) at each ``--budgets`` percent of plain
PyTorch's activation peak on each, and times plain PyTorch and the plans round-robin
(:func:`memfit.bench.harness.interleaved_step_seconds`); memory (exact tracker) and gradients come from one
step of each plan from plain PyTorch's weights. The rewritten graph's gradients are PyTorch's to float32
rounding only (its BatchNorm recovers the normalized input from the rounded output), so they are judged
by the one-step float64 check (:func:`memfit.bench.job.rounding_check`) as ``conv-native`` plans are.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from _spec import measured_setup
from torch import fx, nn

import memfit
from memfit.api import bn_from_output_option
from memfit.bench.harness import compare, fresh_copy, interleaved_step_seconds, measure_training
from memfit.bench.job import rounding_verdict, rounds_differently
from memfit.graph import capture
from memfit.graph.bn_output import apply_bn_from_output, bn_activation_pairs, relu_conv_triples
from memfit.graph.capture import Captured, graph_of
from memfit.profile.costs import profile_graph
from memfit.runtime.overhead import price_regions
from memfit.solve.strategies import InfeasibleBudgetError, make_plan, plan_at_floor
from memfit.variants import bn_from_module

_ACTS = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh)
_BNS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _inplace_activation(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        m = gm.get_submodule(n.target)
        return type(m) in _ACTS and m.inplace and not (isinstance(m, nn.LeakyReLU) and m.negative_slope < 0)
    return n.op == "call_function" and n.target is F.relu and n.kwargs.get("inplace", False) is True


def rewrite(captured: Captured) -> tuple[Captured, list[str]]:
    """A copy of ``captured`` with each BatchNorm -> in-place activation pair run as BatchNorm from its output
    and the activation out of place; the names of the BatchNorm nodes rewritten."""
    gm = captured.gm
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    new = fx.GraphModule(gm, graph, type(gm).__name__)
    holder, done = nn.Module(), []
    new.add_module("memfit_bfo", holder)
    for n in list(graph.nodes):
        if n.op != "call_module" or type(new.get_submodule(n.target)) not in _BNS:
            continue
        bn = new.get_submodule(n.target)
        users = list(n.users)
        if len(users) != 1 or not _inplace_activation(new, users[0]) or not bn.training:
            continue
        if bn.weight is not None and bool((bn.weight.detach() == 0).any()):
            continue  # (a zero-initialized residual BatchNorm: its output does not give back its input)
        act = users[0]
        key = f"m{len(holder._modules)}"
        holder.add_module(key + "bn", bn_from_module(bn))
        n.target = f"memfit_bfo.{key}bn"
        if act.op == "call_module":
            m = new.get_submodule(act.target)
            out_of_place = type(m).__new__(type(m))
            out_of_place.__dict__.update(m.__dict__)
            out_of_place.inplace = False
            holder.add_module(key + "act", out_of_place)
            act.target = f"memfit_bfo.{key}act"
        else:
            act.kwargs = {**act.kwargs, "inplace": False}
        done.append(n.name)
    new.recompile()
    return Captured(gm=new, graph=graph_of(new), model=captured.model, attributes=captured.attributes), done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="model:batch:image-size, e.g. mobilenet_v2:32:128")
    ap.add_argument("--budgets", default="33,40",
                    help="activation budgets, percent of plain PyTorch's, or min (each graph's floor)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--graphs", default="traced,bn-from-output",
                    help="comma-separated: traced, bn-from-output, relu-conv (traced is always solved)")
    args = ap.parse_args()
    model, x, y, loss, base = measured_setup(args.spec)
    asked = ["as traced"] + [g for g in args.graphs.split(",") if g not in ("traced", "")]
    unknown = [g for g in asked[1:] if g not in REWRITES]
    if unknown:
        ap.error(f"unknown graph {unknown[0]!r}: choose from traced, {', '.join(REWRITES)}")
    graphs = {}
    captured0 = capture(fresh_copy(model))
    costs0 = profile_graph(captured0, (x,), with_variants=True, loss_fn=lambda out: loss(out, y))
    price_regions(costs0)
    graphs["as traced"] = (captured0, costs0)
    for name in asked[1:]:
        if name == "relu-conv":  # (the planner's own option: the nodes both graphs share keep the traced times)
            option = bn_from_output_option(captured0, costs0, (x,), lambda out: loss(out, y), relu_conv=True)
            captured, costs = option.captured, option.costs
            print(f"relu-conv: {len(option.bn_from_output)} BatchNorms from their output, "
                  f"{len(relu_conv_triples(captured0.gm, option.bn_from_output))} of them before a ReLU and a "
                  "convolution", flush=True)
        else:
            captured, done = rewrite(capture(fresh_copy(model)))
            print(f"rewritten: {len(done)} BatchNorm -> activation pairs", flush=True)
            costs = profile_graph(captured, (x,), with_variants=True, loss_fn=lambda out: loss(out, y))
            price_regions(costs)
        graphs[name] = (captured, costs)
    plain_plan = make_plan("none", captured0.graph, costs0)
    act = plain_plan.predicted_peak_bytes - costs0.fixed_bytes
    rows, setups = [], [(plain := fresh_copy(model), plain)]
    for pct in (b if b == "min" else float(b) for b in args.budgets.split(",")):
        for name, (captured, costs) in graphs.items():
            try:
                if pct == "min":  # (the floor: the least memory each graph's plans reach)
                    plan = plan_at_floor("memfit", captured.graph, costs, costs.fixed_bytes, args.time_limit,
                                         use_offload=False)[1]
                else:
                    budget = int(costs.fixed_bytes + pct / 100 * act)
                    plan = make_plan("memfit", captured.graph, costs, budget_bytes=budget, time_limit=args.time_limit,
                                     use_offload=False)
            except InfeasibleBudgetError as exc:
                print(f"{name} @ {pct}: infeasible ({exc.smallest_feasible_bytes})")
                continue
            predicted = plan.predicted_step_seconds / plain_plan.predicted_step_seconds
            remake = REWRITES.get(name, lambda c: (c, []))
            fresh = capture(fresh_copy(model))  # (measuring trains the copy: each plan from plain PyTorch's weights)
            pm = memfit.PlannedModule(remake(fresh)[0], plan)
            fig = measure_training(pm, pm, (x,), y, loss, steps=1)
            check = compare(base, fig)
            check = (f"equal ({check['max_abs_grad_diff']:.1e})" if check["gradients_match"] and check["bn_stats_match"]
                     else f"DIFFER ({check['max_abs_grad_diff']:.1e})")
            if name != "as traced" or rounds_differently(plan):  # (conv-native: float32 rounding too)
                check = _rounding(model, plan, x, y, loss, remake)
            timed_captured = remake(capture(fresh_copy(model)))[0]
            timed = memfit.PlannedModule(timed_captured, plan)
            setups.append((timed, timed))
            rows.append((name, pct, plan, fig, predicted, check))
    seconds = interleaved_step_seconds(setups, (x,), y, loss, rounds=args.rounds)
    print(f"plain PyTorch step {seconds[0]:.3f} s (median of {args.rounds}); activation peak "
          f"{base.activation_peak_bytes / 2**20:.1f} MiB")
    print("| graph | budget | activation peak | predicted overhead | measured overhead | regions (nodes) | variants "
          "| gradients |")
    print("|---|---|---|---|---|---|---|---|")
    for k, (name, pct, plan, fig, predicted, check) in enumerate(rows, start=1):
        print(f"| {name} | {pct if pct == 'min' else f'{pct:g}%'} | {100 * fig.activation_peak_bytes / base.activation_peak_bytes:.1f}% "
              f"| {predicted:.3f}x | {seconds[k] / seconds[0]:.3f}x "
              f"| {len(plan.regions)} ({sum(hi - lo + 1 for lo, hi in plan.region_spans())}) "
              f"| {plan.counts()['variants'] or '-'} | {check} |", flush=True)


def _relu_conv(captured: Captured) -> tuple[Captured, list[str]]:
    """``captured`` with the planner's BatchNorm -> activation pairs and every BatchNorm -> ReLU -> ``nn.Conv2d``
    triple run from BatchNorm's output (:func:`memfit.graph.bn_output.apply_bn_from_output`); the BatchNorm nodes."""
    names = bn_activation_pairs(captured.gm, relu_conv=True)
    return apply_bn_from_output(captured, names), names


#: the rewritten graphs ``--graphs`` can ask for, by name
REWRITES = {"bn-from-output": rewrite, "relu-conv": _relu_conv}


def _rounding(model, plan, x, y, loss, remake) -> str:
    """One step from plain PyTorch's weights: the rewritten plan's gradients and BatchNorm statistics against
    plain PyTorch's float32 and float64 ones (:func:`memfit.bench.peers.one_step_check`); ``remake`` rewrites a
    fresh capture as the plan's graph was."""
    from memfit.bench import peers

    reference = peers.reference_grads(model, (x,), y, loss, 0)
    pm = memfit.PlannedModule(remake(capture(fresh_copy(model)))[0], plan)
    buffers: dict[str, torch.Tensor] = {}
    grads = peers.one_step_grads(pm, pm, (x,), y, loss, 0, buffers)
    out = peers.one_step_check(grads, reference, buffers)
    verdict = rounding_verdict(out)
    return (f"{'equal to float32 rounding' if verdict['gradients_match'] and verdict['bn_stats_match'] else 'DIFFER'}"
            f" (one step vs float64 {out['vs_float64']:.1e}, plain float32's {out['float32_noise']:.1e}; BatchNorm "
            f"statistics {out.get('buffers_vs_float64', 0.0):.1e}, plain's {out.get('buffers_float32_noise', 0.0):.1e})")


if __name__ == "__main__":
    main()
