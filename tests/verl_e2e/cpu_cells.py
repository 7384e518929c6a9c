"""What the CPU end-to-end tests share: the policies they run and the command as a user types it."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

POLICIES = ("none", "full", "random", "uniform", "fisher", "mismatch")
#: The worked example policy, by its entry point, where it is installed (.ci/verl-env.sh installs
#: examples/margin_policy): it runs in the policy multirun beside the built-in ones.
EXAMPLE = tuple(point.name for point in importlib.metadata.entry_points(group="ablate.policies") if point.name == "margin")
BUDGET = 0.5
CELLS = {"none": "none-s0", "full": "full-s0", **{p: f"{p}-b{BUDGET}-s0" for p in (*POLICIES[2:], *EXAMPLE)}}
#: The probes every policy cell scores on every step (docs/probes.md), and their overrides: part
#: of a cell's identity, so every command that is to find these cells again passes them too.
PROBES = ("none", "full", f"random@{BUDGET}")
PROBE_OVERRIDES = (f"probes=[{','.join(PROBES)}]", "probe_every=1")


STEPS = 3
#: What every verl cell's steps carry, defined (not NaN) on every step with recorded routes.
ALWAYS = ("replay/budget_requested", "replay/budget_realized", "replay/valid_routes", "replay/replayed_routes",
          "replay/unrecorded_routes", "replay/fisher_fallback", "routing/route_mismatch_rate",
          "routing/token_mismatch_rate", "routing/topk_overlap", "routing/residual_mismatch_rate",
          "mismatch/kl_k1", "mismatch/kl_k2", "mismatch/kl_k3", "mismatch/extreme_token_frac",
          "mismatch/abs_logratio_mean", "mismatch/abs_logratio_max", "train/reward", "train/loss")
#: Defined where something was replayed (override_rate, effective budget), mismatched (recall) or
#: estimated (Fisher mass, from the fisher policy's second step on).
WHERE_DEFINED = ("replay/override_rate", "replay/effective_budget", "routing/mismatch_recall",
                 "replay/fisher_mass", "replay/fisher_nonfinite")


def check_complete_with_every_key(cell: Path, policy: str) -> None:
    """The cell completed its steps with every key, each the same in the run store and its one W&B run."""
    from ablate.store import read_json, read_records
    from ablate.tracking import find_offline_runs, history_frame, read_offline_run

    assert read_json(cell / "status.json")["status"] == "complete", policy
    frame = read_records(cell)
    assert list(frame["step"]) == list(range(1, STEPS + 1)), policy
    missing = [key for key in (*ALWAYS, *WHERE_DEFINED) if key not in frame]
    assert not missing, (policy, missing)
    undefined = {key: frame[key].tolist() for key in ALWAYS if frame[key].isna().any()}
    assert not undefined, (policy, undefined)
    runs = find_offline_runs(cell / "wandb")
    assert len(runs) == 1, (policy, runs)
    history = history_frame(read_offline_run(runs[0]))
    for key in ALWAYS:
        assert history[key].tolist() == pytest.approx(frame[key].tolist(), rel=1e-12), (policy, key)


def needs_verl_runtime() -> None:
    pytest.importorskip("verl.protocol", reason="verl 0.9.1 is not installed here: build it with .ci/verl-env.sh")
    pytest.importorskip("transfer_queue", reason="verl's runtime packages are missing: run .ci/verl-env.sh")


def cell_dir(sweep: Path, name: str) -> Path:
    """The folder of the cell called ``name`` (``random-b0.5-s0``): the name plus its id's hash."""
    found = [path for path in sweep.glob(f"{name}-*") if path.name.rsplit("-", 1)[0] == name]
    assert len(found) == 1, (name, sorted(path.name for path in sweep.iterdir()))
    return found[0]


def ablate_command(store: Path, assets: Path, *args: str) -> list[str]:
    """``python -m ablate [-m] backend=verl_cpu ... <args>``: Hydra takes ``-m`` before the overrides only."""
    flags = [arg for arg in args if arg == "-m"]
    overrides = [arg for arg in args if arg != "-m"]
    return [sys.executable, "-m", "ablate", *flags, "backend=verl_cpu", f"store_dir={store}",
            f"backend.cpu.assets_dir={assets}", "tracking.progress=false", *overrides]


def run_ablate(store: Path, assets: Path, *args: str, timeout: float = 1200) -> tuple[subprocess.CompletedProcess, float]:
    """The command as a user types it, and its wall-clock seconds."""
    started = time.monotonic()
    done = subprocess.run(ablate_command(store, assets, *args), capture_output=True, text=True, timeout=timeout,
                          cwd=store.parent, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    return done, time.monotonic() - started


class Background:
    """The command as a user types it, running while others run; :meth:`wait` gives what :func:`run_ablate` does,
    with the seconds until the command ended (not until it was waited for)."""

    def __init__(self, store: Path, assets: Path, *args: str) -> None:
        self.command = ablate_command(store, assets, *args)
        self.out, self.err = (store.parent / f"ablate.{name}" for name in ("out", "err"))
        self.started = time.monotonic()
        self.seconds: float | None = None
        with open(self.out, "w") as out, open(self.err, "w") as err:  # files: two pipes left unread would block
            self.process = subprocess.Popen(self.command, stdout=out, stderr=err, text=True, cwd=store.parent,
                                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        self.reaper = threading.Thread(target=self._reap, daemon=True)
        self.reaper.start()

    def _reap(self) -> None:
        self.process.wait()
        self.seconds = time.monotonic() - self.started

    def wait(self, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
        self.reaper.join(max(1.0, self.started + timeout - time.monotonic()))
        if self.seconds is None:
            self.process.kill()
            raise subprocess.TimeoutExpired(self.command, timeout)
        done = subprocess.CompletedProcess(self.command, self.process.returncode, self.out.read_text(),
                                           self.err.read_text())
        return done, self.seconds
