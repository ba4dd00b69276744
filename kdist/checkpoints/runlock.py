"""One run per checkpoint folder: a lock file holding the owner's pid and host.

The lock is created atomically (O_CREAT | O_EXCL), so of two runs starting
at once exactly one gets it. A lock whose process is gone (same host, pid no
longer running, a zombie, or running a process that started at another time
than the owner: the pid reused) is stale and is taken over. A lock of a live process, or of
another host (whose processes cannot be checked from here), is broken only
when the user forces it. A take-over removes only the lock file it judged
(`_take_over`), so of two runs taking over one stale lock at once, one gets it.
"""

import contextlib
import errno
import json
import os
import socket
import time
import uuid

from kdist.errors import LockHeld

LOCK_NAME = "kdist.lock"


def _owner():
    pid = os.getpid()
    return dict(pid=pid, host=socket.gethostname(), started=time.time(),
                process_start=_start_ticks(pid))


def _start_ticks(pid):
    """When process `pid` started, in clock ticks since boot (Linux's /proc), or None."""
    fields = _stat(pid)
    return int(fields[19]) if len(fields) > 19 else None  # Field 22, starttime.


def describe(owner):
    if not owner:
        return "an unknown run (its lock file is empty or unreadable)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
    return f"pid {owner.get('pid')} on host {owner.get('host')}, started {started}"


def read_owner(path):
    """The owner recorded in lock file `path`; None if it is unreadable."""
    try:
        with open(path) as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _alive(pid):
    """Whether `pid` runs: it exists and is not a zombie (dead, not yet reaped by its
    parent: a run killed under a parent that has not waited for it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # Exists, owned by another user.
        return True
    return _stat(pid)[:1] != ["Z"]


def _stat(pid):
    """The fields of /proc/PID/stat after the command's name (Linux), or []."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return []


def is_stale(owner):
    """True if `owner` is a process of this host that no longer runs: its pid is
    not running, or runs another process (one that started at another time)."""
    if not (owner and owner.get("host") == socket.gethostname()
            and isinstance(owner.get("pid"), int)):
        return False
    if not _alive(owner["pid"]):
        return True
    recorded, now = owner.get("process_start"), _start_ticks(owner["pid"])
    return isinstance(recorded, int) and now is not None and now != recorded


class RunLock:
    """The lock of one folder; `acquire` then `release` (both idempotent)."""

    def __init__(self, directory):
        self.path = os.path.join(directory, LOCK_NAME)
        self.owner = None  # What this process wrote, while it holds the lock.

    def acquire(self, force=False):
        """Takes the lock; returns the owner it replaced (a stale or forced one) or None.

        Raises LockHeld if another run holds it and `force` is false, OSError
        if the folder cannot be written.
        """
        replaced = None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                other = read_owner(self.path)
                if not (force or is_stale(other)):
                    raise LockHeld(describe(other)) from None
                replaced = other or {}
                _take_over(self.path, other)
                continue
            owner = _owner()
            with os.fdopen(fd, "w") as f:
                json.dump(owner, f)
            self.owner = owner
            return replaced
        raise LockHeld(describe(read_owner(self.path)))

    def release(self):
        """Removes the lock file if it is still this process's."""
        if self.owner is not None and read_owner(self.path) == self.owner:
            _remove(self.path)
        self.owner = None


def _take_over(path, judged):
    """Removes lock file `path` if it still holds `judged`, the owner found stale (or
    forced). It is first renamed to a name of this process's: of runs taking over
    at once, one moves the stale file; another that moves a lock taken meanwhile
    links it back in place."""
    aside = f"{path}.{os.getpid()}-{uuid.uuid4().hex}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # Another run moved it first.
        return
    if read_owner(aside) != judged:  # A run's fresh lock: back where it was.
        with contextlib.suppress(FileExistsError):  # A third run holds the name now.
            os.link(aside, path)
    _remove(aside)


def _remove(path):
    try:
        os.remove(path)
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise
