"""One markdown table per model from `memfit bench` results (issue 5's per-model tables): every row's
budget, measured activation peak (MiB and % of plain PyTorch's), overhead, prediction error and gradient
check. Result files of the same model (a run with the disk store next to one without) are merged.

    python benchmarks/bench_table.py runs/bench_vgg16/results.json runs/bench_vgg16_offload/results.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from summarize import label


def _budget(r: dict) -> str:
    if r["strategy"] == "torch-budget":
        return f"knob {r.get('budget_fraction')}"
    b = r.get("budget_fraction")
    return f"{b:.0%}" if b else "-"


def main(paths: list[str]) -> None:
    by_model: dict[str, list[dict]] = {}
    for path in paths:
        rows = json.loads(Path(path).read_text())
        if rows:
            by_model.setdefault(f"{rows[0]['model']} {rows[0]['batch_size']}x{rows[0]['input_shape'][-1]}",
                                []).extend(rows)
    for model, rows in by_model.items():
        base = rows[0]["baseline"]
        plain = base["activation_peak_bytes"]
        print(f"\n{model}: plain PyTorch total peak {base['peak_bytes'] / 2**20:.1f} MiB, fixed "
              f"{base['fixed_bytes'] / 2**20:.1f} MiB, activation peak {plain / 2**20:.1f} MiB, "
              f"step {base['step_seconds']:.2f} s\n")
        print("| strategy | budget | activation peak | overhead | pred. err | gradients |")
        print("|---|---|---|---|---|---|")
        seen = set()
        for r in rows:
            key = (label(r), _budget(r))
            if r["strategy"] == "none" and "none" in {k[0] for k in seen}:
                continue  # the plain row of the second file
            seen.add(key)
            if r.get("error") or not r.get("planned"):
                err = r.get("error") or "no result"
                if r.get("smallest_feasible_fraction") is not None:
                    err = f"infeasible (smallest feasible: {r['smallest_feasible_fraction']:.0%})"
                elif "cannot be imported" in err:
                    err = "not installed (optional peer)"
                print(f"| {label(r)} | {_budget(r)} | {err} | | | |")
                continue
            p = r["planned"]
            act = p["activation_peak_bytes"]
            pred = p.get("predicted_peak_bytes")
            err = f"{(pred - p['peak_bytes']) / p['peak_bytes']:+.2%}" if pred else "-"
            grads = "equal" if r.get("gradients_match") else f"differ ({r.get('max_abs_grad_diff', 0):.1e})"
            if r.get("rounding_check") and r.get("gradients_match"):
                grads = "float32 rounding (one step as close to float64 as plain PyTorch's)"
            one = r.get("one_step_grad_check")
            if one and not r.get("gradients_match"):
                grads += f"; one step {one['max_abs_grad_diff']:.1e}"
            print(f"| {label(r)} | {_budget(r)} | {act / 2**20:.1f} MiB ({act / plain:.0%}) | "
                  f"{r['overhead']:.2f}x | {err} | {grads} |")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(sys.argv[1:])
