"""The verdict: effect rows in, answers out, on tables small enough to check by hand; then the command's
verdict traced row by row to the effects file it wrote."""

import math
import re
from collections import Counter

import pandas as pd
import pytest

from ablate.analysis.verdict import read_verdict, render

COLUMNS = ["effect", "policy", "baseline", "budget", "pooled", "mean", "ci_adj_low", "ci_adj_high", "p_value",
           "p_adj", "family", "claim", "n_seeds", "note"]


def row(effect, policy, baseline, claim, *, mean=-1.0, p_adj=0.5, family="exploratory pooled", budget=math.nan,
        pooled=True, n=6, note=""):
    spread = abs(mean) / 10  # an interval that excludes 0, as a claim's does
    low, high = (mean - spread, mean + spread) if claim != "inconclusive" else (-math.inf, math.inf)
    if n < 6:
        low = high = math.nan  # too few seeds: no interval at all
    return [effect, policy, baseline, budget, pooled, mean, low, high, p_adj, p_adj, family, claim, n, note]


def table(*rows, margin=None, keys=(), primary=()):
    frame = pd.DataFrame([list(r) for r in rows], columns=[*keys, *COLUMNS])
    frame.attrs.update(by=list(keys), margin=margin, min_seeds=6, primary=list(primary))
    return frame


def answers(*rows, margin=None, plan=None, primary=()):
    effects = table(*rows, margin=margin, primary=primary)
    found = read_verdict({"kl_k3_mean": effects}, {"kl_k3_mean": plan} if plan is not None else None)
    return {answer.subject: answer for answer in found}


REPLAY = row("replay", "full", "none", "differs", mean=-0.0066, p_adj=0.031, family="primary 1: replay",
             pooled=False)
#: The matched row of issue 38 as the demo printed it: 5 seeds (one dropped outside random's range), every one
#: favouring mismatch, p 0.0625 (the smallest 5 seeds allow), inconclusive: not shown to differ, nor shown equal.
MATCHED_5_SEEDS = row("matched_selection", "mismatch", "random", "inconclusive", mean=-0.00049, p_adj=0.062,
                      family="primary 3: matched_selection:mismatch:random@pooled", n=5,
                      note="5 paired seeds < 6: no interval, too few for a claim; pooled over budgets 0.1, 0.5; "
                           "1 seed(s) dropped, missing at budget 0.5: outside random's effective-budget range")
RAW_MISMATCH = row("selection", "mismatch", "random", "differs", mean=-0.0038, p_adj=0.031,
                   family="primary 2: selection:mismatch:random@pooled")


def test_replay_that_differs_changes_the_outcome_and_cites_its_row():
    found = answers(REPLAY)["replay"]
    assert found.finding == "changes" and found.sentence == "full replay lowers it"
    (cited,) = found.evidence
    assert cited.text() == "replay full-none: -0.0066 [-0.0073, -0.0059], p_adj 0.031, primary 1"


def test_the_issues_five_seed_matched_row_is_not_read_as_budget_not_which():
    found = answers(REPLAY, row("budget", "random", "none", "inconclusive", p_adj=0.3), RAW_MISMATCH, MATCHED_5_SEEDS,
                    margin=0.001)["mismatch"]
    # Raw, mismatch beats random; at a matched effective budget nothing is shown either way, so how many routes
    # it changes and which are not told apart: no "budget", no "not which".
    assert found.finding == "not determined"
    assert "not which" not in found.sentence and "budget" not in found.finding
    assert found.sentence.startswith("it lowers it more than random at the same budget, by how many routes it "
                                     "changes or by which: not told apart; ")
    # The five seeds are reconciled with the sweep's six: one dropped, and why.
    assert ("the matched row's 5 paired seeds (1 seed(s) dropped, missing at budget 0.5: outside random's "
            "effective-budget range) are too few for any claim") in found.sentence
    assert [cited.effect for cited in found.evidence] == ["selection", "matched_selection", "budget"]
    assert [cited.family for cited in found.evidence] == ["primary 2", "primary 3", "exploratory pooled"]
    # "(no interval)" says why: too few seeds, not a family too large to reject.
    assert found.evidence[1].text() == ("matched mismatch-random pooled: -0.00049 no interval (5 seeds < 6), "
                                        "p_adj 0.062, primary 3")
    assert found.evidence[2].text().endswith("[-inf, inf], p_adj 0.3, exploratory pooled")


