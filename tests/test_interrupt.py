"""Signals during training: `kdist.workers.interrupt.stop_on_signals`."""

import os
import signal

import pytest

from kdist.workers import interrupt

# Nothing here depends on the backend (signal handling): one session runs it.
pytestmark = pytest.mark.any_backend


def test_a_second_signal_ends_a_process_that_escalates():
    stop = interrupt.StopRequest()
    with pytest.raises(KeyboardInterrupt):
        with interrupt.stop_on_signals(stop):
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.signal_name == "SIGTERM"
            os.kill(os.getpid(), signal.SIGINT)  # Now Python's own handler: at once.
    assert stop.signal_name == "SIGTERM"


def test_a_supervised_process_keeps_the_first_signal_and_goes_on_stopping():
    stop = interrupt.StopRequest()
    before = signal.getsignal(signal.SIGINT)
    with interrupt.stop_on_signals(stop, escalate=False):
        os.kill(os.getpid(), signal.SIGTERM)  # A scheduler's, to every process...
        os.kill(os.getpid(), signal.SIGTERM)  # ...then the parent's, forwarded.
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGINT) is before
