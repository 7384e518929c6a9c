"""Planning, resume and the tally of a grid, in process: no launcher, no subprocess multirun.

The composer is Hydra's compose API on the package's configs (``synthetic_configs.compose_config``); the
run store is real, filled by ``run_cell`` on the noop backend or written directly where a test
needs a state that only a crash produces.
"""

import io
import itertools
import json
import re
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
from synthetic_configs import compose_config
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import create_config_search_path
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from ablate.compose import cell_from_config
from ablate.config import ConfigError
from ablate.runner import run_cell
from ablate.store import CellState, read_json
from ablate.sweep import (
    ProgressReporter,
    outcome,
    tracked,
    describe_plan,
    plan_grid,
    progress_line,
    tally,
    wait_for_others,
)
from hydra_plugins.ablate_grid_sweeper.grid_sweeper import JobComposer

NOOP = ["backend=noop", "backend.steps=2", "tracking.mode=disabled"]


def composer(store):
    return lambda overrides: compose_config(*NOOP, *overrides, store=store, tiny=False)


def grid(**axes):
    """Hydra's grid order: the product of the axes, as ``key=value`` overrides."""
    keys = list(axes)
    return [[f"{k}={v}" for k, v in zip(keys, values)] for values in itertools.product(*axes.values())]


def current_counts(planned):
    """How many of the cells a sweep launches or waits for are in each outcome state."""
    return Counter(outcome(cell)[0] for cell in tracked(planned))


def by_name(planned):
    return {p.cell.name: p for p in planned}


def test_none_and_full_collapse_to_one_cell_per_seed_and_every_cell_is_new(tmp_path):
    planned = plan_grid(grid(policy=["none", "full", "random"], budget=[0.1, 0.5], seed=[0, 1]), composer(tmp_path))
    assert sorted(by_name(planned)) == sorted(
        ["none-s0", "none-s1", "full-s0", "full-s1"] + [f"random-b{b}-s{s}" for b in (0.1, 0.5) for s in (0, 1)])
    assert by_name(planned)["none-s0"].overrides[-1] == "budget=null"
    assert all(p.prior.state is CellState.NEW and p.to_launch for p in planned)
    assert describe_plan("g", planned) == (
        "sweep g: 8 cells: 0 complete (skipped), 0 failed (rerun), 0 unfinished (rerun), 8 new")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # planning writes nothing


def test_the_plan_is_seed_major_every_arm_of_a_seed_before_the_next_seed(tmp_path):
    """Hydra's grid runs one policy after another; the plan runs seed by seed, the seeds in the order the grid
    names them and each seed's arms in grid order, so every prefix of a sweep holds whole seeds of every arm."""
    planned = plan_grid(grid(policy=["none", "random", "fisher"], budget=[0.1, 0.5], seed=[2, 0]), composer(tmp_path))
    arms = ["none", "random-b0.1", "random-b0.5", "fisher-b0.1", "fisher-b0.5"]
    assert [p.cell.name for p in planned] == [f"{arm}-s{seed}" for seed in (2, 0) for arm in arms]


def test_a_bad_value_in_one_job_fails_the_plan_and_names_the_job(tmp_path):
    jobs = grid(policy=["random"], budget=[0.1], seed=[0]) + [["policy=fisher", "budget=0.1", "policy.fisher.decay=1.5"]]
    with pytest.raises(ConfigError, match=r"policy.fisher.decay=1.5: .* \(in the sweep job policy=fisher budget=0.1 "):
        plan_grid(jobs, composer(tmp_path))


