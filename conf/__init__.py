"""Hydra configs of the ablate app (``pkg://ablate.conf``): the main config, groups and sweeps.

Importing this package registers the schemas the YAML files extend, so every way of composing
these configs (the app, Hydra's compose API in tests and notebooks) finds them.
"""

from ablate.config import register_configs

register_configs()
