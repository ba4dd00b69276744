"""SIGINT/SIGTERM handling: stop at a step boundary, checkpoint, exit non-zero."""

import contextlib
import signal


class StopRequest:
    """Set by the first SIGINT/SIGTERM; the loop checks it after every step.

    The first signal lets the current step finish so a checkpoint can be
    written. The handlers are then restored to the defaults, so a second
    Ctrl-C raises KeyboardInterrupt at once (checkpoint writes are atomic, so
    that never leaves a half-written checkpoint behind).
    """

    def __init__(self):
        self.signal_name = None

    def __bool__(self):
        return self.signal_name is not None

    def request(self, signal_name):
        self.signal_name = signal_name


@contextlib.contextmanager
def stop_on_signals(stop):
    """Routes SIGINT and SIGTERM to `stop` for the duration of the block."""
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in signals}

    def handler(signum, frame):
        stop.request(signal.Signals(signum).name)
        for s in signals:
            signal.signal(s, signal.SIG_DFL if s == signal.SIGTERM else signal.default_int_handler)

    for s in signals:
        signal.signal(s, handler)
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
