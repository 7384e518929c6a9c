"""``hydra/sweeper=ablate_grid``: Hydra's grid expansion, made budget-matched and resumable.

The grid is expanded exactly as Hydra's basic sweeper does (command-line sweeps and
``hydra.sweeper.params``); :func:`ablate.sweep.plan_grid` then collapses ``none``/``full`` to one
cell per seed, validates every cell and skips the complete ones, and only the remaining cells
go to the configured launcher (in process, joblib, Ray, submitit). At the end it prints a tally
and fails (exit status 1) if any cell failed; the other cells still ran.
"""


import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict

log = logging.getLogger(__name__)


@dataclass
class AblateGridSweeperConf:
    _target_: str = "hydra_plugins.ablate_grid_sweeper.grid_sweeper.AblateGridSweeper"
    #: Cells handed to the launcher at once (None: all); progress is reported either way.
    max_batch_size: Optional[int] = None
    #: The grid, as in Hydra's basic sweeper: {key: "v1,v2,..."}.
    params: Optional[dict[str, str]] = None
    #: Seconds between progress reports while cells run.
    progress_interval: float = 2.0
    #: Plan only: print the cells and their state in the run store, launch nothing.
    dry_run: bool = False


ConfigStore.instance().store(group="hydra/sweeper", name="ablate_grid", node=AblateGridSweeperConf, provider="ablate")


class AblateGridSweeper(BasicSweeper):
    def __init__(self, max_batch_size: Optional[int], params: Optional[dict[str, str]] = None,
                 progress_interval: float = 2.0, dry_run: bool = False) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.progress_interval = progress_interval
        self.dry_run = dry_run

    def _compose(self, overrides: list[str]):
        assert self.config is not None and self.hydra_context is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg

    def sweep(self, arguments: list[str]) -> Any:
        from ablate.sweep import ProgressReporter, describe_plan, plan_grid, tally

        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides([*self._parse_config(), *arguments])
        jobs = [job for batch in self.split_arguments(overrides, None) for job in batch]
        # Every worker writes to the same store, wherever its working directory is (Ray, SLURM).
        store = f"store_dir={Path(str(self.config.store_dir)).expanduser().absolute()}"
        planned = plan_grid([[*(o for o in job if not o.startswith("store_dir=")), store] for job in jobs], self._compose)
        sweep_name = str(self.config.sweep)
        log.info(describe_plan(sweep_name, planned))
        if self.dry_run:
            for cell in planned:
                shown = [o for o in cell.overrides if not o.startswith("store_dir=")]
                print(f"{cell.state:<10} {cell.cell.name:<28} {' '.join(shown)}")
            return []

        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")

        to_launch = [cell for cell in planned if cell.to_launch]
        batch_size = self.max_batch_size or max(len(to_launch), 1)
        returns = []
        with ProgressReporter(sweep_name, planned, interval=self.progress_interval):
            for start in range(0, len(to_launch), batch_size):
                batch = [cell.overrides for cell in to_launch[start : start + batch_size]]
                returns.append(self.launcher.launch(batch, initial_job_idx=start))
        counts, failures = tally(planned)
        line = (f"sweep {sweep_name}: {counts['complete']} complete, {counts['failed']} failed, "
                f"{counts['skipped']} skipped (results under {planned[0].directory.parent if planned else '-'})")
        print(line, flush=True)
        for failure in failures:
            print(f"  failed: {failure}", flush=True)
        if failures:
            # SystemExit rather than an exception: the tally above is the report, not a traceback.
            print(f"{len(failures)} of {len(planned)} cells failed; the other cells ran to the end", file=sys.stderr)
            raise SystemExit(1)
        return returns
