"""Signals as interrupts: the signal received survives a library that re-raises it as a plain
KeyboardInterrupt, ablate's handlers come back after a library replaced them, a stop of the
sweep reaches a job in another process, and a signal waits while a worker process starts."""

import os
import signal
import time

import pytest

from ablate.interrupts import (
    STOP_FILE_ENV,
    Interrupted,
    as_interrupted,
    deferred,
    request_stop,
    restore_handlers,
    signals_interrupt,
    stop_when_requested,
)


def test_a_plain_keyboard_interrupt_raised_for_sigterm_keeps_sigterm():
    with pytest.raises(KeyboardInterrupt) as caught:
        with signals_interrupt():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)  # the handler raises here
            except Interrupted:
                raise KeyboardInterrupt from None  # what ray.wait does with a handler's exception
    assert type(caught.value) is KeyboardInterrupt
    assert as_interrupted(caught.value).exit_status == 143
    with pytest.raises(KeyboardInterrupt) as again:  # a new sweep starts with no signal received
        with signals_interrupt():
            raise KeyboardInterrupt
    assert as_interrupted(again.value).exit_status == 130


def test_handlers_replaced_inside_a_block_are_put_back():
    before = signal.getsignal(signal.SIGTERM)
    with signals_interrupt():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what ray.init does to SIGTERM
        restore_handlers()
        with pytest.raises(Interrupted) as caught:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
    assert caught.value.exit_status == 143
    assert signal.getsignal(signal.SIGTERM) == before  # and the block gives back the handler it found


def test_a_stop_of_the_sweep_interrupts_a_job_its_signal_does_not_reach(tmp_path, monkeypatch):
    monkeypatch.setenv(STOP_FILE_ENV, str(tmp_path / ".stopping"))
    started = time.monotonic()
    with pytest.raises(Interrupted) as caught:
        with signals_interrupt(), stop_when_requested(interval=0.05):
            request_stop(signal.SIGHUP)  # what the sweep writes when it gets a SIGHUP of its own
            time.sleep(10)
    assert caught.value.signum == signal.SIGHUP and time.monotonic() - started < 5


def test_a_job_that_heard_the_signal_itself_is_not_interrupted_twice(tmp_path, monkeypatch):
    monkeypatch.setenv(STOP_FILE_ENV, str(tmp_path / ".stopping"))
    recorded = []
    with pytest.raises(Interrupted) as caught:
        with signals_interrupt(), stop_when_requested(interval=0.05):
            try:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C reaches the job itself
                time.sleep(10)
            except Interrupted as first:
                request_stop(signal.SIGINT)  # and the sweep asks it to stop as well
                time.sleep(0.5)  # the job records its interrupt: nothing may cut it short
                recorded.append(first.signum)
                raise
    assert recorded == [signal.SIGINT] and caught.value.signum == signal.SIGINT


def test_a_signal_while_a_process_starts_waits_for_the_start_to_end():
    steps = []
    with pytest.raises(Interrupted) as caught:
        with signals_interrupt():
            with deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)
                steps.append("started")
            steps.append("after")
    assert steps == ["started"] and caught.value.signum == signal.SIGTERM
