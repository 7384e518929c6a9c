"""ablate's launchers in themselves: what ``hydra/launcher=...`` selects, and the local pool's workers.

The promises of a sweep under each launcher (signals, a killed worker) are shown end to end by
tests/test_launcher_faults.py (slow); here the parts, fast.
"""

import os
import signal
import time
from dataclasses import dataclass, field

import pytest
from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus

from ablate.launchers.jobs import WorkerLost, cores, without_result
from ablate.launchers.pool import Pool, pool_size

PLUGINS = "hydra_plugins.ablate_launchers.launchers"


@pytest.mark.parametrize(("choice", "launcher"), [("local", "LocalLauncher"), ("joblib", "LocalLauncher"),
                                                  ("ray", "RayLauncher"), ("submitit_local", "SubmititLocalLauncher")])
def test_the_launcher_names_select_ablates_launchers_whatever_hydra_plugins_are_installed(choice, launcher):
    # What Hydra's plugin of that name registers when Hydra scans its plugins (installed or not here).
    ConfigStore.instance().store(group="hydra/launcher", name=choice, node={"_target_": "hydra_plugins.other.Launcher"},
                                 provider="another plugin")
    with initialize_config_module(config_module="ablate.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={choice}"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_ == f"{PLUGINS}.{launcher}"


def test_the_docs_settings_of_each_launcher_compose():
    """The settings docs/launchers.md gives each launcher (ray.init's address is null until set)."""
    with initialize_config_module(config_module="ablate.conf", version_base="1.3"):
        joblib = compose("config", overrides=["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], return_hydra_config=True)
        ray = compose("config", overrides=["hydra/launcher=ray", "+hydra.launcher.ray.init.address=auto",
                                           "+hydra.launcher.ray.remote.max_retries=0"], return_hydra_config=True)
        submitit = compose("config", overrides=["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5"],
                           return_hydra_config=True)
    assert joblib.hydra.launcher.n_jobs == 2
    assert ray.hydra.launcher.ray.init.address == "auto" and ray.hydra.launcher.ray.remote.max_retries == 0
    assert submitit.hydra.launcher.timeout_min == 5 and submitit.hydra.launcher.n_jobs is None


def test_n_jobs_counts_workers_as_joblib_does():
    assert pool_size(3) == 3 and pool_size(-1) == cores() and pool_size(-2) == max(1, cores() - 1)
    with pytest.raises(ValueError, match="hydra.launcher.n_jobs=0: expected a number of workers"):
        pool_size(0)


@dataclass
class Job:
    """A stand-in for a Hydra job: sleeps, then returns the pid of its worker, or dies."""

    num: int
    die: bool = False
    overrides: list = field(default_factory=list)

    def __call__(self) -> JobReturn:
        time.sleep(0.5)
        if self.die:
            os.kill(os.getpid(), signal.SIGKILL)
        return JobReturn(overrides=self.overrides, status=JobStatus.COMPLETED, _return_value=os.getpid())


def test_a_worker_that_dies_fails_its_own_job_and_the_others_run_on():
    pool = Pool(2)
    try:
        returns = pool.run([Job(0), Job(1, die=True), Job(2), Job(3)])
        first = {returned.return_value for returned in returns if returned.status is JobStatus.COMPLETED}
        again = pool.run([Job(4), Job(5)])  # the next batch reuses the workers
        workers = {process.process.pid for process in pool.workers}
    finally:
        pool.close()
    assert [returned.status for returned in returns] == [JobStatus.COMPLETED, JobStatus.FAILED,
                                                         JobStatus.COMPLETED, JobStatus.COMPLETED]
    with pytest.raises(WorkerLost, match=r"its worker \(pid \d+\) ended with SIGKILL"):
        returns[1].return_value
    assert without_result(returns[1]) and not without_result(returns[0])
    assert len(first) == 2  # the worker of job 0 went on to another job; a fresh one replaced the dead one
    assert {returned.return_value for returned in again} <= workers == first
    assert pool.workers == []
