"""``hydra/sweeper=ablate_grid``: Hydra's grid expansion, made budget-matched and resumable.

The grid is expanded as Hydra's basic sweeper expands it (:func:`grid_jobs`: command-line sweeps
and ``hydra.sweeper.params``); :func:`ablate.sweep.plan_grid` then collapses ``none``/``full`` to one
cell per seed, validates every cell and skips the complete ones, and only the remaining cells
go to the configured launcher (in process, joblib, Ray, submitit). Cells that another live
worker is running are waited for. At the end it prints a tally and fails (exit status 1) if any
cell did not complete; the other cells still ran. Ctrl-C or SIGTERM stops the sweep: the running
cell is recorded as interrupted, the tally is printed, and the exit status is 130 or 143.
"""


import copy
import itertools
import logging
import sys
from dataclasses import dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.core.plugins import Plugins
from hydra.errors import HydraException
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from .hydra_private import (
    ConfigLoaderImpl,
    apply_overrides,
    config_repository,
    element_override,
    element_text,
    parsed_element,
    value_node_kind,
)

log = logging.getLogger(__name__)


@dataclass
class AblateGridSweeperConf:
    _target_: str = "hydra_plugins.ablate_grid_sweeper.grid_sweeper.AblateGridSweeper"
    #: Cells handed to the launcher at once (None: all); progress is reported either way.
    max_batch_size: Optional[int] = None
    #: The grid, as in Hydra's basic sweeper: {key: "v1,v2,..."}.
    params: Optional[dict[str, str]] = None
    #: A union of grids where one grid cannot say it (a setting only some policies have): each
    #: {key: "v1,v2,..."} is expanded with ``params`` and the command line's overrides, and the
    #: cells of all of them are planned together (a cell two grids share runs once).
    grids: Optional[list[dict[str, str]]] = None
    #: Seconds between progress reports while cells run.
    progress_interval: float = 2.0
    #: Plan only: print the cells and their state in the run store, launch nothing.
    dry_run: bool = False


ConfigStore.instance().store(group="hydra/sweeper", name="ablate_grid", node=AblateGridSweeperConf, provider="ablate")


@dataclass(frozen=True)
class _Slot:
    """A value's place in a scratch composition, and what decides how a value set there is typed:
    its path and the kind of node there (:func:`~.hydra_private.value_node_kind`)."""

    scratch: DictConfig
    parent: DictConfig
    leaf: str
    kind: tuple[Any, ...]


