"""The analysis package's modules import one another without a cycle, lazy imports included.

A cycle closed by an import inside a function works until someone moves that import to the top of
its module; then importing either module fails halfway. Imports under ``if TYPE_CHECKING:`` never
run and are left out. (The analysis imports its own modules by absolute name only.)
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_import_graph import PACKAGE, cycles

ANALYSIS = PACKAGE / "analysis"


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def runtime_imports(path: Path) -> set[str]:
    """The analysis modules ``path`` imports when it runs, at its top or inside a function."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    modules = {module_of(other) for other in ANALYSIS.rglob("*.py")}
    return {name for name in found if name in modules and name not in ("ablate.analysis", module_of(path))}


def module_graph() -> dict[str, set[str]]:
    return {module_of(path): runtime_imports(path) for path in ANALYSIS.rglob("*.py")}


def test_the_reader_sees_lazy_imports_and_skips_type_checking_ones(tmp_path):
    graph = module_graph()
    assert "ablate.analysis.plots" in graph["ablate.analysis.writer"]  # inside a function only
    assert "ablate.analysis.sources.wandb_offline" in graph["ablate.analysis.load"]  # inside a function only
    source = ANALYSIS / "verdict.py"
    guarded = tmp_path / "guarded.py"
    guarded.write_text("from typing import TYPE_CHECKING\n"
                       "if TYPE_CHECKING:\n    from ablate.analysis.cli import main\n")
    assert runtime_imports(source) and not runtime_imports(guarded)


def test_no_import_cycle_between_the_analysis_modules():
    assert cycles(module_graph()) == []
