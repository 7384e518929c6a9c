"""``ablate-sweeps://PACKAGE``: the sweep definitions of a package, as the config group ``sweeps``.

The repository keeps its sweep definitions in a top-level ``sweeps/`` folder, beside ``conf/``;
both ship inside the package (``ablate.conf`` and ``ablate.sweeps``, see pyproject.toml). Hydra
finds a group only as a sub-folder of a search-path root, and the one folder that holds
``sweeps/`` in a checkout is the repository itself, whose ``.venv/`` and ``runs/`` Hydra would
then walk for every ``--help`` and tab completion. This source serves exactly one group instead:
``sweeps/<name>`` is ``<name>.yaml`` of the package, read through ``importlib.resources``, so it
works the same from an editable checkout and from an installed wheel. ``searchpath.py`` beside
this module adds it to the app's search path. It is a ``ConfigSource``, Hydra's public base for
config sources, with its helpers for subclasses (``_normalize_file_name``, ``_get_header_dict``,
``_list_add_result``; tests/test_hydra_private.py pins them).

No ``from __future__ import annotations``: Hydra's plugin scan executes this module outside
``sys.modules``.
"""

import io
import os
from importlib import resources
from typing import List, Optional

from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from omegaconf import OmegaConf

GROUP = "sweeps"


class AblateSweepsConfigSource(ConfigSource):
    def __init__(self, provider: str, path: str) -> None:
        super().__init__(provider=provider, path=path)
        self.path = self.path.replace("/", ".").rstrip(".")  # a package name, as pkg:// takes it

    @staticmethod
    def scheme() -> str:
        return "ablate-sweeps"

    def _package_file(self, config_path: str):
        """The package resource behind ``sweeps/<name>``, or None for any other path."""
        group, _, name = config_path.strip("/").partition("/")
        if group != GROUP or not name:
            return None
        return resources.files(self.path).joinpath(name)

    def load_config(self, config_path: str) -> ConfigResult:
        res = self._package_file(self._normalize_file_name(config_path))
        if res is None or not res.is_file():
            raise ConfigLoadError(f"Config not found : {config_path}")
        text = res.read_text(encoding="utf-8")
        return ConfigResult(config=OmegaConf.load(io.StringIO(text)), path=f"{self.scheme()}://{self.path}",
                            provider=self.provider, header=ConfigSource._get_header_dict(text))

    def available(self) -> bool:
        try:
            return resources.files(self.path).is_dir()
        except (ValueError, ModuleNotFoundError, TypeError):
            return False

    def is_group(self, config_path: str) -> bool:
        return config_path.strip("/") in ("", GROUP)

    def is_config(self, config_path: str) -> bool:
        res = self._package_file(self._normalize_file_name(config_path))
        return res is not None and res.is_file()

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> List[str]:
        files: List[str] = []
        path = config_path.strip("/")
        if path == "":
            if results_filter in (None, ObjectType.GROUP):
                files.append(GROUP)
            return files
        if path != GROUP:
            return files
        for file in resources.files(self.path).iterdir():
            self._list_add_result(
                files=files, file_path=os.path.join(GROUP, file.name), file_name=file.name, results_filter=results_filter
            )
        return sorted(set(files))
