"""A griffe extension for the API reference: the docstrings' Sphinx roles as code.

The docstrings cross-reference with Sphinx roles (``:func:`ablate.budget.count_for```), which
read well in source and in ``help()``; MkDocs has no reStructuredText, so each role becomes the
code it names (``ablate.budget.count_for``, or ``count_for`` after a ``~``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def _as_code(match: re.Match[str]) -> str:
    shortened, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if shortened else target}`"


class SphinxRolesAsCode(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_as_code, obj.docstring.value)
