"""What ``ablate-analyze`` computes for one sweep, as one result object: no file written, nothing printed.

:func:`analyse` takes the loaded cells (and per-step records) and returns a :class:`SweepAnalysis`
holding every table: per outcome the summary, the effects and their power plan (and the
comparisons asked for), the flags, the survival table, and the verdict that reads the effects
aloud. :mod:`ablate.analysis.writer` writes it to files and :mod:`ablate.analysis.printer` prints
it; the command line (:mod:`ablate.analysis.cli`) only parses, loads and calls the three.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pandas as pd

from ablate.analysis.compare import compare_values
from ablate.analysis.declared import DEFAULT_OUTCOMES, declared_of
from ablate.analysis.dropped import dropped_line
from ablate.analysis.flags import flag_policies
from ablate.analysis.selectors import parse_selector
from ablate.outcomes import OUTCOME_NAMES
from ablate.analysis.settings import AnalysisSettings
from ablate.analysis.tables import arm_keys, effects, summarize
from ablate.analysis.verdict import Answer, cited_rows, read_verdict


@dataclass
class OutcomeTables:
    """Every table of one outcome."""

    outcome: str
    summary: pd.DataFrame
    effects: pd.DataFrame
    plan: pd.DataFrame
    dropped: str | None  # the line naming the cells without a finite value, if any
    compared: list[tuple[str, str, str, pd.DataFrame]] = field(default_factory=list)  # (key, a, b, table)


@dataclass
class SweepAnalysis:
    """The analysis of one sweep (see the module doc)."""

    cells: pd.DataFrame
    steps: pd.DataFrame | None
    keys: list[str]
    settings: AnalysisSettings
    outcomes: dict[str, OutcomeTables]  # each plan covers every row with full_plan, else the verdict's rows
    flags: pd.DataFrame
    verdict: list[Answer]
    not_logged: list[str]  # default outcomes no cell logged, left out
    seeds_per_arm: str
    survival: tuple[pd.DataFrame, pd.DataFrame] | None = None  # (collapse times, table)

    @property
    def margins(self) -> dict[str, float | None]:
        return {outcome: self.settings.margins.get(outcome) for outcome in self.outcomes}


def choose_outcomes(cells: pd.DataFrame, given: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """The outcomes to analyse, and the default ones left out because no cell logged them.

    ``given`` (``--outcome``) first, then the sweep's ``analysis.outcomes``, then
    :data:`~ablate.analysis.declared.DEFAULT_OUTCOMES`, of which only those some cell has a
    finite value for (a backend that logs no mismatch gets no mismatch table).
    """
    if given:
        return list(dict.fromkeys(given)), []
    declared = declared_of(cells).get("outcomes")
    unknown = [name for name in declared if name not in OUTCOME_NAMES]
    if unknown:
        raise ValueError(f"analysis.outcomes of the sweep names {unknown[0]!r}: expected outcomes among "
                         f"{', '.join(OUTCOME_NAMES)}")
    if declared:
        return list(dict.fromkeys(declared)), []
    logged = [name for name in DEFAULT_OUTCOMES if name in cells.columns
              and np.isfinite(pd.to_numeric(cells[name], errors="coerce").to_numpy(dtype=float)).any()]
    return logged or [DEFAULT_OUTCOMES[-1]], [name for name in DEFAULT_OUTCOMES if name not in logged]


def analyse(
    cells: pd.DataFrame,
    steps: pd.DataFrame | None,
    *,
    outcomes: Sequence[str] | None = None,
    settings: AnalysisSettings | None = None,
    comparisons: Sequence[tuple[str, str, str]] = (),
    detect: dict[str, float] | None = None,
    survival: bool = False,
    full_plan: bool = False,
) -> SweepAnalysis:
    """Every table of the sweep in ``cells`` (``load_runs``), and the verdict.

    ``settings`` are completed from the sweep's declaration (primary questions, margins), as
    every table function does. ``detect`` sizes each outcome's plan for a given effect instead
    of the observed one; the plans cover the rows the verdict reads, every row with
    ``full_plan``. ``steps`` (``load_runs(..., per_step=True)``) is needed for ``survival`` only.
    """
    from ablate.analysis.power import plan

    settings = AnalysisSettings.of(settings, {}, cells)
    keys = arm_keys(cells, settings.by)
    settings = AnalysisSettings.of(settings, {"by": tuple(keys)}, cells)
    chosen, not_logged = choose_outcomes(cells, outcomes)
    tables: dict[str, OutcomeTables] = {}
    for outcome in chosen:
        effect_table = effects(cells, outcome, settings=settings)
        tables[outcome] = OutcomeTables(
            outcome=outcome,
            summary=summarize(cells, outcome, settings=settings),
            effects=effect_table,
            plan=plan(effect_table, detect=(detect or {}).get(outcome),
                      rows=None if full_plan else cited_rows(effect_table)),
            dropped=dropped_line(cells, outcome),
            compared=[(key, a, b, compare_values(cells, outcome, key, a, b, settings=settings))
                      for key, a, b in comparisons],
        )
    collapse = None
    if survival and steps is not None:
        from ablate.analysis.survival import collapse_times, survival_table

        times = collapse_times(steps, keys)
        collapse = (times, survival_table(times, keys, seed=settings.seed))
    return SweepAnalysis(
        cells=cells, steps=steps, keys=keys, settings=settings, outcomes=tables,
        flags=flag_policies(cells, settings=settings),
        verdict=read_verdict({o: t.effects for o, t in tables.items()}, {o: t.plan for o, t in tables.items()}),
        not_logged=not_logged, seeds_per_arm=seeds_per_arm(cells, keys), survival=collapse,
    )


def seeds_per_arm(cells: pd.DataFrame, keys: Sequence[str]) -> str:
    """``"6"``, or ``"4 to 6"`` when arms have different seed counts."""
    per_arm = cells.groupby([*keys, "policy", "budget"], dropna=False)["seed"].nunique()
    if per_arm.empty:
        return "0"
    low, high = int(per_arm.min()), int(per_arm.max())
    return f"{low}" if low == high else f"{low} to {high}"


def design_lines(cells: pd.DataFrame, keys: Sequence[str], where: dict[str, Any]) -> list[str]:
    """The arms (with what else an arm key sets) and the seeds per arm, as the header says them."""
    arms = " x ".join(["policy", "budget", *keys])
    lines = [f"arms: {arms}" + (f"; where {', '.join(f'{k}={v}' for k, v in where.items())}" if where else "")]
    determined: dict[str, str] = cells.attrs.get("determined_keys", {})
    for key in sorted(set(determined.values()) & set(keys)):
        lines.append(f"  {key} also sets {', '.join(sorted(k for k, by in determined.items() if by == key))}")
    if not cells.empty:
        lines.append(f"seeds per arm: {seeds_per_arm(cells, keys)}")
    return lines


@dataclass(frozen=True)
class Extension:
    """The seeds the planned rows ask for, and the command that runs them (``--plan``)."""

    what: str  # "the primary rows" or "the replay rows"
    seeds: int | None  # None: no seed count up to the plan's limit gives 80% power
    current: int
    command: str | None  # None when the sweep has the seeds already


def extension(result: SweepAnalysis) -> Extension:
    """What the power plans of the primary rows (else the replay rows) ask for, over every outcome."""
    from ablate.analysis.power import extension_command, seeds_to_run
    from ablate.policies.roles import FULL_REPLAY, NO_REPLAY

    primary = result.settings.primary or ()
    plans = {outcome: tables.plan for outcome, tables in result.outcomes.items()}
    rows = {}
    for outcome, table in plans.items():
        mask = pd.Series(False, index=table.index) if primary else table["effect"] == "replay"
        for text in primary:
            mask |= parse_selector(text).matches(table)
        rows[outcome] = mask
    seeds = seeds_to_run(plans, rows)
    policies = sorted({name for outcome, table in plans.items()
                       for name in (*table.loc[rows[outcome], "policy"], *table.loc[rows[outcome], "baseline"])})
    fixed = (NO_REPLAY, FULL_REPLAY)
    policies = [p for p in fixed if p in policies] + [p for p in policies if p not in fixed]
    cells = result.cells
    sweep = str(cells["sweep"].iloc[0]) if "sweep" in cells.columns else "SWEEP"
    current = int(cells["seed"].nunique())
    command = extension_command(sweep, seeds, policies) if seeds is not None and seeds > current else None
    return Extension("the primary rows" if primary else "the replay rows", seeds, current, command)
