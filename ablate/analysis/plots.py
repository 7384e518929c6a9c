"""Figures for a sweep, written as PNG and SVG.

Uses matplotlib's object API (``matplotlib.figure.Figure``) with the Agg canvas, so it never
touches pyplot's global state or needs a display. Each function takes the tables the rest of
``ablate.analysis`` produces and returns the paths it wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ablate.analysis.tables import FIXED_BUDGET_POLICIES, order_policies

FORMATS: tuple[str, ...] = ("png", "svg")
STEP_KEYS: tuple[str, ...] = ("train/reward", "mismatch/kl_k3")
LINE_STYLES: tuple[str, ...] = ("-", "--", ":", "-.")


def plot_budget_response(summary: pd.DataFrame, path_stem: str | Path, *, outcome: str | None = None) -> list[Path]:
    """Outcome against budget, one line per budgeted policy with its CI band.

    ``summary`` is :func:`ablate.analysis.tables.summarize` output. ``none`` and ``full`` are
    drawn as horizontal reference lines (their mean, dashed, with a light CI band).
    """
    outcome = outcome or summary.attrs.get("outcome", "outcome")
    table = summary.reset_index()
    fig = _figure()
    ax = fig.add_subplot()
    colors = _colors(table["policy"].unique())
    for policy in order_policies(table["policy"].unique()):
        rows = table[table["policy"] == policy].sort_values("budget")
        if policy in FIXED_BUDGET_POLICIES:
            row = rows.iloc[0]
            ax.axhline(row["mean"], color=colors[policy], linestyle="--", label=f"{policy} (b={row['budget']:g})")
            if np.isfinite(row["ci_low"]):
                ax.axhspan(row["ci_low"], row["ci_high"], color=colors[policy], alpha=0.08)
            continue
        ax.plot(rows["budget"], rows["mean"], marker="o", color=colors[policy], label=policy)
        ax.fill_between(rows["budget"], rows["ci_low"], rows["ci_high"], color=colors[policy], alpha=0.2)
    level = summary.attrs.get("level")
    ax.set_xlabel("budget (fraction of valid routes replayed)")
    ax.set_ylabel(outcome)
    ax.set_title(f"{outcome} vs budget" + (f" (mean, {level:.0%} bootstrap CI)" if level else ""))
    ax.legend(fontsize="small")
    return _save(fig, path_stem)


def plot_selection_effects(effects_table: pd.DataFrame, path_stem: str | Path, *, outcome: str | None = None) -> list[Path]:
    """Selection effects per budget: mean paired difference with its interval, zero line."""
    outcome = outcome or effects_table.attrs.get("outcome", "outcome")
    rows = effects_table[effects_table["effect"] == "selection"]
    fig = _figure()
    ax = fig.add_subplot()
    comparisons = list(dict.fromkeys(zip(rows["policy"], rows["baseline"])))
    budgets = sorted(rows["budget"].unique())
    width = 0.8 / max(1, len(comparisons))
    for i, (policy, baseline) in enumerate(comparisons):
        part = rows[(rows["policy"] == policy) & (rows["baseline"] == baseline)].set_index("budget")
        x = np.array([budgets.index(b) for b in part.index]) + (i - (len(comparisons) - 1) / 2) * width
        errors = np.vstack([part["mean"] - part["ci_low"], part["ci_high"] - part["mean"]])
        ax.errorbar(x, part["mean"], yerr=np.nan_to_num(errors), fmt="o", capsize=4, label=f"{policy} - {baseline}")
    ax.axhline(0.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(budgets)), [f"{b:g}" for b in budgets])
    ax.set_xlabel("budget")
    ax.set_ylabel(f"difference in {outcome}")
    ax.set_title("selection effect (paired by seed)")
    if comparisons:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no selection comparisons in this sweep", ha="center", transform=ax.transAxes)
    return _save(fig, path_stem)


def plot_step_curves(
    steps: pd.DataFrame, path_stem: str | Path, *, keys: Sequence[str] = STEP_KEYS
) -> list[Path]:
    """Per-step curves of ``keys``, one line per (policy, budget): mean over seeds, band of
    plus/minus one standard error across seeds; colour = policy, line style = budget.
    ``steps`` is ``load_runs(..., per_step=True)``."""
    keys = [k for k in keys if k in steps.columns]
    fig = _figure(width=6.0 * max(1, len(keys)))
    colors = _colors(steps["policy"].unique()) if len(steps) else {}
    for i, key in enumerate(keys):
        ax = fig.add_subplot(1, len(keys), i + 1)
        grouped = steps.groupby(["policy", "budget", "step"])[key].agg(["mean", "sem"]).reset_index()
        for policy in order_policies(grouped["policy"].unique()):
            for i_budget, (budget, curve) in enumerate(grouped[grouped["policy"] == policy].groupby("budget")):
                label = policy if policy in FIXED_BUDGET_POLICIES else f"{policy} b={budget:g}"
                style = LINE_STYLES[i_budget % len(LINE_STYLES)]
                ax.plot(curve["step"], curve["mean"], color=colors[policy], linestyle=style, label=label)
                sem = curve["sem"].fillna(0.0)
                ax.fill_between(curve["step"], curve["mean"] - sem, curve["mean"] + sem, color=colors[policy], alpha=0.12)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(f"{key} (mean over seeds, band: 1 s.e.)")
        ax.legend(fontsize="x-small", ncol=2)
    if not keys:
        fig.add_subplot().text(0.5, 0.5, f"none of {list(STEP_KEYS)} were logged", ha="center")
    return _save(fig, path_stem)


def _figure(width: float = 6.5, height: float = 4.5) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _colors(policies: Sequence[str]) -> dict[str, tuple[float, ...]]:
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    return {policy: palette(i % 10) for i, policy in enumerate(order_policies(policies))}


def _save(fig: Figure, path_stem: str | Path) -> list[Path]:
    stem = Path(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in FORMATS:
        path = stem.with_name(f"{stem.name}.{fmt}")
        fig.savefig(path, dpi=120)
        paths.append(path)
    return paths
