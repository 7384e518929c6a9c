"""The Optuna sweeper (``hydra/sweeper=ablate_optuna``): real Hydra multiruns of the app, in subprocesses.

Each study runs the shrunken synthetic backend (``TINY``), so a trial takes about a second after
the first (which pays for importing torch); a study of a few trials takes about 10 s.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pandas as pd
import pytest
from synthetic_configs import TINY
from hydra import compose, initialize_config_module
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from ablate.runner import run_cell
from ablate.store import read_json, read_summary
from hydra_plugins.ablate_optuna_sweeper._search_space import SearchSpaceError, parse_search_space

#: A small search space over the Fisher policy, given on the command line.
FISHER_SPACE = ["policy=fisher", "budget=0.25", "policy.tau=interval(0.0, 2.0)", "policy.per_layer=choice(true, false)"]


def ablate_command(tmp_path: Path, *overrides: str, multirun: bool = False) -> list[str]:
    """``python -m ablate`` with the tiny backend and its run store under ``tmp_path/runs``."""
    return [sys.executable, "-m", "ablate", *(["-m"] if multirun else []), *TINY, "tracking.mode=disabled",
            "tracking.progress=false", f"store_dir={tmp_path / 'runs'}", *overrides]


def ablate(tmp_path: Path, *overrides: str, multirun: bool = False, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m ablate`` run in ``tmp_path`` (:func:`ablate_command`)."""
    command = ablate_command(tmp_path, *overrides, multirun=multirun)
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def optuna_study(tmp_path: Path, sweep: str, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    """A study run with the sweeper chosen on the command line (no sweep file)."""
    return ablate(tmp_path, "hydra/sweeper=ablate_optuna", f"sweep={sweep}", *overrides, multirun=True, check=check)


def load_study(tmp_path: Path, sweep: str) -> optuna.Study:
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "runs" / sweep / "optuna.journal")))
    return optuna.load_study(study_name=sweep, storage=storage)


def cells(tmp_path: Path, sweep: str) -> dict[int, Path]:
    """The sweep's cells by trial number (each trial number at most once)."""
    found: dict[int, Path] = {}
    for cell_file in (tmp_path / "runs" / sweep).glob("*/cell.json"):
        trial = read_json(cell_file)["trial"]
        assert trial not in found, f"trial {trial} has two cells: {found[trial]} and {cell_file.parent}"
        found[trial] = cell_file.parent
    return found


# --- fast: discovery, the search-space syntax, the sweep files, the environment -----------


