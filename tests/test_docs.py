"""The documentation: the generated key reference, the site's nav, and the README's links.

The strict MkDocs build (``make docs``) checks every link between pages; these tests check, in the
fast tier and without MkDocs, what the build cannot: that the generated reference holds the whole
schema, and that the README (read on its own, outside the site) links only to files that exist.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from ablate.diagnostics.schema import SCHEMA

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_diagnostics", DOCS / "gen_diagnostics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mkdocs_config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_the_generated_reference_lists_every_schema_key_with_its_unit_meaning_and_nan_rule():
    gen = _generator()
    page = gen.render(gen.load_schema())
    rows = {line.split("`")[1]: line for line in page.splitlines() if line.startswith("| `")}
    assert set(rows) == set(SCHEMA), "the reference and the schema list different keys"
    for name, key in SCHEMA.items():
        row = rows[name]
        # A pipe in a table cell is escaped, or it would end the cell.
        assert key.unit.replace("|", "\\|") in row, f"{name}: unit {key.unit!r} missing"
        assert key.meaning.replace("|", "\\|") in row, f"{name}: meaning missing"
        assert row.split(" | ")[1].endswith(", or NaN") == key.nullable, f"{name}: wrong NaN rule"
    assert "| `replay/budget_requested` | number in [0, 1] | fraction of valid routes |" in page
    assert "| `replay/valid_routes` | integer >= 0 | routes |" in page
    assert "| `replay/override_rate` | number in [0, 1], or NaN |" in page
    assert "| `mismatch/kl_k1` | any number | nats |" in page


def test_the_site_builds_the_reference_with_its_hook_and_names_it_in_the_nav():
    config = _mkdocs_config()
    assert "docs/gen_diagnostics.py" in config["hooks"]
    assert _generator().PAGE in _nav_pages(config["nav"])


def test_the_nav_names_every_page_in_docs_and_only_pages_that_exist():
    generated = {_generator().PAGE}
    nav = _nav_pages(_mkdocs_config()["nav"])
    missing = [page for page in nav if page not in generated and not (DOCS / page).is_file()]
    assert not missing, f"mkdocs.yml names pages that do not exist: {missing}"
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    omitted = sorted(pages - set(nav))
    assert not omitted, f"pages in docs/ missing from the nav of mkdocs.yml (add each under its topic): {omitted}"


def _relative_links(markdown: str) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", markdown)
    return [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_every_relative_link_of_the_readme_points_at_a_file_that_exists():
    links = _relative_links((ROOT / "README.md").read_text())
    assert len(links) >= 10, "the README links into the docs"
    broken = [link for link in links if not (ROOT / link.split("#")[0]).is_file()]
    assert not broken, f"README.md links to missing files: {broken}"


@pytest.mark.parametrize("command", ["make test", "make docs"])
def test_the_readme_commands_are_what_ci_runs(command):
    assert command in (ROOT / "README.md").read_text()
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