def hold_with_a_live_process(cell_dir):
    """A child process that claims ``cell_dir`` and sleeps until killed."""
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from ablate.store import claim
        claim(Path({str(cell_dir)!r}))
        print("held", flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def set_status(cell_dir, status):
    data = read_json(cell_dir / "status.json")
    (cell_dir / "status.json").write_text(json.dumps({**data, "status": status}))


def test_the_plan_reads_every_state_of_the_store(tmp_path):
    jobs = grid(policy=["random"], budget=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], seed=[0])
    compose = composer(tmp_path)
    first = by_name(plan_grid(jobs, compose))
    for name in first:
        run_cell(compose(first[name].overrides))
    set_status(first["random-b0.2-s0"].directory, "failed")
    set_status(first["random-b0.3-s0"].directory, "interrupted")
    set_status(first["random-b0.4-s0"].directory, "running")  # its worker died: no claim
    (first["random-b0.5-s0"].directory / "cell.json").write_text("{not json")
    set_status(first["random-b0.6-s0"].directory, "running")
    holder = hold_with_a_live_process(first["random-b0.6-s0"].directory)
    try:
        planned = by_name(plan_grid(jobs, compose))
    finally:
        holder.kill()
        holder.wait()
    states = {name: p.prior.state for name, p in planned.items()}
    assert states == {"random-b0.1-s0": CellState.COMPLETE, "random-b0.2-s0": CellState.FAILED,
                      "random-b0.3-s0": CellState.INTERRUPTED, "random-b0.4-s0": CellState.UNFINISHED,
                      "random-b0.5-s0": CellState.CORRUPT, "random-b0.6-s0": CellState.RUNNING}
    assert {n for n, p in planned.items() if p.to_launch} == {f"random-b{b}-s0" for b in (0.2, 0.3, 0.4, 0.5)}
    assert planned["random-b0.6-s0"].waited_for and not planned["random-b0.6-s0"].to_launch
    assert describe_plan("g", list(planned.values())) == (
        "sweep g: 6 cells: 1 complete (skipped), 1 failed (rerun), 1 interrupted (rerun), 1 unfinished (rerun), "
        "0 new, 1 damaged (rerun), 1 running elsewhere (waited for)")


def test_the_tally_counts_only_what_the_store_holds(tmp_path):
    """Issue 14, defect 1: a cell the launcher did not run is never counted as done."""
    compose = composer(tmp_path)
    jobs = grid(policy=["random"], budget=[0.1, 0.2, 0.3], seed=[0, 1])
    done_before = by_name(plan_grid(jobs[:1], compose))["random-b0.1-s0"]
    run_cell(compose(done_before.overrides))
    planned = by_name(plan_grid(jobs, compose))
    for name, cell in planned.items():
        if name in ("random-b0.2-s0", "random-b0.2-s1"):
            run_cell(compose(cell.overrides))
    failing = compose([*planned["random-b0.3-s1"].overrides, "backend.fail_seeds=[1]", "backend.fail_at_step=1"])
    with pytest.raises(RuntimeError):
        run_cell(failing)  # another config: its own directory, not counted for this grid
    counts = current_counts(list(planned.values()))
    assert counts == Counter({CellState.NEW: 3, CellState.COMPLETE: 2})
    result = tally(list(planned.values()))
    assert result.counts == Counter({CellState.COMPLETE: 2, CellState.NEW: 3}) and result.skipped == 1
    assert result.line("g", 5.0, tmp_path).startswith("sweep g: 2 complete, 0 failed, 3 not run, 1 skipped in 0:05")
    assert not result.ok and all(p.startswith("not run: random-b") for p in result.problems)
    # A stopped sweep leaves most of its cells not run: one line counts them, naming the first few.
    assert result.report("g", 5.0, tmp_path)[1:] == [
        f"  not run: 3 cells ({', '.join(result.not_run)}); a rerun of the sweep runs them"]
    assert len(result.not_run) == 3 and not tally(list(planned.values())).report("g", 5.0, tmp_path, most=0)[2:]


def test_off_a_terminal_progress_is_a_line_per_tenth_of_the_cells_and_a_failure_at_once(tmp_path):
    compose = composer(tmp_path)
    planned = plan_grid(grid(policy=["random"], budget=[0.1, 0.2, 0.3, 0.4, 0.5], seed=[0, 1, 2, 3]), compose)
    log = io.StringIO()  # a log file: no bar, lines
    reporter = ProgressReporter("g", planned, stream=log)
    reporter.report()
    for index, cell in enumerate(planned):
        run_cell(compose(cell.overrides))
        if index == 4:
            set_status(cell.directory, "failed")
        reporter.report()
    counts = [tuple(int(re.search(rf"(\d+) {word}", line).group(1)) for word in ("done", "failed"))
              for line in log.getvalue().splitlines()]
    # The start, then a line each time two more of the 20 cells have ended (not two lines a cell), and
    # the failure of the fifth cell at once.
    assert counts == [(0, 0), (2, 0), (4, 0), (4, 1), (5, 1), *((n - 1, 1) for n in range(8, 21, 2))]
    reporter.report(final=True)  # the end says the counts once more only if they changed
    assert len(log.getvalue().splitlines()) == len(counts)


