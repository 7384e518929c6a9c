"""Imports from the ``analysis`` extra, with an error that says how to install it.

matplotlib, scipy and wandb-workspaces come with ``pip install 'ablate[analysis]'``, not with
the base install, so that a cell (which only needs :mod:`ablate.outcomes`) never pulls
them in. Every module of ``ablate.analysis`` imports them through :func:`import_extra`, at the point
of use.
"""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL_HINT = "pip install 'ablate[analysis]'"


class MissingExtraError(ImportError):
    """A package of the ``analysis`` extra is not installed; the message says how to get it."""


def import_extra(module: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming what needs it and the extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        package = (error.name or module).split(".")[0]
        raise MissingExtraError(
            f"{purpose} needs {package}, which is not installed: {INSTALL_HINT}"
        ) from error
