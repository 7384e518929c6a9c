"""Run a function on a module once it is imported, without importing it first.

The hook and the CPU plugin patch modules that only one of verl's processes imports (the
Megatron engine's, the trainer's) and that take seconds to import: importing them just to patch
them would slow every other process's start. :func:`when_imported` waits for the import instead.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any


def when_imported(name: str, callback: Callable[[Any], None]) -> None:
    """``callback(module)`` now if ``name`` is imported, else right after whoever imports it does."""
    if name in sys.modules:
        callback(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` once ``name`` has been imported, by whoever imports it."""

    def __init__(self, name: str, callback: Callable[[Any], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        # The finders after this one find the module: another callback waiting for the same
        # module (the hook and the CPU plugin both wait for verl's engine modules) wraps the
        # loader too, so that every callback runs, in the order they were asked for.
        spec = next((found for finder in list(sys.meta_path) if hasattr(finder, "find_spec")
                     for found in [finder.find_spec(fullname, path, target)] if found is not None), None)
        if spec is None or spec.loader is None:
            return spec
        loader, callback = spec.loader, self.callback

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                callback(module)

        spec.loader = Loader()
        return spec
