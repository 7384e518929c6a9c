"""The Hydra application: ``python -m ablate policy=fisher budget=0.25 seed=3``.

The testable function is :func:`ablate.runner.run_cell`; this wrapper only composes the config,
runs the cell and returns the objective, so any Hydra sweeper can optimise it.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig, ListConfig

from ablate.config import register_configs
from ablate.runner import objective, run_cell

register_configs()

#: ``conf/`` beside the package (an absolute path: run as ``python -m ablate`` Hydra would look
#: for a relative path inside the package).
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "conf")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float | list[float]:
    summary = run_cell(cfg)
    if isinstance(cfg.objective, ListConfig):
        return [objective(summary, str(name)) for name in cfg.objective]
    return objective(summary, cfg.objective)
