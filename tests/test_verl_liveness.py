"""A verl cell whose replay silently does nothing fails with one line that says which case it is.

The records are shaped as verl's file logger delivers a step (the hook's keys with their
``actor/`` prefix taken off, the hook's micro-batch count kept under its native name); the CPU
end-to-end tier shows the first case on a real verl run.
"""

import pytest

from ablate.backends.verl.liveness import SEEN_KEY, SilentReplay, check_step

STEP = {"replay/valid_routes": 120.0, "replay/replayed_routes": 60.0, "routing/residual_mismatch_rate": 0.1}


def test_a_live_step_passes_and_none_needs_only_the_installed_hook():
    check_step(1, STEP, {SEEN_KEY: 2.0}, 0.5)
    check_step(1, {**STEP, "replay/replayed_routes": 0.0}, {SEEN_KEY: 0.0}, 0.0)
    check_step(1, {**STEP, "replay/replayed_routes": 120.0, "routing/residual_mismatch_rate": 0.0},
               {SEEN_KEY: 2.0}, 1.0)


@pytest.mark.parametrize("record, native, budget, says", [
    (STEP, {}, 0.5, "step 3: the replay hook never installed in verl's actor"),
    (STEP, {}, 0.0, "step 3: the replay hook never installed in verl's actor"),
    (STEP, {SEEN_KEY: 0.0}, 0.5, "step 3: the replay hook saw no R3 micro-batch at budget 0.5"),
    ({**STEP, "replay/replayed_routes": 0.0}, {SEEN_KEY: 2.0}, 0.25,
     "step 3: replayed none of its 120 recorded routes at budget 0.25"),
    ({**STEP, "replay/replayed_routes": 120.0}, {SEEN_KEY: 2.0}, 1.0,
     "step 3: budget 1 left 0.1 of its valid routes mismatched after replay"),
])
def test_each_silent_no_op_fails_in_one_line(record, native, budget, says):
    with pytest.raises(SilentReplay) as raised:
        check_step(3, record, native, budget)
    message = str(raised.value)
    assert message.startswith(says) and "\n" not in message
