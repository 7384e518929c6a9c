"""The cost of a sweep as it grows: planning, loading and analysing 1k to 10k cells, each against
a baseline measured in the same run.

Every figure is one fresh process (its children included), measured by the kernel
(``os.wait4``): CPU seconds (user + sys), wall seconds and peak resident memory. On a machine
shared with other work, compare CPU seconds: wall seconds there measure the other work too.

The goals are set at 10,000 cells; rows of smaller stores print their ratios unjudged. Per store
size (``--sizes``; stores made by ``bench/make_store.py``: real synthetic cells cloned
with their identity rewritten, the ``budget_selection`` grid of 264 cells per value of
``backend.router_noise``):

- **plan**: ``python -m ablate -m <grid> hydra.sweeper.dry_run=true``, against the plan of the same
  sweep at about 100 cells, for three shapes of grid: many settings (the store's grid: 38 values of
  ``backend.router_noise`` at 10,000 cells), many seeds (``none``, ``full`` and ``random`` at 0.5 on
  the ``smoke`` sweep's backend, 3,334 seeds) and many budgets (``random`` and ``fisher`` at 834
  budgets, 6 seeds). Goal: at most 2x for each.
- **load_runs**: ``ablate.analysis.load_runs(sweep)``, against a plain read of the same files
  (every file ``load_runs`` reads, parsed once with the same parsers: ``json``, libyaml, the
  Parquet reader over the file's bytes, and kept in memory, nothing built from them). Goal: at
  most 1.5x. For information, also against the same read keeping nothing (parsing alone).
- **analysis**: ``python -m ablate.analysis SWEEP --report``, against ``load_runs`` of the same
  sweep. Goal: at most 3x, and at most 1 GiB of memory. Measured again with ``--no-plots``, which
  leaves the tables, effects, flags, power and report: the difference is the plots' share.

Once:

- **sweep overhead**: the per-cell CPU of ``python -m ablate -m backend=noop`` (the slope between
  two grid sizes, so start-up cancels out) against a bare Hydra multirun's (bench/bare_app).
  Goal: at most 1.25x.
- **--help**: ``python -m ablate --help`` against the bare Hydra app's, median CPU of
  ``--repeats`` processes. Goal: at most 1.2x.

The verl hook's row (a micro-batch against one ``torch.sum``) is bench/bench_verl_hook.py's.

    python bench/bench_scale.py                                   # 1k, 2k, 5k, 10k cells: about 30 minutes
    python bench/bench_scale.py --sizes 1000 --steps load,analysis   # a quick look
    python bench/bench_scale.py --store /tmp/scale --profile /tmp/profiles   # stores kept for the next run
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_sweep_overhead import ablate_command, bare_command  # noqa: E402
from make_store import Shape, make_store  # noqa: E402

STEPS = ("plan", "load", "analysis", "overhead", "help")
PLAN_BASELINE_CELLS = 100
BUDGETS = (0.05, 0.1, 0.25, 0.5, 0.75)
GIB = 1024.0

#: The baseline of load_runs: the files it reads, each parsed once with the parsers load_runs uses
#: and kept in memory (``keep``), nothing built from them; ``discard`` keeps nothing (a floor below
#: any loader: it measures parsing only).
PLAIN_READ = """
import json, sys, yaml, pyarrow as pa, pyarrow.parquet as pq
from pathlib import Path
loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
kept = []
for cell in sorted(Path(sys.argv[1]).glob("*/cell.json")):
    d = cell.parent
    read = [json.loads((d / name).read_bytes()) for name in ("status.json", "cell.json", "summary.json")]
    read.append(yaml.load((d / "config.yaml").read_bytes(), Loader=loader))
    read.append(pq.ParquetFile(pa.BufferReader((d / "records.parquet").read_bytes())).read(use_threads=False))
    if sys.argv[2] == "keep":
        kept.append(read)
"""
LOAD_RUNS = "import sys; from ablate.analysis.load import load_runs; load_runs(sys.argv[1])"
PROFILE = """
import cProfile, runpy, sys, time
out, sys.argv = sys.argv[1], sys.argv[2:]
profile = cProfile.Profile(time.process_time)
if sys.argv[0] == "-c":
    code, sys.argv = sys.argv[1], sys.argv[1:]
    profile.runctx(code, {}, {})
