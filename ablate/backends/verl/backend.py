"""``backend=verl``: one cell as one verl ``main_ppo`` run, logged like any other cell.

verl writes its per-step metrics with its own ``file`` logger (JSON lines, path set through
``VERL_FILE_LOGGER_PATH``); this module follows that file while verl runs and hands every step to
the cell runner: the schema keys the worker hook emits (``replay/``, ``routing/`` and, on a probed
step, ``probe/<id>/...``, which verl prefixes with ``actor/`` like every actor metric), verl's
training and rollout-correction metrics mapped onto ``train/`` and ``mismatch/``, and every other
numeric verl metric beside them under its own name (``rollout_corr/*``,
``training/rollout_probs_diff_*``, ...), outside the schema; the mapped ones are kept under their
verl names too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ablate.backends import RunContext
from ablate.backends.verl.config import BACKEND
from ablate.backends.verl.hook_settings import HookSettings
from ablate.backends.verl.launch import (
    check_cell_config,
    check_engine,
    check_resources,
    check_verl,
    compose,
    hydra_string,
    update_epochs,
    verl_overrides,
)
from ablate.backends.verl.liveness import ACTOR_PREFIX, check_step
from ablate.backends.verl.processes import stop_tree
from ablate.cell import Cell
from ablate.diagnostics import SCHEMA
from ablate.diagnostics.schema import split_probe_key

def default_config_dir() -> Path:
    """Where ``backend.config_name`` is looked up when ``backend.config_dir`` is null.

    The repository's ``examples/verl`` ships inside the package as ``ablate/backends/verl/examples``
    (pyproject.toml): an installed package finds it beside this module, a checkout at its source.
    """
    installed = Path(__file__).resolve().parent / "examples"
    return installed if installed.is_dir() else Path(__file__).resolve().parents[3] / "examples" / "verl"


#: verl metric -> schema key, where the two mean the same thing. verl's rollout_corr helper takes
#: l = old_log_prob - rollout_log_prob over response tokens: ``kl`` is mean(-l) (our k1) and
#: ``k3_kl`` is mean(exp(l) - 1 - l) (our k3). The old-log-prob pass replays the cell's mask (for
#: every policy: ``mismatch`` takes its native routes from a pass of its own), so they measure the
#: mismatch left after replay.
VERL_KEYS = {
    "rollout_corr/kl": "mismatch/kl_k1",
    "rollout_corr/k3_kl": "mismatch/kl_k3",
    "critic/score/mean": "train/reward",
    "critic/score/std": "train/reward_std",
    "actor/pg_loss": "train/loss",
    "actor/grad_norm": "train/grad_norm",
    "actor/pg_clipfrac": "train/clip_frac",
    "actor/entropy": "train/entropy",
}


def split_metrics(data: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """verl's metrics of one step as (schema record, native metrics kept under their own names).

    verl's file logger writes NaN as ``null`` (orjson); a schema key that arrives as ``null`` is
    a NaN again (undefined this step), so the record keeps every key the hook emitted.
    """
    record: dict[str, float] = {}
    mapped: dict[str, float] = {}  # a schema key ablate computed itself wins over verl's version of it
    native: dict[str, float] = {}
    for key, value in data.items():
        hook_key = key.removeprefix(ACTOR_PREFIX)
        ours = hook_key in SCHEMA or split_probe_key(hook_key) is not None
        if value is None and ours:
            value = float("nan")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if ours:
            record[hook_key] = float(value)
        elif key in VERL_KEYS:
            mapped.setdefault(VERL_KEYS[key], float(value))
            native[key] = float(value)
        else:
            native[key] = float(value)
    return {**mapped, **record}, native


def follow(path: Path, process: subprocess.Popen, poll: float = 1.0) -> Iterator[dict[str, Any]]:
    """Lines of a JSON-lines file that another process appends to, until that process exits."""
    position, pending = 0, b""
    while True:
        running = process.poll() is None
        if path.exists():
            with open(path, "rb") as handle:
                handle.seek(position)
                chunk = handle.read()
                position += len(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    yield json.loads(line)
        if not running:
            return
        time.sleep(poll)


def build_command(cell: Cell, metrics_file: Path, *, launch: bool = True) -> tuple[list[str], dict[str, str]]:
    """The verl command line and environment of a cell; checks verl and the config first.

    The config is composed twice: once to read what the worker hook must know of verl's own
    settings (the number of update epochs), then with the hook's settings, to check the
    command exactly as ``main_ppo`` will compose it. A CPU cell (``backend.cpu``) makes its
    assets only when it is to be launched, not for a dry run.
    """
    cfg = BACKEND.config_of(cell)
    engine = cfg.engine.value
    check_verl()
    check_engine(engine, cpu=cfg.cpu is not None)
    config_dir = Path(cfg.config_dir) if cfg.config_dir else default_config_dir()
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics_file)}
    cpu: list[str] = []
    if cfg.cpu is not None:
        from ablate.backends.verl.cpu import launch as cpu_launch

        cpu = cpu_launch.overrides(cfg.cpu, make_assets=launch)
        env.update(cpu_launch.environment(cfg.cpu, engine))
    # Quoted: a settings variant puts '=' and ',' in the name (fisher+tau=0.5-b0.25-s4).
    own = [*cpu, "trainer.logger=[console,file]", f"trainer.experiment_name={hydra_string(cell.name)}",
           *cfg.overrides]
    settings = HookSettings(cell.replay, engine=engine)
    draft = compose(config_dir, cfg.config_name, [*verl_overrides(settings), *own])
    source = cell.replay.source
    check_cell_config(draft, cell.policy, cell.plugins, engine=engine, source=source)
    settings = dataclasses.replace(settings, update_epochs=update_epochs(draft))
    overrides = [*verl_overrides(settings), *own]
    final = compose(config_dir, cfg.config_name, overrides)
    check_cell_config(final, cell.policy, cell.plugins, [probe.id for probe in cell.probes], engine=engine,
                      source=source)
    check_resources(final, model_made_by_ablate=cfg.cpu is not None)  # the CPU stand-in makes its own model
    command = [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={config_dir.resolve()}",
               f"--config-name={cfg.config_name}", *overrides]
    return command, env


def dry_run_command(cell: Cell) -> str:
    """``backend.dry_run=true``: the verl command the cell would run, checked as a launch is."""
    command, _ = build_command(cell, Path("verl_metrics.jsonl"), launch=False)
    return shlex.join(command)


def run_cell_steps(cell: Cell, log_step: Callable[..., None], directory: Path) -> None:
    """Run verl's ``main_ppo`` for the cell, logging each step verl writes to ``directory``'s metrics file."""
    metrics_file = directory / "verl_metrics.jsonl"
    command, env = build_command(cell, metrics_file)
    metrics_file.unlink(missing_ok=True)  # a rerun must not replay the previous attempt's steps
    process = subprocess.Popen(command, env=env, start_new_session=True)  # stopped in order by stop_tree
    try:
        for line in follow(metrics_file, process):
            record, native = split_metrics(line.get("data", {}))
            log_step(int(line["step"]), record, native)
            check_step(int(line["step"]), record, native, cell.budget)
    finally:
        stop_tree(process)
    if process.returncode:
        raise RuntimeError(f"verl main_ppo exited with status {process.returncode}: {' '.join(command[:4])} ...")


def run(cell: Cell, context: RunContext) -> None:
    run_cell_steps(cell, context.log_step, context.directory)

