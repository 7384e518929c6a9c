"""Imported in verl's worker processes through ``actor_rollout_ref.model.external_lib``.

Installs :class:`ablate.backends.verl.hook.ReplayMaskHook` from the ``ABLATE_VERL_*`` environment
variables that :func:`ablate.backends.verl.launch.verl_overrides` puts into Ray's runtime_env.
Without them (a process that is not part of an ablate cell) importing this module does nothing.
"""

import json
import os

from ablate.backends.verl.hook import ReplayMaskHook, active_hook, install


def install_from_env() -> ReplayMaskHook | None:
    policy = os.environ.get("ABLATE_VERL_POLICY")
    if policy is None or active_hook() is not None:
        return active_hook()
    budget = os.environ.get("ABLATE_VERL_BUDGET")
    return install(
        ReplayMaskHook(
            policy=policy,
            budget=None if budget in (None, "None") else float(budget),
            seed=int(os.environ.get("ABLATE_VERL_SEED", "0")),
            settings=json.loads(os.environ.get("ABLATE_VERL_SETTINGS", "{}")),
        )
    )


install_from_env()