#: The claims of the budget row B, the raw row R and the matched row M, the answer they support, and words it
#: must say. Every answer appears with the rows that support it and, beside it, one claim short of that.
WITHIN, OPEN, DIFFERS = "within ±0.001", "inconclusive", "differs"
ANSWERS = [
    ((DIFFERS, OPEN, DIFFERS), "both", "how many routes are replayed changes it (random - none), and it lowers it "
                                       "by which routes it picks"),
    ((WITHIN, OPEN, DIFFERS), "selection", "how many routes random replays leaves it within ±0.001 of none"),
    ((OPEN, OPEN, DIFFERS), "selection at least", "whether how many routes are replayed matters too is not "
                                                  "determined: the budget row's 6 paired seeds do not settle it"),
    ((OPEN, DIFFERS, WITHIN), "budget", "it lowers it more than random at the same budget by how many routes it "
                                        "changes, not which (within ±0.001 of random at the same share"),
    ((DIFFERS, OPEN, WITHIN), "budget", "which routes it picks does not (within ±0.001 of random"),
    ((DIFFERS, OPEN, OPEN), "budget at least", "whether which routes it picks adds to that is not determined: the "
                                               "matched row's 6 paired seeds do not settle it"),
    ((OPEN, DIFFERS, OPEN), "not determined", "by how many routes it changes or by which: not told apart"),
    ((WITHIN, WITHIN, WITHIN), "neither", "within the margin of none by budget, and of random by selection"),
    ((OPEN, WITHIN, WITHIN), "no selection effect", "whether how many does is not determined: the budget row's"),
    ((WITHIN, OPEN, WITHIN), "no selection effect", "whether how many does is not determined: the raw row's"),
    ((OPEN, OPEN, WITHIN), "no selection effect", "whether how many does is not determined: the budget row's"),
    ((OPEN, OPEN, OPEN), "not determined", "the matched row's 6 paired seeds do not settle it"),
]


def policy_rows(claims):
    """The budget, raw and matched rows of fisher with these claims (a claim of a difference: -0.002)."""
    questions = [("budget", "random", "none"), ("selection", "fisher", "random"),
                 ("matched_selection", "fisher", "random")]
    return [row(*question, claim, mean=-0.002 if claim == DIFFERS else -1e-4)
            for question, claim in zip(questions, claims)]


@pytest.mark.parametrize(("claims", "finding", "words"), ANSWERS)
def test_each_answer_is_given_exactly_where_its_rows_support_it(claims, finding, words):
    found = answers(*policy_rows(claims), margin=0.001)["fisher"]
    assert (found.finding, words in found.sentence) == (finding, True), found.sentence
    # Every claim the answer makes stands on a row it cites.
    cited = {cited.effect: cited.claim for cited in found.evidence}
    shown = {"selection": ("matched_selection", DIFFERS), "both": ("budget", DIFFERS),
             "neither": ("matched_selection", WITHIN), "no selection effect": ("matched_selection", WITHIN)}
    if finding in shown:
        effect, claim = shown[finding]
        assert cited[effect] == claim
    if finding == "budget":
        assert cited["matched_selection"] == WITHIN and DIFFERS in (cited.get("selection"), cited.get("budget"))


@pytest.mark.parametrize(("claims", "finding", "words"), ANSWERS)
def test_one_claim_less_and_the_answer_is_no_longer_given(claims, finding, words):
    # Weaken each shown claim in turn to "inconclusive": the answer the rows no longer support is not given.
    supported = {tuple(c): f for c, f, _ in ANSWERS}
    for position, claim in enumerate(claims):
        if claim == OPEN:
            continue
        weaker = tuple(OPEN if i == position else c for i, c in enumerate(claims))
        found = answers(*policy_rows(weaker), margin=0.001)["fisher"]
        assert found.finding != finding or supported.get(weaker) == finding, (claims, weaker, found.sentence)


@pytest.mark.parametrize("budget_claim, expected", [("differs", "both"), ("within ±0.001", "selection"),
                                                    ("inconclusive", "selection at least")])
