"""What a sweep reports while and after its cells run: the ETA of cells that run side by side,
and a tally that never calls a cell a live worker still holds "not run"."""

import time
from collections import Counter
from pathlib import Path

from synthetic_configs import compose_config

from ablate.launchers.stopping import settle
from ablate.store import CellState, atomic_write_json, held
from ablate.sweep import Pace, plan_grid, progress_line, tally

RUNNING, COMPLETE, NEW = CellState.RUNNING, CellState.COMPLETE, CellState.NEW
A, B, C, D = (Path(name) for name in "abcd")


def test_cells_that_run_together_leave_little_time_once_the_first_ends():
    pace = Pace()
    pace.update({A: RUNNING, B: RUNNING, C: RUNNING, D: RUNNING}, 20.0)  # after 20 s of start-up
    assert pace.eta({A: RUNNING, B: RUNNING, C: RUNNING, D: RUNNING}, 25.0) is None  # nothing ended yet
    states = {A: COMPLETE, B: RUNNING, C: RUNNING, D: RUNNING}
    pace.update(states, 26.0)
    assert pace.eta(states, 26.0) == 0.0
    # The elapsed time per cell would have said 26 s for each of the three still running.
    assert progress_line("s", Counter(states.values()), 26.0, pace.eta(states, 26.0)).endswith(
        "[0:26 elapsed, 26.0 s/cell, ETA 0:00]")


def test_the_work_left_is_spread_over_the_workers_running_now():
    two = Pace()
    two.update({A: RUNNING, B: RUNNING, C: NEW, D: NEW}, 0.0)
    states = {A: COMPLETE, B: COMPLETE, C: RUNNING, D: RUNNING}
    two.update(states, 6.0)
    assert two.eta(states, 6.0) == 6.0  # two workers, two cells of 6 s just started
    one = Pace()
    one.update({A: RUNNING, B: NEW, C: NEW}, 0.0)
    one.update({A: COMPLETE, B: RUNNING, C: NEW}, 6.0)
    assert one.eta({A: COMPLETE, B: RUNNING, C: NEW}, 9.0) == 9.0  # half of B, then all of C


def test_a_failed_cell_does_not_count_as_a_duration():
    pace = Pace()
    pace.update({A: RUNNING, B: RUNNING}, 0.0)
    pace.update({A: CellState.FAILED, B: RUNNING}, 0.5)
    assert pace.eta({A: CellState.FAILED, B: RUNNING}, 0.5) is None


def test_the_tally_waits_a_bounded_time_for_a_live_claim_and_names_a_cell_still_running(tmp_path):
    planned = plan_grid([["policy=random", "budget=0.1", "seed=0"]], lambda o: compose_config(*o, store=tmp_path))
    directory = planned[0].directory
    with held(directory):  # a live worker (this process) holds the cell and has not ended it
        atomic_write_json(directory / "status.json", {"status": "running", "attempt": 1})
        started = time.monotonic()
        settle(planned, timeout=1.0)
        assert 1.0 <= time.monotonic() - started < 5.0
        result = tally(planned)
        assert result.line("g", 5.0, tmp_path).startswith("sweep g: 0 complete, 0 failed, 1 still running, 0 skipped")
        assert result.problems[0].startswith("still running: random-b0.1-s0: pid ") and not result.ok
    # Its worker gone without a result: a failure, not a cell still running nor one not run.
    assert tally(planned).problems[0].startswith("failed: random-b0.1-s0: no live worker holds it")
