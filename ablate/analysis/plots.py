"""Figures for a sweep, written as PNG and SVG.

Uses matplotlib's object API (``matplotlib.figure.Figure``) with the Agg canvas, so it never
touches pyplot's global state or needs a display. Each function takes the tables the rest of
``ablate.analysis`` produces and returns the paths it wrote.

Every policy has one colour in every figure of every sweep (:func:`policy_color`; settings
variants such as ``fisher[tau=1.0]`` share their policy's colour and differ in line style), so
figures of different sweeps can be read side by side. A sweep with arm keys besides policy and
budget (``backend.router_noise``) gets one panel per value of those keys, up to
:data:`MAX_PANELS` of them (:data:`MAX_STEP_CONTEXTS` for the step curves, which draw a row of
panels per value): past that, a figure shows that many values spread evenly from the first to the
last, and its title says how many it shows (:func:`_contexts`). A figure of 38 settings is neither readable nor cheap
(the step curves of a 10,000-cell sweep were a 33 MB PNG); the tables hold every arm.
"""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

from ablate.analysis.extras import import_extra
from ablate.analysis.frames import without_attrs

import_extra("matplotlib", "Plots")

import matplotlib  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from ablate.analysis.tables import FIXED_BUDGET_POLICIES, context_label, contexts, order_policies  # noqa: E402
from ablate.arms import arm_policy  # noqa: E402
from ablate.policies import policy_look  # noqa: E402
from ablate.policies.base import DERIVED_COLORS  # noqa: E402
from ablate.policies.roles import BUDGET_CONTROL, FULL_REPLAY, NO_REPLAY, SELECTION_BASELINES  # noqa: E402
from ablate.analysis.writing import naming  # noqa: E402
from ablate.store import atomic_write, make_directory  # noqa: E402

FORMATS: tuple[str, ...] = ("png", "svg")
STEP_KEYS: tuple[str, ...] = ("train/reward", "mismatch/kl_k3")
LINE_STYLES: tuple[Any, ...] = ("-", "--", ":", "-.", (0, (5, 1, 1, 1)), (0, (1, 3)))
#: Selection effects: colour is the policy, the marker its baseline (hollow squares: matched).
BASELINE_MARKERS: dict[str, str] = dict(zip(SELECTION_BASELINES, ("o", "D")))
#: The most contexts (values of the arm keys besides policy and budget) one figure draws.
MAX_PANELS = 6
#: The most contexts the step curves draw: each is a row of panels per logged key.
MAX_STEP_CONTEXTS = 2
#: The height a line of a figure's title takes (medium type, with its spacing), added to the figure.
TITLE_LINE_INCHES = 0.2
#: Past this many points in one axes, its legend goes beside the axes instead of the best place inside.
BEST_LEGEND_POINTS = 300
#: The colours a policy that declares none takes (ablate.policies.base.DERIVED_COLORS).
OTHER_COLORS: tuple[str, ...] = DERIVED_COLORS


def policy_color(policy: str, among: Iterable[str] = ()) -> str:
    """The colour of a policy (or of a settings variant ``name[...]``: its policy's colour).

    A policy's class declares its colour (the ``color`` trait; the built-ins' are Okabe-Ito,
    safe for the common colour-vision deficiencies). One that declares none gets the colour a
    hash of its name picks, and no other such policy in ``among`` (the policies of the same
    figure) gets the same: they take the hashed slots in name order, each moving on to the next
    free colour when its slot is taken (colours repeat only past seven of them).
    """
    name = arm_policy(policy)
    look = policy_look(name)
    if look.declared:
        return look.color
    others = sorted({arm_policy(p) for p in among if not policy_look(arm_policy(p)).declared} | {name})
    taken: dict[str, str] = {}
    for other in others:
        slot = OTHER_COLORS.index(policy_look(other).color)
        free = [OTHER_COLORS[(slot + i) % len(OTHER_COLORS)] for i in range(len(OTHER_COLORS))]
        taken[other] = next((c for c in free if c not in taken.values()), free[0])
    return taken[name]


