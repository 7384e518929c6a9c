"""The verdict: the effects tables read aloud, before any table.

For each outcome (and each context of the arm keys) it answers, in plain words:

- **replay**: does full replay change the outcome (the ``replay`` row, ``full - none``)?
- **random**: does the budget alone change it (the ``budget`` row, ``random - none``)?
- **each other policy**: is its effect one of budget, of selection, of both, of neither, or not
  yet determined at these seeds? From three rows: ``B`` the budget row, ``R`` the raw selection
  row (the policy against ``random`` at the same budget) and ``M`` the matched selection row (the
  policy against ``random``'s curve at the policy's effective budget, the share of routes replay
  changed):

  - *selection*: ``M`` differs: the policy beats random at the same number of changed routes;
  - *both*: ``M`` differs and ``B`` differs (the number of routes replayed matters too);
  - *budget*: ``R`` differs while ``M`` does not (a policy that wins raw but not matched wins by
    how many routes it changes, not which), or ``B`` differs while ``M`` is shown within the
    margin;
  - *neither*: ``B``, ``R`` and ``M`` each shown within the outcome's margin;
  - otherwise *not determined*, with the seeds the power plan asks for the open question
    (``M`` first, then ``R``, then ``B``).

Each answer cites the rows it reads (effect, mean, the interval adjusted to the row's family,
``p_adj``, family) and uses their ``claim`` only: ``differs`` (``p_adj < alpha``), ``within
±margin`` (the equivalence test, adjusted the same way) or neither. The verdict adds no test, so
it says nothing the tables do not; "no effect" appears only where the equivalence test shows it,
and an outcome without a margin says "not shown equivalent: no margin".

Where several rows answer one question (one per budget, and one pooled over budgets), the
verdict reads a primary row first (the earliest gate), then the pooled row, then the one budget
(with several budgets and no pooled row, the one with the smallest ``p_adj``, named).

Pure: :func:`read_verdict` takes effect tables (and their power plans) and returns
:class:`Answer` objects; :func:`render` turns them into lines of at most ``width`` characters.
"""

from __future__ import annotations

import math
import textwrap
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import pandas as pd

from ablate.outcomes import HIGHER_IS_BETTER
from ablate.analysis.frames import without_attrs
from ablate.analysis.power import MAX_SEEDS
from ablate.analysis.tables import context_label, contexts, order_policies
from ablate.policies.roles import BUDGET_CONTROL, FULL_REPLAY, NO_REPLAY

#: The effect kinds as the verdict names them (``matched_selection`` is long for a line).
SHORT_KIND = {"matched_selection": "matched"}


@dataclass(frozen=True)
class Evidence:
    """One effect row as the verdict cites it."""

    effect: str
    policy: str
    baseline: str
    where: str  # "pooled", "b=0.1", or "" for replay
    mean: float
    low: float  # the interval adjusted to the row's family: it excludes 0 exactly when p_adj < alpha
    high: float
    p_adj: float
    family: str
    claim: str
    n_seeds: int
    planned: bool  # whether a power plan was given for the row
    seeds_needed: float  # from the power plan: seeds for 80% power (NaN: none up to its limit, or no plan)
    detect: float  # the effect the plan sized for (NaN: the observed one)

    def text(self) -> str:
        interval = (f"[{_number(self.low)}, {_number(self.high)}]"
                    if math.isfinite(self.low) and math.isfinite(self.high) else "(no interval)")
        where = f" {self.where}" if self.where else ""
        return (f"{SHORT_KIND.get(self.effect, self.effect)} {self.policy}-{self.baseline}{where}: "
                f"{_number(self.mean)} {interval}, p_adj {_p(self.p_adj)}, {self.family}")


@dataclass(frozen=True)
class Answer:
    """One line of the verdict: what the rows say of one subject for one outcome."""

    outcome: str
    context: str  # "" or "backend.router_noise=0.07"
    subject: str  # "replay", or a policy
    finding: str  # changes, no effect, budget, selection, both, neither, not determined
    sentence: str
    evidence: tuple[Evidence, ...]


