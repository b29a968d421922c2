"""Plots of ``memfit bench`` results (matplotlib, Agg canvas: no display, no global backend change)."""

from __future__ import annotations

import textwrap
from pathlib import Path

MIB = 2**20


def pareto_plot(rows: list[dict], baseline, path: str | Path, title: str = ""):
    """Measured activation peak (MiB) against overhead (step time / plain PyTorch's), one line per strategy
    and backend, points sorted by memory; plain PyTorch is the black star at (its activation peak, 1.0).
    Rows without a measurement (infeasible budgets, peers that cannot run) are listed in a note under the
    axes instead of being plotted; points whose gradients differ from plain PyTorch are ringed in red.
    Memory is the device's: bytes offloaded to the host store (``vdnn-all``, ``vdnn-conv``, ``memfit`` with
    offloading) are not on the x axis; rows report them as ``planned.host_peak_bytes``.

    Args:
        rows: ``memfit bench`` rows (see :mod:`memfit.bench.sweep`).
        baseline: plain PyTorch's :class:`~memfit.bench.harness.StepFigures` (or anything with
            ``activation_peak_bytes``).
        path: the PNG to write.
        title: plot title (wrapped to the figure's width).

    Returns:
        The matplotlib ``Figure`` (already written to ``path``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    lines: dict[str, list[tuple[float, float, str]]] = {}
    missing: list[str] = []
    for r in rows:
        if r.get("planned") is None or r.get("overhead") is None:
            frac = r.get("budget_fraction")
            missing.append(f"{r['strategy']}" + ("" if frac is None else f" at {frac:.0%}")
                           + (f" (smallest feasible {r['smallest_feasible_fraction']:.0%})"
                              if r.get("smallest_feasible_fraction") is not None else ""))
            continue
        if r.get("gradients_match") is False:
            ax.plot([r["planned"]["activation_peak_bytes"] / MIB], [r["overhead"]], marker="o", markersize=13,
                    markerfacecolor="none", markeredgecolor="red", linestyle="none")
        name = r["strategy"] if r.get("backend") in (None, "eager") else f"{r['strategy']} ({r['backend']})"
        frac = r.get("budget_fraction")
        label = "" if frac is None else (f"{frac:g}" if r["strategy"] == "torch-budget" else f"{frac:.0%}")
        lines.setdefault(name, []).append((r["planned"]["activation_peak_bytes"] / MIB, r["overhead"], label))
    markers = "osD^v<>phX"
    for k, (name, pts) in enumerate(sorted(lines.items())):
        pts.sort()
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ax.plot(xs, ys, marker=markers[k % len(markers)], linestyle="-" if len(pts) > 1 else "none",
                label=name)
        for x, y, lab in pts:
            if lab:
                ax.annotate(lab, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.plot([baseline.activation_peak_bytes / MIB], [1.0], marker="*", markersize=14, color="black",
            linestyle="none", label="plain PyTorch")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xlabel("measured activation peak (MiB)")
    ax.set_ylabel("overhead (step time / plain PyTorch)")
    # (a long title, a model and its sizes, budgets and machine, was cut at the figure's right edge)
    ax.set_title("\n".join(textwrap.wrap(title or "memory vs time", 85)), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if missing:
        fig.text(0.01, 0.005, "not plotted (no measurement): " + "; ".join(missing), fontsize=6, wrap=True)
    if any(r.get("gradients_match") is False for r in rows):
        ax.plot([], [], marker="o", markerfacecolor="none", markeredgecolor="red", linestyle="none",
                label="gradients differ from plain PyTorch")
        ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.04 if missing else 0, 1, 1))
    fig.savefig(str(path))
    return fig
