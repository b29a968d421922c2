"""How far a model's ``memfit`` floor would drop if each convolution's backward held no weight-sized transient.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/floor_without_conv_workspace.py unet:2:96 [--costs FILE]

oneDNN's convolution backward holds a weight-sized transient beside the weight's gradient (a 512-channel 3x3
convolution: 9 MiB). Solves the floor (``budget="min"``, :func:`memfit.solve.strategies.plan_at_floor`) from one
profile as measured, then with every ``Conv2d``'s backward workspace (and its variants') lowered by half a weight
and by a whole one: the most a variant computing the weight gradient in chunks could gain. Prints each floor as a
fraction of plain PyTorch's predicted activation peak. ``--costs``: a saved profile (``Costs.to_dict`` JSON), read
if it exists, else written, so reruns solve the same measured costs.
"""

from __future__ import annotations

import argparse
import copy
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from _spec import profiled_spec
from torch import nn

from memfit.solve.strategies import plan_at_floor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="model:batch:image-size, e.g. unet:2:96")
    ap.add_argument("--costs", default=None, help="saved profile to read (or write)")
    args = ap.parse_args()
    captured, costs, _, act = profiled_spec(args.spec, args.costs)
    convs = {n.name: m.weight.numel() * m.weight.element_size() for n in captured.gm.graph.nodes
             if n.op == "call_module" and isinstance(m := captured.gm.get_submodule(n.target), nn.Conv2d)}
    for share in (0.0, 0.5, 1.0):
        c = copy.deepcopy(costs)
        for n in c.nodes:
            if n.name in convs:
                cut = int(share * convs[n.name])
                n.bwd_workspace = max(0, n.bwd_workspace - cut)
                for v in n.variants.values():
                    v.bwd_workspace = max(0, v.bwd_workspace - cut)
        floor, _ = plan_at_floor("memfit", captured.graph, c, c.fixed_bytes, 20.0, use_offload=False)
        print(f"{args.spec}: convolution backward workspace less {share:.0%} of a weight: floor "
              f"{(floor - c.fixed_bytes) / act:.3f} of plain PyTorch's activation peak", flush=True)


if __name__ == "__main__":
    main()
