"""What ablate's own app adds to Hydra once Hydra has found its plugins: its sweeps and its launchers.

- ``ablate-sweeps://ablate.sweeps`` on the search path. A search-path plugin rather than
  ``hydra.searchpath`` in ``conf/config.yaml``: Hydra lists the groups of ``--help`` from the
  search path it starts with, before it reads the primary config.
- ablate's launchers as the ``hydra/launcher`` options ``local``, ``joblib``, ``ray`` and
  ``submitit_local`` (:func:`ablate.launchers.configs.register_configs`). Hydra's
  launcher plugins register configs under the same names when Hydra scans its plugins; a
  search-path plugin runs after that scan, so ablate's entries are the ones the app composes.

Other Hydra apps in the environment (verl's ``main_ppo``) are left untouched.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

APP_CONFIGS = "pkg://ablate.conf"
SWEEPS = "ablate-sweeps://ablate.sweeps"


class AblateSweepsSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from ablate.launchers.configs import register_configs

        paths = [element.path for element in search_path.get_path()]
        if APP_CONFIGS in paths:
            register_configs()
            if SWEEPS not in paths:
                search_path.append(provider="ablate-sweeps", path=SWEEPS)
