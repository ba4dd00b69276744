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


# A worker whose step waits in a collective for a peer that is gone never reaches
# the stop its launcher's death requested; it outlived the killed launcher for good.
STUCK_WORKER = """
import os, sys, time
from kdist.workers import interrupt, processes
stop = interrupt.StopRequest()  # Requested, never read: a step that never ends.
assert processes.follow_launcher(stop, interval=0.05)
print(os.getpid(), flush=True)
time.sleep(120)
"""


def test_a_worker_stuck_after_its_launcher_is_killed_ends_after_the_grace(tmp_path):
    import subprocess
    import sys
    import time

    from kdist.workers import processes

    launcher = subprocess.Popen(  # Stands for kdist-launch: starts the worker, then waits.
        [sys.executable, "-c", "import subprocess, sys, os; subprocess.Popen([sys.executable, "
         f"'-c', sys.argv[1]], env=dict(os.environ, {processes.LAUNCHER_VARIABLE}="
         f"str(os.getpid()), {processes.GRACE_VARIABLE}='1')); import time; time.sleep(120)",
         STUCK_WORKER], stdout=subprocess.PIPE, text=True)
    worker = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait(timeout=30)
    killed = time.monotonic()

    def running():
        try:
            with open(f"/proc/{worker}/stat") as f:
                return f.read().split(") ")[1][0] != "Z"
        except FileNotFoundError:
            return False

    while running() and time.monotonic() - killed < 30:
        time.sleep(0.1)
    assert not running(), f"worker {worker} still running 30 s after its launcher was killed"