class JobComposer:
    """Composes the jobs of a grid as Hydra would, but once per choice of config groups.

    Hydra composes a job in two phases: overrides of config groups (``policy=fisher``) choose the
    defaults list, then the other overrides (``budget=0.1``, ``policy.tau=1``) are applied to the
    composed config (both through :mod:`.hydra_private`). A grid has few group choices and many
    values, so the first phase is done once per set of group overrides. Which override is a group
    override is decided as Hydra decides it (``repository.group_exists``).

    :meth:`template` plans a job without composing it at all: each value override is typed once
    per kind of node it is set in (set in a scratch copy of a composition, as Hydra sets it, and
    read back), and the job's cell is its composition's :class:`~ablate.compose.CellTemplate` with
    those values. The grid's values come parsed (:func:`grid_jobs` fills :attr:`parsed`). A job the
    template cannot describe (an addition, a deletion, a list or mapping value, a composition with
    interpolations) gets None, and is composed whole by :meth:`__call__`.
    """

    def __init__(self, master: DictConfig, config_loader: ConfigLoaderImpl) -> None:
        self.master, self.loader = master, config_loader
        self.repository = config_repository(config_loader, master.hydra.job.config_name)
        self.parser = OverridesParser.create(config_loader=config_loader)
        #: Each override's parse, by its text (the grid's values are put here as the grid is expanded).
        self.parsed: dict[str, Override] = {}
        self._composed: dict[tuple[str, ...], DictConfig] = {}
        self._templates: dict[tuple[str, ...], Any] = {}
        self._scratch: dict[tuple[str, ...], DictConfig] = {}
        self._slots: dict[tuple[tuple[str, ...], str], Optional[_Slot]] = {}
        self._typed: dict[tuple[tuple[Any, ...], str], Optional[tuple[str, Any]]] = {}
        self._groups: dict[str, bool] = {}
        self._chooses_group: dict[str, bool] = {}

    def parse(self, override: str) -> Override:
        if override not in self.parsed:
            self.parsed[override] = self.parser.parse_override(override)
        return self.parsed[override]

    def __call__(self, overrides: list[str]) -> DictConfig:
        """The job's app config, as Hydra composes it (a copy: the caller may keep it)."""
        key, values = self._split(overrides)
        cfg = copy.deepcopy(self._composition(key))
        apply_overrides(values, cfg)
        return cfg

    def template(self, overrides: list[str]) -> Optional[tuple[Any, dict[str, Any]]]:
        """The job's composition as a :class:`~ablate.compose.CellTemplate` and its values, or None."""
        from ablate.compose import CellTemplate

        key, values = self._split(overrides)
        if key not in self._templates:
            self._templates[key] = CellTemplate.of(self._composition(key))
        template = self._templates[key]
        if template is None:
            return None
        typed = {}
        for override in values:
            found = self._typed_value(key, override)
            if found is None:
                return None
            typed[found[0]] = found[1]
        return template, typed

    def _split(self, overrides: list[str]) -> tuple[tuple[str, ...], list[Override]]:
        groups, values = [], []
        for text in overrides:
            if text not in self._chooses_group:
                self._chooses_group[text] = self._is_group(self.parse(text))
            if self._chooses_group[text]:
                groups.append(text)
            else:
                values.append(self.parse(text))
        return tuple(groups), values

    def _is_group(self, override: Override) -> bool:
        """Whether ``override`` chooses a config group (looked up once per key: each lookup searches the configs)."""
        if isinstance(override.value(), dict):
            return False
        key = override.key_or_group
        if key not in self._groups:
            self._groups[key] = self.repository.group_exists(key)
        return self._groups[key]

    def _composition(self, key: tuple[str, ...]) -> DictConfig:
        if key not in self._composed:
            composed = self.loader.load_sweep_config(self.master, list(key))
            with open_dict(composed):
                del composed["hydra"]
            self._composed[key] = composed
        return self._composed[key]

    def _typed_value(self, key: tuple[str, ...], override: Override) -> Optional[tuple[str, Any]]:
        """``(dotted key, value)`` as the config's schema types it, or None for what a template cannot take.

        A value is typed once per kind of node it is set in, not once per composition: ``seed=3`` is
        typed alike in every policy's composition, and a grid over thousands of seeds would otherwise
        type each seed again for each choice of config groups.
        """
        if override.is_add() or override.is_force_add() or override.is_delete() or override.is_sweep_override():
            return None
        slot = self._slot(key, override.key_or_group)
        if slot is None:
            return None
        typed = (slot.kind, override.input_line or "")
        if typed not in self._typed:
            self._typed[typed] = self._type(slot, override)
        return self._typed[typed]

    def _slot(self, key: tuple[str, ...], path: str) -> Optional[_Slot]:
        """Where ``path`` is set in a scratch copy of the composition ``key``, or None where a template
        cannot take a value for it (a key the composition lacks, one left missing, a mapping or a list)."""
        if (key, path) not in self._slots:
            self._slots[key, path] = self._find_slot(key, path)
        return self._slots[key, path]

    def _find_slot(self, key: tuple[str, ...], path: str) -> Optional[_Slot]:
        if key not in self._scratch:  # each override is set here and read back at once
            self._scratch[key] = copy.deepcopy(self._composition(key))
        scratch = self._scratch[key]
        head, _, leaf = path.rpartition(".")
        parent = OmegaConf.select(scratch, head) if head else scratch
        if not isinstance(parent, DictConfig):
            return None
        kind = value_node_kind(parent, leaf)
        return None if kind is None else _Slot(scratch, parent, leaf, (path, *kind))

    @staticmethod
    def _type(slot: _Slot, override: Override) -> Optional[tuple[str, Any]]:
        apply_overrides([override], slot.scratch)
        if OmegaConf.is_interpolation(slot.parent, slot.leaf):
            return None  # its value depends on the job's other values
        value = slot.parent[slot.leaf]
        return None if isinstance(value, (DictConfig, ListConfig)) else (slot.kind[0], value)


def grid_jobs(overrides: list[Override], parsed: Optional[dict[str, Override]] = None) -> list[list[str]]:
    """Every job of the grid, as Hydra's basic sweeper expands it: the product of each key's values,
    in the order the keys first appear (a key given twice keeps its last values).

    ``parsed``, when given, receives the override of each plain value the jobs hold, keyed by its
    text (``seed=3``), built from the sweep already parsed (:func:`~.hydra_private.element_override`):
    a composer handed it need not parse each value again, which takes about a millisecond a value.
    """
    values: dict[str, list[str]] = {}
    for override in overrides:
        key = override.get_key_element()
        if not override.is_sweep_override():
            elements = [parsed_element(override)]
        elif override.is_discrete_sweep():
            elements = list(override.sweep_iterator())
        else:
            assert override.value_type is not None
            raise HydraException(f"the grid sweeper does not support sweep type : {override.value_type.name}")
        values[key] = [f"{key}={element_text(element)}" for element in elements]
        if parsed is not None:
            for text, element in zip(values[key], elements):
                built = element_override(override, element, text)
                if built is not None:
                    parsed[text] = built
    return [list(job) for job in itertools.product(*values.values())]


