"""What the wheel ships: every package of the source tree, the configs, sweeps and the verl pin."""

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
from pathlib import Path

from setuptools import find_namespace_packages

from ablate.backends.verl.launch import VERL_VERSION

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_explicit_package_list_covers_the_source_tree():
    """The list is explicit (mapped folders defeat discovery), so nothing may be missing from it."""
    discovered = set(find_namespace_packages(where=str(ROOT), include=["ablate*", "hydra_plugins*"]))
    mapped = {package for package in PYPROJECT["package-dir"]}
    mapped_children = {
        ".".join([package, *child.relative_to(ROOT / folder).parts]) for package, folder in PYPROJECT["package-dir"].items()
        for child in (ROOT / folder).rglob("*") if child.is_dir() and any(child.glob("*.yaml"))
    }
    assert set(PYPROJECT["packages"]) == discovered | mapped | mapped_children


def test_configs_and_sweeps_are_package_data():
    import importlib.resources as resources

    conf = resources.files("ablate.conf")
    assert conf.joinpath("config.yaml").is_file()
    assert {p.name for p in conf.joinpath("policy").iterdir()} >= {f"{n}.yaml" for n in ("none", "full", "fisher")}
    assert {p.name for p in resources.files("ablate.sweeps").iterdir()} >= {"smoke.yaml", "budget_selection.yaml"}
    for package, patterns in PYPROJECT["package-data"].items():
        assert patterns, package


def test_required_verl_matches_the_pin_the_code_checks():
    pairs = {}
    for line in (ROOT / "REQUIRED_VERL.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    assert pairs["TAG"] == f"v{VERL_VERSION}"
    assert f"verl=={VERL_VERSION}" in pairs["PIP_INSTALL"]
