"""How an arm is named, and read back: a policy plus its non-default settings (its variant).

Two spellings of one name: the analysis' frames write ``fisher[tau=1.0]``; a cell's name (a W&B
run and a directory of the run store) writes ``fisher+tau=1.0``, because brackets are glob
characters in a shell and in ``Path.glob``. :func:`arm_name` writes both, :func:`arm_policy`
reads the policy back from either.
"""

from __future__ import annotations

import re

#: What a cell name (a directory of the run store) may not hold: separators, spaces, quotes.
UNSAFE_IN_NAME = re.compile(r"[^A-Za-z0-9._=,+-]")


def arm_name(policy: str, variant: str = "", *, in_path: bool = False) -> str:
    """``fisher`` without a variant; ``fisher[tau=1.0]``, or ``fisher+tau=1.0`` with ``in_path``."""
    if not variant:
        return policy
    return f"{policy}+{UNSAFE_IN_NAME.sub('_', variant)}" if in_path else f"{policy}[{variant}]"


def arm_policy(arm: str) -> str:
    """The policy of an arm written by :func:`arm_name`, in either spelling (``fisher[tau=1.0]`` -> ``fisher``)."""
    return re.split(r"[\[+]", arm, maxsplit=1)[0]