def test_selection_is_claimed_only_from_the_matched_row(budget_claim, expected):
    rows = [row("budget", "random", "none", budget_claim),
            row("selection", "fisher", "random", "inconclusive"),
            row("matched_selection", "fisher", "random", "differs", mean=-0.002, p_adj=0.01)]
    assert answers(*rows, margin=0.001)["fisher"].finding == expected
    # The raw row alone, however strong, never makes a selection claim.
    raw_only = [rows[0], row("selection", "fisher", "random", "differs", p_adj=0.01),
                row("matched_selection", "fisher", "random", "inconclusive")]
    assert "selection" not in answers(*raw_only, margin=0.001)["fisher"].finding


def test_no_effect_only_where_the_equivalence_test_shows_it():
    within = [row("budget", "random", "none", "within ±0.001", mean=1e-4, p_adj=0.9),
              row("selection", "uniform", "random", "within ±0.001", mean=1e-4, p_adj=0.9),
              row("matched_selection", "uniform", "random", "within ±0.001", mean=1e-4, p_adj=0.9)]
    found = answers(*within, margin=0.001)
    assert found["random"].finding == "no effect" and "within ±0.001 (shown equivalent)" in found["random"].sentence
    assert found["uniform"].finding == "neither"
    # A large p is no evidence of no effect: without the equivalence claim, not determined.
    vague = [row(*r[:3], "inconclusive", mean=1e-4, p_adj=1.0) for r in within]
    found = answers(*vague)
    assert found["random"].finding == found["uniform"].finding == "not determined"
    assert found["uniform"].sentence.endswith("not shown equivalent: no margin")


def test_undetermined_names_the_seeds_the_plan_gives_for_the_open_row():
    rows = [row("budget", "random", "none", "differs", p_adj=0.01),
            row("selection", "fisher", "random", "inconclusive"),
            row("matched_selection", "fisher", "random", "inconclusive", mean=-0.0003)]
    plan = pd.DataFrame({"seeds_for_observed": [6.0, 40.0, 14.0]})
    found = answers(*rows, margin=0.001, plan=plan)["fisher"]
    assert found.finding == "budget at least"
    # The open question is the matched row (does the choice add?): its 14 seeds, not the raw row's 40, planned
    # from the effect it observed.
    assert "how many routes are replayed changes it (random - none)" in found.sentence
    assert ("about 14 would show a difference with 80% power if the true effect is the observed -0.0003"
            in found.sentence)
    plan = pd.DataFrame({"seeds_for_detect": [6.0, 9.0, math.nan], "detect": [0.002] * 3})
    found = answers(*rows, margin=0.001, plan=plan)["fisher"]
    assert "no seed count up to 64 detects an effect of +0.002 with 80% power" in found.sentence


def test_a_question_whose_arms_have_no_cells_yet_is_said_to_be_not_yet_answerable():
    # A sweep stopped after none, full and random: replay and the budget are asked; the selection questions its
    # sweep file declares have no rows at all.
    primary = ("replay", "selection:mismatch:random@pooled", "matched_selection:mismatch:random@pooled",
               "selection:fisher:random@pooled")
    found = answers(REPLAY, row("budget", "random", "none", "inconclusive"), primary=primary)
    assert found["replay"].finding == "changes" and found["random"].finding == "not determined"
    assert found["mismatch"].finding == found["fisher"].finding == "no cells yet"
    assert found["mismatch"].sentence == ("primary question 2 (selection:mismatch:random@pooled) needs cells of "
                                          "mismatch and random at one budget")
    assert not found["fisher"].evidence
    empty = read_verdict({"kl_k3_mean": table(primary=primary)})
    assert [answer.subject for answer in empty] == ["replay", "random", "mismatch", "fisher"]
    assert {answer.finding for answer in empty} == {"no cells yet"}


def test_a_primary_row_is_read_first_then_the_pooled_row_then_the_best_budget():
    per_budget = row("selection", "fisher", "random", "inconclusive", budget=0.1, pooled=False, p_adj=0.6,
                     family="exploratory per-budget")
    pooled = row("selection", "fisher", "random", "inconclusive", p_adj=0.7)
    primary = row("selection", "fisher", "random", "differs", budget=0.5, pooled=False, p_adj=0.03,
                  family="primary 2: selection:fisher:random@0.5")
    matched = row("matched_selection", "fisher", "random", "inconclusive")
    assert answers(per_budget, pooled, primary, matched)["fisher"].evidence[0].where == "b=0.5"
    assert answers(per_budget, pooled, matched)["fisher"].evidence[0].where == "pooled"
    other = row("selection", "fisher", "random", "inconclusive", budget=0.5, pooled=False, p_adj=0.4,
                family="exploratory per-budget")
    assert answers(per_budget, other, matched)["fisher"].evidence[0].where == "b=0.5"


