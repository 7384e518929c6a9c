"""A run store of N complete cells made from a few real ones, for measuring the analysis at scale.

It runs a few real cells of the synthetic backend with a tiny config (every policy at every
budget, ``--real-seeds`` seeds; about 1.5 s a cell on one core), then clones them with their
identity rewritten: each clone gets its own seed, a value of ``backend.router_noise`` (its
setting), the cell id the runner would hash from that config, the matching name and directory, a
``cell.json`` and ``config.yaml`` that say so, and the source's ``status.json``. Its step records
(``records.parquet``, ``records.jsonl``) and ``summary.json`` are hard links to the source's, so
the clone reads as a complete cell to every reader of the store and a store of 10,000 cells takes
little disk (the page cache holds one copy of each distinct records file: readers of the store
pay the parsing of every file, not the disk reads).

The shape is the ``budget_selection`` sweep's, repeated over settings: per setting, ``none`` and
``full`` once per seed and ``random``, ``uniform``, ``fisher``, ``mismatch`` at each budget
(5 budgets), 12 seeds: 264 cells; ``backend.router_noise`` takes as many values as N needs
(``ceil(N / 264)``, the last setting full too). 10,000 cells are 38 settings: 836 arms of 12
seeds, 10,032 cells. Clone ``seed s`` reads the records of real seed ``s % real_seeds``, so seeds
differ and paired effects have a spread.

    python bench/make_store.py STORE --cells 10000            # STORE/scale-10032, sources in STORE/_sources
    python bench/make_store.py STORE --cells 1000 --seeds 6 --budgets 0.1,0.5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import yaml

from ablate.cell import cell_id_of, cell_name
from ablate.replay import ReplaySpec
from ablate.store import (
    CELL_FILE,
    CONFIG_FILE,
    RECORDS_FILE,
    RECORDS_LOG,
    STATUS_FILE,
    SUMMARY_FILE,
    CellState,
    cell_directories,
    inspect_cell,
    read_identity,
)

POLICIES = ("none", "full", "random", "uniform", "fisher", "mismatch")
FIXED = {"none": 0.0, "full": 1.0}
#: A synthetic cell small enough to run in about 1.5 s; every diagnostic is still logged.
TINY_BACKEND = ("backend.steps=20", "backend.layers=2", "backend.experts=8", "backend.d_model=16",
                "backend.expert_hidden=16", "backend.prompts_per_step=4", "backend.group_size=4", "backend.digits=3")
LINKED = (RECORDS_FILE, RECORDS_LOG, SUMMARY_FILE)
SOURCE_SWEEP = "real"


@dataclass(frozen=True)
class Shape:
    """The grid of a store: settings x seeds x (none, full, budgeted policies x budgets)."""

    settings: int
    seeds: int
    budgets: tuple[float, ...]

    @property
    def per_seed(self) -> int:
        return len(FIXED) + (len(POLICIES) - len(FIXED)) * len(self.budgets)

    @property
    def cells(self) -> int:
        return self.settings * self.seeds * self.per_seed

    @classmethod
    def for_cells(cls, cells: int, seeds: int, budgets: tuple[float, ...]) -> "Shape":
        """The fewest whole settings that hold ``cells`` (fewer seeds when one setting is enough)."""
        per_setting = seeds * cls(1, 1, budgets).per_seed
        if cells <= per_setting:
            return cls(1, max(1, math.ceil(cells / cls(1, 1, budgets).per_seed)), budgets)
        return cls(math.ceil(cells / per_setting), seeds, budgets)

    def arms(self) -> Iterator[tuple[str, float]]:
        for policy in POLICIES:
            if policy in FIXED:
                yield policy, FIXED[policy]
            else:
                yield from ((policy, budget) for budget in self.budgets)

    def noise(self, setting: int) -> float:
        """``backend.router_noise`` of a setting: 0.07 (the default) first, then apart by 0.001."""
        return round(0.07 + 0.001 * setting, 6)

    def grid_overrides(self) -> list[str]:
        """The same grid as ``python -m ablate -m`` overrides (for planning it)."""
        noise = ",".join(f"{self.noise(s):g}" for s in range(self.settings))
        return [f"policy={','.join(POLICIES)}", f"budget={','.join(f'{b:g}' for b in self.budgets)}",
                f"seed=range({self.seeds})", f"backend.router_noise={noise}"]


def run_sources(sources: Path, budgets: tuple[float, ...], real_seeds: int) -> dict[tuple[str, float, int], Path]:
    """Real cells of every (policy, budget, seed < real_seeds), run once and kept in ``sources``."""
    sweep = sources / SOURCE_SWEEP
    found = _complete_sources(sweep)
    wanted = {(p, b, s) for p, b in Shape(1, 1, budgets).arms() for s in range(real_seeds)}
    if not wanted <= set(found):
        command = [sys.executable, "-m", "ablate", "-m", f"policy={','.join(POLICIES)}",
                   f"budget={','.join(f'{b:g}' for b in budgets)}", f"seed=range({real_seeds})",
                   f"sweep={SOURCE_SWEEP}", f"store_dir={sources}", "tracking.mode=disabled", *TINY_BACKEND]
        print(f"running {len(wanted)} real cells into {sweep} (a complete one is skipped)", flush=True)
        started = time.monotonic()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        print(f"  {time.monotonic() - started:.0f} s", flush=True)
        found = _complete_sources(sweep)
    missing = sorted(wanted - set(found))
    if missing:
        raise SystemExit(f"make_store: real cells {missing[:3]} did not complete in {sweep}")
    return {key: found[key] for key in wanted}


def _complete_sources(sweep: Path) -> dict[tuple[str, float, int], Path]:
    if not sweep.is_dir():
        return {}
    found = {}
    for directory in cell_directories(sweep):
        if inspect_cell(directory).state is CellState.COMPLETE:
            identity = read_identity(directory)
            found[(identity.policy, identity.budget, identity.seed)] = directory
    return found


class Source:
    """One real cell, read once: what every clone of it copies or links."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.identity = json.loads((directory / CELL_FILE).read_text())
        self.config = yaml.safe_load((directory / CONFIG_FILE).read_text())
        self.status = (directory / STATUS_FILE).read_bytes()
        if cell_id_of(self.config) != self.identity["cell_id"]:
            raise SystemExit(f"make_store: {directory}: the runner's cell id is not the hash this script computes; "
                             "the runner's identity changed")

    def clone(self, sweep_dir: Path, sweep: str, seed: int, noise: float) -> None:
        config = {**self.config, "seed": seed, "sweep": sweep, "store_dir": str(sweep_dir.parent),
                  "backend": {**self.config["backend"], "router_noise": noise}}
        identity = {**self.identity, "cell_id": cell_id_of(config), "seed": seed, "sweep": sweep, "wandb_run_id": None,
                    "name": cell_name(ReplaySpec.of(self.identity["policy"], self.identity["budget"], seed), None,
                                      self.identity["variant"])}
        directory = sweep_dir / f"{identity['name']}-{identity['cell_id'][:8]}"
        directory.mkdir()
        (directory / CELL_FILE).write_text(json.dumps(identity, indent=2, sort_keys=True) + "\n")
        (directory / CONFIG_FILE).write_text(yaml.dump(config, Dumper=_DUMPER, sort_keys=False))
        (directory / STATUS_FILE).write_bytes(self.status)
        for name in LINKED:
            os.link(self.directory / name, directory / name)


