"""Signals as interrupts: the signal received survives a library that re-raises it as a plain
KeyboardInterrupt, and ablate's handlers come back after a library replaced them."""

import os
import signal
import time

import pytest

from ablate.interrupts import Interrupted, as_interrupted, restore_handlers, signals_interrupt


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