def test_plugin_is_discovered_without_importing_optuna():
    script = (
        "import sys\n"
        "from hydra.core.plugins import Plugins\n"
        "from hydra.plugins.sweeper import Sweeper\n"
        "print(sorted(c.__name__ for c in Plugins.instance().discover(Sweeper)))\n"
        "print('optuna' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd="/")
    sweepers, optuna_imported = done.stdout.splitlines()
    assert "AblateOptunaSweeper" in sweepers
    assert optuna_imported == "False"  # a plain run does not pay for importing Optuna


def test_search_space_reads_hydra_sweep_syntax():
    space = parse_search_space([
        "a=interval(0.05, 0.5)", "b=tag(log, interval(1e-4, 1e-1))", "c=int(interval(1, 8))", "d=range(1, 10, 3)",
        "e=range(0.1, 0.5, 0.1)", "f=choice(router_logits, expert_outputs)", "g=true,false", "+h=3", "policy=fisher",
        "i=interval(0.0, 1.0)", "i=0.5",  # a later override of a key wins: i is fixed
    ])
    assert space.distributions == {
        "a": FloatDistribution(0.05, 0.5), "b": FloatDistribution(1e-4, 1e-1, log=True), "c": IntDistribution(1, 8),
        "d": IntDistribution(1, 7, step=3),  # Hydra's range excludes its stop, Optuna's high is included
        "e": FloatDistribution(0.1, 0.4, step=0.1),
        "f": CategoricalDistribution(["router_logits", "expert_outputs"]), "g": CategoricalDistribution([True, False]),
    }
    assert space.fixed == ["+h=3", "policy=fisher", "i=0.5"]
    assert space.trial_overrides({"a": 0.25, "g": False, "f": "expert_outputs"}) == [
        "+h=3", "policy=fisher", "i=0.5", "a=0.25", "g=False", "f=expert_outputs"]
    for bad in ["a=shuffle(1, 2)", "a=tag(fast, interval(0, 1))", "a=glob(*)", "a=interval(1.0, 0.0)"]:
        with pytest.raises(SearchSpaceError, match="'a="):
            parse_search_space([bad])


@pytest.mark.parametrize("name", ["tune_fisher", "pareto_budget"])
def test_sweep_files_select_the_optuna_sweeper(name):
    with initialize_config_module(config_module="ablate.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"sweeps={name}"], return_hydra_config=True)
        assert cfg.sweep == name
        assert cfg.hydra.sweeper._target_.endswith("AblateOptunaSweeper")
        assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"  # no -m needed
        space = parse_search_space(f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items())
        assert space.distributions and not space.fixed
        # Every searched key exists: a trial at the low end of each range composes.
        low = {k: d.choices[-1] if isinstance(d, CategoricalDistribution) else d.low for k, d in space.distributions.items()}
        compose("config", overrides=[f"sweeps={name}", *space.trial_overrides(low), "trial=0"])


def test_pip_check_passes():
    done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# --- slow: real studies -------------------------------------------------------------------


@pytest.fixture(scope="module")
def first_study(tmp_path_factory):
    """Three TPE trials with a fixed seed: the study other tests compare with or extend."""
    tmp_path = tmp_path_factory.mktemp("first-study")
    optuna_study(tmp_path, "tune", *FISHER_SPACE, "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=7")
    return tmp_path


@pytest.mark.slow
def test_study_trials_are_cells_and_suggestions_are_reproducible(first_study, tmp_path):
    study = load_study(first_study, "tune")
    trials = study.get_trials()
    assert [t.number for t in trials] == [0, 1, 2] and {t.state for t in trials} == {TrialState.COMPLETE}
    by_trial = cells(first_study, "tune")
    assert sorted(by_trial) == [0, 1, 2]
    for trial in trials:
        cell = by_trial[trial.number]
        identity = read_json(cell / "cell.json")
        assert (identity["policy"], identity["budget"], identity["trial"]) == ("fisher", 0.25, trial.number)
        assert identity["settings"]["tau"] == trial.params["policy.tau"]
        assert identity["settings"]["per_layer"] == trial.params["policy.per_layer"]
        assert read_summary(cell)["final_reward"] == trial.value  # the objective is the cell's outcome
    table = pd.read_csv(first_study / "runs" / "tune" / "optuna_trials.csv")
    assert table["number"].tolist() == [0, 1, 2] and "value_final_reward" in table
    assert len(pd.read_parquet(first_study / "runs" / "tune" / "optuna_trials.parquet")) == 3
    assert json.loads((first_study / "runs" / "tune" / "optuna_best.json").read_text())["best_trials"][0]["number"] \
        == study.best_trial.number

    optuna_study(tmp_path, "tune", *FISHER_SPACE, "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=7")
    again = load_study(tmp_path, "tune").get_trials()
    assert [t.params for t in again] == [t.params for t in trials]


@pytest.mark.slow
def test_a_stopped_study_resumes_without_repeating_a_trial(first_study, tmp_path):
    shutil.copytree(first_study / "runs", tmp_path / "runs")
    before = {n: read_json(c / "status.json") for n, c in cells(tmp_path, "tune").items()}

    optuna_study(tmp_path, "tune", *FISHER_SPACE, "hydra.sweeper.n_trials=5", "hydra.sweeper.sampler.seed=7")
    trials = load_study(tmp_path, "tune").get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3, 4] and {t.state for t in trials} == {TrialState.COMPLETE}
    params = [tuple(sorted(t.params.items())) for t in trials]
    assert len(set(params)) == 5  # the resumed sampler is reseeded: it does not replay trials 0-2
    after = cells(tmp_path, "tune")
    assert sorted(after) == [0, 1, 2, 3, 4]
    for number, status in before.items():  # complete cells were not rerun
        assert read_json(after[number] / "status.json") == status


@pytest.mark.slow
def test_trials_left_running_by_a_crash_are_relaunched_under_their_number(tmp_path):
    """A driver killed mid-batch leaves RUNNING trials: one whose cell completed, one never started."""
    space = {"policy.tau": FloatDistribution(0.0, 2.0)}
    (tmp_path / "runs" / "crash").mkdir(parents=True)
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "runs" / "crash" / "optuna.journal")))
    study = optuna.create_study(study_name="crash", storage=storage, direction="maximize")
    done, lost = study.ask(space), study.ask(space)
    tau = done.params["policy.tau"]
    cfg_overrides = ["policy=fisher", "budget=0.25", f"policy.tau={tau}", "trial=0", "sweep=crash", "tracking.mode=disabled",
                     "tracking.progress=false"]
    with initialize_config_module(config_module="ablate.conf", version_base="1.3"):
        summary = run_cell(compose("config", overrides=[*TINY, f"store_dir={tmp_path / 'runs'}", *cfg_overrides]))

    optuna_study(tmp_path, "crash", "policy=fisher", "budget=0.25", "policy.tau=interval(0.0, 2.0)", "hydra.sweeper.n_trials=3")
    trials = load_study(tmp_path, "crash").get_trials()
    assert [t.number for t in trials] == [0, 1, 2] and {t.state for t in trials} == {TrialState.COMPLETE}
    assert trials[0].params == done.params and trials[1].params == lost.params
    assert trials[0].value == summary["final_reward"]
    by_trial = cells(tmp_path, "crash")
    assert sorted(by_trial) == [0, 1, 2]
    assert read_json(by_trial[0] / "status.json")["attempt"] == 1  # read back from the store, not rerun