def read_verdict(effect_tables: Mapping[str, pd.DataFrame],
                 plans: Mapping[str, pd.DataFrame] | None = None) -> list[Answer]:
    """The answers for every outcome of ``effect_tables`` (``{outcome: effects(...)}``), in order.

    ``plans`` (``{outcome: power.plan(effect_table)}``, rows aligned with the table's) give the
    seeds that would settle an undetermined answer; without them the answer names none.
    """
    answers: list[Answer] = []
    for outcome, table in effect_tables.items():
        if table.empty:
            continue
        plan = (plans or {}).get(outcome)
        keys = list(table.attrs.get("by", []))
        for context, part in _contexts(table, keys):
            answers += _answers(outcome, context, part, plan, table.attrs)
    return answers


def cited_rows(effect_table: pd.DataFrame) -> list[Any]:
    """The index labels of the rows the verdict reads (module doc): the rows a plan must cover."""
    cited: list[Any] = []
    for _, part in _contexts(effect_table, list(effect_table.attrs.get("by", []))):
        citer = _Citer(part, None)
        questions = [("replay", FULL_REPLAY, NO_REPLAY), ("budget", BUDGET_CONTROL, NO_REPLAY)]
        selected = part[(part["effect"] == "selection") & (part["baseline"] == BUDGET_CONTROL)]
        for policy in order_policies(selected["policy"].unique()):
            questions += [("selection", policy, BUDGET_CONTROL), ("matched_selection", policy, BUDGET_CONTROL)]
        cited += [index for index in (citer.index(*question) for question in questions) if index is not None]
    return cited


def _answers(outcome: str, context: str, table: pd.DataFrame, plan: pd.DataFrame | None,
             attrs: Mapping[str, Any]) -> list[Answer]:
    margin = attrs.get("margin")
    cite = _Citer(table, plan)
    answers = []
    replay = cite.row("replay", FULL_REPLAY, NO_REPLAY)
    if replay is not None:
        finding, sentence = _single(replay, "full replay", margin)
        answers.append(Answer(outcome, context, "replay", finding, sentence, (replay,)))
    budget = cite.row("budget", BUDGET_CONTROL, NO_REPLAY)
    if budget is not None:
        finding, sentence = _single(budget, "replaying routes at random", margin)
        finding = "budget" if finding == "changes" else finding
        answers.append(Answer(outcome, context, BUDGET_CONTROL, finding, sentence, (budget,)))
    selected = table[(table["effect"] == "selection") & (table["baseline"] == BUDGET_CONTROL)]
    for policy in order_policies(selected["policy"].unique()):
        raw = cite.row("selection", policy, BUDGET_CONTROL)
        matched = cite.row("matched_selection", policy, BUDGET_CONTROL)
        finding, sentence, cited = _policy(budget, raw, matched, margin)
        answers.append(Answer(outcome, context, policy, finding, sentence,
                              tuple(row for row in cited if row is not None)))
    return answers


def _single(row: Evidence, subject: str, margin: float | None) -> tuple[str, str]:
    """A one-row question (replay, the budget alone): changes / no effect / not determined."""
    if _differs(row):
        return "changes", f"{subject} {_direction(row)} it"
    if _within(row):
        return "no effect", f"{subject} leaves it within {_margin(row)} (shown equivalent)"
    return "not determined", _open(row, margin)


