"""Print a :class:`~ablate.analysis.compute.SweepAnalysis` on a terminal: the verdict first, then compact tables.

Every line fits ``width`` characters (100 by default): the verdict is wrapped, the tables are the
compact views of :mod:`ablate.analysis.compact`, and legends are wrapped. ``wide=True`` prints
every column of every table instead, as the files hold them.
"""

from __future__ import annotations

import sys
import textwrap
from typing import TextIO

import pandas as pd

from ablate.analysis.compact import compact_effects, compact_plan, compact_summary, fit
from ablate.analysis.compute import SweepAnalysis, extension
from ablate.analysis.export import to_markdown
from ablate.analysis.flags import flags_text
from ablate.analysis.stats import min_achievable_pvalue
from ablate.analysis.verdict import introduction, legend, render
from ablate.analysis.writer import Written

#: What an effect row needs, said where a sweep has none yet (one stopped early, one of a single arm).
NO_EFFECTS = ("replay needs cells of none and full, the budget cells of random and none, a selection cells of the "
              "policy and random at one budget, each with the same seeds")
#: Columns of a comparison table that only ``--wide`` prints.
COMPARE_DETAIL = ("ci_low", "ci_high", "p_value", "margin", "p_equiv", "p_equiv_adj", "prob_improvement",
                  "share_improved", "sd_diff", "note", "pooled", "family")
ADJUSTMENTS = {"holm": "Holm (family-wise error)", "bh": "Benjamini-Hochberg (false discovery rate)",
               "none": "not adjusted"}


class Printer:
    """Prints the sections of one analysis, each line at most ``width`` characters (``wide``: tables whole)."""

    def __init__(self, stream: TextIO | None = None, *, width: int = 100, wide: bool = False) -> None:
        self.stream = stream or sys.stdout
        self.width, self.wide = width, wide

    def line(self, text: str = "") -> None:
        print(text, file=self.stream)

    def wrapped(self, text: str, indent: str = "") -> None:
        for line in textwrap.wrap(text, self.width, initial_indent=indent, subsequent_indent=indent + "  ",
                                  break_on_hyphens=False) or [""]:
            self.line(line)

    def table(self, full: pd.DataFrame, compact: pd.DataFrame, optional: tuple[str, ...] = ()) -> None:
        self.line(to_markdown(full, escape_html=False) if self.wide else fit(compact, self.width, optional=optional))

    def analysis(self, result: SweepAnalysis, written: Written, *, plan: bool = False) -> None:
        """Everything after the header: the verdict, the tables per outcome, the flags, the files."""
        self.verdict(result)
        for outcome, tables in result.outcomes.items():
            summary = tables.summary
            self.line(f"\n## {outcome}: mean over seeds, {summary.attrs['level']:.0%} {summary.attrs['interval']} "
                      f"interval (none below {summary.attrs['min_seeds']} seeds)\n")
            if tables.dropped is not None:
                self.line(tables.dropped + "\n")
            self.table(summary, compact_summary(summary), optional=("effective_budget",))
            self.wrapped("- effective_budget: the share of routes that replay changed (replayed routes whose "
                         "experts differ from the native ones), mean over seeds")
            self.line(f"\n## effects on {outcome} (paired by seed)\n")
            self.effects(tables.effects)
            if plan:
                self.line()
                self.wrapped(f"## power and seeds for {outcome} (80% power, exact sign-flip test simulated, each "
                             "row at alpha over its family's size)")
                self.line()
                self.table(tables.plan.drop(columns=["pooled"]), compact_plan(tables.plan))
            for key, a, b, compared in tables.compared:
                self.line(f"\n## {outcome}: {key}={a} - {key}={b} (paired by seed within each arm; p_adj: "
                          f"{result.settings.adjust} over the per-budget rows, pooled rows apart)\n")
                view = compared.drop(columns=["compare", "effect"])
                self.table(view, view[[c for c in view.columns if c not in COMPARE_DETAIL]])
        if plan:
            self.extension(result)
        self.flags(result)
        if result.survival is not None:
            self.line("\n## time to collapse (collapse: the collapsed outcome's rule; censored at the last step; "
                      "p: paired permutation log-rank test against none)\n")
            self.line(to_markdown(result.survival[1], escape_html=False))
        if written.plots_skipped:
            self.line(f"plots skipped: {written.plots_skipped}")
        if written.report is not None:
            self.line(f"report: {written.report}")

    def effects(self, effects: pd.DataFrame) -> None:
        """The legend and the effects, compact by family (``wide``: every column); with no rows, what a row
        needs instead (a legend without a table would explain nothing)."""
        if effects.empty:
            self.wrapped(f"no effect rows: {NO_EFFECTS}")
            return
        for bullet in effects_legend(effects, compact=not self.wide):
            self.wrapped(bullet)
        self.line()
        if self.wide:
            self.line(to_markdown(effects, escape_html=False))
        else:
            self.by_family(effects)

    def by_family(self, effects: pd.DataFrame) -> None:
        """The compact effects, one table per family under its name and size: the family a verdict
        line cites is the heading its row stands under."""
        view = compact_effects(effects)
        families = sorted(effects.attrs["families"].items(), key=lambda item: family_order(item[0]))
        family_of_row = effects["family"].to_numpy()
        shown = [(family, size) for family, size in families if (family_of_row == family).any()]
        for i, (family, size) in enumerate(shown):
            rows = view[family_of_row == family].drop(columns="family")
            self.line(("" if i == 0 else "\n") + f"{family} ({size} test{'s' if size != 1 else ''})")
            self.line(fit(rows, self.width))

    def verdict(self, result: SweepAnalysis) -> None:
        self.line("\n## verdict: budget or selection? (the effects tables below, read aloud)\n")
        self.wrapped(introduction())
        self.line()
        lines = render(result.verdict, result.margins, width=self.width)
        for line in lines:
            self.line(line)
        if any(answer.evidence for answer in result.verdict):
            self.line("\nnotes on the answers:")
            for bullet in legend(result.settings.level, result.settings.needed):
                self.wrapped(bullet)
        if result.not_logged:
            self.line(f"(not analysed: {', '.join(result.not_logged)}, which no cell logged)")

    def extension(self, result: SweepAnalysis) -> None:
        asked = extension(result)
        if asked.seeds is None:
            self.line(f"\nno seed count up to 64 gives 80% power for {asked.what}")
        elif asked.command is None:
            self.line(f"\n{asked.what} need {asked.seeds} seeds for 80% power; the sweep has {asked.current}")
        else:
            self.line(f"\n{asked.what} need {asked.seeds} seeds for 80% power (the sweep has {asked.current}); "
                      f"extend it with:\n  {asked.command}")

    def flags(self, result: SweepAnalysis) -> None:
        flags, settings = result.flags, result.settings
        self.line()
        self.wrapped(f"## flags (against none and full of the same sweep, at level {settings.level:g}, "
                     f"p adjusted ({settings.adjust}) over the questions of each context)")
        self.line()
        for line in flags_text(flags, width=self.width):
            self.line(line)


