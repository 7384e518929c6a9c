"""The tables as a reader follows them on a terminal or a page: the columns the verdict reads, fitted to a width.

The files hold every column (:mod:`ablate.analysis.writer`); these views keep what a reader needs
to trace a verdict line to its row: for effects the comparison, the mean, the interval adjusted
to the row's family, ``p_adj``, the claim and the family. :func:`fit` renders a view as a
Markdown pipe table of at most ``width`` characters, dropping the least needed columns first.
"""

from __future__ import annotations

import math

import pandas as pd

from ablate.analysis.export import to_markdown
from ablate.analysis.frames import without_attrs

EFFECT_NAMES = {"matched_selection": "matched"}


def compact_summary(summary: pd.DataFrame) -> pd.DataFrame:
    """Per arm: the mean, its interval, the seeds and the effective budget."""
    flat = without_attrs(summary.reset_index())
    keys = list(summary.attrs.get("by", []))
    return flat[[*keys, "policy", "budget", "mean", "ci_low", "ci_high", "n_seeds", "effective_budget"]]


def compact_effects(effects: pd.DataFrame) -> pd.DataFrame:
    """Per effect row: what is compared, the mean, the adjusted interval, ``p_adj``, the claim, the family."""
    keys = list(effects.attrs.get("by", []))
    view = without_attrs(effects[[*keys, "effect", "policy", "baseline", "budget", "mean", "ci_adj_low",
                                  "ci_adj_high", "p_adj", "claim", "family"]])
    view["effect"] = view["effect"].map(lambda kind: EFFECT_NAMES.get(kind, kind))
    view["budget"] = [("pooled" if pooled else ("" if math.isnan(b) else f"{b:g}"))
                      for pooled, b in zip(effects["pooled"], effects["budget"].astype(float))]
    view["family"] = view["family"].map(short_family)
    return view


def compact_plan(plan: pd.DataFrame) -> pd.DataFrame:
    """Per effect row: the paired sd, the effect detectable now and the seeds the plan asks for."""
    keys = list(plan.attrs.get("by", []))
    seeds = "seeds_for_detect" if "seeds_for_detect" in plan.columns else "seeds_for_observed"
    view = without_attrs(plan[[*keys, "effect", "policy", "baseline", "budget", "n_seeds", "sd_diff", "mde", seeds]])
    view["effect"] = view["effect"].map(lambda kind: EFFECT_NAMES.get(kind, kind))
    view["budget"] = [("pooled" if pooled else ("" if math.isnan(b) else f"{b:g}"))
                      for pooled, b in zip(plan["pooled"], plan["budget"].astype(float))]
    return view


def short_family(family: str) -> str:
    """``primary 2: selection:...`` -> ``primary 2``; ``exploratory pooled (key=v)`` -> ``expl. pooled``."""
    if family.startswith("primary"):
        return family.split(":")[0]
    return family.split(" (")[0].replace("exploratory ", "expl. ")


def fit(view: pd.DataFrame, width: int = 100, *, optional: tuple[str, ...] = (), digits: int = 3) -> str:
    """``view`` as a pipe table of at most ``width`` characters per line.

    Columns named in ``optional`` are dropped, last first, until the table fits; text cells are
    then cut (ending in ``~``) if it still does not.
    """
    view = without_attrs(view)
    for column in reversed(optional):
        if _width(view, digits) <= width:
            break
        if column in view.columns:
            view = view.drop(columns=column)
    while _width(view, digits) > width:
        texts = [c for c in view.columns if view[c].dtype == object and view[c].astype(str).str.len().max() > 6]
        if not texts:
            break
        longest = max(texts, key=lambda c: view[c].astype(str).str.len().max())
        limit = int(view[longest].astype(str).str.len().max()) - 1
        view[longest] = view[longest].astype(str).map(lambda text: text if len(text) <= limit else text[:limit - 1] + "~")
    return to_markdown(view, digits=digits, escape_html=False)


def _width(view: pd.DataFrame, digits: int) -> int:
    return max(len(line) for line in to_markdown(view, digits=digits, escape_html=False).splitlines())