def _policy(budget: Evidence | None, raw: Evidence | None, matched: Evidence | None,
            margin: float | None) -> tuple[str, str, tuple[Evidence | None, ...]]:
    """Budget, selection, both, neither or not determined, from the rows B, R and M (module doc),
    with the rows the answer reads."""
    selection = _differs(matched)
    by_count = _differs(raw) and not selection
    by_budget = _differs(budget)
    if selection and by_budget:
        return "both", (f"how many routes are replayed changes it, and which: it {_direction(matched)} it "
                        "beyond random at the same share of changed routes"), (raw, matched, budget)
    if selection:
        return "selection", (f"it {_direction(matched)} it by which routes it changes: beyond random at the "
                             "same share of changed routes"), (raw, matched)
    if by_count:
        which = (f"within {_margin(matched)} at a matched effective budget" if _within(matched)
                 else "not shown at a matched effective budget")
        return "budget", (f"it {_direction(raw)} it more than random by how many routes it changes (budget), "
                          f"not which ({which})"), (raw, matched)
    if by_budget and _within(matched):
        return "budget", ("the number of routes replayed changes it (random - none); which routes it picks does "
                          f"not (within {_margin(matched)} at a matched effective budget)"), (budget, matched)
    if all(_within(row) for row in (budget, raw, matched)):
        return "neither", ("within the margin of none by budget, and of random by selection, raw and matched"
                           ), (budget, raw, matched)
    question = next((row for row in (matched, raw, budget) if row is not None and not _settled(row)), None)
    if by_budget:
        return "not determined", ("the budget changes it (random - none); whether which routes it picks matters: "
                                  + _open(question, margin)), (budget, raw, matched)
    return "not determined", _open(question, margin), (raw, matched)


def _open(row: Evidence | None, margin: float | None) -> str:
    """Why a question is open, and the seeds the plan says would settle it."""
    if row is None:
        return "no row answers it"
    text = f"{row.n_seeds} seeds do not settle it"
    if row.planned:
        size = f"an effect of {_number(row.detect)}" if math.isfinite(row.detect) else "the observed effect"
        text += (f"; {int(row.seeds_needed)} would give 80% power for {size}" if math.isfinite(row.seeds_needed)
                 else f"; no seed count up to {MAX_SEEDS} gives 80% power for {size}")
    if not margin:
        text += "; not shown equivalent: no margin"
    return text


def _differs(row: Evidence | None) -> bool:
    return row is not None and row.claim == "differs"


def _within(row: Evidence | None) -> bool:
    return row is not None and row.claim.startswith("within")


def _margin(row: Evidence) -> str:
    """The margin a ``within ±m`` claim was shown against."""
    return row.claim.removeprefix("within ")


def _settled(row: Evidence) -> bool:
    return _differs(row) or _within(row)


def _direction(row: Evidence) -> str:
    return "lowers" if row.mean < 0 else "raises"


class _Citer:
    """Picks the row that answers a question (module doc) and cites it as :class:`Evidence`."""

    def __init__(self, table: pd.DataFrame, plan: pd.DataFrame | None) -> None:
        # The citer selects hundreds of times on a sweep of thousands of cells (ablate.analysis.frames).
        self.table, self.plan = without_attrs(table), None if plan is None else without_attrs(plan)

    def index(self, effect: str, policy: str, baseline: str) -> Any:
        """The label of the row that answers the question, None when the table has no tested row for it."""
        table = self.table
        rows = table[(table["effect"] == effect) & (table["policy"] == policy) & (table["baseline"] == baseline)
                     & table["p_value"].notna()]
        if rows.empty:
            return None
        primary = rows[rows["family"].str.startswith("primary")]
        pooled = rows[rows["pooled"].astype(bool)]
        if not primary.empty:
            return min(primary.index, key=lambda i: _gate(primary.at[i, "family"]))
        if not pooled.empty:
            return pooled.index[0]
        return rows["p_adj"].astype(float).idxmin()

    def row(self, effect: str, policy: str, baseline: str) -> Evidence | None:
        index = self.index(effect, policy, baseline)
        return None if index is None else self._evidence(index)

    def _evidence(self, index: Any) -> Evidence:
        row = self.table.loc[index]
        seeds, detect = math.nan, math.nan
        planned = self.plan is not None and index in self.plan.index
        if planned:
            plan_row = self.plan.loc[index]
            column = "seeds_for_detect" if "seeds_for_detect" in self.plan.columns else "seeds_for_observed"
            seeds = float(plan_row[column])
            detect = float(plan_row["detect"]) if "detect" in self.plan.columns else math.nan
        where = "pooled" if bool(row["pooled"]) else ("" if math.isnan(float(row["budget"])) else
                                                      f"b={float(row['budget']):g}")
        return Evidence(
            effect=str(row["effect"]), policy=str(row["policy"]), baseline=str(row["baseline"]), where=where,
            mean=float(row["mean"]), low=float(row["ci_adj_low"]), high=float(row["ci_adj_high"]),
            p_adj=float(row["p_adj"]), family=_family(str(row["family"])), claim=str(row["claim"] or ""),
            n_seeds=int(row["n_seeds"]), planned=planned, seeds_needed=seeds, detect=detect,
        )


