"""``bn-saved-stats`` in a real step: the same plans with and without it, timed round-robin with plain PyTorch.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bn_saved_stats_ablation.py resnet50:8:128 --budget 40 --rounds 25

Two pairs of plans from one profile of the model: (1) every BatchNorm in a checkpoint region of its own
(legalized), recomputed by PyTorch's kernel or from its saved statistics; (2) ``memfit``'s plan at
``--budget`` percent of plain PyTorch's activation peak, as solved and with ``stats_recompute`` emptied
(the same regions, BatchNorm recomputed as ``torch.utils.checkpoint`` does). Prints each plan's predicted
and measured overhead (ratio of medians over plain PyTorch's, all setups taking one step each in turn) and
its recomputation time as predicted: the difference between the members of a pair is what the variant
saves, in the model and on the machine.
"""

from __future__ import annotations

import argparse
import copy
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


from _spec import profile_once, timed_plans, zoo_setup

from memfit.solve import simulate
from memfit.solve.accounting import Accounting
from memfit.solve.legal import legalize
from memfit.solve.plan import Plan
from memfit.solve.strategies import make_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="model:batch:image-size, e.g. resnet50:8:128")
    ap.add_argument("--budget", type=float, default=40.0, help="memfit's activation budget, percent")
    ap.add_argument("--rounds", type=int, default=25)
    args = ap.parse_args()
    model, x, y, loss = zoo_setup(args.spec)
    captured, costs = profile_once(model, x, y, loss)
    graph, fixed = captured.graph, costs.fixed_bytes
    names = [n.name for n in graph.nodes]
    plain = make_plan("none", graph, costs)
    bns = [i for i, c in enumerate(costs.nodes) if c.recompute_seconds is not None]
    spans = legalize(Accounting.build(graph, costs), [(i, i) for i in bns])
    own = Plan.from_spans("memfit", names, spans)
    own_stats = Plan.from_spans("memfit", names, spans,
                                stats_recompute=[names[i] for lo, hi in spans for i in range(lo, hi + 1) if i in bns])
    act = plain.predicted_peak_bytes - fixed
    solved = make_plan("memfit", graph, costs, budget_bytes=int(fixed + args.budget / 100 * act), use_offload=False)
    emptied = copy.deepcopy(solved)
    emptied.stats_recompute = []
    plans = {f"each of {len(bns)} BatchNorms its own region, PyTorch's kernel": own,
             "the same, from saved statistics": own_stats,
             f"memfit at {args.budget:g}%, BatchNorm by PyTorch's kernel": emptied,
             f"memfit at {args.budget:g}% as solved ({len(solved.stats_recompute)} from saved statistics)": solved}
    seconds = timed_plans(model, plans.values(), x, y, loss, args.rounds)
    print(f"{args.spec}: plain PyTorch {seconds[0]:.3f} s per step (median of {args.rounds}), "
          f"{plain.predicted_step_seconds:.3f} s predicted")
    print("| plans | predicted overhead | measured overhead | predicted recomputation |")
    print("|---|---|---|---|")
    for (label, plan), s in zip(plans.items(), seconds[1:]):
        sim = simulate(graph, costs, plan)
        print(f"| {label} | {sim.step_seconds / plain.predicted_step_seconds:.3f}x | {s / seconds[0]:.3f}x "
              f"| {sim.recompute_seconds:.3f} s |")


if __name__ == "__main__":
    main()
