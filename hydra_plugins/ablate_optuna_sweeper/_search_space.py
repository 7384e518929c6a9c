"""Hydra's sweep syntax turned into Optuna distributions, and suggested values back into overrides.

=========================================  ===============================================
``key=interval(0.05, 0.5)``                ``FloatDistribution(0.05, 0.5)``
``key=tag(log, interval(1e-4, 1e-1))``     ``FloatDistribution(1e-4, 1e-1, log=True)``
``key=int(interval(1, 8))``                ``IntDistribution(1, 8)`` (both ends included)
``key=range(1, 10, 3)``                    ``IntDistribution(1, 7, step=3)``: 1, 4, 7, as Hydra's
                                           ``range`` (the stop is excluded); float ranges give a
                                           stepped ``FloatDistribution``
``key=choice(a, b)`` or ``key=a,b``        ``CategoricalDistribution(["a", "b"])``
``key=value``                              not searched: passed unchanged to every trial
=========================================  ===============================================

``shuffle`` and ``glob`` sweeps have no meaning for a sampler and are rejected, as are tags other
than ``log``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution


class SearchSpaceError(ValueError):
    """A sweep override that has no Optuna distribution."""


@dataclass(frozen=True)
class SearchSpace:
    #: Optuna parameter name (the override's key, ``policy.tau``) -> its distribution.
    distributions: dict[str, BaseDistribution]
    #: Overrides that are not searched, as written: every trial receives them.
    fixed: list[str]

    def trial_overrides(self, params: Mapping[str, Any]) -> list[str]:
        """The overrides of one trial: the fixed ones, then the suggested values in Hydra's syntax."""
        return [*self.fixed, *(f"{name}={Override._get_value_element_as_str(value)}" for name, value in params.items())]


def parse_search_space(overrides: Iterable[str]) -> SearchSpace:
    """Split overrides into a search space and fixed overrides; a later override of a key wins."""
    by_key: dict[str, Override] = {}
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        by_key[override.get_key_element()] = override
    distributions: dict[str, BaseDistribution] = {}
    fixed: list[str] = []
    for key, override in by_key.items():
        if override.is_sweep_override():
            distributions[key] = distribution_of(override)
        else:
            assert override.input_line is not None
            fixed.append(override.input_line)
    return SearchSpace(distributions, fixed)


def distribution_of(override: Override) -> BaseDistribution:
    sweep = override.value()
    where = f"{override.input_line!r}"
    tags = set(getattr(sweep, "tags", set()))
    if tags - {"log"}:
        raise SearchSpaceError(f"{where}: unknown tag(s) {sorted(tags - {'log'})}; the only tag is log (a log-uniform search)")
    log = "log" in tags
    try:
        if isinstance(sweep, IntervalSweep):
            if isinstance(sweep.start, int) and isinstance(sweep.end, int):
                return IntDistribution(sweep.start, sweep.end, log=log)
            return FloatDistribution(float(sweep.start), float(sweep.end), log=log)
        if isinstance(sweep, RangeSweep) and not sweep.shuffle:
            values = list(override.sweep_iterator())
            if not values:
                raise SearchSpaceError(f"{where}: the range is empty")
            step = abs(sweep.step)
            if all(isinstance(v, int) for v in values) and isinstance(step, int):
                return IntDistribution(min(values), max(values), log=log, step=step)
            return FloatDistribution(float(min(values)), float(max(values)), log=log, step=float(step))
        if isinstance(sweep, ChoiceSweep) and not sweep.shuffle and not log:
            for value in sweep.list:
                if not isinstance(value, (str, int, float, bool, type(None))):
                    raise SearchSpaceError(f"{where}: choice {value!r} is a {type(value).__name__}; expected str, int, float, bool or null")
            return CategoricalDistribution(list(sweep.list))
    except ValueError as error:
        if isinstance(error, SearchSpaceError):
            raise
        raise SearchSpaceError(f"{where}: {error}") from None
    raise SearchSpaceError(
        f"{where}: expected interval(...), int(interval(...)), range(...), choice(...) or a,b,c, optionally "
        "tagged log (intervals and ranges); shuffle and glob sweeps have no meaning for a sampler"
    )
