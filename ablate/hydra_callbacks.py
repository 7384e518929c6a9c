"""Hydra callbacks the app's config installs (``hydra.callbacks`` in ``conf/config.yaml``).

Hydra creates a single run's output folder (``hydra.run.dir``, inside the store) before the app
starts, and reports a failure there as a traceback. :class:`WritableStore` checks the store first
and ends the command in one line that names the folder; a sweep checks its own folder in the
grid sweeper.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class WritableStore(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from ablate.store import StoreError, make_directory, store_root

        try:
            make_directory(store_root(str(config.store_dir)), "the run store")
            make_directory(Path(str(config.hydra.run.dir)), "Hydra's folder for this run")
        except StoreError as error:
            print(f"ablate: {error}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
