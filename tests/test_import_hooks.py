"""``when_imported``: a function run on a module right after its import, or at once if it is imported."""

from __future__ import annotations

import sys

from ablate.backends.verl.import_hooks import when_imported


def test_a_callback_waits_for_the_import_then_sees_the_whole_module(tmp_path, monkeypatch):
    (tmp_path / "ablate_hook_probe").mkdir()
    (tmp_path / "ablate_hook_probe" / "__init__.py").write_text("")
    (tmp_path / "ablate_hook_probe" / "late.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def bump(module):
        seen.append(module.__name__)
        module.VALUE += 1

    finders = list(sys.meta_path)
    when_imported("ablate_hook_probe.late", bump)
    import ablate_hook_probe  # noqa: F401  (the parent: not the module waited for)

    assert seen == []
    from ablate_hook_probe import late

    assert seen == ["ablate_hook_probe.late"] and late.VALUE == 42
    assert sys.meta_path == finders  # the hook removed itself
    when_imported("ablate_hook_probe.late", bump)  # imported already: at once
    assert seen == ["ablate_hook_probe.late"] * 2 and late.VALUE == 43
    for name in ("ablate_hook_probe.late", "ablate_hook_probe"):
        sys.modules.pop(name)


def test_every_callback_waiting_for_one_module_runs_in_the_order_asked(tmp_path, monkeypatch):
    """The hook's engine arming and the CPU plugin's stand-ins both wait for verl's engine modules."""
    (tmp_path / "ablate_hook_twice.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    finders = list(sys.meta_path)
    when_imported("ablate_hook_twice", lambda module: seen.append(("first", module.VALUE)))
    when_imported("ablate_hook_twice", lambda module: seen.append(("second", module.VALUE)))
    import ablate_hook_twice  # noqa: F401

    assert seen == [("first", 1), ("second", 1)]
    assert sys.meta_path == finders
    sys.modules.pop("ablate_hook_twice")
