"""Frames without their ``attrs``, for code that reads a table column by column or row by row.

pandas deep-copies a frame's ``attrs`` into every column, row and selection it hands back, and
the tables keep their settings there (the level, the families and their sizes, the questions).
Printing, exporting or citing a table of a sweep of thousands of cells selects from it tens of
thousands of times: with the settings copied each time, that was a third of the analysis.
"""

from __future__ import annotations

import pandas as pd


def without_attrs(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame``'s values without its attrs (the values are not copied)."""
    bare = frame.copy(deep=False)
    bare.attrs = {}
    return bare
