"""Puts the repository's ``sweeps/`` on the search path of ablate's own app (``sweeps=<name>``)."""


from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class AblateSweepsSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        import ablate

        repository = Path(ablate.__file__).resolve().parents[1]
        conf = str(repository / "conf")
        # Only ablate's app gets the sweeps: other Hydra apps in the environment (verl) are untouched.
        if any(element.path.rstrip("/") == conf for element in search_path.get_path()):
            search_path.append(provider="ablate-sweeps", path=f"file://{repository}")