def test_render_fits_the_width_and_heads_each_outcome_with_its_margin():
    effects = table(REPLAY, row("selection", "a_policy_with_a_long_name", "random", "inconclusive"),
                    row("matched_selection", "a_policy_with_a_long_name", "random", "inconclusive"))
    lines = render(read_verdict({"kl_k3_mean": effects}), {"kl_k3_mean": None}, width=60)
    assert lines[0] == "kl_k3_mean (lower is better; no margin declared)"
    assert max(map(len, lines)) <= 60
    contexts = table(REPLAY, [*REPLAY[:5], 0.01, *REPLAY[6:]], keys=())
    contexts.insert(0, "backend.router_noise", [0.07, 0.0])  # rows as a store lists them: not in order
    contexts.attrs["by"] = ["backend.router_noise"]
    lines = render(read_verdict({"final_reward": contexts}), {"final_reward": 0.05})
    headings = [line for line in lines if line.startswith("final_reward at ")]
    assert headings == [f"final_reward at backend.router_noise={noise} (higher is better; margin ±0.05)"
                        for noise in (0.0, 0.07)]  # in the order of the values, as the figures' panels
    # Answered in two contexts: counted across them first, before the answers of each.
    replay = [line for line in lines if line.startswith("  replay: ")]
    assert lines[0] == "final_reward across the 2 values of backend.router_noise (each answered below)"
    assert lines[1] == "  replay: " + ", ".join(
        f"{finding} in {n}" for finding, n in Counter(line.split(": ")[1].split(" - ")[0] for line in replay[1:]).most_common()
    ) + " (of 2)"
    assert not render(read_verdict({"final_reward": table(REPLAY)}), {"final_reward": 0.05})[0].startswith(
        "final_reward across")  # one context: nothing to count


EVIDENCE = re.compile(r"^\s+(replay|budget|selection|matched) (\S+)-(\w+)(?: (pooled|b=\S+))?: (\S+) .*, "
                      r"p_adj (\S+), (.+)$")


def traced_rows(printed: str, outcome: str, effects: pd.DataFrame) -> int:
    """Every evidence line of ``outcome``'s verdict matches one row of its effects file; returns how many."""
    section = printed.split("## verdict")[1].split("\n## ")[0]
    block = section.split(f"\n{outcome} (")[1].split("\n\n")[0]
    found = 0
    for line in block.splitlines():
        match = EVIDENCE.match(line)
        if not match:
            continue
        kind, policy, baseline, where, mean, p_adj, family = match.groups()
        kind = "matched_selection" if kind == "matched" else kind
        rows = effects[(effects["effect"] == kind) & (effects["policy"] == policy)
                       & (effects["baseline"] == baseline)]
        if where == "pooled":
            rows = rows[rows["pooled"]]
        elif where:
            rows = rows[(~rows["pooled"]) & (rows["budget"] == float(where[2:]))]
        assert len(rows) == 1, line
        cited = rows.iloc[0]
        assert float(mean) == pytest.approx(cited["mean"], rel=0.05, abs=1e-12), line
        assert float(p_adj) == pytest.approx(cited["p_adj"], rel=0.05), line
        assert cited["family"].startswith(family), line
        found += 1
    return found


def test_the_command_prints_the_verdict_first_and_every_line_traces_to_a_row(tmp_path, capsys, monkeypatch):
    from ablate.analysis.cli import main
    from tests.test_analysis_store import BUDGETS, write_cell

    sweep_dir = tmp_path / "runs" / "toy"
    for seed in range(6):
        for policy, budget in [("none", 0.0), ("full", 1.0)] + [(p, b) for b in BUDGETS for p in ("random", "fisher")]:
            write_cell(sweep_dir, policy, budget, seed)
    monkeypatch.setenv("COLUMNS", "100")
    assert main([str(sweep_dir), "--out", str(tmp_path / "out"), "--reps", "100", "--no-plots",
                 "--primary", "replay", "--primary", "selection:fisher:random@pooled"]) == 0
    printed = capsys.readouterr().out
    # No --outcome and none declared: the mismatch and the reward, the verdict before any table.
    assert printed.index("## verdict") < printed.index("| ")
    assert "\nkl_k3_mean (lower is better; no margin declared)" in printed
    assert "\nfinal_reward (higher is better; no margin declared)" in printed
    for outcome in ("kl_k3_mean", "final_reward"):
        effects = pd.read_csv(tmp_path / "out" / f"effects_{outcome}.csv")
        assert traced_rows(printed, outcome, effects) >= 3
    wide = [line for line in printed.splitlines() if len(line) > 100 and str(tmp_path) not in line]
    assert not wide  # only a line naming a long path may be wider