def policy_marker(policy: str) -> str:
    """The marker of a policy (a settings variant: its policy's), its class's ``marker`` trait."""
    return policy_look(arm_policy(policy)).marker


def policy_style(policy: str, policies: Iterable[str]) -> Any:
    """Line style of a variant among ``policies``: solid for the policy itself, then dashes."""
    name = arm_policy(policy)
    variants = sorted(p for p in set(policies) if arm_policy(p) == name and p != name)
    return LINE_STYLES[0] if policy == name else LINE_STYLES[(1 + variants.index(policy)) % len(LINE_STYLES)]


def plot_budget_response(summary: pd.DataFrame, path_stem: str | Path, *, outcome: str | None = None) -> list[Path]:
    """Outcome against budget, one line per budgeted policy with its interval, per context.

    ``summary`` is :func:`ablate.analysis.tables.summarize` output. Intervals are error bars
    on points nudged apart along the budget axis, over a faint band, so that arms whose
    intervals overlap stay readable; arms with too few seeds for an interval are hollow.
    ``none`` and ``full`` are horizontal reference lines (dashed) with a faint band.
    """
    outcome = outcome or summary.attrs.get("outcome", "outcome")
    keys = list(summary.attrs.get("by", []))
    table = summary.reset_index()
    panels, shown = _contexts(table, keys)
    fig, axes = _panels(len(panels))
    policies = list(table["policy"].unique())
    budgeted = [p for p in order_policies(policies) if p not in FIXED_BUDGET_POLICIES]
    budgets = np.sort(table.loc[~table["policy"].isin(FIXED_BUDGET_POLICIES), "budget"].unique())
    nudge = 0.012 * (float(budgets.max() - budgets.min()) if budgets.size > 1 else 1.0)
    for ax, (title, part) in zip(axes, panels):
        for policy in order_policies(part["policy"].unique()):
            rows = part[part["policy"] == policy].sort_values("budget")
            color = policy_color(policy, policies)
            if policy in FIXED_BUDGET_POLICIES:
                row = rows.iloc[0]
                ax.axhline(row["mean"], color=color, linestyle="--", linewidth=1.2, label=f"{policy} (b={row['budget']:g})")
                if np.isfinite(row["ci_low"]):
                    ax.axhspan(row["ci_low"], row["ci_high"], color=color, alpha=0.06)
                continue
            x = rows["budget"].to_numpy() + (budgeted.index(policy) - (len(budgeted) - 1) / 2) * nudge
            has_ci = np.isfinite(rows["ci_low"].to_numpy())
            ax.plot(x, rows["mean"], color=color, linestyle=policy_style(policy, policies), linewidth=1.5,
                    label=policy)
            ax.fill_between(x, rows["ci_low"], rows["ci_high"], color=color, alpha=0.07, linewidth=0)
            errors = np.vstack([rows["mean"] - rows["ci_low"], rows["ci_high"] - rows["mean"]])
            ax.errorbar(x[has_ci], rows["mean"].to_numpy()[has_ci], yerr=errors[:, has_ci], fmt="none",
                        ecolor=color, capsize=3, linewidth=1.0)
            marker = policy_marker(policy)
            ax.scatter(x, rows["mean"], color=np.where(has_ci[:, None], [_rgba(color)], [(1, 1, 1, 1)]),
                       edgecolors=color, marker=marker, zorder=3, s=28)
        ax.set_xlabel("budget (fraction of valid routes replayed)")
        ax.set_ylabel(outcome)
        ax.set_title(title, fontsize="small")
        _legend(ax, "x-small")
    level = summary.attrs.get("level")
    interval = summary.attrs.get("interval", "t")
    _title(fig, f"{outcome} vs budget" + (f" (mean over seeds; bars and band: {level:.0%} {interval} interval of "
                                          "the mean; hollow: too few seeds for one" if level else " (mean over seeds")
           + shown + ")")
    return _save(fig, path_stem)


