"""Primary questions as a sweep file or ``--primary`` names them: row selectors of an effect table.

::

    KIND[:POLICY:BASELINE][@BUDGET|@pooled]

    replay                              full - none
    selection:fisher:random@pooled      fisher against random, pooled over budgets
    selection:fisher:random             ... and at every budget

``KIND`` is ``replay``, ``budget``, ``selection``, ``matched_selection`` or ``compare``. Parsing
needs no other part of the analysis, so the settings check a sweep's declared questions with it,
and :mod:`ablate.analysis.families` forms the primary gates from it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

KINDS: tuple[str, ...] = ("replay", "budget", "selection", "matched_selection", "compare")
_SELECTOR = re.compile(r"^(?P<kind>[a-z_]+)(?::(?P<policy>[^:@]+):(?P<baseline>[^:@]+))?(?:@(?P<where>[^@]+))?$")


@dataclass(frozen=True)
class Selector:
    """One primary question: which effect rows it names (see the module doc)."""

    text: str
    kind: str
    policy: str | None
    baseline: str | None
    pooled: bool | None
    budget: float | None

    def matches(self, table: pd.DataFrame) -> pd.Series:
        mask = table["effect"] == self.kind
        if self.policy is not None:
            mask &= (table["policy"] == self.policy) & (table["baseline"] == self.baseline)
        if self.pooled is not None:
            mask &= table["pooled"] == self.pooled
        if self.budget is not None:
            mask &= np.isclose(table["budget"].astype(float), self.budget)
        return mask


def parse_selector(text: str, source: str = "--primary") -> Selector:
    """``"selection:fisher:random@pooled"`` -> a :class:`Selector`; a bad one is one clear error."""
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
    return Selector(text.strip(), match["kind"], match["policy"], match["baseline"], pooled, budget)
