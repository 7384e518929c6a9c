import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Nothing a test does may reach a W&B account or the user's W&B settings.
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DISABLE_GIT", "true")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(autouse=True)
def _isolated_wandb(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("wandb-home")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / "cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(home / "data"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)

# Schema violations are errors in tests (a logged warning in production).
os.environ["ABLATE_STRICT_SCHEMA"] = "1"

#: Overrides that shrink the synthetic backend to a cell of about a second.
TINY = [
    "backend.steps=6", "backend.layers=2", "backend.experts=4", "backend.topk=2", "backend.d_model=16",
    "backend.expert_hidden=16", "backend.prompts_per_step=4", "backend.group_size=4", "backend.digits=3",
    "backend.router_noise=0.05",
]


def compose_config(*overrides: str, store: Path | None = None, tiny: bool = True):
    """The real app config, composed with Hydra's compose API from the package's configs.

    ``tiny`` shrinks the synthetic backend (``TINY``); pass False for another backend.
    """
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="ablate.conf", version_base="1.3"):
        extra = [f"store_dir={store}"] if store is not None else []
        return compose("config", overrides=[*(TINY if tiny else []), *extra, *overrides])
