"""The core's imports flow one way (docs/design.md, "Data flows one way").

The graph is read from the source, every import statement included: those inside functions
(lazy imports) and, between areas, under ``if TYPE_CHECKING``. An *area* is a subpackage of
``ablate`` or a top-level module (the package's own ``__init__`` is the area ``ablate``). Between
*modules* no cycle is allowed either, lazy imports included: an import inside a function that
closes a loop is a cycle postponed, not removed. Only imports under ``if TYPE_CHECKING`` (names
for annotations, never executed) are left out of the module graph.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ablate"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


class _WithoutTypeChecking(ast.NodeTransformer):
    """Drops ``if TYPE_CHECKING:`` blocks: their imports never run."""

    def visit_If(self, node: ast.If) -> ast.AST | None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            return None
        return self.generic_visit(node)


def imported_modules(path: Path, *, type_checking: bool = True) -> set[str]:
    """Every ablate module ``path`` imports, with ``from package import module`` read as the module.

    ``type_checking=False`` leaves out the imports under ``if TYPE_CHECKING``.
    """
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if not type_checking:
        tree = _WithoutTypeChecking().visit(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            modules = {f"{base}.{alias.name}" for alias in node.names if is_module(f"{base}.{alias.name}")}
            found.update(modules)
            if len(modules) < len(node.names):  # names defined in ``base`` itself
                found.add(base)
    return {name for name in found if name == "ablate" or name.startswith("ablate.")}


def area(module: str) -> str:
    return ".".join(module.split(".")[:2])


def area_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        source = area(module_name(path))
        graph[source].update(area(target) for target in imported_modules(path) if area(target) != source)
    return graph


def module_graph() -> dict[str, set[str]]:
    """Module -> the ablate modules it imports when it runs (any import statement, none under TYPE_CHECKING)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        source = module_name(path)
        graph[source].update(target for target in imported_modules(path, type_checking=False) if target != source)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one area (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in graph.get(node, ()):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_reader_sees_lazy_and_type_checking_imports(tmp_path):
    # The test is only as good as its reader: a lazy import and a TYPE_CHECKING import count.
    graph = area_graph()
    assert "ablate.cell" in graph["ablate.backends"]  # backends/__init__.py: under TYPE_CHECKING only
    assert "ablate.runner" in graph["ablate.app"]  # app.py: inside a function only


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_areas():
    assert cycles(area_graph()) == []


def test_the_module_reader_sees_lazy_imports_and_skips_type_checking_ones():
    graph = module_graph()
    assert "ablate.runner" in graph["ablate.app"]  # app.py: inside a function only
    assert "ablate.cell" not in graph["ablate.backends"]  # backends/__init__.py: under TYPE_CHECKING only


def test_no_import_cycle_between_modules():
    assert cycles(module_graph()) == []


def test_nothing_outside_the_analysis_imports_it():
    importers = sorted(source for source, targets in area_graph().items()
                       if "ablate.analysis" in targets and source != "ablate.analysis")
    assert importers == []


@pytest.mark.parametrize(("area_name", "forbidden"), [
    ("ablate.diagnostics", "ablate.policies"),  # diagnostics need no concrete policy
    ("ablate.config", "ablate.backends"),  # config checks need no registry
    ("ablate.cell", "ablate.backends"),  # a cell is data: the registry is consulted where it is composed
    ("ablate.store", "ablate.cell"),  # the store knows directories and files, not cells
])
def test_layer_does_not_reach_up(area_name, forbidden):
    assert forbidden not in area_graph()[area_name]
