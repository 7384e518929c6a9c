"""The options every analysis table is computed with, in one place.

:func:`~ablate.analysis.tables.summarize`, :func:`~ablate.analysis.tables.effects`,
:func:`~ablate.analysis.flags.flag_policies` and :func:`~ablate.analysis.compare.compare_values`
take ``settings=AnalysisSettings(...)`` and, for a one-off change, the same names as keywords
(``effects(df, "kl_k3_mean", level=0.9)``); ``ablate-analyze`` builds one object from its flags,
so the command line and the library compute the same tables from the same defaults. Given a frame
of :func:`~ablate.analysis.load.load_runs`, the defaults include what the sweep file declared
(:mod:`ablate.analysis.declared`): its primary questions and its margins.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Mapping, Sequence

from ablate.analysis.declared import declared_of
from ablate.analysis.selectors import parse_selector
from ablate.analysis.stats import ADJUSTMENTS, Adjustment, min_seeds_for_interval

IntervalMethod = Literal["exact", "t", "percentile", "BCa"]
INTERVAL_METHODS: tuple[str, ...] = ("exact", "t", "percentile", "BCa")


@dataclass(frozen=True)
class AnalysisSettings:
    """What a table's intervals, tests and families mean (each field says it statistically).

    - ``by``: the arm keys besides policy and budget (None: every config key that varies).
    - ``level``: confidence level of every interval; ``1 - level`` is the error rate ``alpha``
      each family's claims are held to.
    - ``method``: the interval. ``"exact"`` (default): for paired effects the interval that
      inverts the exact sign-flip test (it excludes 0 exactly when ``p < alpha``), for one arm's
      summary Student's t. ``"t"``: Student's t for both. ``"percentile"`` / ``"BCa"``: bootstrap
      with ``reps`` resamples (too narrow at few seeds: 0.87 coverage at 6 seeds for 0.95).
    - ``reps``: bootstrap resamples (bootstrap methods and ratio intervals only).
    - ``seed``: seed of each row's own generator (bootstrap, Monte Carlo sign patterns above 16
      seeds), so the same call gives the same table.
    - ``min_seeds``: fewest (paired) seeds for an interval; default: the fewest for which an
      exact sign-flip test can reach ``p < alpha`` (6 at 0.95).
    - ``adjust``: multiplicity adjustment within each family: Holm (family-wise error), BH
      (false discovery rate) or none.
    - ``primary``: ordered primary questions (row selectors, :mod:`ablate.analysis.selectors`),
      tested by serial gatekeeping before anything else; the rest is exploratory. None (the
      default): the questions the sweep file declared (``analysis.primary``), none for a frame
      that carries no declaration; ``()`` asks none.
    - ``margins``: per outcome, the equivalence margin in the outcome's units: rows test
      ``|effect| < margin`` (TOST) beside the difference test, and only a row that passes it
      reads as "no effect". They add to (and, per outcome, replace) the sweep's declared
      ``analysis.margins``.
    """

    by: tuple[str, ...] | None = None
    level: float = 0.95
    method: IntervalMethod = "exact"
    reps: int = 2000
    seed: int = 0
    min_seeds: int | None = None
    adjust: Adjustment = "holm"
    primary: tuple[str, ...] | None = None
    margins: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.level < 1.0:
            raise ValueError(f"level={self.level}: expected a confidence level in (0, 1), e.g. 0.95")
        if self.method not in INTERVAL_METHODS:
            raise ValueError(f"method={self.method!r}: expected one of {', '.join(INTERVAL_METHODS)}")
        if self.adjust not in ADJUSTMENTS:
            raise ValueError(f"adjust={self.adjust!r}: expected one of {', '.join(ADJUSTMENTS)}")
        if self.reps < 1:
            raise ValueError(f"reps={self.reps}: expected a positive number of bootstrap resamples")
        if self.min_seeds is not None and self.min_seeds < 2:
            raise ValueError(f"min_seeds={self.min_seeds}: expected at least 2 (an interval needs two values)")
        for outcome, margin in self.margins.items():
            if not margin > 0:
                raise ValueError(f"margin {outcome}={margin}: expected a positive margin in {outcome}'s units")
        object.__setattr__(self, "by", None if self.by is None else tuple(self.by))
        object.__setattr__(self, "primary", None if self.primary is None else tuple(self.primary))
        object.__setattr__(self, "margins", dict(self.margins))

    @property
    def alpha(self) -> float:
        return 1.0 - self.level

    @property
    def needed(self) -> int:
        """Fewest (paired) seeds for an interval: ``min_seeds`` or the default rule."""
        return min_seeds_for_interval(self.level) if self.min_seeds is None else int(self.min_seeds)

    @classmethod
    def of(cls, settings: "AnalysisSettings | None", options: Mapping[str, Any],
           frame: Any = None) -> "AnalysisSettings":
        """``settings`` (or the defaults) with ``options`` replaced, completed from ``frame``'s
        declaration (:meth:`for_frame`); an unknown name is an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown analysis option(s) {unknown}; expected some of {sorted(known)}")
        base = settings if settings is not None else cls()
        return (replace(base, **options) if options else base).for_frame(frame)

    def for_frame(self, frame: Any) -> "AnalysisSettings":
        """These settings with what ``frame``'s sweep declared filled in: the primary questions
        when ``primary`` is None, the declared margins under the given ones.

        The one place the library and the command line read a sweep's declaration from, so that
        both compute the same tables; applying it twice changes nothing.
        """
        declared = declared_of(frame)
        primary = self.primary
        if primary is None:
            primary = declared.get("primary")
            for text in primary:
                parse_selector(text, "analysis.primary")
        margins = dict(self.margins) if self.margins and "margins" in declared.conflicts else {
            **declared.get("margins"), **self.margins}
        if primary == self.primary and margins == self.margins:
            return self
        return replace(self, primary=primary, margins=margins)


def parse_outcome_values(texts: Sequence[str], outcomes: Sequence[str], flag: str) -> dict[str, float]:
    """``["final_reward=0.05"]`` -> ``{"final_reward": 0.05}``: a positive value per known outcome."""
    margins = {}
    for text in texts:
        outcome, _, value = text.partition("=")
        try:
            margin = float(value)
        except ValueError:
            margin = float("nan")
        if outcome not in outcomes or not margin > 0:
            raise ValueError(f"{flag} {text!r}: expected OUTCOME=VALUE with a positive value in the outcome's "
                             f"units and OUTCOME one of {', '.join(outcomes)}, e.g. final_reward=0.05")
        margins[outcome] = margin
    return margins
