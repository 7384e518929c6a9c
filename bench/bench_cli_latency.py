"""How long a user waits for ``--help``, tab completion and the plan of a sweep, with baselines.

Every figure is the median wall time of a fresh process, measured in this run:
- ``--help`` of ablate, from the repository root (which holds ``.venv/``) and from a directory
  that looks like a used checkout (a ``.venv/`` link to the real one and a ``runs/`` of many
  cells), next to the ``--help`` of a bare Hydra app (bench/bare_app) as the baseline;
- tab completion (``ablate -sc query=bash`` for ``ablate polic``);
- planning a sweep without running it (``hydra.sweeper.dry_run=true``): ``smoke`` (60 cells)
  and ``budget_selection`` (264 cells), next to ``python -c "import torch"``, a floor that any
  plan pays because validating a cell builds its policy.

    python bench/bench_cli_latency.py [--repeats 5] [--cells 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def timed(command: list[str], cwd: Path, env: dict[str, str], repeats: int) -> float:
    """Median seconds of ``repeats`` runs (after one warm-up run that fills the OS file cache)."""
    subprocess.run(command, cwd=cwd, env=env, check=True, capture_output=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, cwd=cwd, env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def used_checkout(root: Path, cells: int) -> Path:
    """A directory with ``.venv/`` (a link to the real one) and a ``runs/`` of ``cells`` cell folders."""
    root.mkdir(parents=True)
    (root / ".venv").symlink_to(REPO / ".venv" if (REPO / ".venv").exists() else Path(sys.prefix))
    for number in range(cells):
        cell = root / "runs" / f"sweep{number % 10}" / f"random-b0.1-s{number}-0123abcd"
        (cell / "wandb" / "offline-run-x" / "files").mkdir(parents=True)
        for name in ("cell.json", "status.json", "summary.json", "config.yaml", "records.jsonl"):
            (cell / name).write_text("{}\n")
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cells", type=int, default=2000, help="cell folders in the fake runs/ (default: 2000)")
    args = parser.parse_args()
    python = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        env = {**os.environ, "BENCH_OUT": str(tmp_path / "bare"), "WANDB_SILENT": "true",
               "COMP_LINE": "ablate polic"}
        checkout = used_checkout(tmp_path / "checkout", args.cells)
        ablate = [python, "-m", "ablate"]
        figures = {
            "bare Hydra app --help": timed([python, str(HERE / "bare_app" / "app.py"), "--help"], tmp_path, env,
                                           args.repeats),
            "ablate --help (repository root, .venv/)": timed([*ablate, "--help"], REPO, env, args.repeats),
            f"ablate --help (.venv/ and runs/ of {args.cells} cells)": timed([*ablate, "--help"], checkout, env,
                                                                           args.repeats),
            "ablate tab completion (ablate polic<TAB>)": timed([*ablate, "-sc", "query=bash"], checkout, env,
                                                              args.repeats),
            'python -c "import torch"': timed([python, "-c", "import torch"], tmp_path, env, args.repeats),
        }
        for sweep, cells in (("smoke", 60), ("budget_selection", 264)):
            store = tmp_path / f"store-{sweep}"
            figures[f"plan sweeps={sweep} ({cells} cells, dry run)"] = timed(
                [*ablate, f"sweeps={sweep}", "hydra.sweeper.dry_run=true", f"store_dir={store}"], checkout, env,
                args.repeats)
    baseline = figures["bare Hydra app --help"]
    width = max(len(label) for label in figures)
    print(f"median of {args.repeats} fresh processes each (after one warm-up)")
    for label, seconds in figures.items():
        print(f"{label:<{width}}  {seconds:6.2f} s   {seconds / baseline:5.1f}x bare Hydra --help")
    per_cell = (figures["plan sweeps=budget_selection (264 cells, dry run)"]
                - figures["plan sweeps=smoke (60 cells, dry run)"]) / (264 - 60)
    print(f"planning cost per cell (slope between the two sweeps): {per_cell * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
