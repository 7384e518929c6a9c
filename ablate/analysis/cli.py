"""``ablate-analyze``: tables, effects, flags and plots for one sweep of the run store.

    ablate-analyze runs/my-sweep                      # a sweep directory
    ablate-analyze my-sweep --store runs --outcome final_reward --outcome kl_k3_mean
    ablate-analyze runs/noise_test --where backend.steps=5 --by backend.router_noise
    python -m ablate.analysis runs/my-sweep --level 0.9 --reps 5000 --ci BCa --adjust bh --dashboard
    ablate-analyze runs/smoke --primary replay --margin final_reward=0.05 --plan --detect final_reward=0.05 --report

Prints the verdict first (for each outcome and policy: budget, selection, both, neither, or not
determined at these seeds, each answer citing its table rows), then compact tables that fit 100
columns (``--wide``: every column), the flags and the files written. Writes into ``--out``
(default ``<sweep>/analysis``), per outcome: ``table_<outcome>`` (csv, parquet, md, tex),
``effects_<outcome>`` (csv, md), ``budget_response_<outcome>``, ``selection_effects_<outcome>``
and ``effective_budget_<outcome>`` (png, svg); once: ``cells.csv`` (one row per cell), ``flags``
(csv, md) and ``steps`` (png, svg); with ``--plan`` ``power_<outcome>`` (csv, md) and the
command that extends the sweep; with ``--survival``
``survival`` (csv, md) and ``collapse_survival`` (png, svg); with ``--report`` one
self-contained ``report.html``. Errors (no such sweep, a corrupt cell, a bad ``--where``, a bad
option, a missing package, an output that cannot be written) are one line on stderr and exit
status 1.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import numpy as np
import pandas as pd

from ablate.analysis.compare import parse_comparison
from ablate.analysis.compute import analyse, design_lines
from ablate.analysis.export import export_table, to_markdown
from ablate.analysis.extras import MissingExtraError
from ablate.analysis.load import CorruptCellError, ExcludedCellsWarning, find_sweep, load_runs, parse_where, read_sweep
from ablate.analysis.printer import Printer, effects_legend
from ablate.analysis.probe_effects import PROBE_OUTCOMES, across_cells, step_effects, within_run
from ablate.analysis.selectors import parse_selector
from ablate.analysis.settings import INTERVAL_METHODS, AnalysisSettings, parse_outcome_values
from ablate.analysis.stats import ADJUSTMENTS
from ablate.analysis.tables import arm_keys
from ablate.analysis.writer import write_outputs
from ablate.analysis.writing import OutputError, naming
from ablate.outcomes import OUTCOME_NAMES
from ablate.store import StoreError, atomic_write, make_directory
from ablate.terminal import printable_output


class UsageError(ValueError):
    """A bad command-line argument: argparse's message, naming the option."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` instead of printing its usage block and exiting with 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _checked(convert: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse type: ``convert``, then ``ok``; a failure says what was expected (argparse names the option)."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text}: expected {expected}")
        return value
    parse.__name__ = expected
    return parse