def family_order(family: str) -> tuple[int, int, str]:
    """Primary gates in their order, then the exploratory families as the table lists them."""
    if family.startswith("primary"):
        return (0, int(family.split(":")[0].split()[1]), "")
    return (1, 0, "")


def effects_legend(table: pd.DataFrame, *, compact: bool = True) -> list[str]:
    """What the columns of an effects table mean, and the smallest adjusted p these seeds allow."""
    attrs = table.attrs
    alpha = f"{1 - attrs['level']:.2g}"
    level = f"{attrs['level']:.0%}"
    families = "; ".join(f"{name}: {n} tests" for name, n in attrs["families"].items() if n)
    interval = {"exact": f"inverts the exact sign-flip test (excludes 0 exactly when p_value < {alpha})",
                "t": "Student's t of the paired differences"}.get(
        attrs["method"], f"{attrs['method']} bootstrap of the paired differences")
    lines = []
    if not compact:
        lines.append(f"- ci_low/ci_high: UNADJUSTED {level} interval of the mean difference; it {interval}")
    lines += [
        f"- ci_adj_low/ci_adj_high: {level} interval ADJUSTED to the row's family, as p_adj (it excludes 0 exactly "
        f"when p_adj < {alpha}; -inf/inf: a family this large, or a primary gate not reached, allows these seeds no "
        f"claim; empty: fewer than {attrs['min_seeds']} paired seeds, too few for any interval, the note saying "
        "why, such as seeds dropped)",
        f"- p_value: two-sided exact sign-flip test; p_adj: {ADJUSTMENTS[attrs['adjust']]} within each family"
        + (", primary gates by serial gatekeeping in the order given" if attrs["primary"] else ""),
        "- families: each table below is one, under its name and size" if compact else
        f"- families: {families or 'no tests'}",
        "- claim: differs (p_adj < " f"{alpha}), within ±margin (the equivalence test, adjusted the same way), "
        "else inconclusive" + ("" if attrs.get("margin") else " (no margin for this outcome: no claim of no effect)"),
        "- matched (matched_selection): the policy against random's budget-response curve at the policy's "
        "effective budget",
    ]
    if not compact:
        lines.append(f"- prob_improvement: probability that a run of the policy beats a run of the baseline, "
                     f"unpaired ({attrs['improvement']}); share_improved: share of seeds whose own paired "
                     "difference improved")
    if attrs.get("margin") and not compact:
        lines.append(f"- p_equiv: equivalence (two one-sided sign-flip tests) of |effect| < {attrs['margin']:g}; "
                     "p_equiv_adj: Holm within the row's family, over all primary rows together for a primary row")
    tested = table["n_seeds"][table["p_value"].notna()]
    if not tested.empty and attrs["adjust"] == "holm":
        n = int(tested.max())
        m = max(attrs["families"].values())
        smallest = min(1.0, m * min_achievable_pvalue(n))
        lines.append(f"- with {n} seeds the smallest p is {min_achievable_pvalue(n):.3g}; after Holm in a family "
                     f"of {m} tests the smallest p_adj is {smallest:.3g}")
    if compact:
        lines.append("- every column (unadjusted intervals, p_value, equivalence p, prob_improvement, notes) is in "
                     "the effects file and printed with --wide")
    return lines
