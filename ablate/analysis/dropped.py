"""The cells a table of one outcome leaves out: those whose outcome is NaN, infinite or missing.

Tables and effects average finite values only (``n_seeds`` counts what was used), so a diverged
cell or one whose records lack the outcome silently shrinks its arm. The CLI names them beside the
table, so that "seeds per arm: 6" is never read as six seeds behind every mean.
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def dropped_cells(cells: pd.DataFrame, outcome: str) -> list[str]:
    """``name (outcome=value)`` for every cell without a finite ``outcome``, in the frame's order."""
    if outcome not in cells.columns:
        return [f"{name} ({outcome} missing)" for name in cells["name"]]
    values = pd.to_numeric(cells[outcome], errors="coerce").to_numpy(dtype=float)
    return [f"{name} ({outcome}={value:g})" for name, value in zip(cells["name"], values) if not np.isfinite(value)]


def dropped_line(cells: pd.DataFrame, outcome: str) -> str | None:
    """One line counting and naming the dropped cells, or ``None`` when every cell has a value."""
    dropped = dropped_cells(cells, outcome)
    if not dropped:
        return None
    return (f"dropped {len(dropped)} of {len(cells)} cells with no finite {outcome} (NaN, inf or missing), "
            f"so their arms have fewer seeds than shown above: {', '.join(dropped)}")
