"""The verdict: the effects tables read aloud, before any table.

For each outcome (and each context of the arm keys) it answers, in plain words:

- **replay**: does full replay change the outcome (the ``replay`` row, ``full - none``)?
- **random**: does the budget alone change it (the ``budget`` row, ``random - none``)?
- **each other policy**: does it act through how many routes it changes (budget), which routes
  it picks (selection), both, or neither? From three rows: ``B`` the budget row, ``R`` the raw
  selection row (the policy against ``random`` at the same budget) and ``M`` the matched
  selection row (the policy against ``random``'s curve at the policy's effective budget, the
  share of routes replay changed). Each part of an answer rests on a row's claim, and a row that
  is neither shown to differ nor shown within the margin settles nothing:

  - *selection* needs ``M`` to differ; *both* adds ``B`` differing (the number of routes random
    replays changes the outcome); the plain *selection* needs ``B`` within the margin, and
    with ``B`` open it is *selection at least*;
  - *budget* needs ``M`` within the margin (the equivalence test) and ``R`` or ``B`` to differ:
    a policy that beats random at the same budget but not at the same share of changed routes
    wins by how many routes it changes, not which. ``M`` merely not shown to differ is not
    shown equal: with ``B`` differing and ``M`` open it is *budget at least*, whether the choice
    adds being open; with only ``R`` differing, how many and which are not told apart;
  - *no selection effect*: ``M`` within the margin while ``B`` and ``R`` are open;
  - *neither*: ``B``, ``R`` and ``M`` each within the margin;
  - otherwise *not determined*.

  Every open part names its row, its paired seeds (and those dropped, from the row's note) and
  the seeds the power plan gives for 80% power if the true effect is the observed one.

Each answer cites the rows it reads (effect, mean, the interval adjusted to the row's family,
``p_adj``, family) and uses their ``claim`` only: ``differs`` (``p_adj < alpha``), ``within
±margin`` (the equivalence test, adjusted the same way) or neither. The verdict adds no test, so
it says nothing the tables do not; an outcome without a margin says "not shown equivalent: no
margin". A question whose arms have no cells yet (a sweep stopped early, or a policy the sweep's
primary questions name and no cell ran) is said to be not yet answerable.

Where several rows answer one question (one per budget, and one pooled over budgets), the
verdict reads a primary row first (the earliest gate), then the pooled row, then the one budget
(with several budgets and no pooled row, the one with the smallest ``p_adj``, named).

Pure: :func:`read_verdict` takes effect tables (and their power plans) and returns
:class:`Answer` objects; :func:`render` turns them into lines of at most ``width`` characters and
:func:`legend` says how to read them.
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
from ablate.analysis.selectors import parse_selector
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
    high: float  # (NaN: too few seeds for an interval; -inf/inf: the family's level allows no claim)
    p_adj: float
    family: str
    claim: str
    n_seeds: int
    min_seeds: int  # the fewest paired seeds for an interval and a claim
    dropped: str  # what the row's note says of the seeds it dropped ("" when none)
    planned: bool  # whether a power plan was given for the row
    seeds_needed: float  # from the power plan: seeds for 80% power (NaN: none up to its limit, or no plan)
    detect: float  # the effect the plan sized for (NaN: the observed one)

    def text(self) -> str:
        if math.isnan(self.low) or math.isnan(self.high):
            interval = f"no interval ({self.n_seeds} seeds < {self.min_seeds})"
        elif math.isinf(self.low) and math.isinf(self.high):
            interval = "[-inf, inf]"
        else:
            interval = f"[{_number(self.low)}, {_number(self.high)}]"
        where = f" {self.where}" if self.where else ""
        return (f"{SHORT_KIND.get(self.effect, self.effect)} {self.policy}-{self.baseline}{where}: "
                f"{_number(self.mean)} {interval}, p_adj {_p(self.p_adj)}, {self.family}")


@dataclass(frozen=True)
class Answer:
    """One line of the verdict: what the rows say of one subject for one outcome."""

    outcome: str
    context: str  # "" or "backend.router_noise=0.07"
    subject: str  # "replay", or a policy
    finding: str  # one of FINDINGS
    sentence: str
    evidence: tuple[Evidence, ...]


#: Every finding an answer can give; "at least" names the part shown while the other is open.
FINDINGS = ("changes", "no effect", "budget", "selection", "both", "neither", "selection at least", "budget at least",
            "no selection effect", "not determined", "no cells yet")


def read_verdict(effect_tables: Mapping[str, pd.DataFrame],
                 plans: Mapping[str, pd.DataFrame] | None = None) -> list[Answer]:
    """The answers for every outcome of ``effect_tables`` (``{outcome: effects(...)}``), in order.

    ``plans`` (``{outcome: power.plan(effect_table)}``, rows aligned with the table's) give the
    seeds that would settle an undetermined answer; without them the answer names none.
    """
    answers: list[Answer] = []
    for outcome, table in effect_tables.items():
        plan = (plans or {}).get(outcome)
        keys = list(table.attrs.get("by", []))
        for context, part in _contexts(table, keys) if not table.empty else [("", table)]:
            answers += _answers(outcome, context, part, plan, table.attrs)
    return answers


def cited_rows(effect_table: pd.DataFrame) -> list[Any]:
    """The index labels of the rows the verdict reads (module doc): the rows a plan must cover."""
    cited: list[Any] = []
    for _, part in _contexts(effect_table, list(effect_table.attrs.get("by", []))):
        citer = _Citer(part, None, effect_table.attrs)
        questions = [("replay", FULL_REPLAY, NO_REPLAY), ("budget", BUDGET_CONTROL, NO_REPLAY)]
        selected = part[(part["effect"] == "selection") & (part["baseline"] == BUDGET_CONTROL)]
        for policy in order_policies(selected["policy"].unique()):
            questions += [("selection", policy, BUDGET_CONTROL), ("matched_selection", policy, BUDGET_CONTROL)]
        cited += [index for index in (citer.index(*question) for question in questions) if index is not None]
    return cited


def _answers(outcome: str, context: str, table: pd.DataFrame, plan: pd.DataFrame | None,
             attrs: Mapping[str, Any]) -> list[Answer]:
    margin = attrs.get("margin")
    cite = _Citer(table, plan, attrs)
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
    asked = {answer.subject for answer in answers}
    answers += [Answer(outcome, context, subject, "no cells yet", why, ())
                for subject, why in _not_yet(attrs.get("primary", ()), asked)]
    return answers


def _not_yet(primary: Sequence[str], asked: set[str]) -> list[tuple[str, str]]:
    """The subjects the sweep asks of (replay and the budget always, and each policy its primary questions
    name) that no row answers: their arms have no cells yet."""
    needs = {"replay": f"its rows need cells of {NO_REPLAY} and {FULL_REPLAY}",
             BUDGET_CONTROL: f"its rows need cells of {BUDGET_CONTROL} and {NO_REPLAY}"}
    for number, text in enumerate(primary, 1):
        selector = parse_selector(text)
        if selector.policy and selector.kind in ("selection", "matched_selection") and selector.policy not in needs:
            needs[selector.policy] = (f"primary question {number} ({text}) needs cells of {selector.policy} and "
                                      f"{selector.baseline} at one budget")
    return [(subject, why) for subject, why in needs.items() if subject not in asked]


def _single(row: Evidence, subject: str, margin: float | None) -> tuple[str, str]:
    """A one-row question (replay, the budget alone): changes / no effect / not determined."""
    if _differs(row):
        return "changes", f"{subject} {_direction(row)} it"
    if _within(row):
        return "no effect", f"{subject} leaves it within {_margin(row)} (shown equivalent)"
    return "not determined", _open(row, margin)


def _policy(budget: Evidence | None, raw: Evidence | None, matched: Evidence | None,
            margin: float | None) -> tuple[str, str, tuple[Evidence | None, ...]]:
    """Budget, selection, both, neither, one of them at least, or not determined, from the rows B, R
    and M (module doc), with the rows the answer reads."""
    same_share = "random at the same share of changed routes"
    if _differs(matched):
        which = f"it {_direction(matched)} it by which routes it picks: beyond {same_share}"
        if _differs(budget):
            return "both", f"how many routes are replayed changes it (random - none), and {which}", (
                raw, matched, budget)
        if _within(budget):
            return "selection", (f"{which}; how many routes random replays leaves it within {_margin(budget)} "
                                 "of none"), (raw, matched, budget)
        return "selection at least", (f"{which}; whether how many routes are replayed matters too is not "
                                      f"determined: {_open(budget, margin, 'the budget row')}"), (raw, matched, budget)
    if _within(matched):
        not_which = f"within {_margin(matched)} of {same_share}"
        if _differs(raw):
            return "budget", (f"it {_direction(raw)} it more than random at the same budget by how many routes it "
                              f"changes, not which ({not_which})"), (raw, matched)
        if _differs(budget):
            return "budget", ("how many routes are replayed changes it (random - none); which routes it picks "
                              f"does not ({not_which})"), (budget, matched)
        if _within(budget) and _within(raw):
            return "neither", ("within the margin of none by budget, and of random by selection, raw and matched"
                               ), (budget, raw, matched)
        question = next(row for row in (budget, raw) if row is None or not _settled(row))
        return "no selection effect", (f"which routes it picks does not change it ({not_which}); whether how many "
                                       f"does is not determined: {_open(question, margin, _label(question))}"), (
            budget, raw, matched)
    open_matched = _open(matched, margin, "the matched row")
    if _differs(budget):
        return "budget at least", ("how many routes are replayed changes it (random - none); whether which routes it "
                                   f"picks adds to that is not determined: {open_matched}"), (budget, raw, matched)
    if _differs(raw):
        return "not determined", (f"it {_direction(raw)} it more than random at the same budget, by how many routes "
                                  f"it changes or by which: not told apart; {open_matched}"), (raw, matched, budget)
    question = next((row for row in (matched, raw, budget) if row is not None and not _settled(row)), None)
    return "not determined", _open(question, margin, _label(question)), (raw, matched)


def _label(row: Evidence | None) -> str:
    """How an open row is named in an answer's sentence."""
    if row is None:
        return ""
    return {"matched_selection": "the matched row", "selection": "the raw row", "budget": "the budget row"}.get(
        row.effect, "")


def _open(row: Evidence | None, margin: float | None, label: str = "") -> str:
    """Why a question is open (the row, its seeds and those it dropped) and the seeds the plan says would
    settle it, planned from the observed effect."""
    if row is None:
        return "no row answers it"
    seeds = f"{row.n_seeds} paired seeds" + (f" ({row.dropped})" if row.dropped else "")
    text = f"{label}'s {seeds}" if label else seeds
    text += " are too few for any claim" if row.n_seeds < row.min_seeds else " do not settle it"
    if row.planned:
        if math.isfinite(row.detect):
            size = f"an effect of {_number(row.detect)}"
            text += (f"; {int(row.seeds_needed)} would detect {size} with 80% power" if math.isfinite(row.seeds_needed)
                     else f"; no seed count up to {MAX_SEEDS} detects {size} with 80% power")
        elif math.isfinite(row.seeds_needed):
            text += (f"; about {int(row.seeds_needed)} would show a difference with 80% power if the true effect is "
                     f"the observed {_number(row.mean)}")
        else:
            text += (f"; no seed count up to {MAX_SEEDS} would show a difference with 80% power if the true effect is "
                     f"the observed {_number(row.mean)}")
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

    def __init__(self, table: pd.DataFrame, plan: pd.DataFrame | None, attrs: Mapping[str, Any]) -> None:
        # The citer selects hundreds of times on a sweep of thousands of cells (ablate.analysis.frames).
        self.table, self.plan = without_attrs(table), None if plan is None else without_attrs(plan)
        self.min_seeds = int(attrs.get("min_seeds", 0))

    def index(self, effect: str, policy: str, baseline: str) -> Any:
        """The label of the row that answers the question, None when the table has no tested row for it."""
        table = self.table
        if table.empty:
            return None
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
            n_seeds=int(row["n_seeds"]), min_seeds=self.min_seeds, dropped=_dropped(row.get("note")),
            planned=planned, seeds_needed=seeds, detect=detect,
        )


