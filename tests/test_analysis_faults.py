"""The analysis command against a full disk, a folder under a file, many seeds, bad arguments, hostile
names and a dead writer's leftovers: one line each, nothing cut or left behind (through the command line)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from ablate.analysis.load import load_runs
from ablate.analysis.tables import effects
from ablate.cell import cell_id_of
from disks import tmpfs
from tests.test_analysis_store import BUDGETS, write_cell


def analyze(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ablate.analysis", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "100"})


def one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done.stderr.strip()


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    """none, full, random and fisher at two budgets, 6 seeds, written as the runner writes cells."""
    sweep_dir = tmp_path_factory.mktemp("faults") / "runs" / "toy"
    for seed in range(6):
        for policy, budget in [("none", 0.0), ("full", 1.0)] + [(p, b) for b in BUDGETS for p in ("random", "fisher")]:
            write_cell(sweep_dir, policy, budget, seed)
    return sweep_dir


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 1 MiB tmpfs (unmounted after the test)."""
    with tmpfs(tmp_path / "disk", "1m") as mount:
        yield mount


def fill(disk: Path, leave: int) -> None:
    """Fill ``disk`` until ``leave`` bytes are free."""
    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    (disk / f"filler{len(list(disk.iterdir()))}").write_bytes(b"\0" * max(0, free - leave))


