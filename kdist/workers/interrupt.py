"""SIGINT/SIGTERM/SIGHUP handling: stop at a step boundary, checkpoint, exit non-zero.

Before training takes the signals over (`stop_on_signals`), while the
frameworks load, `exit_on_signals` ends the process with one line instead of
a traceback.
"""

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from kdist.workers.processes import LAUNCHER_VARIABLE, STOP_SIGNALS, follow_launcher


class StopRequest:
    """Set by the first SIGINT, SIGTERM or SIGHUP; the loop checks it after every
    chunk of steps.

    The first signal lets the current chunk of steps finish so a checkpoint
    can be written. The handlers are then restored to the defaults, so a second
    Ctrl-C raises KeyboardInterrupt at once (checkpoint writes are atomic, so
    that never leaves a half-written checkpoint behind).
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def __bool__(self) -> bool:
        return self.signal_name is not None

    def request(self, signal_name: str) -> None:
        self.signal_name = signal_name


@contextlib.contextmanager
def stop_on_signals(stop: StopRequest, escalate: bool = True) -> Iterator[StopRequest]:
    """Routes SIGINT, SIGTERM and SIGHUP (a closed terminal) to `stop` for the
    duration of the block.

    With `escalate`, a second signal ends the process at once (SIGINT raises
    KeyboardInterrupt). A process that a kdist parent supervises (a launcher's
    worker, a replica process) passes False: its parent forwards a stop once
    and ends it if need be, so a signal that reaches every process at once
    (a job scheduler, `pkill`) followed by the parent's must not count twice.
    """
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.getsignal(s) for s in signals}

    def handler(signum, frame):
        if not stop:  # The first signal names the stop.
            stop.request(signal.Signals(signum).name)
        if escalate:
            for s in signals:
                signal.signal(s, signal.default_int_handler if s == signal.SIGINT
                              else signal.SIG_DFL)

    for s in signals:
        signal.signal(s, handler)
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def stop_of_run(stop: object, several_workers: bool) -> Iterator[object]:
    """The stop request a library run acts on: `stop` where the caller gives one
    (an Event, `threading`'s or `multiprocessing`'s, once it is set: as a bool
    an Event is always true).

    Else, for a run of several workers or a process a kdist launcher started,
    the run's own `StopRequest`: SIGINT, SIGTERM and SIGHUP set it for the
    block (from the main thread), and so does the launcher's end. Every
    worker then stops after the same step and the chief checkpoints, as under
    `kdist-train`, where a signal's default would end one worker in the middle
    of a step and leave the others waiting. Else None: signals act as before.
    """
    launched = bool(os.environ.get(LAUNCHER_VARIABLE))
    main_thread = threading.current_thread() is threading.main_thread()
    if stop is not None or not (several_workers or launched) or not main_thread:
        yield _WhenSet(stop) if callable(getattr(stop, "is_set", None)) else stop
        return
    own = StopRequest()
    supervised = follow_launcher(own)
    with stop_on_signals(own, escalate=not supervised):
        yield own


class _WhenSet:
    """An Event read as a stop request: true once it is set."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def __bool__(self) -> bool:
        return bool(self.event.is_set())


def retake_signals() -> None:
    """Points SIGINT, SIGTERM and SIGHUP back at this process's Python handlers.

    A framework's native code can replace a handler behind Python's back: the
    preemption notifier that TensorFlow's `MultiWorkerMirroredStrategy` and
    `jax.distributed.initialize` start calls `std::signal(SIGTERM)` with a
    handler that only sets a flag of its own, so a SIGTERM would never reach
    kdist's stop. `signal.getsignal` still names the Python handler;
    setting it again installs it at the C level. Only the main thread can.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for s in STOP_SIGNALS:
        handler = signal.getsignal(s)
        if handler is not None:  # None: not installed from Python; left as it is.
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_end_the_process() -> Iterator[None]:
    """Gives SIGINT, SIGTERM and SIGHUP their default action, ending the process,
    for the block; the handlers are put back after it.

    For a block that waits in native code, where no Python handler runs: the
    join of the workers (`kdist.workers.cluster.connect_deadline`). A handler
    would run only once the join returns, and a join whose peer is gone returns
    at the connect timeout, so the launcher's stop would wait for its grace
    period. Nothing is trained yet, so ending at once loses nothing. A signal
    set to be ignored (`nohup`) stays ignored, and one whose handler was not
    set from Python is left as it is. Only the main thread can set handlers;
    elsewhere the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    changed = {s: h for s, h in previous.items() if h not in (None, signal.SIG_IGN)}
    for s in changed:
        signal.signal(s, signal.SIG_DFL)
    try:
        yield
    finally:
        for s, h in changed.items():
            signal.signal(s, h)


class AgreedStop:
    """A stop request that every worker acts on after the same step.

    A signal reaches one worker (a preempted machine), or reaches several at
    different moments, while every train step is a collective over all of
    them: a worker that stopped on its own would leave the others waiting in
    the next step, and the chief might never write its checkpoint. So the loop
    never reads `request` alone. At the same points of the loop on every
    worker (after each train chunk and after each epoch), `poll()` asks
    whether any worker's request is set, through the engine's own collective
    (`engine.any_worker`); once that is true it stays true, and every worker
    stops after the same step.

    Args:
        request: the local request (e.g. a `StopRequest`), read as a bool; None
            never asks to stop.
        engine: the run's engine.
    """

    def __init__(self, request, engine):
        self.request, self.engine = request, engine
        self.agreed = False

    def poll(self):
        """True once any worker has asked to stop; a collective on every worker."""
        if not self.agreed:
            self.agreed = bool(self.engine.any_worker(bool(self.request)))
        return self.agreed

    def __bool__(self):
        return self.agreed

    @property
    def signal_name(self):
        """The signal this process received, or None if another worker's stopped it."""
        return getattr(self.request, "signal_name", None)

    def reason(self):
        """The signal this process received, or whether its own `request` (a stop
        object given to the run) or another worker's asked to stop."""
        if self.signal_name:
            return self.signal_name
        return "asked to stop" if self.request else "another worker was asked to stop"


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
