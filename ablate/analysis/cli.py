"""``ablate-analyze``: tables, effects, flags and plots for one sweep of the run store.

    ablate-analyze runs/my-sweep                      # a sweep directory
    ablate-analyze my-sweep --store runs --outcome final_reward --outcome kl_k3_mean
    ablate-analyze runs/noise_test --where backend.steps=5 --by backend.router_noise
    python -m ablate.analysis runs/my-sweep --level 0.9 --reps 5000 --ci BCa --adjust bh --dashboard
    ablate-analyze runs/smoke --primary replay --margin final_reward=0.05 --plan --detect final_reward=0.05 --report

Writes into ``--out`` (default ``<sweep_dir>/analysis``), per outcome: ``table_<outcome>``
(csv, parquet, md, tex), ``effects_<outcome>`` (csv, md), ``budget_response_<outcome>``,
``selection_effects_<outcome>`` and ``effective_budget_<outcome>`` (png, svg); once:
``cells.csv`` (one row per cell), ``flags`` (csv, md) and ``steps`` (png, svg); with ``--plan``
``power_<outcome>`` (csv, md) and the command that extends the sweep; with ``--survival``
``survival`` (csv, md) and ``collapse_survival`` (png, svg); with ``--report`` one self-contained
``report.html``. Prints the tables as markdown and the excluded cells. Errors (no such sweep, a corrupt cell, a bad
``--where``, a missing package) are one line on stderr and exit status 1 (2 for usage).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

import pandas as pd
import yaml

from ablate.analysis.export import export_table, to_markdown
from ablate.analysis.extras import MissingExtraError
from ablate.analysis.compare import compare_values, parse_comparison
from ablate.analysis.dropped import dropped_line
from ablate.analysis.flags import flag_policies
from ablate.analysis.load import CorruptCellError, ExcludedCellsWarning, load_runs, parse_where, sweep_dir
from ablate.outcomes import OUTCOME_NAMES
from ablate.analysis.families import parse_selector
from ablate.analysis.probes import PROBE_OUTCOMES, across_cells, step_effects, within_run
from ablate.analysis.settings import INTERVAL_METHODS, AnalysisSettings, parse_outcome_values
from ablate.analysis.stats import ADJUSTMENTS, min_achievable_pvalue
from ablate.policies.roles import FULL_REPLAY, NO_REPLAY
from ablate.analysis.tables import arm_keys, effects, summarize
from ablate.store import StoreError, atomic_write, make_directory


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ablate-analyze",
        description="Summary tables, effects (paired by seed, adjusted for multiplicity), flags and plots "
                    "for one sweep of the run store.",
    )
    parser.add_argument("sweep", help="a sweep directory, or a sweep name inside --store")
    parser.add_argument("--store", default="runs", help="run store root used when SWEEP is a name (default: runs)")
    parser.add_argument("--out", type=Path, help="output folder (default: <sweep_dir>/analysis)")
    parser.add_argument(
        "--outcome", action="append", choices=sorted({*OUTCOME_NAMES, *PROBE_OUTCOMES}), metavar="NAME",
        help=f"outcome to analyse, repeatable (default: final_reward); one of {', '.join(OUTCOME_NAMES)}",
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
    parser.add_argument("--level", type=float, default=0.95, help="confidence level of intervals (default: 0.95)")
    parser.add_argument("--reps", type=int, default=2000, help="bootstrap resamples (default: 2000)")
    parser.add_argument("--ci", choices=INTERVAL_METHODS, default="exact",
                        help="interval: exact (default: effects invert the exact sign-flip test, so an interval "
                             "excludes 0 exactly when p < 1 - level; one arm's summary is Student's t), t, or a "
                             "bootstrap: percentile or BCa")
    parser.add_argument("--min-seeds", type=int, default=None,
                        help="fewest (paired) seeds for an interval (default: the fewest for which an exact "
                             "sign-flip test can reach p < 1 - level: 6 at 0.95)")
    parser.add_argument("--adjust", choices=ADJUSTMENTS, default="holm",
                        help="multiple-comparison adjustment within each outcome's family: holm (default, "
                             "family-wise error), bh (false discovery rate) or none")
    parser.add_argument("--primary", action="append", default=[], metavar="SELECTOR",
                        help="a primary question, repeatable, in the order asked: KIND[:POLICY:BASELINE]"
                             "[@BUDGET|@pooled], e.g. --primary replay --primary selection:fisher:random@pooled; "
                             "tested by serial gatekeeping at the full level, the other rows exploratory "
                             "(default: analysis.primary of the sweep file, else none)")
    parser.add_argument("--margin", action="append", default=[], metavar="OUTCOME=MARGIN",
                        help="equivalence margin in the outcome's units, repeatable: each effect row also tests "
                             "|effect| < MARGIN (two one-sided sign-flip tests), and the flags judge 'too weak' on "
                             "that outcome by it; e.g. --margin final_reward=0.05")
    parser.add_argument("--plan", action="store_true",
                        help="also write power_<outcome>: per effect row the paired sd, the minimum detectable "
                             "effect at these seeds (80%% power, the exact test, the row's family) and the seeds "
                             "needed, with the command that extends the sweep")
    parser.add_argument("--detect", action="append", default=[], metavar="OUTCOME=EFFECT",
                        help="with --plan: the seeds needed to detect this effect (outcome units) instead of "
                             "the observed one, repeatable; e.g. --detect final_reward=0.05")
    parser.add_argument("--survival", action="store_true",
                        help="also write survival: per arm the collapses, the median step of collapse and a paired "
                             "permutation log-rank p against none, with Kaplan-Meier curves (collapse_survival)")
    parser.add_argument("--report", action="store_true",
                        help="also write report.html: one self-contained file (tables, plots embedded, flags, "
                             "power, a methods paragraph), readable offline; implies --plan")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap generators (default: 0)")
    parser.add_argument("--probes", action="store_true",
                        help="analyse the cells' counterfactual probes instead (docs/probes.md): per-cell effects over "
                             "probed steps (conditional on each trajectory) and effects across cells, paired by seed; "
                             f"--outcome one of {', '.join(PROBE_OUTCOMES)} (default: kl_k3_mean)")
    parser.add_argument("--no-plots", action="store_true", help="write tables and effects only")
    parser.add_argument("--skip-corrupt", action="store_true", help="exclude (and list) unreadable cells instead of failing")
    parser.add_argument("--dashboard", action="store_true",
                        help="also write the W&B workspace spec, log the summary table to the sweep's W&B summary "
                             "run (offline unless --wandb-mode online) and save the workspace when logged in")
    parser.add_argument("--entity", default=None, help="W&B entity for --dashboard")
    parser.add_argument("--project", default="ablate", help="W&B project for --dashboard (default: ablate)")
    parser.add_argument("--wandb-mode", default="offline", choices=("offline", "online"), help="mode of the summary run")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _analyse(args, parse_where(args.where))
    except (FileNotFoundError, CorruptCellError, MissingExtraError, StoreError, ValueError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
        if isinstance(error, CorruptCellError):
            message += " (--skip-corrupt analyses the other cells)"
        print(f"ablate-analyze: {message}", file=sys.stderr)
        return 1


def _sweep_dir(args: argparse.Namespace) -> Path:
    given = Path(args.sweep)
    if given.is_dir():
        return sweep_dir(given)
    store = Path(args.store)
    if (store / args.sweep).is_dir():
        return sweep_dir(store, args.sweep)
    known = sorted(p.parent.parent.name for p in store.glob("*/*/cell.json")) if store.is_dir() else []
    there = f"; sweeps there: {', '.join(sorted(set(known)))}" if known else ""
    raise FileNotFoundError(f"{args.sweep}: no such sweep directory, and no sweep {args.sweep!r} in the store {store}{there}")


def _analyse(args: argparse.Namespace, where: dict[str, Any]) -> int:
    comparisons = [parse_comparison(text) for text in args.compare]  # a typo fails before any work
    for text in args.primary:
        parse_selector(text)
    margins = parse_outcome_values(args.margin, OUTCOME_NAMES, "--margin")
    detect = parse_outcome_values(args.detect, OUTCOME_NAMES, "--detect")
    directory = _sweep_dir(args)
    if args.probes:
        return _analyse_probes(args, where, directory)
    out = args.out or directory / "analysis"
    outcomes = args.outcome or ["final_reward"]
    wrong = [name for name in outcomes if name not in OUTCOME_NAMES]
    if wrong:
        raise ValueError(f"--outcome {wrong[0]} is a probe outcome: add --probes, or use one of {', '.join(OUTCOME_NAMES)}")
    on_corrupt = "exclude" if args.skip_corrupt else "error"
    with warnings.catch_warnings():
        # load_runs also logs the exclusion; the CLI prints it once, below, in its own words.
        warnings.simplefilter("ignore", ExcludedCellsWarning)
        cells = load_runs(directory, on_corrupt=on_corrupt, where=where)
        steps = (load_runs(directory, per_step=True, on_corrupt=on_corrupt, where=where)
                 if not args.no_plots or args.survival else None)
    excluded = cells.attrs["excluded"]
    print(f"sweep {directory}: {len(cells)} complete cells; excluded: "
          + ", ".join(f"{kind}={n}" for kind, n in excluded.items()))
    for problem in cells.attrs["corrupt_files"]:
        print(f"  corrupt: {problem}")
    if cells.empty:
        print("ablate-analyze: no complete cells to analyse", file=sys.stderr)
        return 1
    keys = arm_keys(cells, args.by)
    primary = tuple(args.primary) or sweep_primary(cells)
    settings = AnalysisSettings(by=tuple(keys), level=args.level, reps=args.reps, seed=args.seed, method=args.ci,
                                min_seeds=args.min_seeds, adjust=args.adjust, primary=primary, margins=margins)
    _print_design(cells, keys, where, args)

    make_directory(out, "the analysis output folder")
    atomic_write(out / "cells.csv", lambda tmp: cells.to_csv(tmp, index=False))
    plots = None if args.no_plots else _plots_module()
    summaries = {}
    plans: dict[str, pd.DataFrame] = {}
    effect_tables: dict[str, pd.DataFrame] = {}
    images: dict[str, list[Path]] = {}
    for outcome in outcomes:
        table = summarize(cells, outcome, settings=settings)
        effect_table = effects(cells, outcome, settings=settings)
        export_table(table, out / f"table_{outcome}")
        export_table(effect_table, out / f"effects_{outcome}", formats=("csv", "md"))
        if plots is not None:
            written = plots.plot_budget_response(table, out / f"budget_response_{outcome}")
            written += plots.plot_selection_effects(effect_table, out / f"selection_effects_{outcome}")
            if "effective_budget_mean" in cells.columns:
                written += plots.plot_effective_budget(cells, out / f"effective_budget_{outcome}", outcome=outcome,
                                                       by=keys)
            images[outcome] = [path for path in written if path.suffix == ".png"]
        summaries[outcome] = table
        effect_tables[outcome] = effect_table
        print(f"\n## {outcome}: mean over seeds, {args.level:.0%} {table.attrs['interval']} interval "
              f"(none below {table.attrs['min_seeds']} seeds)\n")
        dropped = dropped_line(cells, outcome)
        if dropped is not None:
            print(dropped + "\n")
        print(to_markdown(table))
        print(f"\n## effects on {outcome} (paired by seed)\n")
        print(_effects_legend(effect_table))
        print()
        print(to_markdown(effect_table))
        if args.plan or args.report:
            plans[outcome] = _plan(effect_table, detect.get(outcome), out / f"power_{outcome}")
        for key, a, b in comparisons:
            compared = compare_values(cells, outcome, key, a, b, settings=settings)
            export_table(compared, out / f"compare_{_file_part(key)}_{outcome}", formats=("csv", "md"))
            print(f"\n## {outcome}: {key}={a} - {key}={b} (paired by seed within each arm; p_adj: "
                  f"{args.adjust} over the per-budget rows, pooled rows apart)\n")
            print(to_markdown(compared.drop(columns=["compare", "effect"])))
    if plans:
        _print_extension(cells, plans, primary)
    flags = flag_policies(cells, settings=settings)
    export_table(flags, out / "flags", formats=("csv", "md"))
    print(f"\n## flags (against none and full of the same sweep, at level {args.level:g}, "
          f"p adjusted ({args.adjust}) over the questions of each context)\n")
    print(_flags_text(flags))
    if plots is not None and steps is not None:
        images[""] = [path for path in plots.plot_step_curves(steps, out / "steps", by=keys) if path.suffix == ".png"]
    survival = None
    if args.survival and steps is not None:
        from ablate.analysis.survival import collapse_times, survival_table

        times = collapse_times(steps, keys)
        survival = survival_table(times, keys, seed=args.seed)
        export_table(survival, out / "survival", formats=("csv", "md"))
        print("\n## time to collapse (collapse: the collapsed outcome's rule; censored at the last step; "
              "p: paired permutation log-rank test against none)\n")
        print(to_markdown(survival))
        if plots is not None:
            images[""] += [path for path in plots.plot_collapse_survival(times, out / "collapse_survival", by=keys)
                           if path.suffix == ".png"]
    if args.report:
        from ablate.analysis.report import write_report

        per_arm = cells.groupby([*keys, "policy", "budget"], dropna=False)["seed"].nunique()
        n_seeds = f"{per_arm.min()}" if per_arm.min() == per_arm.max() else f"{per_arm.min()} to {per_arm.max()}"
        design = [f"{len(cells)} complete cells; arms: {' x '.join(['policy', 'budget', *keys])}",
                  f"seeds per arm: {n_seeds}"] + ([f"where {', '.join(f'{k}={v}' for k, v in where.items())}"]
                                                 if where else [])
        report = write_report(out / "report.html", sweep=directory.name, design=design, summaries=summaries,
                              effect_tables=effect_tables, plans=plans, flags=flags, images=images,
                              n_seeds=n_seeds, survival=survival)
        print(f"report: {report}")
    if args.dashboard:
        _dashboard(args, directory.name, summaries[outcomes[0]], keys, out)
    print(f"\nwrote tables, effects{'' if plots is None else ' and plots'} to {out}")
    return 0


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
    out.mkdir(parents=True, exist_ok=True)
    for outcome in outcomes:
        per_step = step_effects(steps, table, PROBE_OUTCOMES[outcome])
        runs = within_run(per_step, level=args.level)
        across = across_cells(steps, table, outcome, level=args.level, reps=args.reps, seed=args.seed,
                              method=args.ci, min_seeds=args.min_seeds, adjust=args.adjust)
        per_step.to_csv(out / f"probe_steps_{outcome}.csv", index=False)
        export_table(runs, out / f"probe_within_run_{outcome}", formats=("csv", "md"))
        export_table(across, out / f"probe_effects_{outcome}", formats=("csv", "md"))
        print(f"\n## probe effects on {outcome}, per cell: mean over its probed steps, {args.level:.0%} HAC interval, "
              "conditional on that cell's trajectory\n")
        print(to_markdown(runs.drop(columns=["cell_id", "note"])))
        print(f"\n## probe effects on {outcome} across cells (per-cell means over probed steps, paired by seed)\n")
        print(_effects_legend(across))
        print()
        print(to_markdown(across))
    print(f"\nwrote probe tables to {out}")
    return 0


def sweep_primary(cells: pd.DataFrame) -> tuple[str, ...]:
    """``analysis.primary`` of the sweep file, as the cells' resolved configs recorded it.

    Every cell of a sweep must agree (they were started from one file); none recorded: no
    primary questions.
    """
    found: dict[tuple[str, ...], str] = {}
    for cell_dir in dict.fromkeys(cells["path"]):
        config = yaml.safe_load((Path(cell_dir) / "config.yaml").read_text()) or {}
        primary = tuple(str(text) for text in (config.get("analysis") or {}).get("primary") or ())
        found.setdefault(primary, str(cell_dir))
    if len(found) > 1:
        raise ValueError(f"analysis.primary differs between cells of this sweep ({'; '.join(map(str, found))}); "
                         "pass --primary to choose")
    selectors = next(iter(found), ())
    for text in selectors:
        parse_selector(text, "analysis.primary")
    return selectors


def _plan(effect_table: pd.DataFrame, detect: float | None, stem: Path) -> pd.DataFrame:
    from ablate.analysis.power import plan

    planned = plan(effect_table, detect=detect)
    export_table(planned, stem, formats=("csv", "md"))
    outcome = effect_table.attrs["outcome"]
    print(f"\n## power and seeds for {outcome} (80% power, exact sign-flip test simulated, each row at "
          "alpha over its family's size)\n")
    shown = [c for c in planned.columns if c not in ("pooled",)]
    print(to_markdown(planned[shown]))
    return planned


def _print_extension(cells: pd.DataFrame, plans: dict[str, pd.DataFrame], primary: tuple[str, ...]) -> None:
    from ablate.analysis.families import parse_selector as selector
    from ablate.analysis.power import extension_command, seeds_to_run

    rows = {}
    for outcome, table in plans.items():
        if primary:
            mask = pd.Series(False, index=table.index)
            for text in primary:
                mask |= selector(text).matches(table)
        else:
            mask = table["effect"] == "replay"
        rows[outcome] = mask
    seeds = seeds_to_run(plans, rows)
    policies = sorted({name for outcome, table in plans.items()
                       for name in (*table.loc[rows[outcome], "policy"], *table.loc[rows[outcome], "baseline"])})
    fixed = (NO_REPLAY, FULL_REPLAY)
    policies = [p for p in fixed if p in policies] + [p for p in policies if p not in fixed]
    what = "the primary rows" if primary else "the replay rows"
    sweep = str(cells["sweep"].iloc[0]) if "sweep" in cells.columns else "SWEEP"
    current = int(cells["seed"].nunique())
    if seeds is None:
        print(f"\nno seed count up to 64 gives 80% power for {what}")
    elif seeds <= current:
        print(f"\n{what} need {seeds} seeds for 80% power; the sweep has {current}")
    else:
        print(f"\n{what} need {seeds} seeds for 80% power (the sweep has {current}); extend it with:\n"
              f"  {extension_command(sweep, seeds, policies)}")


def _plots_module() -> Any:
    """The plotting module, or None (and a line saying why) on an install without matplotlib."""
    try:
        from ablate.analysis import plots
    except MissingExtraError as error:
        print(f"plots skipped: {error}")
        return None
    return plots


def _print_design(cells: pd.DataFrame, keys: list[str], where: dict[str, Any], args: argparse.Namespace) -> None:
    arms = " x ".join(["policy", "budget", *keys])
    print(f"arms: {arms}" + (f"; where {', '.join(f'{k}={v}' for k, v in where.items())}" if where else ""))
    determined: dict[str, str] = cells.attrs.get("determined_keys", {})
    for key in sorted(set(determined.values()) & set(keys)):
        print(f"  {key} also sets {', '.join(sorted(k for k, by in determined.items() if by == key))}")
    per_arm = cells.groupby([*keys, "policy", "budget"], dropna=False)["seed"].nunique()
    if per_arm.empty:
        return
    low, high = int(per_arm.min()), int(per_arm.max())
    print(f"seeds per arm: {low if low == high else f'{low} to {high}'}")


def _effects_legend(table: pd.DataFrame) -> str:
    """What the p-value columns mean, and the smallest adjusted p these seeds allow."""
    attrs = table.attrs
    adjust = {"holm": "Holm (family-wise error)", "bh": "Benjamini-Hochberg (false discovery rate)",
              "none": "not adjusted"}[attrs["adjust"]]
    families = "; ".join(f"{name}: {n} tests" for name, n in attrs["families"].items() if n)
    level = f"{attrs['level']:.0%}"
    interval = {"exact": "inverts the exact sign-flip test (excludes 0 exactly when p_value < "
                         f"{1 - attrs['level']:.2g})", "t": "Student's t of the paired differences"}.get(
        attrs["method"], f"{attrs['method']} bootstrap of the paired differences")
    lines = [
        f"- ci_low/ci_high: UNADJUSTED {level} interval of the mean difference; it {interval}",
        f"- ci_adj_low/ci_adj_high: {level} interval ADJUSTED to the row's family, as p_adj (it excludes 0 "
        "exactly when p_adj < " f"{1 - attrs['level']:.2g}; -inf/inf: these seeds or this family allow no claim)",
        f"- p_value: two-sided exact sign-flip test; p_adj: {adjust} within each family"
        + (", primary gates by serial gatekeeping in the order given" if attrs["primary"] else ""),
        f"- families: {families or 'no tests'}",
        f"- prob_improvement: probability that a run of the policy beats a run of the baseline, unpaired "
        f"({attrs['improvement']}); share_improved: share of seeds whose own paired difference improved",
        "- matched_selection: the policy against random's budget-response curve at the policy's effective budget",
    ]
    if attrs.get("margin"):
        lines.append(f"- p_equiv: equivalence (two one-sided sign-flip tests) of |effect| < {attrs['margin']:g}; "
                     "p_equiv_adj: Holm within the row's family, over all primary rows together for a primary row; "
                     "claim: differs (p_adj), within ±margin (p_equiv_adj), else inconclusive")
    tested = table["n_seeds"][table["p_value"].notna()]
    if not tested.empty and attrs["adjust"] == "holm":
        n = int(tested.max())
        m = max(attrs["families"].values())
        smallest = min(1.0, m * min_achievable_pvalue(n))
        lines.append(f"- with {n} seeds the smallest p is {min_achievable_pvalue(n):.3g}; after Holm in a family "
                     f"of {m} tests the smallest p_adj is {smallest:.3g}")
    return "\n".join(lines)


def _flags_text(flags: pd.DataFrame) -> str:
    if flags.empty:
        return "no arms to judge"
    fired = flags[flags["too_restrictive"] | flags["too_weak"]]
    lines = [to_markdown(fired[["reason"]])] if not fired.empty else ["no arm flagged as too restrictive or too weak"]
    unjudged = flags["note"][flags["note"] != ""]
    if not unjudged.empty:
        lines.append(f"{len(unjudged)} of {len(flags)} arms not fully judged, e.g. {unjudged.iloc[0]}")
    return "\n".join(lines)


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


def _file_part(key: str) -> str:
    """A config key as part of a file name: ``policy.per_layer`` -> ``policy-per_layer``."""
    return "".join(c if c.isalnum() or c in "_-" else "-" for c in key)