def _dropped(note: Any) -> str:
    """What a row's note says of the seeds it dropped (a matched row: those outside random's range)."""
    parts = str(note).split("; ") if isinstance(note, str) else []
    return "; ".join(part for part in parts if "dropped" in part)


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


def introduction() -> str:
    """What the verdict asks, in a researcher's words (the rule it reads the rows by is in :func:`legend`)."""
    return ("Does full replay change each outcome, and does each policy change it by how many routes it replays "
            "(budget), by which routes it picks (selection), by both or by neither? An answer claims only what a "
            "test shows; under it stand the table rows it rests on, read as the notes after the answers say.")


def legend(level: float, min_seeds: int) -> list[str]:
    """How to read the answers and the rows they cite: the rule of the module doc, in bullets."""
    alpha = f"{1 - level:.2g}"
    return [
        f"- a row: effect policy-baseline [pooled | b=budget]: mean difference [{level:.0%} interval adjusted to the "
        "row's family], p_adj, family. budget: random - none; selection: the policy - random at the same budget; "
        "matched: the policy - random at the same share of changed routes (its effective budget)",
        f"- a row differs when p_adj < {alpha}, and is within ±margin when the equivalence test (two one-sided "
        "sign-flip tests, adjusted the same way) puts it inside the outcome's margin; any other row settles nothing: "
        "not shown to differ is not shown equal",
        "- selection: matched differs (both: the budget row differs too; at least: the budget row is open). budget: "
        "matched is within the margin while the raw or the budget row differs (at least: the budget row differs "
        "and matched is open). neither: the budget, raw and matched rows all within the margin",
        f"- no interval (n seeds < {min_seeds}): too few paired seeds for any claim (a matched row drops the seeds "
        "whose effective budget lies outside random's range); [-inf, inf]: Holm over a family this large, or a "
        "primary gate not reached, leaves these seeds no claim",
        "- the seeds that would settle a question are planned from its observed effect: the count at which the exact "
        "test shows a difference with 80% power if the true effect is the one measured; measured on few seeds that "
        "effect is itself rough, so read the count as an order of magnitude",
    ]


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
