"""Hydra callbacks the app's config installs (``hydra.callbacks`` in ``conf/config.yaml``).

Hydra reports what fails before the app or the sweeper runs as a traceback. These callbacks run
first and end the command in one line:

- :class:`WritableStore`: a single run's output folder (``hydra.run.dir``, inside the store) is
  made by Hydra before the app starts; the store is checked first (a sweep checks its own folder
  in the grid sweeper);
- :class:`ResolvableSweeper`: Hydra resolves the sweeper's own config (``hydra.sweeper``, from a
  sweep file such as an Optuna study's) when it instantiates the sweeper; an interpolation there
  that cannot resolve is named first.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


class WritableStore(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from omegaconf.errors import InterpolationResolutionError

        from ablate.config_errors import exit_with_interpolation_problem
        from ablate.store import StoreError, make_directory, store_root

        # Hydra reports a callback's exceptions as a warning and goes on: only SystemExit ends it.
        try:
            store = store_root(str(config.store_dir))
        except InterpolationResolutionError as error:
            exit_with_interpolation_problem(error, config)
        try:
            run_dir = Path(str(config.hydra.run.dir))
        except InterpolationResolutionError:  # ${hydra:...} resolves only once Hydra runs the job
            run_dir = None
        try:
            make_directory(store, "the run store")
            if run_dir is not None:
                make_directory(run_dir, "Hydra's folder for this run")
        except StoreError as error:
            print(f"ablate: {error}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None


class ResolvableSweeper(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from omegaconf.errors import InterpolationResolutionError

        from ablate.config_errors import exit_with_interpolation_problem

        try:
            OmegaConf.to_container(config.hydra.sweeper, resolve=True)
        except InterpolationResolutionError as error:
            exit_with_interpolation_problem(error, config)