def pages(folder: Path) -> int:
    """Bytes the files of ``folder`` take on a tmpfs (whole 4 KiB pages)."""
    return sum(-(-path.stat().st_size // 4096) * 4096 for path in folder.iterdir())


def test_a_disk_that_fills_while_the_report_is_written_leaves_no_cut_report(toy, tmp_path, small_disk):
    # Where the outputs (without the report) take this much room, and the report that much more:
    reference = tmp_path / "reference"
    assert analyze(str(toy), "--out", str(reference), "--reps", "100", "--no-plots", "--report").returncode == 0
    report = (reference / "report.html").stat().st_size
    (reference / "report.html").unlink()
    others = pages(reference)

    # The disk fills while the report is written: one line, and no report.html at all, not a cut one.
    fill(small_disk, others + report // 2)
    out = small_disk / "out"
    error = one_line(analyze(str(toy), "--out", str(out), "--reps", "100", "--no-plots", "--report"))
    assert error.startswith(f"ablate-analyze: {out / 'report.html'}: cannot write (No space left on device)")
    assert not (out / "report.html").exists() and not list(out.glob(".*.tmp"))


@pytest.mark.slow
def test_a_disk_that_fills_while_the_plots_are_drawn_ends_in_one_line_naming_the_plot(toy, small_disk):
    fill(small_disk, 200_000)
    out = small_disk / "out"
    error = one_line(analyze(str(toy), "--out", str(out), "--reps", "100"))
    assert "No space left on device" in error and Path(error.split()[1].rstrip(":")).parent == out
    assert not list(out.glob(".*.tmp"))
    for png in out.glob("*.png"):
        assert png.read_bytes()[-8:] == b"IEND\xaeB`\x82"  # a PNG's last chunk: written whole
    for csv in out.glob("*.csv"):
        pd.read_csv(csv)


def test_an_output_folder_under_a_file_is_one_line_with_and_without_probes(toy, tmp_path):
    from ablate.probes import parse_probes, probe_table

    probed = tmp_path / "probed"
    subprocess.run(["cp", "-a", str(toy), str(probed)], check=True)
    for config in list(probed.glob("*/config.yaml")):
        tree = yaml.safe_load(config.read_text())
        tree["probes"] = probe_table(parse_probes(["none", "full", "random@0.25"]))
        config.write_text(yaml.safe_dump(tree))
        probed_cell(config.parent, cell_id_of(tree))
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for extra in ([], ["--probes"]):
        error = one_line(analyze(str(probed), "--out", str(blocker / "sub"), "--no-plots", "--reps", "50", *extra))
        assert error == (f"ablate-analyze: {blocker / 'sub'}: cannot create the analysis output folder (Not a "
                         "directory); expected a writable directory")


def probed_cell(cell: Path, cell_id: str) -> None:
    """The cell of a config with probes: its id is the new config's hash, and its directory is named by it."""
    identity = json.loads((cell / "cell.json").read_text())
    (cell / "cell.json").write_text(json.dumps({**identity, "cell_id": cell_id}))
    cell.rename(cell.with_name(f"{identity['name']}-{cell_id[:8]}"))


@pytest.mark.slow
def test_a_thousand_and_more_seeds_per_arm_are_analysed(tmp_path):
    sweep_dir = tmp_path / "many"
    for seed in range(1030):
        write_cell(sweep_dir, "none", 0.0, seed)
        write_cell(sweep_dir, "full", 1.0, seed)
    done = analyze(str(sweep_dir), "--no-plots", "--reps", "50", "--plan")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "seeds per arm: 1030" in done.stdout and "replay: changes - full replay lowers it" in done.stdout


def test_the_library_and_the_command_give_the_same_numbers_for_a_declared_sweep(tmp_path):
    block = {"primary": ["replay", "selection:fisher:random@pooled"], "outcomes": ["final_reward"],
             "margins": {"final_reward": 0.05}}
    sweep_dir = tmp_path / "declared"
    for seed in range(6):
        for policy, budget in [("none", 0.0), ("full", 1.0)] + [(p, b) for b in BUDGETS for p in ("random", "fisher")]:
            write_cell(sweep_dir, policy, budget, seed, analysis=block)
    done = analyze(str(sweep_dir), "--no-plots", "--reps", "100")
    assert done.returncode == 0, done.stderr
    assert "## effects on kl_k3_mean" not in done.stdout  # the declared outcomes, not the defaults
    command = pd.read_csv(sweep_dir / "analysis" / "effects_final_reward.csv")
    library = effects(load_runs(sweep_dir), "final_reward", reps=100)
    assert library.loc[library["effect"] == "replay", "family"].item() == "primary 1: replay"
    assert library["margin"].eq(0.05).all()
    for column in ("p_value", "p_adj", "ci_adj_low", "ci_adj_high", "p_equiv_adj"):
        pd.testing.assert_series_equal(command[column], library[column].reset_index(drop=True), check_names=False)
    assert command["family"].tolist() == library["family"].tolist()
    assert command["claim"].fillna("").tolist() == library["claim"].tolist()


@pytest.mark.parametrize("argv, expected", [
    (["--outcome", "final_rewrd"], "argument --outcome: 'final_rewrd' is not an outcome; did you mean final_reward?"),
    (["--seed", "-1"], "argument --seed: -1: expected an integer >= 0"),
    (["--level", "95"], "argument --level: 95: expected a confidence level in (0, 1)"),
    (["--reps", "many"], "argument --reps: 'many': expected an integer >= 1"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_an_argument_error_is_one_line_naming_the_option(toy, argv, expected):
    error = one_line(analyze(str(toy), *argv))
    assert error.startswith(f"ablate-analyze: {expected}"), error


def test_markdown_tables_keep_names_as_text(tmp_path):
    sweep_dir = tmp_path / "hostile"
    for seed in range(2):
        for policy, budget in (("none", 0.0), ("<script>x", 0.5)):
            write_cell(sweep_dir, policy, budget, seed)
    assert analyze(str(sweep_dir), "--no-plots", "--reps", "50").returncode == 0
    for table in (sweep_dir / "analysis").glob("*.md"):
        assert "<script>" not in table.read_text()
    assert "| &lt;script&gt;x | 0.5 |" in (sweep_dir / "analysis" / "table_final_reward.md").read_text()


def test_the_next_run_removes_what_a_dead_writer_left_and_nothing_of_a_live_one(toy, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = out / f".steps.svg.{dead.stdout.strip()}.140000.tmp"  # as SIGTERM mid-plot leaves it
    left.write_text("<svg")
    live = out / f".cells.csv.{os.getpid()}.140000.tmp"  # another analysis writing now
    live.write_text("policy")
    assert analyze(str(toy), "--out", str(out), "--reps", "50", "--no-plots").returncode == 0
    assert not left.exists() and live.exists()


def test_a_sweep_path_that_starts_with_a_dash_gets_how_to_write_it(toy, tmp_path):
    shutil.copytree(toy, tmp_path / "-dash" / "adhoc")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ablate.analysis", "--no-plots", "--reps", "50", *args],
                              capture_output=True, text=True, cwd=tmp_path, timeout=600)

    assert one_line(run("-dash/adhoc")) == (
        "ablate-analyze: the following arguments are required: sweep; -dash/adhoc was read as an option: write a "
        "path that starts with '-' as ./-dash/adhoc, or after -- (ablate-analyze --help lists the options)")
    assert run("./-dash/adhoc").returncode == 0
    assert run("--", "-dash/adhoc").returncode == 0


@pytest.mark.slow
def test_records_near_the_float_limit_print_no_numpy_warning(tmp_path):
    """Their sums overflow: the outcomes are infinite, and neither the sweep nor the analysis warns on the console."""
    sweep = subprocess.run([sys.executable, "-m", "ablate", "-m", "backend=noop", "backend.reward=1.7e308",
                            "backend.steps=5", "policy=none,full,random", "budget=0.5", "seed=range(6)",
                            "tracking.mode=disabled", "sweep=huge"], capture_output=True, text=True, cwd=tmp_path,
                           timeout=600)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    analysed = analyze(str(tmp_path / "runs" / "huge"), "--no-plots", "--reps", "50")
    assert analysed.returncode == 0, analysed.stderr[-3000:]
    for output in (sweep.stdout + sweep.stderr, analysed.stdout + analysed.stderr):
        assert "RuntimeWarning" not in output and "overflow" not in output, output[-3000:]
