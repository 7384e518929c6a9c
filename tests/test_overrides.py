"""Values ablate hands back to Hydra's override parser come back exactly as they were."""

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from ablate.overrides import hydra_string, quoted_override

#: Issue 18, defect 1: each of these in a store path broke every sweep.
AWKWARD = ["/tmp/p (copy)/runs", "/tmp/é/runs", "/tmp/a,b/runs", "/tmp/l'x/runs", "/tmp/k=v/runs", "/tmp/x[1]/runs",
           "/tmp/{a: 1}/runs", "/tmp/back\\slash\\", "/tmp/quote\\'d", "/tmp/two  spaces", "0.3", "null", "true", ""]


@pytest.mark.parametrize("value", AWKWARD)
def test_a_quoted_override_parses_back_to_the_same_string(value):
    parsed = OverridesParser.create().parse_override(quoted_override("store_dir", value))
    assert parsed.key_or_group == "store_dir" and parsed.value() == value and not parsed.is_sweep_override()


def test_a_value_is_single_quoted():
    assert hydra_string("p (copy)") == "'p (copy)'" and hydra_string("l'x") == "'l\\'x'"
