"""``memfit`` with more stripe counts offered for its striped blocks (``memfit.solve.tiling.STRIPES``).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/stripe_counts.py vgg16:2:128 --stripes 2,3,4,8 --budgets 33,40

Profiles the model once, then its striping candidates with each stripe count of ``--stripes`` (a profile each),
and solves ``memfit`` over them as :func:`memfit.plan` does (``_spec.solve_as_planned``) at each of ``--budgets``
(percent of plain PyTorch's activation peak); prints the chosen blocks and stripes, the predicted overhead and the
predicted activation peak (fraction of plain PyTorch's).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from _spec import memfit_options, profiled_spec, solve_as_planned, zoo_setup

from memfit.solve import tiling


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="model:batch:image-size, e.g. vgg16:2:128")
    ap.add_argument("--stripes", default="2,3,4,8")
    ap.add_argument("--budgets", default="33,40")
    ap.add_argument("--costs", default=None, help="saved profile of the unstriped model to read (or write)")
    args = ap.parse_args()
    tiling.STRIPES = tuple(int(s) for s in args.stripes.split(","))
    model, x, y, loss = zoo_setup(args.spec)
    captured, costs, plain, act = profiled_spec(args.spec, args.costs)
    t0 = time.perf_counter()
    options, rounding = memfit_options(model, x, y, loss, captured, costs)
    print(f"{len(options) - 1} striped candidates profiled in {time.perf_counter() - t0:.0f} s")
    for pct in (float(p) for p in args.budgets.split(",")):
        plan, _ = solve_as_planned("memfit", options, rounding, int(costs.fixed_bytes + pct / 100 * act), 20.0)
        blocks = [(b["nodes"][0], b["nodes"][-1], b["stripes"]) for b in plan.tiled]
        print(f"{args.spec} @ {pct}%: {plan.predicted_step_seconds / plain.predicted_step_seconds:.3f}x predicted, "
              f"activation {(plan.predicted_peak_bytes - costs.fixed_bytes) / act:.3f}, striped {blocks or 'none'}",
              flush=True)


if __name__ == "__main__":
    main()
