"""Plots: one colour per policy in every sweep, panels per context, every figure written."""

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("matplotlib")

from ablate.analysis import plots  # noqa: E402
from ablate.analysis.tables import effects, summarize  # noqa: E402


def test_a_policy_has_one_colour_whatever_else_the_sweep_holds():
    builtin = ["none", "full", "random", "uniform", "fisher", "mismatch"]
    colours = [plots.policy_color(p) for p in builtin]
    assert len(set(colours)) == len(builtin)
    assert plots.policy_color("fisher[tau=1.0]") == plots.policy_color("fisher")
    # A user's policy gets the same colour in every sweep (a hash of its name, not its position).
    assert plots.policy_color("my_policy") == plots.policy_color("my_policy") in plots.OTHER_COLORS
    assert plots.policy_style("fisher", ["fisher", "fisher[tau=1.0]"]) == "-"
    assert plots.policy_style("fisher[tau=1.0]", ["fisher", "fisher[tau=1.0]"]) != "-"


def _cells(rng, n_seeds=6):
    rows = []
    for noise in (0.0, 0.07):
        for seed in range(n_seeds):
            m = 0.02 + noise
            arms = [("none", 0.0, 0.0), ("full", 1.0, m)]
            arms += [(p, b, b * m if p != "mismatch" else min(b, m)) for p in ("random", "fisher", "mismatch")
                     for b in (0.1, 0.5)]
            for policy, budget, e in arms:
                rows.append({"policy": policy, "budget": budget, "seed": seed, "backend.router_noise": noise,
                             "effective_budget_mean": e, "kl_k3_mean": 0.01 - 0.05 * e + rng.normal(scale=1e-4)})
    frame = pd.DataFrame(rows)
    frame.attrs["config_keys"] = ["backend.router_noise"]
    return frame


def test_every_figure_is_written_with_a_panel_per_context(tmp_path):
    cells = _cells(np.random.default_rng(0))
    table = summarize(cells, "kl_k3_mean", reps=200)
    fx = effects(cells, "kl_k3_mean", reps=200, others_vs_random=True)
    steps = cells.loc[cells.index.repeat(3)].assign(step=np.tile([0, 1, 2], len(cells)))
    steps["mismatch/kl_k3"] = steps["kl_k3_mean"]
    written = [
        *plots.plot_budget_response(table, tmp_path / "budget"),
        *plots.plot_selection_effects(fx, tmp_path / "selection"),
        *plots.plot_effective_budget(cells, tmp_path / "effective", outcome="kl_k3_mean", by=["backend.router_noise"]),
        *plots.plot_step_curves(steps, tmp_path / "steps", by=["backend.router_noise"]),
    ]
    assert [p.suffix for p in written] == [".png", ".svg"] * 4
    for path in written:
        assert path.stat().st_size > 1000
    svg = (tmp_path / "effective.svg").read_text()
    assert "backend.router_noise=0.07" in svg and "backend.router_noise=0.0" in svg  # one panel per value
    assert plots.policy_color("mismatch").lower() in svg.lower()
    with pytest.raises(KeyError, match="effective_budget_mean"):
        plots.plot_effective_budget(cells.drop(columns="effective_budget_mean"), tmp_path / "x", outcome="kl_k3_mean")


def test_a_policy_declares_its_look_and_one_that_does_not_gets_one_from_its_name(monkeypatch):
    from ablate.policies import FisherReplay, base, policy_look, register_policy

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # the policies below stay in this test

    @register_policy("looks_declared")
    class Declared(FisherReplay):
        color = "#123456"
        marker = "p"

    @register_policy("looks_inherited")
    class Inherited(FisherReplay):
        """Declares nothing: fisher's vermillion is not its own."""

    assert plots.policy_color("looks_declared") == "#123456" and plots.policy_marker("looks_declared") == "p"
    assert plots.policy_color("looks_declared[tau=1.0]") == "#123456"
    inherited = policy_look("looks_inherited")
    assert not inherited.declared and inherited.color != policy_look("fisher").color
    assert inherited == policy_look("looks_inherited")  # the same in every sweep: from the name only
    assert plots.policy_color("looks_inherited") in plots.OTHER_COLORS
    assert policy_look("not_installed_here").color in plots.OTHER_COLORS


def test_a_sweep_of_many_settings_draws_a_few_spread_from_the_first_to_the_last(tmp_path):
    """38 values of a setting: each figure draws at most MAX_PANELS of them (the step curves
    MAX_STEP_CONTEXTS), the first and the last among them, and its title says so."""
    rows = [{"policy": policy, "budget": budget, "seed": seed, "backend.router_noise": noise / 100, "step": step,
             "train/reward": 0.1 * step + seed, "mismatch/kl_k3": 0.01}
            for noise in range(38) for policy, budget in (("none", 0.0), ("random", 0.5), ("full", 1.0))
            for seed in range(2) for step in range(4)]
    steps = pd.DataFrame(rows)
    assert plots._spread(38, 6) == [0, 7, 15, 22, 30, 37]
    assert plots._spread(5, 6) == [0, 1, 2, 3, 4]
    panels, note = plots._contexts(steps, ["backend.router_noise"], plots.MAX_STEP_CONTEXTS)
    assert [title for title, _ in panels] == ["backend.router_noise=0.0", "backend.router_noise=0.37"]
    assert "2 of 38 values of backend.router_noise" in note
    assert plots._contexts(steps, ["backend.router_noise"], 40)[1] == ""
    paths = plots.plot_step_curves(steps, tmp_path / "steps", by=["backend.router_noise"])
    svg = next(p for p in paths if p.suffix == ".svg").read_text()
    assert "backend.router_noise=0.37" in svg and "backend.router_noise=0.18" not in svg