def _outcome(text: str) -> str:
    known = sorted({*OUTCOME_NAMES, *PROBE_OUTCOMES})
    if text in known:
        return text
    close = difflib.get_close_matches(text, known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise argparse.ArgumentTypeError(f"{text!r} is not an outcome; {hint}expected one of {', '.join(OUTCOME_NAMES)}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ablate-analyze",
        description="Summary tables, effects (paired by seed, adjusted for multiplicity), flags and plots "
                    "for one sweep of the run store.",
    )
    parser.add_argument("sweep", help="a sweep directory, or a sweep name inside --store")
    parser.add_argument("--store", default="runs", help="run store root used when SWEEP is a name (default: runs)")
    parser.add_argument("--out", type=Path, help="output folder (default: <sweep>/analysis)")
    parser.add_argument(
        "--outcome", action="append", type=_outcome, metavar="NAME",
        help="outcome to analyse, repeatable (default: the sweep's analysis.outcomes, else kl_k3_mean and "
             f"final_reward); one of {', '.join(OUTCOME_NAMES)}",
    )
    parser.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                        help="keep only cells whose config key (or column such as policy_name) has this value, "
                             "repeatable; e.g. --where backend.steps=5")
    parser.add_argument("--by", action="append", metavar="KEY",
                        help="group arms by these keys (besides policy and budget) instead of every config key "
                             "that varies in the sweep, repeatable")
    parser.add_argument("--compare", action="append", default=[], metavar="KEY=A:B",
                        help="also compare two values of one key, paired by seed within every arm, repeatable; "
                             "e.g. --compare policy.per_layer=true:false or --compare policy=mismatch:fisher")
    parser.add_argument("--level", type=_checked(float, lambda v: 0 < v < 1, "a confidence level in (0, 1)"),
                        default=0.95, help="confidence level of intervals (default: 0.95)")
    parser.add_argument("--reps", type=_checked(int, lambda v: v >= 1, "an integer >= 1"), default=2000,
                        help="bootstrap resamples (default: 2000)")
    parser.add_argument("--ci", choices=INTERVAL_METHODS, default="exact",
                        help="interval: exact (default: effects invert the exact sign-flip test, so an interval "
                             "excludes 0 exactly when p < 1 - level; one arm's summary is Student's t), t, or a "
                             "bootstrap: percentile or BCa")
    parser.add_argument("--min-seeds", type=_checked(int, lambda v: v >= 2, "an integer >= 2"), default=None,
                        help="fewest (paired) seeds for an interval (default: the fewest for which an exact "
                             "sign-flip test can reach p < 1 - level: 6 at 0.95)")
    parser.add_argument("--adjust", choices=ADJUSTMENTS, default="holm",
                        help="multiple-comparison adjustment within each outcome's family: holm (default, "
                             "family-wise error), bh (false discovery rate) or none")
    parser.add_argument("--primary", action="append", default=[], metavar="SELECTOR",
                        help="a primary question, repeatable, in the order asked: KIND[:POLICY:BASELINE]"
                             "[@BUDGET|@pooled], e.g. --primary replay --primary selection:fisher:random@pooled; "
                             "tested by serial gatekeeping at the full level, the other rows exploratory "
                             "(default: the sweep's analysis.primary, else none)")
    parser.add_argument("--margin", action="append", default=[], metavar="OUTCOME=MARGIN",
                        help="equivalence margin in the outcome's units, repeatable, added to the sweep's "
                             "analysis.margins: each effect row also tests |effect| < MARGIN (two one-sided "
                             "sign-flip tests), the verdict says 'no effect' only where it holds, and the flags "
                             "judge 'too weak' on that outcome by it; e.g. --margin final_reward=0.05")
    parser.add_argument("--plan", action="store_true",
                        help="also write and print power_<outcome>: per effect row the paired sd, the minimum "
                             "detectable effect at these seeds (80%% power, the exact test, the row's family) and "
                             "the seeds needed, with the command that extends the sweep (the verdict plans the "
                             "rows it reads either way)")
    parser.add_argument("--detect", action="append", default=[], metavar="OUTCOME=EFFECT",
                        help="with --plan: the seeds needed to detect this effect (outcome units) instead of "
                             "the observed one, repeatable; e.g. --detect final_reward=0.05")
    parser.add_argument("--survival", action="store_true",
                        help="also write survival: per arm the collapses, the median step of collapse and a paired "
                             "permutation log-rank p against none, with Kaplan-Meier curves (collapse_survival)")
    parser.add_argument("--report", action="store_true",
                        help="also write report.html: one self-contained file (tables, plots embedded, flags, "
                             "power, a methods paragraph), readable offline; implies --plan")
    parser.add_argument("--seed", type=_checked(int, lambda v: v >= 0, "an integer >= 0"), default=0,
                        help="seed of the bootstrap generators (default: 0)")
    parser.add_argument("--probes", action="store_true",
                        help="analyse the cells' counterfactual probes instead (docs/probes.md): per-cell effects over "
                             "probed steps (conditional on each trajectory) and effects across cells, paired by seed; "
                             f"--outcome one of {', '.join(PROBE_OUTCOMES)} (default: kl_k3_mean)")
    parser.add_argument("--no-plots", action="store_true", help="write tables and effects only")
    parser.add_argument("--wide", action="store_true",
                        help="print every column of every table (the files always hold them all)")
    parser.add_argument("--skip-corrupt", action="store_true", help="exclude (and list) unreadable cells instead of failing")
    parser.add_argument("--dashboard", action="store_true",
                        help="also write the W&B workspace spec, log the summary table to the sweep's W&B summary "
                             "run (offline unless --wandb-mode online) and save the workspace when logged in")
    parser.add_argument("--entity", default=None, help="W&B entity for --dashboard")
    parser.add_argument("--project", default="ablate", help="W&B project for --dashboard (default: ablate)")
    parser.add_argument("--wandb-mode", default="offline", choices=("offline", "online"), help="mode of the summary run")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    printable_output()
    arguments = sys.argv[1:] if argv is None else list(argv)
    # Library warnings (matplotlib, pandas, numpy, W&B) stay off the console: each says something of the
    # library's own workings, at a line of its caller. What matters to the user ablate says in its own words
    # (its own warning classes), once each, after the output.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return _main(arguments)
        finally:
            for message in dict.fromkeys(str(w.message) for w in caught if w.category.__module__.startswith("ablate")):
                print(f"ablate-analyze: warning: {message}", file=sys.stderr)