@pytest.mark.slow
def test_a_failing_trial_is_told_fail_and_the_study_goes_on(tmp_path):
    # With the random sampler and seed 0 the four trials get tau 0.5, -1.0, 0.5, 0.5; -1.0 is a ConfigError.
    space = ["policy=fisher", "budget=0.25", "policy.tau=choice(-1.0, 0.5)", "hydra.sweeper.sampler.name=random",
             "hydra.sweeper.sampler.seed=0", "hydra.sweeper.n_trials=4"]
    optuna_study(tmp_path, "failing", *space, "hydra.sweeper.max_failure_rate=0.25")
    trials = load_study(tmp_path, "failing").get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    assert trials[1].params["policy.tau"] == -1.0
    assert sorted(cells(tmp_path, "failing")) == [0, 2, 3]  # the invalid config never became a cell

    stopped = optuna_study(tmp_path, "strict", *space, "hydra.sweeper.max_failure_rate=0.0", check=False)
    assert stopped.returncode == 1
    assert "max_failure_rate=0.0" in stopped.stderr and "ConfigError" in stopped.stderr
    last = stopped.stderr.strip().splitlines()[-1]  # one line says why, no chained traceback before it
    assert last.startswith("ablate: 1 trial(s) of study 'strict' failed") and "Traceback" not in stopped.stderr
    assert [t.state for t in load_study(tmp_path, "strict").get_trials()] == [TrialState.COMPLETE, TrialState.FAIL]


@pytest.mark.slow
def test_sweep_file_runs_a_study(tmp_path):
    ablate(tmp_path, "sweeps=tune_fisher", "hydra.sweeper.n_trials=2")
    trials = load_study(tmp_path, "tune_fisher").get_trials()
    assert {t.state for t in trials} == {TrialState.COMPLETE} and len(trials) == 2
    assert set(trials[0].params) == {"policy.tau", "policy.fisher.decay", "policy.fisher.estimator",
                                     "policy.fisher.normalize", "policy.per_layer"}
    for number, cell in cells(tmp_path, "tune_fisher").items():
        config = (cell / "config.yaml").read_text()
        assert f"trial: {number}" in config and "budget: 0.25" in config
        assert read_json(cell / "cell.json")["policy"] == "fisher"


