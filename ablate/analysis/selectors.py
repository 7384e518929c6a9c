"""Primary questions as row selectors of an effect table (the grammar is :mod:`ablate.questions`).

::

    KIND[:POLICY:BASELINE][@BUDGET|@pooled]

    replay                              full - none
    selection:fisher:random@pooled      fisher against random, pooled over budgets
    selection:fisher:random             ... and at every budget

Selecting needs no other part of the analysis, so the verdict and :mod:`ablate.analysis.families`
(which forms the primary gates) both import it without importing each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from ablate.questions import Question, parse_question


@dataclass(frozen=True)
class Selector(Question):
    """One primary question: which effect rows it names."""

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
    return Selector(**asdict(parse_question(text, source)))
