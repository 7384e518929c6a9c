"""What a sweep declares of its own analysis: its primary questions, its outcomes and their margins.

A sweep file's ``analysis:`` block (``ablate.config.AnalysisConfig``) travels in every cell's
resolved config. :func:`ablate.analysis.load.load_runs` reads it once into
``df.attrs["analysis"]``, and every table (:func:`~ablate.analysis.tables.summarize`,
:func:`~ablate.analysis.tables.effects`, :func:`~ablate.analysis.flags.flag_policies`,
:func:`~ablate.analysis.compare.compare_values`) and ``ablate-analyze`` take their defaults from
there, through :meth:`ablate.analysis.settings.AnalysisSettings.of`: the library and the command
give the same numbers for the same sweep by default.

A frame built by hand carries no declaration: no primary questions, no margins, and the default
outcomes (:data:`DEFAULT_OUTCOMES`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

#: The outcomes reported when a sweep declares none and none is asked for: the train-inference
#: mismatch, where budget and selection separate, and the reward, what training is for.
DEFAULT_OUTCOMES: tuple[str, ...] = ("kl_k3_mean", "final_reward")
_FIELDS = ("primary", "outcomes", "margins")


@dataclass(frozen=True)
class DeclaredAnalysis:
    """The ``analysis:`` block the cells of one sweep recorded.

    ``conflicts`` names each field whose value differs between cells (they were started from
    different versions of the sweep file), with two of the cells: using such a field is an error
    until it is given explicitly (``--primary``, ``--outcome``, ``--margin``).
    """

    primary: tuple[str, ...] = ()
    outcomes: tuple[str, ...] = ()
    margins: Mapping[str, float] = field(default_factory=dict)
    conflicts: Mapping[str, str] = field(default_factory=dict)

    def get(self, name: str) -> Any:
        """One declared field; a field the cells disagree on raises a one-line ``ValueError``."""
        if name in self.conflicts:
            flag = {"primary": "--primary", "outcomes": "--outcome", "margins": "--margin"}[name]
            raise ValueError(f"analysis.{name} differs between cells of this sweep ({self.conflicts[name]}); "
                             f"pass {flag} to choose")
        return getattr(self, name)


def declared_analysis(configs: Iterable[tuple[str, Mapping[str, Any]]]) -> DeclaredAnalysis:
    """The ``analysis:`` block of ``(cell path, flattened resolved config)`` pairs, checked for agreement."""
    found: dict[str, dict[Any, str]] = {name: {} for name in _FIELDS}
    for where, config in configs:
        block = _block(config)
        for name in _FIELDS:
            found[name].setdefault(block[name], str(where))
    values, conflicts = {}, {}
    for name, seen in found.items():
        if len(seen) > 1:
            conflicts[name] = "; ".join(list(seen.values())[:2])
        values[name] = next(iter(seen), ())
    return DeclaredAnalysis(primary=values["primary"], outcomes=values["outcomes"], margins=dict(values["margins"]),
                            conflicts=conflicts)


def declared_of(frame: Any) -> DeclaredAnalysis:
    """The declaration a frame of :func:`~ablate.analysis.load.load_runs` carries (none for another frame)."""
    declared = getattr(frame, "attrs", {}).get("analysis")
    return declared if isinstance(declared, DeclaredAnalysis) else DeclaredAnalysis()


def _block(config: Mapping[str, Any]) -> dict[str, Any]:
    """The block of one flattened config as hashable values (margins as sorted pairs)."""
    margins = dict(config.get("analysis.margins") or {})
    margins.update({key.removeprefix("analysis.margins."): value for key, value in config.items()
                    if key.startswith("analysis.margins.")})
    return {
        "primary": tuple(str(text) for text in config.get("analysis.primary") or ()),
        "outcomes": tuple(str(text) for text in config.get("analysis.outcomes") or ()),
        "margins": tuple(sorted((str(k), float(v)) for k, v in margins.items())),
    }