#: What each figure the analysis writes draws, as its title begins (``{o}``: the outcome).
SUBJECTS = {"budget_response": "{o} vs budget", "selection_effects": "selection effects on {o}",
            "effective_budget": "{o} vs effective budget", "steps": "train/reward and mismatch/kl_k3 per step",
            "collapse_survival": "time to collapse"}
SVG = {"svg": "http://www.w3.org/2000/svg"}


def title_names_what_is_drawn(stem: str, title: str) -> bool:
    """A figure's title is short text that begins with what the figure draws (a table printed into it is not)."""
    kind = next(name for name in SUBJECTS if stem == name or stem.startswith(name + "_"))
    outcome = stem[len(kind) + 1:]
    return title.startswith(SUBJECTS[kind].format(o=outcome)) and len(title) <= 320 and "\n" not in title


def svg_layout(path):
    """(title, the bottom of the title's last line, each axes as (left, top, right, bottom)) of an SVG the
    analysis wrote, in points from its top left corner."""
    import re
    import xml.etree.ElementTree as ElementTree

    root = ElementTree.parse(path).getroot()
    figure = root.find(".//svg:g[@id='figure_1']", SVG)
    boxes, lines = [], []
    for group in figure.findall("svg:g", SVG):
        if group.get("id", "").startswith("axes_"):
            background = group.find("svg:g/svg:path", SVG)  # an axes is drawn from its background patch up
            numbers = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", background.get("d"))]
            boxes.append((min(numbers[0::2]), min(numbers[1::2]), max(numbers[0::2]), max(numbers[1::2])))
        elif group.get("id", "").startswith("text_"):  # the figure's own text: its title, line by line
            for line in group.findall("svg:text", SVG):
                baseline = float(line.get("y") or re.search(r"translate\(\S+ (\S+)\)", line.get("transform")).group(1))
                lines.append((baseline + 0.3 * float(re.search(r"font-size: ([\d.]+)px", line.get("style")).group(1)),
                              line.text or ""))
    return root.find("svg:title", SVG).text, max((bottom for bottom, _ in lines), default=0.0), boxes


def grid(sweep_dir, policies, budgets, seeds, noises=(0.07,)):
    from tests.test_analysis_store import write_cell

    for noise in noises:
        for seed in range(seeds):
            for policy in policies:
                for budget in {"none": [0.0], "full": [1.0]}.get(policy, budgets):
                    write_cell(sweep_dir, policy, budget, seed, backend={"router_noise": noise})


@pytest.mark.parametrize("shape", ["one budget", pytest.param("one policy", marks=pytest.mark.slow),
                                   pytest.param("many contexts", marks=pytest.mark.slow)])
def test_every_figure_of_every_grid_shape_has_room_for_its_axes_and_a_title_naming_it(tmp_path, capsys, shape):
    from PIL import Image

    from ablate.analysis.cli import main

    sweep_dir = tmp_path / "runs" / "toy"
    if shape == "one budget":  # the grid of issue 39: one budget, so the step curves are one panel wide
        grid(sweep_dir, ["none", "full", "random", "mismatch"], [0.25], 6)
    elif shape == "one policy":
        grid(sweep_dir, ["random"], [0.1, 0.5], 3)
    else:  # more values of a setting than a figure draws
        grid(sweep_dir, ["none", "full", "random", "fisher"], [0.5], 2, noises=[0.01 * i for i in range(8)])
    out = tmp_path / "analysis"
    assert main([str(sweep_dir), "--out", str(out), "--reps", "50", "--survival"]) == 0
    printed = capsys.readouterr()
    # No library's warning reaches the console (it was matplotlib's, at 177 characters).
    assert "Warning" not in printed.err and "warning" not in printed.out.lower(), printed.err
    figures = sorted(out.glob("*.svg"))
    assert len(figures) == 8  # three per outcome, the step curves, the collapse curves
    for svg in figures:
        title, title_bottom, boxes = svg_layout(svg)
        assert title_names_what_is_drawn(svg.stem, title), (svg.name, title)
        with Image.open(svg.with_suffix(".png")) as png:
            assert png.text["Title"] == title
        assert boxes, svg.name
        for left, top, right, bottom in boxes:  # every panel at least an inch each way, below the title
            assert right - left >= 72 and bottom - top >= 72 and top >= title_bottom, (svg.name, boxes, title_bottom)
