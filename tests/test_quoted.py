"""Every output README.md and docs/ quote is what a run printed, and what the code still prints.

The quotes are the blocks between ``<!-- quoted SOURCE:EXCERPT -->`` and ``<!-- /quoted -->``,
written by ``docs/regenerate_quotes.py`` (``make docs-figures``) from the runs it saved under
``docs/quoted/``. The fast tier checks that each block is its excerpt of a saved run, that each
run names a commit of this branch's history, and that no output is quoted outside such a block.
The slow tier runs commands again: the cell and its errors, the demo and the Optuna study in full
(their quotes must match what they print now, times aside), and a few cells of
``budget_selection``, whose outcomes must be those saved (the sweep itself takes 13 minutes on a
2-core machine of its own: ``make docs-figures``). A failure means the code changed what it
prints: run ``make docs-figures`` (or ``--only`` the source named) and commit what it rewrites.
Cells are compared to the digits on the machine kind the quotes were made on; another kind's float
kernels may differ in the last bits.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _regenerate():
    spec = importlib.util.spec_from_file_location("regenerate_quotes", ROOT / "docs" / "regenerate_quotes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


quotes = _regenerate()
BLOCKS = [block for page in quotes.pages() for block in quotes.blocks(page)]


def test_the_pages_quote_every_source_and_every_source_is_saved():
    assert {block.name.split(":")[0] for block in BLOCKS} == set(quotes.SOURCES)
    for source in quotes.SOURCES:
        capture = quotes.load_capture(source)
        assert capture.header["source"] == source and capture.runs


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: f"{block.page.relative_to(ROOT)}:{block.name}")
def test_a_quoted_block_is_its_excerpt_of_a_saved_run(block):
    assert block.text == quotes.excerpt(block.name, {}), (
        f"{block.page.relative_to(ROOT)}: the block {block.name} is not what docs/quoted/ holds; run "
        "python docs/regenerate_quotes.py --rewrite")


@pytest.mark.parametrize("source", list(quotes.SOURCES))
def test_a_saved_run_names_a_commit_of_this_branch(source):
    header = quotes.load_capture(source).header
    for commit in re.findall(r"\b[0-9a-f]{7,40}\b", header["commit"]):
        found = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=ROOT, capture_output=True)
        assert found.returncode == 0, f"docs/quoted/{source}.txt: commit {commit} is not in this branch's history"


#: A line of what ablate prints: a prompt, a sweep's line, an error, a verdict's heading or row, a study's line.
OUTPUT = re.compile(r"^(\$ python -m ablate|sweep \S+: |ablate: |\S+ \((lower|higher) is better|.*, p_adj |"
                    r"Study '|trial \d)")


def test_no_output_is_quoted_outside_a_quoted_block():
    # A fence without a language holds a run's output; a form with placeholders is fenced as ``text``.
    loose = []
    for page in quotes.pages():
        quoted = fenced = bare = False
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            quoted = (quoted or bool(quotes.BEGIN.match(line))) and line != quotes.END
            if line.startswith("```"):
                fenced, bare = not fenced, not fenced and line == "```"
            elif bare and not quoted and OUTPUT.match(line):
                loose.append(f"{page.relative_to(ROOT)}:{number}: {line[:80]}")
    assert not loose, "output quoted by hand (quote it through docs/regenerate_quotes.py):\n" + "\n".join(loose)


def _timeless(text: str) -> str:
    """A run's output without what differs from one run to the next: times, the machine's load, and a sweep's
    counts while it runs."""
    text = re.sub(r"load average [\d.]+", "load average L", text)
    text = re.sub(r"\d+(?:\.\d+)? s\b", "N s", text)
    text = re.sub(r"\b\d+:\d\d(?::\d\d)?\b", "M:SS", text)
    text = re.sub(r"\d+ s/cell", "N s/cell", text)
    return re.sub(r"^(sweep \S+: )\d+ done, \d+ running, \d+ failed, \d+ left", r"\1counts", text, flags=re.M)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["cli", "demo", "tuning"])
def test_the_code_still_prints_what_the_quotes_show(tmp_path, source):
    now = quotes.run_source(source, tmp_path / source, quotes.git("rev-parse", "--short", "HEAD"))
    now.header = quotes.load_capture(source).header  # the saved run's commit and machine, as the excerpts name them
    for block in (block for block in BLOCKS if block.name.startswith(f"{source}:")):
        assert _timeless(quotes.EXCERPTS[block.name](now)) == _timeless(block.text), (
            f"{block.page.relative_to(ROOT)}: {block.name} is no longer what the code prints: run "
            f"python docs/regenerate_quotes.py --only {source}")


@pytest.mark.slow
def test_a_few_budget_selection_cells_still_give_the_saved_outcomes(tmp_path):
    with open(quotes.QUOTED / "budget_selection" / "cells.csv", newline="", encoding="utf-8") as handle:
        saved = {row["name"]: row for row in csv.DictReader(handle)}
    cells = [("none", None), ("full", None), ("mismatch", 0.5)]
    for policy, budget in cells:
        grid = [f"policy={policy}", "seed=0", *([f"budget={budget}"] if budget is not None else [])]
        done = subprocess.run([sys.executable, "-m", "ablate", "sweeps=budget_selection", *grid,
                               "tracking.mode=disabled"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    for summary in (tmp_path / "runs" / "budget_selection").glob("*/summary.json"):
        name = json.loads((summary.parent / "cell.json").read_text())["name"]
        outcomes = json.loads(summary.read_text())
        for outcome, value in saved[name].items():
            if outcome != "name":
                assert math.isclose(outcomes[outcome], float(value), rel_tol=1e-9), (name, outcome)
