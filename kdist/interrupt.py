"""SIGINT/SIGTERM handling: stop at a step boundary, checkpoint, exit non-zero.

Before training takes the signals over (`stop_on_signals`), while the
frameworks load, `exit_on_signals` ends the process with one line instead of
a traceback.
"""

import contextlib
import os
import signal
import sys


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



@contextlib.contextmanager
def exit_on_signals(message):
    """Ends the process on SIGINT or SIGTERM within the block, with one line.

    It prints `interrupted: SIGINT: <message>` (or SIGTERM) to stderr and
    exits with status 128 + the signal number at once, without unwinding:
    an exception raised into an import that runs native code (NumPy's,
    TensorFlow's) can come out as another error with a long traceback. Meant
    for start-up, before training takes the signals over, where there is
    nothing to save.
    """
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in signals}
    stderr = os.dup(2)  # The terminal's, even while start-up notices are hidden.

    def handler(signum, frame):
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os.write(stderr, f"interrupted: {signal.Signals(signum).name}: {message}\n".encode())
        os._exit(128 + signum)

    for s in signals:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        os.close(stderr)
