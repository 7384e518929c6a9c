"""Adds ``ablate-sweeps://ablate.sweeps`` to the search path of ablate's own app.

A search-path plugin rather than ``hydra.searchpath`` in ``conf/config.yaml``: Hydra lists the
groups of ``--help`` from the search path it starts with, before it reads the primary config.
Other Hydra apps in the environment (verl's ``main_ppo``) are left untouched.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

APP_CONFIGS = "pkg://ablate.conf"
SWEEPS = "ablate-sweeps://ablate.sweeps"


class AblateSweepsSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        paths = [element.path for element in search_path.get_path()]
        if APP_CONFIGS in paths and SWEEPS not in paths:
            search_path.append(provider="ablate-sweeps", path=SWEEPS)
