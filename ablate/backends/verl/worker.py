"""Imported in verl's processes through ``actor_rollout_ref.model.external_lib``.

verl imports that module in every process that builds its model config (the trainer, the
agent-loop workers, the rollout servers and the actor). Importing this module installs nothing
by itself: it arranges for :class:`ablate.replay.hook.ReplayMaskHook` to be installed
when the process builds an R3 actor engine of the cell's engine (:mod:`ablate.backends.verl.engines`),
and the schema's ``mismatch/`` keys to verl's trainer (:mod:`ablate.backends.verl.offpolicy`), with
the cell's settings from the ``ABLATE_VERL_CELL`` environment variable that
:func:`ablate.backends.verl.launch.verl_overrides` puts into Ray's runtime_env. Without it (a
process that is not part of an ablate cell) it does nothing at all.
"""

from ablate.backends.verl import engines
from ablate.backends.verl.hook_settings import HookSettings
from ablate.backends.verl.offpolicy import install_in_trainer


def arrange_install() -> HookSettings | None:
    settings = HookSettings.from_env()
    if settings is not None:
        engines.arm(settings.engine, settings.make_hook)
        install_in_trainer()
    return settings


arrange_install()
