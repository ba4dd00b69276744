"""One run per checkpoint folder: the lock file, its stale and forced take-overs."""

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from kdist import checkpoints, hints
from kdist.checkpoints import runlock

# Nothing here depends on the backend (the checkpoint folder's lock file): one session runs it.
pytestmark = pytest.mark.any_backend


def locked(folder, break_lock=False):
    manager = checkpoints.CheckpointManager(str(folder))
    manager.prepare(lock=True, break_lock=break_lock)
    return manager


def write_lock(folder, pid, host):
    (folder / runlock.LOCK_NAME).write_text(json.dumps(dict(pid=pid, host=host, started=0)))


def dead_pid():
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_a_second_run_on_the_folder_is_refused_with_the_owner_named(tmp_path):
    first = locked(tmp_path)
    owner = json.loads((tmp_path / runlock.LOCK_NAME).read_text())
    assert owner["host"] == socket.gethostname()
    with pytest.raises(checkpoints.CheckpointError,
                       match=f"in use by another run \\(pid {owner['pid']} on host "
                             f"{owner['host']}, started .*--break-lock"):
        locked(tmp_path)
    first.release()
    assert not (tmp_path / runlock.LOCK_NAME).exists()
    locked(tmp_path).release()


def test_a_lock_whose_process_is_gone_is_taken_over(tmp_path):
    pid = dead_pid()
    write_lock(tmp_path, pid, socket.gethostname())
    with pytest.warns(checkpoints.CheckpointWarning,
                      match=f"took over the lock .* from pid {pid} .*its process is gone"):
        manager = locked(tmp_path)
    assert manager.lock.owner == json.loads((tmp_path / runlock.LOCK_NAME).read_text())


def test_a_lock_of_a_killed_process_not_yet_reaped_is_taken_over(tmp_path):
    """A run killed under a parent that has not waited for it is a zombie: dead."""
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        zombie.send_signal(signal.SIGKILL)
        while runlock._stat(zombie.pid)[:1] != ["Z"]:
            time.sleep(0.01)
        write_lock(tmp_path, zombie.pid, socket.gethostname())
        with pytest.warns(checkpoints.CheckpointWarning, match=f"from pid {zombie.pid} "):
            locked(tmp_path).release()
    finally:
        zombie.wait()


def test_a_lock_whose_pid_now_runs_another_process_is_taken_over(tmp_path):
    """The owner was killed and its pid reused (pid_max wraps on a busy machine):
    the process running under that pid started at another time."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = runlock._start_ticks(other.pid)
        lock = dict(pid=other.pid, host=socket.gethostname(), started=0, process_start=start)
        (tmp_path / runlock.LOCK_NAME).write_text(json.dumps(lock))
        with pytest.raises(checkpoints.CheckpointError, match=f"pid {other.pid}"):
            locked(tmp_path)  # The same process: held.
        lock["process_start"] = start - 1
        (tmp_path / runlock.LOCK_NAME).write_text(json.dumps(lock))
        with pytest.warns(checkpoints.CheckpointWarning,
                          match=f"took over the lock .* from pid {other.pid} "):
            locked(tmp_path).release()
    finally:
        other.kill()
        other.wait()


def test_another_hosts_lock_holds_unless_broken(tmp_path):
    write_lock(tmp_path, dead_pid(), "elsewhere")
    with pytest.raises(checkpoints.CheckpointError, match="on host elsewhere"):
        locked(tmp_path)
    with pytest.warns(checkpoints.CheckpointWarning, match="forced by break_lock=True"):
        manager = locked(tmp_path, break_lock=True)
    manager.release()
    assert not (tmp_path / runlock.LOCK_NAME).exists()
    write_lock(tmp_path, dead_pid(), "elsewhere")
    with hints.command_line(), pytest.warns(checkpoints.CheckpointWarning,
                                            match="forced by --break-lock"):
        locked(tmp_path, break_lock=True).release()


def test_release_leaves_a_lock_that_another_run_took(tmp_path):
    manager = locked(tmp_path)
    write_lock(tmp_path, 1, "elsewhere")  # Taken with --break-lock by a run elsewhere.
    manager.release()
    assert json.loads((tmp_path / runlock.LOCK_NAME).read_text())["host"] == "elsewhere"


def test_an_unreadable_lock_is_named_as_such(tmp_path):
    (tmp_path / runlock.LOCK_NAME).write_text("")
    with pytest.raises(checkpoints.CheckpointError, match="an unknown run"):
        locked(tmp_path)


def test_a_lock_taken_over_by_another_run_meanwhile_is_not_removed(tmp_path, monkeypatch):
    """Two runs find the same stale lock; the other takes it over between this run's
    reading it and its take-over. The other run's lock stays, and this run is
    refused: the take-over removed whatever lock file was there, and both ran."""
    pid = dead_pid()
    write_lock(tmp_path, pid, socket.gethostname())
    path = tmp_path / runlock.LOCK_NAME
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    theirs = dict(pid=other.pid, host=socket.gethostname(), started=0,
                  process_start=runlock._start_ticks(other.pid))
    judged = runlock.is_stale

    def taken_meanwhile(owner):  # This run judges pid's lock stale; the other takes it.
        stale = judged(owner)
        if owner and owner.get("pid") == pid:
            path.unlink()
            path.write_text(json.dumps(theirs))
        return stale

    monkeypatch.setattr(runlock, "is_stale", taken_meanwhile)
    try:
        with pytest.raises(checkpoints.CheckpointError, match=f"in use by another run \\(pid "
                                                              f"{other.pid} "):
            locked(tmp_path)
        assert json.loads(path.read_text()) == theirs
        assert sorted(p.name for p in tmp_path.iterdir()) == [runlock.LOCK_NAME]
    finally:
        other.kill()
        other.wait()