def _main(arguments: list[str]) -> int:
    try:
        args = build_parser().parse_args(arguments)
        # Records near the float limit overflow in a mean: the rows say inf, the console no warning.
        with np.errstate(over="ignore"):
            return _analyse(args, parse_where(args.where))
    except UsageError as error:
        print(f"ablate-analyze: {error}{_dash_hint(arguments)} (ablate-analyze --help lists the options)",
              file=sys.stderr)
        return 1
    except (FileNotFoundError, CorruptCellError, MissingExtraError, StoreError, OutputError, ValueError,
            KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
        if isinstance(error, CorruptCellError):
            message += " (--skip-corrupt analyses the other cells)"
        print(f"ablate-analyze: {message}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"ablate-analyze: {error.filename or ''}: {error.strerror or error}", file=sys.stderr)
        return 1


def _dash_hint(arguments: Sequence[str]) -> str:
    """Where a sweep path that starts with ``-`` was read as an option: how to write it."""
    for text in arguments:
        if text == "--":
            break
        if text.startswith("-") and not text.startswith("--") and ("/" in text or Path(text).exists()):
            return f"; {text} was read as an option: write a path that starts with '-' as ./{text}, or after --"
    return ""


def _sweep_directory(args: argparse.Namespace) -> Path:
    given = Path(args.sweep)
    if given.is_dir():
        return find_sweep(given)
    store = Path(args.store)
    if (store / args.sweep).is_dir():
        return find_sweep(store, args.sweep)
    known = sorted(p.parent.parent.name for p in store.glob("*/*/cell.json")) if store.is_dir() else []
    there = f"; sweeps there: {', '.join(sorted(set(known)))}" if known else ""
    raise FileNotFoundError(f"{args.sweep}: no such sweep directory, and no sweep {args.sweep!r} in the store {store}{there}")


def _analyse(args: argparse.Namespace, where: dict[str, Any]) -> int:
    """Load, then compute (:mod:`~ablate.analysis.compute`), write (:mod:`~ablate.analysis.writer`) and print
    (:mod:`~ablate.analysis.printer`)."""
    comparisons = [parse_comparison(text) for text in args.compare]  # a typo fails before any work
    for text in args.primary:
        parse_selector(text)
    margins = parse_outcome_values(args.margin, OUTCOME_NAMES, "--margin")
    detect = parse_outcome_values(args.detect, OUTCOME_NAMES, "--detect")
    directory = _sweep_directory(args)
    if args.probes:
        return _analyse_probes(args, where, directory)
    wrong = [name for name in args.outcome or () if name not in OUTCOME_NAMES]
    if wrong:
        raise ValueError(f"--outcome {wrong[0]} is a probe outcome: add --probes, or use one of {', '.join(OUTCOME_NAMES)}")
    out = args.out or directory / "analysis"
    on_corrupt = "exclude" if args.skip_corrupt else "error"
    with warnings.catch_warnings():
        # load_runs also logs the exclusion; the CLI prints it once, below, in its own words.
        warnings.simplefilter("ignore", ExcludedCellsWarning)
        read = read_sweep(directory, on_corrupt=on_corrupt, where=where)  # one read for both frames
    cells = read.cells_frame()
    steps = read.steps_frame() if not args.no_plots or args.survival else None
    excluded = cells.attrs["excluded"]
    print(f"sweep {directory}: {len(cells)} complete cells")
    print("excluded: " + ", ".join(f"{kind}={n}" for kind, n in excluded.items()))
    for problem in cells.attrs["corrupt_files"]:
        print(f"  corrupt: {problem}")
    if cells.empty:
        print("ablate-analyze: no complete cells to analyse", file=sys.stderr)
        return 1
    settings = AnalysisSettings(by=args.by, level=args.level, reps=args.reps, seed=args.seed, method=args.ci,
                                min_seeds=args.min_seeds, adjust=args.adjust, primary=tuple(args.primary) or None,
                                margins=margins)
    keys = arm_keys(cells, args.by)
    design = design_lines(cells, keys, where)
    for line in design:
        print(line)
    plan = args.plan or args.report
    result = analyse(cells, steps, outcomes=args.outcome, settings=settings, comparisons=comparisons,
                     detect=detect, survival=args.survival, full_plan=plan)
    written = write_outputs(result, out, plots=not args.no_plots, report=args.report, plan=plan,
                            sweep=directory.name,
                            report_design=[f"{len(cells)} complete cells; " + design[0], *design[1:]])
    Printer(width=_width(), wide=args.wide).analysis(result, written, plan=plan)
    if args.dashboard:
        first = next(iter(result.outcomes.values()))
        _dashboard(args, directory.name, first.summary, result.keys, out)
    print(f"\nwrote tables, effects{'' if written.plots_skipped or args.no_plots else ' and plots'} to {out}")
    return 0


def _width() -> int:
    """The width printed lines keep to: the terminal's (``COLUMNS``), at most 100 and at least 60."""
    return max(60, min(100, shutil.get_terminal_size((100, 24)).columns))


def _analyse_probes(args: argparse.Namespace, where: dict[str, Any], directory: Path) -> int:
    """``--probes``: per-step probe effects, their per-cell means (HAC) and effects across cells."""
    outcomes = args.outcome or ["kl_k3_mean"]
    wrong = [name for name in outcomes if name not in PROBE_OUTCOMES]
    if wrong:
        raise ValueError(f"--outcome {wrong[0]} with --probes: expected one of {', '.join(PROBE_OUTCOMES)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExcludedCellsWarning)
        steps = load_runs(directory, per_step=True, on_corrupt="exclude" if args.skip_corrupt else "error", where=where)
    table = steps.attrs["probes"]
    print(f"sweep {directory}: {steps['cell_id'].nunique() if not steps.empty else 0} complete cells, "
          f"{len(table)} probes: {', '.join(table) or '-'}")
    if not table:
        print("ablate-analyze: no cell of this sweep has probes (set probes=[...] when running it)", file=sys.stderr)
        return 1
    out = args.out or directory / "analysis"
    with naming(out):
        make_directory(out, "the analysis output folder")
    for outcome in outcomes:
        per_step = step_effects(steps, table, PROBE_OUTCOMES[outcome])
        runs = within_run(per_step, level=args.level)
        across = across_cells(steps, table, outcome, level=args.level, reps=args.reps, seed=args.seed,
                              method=args.ci, min_seeds=args.min_seeds, adjust=args.adjust)
        with naming(out / f"probe_steps_{outcome}.csv"):
            atomic_write(out / f"probe_steps_{outcome}.csv", lambda tmp: per_step.to_csv(tmp, index=False))
            export_table(runs, out / f"probe_within_run_{outcome}", formats=("csv", "md"))
            export_table(across, out / f"probe_effects_{outcome}", formats=("csv", "md"))
        print(f"\n## probe effects on {outcome}, per cell: mean over its probed steps, {args.level:.0%} HAC interval, "
              "conditional on that cell's trajectory\n")
        print(to_markdown(runs.drop(columns=["cell_id", "note"]), escape_html=False))
        print(f"\n## probe effects on {outcome} across cells (per-cell means over probed steps, paired by seed)\n")
        print("\n".join(effects_legend(across, compact=False)))
        print()
        print(to_markdown(across, escape_html=False))
    print(f"\nwrote probe tables to {out}")
    return 0


def _dashboard(args: argparse.Namespace, sweep: str, table: pd.DataFrame, keys: list[str], out: Path) -> None:
    from ablate.analysis.dashboard import build_workspace, log_summary_table, save_workspace, write_workspace_spec

    workspace = build_workspace(args.entity or "", args.project, sweep, arm_keys=keys)
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
