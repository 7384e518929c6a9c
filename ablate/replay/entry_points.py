"""A name ablate replaces in another library at run time: checked before it is touched, put back exactly.

ablate edits no file of verl, Megatron-core or VeOmni. Where it replays routes inside them it
replaces a few names while it runs; each one is an :class:`EntryPoint`, and every entry point of
every replay path is a row of one table, ``ablate/backends/verl/entry_points.py``. Each is
checked twice:

- before any work, from the installed sources without importing them (:func:`source_params`);
- when it is replaced (:func:`replace`): the live object, its signature inspected, so nothing
  is ever wrapped silently in the wrong place.

:func:`restore` puts back the very object that was there, so the library behaves as before.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

TABLE = "ablate/backends/verl/entry_points.py"


@dataclass(frozen=True)
class EntryPoint:
    """One name ablate replaces: ``module.name`` (``name`` may be ``Class.method``).

    ``params`` are the leading parameters ablate's replacement receives and passes on; the
    installed function must start with them. None: the name is no function (a module attribute,
    a registry, a class), and must only be there. ``engine`` is the replay path that replaces it.
    ``during`` says when it is replaced: for the whole process once a hook is installed, for the
    length of one call, or for the length of a context. ``cpu``: only a CPU run
    (``backend=verl_cpu``) replaces it.
    """

    #: the release ablate's replacement is written against, named when the entry point is refused:
    #: each block of the table is a subclass that sets it.
    against: ClassVar[str]

    engine: str
    module: str
    name: str
    params: tuple[str, ...] | None
    ablate: str
    during: str = "process"
    cpu: bool = False

    @property
    def where(self) -> str:
        return f"{self.module}.{self.name}"

    def refusal(self, problem: str) -> str:
        """The one-line error for this entry point when ``problem`` is found."""
        return (f"{self.where} {problem}: ablate's hook replaces it with {self.ablate} and is written against "
                f"{self.against}; every entry point: {TABLE}")


class EntryPointMissing(RuntimeError):
    """An entry point that is not where the table says, or not with the parameters ablate passes on."""


def missing(point: EntryPoint, problem: str) -> EntryPointMissing:
    return EntryPointMissing(point.refusal(problem))


def check_params(point: EntryPoint, found: list[str] | None) -> None:
    if point.params is None:
        return
    if found is None:
        raise missing(point, "is not a function")
    if found[:len(point.params)] != list(point.params):
        raise missing(point, f"takes ({', '.join(found)}), not ({', '.join(point.params)}, ...)")


# ------------------------------------------------------------------ before any work: the sources only
def _source_file(module: str) -> Path | None:
    """The source file of ``module``, found from its top-level package without importing the module."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        base = Path(root).joinpath(*rest)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def parsed_source(point: EntryPoint, module: str) -> tuple[Path, list[ast.stmt]]:
    """``module``'s source file and its top-level statements, read without importing it."""
    path = _source_file(module)
    if path is None:
        raise missing(point, f"is not there: module {module} is not installed")
    return path, ast.parse(path.read_text(encoding="utf-8")).body


def source_params(point: EntryPoint, module: str | None = None, hops: int = 3) -> list[str] | None:
    """Parameter names of ``point.name`` as defined in ``module``'s source (following ``from x import``);
    None where it is defined as no function (a class, an assignment, an import, for a row of ``params=None``)."""
    module = module or point.module
    path, scope = parsed_source(point, module)
    *owners, name = point.name.split(".")
    for owner in owners:
        found = next((node for node in scope if isinstance(node, ast.ClassDef) and node.name == owner), None)
        if found is None:
            raise missing(point, f"is not there: {module} defines no class {owner}")
        scope = found.body
    for node in scope:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            arguments = node.args
            return [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
        if point.params is None and _defines(node, name):
            return None
        if not owners and isinstance(node, ast.ImportFrom) and hops > 0:
            if any((alias.asname or alias.name) == name and alias.name == name for alias in node.names):
                return source_params(point, imported_module(module, node, path), hops - 1)
    raise missing(point, f"is not there: {module} defines no {point.name}")


def _defines(node: ast.stmt, name: str) -> bool:
    """``node`` binds ``name`` as something other than a function: a class, an assignment, an import."""
    if isinstance(node, ast.ClassDef):
        return node.name == name
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(isinstance(target, ast.Name) and target.id == name for target in targets)
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((alias.asname or alias.name).split(".")[0] == name for alias in node.names)
    return False


def imported_module(module: str, node: ast.ImportFrom, path: Path) -> str:
    """The absolute name of the module a ``from ... import`` statement of ``module`` (at ``path``) reads."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


# ----------------------------------------------------------------- when replaced: the live objects
_ORIGINALS: dict[EntryPoint, Any] = {}


def original(point: EntryPoint) -> Any:
    """What ``point`` held before ablate replaced it (what it holds now if not replaced)."""
    return _ORIGINALS[point] if point in _ORIGINALS else lookup(point)[2]


def lookup(point: EntryPoint) -> tuple[Any, str, Any]:
    """(the object holding the name, the attribute, its current value), with its signature checked."""
    module = sys.modules.get(point.module) or importlib.import_module(point.module)
    *owners, attribute = point.name.split(".")
    owner: Any = module
    for name in owners:
        owner = getattr(owner, name, None)
        if owner is None:
            raise missing(point, f"is not there: {point.module} has no {name}")
    current = owner.__dict__.get(attribute) if isinstance(owner, type) else getattr(owner, attribute, None)
    if current is None:
        raise missing(point, f"is not there: {'.'.join([point.module, *owners])} has no {attribute}")
    if point.params is not None:
        function = current.__func__ if isinstance(current, (staticmethod, classmethod)) else current
        kept = _ORIGINALS.get(point, function)
        target = inspect.unwrap(kept.__func__ if isinstance(kept, (staticmethod, classmethod)) else kept)
        check_params(point, list(inspect.signature(target).parameters))
    return owner, attribute, current


def verify(*points: EntryPoint) -> None:
    """Each live object where its row says, with the parameters it says: for names wrapped in place."""
    for point in points:
        lookup(point)


def replace(point: EntryPoint, replacement: Any) -> Any:
    """Put ``replacement`` in ``point``'s place (checked first); returns the original it stands in for."""
    owner, attribute, current = lookup(point)
    previous = _ORIGINALS.setdefault(point, current)
    setattr(owner, attribute, replacement)
    return previous


def restore(point: EntryPoint) -> None:
    """Put the original back, if ``point`` was replaced."""
    if point in _ORIGINALS:
        owner, attribute, _ = lookup(point)
        setattr(owner, attribute, _ORIGINALS.pop(point))


def replaced(point: EntryPoint) -> bool:
    return point in _ORIGINALS
