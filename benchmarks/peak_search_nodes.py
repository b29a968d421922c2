"""Smallest feasible budgets (``budget="min"``, predicted) of ``remat-ilp`` and ``memfit`` (no offloading) per zoo model
at several node limits of the peak-minimizing program's search (:data:`memfit.solve.ilp.PEAK_SEARCH_NODES`, with
:data:`memfit.solve.ilp.PEAK_SEARCH_WORK` set to 0 so that the limit is exactly the one given), from one profile.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/peak_search_nodes.py resnet50:8:128 unet:2:96 --nodes 300,1000,3000

Prints each floor as a fraction of plain PyTorch's predicted activation peak, and the seconds its search took.
``--costs DIR`` keeps each model's profile there (``Costs.to_dict``), so that two commits solve the same costs.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from _spec import profiled_spec

from memfit.solve import ilp, strategies
from memfit.solve.strategies import smallest_feasible


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+", help="model:batch:image-size, e.g. resnet50:8:128")
    ap.add_argument("--nodes", default="300,1000,3000", help="node limits, comma-separated")
    ap.add_argument("--costs", help="folder for the profiles (JSON): written if missing, read if present")
    args = ap.parse_args()
    limits = [int(v) for v in args.nodes.split(",")]
    ilp.PEAK_SEARCH_WORK = 0
    for spec in args.specs:
        path = os.path.join(args.costs, spec.replace(":", "_") + ".json") if args.costs else None
        captured, costs, _, act = profiled_spec(spec, path)
        print(f"{spec}: {len(captured.graph.nodes)} nodes, plain activation peak {act} B", flush=True)
        for label, variants in (("remat-ilp", False), ("memfit", True)):
            for limit in limits:
                ilp.PEAK_SEARCH_NODES = limit
                strategies._LOWS.clear()  # (the lowest-memory plans are kept per profile: solve again)
                t0 = time.perf_counter()
                floor = smallest_feasible(captured.graph, costs, costs.fixed_bytes, 20, use_variants=variants,
                                          use_offload=False)
                print(f"  {label}, {limit} nodes: floor {100 * (floor - costs.fixed_bytes) / act:.2f}% "
                      f"({floor - costs.fixed_bytes} B) in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
