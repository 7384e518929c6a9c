"""Analysis of a sweep: outcomes per cell, summary tables, effects with intervals, plots.

``load_runs`` -> ``summarize`` / ``effects`` / ``flag_policies`` is the main path, and
``analyse`` computes all of them and the verdict (``read_verdict``) as ``ablate-analyze`` does. Submodules are imported on first use, so
``import ablate.analysis`` stays light: scipy, matplotlib and W&B code load only when asked for,
and without the ``analysis`` extra they fail with a message naming it (``ablate.analysis.extras``).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_runs": "ablate.analysis.load",
    "summarize": "ablate.analysis.tables",
    "effects": "ablate.analysis.tables",
    "arm_keys": "ablate.analysis.tables",
    "cell_outcomes": "ablate.outcomes",
    "OUTCOME_NAMES": "ablate.outcomes",
    "flag_policies": "ablate.analysis.flags",
    "analyse": "ablate.analysis.compute",
    "read_verdict": "ablate.analysis.verdict",
    "export_table": "ablate.analysis.export",
    "AnalysisSettings": "ablate.analysis.settings",
    "paired_effect": "ablate.analysis.paired",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ablate.analysis' has no attribute {name!r}")
