"""Summary table of `memfit bench` results (issue 5): for each model, the lowest measured activation peak
each strategy reaches at an overhead of at most 1.10 and at most 1.25. Several results files of one model
(e.g. a run with the disk store next to one without) are merged; rows that used the disk store are
labelled "+ disk store".

    python benchmarks/summarize.py runs/bench_*/results.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def label(row: dict) -> str:
    if row["strategy"] == "torch-budget":
        return f"torch-budget ({row.get('backend')})"
    if (row.get("offload_store") or "").startswith("disk") and row["strategy"] in ("memfit", "vdnn-all",
                                                                                   "vdnn-conv"):
        return f"{row['strategy']} + disk store"
    return row["strategy"]


def main(paths: list[str]) -> None:
    levels = (1.10, 1.25)
    by_model: dict[str, list[dict]] = {}
    plain: dict[str, int] = {}
    for path in paths:
        rows = json.loads(Path(path).read_text())
        ok = [r for r in rows if not r.get("error") and r.get("planned") and r.get("overhead")]
        if not ok:
            continue
        model = f"{ok[0]['model']} {ok[0]['batch_size']}x{ok[0]['input_shape'][-1]}"
        plain.setdefault(model, ok[0]["baseline"]["activation_peak_bytes"])
        by_model.setdefault(model, []).extend(ok)
    print("| model | plain act. peak | strategy | " + " | ".join(f"act. peak at <= {x:.2f}x" for x in levels) + " |")
    print("|---|---|---|" + "---|" * len(levels))
    for model, ok in by_model.items():
        for name in dict.fromkeys(label(r) for r in ok if r["strategy"] != "none"):
            cells = []
            for level in levels:
                fits = [r["planned"]["activation_peak_bytes"] for r in ok
                        if label(r) == name and r["overhead"] <= level and r.get("under_budget") is not False]
                cells.append(f"{min(fits) / 2**20:.0f} MiB ({min(fits) / plain[model]:.0%})" if fits else "-")
            print(f"| {model} | {plain[model] / 2**20:.0f} MiB | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
