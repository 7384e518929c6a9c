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


@pytest.fixture(autouse=True)
def _fixed_terminal_width(monkeypatch):
    """Printed tables and legends wrap at the terminal's width: a test reads them at 100 columns,
    whatever terminal (or none) the test run has."""
    monkeypatch.setenv("COLUMNS", "100")

# Schema violations are errors in tests (a logged warning in production).
os.environ["ABLATE_STRICT_SCHEMA"] = "1"
