"""Hydra configs of the ablate app (``pkg://ablate.conf``): the main config, groups and sweeps.

Importing this package registers the schemas the YAML files extend, so every way of composing
these configs (the app, Hydra's compose API in tests and notebooks) finds them. An installed
package that adds policies or backends (entry point groups ``ablate.policies``,
``ablate.backends``) has them offered as ``policy=<name>`` and ``backend=<name>`` options; only
then are they (and torch) imported here.
"""

import importlib.metadata

from ablate.config import register_configs

register_configs()
if importlib.metadata.entry_points(group="ablate.policies"):
    from ablate.policies import register_policy_options

    register_policy_options()
if importlib.metadata.entry_points(group="ablate.backends"):
    from ablate.backends import register_backend_options

    register_backend_options()