class AblateGridSweeper(Sweeper):
    def __init__(self, max_batch_size: Optional[int], params: Optional[dict[str, str]] = None,
                 progress_interval: float = 2.0, dry_run: bool = False,
                 grids: Optional[list[dict[str, str]]] = None) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"hydra.sweeper.max_batch_size={max_batch_size}: expected a number of cells >= 1, or "
                             "null for all of them")
        self.max_batch_size = max_batch_size
        self.params = dict(params or {})
        self.grids = [dict(grid) for grid in grids or [{}]]
        self.progress_interval = progress_interval
        self.dry_run = dry_run
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.launcher: Optional[Launcher] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        """Plan, launch and tally; an interpolation that cannot resolve ends it in one line."""
        from omegaconf.errors import InterpolationResolutionError

        from ablate.config_errors import exit_with_interpolation_problem

        try:
            return self._sweep(arguments)
        except InterpolationResolutionError as error:
            assert self.config is not None
            exit_with_interpolation_problem(error, self.config)

    def _sweep(self, arguments: list[str]) -> Any:
        from ablate.config import ConfigError
        from ablate.interrupts import as_interrupted, signals_interrupt
        from ablate.launchers.stopping import settle, stop_file
        from ablate.overrides import quoted_override
        from ablate.store import is_disk_full, store_root
        from ablate.sweep import (
            ProgressReporter,
            describe_plan,
            empty_sweeps,
            make_sweep_directory,
            plan_grid,
            repeated_values,
            tally,
            wait_for_others,
        )

        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        from ablate.app import load_command_plugins

        # A sweep file's plugins: their policies become `policy` options before the jobs compose.
        load_command_plugins([str(module) for module in self.config.get("plugins") or ()])
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        compose = JobComposer(self.config, self.hydra_context.config_loader)
        jobs: list[list[str]] = []
        for grid in self.grids:
            overrides = parser.parse_overrides(
                [*(f"{key}={value}" for key, value in {**self.params, **grid}.items()), *arguments])
            empty = empty_sweeps(overrides)
            if empty:
                print(f"ablate: {empty[0]} gives no value: a grid with an empty sweep has no cells (expected at least "
                      "one value)", file=sys.stderr, flush=True)
                raise SystemExit(2)
            for note in repeated_values(overrides):
                print(f"ablate: {note}: each cell runs once", file=sys.stderr, flush=True)
            jobs += grid_jobs(overrides, compose.parsed)
        # Every worker writes to the same store, wherever its working directory is (Ray, SLURM).
        # Quoted: Hydra parses it again, and a path may hold any character ("p (copy)", "é", ",").
        store = quoted_override("store_dir", str(store_root(str(self.config.store_dir))))
        try:
            planned = plan_grid([[*(o for o in job if not o.startswith("store_dir=")), store] for job in jobs], compose)
        except ConfigError as error:
            # One line, before any cell starts: the whole grid is checked first.
            print(f"ablate: {error}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        sweep_name = str(self.config.sweep)
        log.info(describe_plan(sweep_name, planned))
        if self.dry_run:
            for cell in planned:
                shown = [o for o in cell.overrides if not o.startswith("store_dir=")]
                print(f"{cell.prior.state.value:<11} {cell.cell.name:<28} {' '.join(shown)}")
            return []

        sweep_dir = make_sweep_directory(self.config)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")

        to_launch = [cell for cell in planned if cell.to_launch]
        batch_size = self.max_batch_size or max(len(to_launch), 1)
        returns = []
        stopped = full = None
        reporter = ProgressReporter(sweep_name, planned, interval=self.progress_interval)
        with reporter, stop_file(sweep_dir):
            try:
                with signals_interrupt():
                    for start in range(0, len(to_launch), batch_size):
                        batch = [list(cell.overrides) for cell in to_launch[start : start + batch_size]]
                        returns.append(self.launcher.launch(batch, initial_job_idx=start))
                    wait_for_others(planned, self.progress_interval)
            except KeyboardInterrupt as error:
                stopped = as_interrupted(error)
            except OSError as error:
                if not is_disk_full(error):
                    raise
                full = error  # the launcher could not even write a job's files: no cell after it can run
            settle(to_launch)  # a launcher may return while its workers still record their cells
        result = tally(planned)
        where = planned[0].directory.parent if planned else None
        print("\n".join(result.report(sweep_name, reporter.elapsed, where)), flush=True)
        # SystemExit rather than an exception: the tally above is the report, not a traceback.
        if stopped is not None:
            print(f"ablate: sweep {sweep_name} interrupted by {stopped.signal_name}; run the same command again "
                  "to resume it (complete cells are skipped)", file=sys.stderr, flush=True)
            raise SystemExit(stopped.exit_status)
        if full is not None or result.disk_full:
            what = f"{full.strerror}: {full.filename or sweep_dir}" if full else f"{result.disk_full} cells failed on it"
            print(f"ablate: sweep {sweep_name} stopped: the disk is full ({what}); free some space and run the same "
                  "command again to resume it (complete cells are skipped)", file=sys.stderr, flush=True)
            raise SystemExit(1)
        if not result.ok:
            print(f"{len(result.problems)} of {len(planned)} cells did not complete; the other cells ran to the end",
                  file=sys.stderr, flush=True)
            raise SystemExit(1)
        return returns
