"""The Hydra application: ``python -m ablate policy=fisher budget=0.25 seed=3``.

The testable function is :func:`ablate.runner.run_cell`; this wrapper composes the config, runs
the cell and returns the objective, so any Hydra sweeper can optimise it. The configs ship inside
the package (``pkg://ablate.conf``), so an installed wheel runs from any directory; users add
their own ``sweeps/`` folder with Hydra's ``--config-dir``.

Imports are deferred into :func:`app`: ``--help`` and tab completion never run a cell, and they
should not pay for torch, pandas and wandb.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import hydra
from omegaconf import DictConfig

CONFIG_PATH = "pkg://ablate.conf"


def plugins_from_arguments(arguments: Sequence[str]) -> list[str]:
    """The modules a ``plugins=[...]`` override on the command line names (``[]`` without one)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [a for a in arguments if a.split("=", 1)[0].lstrip("+") == "plugins" and "=" in a]
    modules: list[str] = []
    for override in OverridesParser.create().parse_overrides(given):
        value = override.value()
        modules += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return modules


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def app(cfg: DictConfig) -> float | list[float]:
    from ablate.runner import run_cell_from_cli

    return run_cell_from_cli(cfg)


def main() -> float | list[float] | None:
    """The command. Before Hydra starts: an argument that is not text in the locale, an override
    Hydra cannot read and a ``--config-dir`` file that is not YAML end in one line (printable in
    any locale), and a policy module named by ``plugins=[...]`` is imported, so that
    ``policy=<its name>`` is an option of the ``policy`` group."""
    from ablate.config_errors import config_dir, override_problem, undecodable_argument, yaml_problem
    from ablate.terminal import printable_output

    printable_output()
    arguments = sys.argv[1:]
    directory = config_dir(arguments)
    problem = (undecodable_argument(arguments) or override_problem(arguments)
               or (yaml_problem(directory, arguments) if directory is not None else None))
    if problem is not None:
        print(f"ablate: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    load_installed_plugins()
    load_command_plugins(plugins_from_arguments(arguments))
    return app()


def load_installed_plugins() -> None:
    """Register the app's configs, with every installed backend and policy (``ablate.conf``): a
    broken install ends the command in one line (exit 2), not in Hydra's "config module not found"."""
    try:
        import ablate.conf  # noqa: F401  (registers the schemas and the installed plugins' options)
    except ValueError as error:  # ConfigError, PolicyError: both name the entry point (PolicyError's module needs torch)
        print(f"ablate: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def load_command_plugins(modules: Sequence[str]) -> None:
    """Import the policy modules a command names and offer their policies as ``policy`` options;
    a module that cannot be imported ends the command in one line (exit 2)."""
    if not modules:
        return
    from ablate.policies import PolicyError, load_plugins, register_policy_options

    try:
        load_plugins(list(modules))
    except PolicyError as error:
        print(f"ablate: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    register_policy_options()
