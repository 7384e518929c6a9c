"""A W&B workspace for one sweep, and the summary table logged as a W&B run.

The workspace (``wandb-workspaces``) shows only the sweep's runs (W&B group = sweep), grouped
by ``config.policy`` then ``config.budget`` (DESIGN.md section 5), in three sections: outcomes,
routing and mismatch, load and drift. It is built offline; :func:`write_workspace_spec` writes
the exact view spec that :func:`save_workspace` would upload, so it can be reviewed (and
tested) without an account. Saving needs a W&B login.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import pandas as pd

OUTCOME_KEYS: tuple[str, ...] = ("train/reward", "train/loss", "train/entropy", "train/grad_norm", "train/clip_frac")
ROUTING_KEYS: tuple[str, ...] = (
    "mismatch/kl_k3", "mismatch/extreme_token_frac", "mismatch/abs_logratio_max",
    "routing/route_mismatch_rate", "routing/residual_mismatch_rate", "routing/mismatch_recall",
    "routing/topk_overlap", "replay/override_rate", "replay/budget_realized", "replay/fisher_mass",
)
LOAD_DRIFT_KEYS: tuple[str, ...] = (
    "load/entropy_norm", "load/max_violation", "load/dead_expert_frac", "drift/experts", "drift/router",
)


def build_workspace(entity: str, project: str, sweep: str) -> Any:
    """The workspace of ``sweep`` (a ``wandb_workspaces.workspaces.Workspace``)."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

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
            groupby=[ws.Config("policy"), ws.Config("budget")],
        ),
        settings=ws.WorkspaceSettings(x_axis="Step", max_runs=100),
    )


def workspace_spec(workspace: Any) -> dict[str, Any]:
    """The view spec W&B stores for ``workspace`` (what ``save_workspace`` uploads), as plain data."""
    return workspace._to_model().model_dump(by_alias=True, exclude_none=True, mode="json")


def write_workspace_spec(workspace: Any, path: str | Path) -> Path:
    """Write the workspace's view spec to ``path``: YAML for ``.yaml``/``.yml``, else JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    spec = workspace_spec(workspace)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        path.write_text(yaml.safe_dump(spec, sort_keys=False))
    else:
        path.write_text(json.dumps(spec, indent=2) + "\n")
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
    """Log ``table`` as a ``wandb.Table`` under ``key`` in a run of ``job_type="summary"``.

    The run joins the sweep's W&B group (``group`` = the sweep), named ``<group>-summary``.
    Offline by default: ``wandb sync`` uploads it later. Returns the run's local directory
    (``None`` when ``mode="disabled"``).
    """
    import wandb

    flat = table.reset_index() if any(name is not None for name in table.index.names) else table
    run = wandb.init(
        project=project,
        entity=entity,
        group=group,
        job_type="summary",
        name=f"{group}-summary",
        mode=mode,
        dir=None if dir is None else str(dir),
        config={"sweep": group, **{k: v for k, v in table.attrs.items() if isinstance(v, (str, int, float))}},
        reinit="create_new",
    )
    try:
        run.log({key: wandb.Table(dataframe=flat)})
        run_dir = None if mode == "disabled" else str(Path(run.dir).parent)
    finally:
        run.finish()
    return run_dir
