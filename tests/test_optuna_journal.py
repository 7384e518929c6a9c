"""A crash in the middle of an append to the Optuna journal costs that one record, never the study."""

import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from synthetic_configs import TINY
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from hydra_plugins.ablate_optuna_sweeper._journal import JournalDamaged, repair_journal


def tune_fisher(tmp_path: Path, trials: int) -> subprocess.CompletedProcess:
    """The issue's command: ``sweeps=tune_fisher backend.steps=5 tracking.mode=disabled hydra.sweeper.n_trials=N``."""
    command = [sys.executable, "-m", "ablate", "sweeps=tune_fisher", *TINY, "backend.steps=5", "tracking.mode=disabled",
               f"hydra.sweeper.n_trials={trials}", f"store_dir={tmp_path / 'runs'}"]
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def journal_trials(journal: Path) -> list[tuple[int, TrialState]]:
    study = optuna.load_study(study_name="tune_fisher", storage=JournalStorage(JournalFileBackend(str(journal))))
    return [(t.number, t.state) for t in study.get_trials()]


def records(*operations: dict) -> bytes:
    return b"".join(json.dumps(op, separators=(",", ":")).encode() + b"\n" for op in operations)


OPS = [{"op_code": 0, "worker_id": "w", "study_name": "s", "directions": [1]},
       {"op_code": 4, "worker_id": "w", "study_id": 0, "datetime_start": "2026-01-01T00:00:00"},
       {"op_code": 6, "worker_id": "w", "trial_id": 0, "state": 1, "values": [0.5]}]


@pytest.mark.slow
def test_a_journal_cut_mid_record_costs_that_record_and_the_study_goes_on(tmp_path):
    first = tune_fisher(tmp_path, 2)
    assert first.returncode == 0, first.stderr
    journal = tmp_path / "runs" / "tune_fisher" / "optuna.journal"
    whole = journal.read_bytes()
    journal.write_bytes(whole[:-20])  # truncate -s -20: the last record (trial 1 told complete) is cut

    resumed = tune_fisher(tmp_path, 3)
    assert resumed.returncode == 0, resumed.stderr
    output = resumed.stdout + resumed.stderr
    assert "optuna.journal: its last record was cut by a crash (" in output and "JSONDecodeError" not in output
    assert "1 interrupted (relaunched)" in output  # trial 1 lost its "complete" record: relaunched, read back
    assert journal_trials(journal) == [(0, TrialState.COMPLETE), (1, TrialState.COMPLETE), (2, TrialState.COMPLETE)]

    again = tune_fisher(tmp_path, 3)  # every later run opens the study, with no repair left to do
    assert again.returncode == 0, again.stderr
    assert "cut by a crash" not in again.stdout + again.stderr and "0 to ask for" in again.stdout + again.stderr


def test_a_record_glued_onto_a_cut_one_is_split_off_and_kept(tmp_path):
    """What an earlier version left: the next append landed on the cut line."""
    journal = tmp_path / "optuna.journal"
    whole = records(*OPS)
    cut = whole[: len(whole) - 20]  # the last record, cut...
    journal.write_bytes(cut + json.dumps(OPS[2], separators=(",", ":")).encode() + b"\n")  # ...then appended again

    (problem,) = repair_journal(journal)
    assert "line 3 began with" in problem and "record cut by a crash" in problem
    assert journal.read_bytes() == whole
    assert repair_journal(journal) == []  # a whole journal is left as it is


def test_a_whole_last_record_that_lost_its_end_of_line_is_kept(tmp_path):
    journal = tmp_path / "optuna.journal"
    journal.write_bytes(records(*OPS)[:-1])
    (problem,) = repair_journal(journal)
    assert "lost its end of line" in problem
    assert journal.read_bytes() == records(*OPS)


def test_a_line_that_is_no_record_is_named_and_nothing_is_rewritten(tmp_path):
    journal = tmp_path / "optuna.journal"
    damaged = records(*OPS[:2]) + b"not json at all\n" + records(OPS[2])
    journal.write_bytes(damaged)
    with pytest.raises(JournalDamaged, match=r"optuna.journal: line 3 is not an Optuna journal record"):
        repair_journal(journal)
    assert journal.read_bytes() == damaged
    assert not list(tmp_path.glob("*.lock"))  # the journal's lock is released


def test_a_damaged_journal_ends_the_study_with_one_line(tmp_path):
    journal = tmp_path / "runs" / "tune_fisher" / "optuna.journal"
    journal.parent.mkdir(parents=True)
    journal.write_bytes(b"not json at all\n")
    done = tune_fisher(tmp_path, 1)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("ablate: ") and "optuna.journal: line 1 is not an Optuna journal record" in lines[-1]
    assert "Traceback" not in done.stderr
