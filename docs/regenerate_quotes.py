"""Every output README.md and docs/ quote, regenerated from real runs at the current commit.

    make docs-figures                                       # every source, in a fresh scratch folder
    python docs/regenerate_quotes.py --only demo --only cli # some sources
    python docs/regenerate_quotes.py --work runs-quoted     # keep the runs; a later call reuses their cells
    python docs/regenerate_quotes.py --rewrite              # only rewrite the quoted blocks from docs/quoted/

A *source* is a list of commands, run as a user types them in an empty folder (``COLUMNS=100``).
What each printed is saved with the commit it ran at in ``docs/quoted/<source>.txt`` (the scratch
folder's path written ``/...``), with the files a page draws on (effects tables, per-cell outcomes,
figures). Then every block of README.md and docs/ between ``<!-- quoted SOURCE:EXCERPT -->`` and
``<!-- /quoted -->`` is rewritten from those files by the excerpt of that name (:data:`EXCERPTS`),
which names the commit. ``tests/test_quoted.py`` fails when a block differs from its excerpt of the
saved runs, and (slow tier) when the code no longer prints what a saved run printed.

With ``--work DIR`` the runs stay in DIR, and a later call reuses a source's cells when nothing
that makes a cell changed since they ran (:data:`CELL_CODE`: ``ablate`` but its analysis, the
configs, the sweeps, the Hydra plugins): it runs the analysis commands again and keeps the
sweep's saved output. The code must be committed:
a quote names a commit, and uncommitted code is no commit.

Times on a 2-core machine of its own: ``cli`` under a minute, ``demo`` 3 to 4 minutes, ``store_10k``
a few, ``budget_selection`` about 13 (264 cells of 100 steps on two workers); docs/development.md
gives what was measured.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
QUOTED = ROOT / "docs" / "quoted"
RESULTS_IMAGES = ROOT / "docs" / "results" / "img"
#: The pages whose quoted blocks are rewritten (and checked).
PAGES = ("README.md", "docs")
BEGIN = re.compile(r"^<!-- quoted (\S+) -->$")
END = "<!-- /quoted -->"
#: What makes a cell (its code, configs and sweeps): ``--work`` reuses cells across changes elsewhere.
CELL_CODE = ("ablate", ":!ablate/analysis", "conf", "sweeps", "hydra_plugins", "pyproject.toml")
#: The prefix of the lines that separate the commands of a saved run.
MARK = ">>> "


@dataclass(frozen=True)
class Command:
    """One command of a source: ``cells`` when it runs cells (reused with ``--work``)."""

    line: str  # ``{root}`` stands for the repository
    cells: bool = False
    expect: int = 0  # its exit status

    @property
    def shown(self) -> str:
        """The command as a user types it in the repository."""
        return self.line.replace("{root}/", "")


@dataclass(frozen=True)
class Source:
    commands: tuple[Command, ...]
    #: Files the source's pages draw on, copied to docs/quoted/<source>/ (relative to its folder).
    keep: tuple[str, ...] = ()
    #: Figures for the results pages: (file in the run's folder, name under docs/results/img/).
    figures: tuple[tuple[str, str], ...] = ()
    #: Per-cell outcomes kept in docs/quoted/<source>/cells.csv: (the analysis's cells.csv, outcomes).
    cells: tuple[str, tuple[str, ...]] | None = None


ANALYSE = "python -m ablate.analysis"
SOURCES: dict[str, Source] = {
    "cli": Source((
        Command("python -m ablate policy=fisher budget=0.25 seed=3 backend.steps=20 tracking.mode=disabled",
                cells=True),
        Command("python -m ablate policy=fisher budget=2.0", expect=2),
        Command("python -m ablate backend.topk=9", expect=2),
        Command("python -m ablate policy=none replay.source=train", expect=2),
        Command("STEPS=3 python -m ablate 'backend.steps=${oc.env:STEPS}'", expect=2),
    )),
    "demo": Source(
        (
            Command("python -m ablate sweeps=smoke", cells=True),
            Command(f"{ANALYSE} runs/smoke --reps 1000"),
            Command(f"{ANALYSE} runs/smoke --reps 1000 --plan --no-plots --out runs/smoke/plan"),
        ),
        cells=("runs/smoke/analysis/cells.csv", ("kl_k3_mean", "final_reward", "effective_budget_mean")),
    ),
    "budget_selection": Source(
        (
            Command("python -m ablate sweeps=budget_selection hydra/launcher=joblib hydra.launcher.n_jobs=2",
                    cells=True),
            Command(f"{ANALYSE} runs/budget_selection --plan --report"),
        ),
        keep=tuple(f"runs/budget_selection/analysis/{name}_{outcome}.csv" for name in ("effects", "table")
                   for outcome in ("kl_k3_mean", "final_reward")),
        figures=tuple((f"runs/budget_selection/analysis/{name}.png", f"budget-selection-{name}.png")
                      for name in ("selection_effects_kl_k3_mean", "selection_effects_final_reward",
                                   "effective_budget_kl_k3_mean")),
        cells=("runs/budget_selection/analysis/cells.csv", ("kl_k3_mean", "final_reward", "effective_budget_mean")),
    ),
    "variants": Source(
        (
            Command("python -m ablate sweeps=variants hydra/launcher=joblib hydra.launcher.n_jobs=2", cells=True),
            Command(f"{ANALYSE} runs/variants --plan"),
        ),
        cells=("runs/variants/analysis/cells.csv", ("kl_k3_mean", "final_reward", "effective_budget_mean",
                                                     "residual_mismatch_mean")),
    ),
    "tuning": Source((
        Command("python -m ablate -m hydra/sweeper=ablate_optuna sweep=my_study policy=fisher budget=0.25 "
                "'policy.tau=interval(0.0, 2.0)' 'policy.fisher.decay=tag(log, interval(0.5, 0.99))' "
                "'policy.per_layer=choice(true, false)' hydra.sweeper.n_trials=3 hydra.sweeper.sampler.seed=0 "
                "backend.steps=20", cells=True),
    )),
    "store_10k": Source((
        Command("python {root}/bench/make_store.py store --cells 10000", cells=True),
        Command(f"{ANALYSE} store/scale-10032 --no-plots"),
    )),
}


@dataclass
class Run:
    """What one command printed."""

    command: str
    exit: int
    seconds: float
    stdout: str
    stderr: str
    load: float | None = None  # the 1-minute load average when it started: its times are a shared machine's


@dataclass
class Capture:
    """The saved runs of one source: its header (commit, machine, date) and each command's output."""

    source: str
    header: dict[str, str] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)

    def run(self, prefix: str) -> Run:
        """The run of the (first) command that starts with ``prefix``."""
        return next(run for run in self.runs if run.command.startswith(prefix))

    def render(self) -> str:
        lines = [f"# {key}: {value}" for key, value in self.header.items()]
        for run in self.runs:
            load = "" if run.load is None else f", load average {run.load:.1f} at its start"
            lines += ["", f"{MARK}$ {run.command}", f"{MARK}exit {run.exit} after {run.seconds:.1f} s{load}; stdout:"]
            lines += run.stdout.splitlines()
            if run.stderr:
                lines += [f"{MARK}stderr:", *run.stderr.splitlines()]
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, source: str, text: str) -> "Capture":
        capture = cls(source)
        streams: list[tuple[list[str], list[str]]] = []
        stream: list[str] | None = None
        for line in text.splitlines():
            if not capture.runs and line.startswith("# "):
                key, _, value = line[2:].partition(": ")
                capture.header[key] = value
            elif line.startswith(f"{MARK}$ "):
                capture.runs.append(Run(line[len(MARK) + 2:], 0, 0.0, "", ""))
                streams.append(([], []))
                stream = None
            elif line.startswith(f"{MARK}exit "):
                status, seconds, load = re.fullmatch(
                    rf"{MARK}exit (-?\d+) after ([\d.]+) s(?:, load average ([\d.]+) at its start)?; stdout:",
                    line).groups()
                run = capture.runs[-1]
                run.exit, run.seconds, run.load = int(status), float(seconds), None if load is None else float(load)
                stream = streams[-1][0]
            elif line == f"{MARK}stderr:":
                stream = streams[-1][1]
            elif stream is not None:
                stream.append(line)
        for run, (stdout, stderr) in zip(capture.runs, streams):
            run.stdout, run.stderr = _text("\n".join(stdout)), _text("\n".join(stderr))
        return capture