def plot_selection_effects(effects_table: pd.DataFrame, path_stem: str | Path, *, outcome: str | None = None) -> list[Path]:
    """Selection effects per budget, raw (filled; circle: against random, diamond: against uniform)
    and at a matched effective budget (hollow squares), per context."""
    outcome = outcome or effects_table.attrs.get("outcome", "outcome")
    keys = list(effects_table.attrs.get("by", []))
    rows = effects_table[effects_table["effect"].isin(["selection", "matched_selection"]) & ~effects_table["pooled"]]
    panels, shown = _contexts(rows, keys)
    fig, axes = _panels(len(panels))
    policies = list(effects_table["policy"].unique())
    fewest = effects_table.attrs.get("min_seeds", 2)
    for ax, (title, part) in zip(axes, panels):
        comparisons = list(dict.fromkeys(zip(part["effect"], part["policy"], part["baseline"])))
        budgets = sorted(part["budget"].unique())
        width = 0.8 / max(1, len(comparisons))
        for i, (effect, policy, baseline) in enumerate(comparisons):
            sub = part[(part["effect"] == effect) & (part["policy"] == policy) & (part["baseline"] == baseline)]
            x = np.array([budgets.index(b) for b in sub["budget"]]) + (i - (len(comparisons) - 1) / 2) * width
            # A row with too few paired seeds has no interval: no bar, and its seed count beside the point.
            errors = np.nan_to_num(np.vstack([sub["mean"] - sub["ci_low"], sub["ci_high"] - sub["mean"]]),
                                   nan=0.0, posinf=0.0, neginf=0.0)
            color = policy_color(policy, policies)
            matched = effect == "matched_selection"
            label = f"{policy} - {baseline}" + (" at its effective budget" if matched else "")
            marker = "s" if matched else BASELINE_MARKERS.get(baseline, "v")
            ax.errorbar(x, sub["mean"], yerr=errors, fmt=marker, capsize=3, color=color,
                        markerfacecolor="white" if matched else color,
                        linestyle="none", label=label)
            for x_point, row in zip(x, sub.itertuples()):
                if not np.isfinite(row.ci_low):
                    ax.annotate(f"n={row.n_seeds}", (x_point, row.mean), textcoords="offset points", xytext=(5, -3),
                                fontsize="xx-small", color=color)
            if policy_style(policy, policies) != "-":
                ax.plot(x, sub["mean"], color=color, linestyle=policy_style(policy, policies), linewidth=0.8)
        if not np.isfinite(part["ci_low"].to_numpy(dtype=float)).all():
            ax.plot([], [], linestyle="none", label=f"no bar, n=k beside it: fewer than {fewest} paired seeds")
        ax.axhline(0.0, color="gray", linewidth=0.8)
        ax.set_xlim(-0.5, len(budgets) - 0.35)  # room right of the last point for its seed count
        ax.set_xticks(range(len(budgets)), [f"{b:g}" for b in budgets])
        ax.set_xlabel("budget")
        ax.set_ylabel(f"difference in {outcome}")
        ax.set_title(title, fontsize="small")
        if comparisons:
            _legend(ax, "x-small")
        else:
            ax.text(0.5, 0.5, "no selection comparisons in this sweep", ha="center", transform=ax.transAxes)
    level = effects_table.attrs.get("level", 0.95)
    interval = {"exact": "inverting the exact sign-flip test", "t": "Student's t"}.get(
        effects_table.attrs.get("method", "exact"), f"{effects_table.attrs.get('method')} bootstrap")
    _title(fig, f"selection effects on {outcome} (paired by seed; bars: {level:.0%} interval {interval}, unadjusted; "
                f"hollow: against random at the same effective budget{shown})")
    return _save(fig, path_stem)