else:
    sys.argv = sys.argv[1:]
    try:
        profile.runcall(runpy.run_module, sys.argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as end:  # the module's own exit status ends the profile, not the run
        if end.code:
            raise
profile.dump_stats(out)
"""


@dataclass(frozen=True)
class Cost:
    cpu: float
    wall: float
    peak_mib: float


def measured(command: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> Cost:
    """CPU (user + sys), wall seconds and peak RSS of one process and the children it waited for."""
    with tempfile.TemporaryFile() as errors:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors, env=env, cwd=cwd)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode:
            errors.seek(0)
            tail = errors.read().decode(errors="replace")[-2000:]
            raise SystemExit(f"bench_scale: {' '.join(command)} exited {process.returncode}:\n{tail}")
    return Cost(usage.ru_utime + usage.ru_stime, wall, usage.ru_maxrss / 1024.0)


def cheapest(command: list[str] | Callable[[], list[str]], repeats: int, **kwargs) -> Cost:
    """The run with the least CPU of ``repeats`` (other work on the machine only ever adds).
    ``command`` may be a function that makes each run's command: a sweep is run afresh each time
    (its own name), where the same command again would find its cells complete and skip them."""
    make = command if callable(command) else lambda: command
    return min((measured(make(), **kwargs) for _ in range(repeats)), key=lambda cost: cost.cpu)


#: The goals of issue 27 are set at 10,000 cells: smaller stores print their ratios unjudged.
GOAL_CELLS = 10_000


@dataclass
class Row:
    step: str
    cells: int | None
    cost: Cost
    baseline: str
    base: Cost
    ratio: float
    goal: float
    memory_goal_mib: float | None = None

    @property
    def judged(self) -> bool:
        return not math.isinf(self.goal) and (self.cells is None or self.cells >= GOAL_CELLS)

    def verdict(self) -> str:
        if math.isinf(self.goal):
            return ""
        if not self.judged:
            return "(goal at 10k)"
        misses = []
        if self.ratio > self.goal:
            misses.append(f"missed by {self.ratio / self.goal - 1:.0%}")
        if self.memory_goal_mib is not None and self.cost.peak_mib > self.memory_goal_mib:
            misses.append(f"memory missed by {self.cost.peak_mib / self.memory_goal_mib - 1:.0%}")
        return "; ".join(misses) or "met"

    def goal_text(self) -> str:
        if math.isinf(self.goal):
            return "none"
        memory = f", <= {self.memory_goal_mib / GIB:g} GiB" if self.memory_goal_mib is not None else ""
        return f"<= {self.goal:g}x{memory}"


def print_row(row: Row) -> None:
    cells = f"{row.cells:,}" if row.cells is not None else ""
    print(f"| {row.step} | {cells} | {row.cost.cpu:.2f} | {row.cost.wall:.2f} | {row.cost.peak_mib:,.0f} | "
          f"{row.baseline}: {row.base.cpu:.2f} s | {row.ratio:.2f}x | {row.goal_text()} | {row.verdict()} |",
          flush=True)


@dataclass(frozen=True)
class PlanGrid:
    """A shape of grid whose plan is measured: ``of(cells)`` is the grid's overrides at about
    ``cells`` cells, and its exact count of cells."""

    name: str
    of: Callable[[int], tuple[list[str], int]]


def settings_grid(cells: int) -> tuple[list[str], int]:
    """The store's grid: the ``budget_selection`` grid over values of ``backend.router_noise``."""
    shape = Shape.for_cells(cells, 12, BUDGETS)
    return shape.grid_overrides(), shape.cells


def seeds_grid(cells: int) -> tuple[list[str], int]:
    """``none``, ``full`` and ``random`` at 0.5 on the ``smoke`` sweep's backend, over as many seeds as it takes."""
    seeds = math.ceil(cells / 3)
    return ["sweeps=smoke", "policy=none,full,random", "budget=0.5", f"seed=range({seeds})"], 3 * seeds


def budgets_grid(cells: int) -> tuple[list[str], int]:
    """``random`` and ``fisher`` at as many budgets as it takes (spread over (0, 1)), 6 seeds."""
    budgets = math.ceil(cells / 12)
    values = ",".join(f"{round((k + 1) / (budgets + 1), 6):g}" for k in range(budgets))
    return ["policy=random,fisher", f"budget={values}", "seed=range(6)"], 12 * budgets


PLAN_GRIDS = (PlanGrid("many settings", settings_grid), PlanGrid("many seeds", seeds_grid),
              PlanGrid("many budgets", budgets_grid))


def plan_command(overrides: list[str], cells: int, store: Path) -> list[str]:
    return [sys.executable, "-m", "ablate", "-m", *overrides, "hydra.sweeper.dry_run=true", f"store_dir={store}",
            f"sweep=plan-{cells}", "tracking.mode=disabled"]


def plan_rows(sizes: list[int], store: Path, repeats: int) -> list[Row]:
    """Per shape of grid, its plan at each size against its plan at about 100 cells."""
    rows = []
    for grid in PLAN_GRIDS:
        overrides, base_cells = grid.of(PLAN_BASELINE_CELLS)
        base = cheapest(plan_command(overrides, base_cells, store), repeats)
        for size in sizes:
            overrides, cells = grid.of(size)
            cost = cheapest(plan_command(overrides, cells, store), repeats)
            rows.append(Row(f"plan (dry run), {grid.name}", cells, cost, f"plan of {base_cells} cells", base,
                            cost.cpu / base.cpu, 2.0))
            print_row(rows[-1])
    return rows


def profile(out: Path, command: list[str]) -> None:
    """Run ``command`` (``python -c CODE ...`` or ``python -m MODULE ...``) under cProfile in CPU time."""
    subprocess.run([sys.executable, "-c", PROFILE, str(out), *command[1:]], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import pstats

    print(f"\nprofile {out.name} (CPU time, by own time):")
    pstats.Stats(str(out), stream=sys.stdout).sort_stats("tottime").print_stats(12)


def overhead_row(work: Path, small: int, large: int, repeats: int) -> Row:
    env = {**os.environ, "BENCH_OUT": str(work / "bare"), "WANDB_SILENT": "true"}
    slopes = {}
    for label, command in (("bare", bare_command), ("ablate", lambda n: ablate_command(n, str(work), "offline"))):
        low = cheapest(lambda: command(small), repeats, env=env)
        high = cheapest(lambda: command(large), repeats, env=env)
        slopes[label] = Cost((high.cpu - low.cpu) / (large - small), (high.wall - low.wall) / (large - small),
                             high.peak_mib)
    return Row("per-cell sweep overhead (noop backend, W&B offline; per cell)", None, slopes["ablate"],
               "bare Hydra multirun", slopes["bare"], slopes["ablate"].cpu / slopes["bare"].cpu, 1.25)


def help_row(work: Path, repeats: int) -> Row:
    env = {**os.environ, "BENCH_OUT": str(work / "bare")}

    def median(command: list[str]) -> Cost:
        measured(command, env=env, cwd=work)  # fills the OS file cache
        costs = [measured(command, env=env, cwd=work) for _ in range(repeats)]
        return Cost(statistics.median(c.cpu for c in costs), statistics.median(c.wall for c in costs),
                    max(c.peak_mib for c in costs))

    ablate = median([sys.executable, "-m", "ablate", "--help"])
    bare = median([sys.executable, str(HERE / "bare_app" / "app.py"), "--help"])
    return Row(f"`python -m ablate --help` (median of {repeats})", None, ablate, "bare Hydra app --help", bare,
               ablate.cpu / bare.cpu, 1.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,2000,5000,10000",
                        help="store sizes in cells, comma-separated (default: 1000,2000,5000,10000)")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"rows to measure (default: {','.join(STEPS)})")
    parser.add_argument("--store", type=Path, help="where the stores are made, and kept for the next run "
                                                   "(default: a temporary folder, removed at the end)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each plan and analysis measurement; the least CPU counts (default: 1)")
    parser.add_argument("--load-repeats", type=int, default=3,
                        help="runs of each load_runs and plain read measurement (default: 3)")
    parser.add_argument("--help-repeats", type=int, default=5, help="--help processes per arm (default: 5)")
    parser.add_argument("--overhead-cells", default="4,24", help="the two grid sizes of the overhead slope")
    parser.add_argument("--profile", type=Path, help="also write CPU-time cProfile files of load_runs and the "
                                                     "analysis per size into this folder, and print their tops")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",") if size]
    steps = [step for step in args.steps.split(",") if step]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown or not sizes or min(sizes) < 1:
        parser.error(f"--steps {args.steps} / --sizes {args.sizes}: expected steps among {', '.join(STEPS)} "
                     "and positive cell counts")
    root = args.store or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    work = Path(tempfile.mkdtemp(prefix="bench-scale-work-"))
    python = sys.executable
    print(f"{os.cpu_count()} cores; load average at start {os.getloadavg()[0]:.1f}. CPU s: user + sys of the "
          "process and its children; peak: its largest resident memory.\n")
    print("| step | cells | CPU s | wall s | peak MiB | baseline (CPU) | ratio | goal | |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows: list[Row] = []
    try:
        if "plan" in steps:
            rows += plan_rows(sizes, work / "plan", args.repeats)
        for size in sizes:
            shape = Shape.for_cells(size, 12, BUDGETS)
            if not {"load", "analysis"} & set(steps):
                continue
            sweep = root / f"scale-{shape.cells}"
            if not sweep.is_dir():
                make_store(root, size, sources=root / "_sources")
            load = cheapest([python, "-c", LOAD_RUNS, str(sweep)], args.load_repeats)
            if "load" in steps:
                plain = cheapest([python, "-c", PLAIN_READ, str(sweep), "keep"], args.load_repeats)
                rows.append(Row("`load_runs`", shape.cells, load, "plain read of the same files", plain,
                                load.cpu / plain.cpu, 1.5))
                print_row(rows[-1])
                parsed = cheapest([python, "-c", PLAIN_READ, str(sweep), "discard"], args.load_repeats)
                rows.append(Row("`load_runs` (information)", shape.cells, load, "the same read, keeping nothing",
                                parsed, load.cpu / parsed.cpu, math.inf))
                print_row(rows[-1])
            if "analysis" in steps:
                for label, extra in (("analysis with `--report`", []), ("the same with `--no-plots`", ["--no-plots"])):
                    command = [python, "-m", "ablate.analysis", str(sweep), "--report", *extra,
                               "--out", str(work / f"analysis-{shape.cells}")]
                    analysis = cheapest(command, args.repeats)
                    rows.append(Row(label, shape.cells, analysis, "`load_runs`", load, analysis.cpu / load.cpu, 3.0,
                                    memory_goal_mib=GIB))
                    print_row(rows[-1])
            if args.profile:
                args.profile.mkdir(parents=True, exist_ok=True)
                profile(args.profile / f"load_runs-{shape.cells}.prof", [python, "-c", LOAD_RUNS, str(sweep)])
                profile(args.profile / f"analysis-{shape.cells}.prof",
                        [python, "-m", "ablate.analysis", str(sweep), "--report", "--out", str(work / "profiled")])
        if "overhead" in steps:
            small, large = (int(n) for n in args.overhead_cells.split(","))
            rows.append(overhead_row(work, small, large, args.repeats))
            print_row(rows[-1])
        if "help" in steps:
            rows.append(help_row(work, args.help_repeats))
            print_row(rows[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.store is None:
            shutil.rmtree(root, ignore_errors=True)
    print("\nverl hook per micro-batch against one torch.sum: bench/bench_verl_hook.py")
    judged = [row for row in rows if row.judged]
    missed = [row for row in judged if row.verdict() != "met"]
    print(f"load average at the end {os.getloadavg()[0]:.1f}; "
          + (f"every goal judged ({len(judged)}) met" if not missed else f"{len(missed)} of {len(judged)} goals missed"))


if __name__ == "__main__":
    main()