@pytest.mark.slow
def test_multi_objective_study_reports_a_non_dominated_front(tmp_path):
    ablate(tmp_path, "sweeps=pareto_budget", "hydra.sweeper.n_trials=6", "hydra.sweeper.n_jobs=2")
    study = load_study(tmp_path, "pareto_budget")
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 6 and study.metric_names == ["final_reward", "kl_k3_mean"]
    report = json.loads((tmp_path / "runs" / "pareto_budget" / "optuna_best.json").read_text())
    front = {t["number"]: t["values"] for t in report["best_trials"]}
    assert front

    def dominates(a, b):  # maximise final_reward, minimise kl_k3_mean
        return a[0] >= b[0] and a[1] <= b[1] and (a[0] > b[0] or a[1] < b[1])

    for trial in complete:
        dominated = any(dominates(other.values, trial.values) for other in complete)
        assert (trial.number in front) == (not dominated), (trial.number, trial.values)
    for number, cell in cells(tmp_path, "pareto_budget").items():
        summary = read_summary(cell)
        assert [summary["final_reward"], summary["kl_k3_mean"]] == study.trials[number].values
    table = pd.read_csv(tmp_path / "runs" / "pareto_budget" / "optuna_trials.csv")
    assert {"values_final_reward", "values_kl_k3_mean", "params_policy", "params_budget"} <= set(table.columns)


@pytest.mark.slow
def test_a_killed_joblib_worker_fails_its_trial_only_and_the_study_goes_on(tmp_path):
    """The study launches through the same wrapper as a grid sweep: a dead worker used to break
    joblib's pool, end the study with a traceback and leave the other trial's cell ``running``."""
    import os
    import signal
    import time

    command = ablate_command(tmp_path, "backend.steps=400", "hydra/sweeper=ablate_optuna", "sweep=killed",
                             *FISHER_SPACE, "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2",
                             "hydra.sweeper.max_failure_rate=0.5", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                             multirun=True)
    study = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        running = [c for c in cells(tmp_path, "killed").values() if (c / "claim.json").exists() and (c / "records.jsonl").exists()]
        if len(running) == 2:
            break
        time.sleep(0.2)
    assert len(running) == 2, "both trials never ran at once"
    victim = running[0]
    os.kill(read_json(victim / "claim.json")["pid"], signal.SIGKILL)
    out, _ = study.communicate(timeout=300)
    assert study.returncode == 0, out[-3000:]
    trials = {t.number: t.state for t in load_study(tmp_path, "killed").get_trials()}
    killed = read_json(victim / "cell.json")["trial"]
    assert trials == {killed: TrialState.FAIL, 1 - killed: TrialState.COMPLETE}, trials
    assert read_json(cells(tmp_path, "killed")[1 - killed] / "status.json")["status"] == "complete"


@pytest.mark.slow
def test_two_sweepers_of_one_study_hold_it_to_n_trials_and_run_each_trial_once(tmp_path):
    """Two processes on one journal with n_trials=4 used to end with 7 trials ("trial 7/4")."""
    command = ablate_command(tmp_path, "hydra/sweeper=ablate_optuna", "sweep=shared", "hydra.sweeper.n_trials=4",
                             *FISHER_SPACE, multirun=True)
    sweepers = [subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for _ in range(2)]
    outputs = [sweeper.communicate(timeout=600)[0] for sweeper in sweepers]
    assert [sweeper.returncode for sweeper in sweepers] == [0, 0], outputs
    study = load_study(tmp_path, "shared")
    assert [trial.state for trial in study.trials] == [TrialState.COMPLETE] * 4
    assert sorted(cells(tmp_path, "shared")) == [0, 1, 2, 3]
    both = "\n".join(outputs)
    assert "/4 (#" in both and "trial 5/4" not in both and "CellBusy" not in both and "Trial 0 failed" not in both