def plot_effective_budget(
    cells: pd.DataFrame, path_stem: str | Path, *, outcome: str, by: Sequence[str] = ()
) -> list[Path]:
    """Outcome against the effective budget (share of valid routes replay changed), per context.

    Each seed is a faint point; each arm (policy at a budget) a marker at its mean with
    one-standard-error bars on both axes, labelled with its budget. ``random``'s arms, from
    ``none`` (effective budget 0) to ``full``, are joined into the curve that matched
    comparisons read from: an arm above that curve did better than changing as many routes at
    random.
    """
    effective = "effective_budget_mean"
    missing = [c for c in (effective, outcome) if c not in cells.columns]
    if missing:
        raise KeyError(f"plot_effective_budget needs column(s) {missing}")
    panels, shown = _contexts(cells, list(by))
    fig, axes = _panels(len(panels))
    policies = list(cells["policy"].unique())
    for ax, (title, part) in zip(axes, panels):
        arms = (part.groupby(["policy", "budget"])[[effective, outcome]]
                .agg(["mean", "sem"]).reset_index())
        arms.columns = ["policy", "budget", "e", "e_sem", "y", "y_sem"]
        curve = arms[arms["policy"].isin([NO_REPLAY, BUDGET_CONTROL, FULL_REPLAY])].sort_values("e")
        if (curve["policy"] == BUDGET_CONTROL).any():
            ax.plot(curve["e"], curve["y"], color=policy_color(BUDGET_CONTROL), linewidth=1.0, alpha=0.6,
                    label="random's curve (none to full)")
        for policy in order_policies(arms["policy"].unique()):
            color = policy_color(policy, policies)
            seeds = part[part["policy"] == policy]
            ax.scatter(seeds[effective], seeds[outcome], color=color, alpha=0.25, s=10, linewidths=0)
            mine = arms[arms["policy"] == policy]
            ax.errorbar(mine["e"], mine["y"], xerr=mine["e_sem"].fillna(0), yerr=mine["y_sem"].fillna(0),
                        fmt=policy_marker(policy), color=color, capsize=2,
                        linestyle="none", label=policy,
                        markerfacecolor="white" if policy_style(policy, policies) != "-" else color)
            if policy not in FIXED_BUDGET_POLICIES:
                for row in mine.itertuples():
                    ax.annotate(f"{row.budget:g}", (row.e, row.y), textcoords="offset points", xytext=(4, 3),
                                fontsize="xx-small", color=color)
        ax.set_xlabel("effective budget (share of valid routes whose experts replay changed)")
        ax.set_ylabel(outcome)
        ax.set_title(title, fontsize="small")
        _legend(ax, "x-small")
    _title(fig, f"{outcome} vs effective budget (arm means; bars: 1 standard error on each axis, no "
                f"confidence interval; labels: budget{shown})")
    return _save(fig, path_stem)


def plot_step_curves(
    steps: pd.DataFrame,
    path_stem: str | Path,
    *,
    keys: Sequence[str] = STEP_KEYS,
    by: Sequence[str] = (),
    smoothing: float = 0.1,
    level: float = 0.95,
) -> list[Path]:
    """Per-step curves of ``keys`` (the reward and the mismatch): one panel per key and budget.

    Each panel holds every policy at that budget plus ``none`` and ``full`` as references, so
    every arm is drawn: the mean over seeds, smoothed by a centred moving average over
    ``smoothing`` of the steps (at least 1 step), over the raw mean (faint), in a band: at each
    step the ``level`` Student's t interval of the mean over seeds (pointwise, smoothed alike;
    none where an arm has one seed). ``steps`` is ``load_runs(..., per_step=True)``.
    """
    keys = [k for k in keys if k in steps.columns]
    if not keys or steps.empty:
        fig = _figure()
        fig.add_subplot().text(0.5, 0.5, f"none of {list(STEP_KEYS)} were logged", ha="center")
        _title(fig, "per-step curves (nothing to draw)")
        return _save(fig, path_stem)
    t = import_extra("scipy.stats", "the step curves' intervals").t
    contexts, shown = _contexts(steps, list(by), MAX_STEP_CONTEXTS)
    budgeted = steps.loc[~steps["policy"].isin(FIXED_BUDGET_POLICIES), "budget"]
    budgets = sorted(budgeted.unique()) or [None]
    n_rows, n_cols = len(keys) * len(contexts), len(budgets)
    fig = _figure(width=4.2 * n_cols, height=3.3 * n_rows)
    axes = fig.subplots(n_rows, n_cols, squeeze=False)
    window = max(1, int(round(smoothing * steps["step"].nunique())))
    policies = list(steps["policy"].unique())
    for i_key, key in enumerate(keys):
        for i_ctx, (title, part) in enumerate(contexts):
            per_step = part.groupby(["policy", "budget", "step"])[key].agg(["mean", "std", "count"]).reset_index()
            count = per_step["count"].to_numpy(dtype=float)
            half = np.where(count > 1, t.ppf(0.5 + level / 2, np.maximum(count - 1, 1)) * per_step["std"]
                            / np.sqrt(count), np.nan)
            per_step["low"], per_step["high"] = per_step["mean"] - half, per_step["mean"] + half
            for i_budget, budget in enumerate(budgets):
                ax = axes[i_key * len(contexts) + i_ctx, i_budget]
                arms = per_step[per_step["policy"].isin(FIXED_BUDGET_POLICIES) | (per_step["budget"] == budget)]
                for policy in order_policies(arms["policy"].unique()):
                    curve = arms[arms["policy"] == policy].sort_values("step")
                    color, style = policy_color(policy, policies), policy_style(policy, policies)
                    smooth = {column: curve[column].rolling(window, center=True, min_periods=1).mean()
                              for column in ("mean", "low", "high")}
                    ax.fill_between(curve["step"], smooth["low"], smooth["high"], color=color, alpha=0.12,
                                    linewidth=0)
                    ax.plot(curve["step"], curve["mean"], color=color, alpha=0.2, linewidth=0.7, linestyle=style)
                    ax.plot(curve["step"], smooth["mean"], color=color, linewidth=1.5, linestyle=style, label=policy)
                ax.set_title(" ".join(part for part in (title, "" if budget is None else f"b={budget:g}") if part),
                             fontsize="small")
                ax.set_xlabel("step")
                ax.set_ylabel(key)
                _legend(ax, "xx-small")
    _title(fig, f"{' and '.join(keys)} per step (mean over seeds; bold: moving average over {window} step(s), "
                f"faint: raw; band: {level:.0%} t interval of the mean over seeds at each step, smoothed alike{shown})")
    return _save(fig, path_stem)


