"""The Hydra application: ``python -m ablate policy=fisher budget=0.25 seed=3``.

The testable function is :func:`ablate.runner.run_cell`; this wrapper composes the config, runs
the cell and returns the objective, so any Hydra sweeper can optimise it. The configs ship inside
the package (``pkg://ablate.conf``), so an installed wheel runs from any directory; users add
their own ``sweeps/`` folder with Hydra's ``--config-dir``.

Imports are deferred into :func:`main`: ``--help`` and tab completion never run a cell, and they
should not pay for torch, pandas and wandb.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

CONFIG_PATH = "pkg://ablate.conf"


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def main(cfg: DictConfig) -> float | list[float]:
    from ablate.runner import run_cell_from_cli

    return run_cell_from_cli(cfg)