def test_a_failed_rerun_is_failed_and_an_old_failure_is_only_left(tmp_path):
    compose = composer(tmp_path)
    jobs = [["policy=random", "budget=0.1", "seed=1", "backend.fail_seeds=[1]", "backend.fail_at_step=1"]]
    with pytest.raises(RuntimeError):
        run_cell(compose(jobs[0]))
    (planned,) = plan_grid(jobs, compose)
    assert planned.prior.state is CellState.FAILED and current_counts([planned]) == Counter({CellState.NEW: 1})
    with pytest.raises(RuntimeError):
        run_cell(compose(jobs[0]))
    assert current_counts([planned]) == Counter({CellState.FAILED: 1})
    result = tally([planned])
    assert result.counts == Counter({CellState.FAILED: 1})
    assert "PlannedFailure: noop backend: seed 1 is in fail_seeds=[1]" in result.problems[0]


def test_a_cell_running_elsewhere_is_waited_for_and_counted_by_its_result(tmp_path):
    """Issue 14, defect 3: a cell held by a live claim is neither failed nor skipped."""
    compose = composer(tmp_path)
    job = ["policy=random", "budget=0.1", "seed=0", "backend.steps=20", "backend.step_seconds=0.1"]
    store = tmp_path
    other = subprocess.Popen([sys.executable, "-m", "ablate", *NOOP, *job[:3], *job[3:], f"store_dir={store}"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        cell_dir = None
        while cell_dir is None or not (cell_dir / "records.jsonl").exists():
            cell_dir = next(iter((store / "adhoc").glob("random-*")), None) if (store / "adhoc").exists() else None
        (planned,) = plan_grid([job], compose)
        assert planned.prior.state is CellState.RUNNING
        assert current_counts([planned]) == Counter({CellState.RUNNING: 1})
        wait_for_others([planned], interval=0.1)
    finally:
        other.wait(timeout=300)
    result = tally([planned])
    assert result.ok and result.counts == Counter({CellState.COMPLETE: 1})
    assert read_json(planned.directory / "status.json")["attempt"] == 1  # it ran once, elsewhere


def test_progress_lines_give_elapsed_time_rate_and_eta():
    counts = Counter({CellState.COMPLETE: 6, CellState.FAILED: 1, CellState.RUNNING: 2, CellState.NEW: 12})
    assert progress_line("s", counts, 70.0) == (
        "sweep s: 6 done, 2 running, 1 failed, 12 left [1:10 elapsed, 10.0 s/cell, ETA 2:20]")
    assert progress_line("s", Counter({CellState.NEW: 3, CellState.INTERRUPTED: 1}), 5.0) == (
        "sweep s: 0 done, 0 running, 0 failed, 1 interrupted, 3 left [0:05 elapsed, 5.0 s/cell, ETA 0:15]")


# --- the fast composer against Hydra's own composition ---------------------------------------


def sweep_jobs(sweep: str):
    """Hydra's loader, the sweep file's master config and every job of its grids, as the sweeper expands them."""
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path("pkg://ablate.conf"))
    master = loader.load_configuration("config", overrides=[f"sweeps={sweep}"], run_mode=RunMode.MULTIRUN)
    params = {str(k): str(v) for k, v in master.hydra.sweeper.params.items()}
    parser = OverridesParser.create(config_loader=loader)
    jobs = []
    for extra in master.hydra.sweeper.get("grids") or [{}]:
        merged = {**params, **{str(k): str(v) for k, v in extra.items()}}
        parsed = {k: parser.parse_override(f"{k}={v}") for k, v in merged.items()}
        axes = {k: [str(v) for v in o.sweep_string_iterator()] if o.is_sweep_override() else [merged[k]]
                for k, o in parsed.items()}
        jobs += [[f"sweeps={sweep}", *job, "store_dir=/store"] for job in grid(**axes)]
    return loader, master, jobs


@pytest.mark.parametrize("sweep", ["budget_selection", "fisher_estimator"])
def test_the_job_composer_gives_what_hydra_composes(sweep):
    loader, master, jobs = sweep_jobs(sweep)
    jobs += [[f"sweeps={sweep}", "policy=none", "budget=null", "seed=0", "+extra=1"],
             [f"sweeps={sweep}", "policy=fisher", "budget=0.1", "~objective", "tracking.tags=[a,b]"]]
    fast = JobComposer(master, loader)
    for job in jobs[:: max(1, len(jobs) // 10)] + jobs[-2:]:
        expected = loader.load_sweep_config(master, job)
        with open_dict(expected):
            del expected["hydra"]
        assert OmegaConf.to_container(fast(job)) == OmegaConf.to_container(expected), job


@pytest.mark.parametrize("sweep", ["budget_selection", "fisher_estimator", "per_layer", "probes", "variants"])
def test_a_cell_planned_from_its_template_is_the_cell_of_its_composed_config(sweep):
    """The sweeper plans most jobs without composing them (CellTemplate): the cells must be the same."""
    from ablate.compose import cell_from_config

    loader, master, jobs = sweep_jobs(sweep)
    jobs = jobs[:: max(1, len(jobs) // 12)]
    jobs += [[f"sweeps={sweep}", "policy=fisher", "budget=0.1", "seed=3", "policy.tau=1.5", "tracking.mode=disabled",
              "backend.steps=7", "policy.fisher.normalize=global", "trial=4", "sweep=other", "store_dir='/s (é,)'"],
             [f"sweeps={sweep}", "policy=none", "budget=null", "seed=2", "objective=kl_k3_mean", "tracking.label='a b'"]]
    composer = JobComposer(master, loader)
    for job in jobs:
        found = composer.template(job)
        assert found is not None, job
        template, values = found
        if template.fixed_budget is not None and values.get("budget") is not None:  # as plan_grid collapses none/full
            job = [o for o in job if not o.startswith("budget=")] + ["budget=null"]
            values = {**values, "budget": None}
        fast, slow = template.cell(values), cell_from_config(composer(job))
        assert fast == slow and fast.resolved == slow.resolved, job


def test_a_template_checks_each_new_value_of_a_section_and_reuses_a_cell_for_the_same_values(tmp_path):
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path("pkg://ablate.conf"))
    master = loader.load_configuration("config", overrides=[], run_mode=RunMode.MULTIRUN)
    composer = JobComposer(master, loader)
    job = ["backend=noop", "policy=none", "tracking.mode=disabled", f"store_dir={tmp_path}"]
    template, values = composer.template([*job, "seed=1", "backend.steps=3"])
    first = template.cell(values)
    assert template.cell(dict(values)) is first  # the same job again (none at another budget, collapsed)
    assert template.cell({**values, "backend.steps": 4}).backend.steps == 4
    with pytest.raises(ConfigError, match=r"backend.steps=0"):
        template.cell({**values, "backend.steps": 0})
    with pytest.raises(ConfigError, match=r"backend.steps=0"):  # a failed check is not remembered as passed
        template.cell({**values, "backend.steps": 0, "seed": 2})
    with pytest.raises(ConfigError, match=r"seed=-1"):  # top-level values are checked in every job
        template.cell({**values, "seed": -1})
    assert template.cell({**values, "seed": 2}) == cell_from_config(composer([*job, "seed=2", "backend.steps=3"]))


def test_a_job_a_template_cannot_describe_is_composed_whole(tmp_path):
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path("pkg://ablate.conf"))
    master = loader.load_configuration("config", overrides=[], run_mode=RunMode.MULTIRUN)
    composer = JobComposer(master, loader)
    for job in (["policy=random", "budget=0.1", "+backend.stepz=3"], ["policy=random", "budget=0.1", "~objective"],
                ["policy=random", "budget=0.1", "probes=[none,random@0.5]"],
                ["policy=random", "budget=0.1", "tracking.project=${sweep}"]):
        assert composer.template(job) is None, job
    with pytest.raises(ConfigError, match=r"backend.stepz=3: backend=synthetic has no setting 'stepz'"):
        plan_grid([["policy=random", "budget=0.1", "+backend.stepz=3", f"store_dir={tmp_path}"]], composer)
    (planned,) = plan_grid([["policy=random", "budget=0.1", "probes=[none,random@0.5]", f"store_dir={tmp_path}"]],
                           composer)
    assert [probe.id for probe in planned.cell.probes] == ["none", "random@0.5"]