def _legend(ax: Any, fontsize: str) -> None:
    """The axes' legend where it hides the least data ("best"), or beside the axes when they hold
    more than :data:`BEST_LEGEND_POINTS` points (a text label counting as ten): matplotlib's
    search for the best place tries every point and label at every candidate place."""
    points = sum(len(line.get_xydata()) for line in ax.lines) + sum(len(c.get_offsets()) for c in ax.collections)
    # A label is a box the search measures at every candidate place: it weighs as ten points.
    if points + 10 * len(ax.texts) <= BEST_LEGEND_POINTS:
        ax.legend(fontsize=fontsize, loc="best")
    else:
        ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _title(fig: Figure, text: str) -> None:
    """The figure's title, wrapped to its width (about 13 characters an inch at this size), never cut.

    The figure grows by the title's lines, so that the title never takes its height from the panels: a
    narrow figure (one budget's step curves) with a title of several lines had panels of no height."""
    wrapped = textwrap.fill(text, max(40, int(fig.get_figwidth() * 13)), break_long_words=False)
    fig.set_figheight(fig.get_figheight() + TITLE_LINE_INCHES * (wrapped.count("\n") + 1))
    fig.suptitle(wrapped, fontsize="medium")


def title_of(fig: Figure) -> str:
    """The title :func:`_title` gave ``fig``, in one line (as each saved file records it)."""
    return fig.get_suptitle().replace("\n", " ")


def _contexts(frame: pd.DataFrame, keys: list[str],
              limit: int = MAX_PANELS) -> tuple[list[tuple[str, pd.DataFrame]], str]:
    """One ``(title, rows)`` per value of ``keys``, at most ``limit`` of them, spread evenly from the
    first value to the last, and the note the figure's title carries when that is not every value
    ("" when it is). A frame without keys or rows is one untitled panel. The panels' rows come
    without the frame's attrs: a figure selects from them once per arm (:mod:`ablate.analysis.frames`)."""
    frame = without_attrs(frame)
    if not keys or frame.empty:
        return [("", frame)], ""
    groups = contexts(frame, keys)
    panels = [(context_label(groups[index][0]), groups[index][1]) for index in _spread(len(groups), limit)]
    if len(panels) == len(groups):
        return panels, ""
    return panels, (f"; {len(panels)} of {len(groups)} values of {', '.join(keys)}, spread from the first to the "
                    "last (every arm is in the tables)")


