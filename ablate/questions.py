"""The questions a sweep may declare first (``analysis.primary``): the grammar of an effect-row selector.

    KIND[:POLICY:BASELINE][@BUDGET|@pooled]

It is read here, below the analysis, so that a sweep file's questions are checked with the rest
of its config before any cell runs (:mod:`ablate.compose`); the analysis matches effect rows
with them (:class:`ablate.analysis.families.Selector`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS: tuple[str, ...] = ("replay", "budget", "selection", "matched_selection", "compare")
_SELECTOR = re.compile(r"^(?P<kind>[a-z_]+)(?::(?P<policy>[^:@]+):(?P<baseline>[^:@]+))?(?:@(?P<where>[^@]+))?$")


@dataclass(frozen=True)
class Question:
    """One declared question, as written: which effect rows it names."""

    text: str
    kind: str
    policy: str | None
    baseline: str | None
    pooled: bool | None
    budget: float | None


def parse_question(text: str, source: str = "--primary") -> Question:
    """``"selection:fisher:random@pooled"`` -> a :class:`Question`; a bad one is one clear error."""
    match = _SELECTOR.match(text.strip())
    problem = ""
    if not match:
        problem = "expected KIND[:POLICY:BASELINE][@BUDGET|@pooled]"
    elif match["kind"] not in KINDS:
        problem = f"KIND {match['kind']!r} is not one of {', '.join(KINDS)}"
    budget, pooled = None, None
    if not problem and match["where"] is not None:
        if match["where"] == "pooled":
            pooled = True
        else:
            try:
                budget, pooled = float(match["where"]), False
            except ValueError:
                problem = f"@{match['where']} is neither a budget nor 'pooled'"
    if problem:
        raise ValueError(f"{source} {text!r}: {problem}, e.g. replay or selection:fisher:random@pooled")
    return Question(text.strip(), match["kind"], match["policy"], match["baseline"], pooled, budget)
