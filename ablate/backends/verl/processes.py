"""Ending a verl run with everything it started: ``main_ppo``, its Ray instance and Ray's workers.

``main_ppo`` runs in a session of its own, so a Ctrl-C in the terminal reaches ablate alone and
the run is stopped in order: SIGTERM to ``main_ppo``, then to whatever it started that is still
alive (Ray's GCS, raylet and workers, which do not all exit with it), then SIGKILL to whatever
outlives the grace period. No process of the run is left behind.
"""

from __future__ import annotations

import subprocess

import psutil


def stop_tree(process: subprocess.Popen, grace: float = 15.0) -> None:
    """Stop ``process`` and every process it started, waiting at most ``grace`` seconds for each round."""
    try:
        tree = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    alive = [child for child in tree if child.is_running()]
    for child in alive:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=grace)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
