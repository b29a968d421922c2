"""How HiGHS's search options change the ``memfit`` plans found near the floor, from one profile.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/ilp_search.py resnet50:8:128 --budgets 40,35 --repeats 2 \\
        --setups "default;mip_heuristic_effort=0.3;mip_heuristic_effort=0.6"

Each setup is a ``;``-separated entry of ``name=value[,name=value]`` HiGHS options (``default``: none),
set on every program (``memfit.solve.ilp.HIGHS_OPTIONS``). For each activation budget (percent of plain
PyTorch's predicted activation peak) and setup, ``memfit`` (no offloading) is solved and its plan's predicted
overhead read by the replay; nothing is run. The time-limited search varies from run to run: ``--repeats``.

``--costs FILE`` keeps the profile: written by the first run (``Costs.to_dict``), read by the next, so that the
search of two commits can be compared on the same measured costs (``git stash`` or a worktree of the other
commit, ``PYTHONPATH=that/src``). ``--strategy remat-ilp`` solves the recompute-only program instead.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from _spec import profiled_spec

from memfit.solve import ilp
from memfit.solve.strategies import InfeasibleBudgetError, make_plan


def parse_setup(text: str) -> dict[str, object]:
    """``"a=1,b=0.5"`` -> ``{"a": 1, "b": 0.5}``; ``"default"`` -> ``{}``."""
    if text.strip() == "default":
        return {}
    out: dict[str, object] = {}
    for item in text.split(","):
        name, value = item.split("=")
        out[name.strip()] = float(value) if "." in value or "e" in value else int(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="model:batch:image-size, e.g. resnet50:8:128")
    ap.add_argument("--budgets", default="40,35", help="activation budgets, percent, comma-separated")
    ap.add_argument("--setups", default="default;mip_heuristic_effort=0.3",
                    help="';'-separated HiGHS option sets, each 'name=value[,name=value]' or 'default'")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--strategy", default="memfit", choices=["memfit", "remat-ilp"])
    ap.add_argument("--costs", help="JSON file of the profile: written if missing, read if present")
    args = ap.parse_args()
    setups = {text: parse_setup(text) for text in args.setups.split(";")}
    captured, costs, plain, act = profiled_spec(args.spec, args.costs)
    graph, fixed = captured.graph, costs.fixed_bytes
    print("| budget | HiGHS options | activation peak | regions | MIP gap | predicted overhead | solve |")
    print("|---|---|---|---|---|---|---|")
    for _ in range(args.repeats):
        for pct in (float(b) for b in args.budgets.split(",")):
            for text, options in setups.items():
                ilp.HIGHS_OPTIONS.clear()
                ilp.HIGHS_OPTIONS.update(options)
                t0 = time.perf_counter()
                try:
                    p = make_plan(args.strategy, graph, costs, budget_bytes=int(fixed + pct / 100 * act),
                                  time_limit=args.time_limit, use_offload=False)
                except InfeasibleBudgetError as exc:
                    floor = 100 * (exc.smallest_feasible_bytes - fixed) / act
                    print(f"| {pct:g}% | {text} | infeasible (floor {floor:.1f}%) | | | | |", flush=True)
                    continue
                finally:
                    ilp.HIGHS_OPTIONS.clear()
                step = p.predicted_step_seconds / plain.predicted_step_seconds
                print(f"| {pct:g}% | {text} | {100 * (p.predicted_peak_bytes - fixed) / act:.1f}% | {len(p.regions)} "
                      f"| {'-' if p.mip_gap is None else f'{p.mip_gap:.3f}'} | {step:.4f}x "
                      f"| {time.perf_counter() - t0:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