_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def make_store(store: Path, cells: int, *, seeds: int = 12, budgets: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 0.75),
               real_seeds: int = 2, sources: Path | None = None, sweep: str | None = None) -> tuple[Path, Shape]:
    """Write the sweep ``store/<sweep>`` of at least ``cells`` cells; returns its directory and shape."""
    shape = Shape.for_cells(cells, seeds, budgets)
    real = run_sources(sources or store / "_sources", budgets, real_seeds)
    loaded = {key: Source(path) for key, path in real.items()}
    sweep = sweep or f"scale-{shape.cells}"
    sweep_dir = store / sweep
    if sweep_dir.exists():
        raise SystemExit(f"make_store: {sweep_dir} exists; remove it or pass another --sweep")
    sweep_dir.mkdir(parents=True)
    for setting in range(shape.settings):
        for seed in range(shape.seeds):
            for policy, budget in shape.arms():
                loaded[(policy, budget, seed % real_seeds)].clone(sweep_dir, sweep, seed, shape.noise(setting))
    return sweep_dir, shape


def _budgets(text: str) -> tuple[float, ...]:
    values = tuple(float(part) for part in text.split(","))
    if not values or not all(0 < value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected budgets in (0, 1) joined by commas, e.g. 0.1,0.5")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", type=Path, help="the run store root to write the sweep into")
    parser.add_argument("--cells", type=int, required=True, help="at least this many cells (whole settings)")
    parser.add_argument("--seeds", type=int, default=12, help="seeds per arm (default: 12)")
    parser.add_argument("--budgets", type=_budgets, default=(0.05, 0.1, 0.25, 0.5, 0.75),
                        help="budgets of the budgeted policies (default: 0.05,0.1,0.25,0.5,0.75)")
    parser.add_argument("--real-seeds", type=int, default=2, help="seeds of real cells run (default: 2)")
    parser.add_argument("--sources", type=Path, help="where the real cells are run and kept (default: STORE/_sources)")
    parser.add_argument("--sweep", help="the sweep's name (default: scale-<cells>)")
    args = parser.parse_args()
    if args.cells < 1 or args.seeds < 1 or args.real_seeds < 1:
        parser.error(f"--cells {args.cells}, --seeds {args.seeds}, --real-seeds {args.real_seeds}: expected positive counts")
    started = time.monotonic()
    sweep_dir, shape = make_store(args.store, args.cells, seeds=args.seeds, budgets=args.budgets,
                                  real_seeds=args.real_seeds, sources=args.sources, sweep=args.sweep)
    print(f"{sweep_dir}: {shape.cells} cells = {shape.settings} settings of backend.router_noise x {shape.seeds} seeds "
          f"x {shape.per_seed} cells (none, full, {len(POLICIES) - len(FIXED)} policies x {len(shape.budgets)} "
          f"budgets); {shape.settings * (shape.per_seed)} arms; {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
