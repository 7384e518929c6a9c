"""Hydra configs of the ablate app (``pkg://ablate.conf``): the main config, groups and sweeps.

Importing this package registers the schemas the YAML files extend, so every way of composing
these configs (the app, Hydra's compose API in tests and notebooks) finds them: the app's own
and every backend's (built-in or installed by entry point, group ``ablate.backends``), whose
declarations import no heavy library. An installed package that adds policies (group
``ablate.policies``) has them offered as ``policy=<name>`` options; only then are they (and
torch) imported here. Hydra's repositories share the config store rather than copy it
(:func:`~hydra_plugins.ablate_grid_sweeper.hydra_private.share_config_store`), and, since a
launcher composes every job of a sweep, Hydra composes a sweep's jobs once per choice of config
groups and parses each config text and each override once per process
(``compose_jobs_per_group_choice``, ``parse_config_texts_once``, ``parse_overrides_once`` beside it).
"""

import importlib.metadata

from ablate.backends import register_backend_schemas
from ablate.config import register_configs
from hydra_plugins.ablate_grid_sweeper.hydra_private import (
    compose_jobs_per_group_choice,
    parse_config_texts_once,
    parse_overrides_once,
    share_config_store,
)

share_config_store()
compose_jobs_per_group_choice()
parse_config_texts_once()
parse_overrides_once()
register_configs()
register_backend_schemas()
if importlib.metadata.entry_points(group="ablate.policies"):
    from ablate.policies import register_policy_options

    register_policy_options()
