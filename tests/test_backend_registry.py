"""Backends are one object each, found by name in one registry (built-ins and entry points)."""

import pytest

from ablate.backends import BACKENDS, Backend, get_backend
from ablate.backends.noop import NoopConfig
from ablate.backends.synthetic_config import SyntheticConfig
from ablate.config import ConfigError
from synthetic_configs import compose_config


def test_each_builtin_backend_is_one_object_with_its_config_class():
    for name in ("noop", "synthetic", "verl"):
        backend = get_backend(name)
        assert isinstance(backend, Backend) and backend.name == name
    assert get_backend("synthetic").config is SyntheticConfig and get_backend("synthetic").preflight is None
    assert get_backend("verl").preflight is not None  # it launches another program: checked before writing


def test_an_unknown_backend_or_a_wrong_object_is_one_clear_line(monkeypatch):
    with pytest.raises(ConfigError, match=r"backend='nope': expected one of noop, synthetic, verl .*group ablate\.backends"):
        get_backend("nope")
    monkeypatch.setitem(BACKENDS, "noop", "ablate.backends.synthetic_config:BACKEND")
    with pytest.raises(ConfigError, match=r"backend='noop' at ablate.backends.synthetic_config:BACKEND is .*named 'noop'"):
        get_backend("noop")


def test_a_backend_reads_its_typed_settings_from_the_cell():
    from ablate.compose import cell_from_config

    cell = cell_from_config(compose_config("backend=noop", "policy=none", tiny=False))
    assert isinstance(get_backend("noop").config_of(cell), NoopConfig)
    with pytest.raises(TypeError, match="backend=synthetic got a NoopConfig: expected SyntheticConfig"):
        get_backend("synthetic").config_of(cell)