@pytest.mark.slow
def test_the_verdict_of_a_real_smoke_sweep_reads_its_declared_outcomes_and_traces_to_its_rows(tmp_path):
    import os
    import subprocess
    import sys

    from synthetic_configs import TINY

    shrink = [o for o in TINY if not o.startswith("backend.steps")]
    sweep = subprocess.run([sys.executable, "-m", "ablate", "sweeps=smoke", "policy=none,full,random,mismatch",
                            "budget=0.5", "seed=range(6)", "backend.steps=8", *shrink, "tracking.mode=disabled"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    done = subprocess.run([sys.executable, "-m", "ablate.analysis", "runs/smoke", "--reps", "100", "--no-plots"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "100"})
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout
    # smoke.yaml declares the outcomes and their margins; its first primary question is replay.
    assert "\nkl_k3_mean (lower is better; margin ±0.001)" in printed
    assert "\nfinal_reward (higher is better; margin ±0.05)" in printed
    assert "replay full-none: " in printed and ", primary 1\n" in printed
    assert "\n  mismatch: " in printed
    for outcome in ("kl_k3_mean", "final_reward"):
        effects = pd.read_csv(tmp_path / "runs/smoke/analysis" / f"effects_{outcome}.csv")
        assert traced_rows(printed, outcome, effects) >= 4  # replay, budget, mismatch raw and matched
    assert max(len(line) for line in printed.splitlines()) <= 100


def test_a_stopped_sweep_says_which_questions_it_can_already_answer(tmp_path, capsys, monkeypatch):
    from ablate.analysis.cli import main
    from tests.test_analysis_store import write_cell

    declared = {"outcomes": ["kl_k3_mean"], "margins": {"kl_k3_mean": 0.001},
                "primary": ["replay", "selection:mismatch:random@pooled", "selection:fisher:random@pooled"]}
    sweep_dir = tmp_path / "runs" / "smoke"
    for seed in range(6):  # stopped after none, full and random: no cell of mismatch or fisher yet
        for policy, budget in [("none", 0.0), ("full", 1.0), ("random", 0.25), ("random", 0.5)]:
            write_cell(sweep_dir, policy, budget, seed, analysis=declared)
    monkeypatch.setenv("COLUMNS", "100")
    assert main([str(sweep_dir), "--out", str(tmp_path / "out"), "--reps", "50", "--no-plots"]) == 0
    printed = capsys.readouterr().out
    verdict = printed.split("## verdict")[1].split("\n## ")[0]
    assert "\n  replay: " in verdict and "\n  random: " in verdict  # answered, whatever the answer
    words = " ".join(verdict.split())  # the lines as one text, whatever their wrapping
    assert ("mismatch: no cells yet - primary question 2 (selection:mismatch:random@pooled) needs cells of "
            "mismatch and random at one budget") in words
    assert "\n  fisher: no cells yet - primary question 3" in verdict


def test_a_store_without_a_pair_of_arms_prints_no_legend_without_a_table(tmp_path, capsys, monkeypatch):
    from ablate.analysis.cli import main
    from tests.test_analysis_store import write_cell

    sweep_dir = tmp_path / "runs" / "toy"
    for seed in range(3):
        write_cell(sweep_dir, "fisher", 0.5, seed)  # one arm: nothing to pair it with
    monkeypatch.setenv("COLUMNS", "100")
    assert main([str(sweep_dir), "--out", str(tmp_path / "out"), "--reps", "50", "--no-plots",
                 "--outcome", "kl_k3_mean"]) == 0
    printed = capsys.readouterr().out
    effects = printed.split("## effects on kl_k3_mean (paired by seed)")[1].split("\n## ")[0]
    assert effects.strip().startswith("no effect rows: replay needs cells of none and full")
    assert "ci_adj_low" not in effects and "| " not in effects  # no legend, no table
    verdict = printed.split("## verdict")[1].split("\n## ")[0]
    assert "replay: no cells yet" in verdict and "notes on the answers" not in verdict
