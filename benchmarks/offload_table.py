"""Issue 4's table from `memfit bench` results with the disk store (benchmarks/offload_all.sh): per budget,
the measured activation peak and overhead of every strategy that fits it, and whether the joint plan
(`memfit`, the row solved for that budget) is at least as fast as the fastest recompute-only (`chen`,
`remat-ilp`) and offload-only (`vdnn-all`, `vdnn-conv`) plan whose measured activation peak fits it.

    python benchmarks/offload_table.py runs/offload_resnet50/results.json runs/offload_vgg16/results.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RECOMPUTE = ("chen", "remat-ilp")
OFFLOAD = ("vdnn-all", "vdnn-conv")


def main(paths: list[str]) -> None:
    for path in paths:
        rows = [r for r in json.loads(Path(path).read_text()) if not r.get("error") and r.get("planned")]
        if not rows:
            continue
        plain = rows[0]["baseline"]["activation_peak_bytes"]
        print(f"\n{rows[0]['model']} {rows[0]['batch_size']}x{rows[0]['input_shape'][-1]}: plain activation "
              f"peak {plain / 2**20:.0f} MiB\n")
        print("| strategy | budget | act. peak | overhead | host bytes | decisions |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            b = r.get("budget_fraction")
            d = r["decisions"] or {}
            print(f"| {r['strategy']} | {f'{b:.0%}' if b else '-'} | "
                  f"{r['planned']['activation_peak_bytes'] / plain:.0%} | {r['overhead']:.2f} | "
                  f"{(r['planned'].get('host_peak_bytes') or 0) / 2**20:.0f} MiB | "
                  f"keep {d.get('keep')} / recompute {d.get('recompute')} / offload {d.get('offload')} |")
        budgets = sorted({r["budget_fraction"] for r in rows if r["strategy"] == "memfit"
                          and r.get("budget_fraction")}, reverse=True)
        print("\n| budget | memfit (joint) | fastest recompute-only | fastest offload-only | joint at least as fast |")
        print("|---|---|---|---|---|")
        for b in budgets:
            def fastest(names, b=b, rows=rows, plain=plain):
                fit = [r for r in rows if r["strategy"] in names
                       and r["planned"]["activation_peak_bytes"] <= b * plain * 1.0001]
                return min(fit, key=lambda r: r["overhead"]) if fit else None

            joint = next((r for r in rows if r["strategy"] == "memfit" and r.get("budget_fraction") == b), None)
            rec, off = fastest(RECOMPUTE), fastest(OFFLOAD)
            cell = lambda r: f"{r['strategy']} {r['overhead']:.2f}x" if r else "none fits"
            best = min([r["overhead"] for r in (rec, off) if r] or [float("inf")])
            verdict = "-" if joint is None else (
                "yes" if joint["overhead"] <= best else f"{joint['overhead'] - best:+.2f}x slower")
            print(f"| {b:.0%} | {cell(joint)} | {cell(rec)} | {cell(off)} | {verdict} |")


if __name__ == "__main__":
    main(sys.argv[1:])
