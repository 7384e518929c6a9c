"""Values that ablate hands back to Hydra's override parser, quoted so that they stay what they are.

Hydra parses every override it is given (``key=value``) with its own grammar, so a value taken
from the world (a path with ``(``, ``,``, ``'``, ``=``, ``[`` or a non-ASCII letter, a JSON
string, a number that must stay a string) would be read as syntax, a sweep, a list or a float.
Every such value goes through :func:`hydra_string`.
"""

from __future__ import annotations

import re

__all__ = ["hydra_string", "quoted_override"]


def hydra_string(value: str) -> str:
    """``value`` as a single-quoted Hydra override value: Hydra keeps it a string, character for character.

    Inside quotes a backslash is literal unless it precedes a quote or ends the string, where it
    must be doubled; quotes are escaped.
    """
    doubled = re.sub(r"(\\+)(?='|$)", lambda run: run.group(1) * 2, value)
    return "'" + doubled.replace("'", "\\'") + "'"


def quoted_override(key: str, value: str) -> str:
    """``key='value'``: an override whose value Hydra reads back as exactly ``value``."""
    return f"{key}={hydra_string(value)}"
