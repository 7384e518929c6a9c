"""A W&B workspace for one sweep, and the summary table logged as a W&B run.

The workspace (``wandb-workspaces``) shows only the sweep's runs (W&B group = sweep), grouped
by the arm as the local analysis defines it (docs/design.md section 5): ``config.policy``,
``config.variant`` (settings variants such as ``fisher[tau=1.0]`` stay apart), ``config.budget``
and every other config key that varies in the sweep. Three sections: outcomes, routing and
mismatch, load and drift. It is built offline; :func:`write_workspace_spec` writes the exact
view spec that :func:`save_workspace` would upload, so it can be reviewed (and tested) without
an account. Saving needs a W&B login.

The summary table goes to one W&B run per sweep, whose id is derived from the sweep
(:func:`summary_run_id`): logging it again replaces the local offline copy and resumes the
online run, so ``--dashboard`` can be run any number of times and the project holds one
summary run per sweep.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Literal, Sequence

import pandas as pd

from ablate.analysis.extras import import_extra
from ablate.analysis.writing import naming
from ablate.store import atomic_write, make_directory

OUTCOME_KEYS: tuple[str, ...] = ("train/reward", "train/loss", "train/entropy", "train/grad_norm", "train/clip_frac")
ROUTING_KEYS: tuple[str, ...] = (
    "mismatch/kl_k3", "mismatch/extreme_token_frac", "mismatch/abs_logratio_max",
    "routing/route_mismatch_rate", "routing/residual_mismatch_rate", "routing/mismatch_recall",
    "routing/topk_overlap", "replay/override_rate", "replay/budget_realized", "replay/fisher_mass",
)
LOAD_DRIFT_KEYS: tuple[str, ...] = (
    "load/entropy_norm", "load/max_violation", "load/dead_expert_frac", "drift/experts", "drift/router",
)


def build_workspace(entity: str, project: str, sweep: str, arm_keys: Sequence[str] = ()) -> Any:
    """The workspace of ``sweep`` (a ``wandb_workspaces.workspaces.Workspace``).

    ``arm_keys``: the config keys besides policy, settings variant and budget that vary in the
    sweep (``df.attrs["config_keys"]`` of ``load_runs``); runs are grouped by all of them.
    """
    wr = import_extra("wandb_workspaces.reports.v2", "The W&B workspace")
    ws = import_extra("wandb_workspaces.workspaces", "The W&B workspace")

    def lines(keys: tuple[str, ...]) -> list[Any]:
        return [wr.LinePlot(title=key, x="Step", y=[key]) for key in keys]

    outcome_bars = [
        wr.BarPlot(title=f"{key} (last value, by group)", metrics=[key], groupby_aggfunc="mean", groupby_rangefunc="stderr")
        for key in ("train/reward", "mismatch/kl_k3")
    ]
    return ws.Workspace(
        entity=entity,
        project=project,
        name=f"ablate: {sweep}",
        sections=[
            ws.Section(name="Outcomes", panels=[*outcome_bars, *lines(OUTCOME_KEYS)], is_open=True),
            ws.Section(name="Routing and mismatch", panels=lines(ROUTING_KEYS), is_open=True),
            ws.Section(name="Load and drift", panels=lines(LOAD_DRIFT_KEYS)),
        ],
        runset_settings=ws.RunsetSettings(
            filters=[ws.Metric("Group") == sweep],
            groupby=[_config_key(ws, key) for key in dict.fromkeys(("policy", "variant", "budget", *arm_keys))],
        ),
        settings=ws.WorkspaceSettings(x_axis="Step", max_runs=100),
    )


def _config_key(ws: Any, key: str) -> Any:
    """A config key of the cells' W&B runs. Their config is flattened with dots
    (``backend.router_noise`` is one top-level key), which W&B stores as ``backend.router_noise.value``;
    ``Config("backend.router_noise")`` alone would mean a nested ``backend`` dict."""
    return ws.Config(f"{key}.value" if "." in key else key)


def workspace_spec(workspace: Any) -> dict[str, Any]:
    """The view spec W&B stores for ``workspace`` (what ``save_workspace`` uploads), as plain data."""
    return workspace._to_model().model_dump(by_alias=True, exclude_none=True, mode="json")


def write_workspace_spec(workspace: Any, path: str | Path) -> Path:
    """Write the workspace's view spec to ``path``: YAML for ``.yaml``/``.yml``, else JSON."""
    path = Path(path)
    with naming(path.parent):
        make_directory(path.parent, "the analysis output folder")
    spec = workspace_spec(workspace)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        text = yaml.safe_dump(spec, sort_keys=False)
    else:
        text = json.dumps(spec, indent=2) + "\n"
    with naming(path):
        atomic_write(path, lambda tmp: tmp.write_text(text))
    return path


def save_workspace(workspace: Any) -> str:
    """Upload the workspace to W&B and return its URL. Needs a W&B login."""
    import wandb
    from wandb.errors import UsageError

    try:
        wandb.Api()
    except UsageError as error:
        raise RuntimeError(
            "cannot save the W&B workspace: not logged in to W&B "
            f"({error}). Run `wandb login` or set WANDB_API_KEY; without an account, "
            "write the spec offline with write_workspace_spec(ws, 'workspace.json')."
        ) from error
    return workspace.save().url


def log_summary_table(
    table: pd.DataFrame,
    *,
    project: str,
    entity: str | None = None,
    group: str,
    mode: Literal["offline", "online", "disabled"] = "offline",
    key: str = "summary",
    dir: str | Path | None = None,
) -> str | None:
    """Log ``table`` as a ``wandb.Table`` under ``key`` in the sweep's summary run.

    The run (``job_type="summary"``, named ``<group>-summary``) joins the sweep's W&B group
    (``group`` = the sweep) and has the id :func:`summary_run_id` gives the sweep. Offline (the
    default), an earlier offline copy of it under ``dir`` is replaced, and ``wandb sync``
    uploads it later into that one run; online, the run is resumed. Returns the run's local
    directory (``None`` when ``mode="disabled"``).
    """
    import wandb

    run_id = summary_run_id(group)
    if mode == "offline":
        wandb_dir = Path(dir if dir is not None else ".") / "wandb"
        for previous in wandb_dir.glob(f"*-{run_id}"):
            if previous.is_dir() and not previous.is_symlink():
                shutil.rmtree(previous)

    flat = table.reset_index() if any(name is not None for name in table.index.names) else table
    run = wandb.init(
        project=project,
        entity=entity,
        group=group,
        job_type="summary",
        name=f"{group}-summary",
        id=run_id,
        resume="allow" if mode == "online" else None,
        mode=mode,
        dir=None if dir is None else str(dir),
        config={"sweep": group, **{k: v for k, v in table.attrs.items() if isinstance(v, (str, int, float))}},
        reinit="create_new",
        settings=wandb.Settings(silent=True, console="off"),  # the command's output, not W&B's banners
    )
    try:
        run.log({key: wandb.Table(dataframe=flat)})
        run_dir = None if mode == "disabled" else str(Path(run.dir).parent)
    finally:
        run.finish()
    return run_dir


def summary_run_id(sweep: str) -> str:
    """The W&B run id of a sweep's summary run: the same for every call, distinct per sweep."""
    return "summary-" + hashlib.sha256(sweep.encode()).hexdigest()[:16]