def _spread(total: int, limit: int) -> list[int]:
    """``limit`` indices of ``range(total)``, evenly spaced, the first and the last among them."""
    if total <= limit:
        return list(range(total))
    return sorted({round(i * (total - 1) / (limit - 1)) for i in range(limit)}) if limit > 1 else [0]


def _panels(n: int) -> tuple[Figure, list[Any]]:
    cols = min(n, 3)
    rows = -(-n // cols)
    fig = _figure(width=6.5 * cols, height=4.5 * rows)
    axes = list(fig.subplots(rows, cols, squeeze=False).ravel())
    for unused in axes[n:]:
        unused.remove()
    return fig, axes[:n]


def _rgba(color: str) -> tuple[float, ...]:
    from matplotlib.colors import to_rgba

    return to_rgba(color)


def _figure(width: float = 6.5, height: float = 4.5) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path_stem: str | Path) -> list[Path]:
    stem = Path(path_stem)
    with naming(stem.parent):
        make_directory(stem.parent, "the output folder")
    paths = []
    for fmt in FORMATS:
        path = stem.with_name(f"{stem.name}.{fmt}")
        # The temporary file's name does not end in the format, so it is given. Each file records the title
        # (PNG: a text chunk, SVG: its <title>, no date, so a figure drawn again is the same file), and an
        # SVG keeps its text as text.
        metadata = {"Title": title_of(fig), **({"Date": None} if fmt == "svg" else {})}
        with naming(path), matplotlib.rc_context({"svg.fonttype": "none"}), \
                warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format=fmt, metadata=metadata))
        if any("constrained_layout" in str(warning.message) for warning in said):
            warnings.warn(f"{path.name}: its panels did not fit the figure, drawn without a layout (some text may "
                          "overlap)", FigureLayoutWarning, stacklevel=2)
        paths.append(path)
        _freeze(fig)
    return paths


class FigureLayoutWarning(UserWarning):
    """A figure whose panels did not fit: said once, in ablate's words, where matplotlib's warning was not."""


def _freeze(fig: Figure) -> None:
    """Keep the layout and the legends where the first drawing put them, so that the next format
    draws the same figure without searching again: the constrained layout measures every text
    (on a figure of six panels, a third of a drawing) and each "best" legend tries every point."""
    fig.set_layout_engine("none")
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None and legend._loc == 0:  # 0 is "best" (matplotlib keeps no public name for it)
            corner = legend.get_window_extent().transformed(ax.transAxes.inverted())
            legend.set_loc((corner.x0, corner.y0))  # the lower left corner, in axes coordinates


def plot_collapse_survival(times: pd.DataFrame, path_stem: str | Path, *, by: Sequence[str] = ()) -> list[Path]:
    """Kaplan-Meier curves of P(no collapse yet) against the step, one line per arm, per context.

    ``times`` is :func:`ablate.analysis.survival.collapse_times`; a tick marks a censored run
    (one that never collapsed, at its last step).
    """
    from ablate.analysis.survival import kaplan_meier

    panels, shown = _contexts(times, list(by))
    fig, axes = _panels(len(panels))
    policies = list(times["policy"].unique())
    for ax, (title, part) in zip(axes, panels):
        for (policy, budget), arm in part.groupby(["policy", "budget"], sort=False):
            curve = kaplan_meier(arm["time"], arm["event"])
            label = policy if policy in FIXED_BUDGET_POLICIES else f"{policy} b={budget:g}"
            ax.step([0.0, *curve["step"]], [1.0, *curve["survival"]], where="post", label=label,
                    color=policy_color(policy, policies), linestyle=policy_style(policy, policies))
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("step")
        ax.set_ylabel("share of seeds not collapsed")
        ax.set_title(title, fontsize="small")
        _legend(ax, "xx-small")
    _title(fig, f"time to collapse (Kaplan-Meier over seeds; no interval drawn{shown})")
    return _save(fig, path_stem)
