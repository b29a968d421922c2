"""Seconds memfit spends tracing a shape-specialized forward again for a call of smaller shapes.

A Hugging Face model's forward reads sizes in Python code, so memfit traces it with the example batch's shapes
(``memfit.graph.sized``); a call with smaller tensors (a short last batch, a shorter sequence) is traced again with
its shapes, once per shape (``memfit.runtime.reshaped``). With batches padded to the longest sequence in each (dynamic
padding), that trace is paid at most steps. This plans each model (``benchmarks/transformers_models.py``'s small
configurations) at ``50%`` for ``BATCH x TOKENS``, then calls it with ``--rounds`` sequence lengths, each new, one
token shorter each time: the first call of a length traces and runs a step, the second only runs it (steps: forward
and backward); printed, the median over the lengths of (first - second), and the trace's share of the first call.
Needs ``pip install transformers`` (not a memfit dependency).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/retrace_seconds.py [--models llama,gpt2] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from transformers_models import MODELS, build

import memfit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS, help="comma-separated: " + MODELS.replace(",", ", "))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=9, help="sequence lengths called (each traced once)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; planned for {args.batch} x "
          f"{args.tokens} at 50%; {args.rounds} shorter lengths")
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = build(name)
        ids = torch.randint(0, 2000, (args.batch, args.tokens))
        planned = memfit.optimize(model, (ids, ids), "50%", loss_fn=lambda out: out)
        traces, steps = [], []
        for k in range(1, args.rounds + 1):
            short = ids[:, :args.tokens - k].contiguous()
            times = []
            for _ in range(2):
                start = time.perf_counter()
                planned(short, short).backward()
                times.append(time.perf_counter() - start)
            traces.append(times[0] - times[1])
            steps.append(times[1])
        trace = statistics.median(traces)
        print(f"{name:9s} trace {trace:.3f} s (median; {min(traces):.3f}-{max(traces):.3f}), step "
              f"{statistics.median(steps):.3f} s: {trace / (trace + statistics.median(steps)):.0%} of a first call",
              flush=True)


if __name__ == "__main__":
    main()
