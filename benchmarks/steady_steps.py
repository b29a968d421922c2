"""Plain PyTorch's training steps on the CPU, one by one, with the C allocator as it is and after
:func:`memfit.profile.timing.retain_freed_memory`: each step's wall time, user and system CPU time and page
faults.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/steady_steps.py mobilenet_v2:32:128 [--steps 8]

Each setting runs in its own process (the setting holds for the rest of a process). With glibc's default, every
allocation above its mmap threshold is a mapping of its own, returned to the system when freed, so every step
pays its page faults again; with the setting, steps after the first few fault no more.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def steps(spec: str, n: int, retain: bool) -> None:
    import torch
    from _spec import zoo_setup

    from memfit.profile.timing import retain_freed_memory

    if retain:
        print(f"retain_freed_memory(): {retain_freed_memory()}")
    else:
        os.environ["MEMFIT_SYSTEM_ALLOCATOR"] = "1"  # zoo_setup would retain it otherwise
    model, x, y, loss = zoo_setup(spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for k in range(n):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss(model(x), y).backward()
        opt.step()
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        print(f"step {k}: {wall:.3f} s wall, user {r1.ru_utime - r0.ru_utime:.2f} s, "
              f"system {r1.ru_stime - r0.ru_stime:.2f} s, {r1.ru_minflt - r0.ru_minflt} page faults", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="model:batch:image-size, e.g. mobilenet_v2:32:128")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--_child", choices=("system", "retain"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        steps(args.spec, args.steps, args._child == "retain")
        return
    for setting in ("system", "retain"):
        print(f"== {args.spec}, allocator: {setting}", flush=True)
        subprocess.run([sys.executable, __file__, args.spec, "--steps", str(args.steps), "--_child", setting],
                       check=True, cwd=os.path.dirname(os.path.abspath(__file__)))


if __name__ == "__main__":
    main()
