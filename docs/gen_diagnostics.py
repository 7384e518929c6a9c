"""The diagnostics key reference, generated from the schema at every docs build.

mkdocs runs this file as a hook (``hooks:`` in mkdocs.yml): it adds the page
``diagnostics-keys.md``, rendered from ``ablate/diagnostics/schema.json``, so the reference can
never drift from the schema. It reads the JSON export rather than importing ``ablate``, so the
docs build needs neither torch nor the package; a test keeps the JSON equal to the Python schema.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMA_JSON = Path(__file__).resolve().parents[1] / "ablate" / "diagnostics" / "schema.json"
PAGE = "diagnostics-keys.md"

# One line per section, in the schema's order: what the keys of that prefix measure.
SECTION_INTROS = {
    "replay": "What the mask did: budget, counts, how much replay changed, the Fisher estimate.",
    "routing": "Rollout routes against the training router's native routes.",
    "mismatch": "Rollout against training log-probs after replay, with `l = logp_train - logp_rollout`.",
    "load": "Expert load of the routes the training forward used, per layer, reduced over layers.",
    "drift": "Relative parameter change since step 0.",
    "train": "The RL update itself.",
}


def load_schema(path: Path = SCHEMA_JSON) -> dict[str, Any]:
    return json.loads(path.read_text())


def _fields(prop: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The key's own JSON Schema entry and whether NaN is allowed (nullable keys wrap it in anyOf)."""
    if "anyOf" in prop:
        return prop["anyOf"][0], True
    return prop, False


def _meaning(entry: dict[str, Any]) -> str:
    """The description without its trailing ``[unit]``, which the table shows in its own column."""
    description = entry["description"]
    suffix = f" [{entry['x-unit']}]"
    return description[: -len(suffix)] if description.endswith(suffix) else description


def _values(entry: dict[str, Any], nullable: bool) -> str:
    """The JSON type and range in words, e.g. ``number in [0, 1], or NaN``."""
    low, high = entry.get("minimum"), entry.get("maximum")
    if low is None and high is None:
        values = f"any {entry['type']}"
    elif high is None:
        values = f"{entry['type']} >= {low:g}"
    else:
        values = f"{entry['type']} in [{low:g}, {high:g}]"
    return values + (", or NaN" if nullable else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(schema: dict[str, Any]) -> str:
    """The reference page: one table per section, one row per key, in the schema's order."""
    sections: dict[str, list[str]] = {}
    for name in schema["properties"]:
        sections.setdefault(name.split("/", 1)[0], []).append(name)
    lines = [
        "# Diagnostics keys",
        "",
        f"Generated from `ablate/diagnostics/schema.json` ({schema['title']}) when the site is built.",
        "Every record a backend logs is validated against this schema; a key whose values include NaN",
        "is NaN in a step where it is undefined. The schema and what the keys mean are explained in",
        "[Diagnostics](diagnostics.md).",
    ]
    for section, names in sections.items():
        lines += ["", f"## `{section}/`", ""]
        if section in SECTION_INTROS:
            lines += [SECTION_INTROS[section], ""]
        lines += ["| key | values | unit | meaning |", "| --- | --- | --- | --- |"]
        for name in names:
            entry, nullable = _fields(schema["properties"][name])
            lines.append(
                f"| `{name}` | {_values(entry, nullable)} | {_cell(entry['x-unit'])} | {_cell(_meaning(entry))} |"
            )
    return "\n".join(lines) + "\n"


def on_files(files, config):
    """mkdocs hook: add the generated page before the nav is built, so the nav can name it."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render(load_schema())))
    return files
