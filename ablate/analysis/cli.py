"""``ablate-analyze``: tables, effects and plots for one sweep of the run store.

    ablate-analyze runs/my-sweep                      # a sweep directory
    ablate-analyze my-sweep --store runs --outcome final_reward --outcome kl_k3_mean
    python -m ablate.analysis runs/my-sweep --level 0.9 --reps 5000 --dashboard

Writes into ``--out`` (default ``<sweep_dir>/analysis``), per outcome: ``table_<outcome>``
(csv, parquet, md, tex), ``effects_<outcome>`` (csv, md), ``budget_response_<outcome>`` and
``selection_effects_<outcome>`` (png, svg); once: ``cells.csv`` (one row per cell), ``flags``
(csv, md) and ``steps`` (png, svg). Prints the tables as markdown and the excluded cells.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Sequence

from ablate.analysis.export import export_table, to_markdown
from ablate.analysis.flags import flag_policies
from ablate.analysis.load import ExcludedCellsWarning, load_runs
from ablate.analysis.outcomes import OUTCOME_NAMES
from ablate.analysis.tables import effects, summarize


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ablate-analyze",
        description="Summary tables, effects (paired by seed) and plots for one sweep of the run store.",
    )
    parser.add_argument("sweep", help="a sweep directory, or a sweep name inside --store")
    parser.add_argument("--store", default="runs", help="run store root used when SWEEP is a name (default: runs)")
    parser.add_argument("--out", type=Path, help="output folder (default: <sweep_dir>/analysis)")
    parser.add_argument(
        "--outcome", action="append", choices=OUTCOME_NAMES, metavar="NAME",
        help=f"outcome to analyse, repeatable (default: final_reward); one of {', '.join(OUTCOME_NAMES)}",
    )
    parser.add_argument("--level", type=float, default=0.95, help="confidence level of intervals (default: 0.95)")
    parser.add_argument("--reps", type=int, default=2000, help="bootstrap resamples (default: 2000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap generators (default: 0)")
    parser.add_argument("--no-plots", action="store_true", help="write tables and effects only")
    parser.add_argument("--skip-corrupt", action="store_true", help="exclude (and list) unreadable cells instead of failing")
    parser.add_argument("--dashboard", action="store_true",
                        help="also write the W&B workspace spec, log the summary table to W&B "
                             "(offline unless --wandb-mode online) and save the workspace when logged in")
    parser.add_argument("--entity", default=None, help="W&B entity for --dashboard")
    parser.add_argument("--project", default="ablate", help="W&B project for --dashboard (default: ablate)")
    parser.add_argument("--wandb-mode", default="offline", choices=("offline", "online"), help="mode of the summary run")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sweep_dir = Path(args.sweep) if Path(args.sweep).is_dir() else Path(args.store) / args.sweep
    out = args.out or sweep_dir / "analysis"
    outcomes = args.outcome or ["final_reward"]
    on_corrupt = "exclude" if args.skip_corrupt else "error"

    with warnings.catch_warnings():
        # load_runs also logs the exclusion; the CLI prints it once, below, in its own words.
        warnings.simplefilter("ignore", ExcludedCellsWarning)
        cells = load_runs(sweep_dir, on_corrupt=on_corrupt)
        steps = load_runs(sweep_dir, per_step=True, on_corrupt=on_corrupt)
    excluded = cells.attrs["excluded"]
    print(f"sweep {sweep_dir}: {len(cells)} complete cells; excluded: "
          + ", ".join(f"{kind}={n}" for kind, n in excluded.items()))
    for problem in cells.attrs["corrupt_files"]:
        print(f"  corrupt: {problem}")
    if cells.empty:
        print("no complete cells to analyse", file=sys.stderr)
        return 1

    out.mkdir(parents=True, exist_ok=True)
    cells.to_csv(out / "cells.csv", index=False)
    summaries = {}
    for outcome in outcomes:
        table = summarize(cells, outcome, level=args.level, reps=args.reps, seed=args.seed)
        effect_table = effects(cells, outcome, level=args.level, reps=args.reps, seed=args.seed, others_vs_random=True)
        export_table(table, out / f"table_{outcome}")
        export_table(effect_table, out / f"effects_{outcome}", formats=("csv", "md"))
        if not args.no_plots:
            from ablate.analysis import plots

            plots.plot_budget_response(table, out / f"budget_response_{outcome}")
            plots.plot_selection_effects(effect_table, out / f"selection_effects_{outcome}")
        summaries[outcome] = table
        print(f"\n## {outcome}: mean over seeds, {args.level:.0%} bootstrap CI\n")
        print(to_markdown(table))
        print(f"\n## effects on {outcome} (paired by seed; p: two-sided sign-flip test)\n")
        print(to_markdown(effect_table))
    flags = flag_policies(cells)
    export_table(flags, out / "flags", formats=("csv", "md"))
    flagged = flags[flags["too_restrictive"] | flags["too_weak"]] if not flags.empty else flags
    print("\n## flags\n")
    print(to_markdown(flagged[["reason"]]) if not flagged.empty else "no policy flagged as too restrictive or too weak")
    if not args.no_plots:
        from ablate.analysis import plots

        plots.plot_step_curves(steps, out / "steps")
    if args.dashboard:
        _dashboard(args, sweep_dir.name, summaries[outcomes[0]], out)
    print(f"\nwrote tables, effects{'' if args.no_plots else ' and plots'} to {out}")
    return 0


def _dashboard(args: argparse.Namespace, sweep: str, table, out: Path) -> None:
    from ablate.analysis.dashboard import build_workspace, log_summary_table, save_workspace, write_workspace_spec

    workspace = build_workspace(args.entity or "", args.project, sweep)
    print(f"W&B workspace spec: {write_workspace_spec(workspace, out / 'workspace.json')}")
    run_dir = log_summary_table(table, project=args.project, entity=args.entity, group=sweep,
                                mode=args.wandb_mode, dir=out)
    print(f"summary table logged to W&B run {run_dir} ({args.wandb_mode})")
    if args.entity is None:
        print("workspace not saved: pass --entity to save it to W&B")
        return
    try:
        print(f"W&B workspace saved: {save_workspace(workspace)}")
    except RuntimeError as error:
        print(f"workspace not saved: {error}")