def _text(output: str) -> str:
    """Output as saved: without trailing blank lines (the file separates runs with one), ending in a newline."""
    output = output.rstrip("\n")
    return output + "\n" if output else ""


def load_capture(source: str, folder: Path = QUOTED) -> Capture:
    return Capture.parse(source, (folder / f"{source}.txt").read_text(encoding="utf-8"))


# ---- running the sources -------------------------------------------------------------------------------------


def git(*arguments: str) -> str:
    return subprocess.run(["git", *arguments], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def commit() -> str:
    """The commit the runs are made at; uncommitted code (outside the docs) is refused."""
    dirty = git("status", "--porcelain", "--", ".", ":!docs", ":!README.md")
    if dirty:
        raise SystemExit(f"regenerate_quotes: uncommitted changes ({dirty.splitlines()[0].strip()} ...): "
                         "commit them first, a quote names the commit it ran at")
    return git("rev-parse", "--short", "HEAD")


def cells_unchanged(since: str) -> bool:
    """Whether ``since`` is in HEAD's history (a quote names it) and nothing that makes a cell changed since."""
    ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", since, "HEAD"], cwd=ROOT, capture_output=True)
    changed = subprocess.run(["git", "diff", "--quiet", since, "HEAD", "--", *CELL_CODE], cwd=ROOT, capture_output=True)
    return ancestor.returncode == 0 and changed.returncode == 0


def run_command(command: Command, folder: Path) -> Run:
    # The python of this environment first, as `make` runs it; 100 columns, as the docs quote them.
    env = {**os.environ, "COLUMNS": "100", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    load, started = os.getloadavg()[0], time.monotonic()
    done = subprocess.run(command.line.replace("{root}", str(ROOT)), shell=True, cwd=folder, capture_output=True,
                          text=True, env=env, executable="/bin/bash")
    seconds = time.monotonic() - started
    if done.returncode != command.expect:
        raise SystemExit(f"regenerate_quotes: `{command.line}` exited with {done.returncode}, expected "
                         f"{command.expect}:\n{done.stderr[-3000:]}")
    scrub = lambda text: text.replace(str(folder.resolve()), "/...").replace(str(folder), "/...")  # noqa: E731
    return Run(command.shown, done.returncode, seconds, _text(scrub(done.stdout)), _text(scrub(done.stderr)), load)


def run_source(name: str, folder: Path, at: str) -> Capture:
    """Run every command of source ``name`` in ``folder`` (reusing its cells where they are still
    what this commit's code makes), and return what they printed."""
    source = SOURCES[name]
    ran_at = folder / "cells-commit"
    saved = folder / "cells-output.txt"
    reuse = ran_at.is_file() and saved.is_file() and cells_unchanged(ran_at.read_text().strip())
    if not reuse:  # an empty folder, as a user's first run: a cell left from before would be skipped
        shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    cells_at = ran_at.read_text().strip() if reuse else at
    capture = Capture(name)
    for command in source.commands:
        if command.cells and reuse:
            capture.runs += Capture.parse(name, saved.read_text(encoding="utf-8")).runs
            continue
        print(f"[{name}] $ {command.shown}", file=sys.stderr, flush=True)
        run = run_command(command, folder)
        capture.runs.append(run)
        if command.cells:
            saved.write_text(Capture(name, {}, [run]).render(), encoding="utf-8")
            ran_at.write_text(at + "\n")
    capture.header = {
        "source": name,
        "commit": at if cells_at == at else f"{cells_at} (cells), {at} (the rest)",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPUs, {platform.system()} {platform.machine()}, Python "
                   f"{platform.python_version()}",
        "regenerate": f"python docs/regenerate_quotes.py --only {name}",
    }
    return capture


def keep_files(name: str, folder: Path) -> None:
    """Copy the files a source's pages draw on into docs/quoted/<source>/ and docs/results/img/."""
    source = SOURCES[name]
    kept = QUOTED / name
    if source.keep or source.cells:
        kept.mkdir(parents=True, exist_ok=True)
    for relative in source.keep:
        shutil.copyfile(folder / relative, kept / Path(relative).name)
    for relative, target in source.figures:
        RESULTS_IMAGES.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / relative, RESULTS_IMAGES / target)
    if source.cells:
        relative, outcomes = source.cells
        with open(folder / relative, newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
        with open(kept / "cells.csv", "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle, lineterminator="\n")
            writer.writerow(["name", *outcomes])
            writer.writerows([row["name"], *(row[outcome] for outcome in outcomes)] for row in rows)


# ---- excerpts: what a page quotes of a saved run -------------------------------------------------------------


def fenced(text: str) -> str:
    return "```\n" + text.rstrip("\n") + "\n```"


def commit_of(capture: Capture) -> str:
    return capture.header["commit"]


def section(output: str, heading: str) -> list[str]:
    """The lines of the ``## heading...`` section of an analysis's output, without its heading."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"## {heading}"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1:end]


def paragraph(lines: list[str], first: str) -> list[str]:
    """The lines from the one that starts with ``first`` to the next blank line."""
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


#: The first line of a row a verdict's answer cites (indented under the answer, as its wrapped sentence is).
CITED_ROW = re.compile(r"^      (replay|budget|selection|matched) \S+-\S+( pooled| b=\S+)?: ")


def answers_only(lines: list[str]) -> list[str]:
    """A verdict's headings and answers, from its first heading to its notes, without the rows each cites."""
    introduction = next(i for i, line in enumerate(lines) if line.strip())
    first = next(i for i in range(introduction, len(lines)) if not lines[i].strip()) + 1
    kept, in_rows = [], False
    for line in lines[first:]:
        if line.startswith("notes on the answers"):
            break
        in_rows = bool(CITED_ROW.match(line)) or (in_rows and line.startswith("      "))
        if not in_rows:
            kept.append(line)
    return kept


def verdict(capture: Capture, analysis: str, outcome: str | None = None) -> list[str]:
    lines = section(capture.run(analysis).stdout, "verdict")
    return paragraph(lines, f"{outcome} (") if outcome else lines


def demo_sweep(capture: Capture) -> str:
    run = capture.run("python -m ablate sweeps=smoke")
    lines = run.stdout.splitlines()
    return (f"At commit `{commit_of(capture)}` ({capture.header['machine']}{_load(run)}) the sweep printed:\n\n"
            + fenced("\n".join([lines[0], "...", lines[len(lines) // 2], "...", lines[-1]])))


def _load(run: Run) -> str:
    return "" if run.load is None else f", load average {run.load:.1f}"


def demo_verdict(outcome: str | None) -> Callable[[Capture], str]:
    def excerpt(capture: Capture) -> str:
        lines = verdict(capture, f"{ANALYSE} runs/smoke --reps 1000", outcome)
        what = f"the verdict on {outcome}" if outcome else "its verdict"
        return (f"At commit `{commit_of(capture)}`, `make demo` printed {what}:\n\n"
                + fenced("\n".join(lines).strip("\n")))
    return excerpt


def demo_extension(capture: Capture) -> str:
    output = capture.run(f"{ANALYSE} runs/smoke --reps 1000 --plan").stdout.splitlines()
    command = next(line.strip() for line in output if line.strip().startswith("python -m ablate sweeps="))
    return (f"From `make demo`'s sweep with `--plan`, at commit `{commit_of(capture)}`:\n\n" + fenced(command))


def cli_cell(capture: Capture) -> str:
    run = capture.runs[0]
    return (f"At commit `{commit_of(capture)}`:\n\n"
            + fenced(f"$ {run.command}\n{run.stdout.strip().splitlines()[-1]}"))


def cli_errors(count: int) -> Callable[[Capture], str]:
    def excerpt(capture: Capture) -> str:
        lines = []
        for run in capture.runs[1:1 + count]:
            lines += [f"$ {run.command}", run.stderr.strip().splitlines()[-1]]
        return f"At commit `{commit_of(capture)}`:\n\n" + fenced("\n".join(lines))
    return excerpt


def cli_error_of(prefix: str) -> Callable[[Capture], str]:
    """The last line a refused command printed, after the command as typed."""
    def excerpt(capture: Capture) -> str:
        run = capture.run(prefix)
        last = run.stderr.strip().splitlines()[-1]
        return f"At commit `{commit_of(capture)}`:\n\n" + fenced(f"$ {run.command}\n{last}")
    return excerpt


def tuning_study(capture: Capture) -> str:
    lines = capture.runs[0].stdout.splitlines()
    shown = lines[:next(i for i, line in enumerate(lines) if line.startswith("Trials exported"))]
    return (f"At commit `{commit_of(capture)}` ({capture.header['machine']}{_load(capture.runs[0])}; Hydra's "
            "and Optuna's log lines, on stderr, left out):\n\n" + fenced("\n".join(shown)))


def store_across(capture: Capture) -> str:
    lines = section(capture.run(ANALYSE).stdout, "verdict")
    return (f"At commit `{commit_of(capture)}`:\n\n"
            + fenced("\n".join(paragraph(lines, "kl_k3_mean across"))))


BUDGET_SELECTION = f"{ANALYSE} runs/budget_selection"


def sweep_run(analysis: str) -> Callable[[Capture], str]:
    """How a sweep source ran: its commit, the sweep's tally and load, the time of its analysis."""
    def excerpt(capture: Capture) -> str:
        sweep, analysed = capture.runs[0], capture.run(analysis)
        tally = next(line for line in sweep.stdout.splitlines() if " complete, " in line)
        return (f"Run at commit `{commit_of(capture)}`, analysed on {capture.header['date']} "
                f"({capture.header['machine']}). The sweep printed `{tally}`"
                f"{_load(sweep).replace(', load', ' (load')}{')' if sweep.load else ''}; "
                f"the analysis took {analysed.seconds:.0f} s.")
    return excerpt


def budget_selection_answers(capture: Capture) -> str:
    lines = answers_only(verdict(capture, BUDGET_SELECTION))
    return (f"At commit `{commit_of(capture)}`, its analysis answers (the rows each answer rests on left out):\n\n"
            + fenced("\n".join(lines).strip("\n")))


def budget_selection_verdict(capture: Capture) -> str:
    return (f"At commit `{commit_of(capture)}`, `{BUDGET_SELECTION} --plan --report` printed:\n\n"
            + fenced("\n".join(verdict(capture, BUDGET_SELECTION)).strip("\n")))


VARIANTS = f"{ANALYSE} runs/variants"


def variants_verdict(capture: Capture) -> str:
    return (f"At commit `{commit_of(capture)}`, `{VARIANTS} --plan` printed:\n\n"
            + fenced("\n".join(verdict(capture, VARIANTS)).strip("\n")))


def variants_arms(capture: Capture) -> str:
    """Each arm's outcomes averaged over its seeds, from the cells the run kept."""
    columns = ("effective_budget_mean", "residual_mismatch_mean", "kl_k3_mean", "final_reward")
    arms: dict[str, list[dict[str, str]]] = {}
    for row in _csv(QUOTED / "variants" / "cells.csv"):
        arms.setdefault(re.sub(r"-s\d+$", "", row["name"]), []).append(row)
    lines = [f"At commit `{commit_of(capture)}`, each arm's mean over its seeds (the cells' `{'`, `'.join(columns)}`):",
             "", "| arm | seeds | " + " | ".join(f"`{column}`" for column in columns) + " |",
             "| --- | ---: |" + " ---: |" * len(columns)]
    for arm, rows in arms.items():
        means = [sum(float(row[column]) for row in rows) / len(rows) for column in columns]
        lines.append(f"| `{arm}` | {len(rows)} | " + " | ".join(f"{mean:.3g}" for mean in means) + " |")
    return "\n".join(lines)


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _number(text: str, digits: int = 2) -> str:
    if text in ("", "nan"):
        return ""
    value = float(text)
    if math.isinf(value):
        return "-inf" if value < 0 else "inf"
    return "0" if value == 0 else f"{value:+.{digits}g}"


def budget_selection_rows(outcome: str) -> Callable[[Capture], str]:
    """The rows the verdict reads first, per question: every primary row and every pooled row."""
    def excerpt(capture: Capture) -> str:
        rows = [row for row in _csv(QUOTED / capture.source / f"effects_{outcome}.csv")
                if row["family"].startswith("primary") or row["pooled"] == "True"]
        lines = ["| row | family | mean | 95% interval (unadjusted) | p | `p_adj` | `p_equiv_adj` | seeds | claim |",
                 "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
        for row in rows:
            name = f"{row['effect']} `{row['policy']} - {row['baseline']}`"
            if row["effect"] != "replay":
                name += " pooled" if row["pooled"] == "True" else f" b={float(row['budget']):g}"
            interval = (f"[{_number(row['ci_low'])}, {_number(row['ci_high'])}]"
                        if _number(row["ci_low"]) not in ("", "-inf") else "none")
            lines.append(f"| {name} | {row['family'].split(':')[0].split(' (')[0]} | {_number(row['mean'])} | "
                         f"{interval} | {_number(row['p_value']).lstrip('+')} | {_number(row['p_adj']).lstrip('+')} | "
                         f"{_number(row.get('p_equiv_adj', '')).lstrip('+')} | {row['n_seeds']} | {row['claim']} |")
        return (f"From `effects_{outcome}.csv` at commit `{commit_of(capture)}` (every column: "
                f"`docs/quoted/{capture.source}/effects_{outcome}.csv`):\n\n" + "\n".join(lines))
    return excerpt


def budget_selection_effective(capture: Capture) -> str:
    rows = _csv(QUOTED / capture.source / "table_kl_k3_mean.csv")
    budgets = sorted({float(row["budget"]) for row in rows if row["policy"] not in ("none", "full")})
    lines = ["| policy | " + " | ".join(f"{b:g}" for b in budgets) + " |",
             "| :--- | " + " | ".join("---:" for _ in budgets) + " |"]
    for policy in dict.fromkeys(row["policy"] for row in rows):
        if policy in ("none", "full"):
            continue
        by_budget = {float(row["budget"]): float(row["effective_budget"]) for row in rows if row["policy"] == policy}
        lines.append(f"| {policy} | " + " | ".join(f"{by_budget[b]:.4f}" for b in budgets) + " |")
    full = next(float(row["effective_budget"]) for row in rows if row["policy"] == "full")
    return (f"Mean over seeds at commit `{commit_of(capture)}` (`full`: {full:.4f}):\n\n" + "\n".join(lines))


#: Every excerpt a page may quote, by ``SOURCE:NAME``.
EXCERPTS: dict[str, Callable[[Capture], str]] = {
    "cli:one-cell": cli_cell,
    "cli:bad-budget": cli_errors(1),
    "cli:errors": cli_errors(2),
    "cli:variant-error": cli_error_of("python -m ablate policy=none replay.source=train"),
    "cli:environment-error": cli_error_of("STEPS=3 python -m ablate"),
    "demo:sweep": demo_sweep,
    "demo:verdict": demo_verdict(None),
    "demo:verdict-kl_k3_mean": demo_verdict("kl_k3_mean"),
    "demo:extension": demo_extension,
    "tuning:study": tuning_study,
    "store_10k:across": store_across,
    "budget_selection:run": sweep_run(BUDGET_SELECTION),
    "budget_selection:answers": budget_selection_answers,
    "budget_selection:verdict": budget_selection_verdict,
    "budget_selection:effective-budgets": budget_selection_effective,
    "budget_selection:rows-kl_k3_mean": budget_selection_rows("kl_k3_mean"),
    "budget_selection:rows-final_reward": budget_selection_rows("final_reward"),
    "variants:run": sweep_run(VARIANTS),
    "variants:verdict": variants_verdict,
    "variants:arms": variants_arms,
}


# ---- the pages -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    page: Path
    name: str
    text: str  # what stands between the markers now


def pages() -> list[Path]:
    found = []
    for entry in PAGES:
        path = ROOT / entry
        found += sorted(path.rglob("*.md")) if path.is_dir() else [path]
    return found


def blocks(page: Path) -> list[Block]:
    """The quoted blocks of one page; an unclosed or unknown one is an error naming it."""
    found, lines = [], page.read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        match = BEGIN.match(line)
        if not match:
            continue
        end = next((j for j in range(index + 1, len(lines)) if lines[j] == END), None)
        if end is None or match.group(1) not in EXCERPTS:
            problem = "no closing marker" if end is None else f"no excerpt of that name (one of {', '.join(EXCERPTS)})"
            raise ValueError(f"{page.relative_to(ROOT)}:{index + 1}: quoted block {match.group(1)}: {problem}")
        found.append(Block(page, match.group(1), "\n".join(lines[index + 1:end])))
    return found


def excerpt(name: str, captures: dict[str, Capture]) -> str:
    source = name.split(":")[0]
    if source not in captures:
        captures[source] = load_capture(source)
    return EXCERPTS[name](captures[source])


def rewrite(page: Path, captures: dict[str, Capture]) -> bool:
    """Rewrite each quoted block of ``page`` from its excerpt; whether the page changed."""
    text = page.read_text(encoding="utf-8")
    out, lines, index = [], text.splitlines(), 0
    while index < len(lines):
        out.append(lines[index])
        match = BEGIN.match(lines[index])
        if match:
            end = lines.index(END, index + 1)
            out += excerpt(match.group(1), captures).splitlines()
            index = end
            continue
        index += 1
    new = "\n".join(out) + ("\n" if text.endswith("\n") else "")
    if new != text:
        page.write_text(new, encoding="utf-8")
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=list(SOURCES), help="run only this source, repeatable")
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a scratch folder, removed after)")
    parser.add_argument("--rewrite", action="store_true", help="run nothing: rewrite the blocks from docs/quoted/")
    args = parser.parse_args(argv)
    if not args.rewrite:
        at = commit()
        work = args.work or Path(tempfile.mkdtemp(prefix="ablate-quotes-"))
        try:
            for name in args.only or list(SOURCES):
                started = time.monotonic()
                capture = run_source(name, (work / name).resolve(), at)
                if commit() != at:  # the commands ran the working tree's code: it must still be the commit's
                    raise SystemExit(f"regenerate_quotes: the code changed while {name} ran; nothing saved for it")
                QUOTED.mkdir(parents=True, exist_ok=True)
                (QUOTED / f"{name}.txt").write_text(capture.render(), encoding="utf-8")
                keep_files(name, (work / name).resolve())
                print(f"[{name}] saved docs/quoted/{name}.txt in {time.monotonic() - started:.0f} s", file=sys.stderr)
        finally:
            if args.work is None:
                shutil.rmtree(work, ignore_errors=True)
    captures: dict[str, Capture] = {}
    for page in pages():
        blocks(page)  # an unknown or unclosed block fails before any page is written
    changed = [page.relative_to(ROOT) for page in pages() if rewrite(page, captures)]
    print(f"rewrote {len(changed)} page(s): {', '.join(map(str, changed)) or '-'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