def _gate(family: str) -> int:
    return int(family.split(":")[0].split()[1])


def _family(family: str) -> str:
    """A family as a verdict line names it: ``primary 2``, ``exploratory pooled`` (the context is the heading)."""
    if family.startswith("primary"):
        return family.split(":")[0]
    return family.split(" (")[0]


def _contexts(table: pd.DataFrame, keys: Sequence[str]) -> list[tuple[str, pd.DataFrame]]:
    return [(context_label(values), part) for values, part in contexts(table, keys)]


def heading(outcome: str, context: str, margin: float | None) -> str:
    """The line above one outcome's answers: its better side and its margin."""
    better = {True: "higher is better", False: "lower is better"}.get(HIGHER_IS_BETTER.get(outcome), "")
    parts = [better, f"margin ±{margin:g}" if margin else "no margin declared"]
    return f"{outcome}{f' at {context}' if context else ''} ({'; '.join(p for p in parts if p)})"


def render(answers: Sequence[Answer], margins: Mapping[str, float | None], width: int = 100) -> list[str]:
    """The verdict as lines of at most ``width`` characters: per outcome a heading, per subject
    its finding and sentence, and below it the rows it reads, indented. An outcome answered in
    several contexts is first counted across them (:func:`across_contexts`)."""
    lines = across_contexts(answers, width)
    shown = None
    for answer in answers:
        if (answer.outcome, answer.context) != shown:
            shown = (answer.outcome, answer.context)
            lines += ([""] if lines else []) + textwrap.wrap(
                heading(answer.outcome, answer.context, margins.get(answer.outcome)), width)
        lines += textwrap.wrap(f"{answer.subject}: {answer.finding} - {answer.sentence}", width,
                               initial_indent="  ", subsequent_indent="      ")
        for row in answer.evidence:
            lines += textwrap.wrap(row.text(), width, initial_indent="      ", subsequent_indent="        ")
    return lines


def across_contexts(answers: Sequence[Answer], width: int = 100) -> list[str]:
    """Per outcome answered in more than one context (a value of the arm keys besides policy and
    budget), one line per subject counting its findings over the contexts: a sweep over many
    settings answers each of them, and its reader looks first for what holds in all."""
    contexts: dict[str, dict[str, None]] = {}
    findings: dict[str, dict[str, Counter[str]]] = {}
    for answer in answers:
        contexts.setdefault(answer.outcome, {})[answer.context] = None
        findings.setdefault(answer.outcome, {}).setdefault(answer.subject, Counter())[answer.finding] += 1
    lines: list[str] = []
    for outcome, seen in contexts.items():
        if len(seen) < 2:
            continue
        keys = ", ".join(dict.fromkeys(part.split("=", 1)[0] for part in next(iter(seen)).split(", ")))
        lines += [""] if lines else []
        lines += textwrap.wrap(f"{outcome} across the {len(seen)} values of {keys} (each answered below)", width)
        for subject, counted in findings[outcome].items():
            counts = ", ".join(f"{finding} in {n}" for finding, n in counted.most_common())
            lines += textwrap.wrap(f"{subject}: {counts} (of {len(seen)})", width, initial_indent="  ",
                                   subsequent_indent="      ")
    return lines


def _number(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    return "0" if value == 0 else f"{value:+.2g}"


def _p(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.2g}"
