"""Local launcher: N training workers on 127.0.0.1, for trying multi-worker runs.

`kdist-launch --workers 2 -- --synthetic --epochs 1` starts `python -m kdist`
(kdist-train, with the launcher's Python, environment and folder) with those
flags; `kdist-launch --workers 2 -- python my_train.py ARGS` starts any command
(`python`, `python3` or a first word ending in .py runs with the launcher's
Python, whatever PATH holds). It picks free
loopback ports and tells each worker its cluster in `KDIST_PEERS` and
`KDIST_WORKER_INDEX`, which kdist-train and `kdist.connect` (called by
`kdist.train_and_evaluate`) read. It prints each worker's output lines
prefixed with `[worker I]`. If a worker exits with an error, the others are
stopped and the launcher exits with that worker's exit status (128 + N for a
worker killed by signal N), after its last lines. SIGTERM, SIGINT or SIGHUP to
the launcher sends SIGTERM to every worker: they stop after the same step, the
chief checkpoints. If the launcher itself is killed, its workers stop as on
SIGTERM, and one still running `--grace` seconds later ends itself
(`follow_launcher`). Every wait is bounded: `--timeout` for the whole run,
`--grace` for workers to stop. Bad flags and a command that is not found
are usage errors (exit 2) before any worker starts. Imports no framework.
"""


import argparse
import os
import shutil
import signal
import sys

from kdist.cli import train
from kdist.cli.flags import command_name, non_negative, positive
from kdist.workers.processes import (
    STOP_SIGNALS,
    start,
    stop_all,
    supervise,
    worker_command,
)


def parser():
    p = argparse.ArgumentParser(
        prog=command_name("kdist-launch"),
        usage="kdist-launch [-h] --workers N [--timeout S] [--grace S] "
              "-- [kdist-train flags | COMMAND ...]",
        description="Start N training workers on this machine (127.0.0.1, free ports), on "
                    "the backend chosen by KERAS_BACKEND. After --: kdist-train's flags, or "
                    "a command such as `python my_train.py ARGS` (a script that calls "
                    "kdist.train_and_evaluate or kdist.connect; python runs as the launcher's "
                    "Python). Each worker learns its "
                    "place from KDIST_PEERS and KDIST_WORKER_INDEX.")
    p.add_argument("--workers", type=int, required=True, help="number of worker processes")
    p.add_argument("--timeout", type=positive(float), default=24 * 3600.0,
                   help="stop every worker and fail after this many seconds "
                        "(default: %(default)s)")
    p.add_argument("--grace", type=non_negative(float), default=30.0,
                   help="seconds a worker gets to exit after SIGTERM before SIGKILL, or "
                        "after the launcher is gone before it ends itself "
                        "(default: %(default)s)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.workers < 1:
        parser().error(f"--workers must be at least 1, got {args.workers}")
    flags = train_args if not train_args or train_args[0].startswith("-") else []
    given = [f for f in ("--peers", "--workers", "--worker-index")
             if any(a.split("=")[0] == f for a in flags)]
    if given:
        parser().error("the launcher tells each worker its peers and index itself; drop "
                       f"{' and '.join(given)} after --")
    if flags or not train_args:  # kdist's own job: its flags' errors once, before any worker.
        own = train.train_parser()
        own.prog = f"{parser().prog} ... --"
        own.parse_args(flags)
    program, *rest = worker_command(train_args)
    if shutil.which(program) is None:  # Not on PATH, or a path to no executable file.
        parser().error(f"{program}: command not found")
    script = next((a for a in rest if not a.startswith("-")), "") if program == sys.executable \
        else ""
    if script.endswith(".py") and not os.path.isfile(script):  # `python my_train.py`'s.
        parser().error(f"{script}: no such file")
    try:
        workers = start(args.workers, train_args, args.grace)
    except OSError as e:  # An executable file that cannot run (no #! line, say).
        parser().error(f"{program}: {e.strerror or e}")

    def on_signal(signum, frame):  # Like Ctrl-C: every worker checkpoints and stops.
        raise KeyboardInterrupt

    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)  # A closed terminal.
    try:
        return supervise(workers, args.timeout, args.grace)
    except KeyboardInterrupt:
        for s in previous:  # Further signals must not cut the bounded clean-up short.
            signal.signal(s, signal.SIG_IGN)
        stop_all(workers, args.grace)
        print("kdist-launch: interrupted; stopped every worker", file=sys.stderr)
        return 130
    finally:
        stop_all(workers, args.grace)  # Nothing outlives the launcher.
        for s, handler in previous.items():
            signal.signal(s, handler)
