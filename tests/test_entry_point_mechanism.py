"""ablate replaces a library's name and puts back exactly what was there (ablate/replay/entry_points.py).

A staticmethod (Megatron-core's ``RouterReplay.set_replay_data``) is put back as the staticmethod it
was, so that calling it on an instance still works; a replacement whose target lost a parameter is
refused in one line naming the release the row is written against.
"""

import importlib
import inspect
import sys
import textwrap
from dataclasses import dataclass
from typing import ClassVar

import pytest

from ablate.replay import entry_points as ep


@dataclass(frozen=True)
class LibraryPoint(ep.EntryPoint):
    against: ClassVar[str] = "library 1.0"


@pytest.fixture()
def library(tmp_path, monkeypatch):
    package = tmp_path / "replaylibrary"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "replay.py").write_text(textwrap.dedent('''
        class Replay:
            @staticmethod
            def set_data(all_layers):
                return ("library", all_layers)

            def set_targets(self, topk):
                return ("library", topk)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("replaylibrary.replay")
    for name in ("replaylibrary.replay", "replaylibrary"):  # each test imports its own copy
        sys.modules.pop(name, None)


def test_a_staticmethod_is_replaced_and_put_back_as_it_was(library):
    point = LibraryPoint("test", "replaylibrary.replay", "Replay.set_data", ("all_layers",), "a test")
    stored = inspect.getattr_static(library.Replay, "set_data")
    assert ep.replace(point, staticmethod(lambda all_layers: ("ablate", all_layers))) is stored
    assert library.Replay.set_data(1) == ("ablate", 1) and library.Replay().set_data(2) == ("ablate", 2)
    assert ep.original(point) is stored and ep.replaced(point)
    ep.restore(point)
    assert inspect.getattr_static(library.Replay, "set_data") is stored and not ep.replaced(point)
    assert library.Replay().set_data(3) == ("library", 3)  # still a staticmethod on an instance


def test_a_moved_parameter_is_refused_in_one_line_naming_the_release(library):
    point = LibraryPoint("test", "replaylibrary.replay", "Replay.set_targets", ("self", "topk_indices"), "a test")
    with pytest.raises(ep.EntryPointMissing) as raised:
        ep.replace(point, lambda self, topk_indices: None)
    assert str(raised.value) == (
        "replaylibrary.replay.Replay.set_targets takes (self, topk), not (self, topk_indices, ...): ablate's hook "
        "replaces it with a test and is written against library 1.0; every entry point: "
        "ablate/backends/verl/entry_points.py")
    assert inspect.getattr_static(library.Replay, "set_targets") is library.Replay.__dict__["set_targets"]
    assert library.Replay().set_targets(4) == ("library", 4)
    with pytest.raises(ep.EntryPointMissing, match=r"^replaylibrary\.replay\.Replay\.set_targets takes \(self, topk\)"):
        ep.check_params(point, ep.source_params(point))  # the sources say the same, read without importing
