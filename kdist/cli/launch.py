"""Local launcher: N training workers on 127.0.0.1, for trying multi-worker runs.

`kdist-launch --workers 2 -- --synthetic --epochs 1` (or `python
scripts/launch.py ...`) picks free loopback ports, starts every worker as
`python -m kdist` (the training command; the launcher's Python, environment
and folder, no PATH lookup) with `--peers` and its `--worker-index`,
and prints each worker's output lines prefixed with `[worker I]`. If a worker
exits with an error, the others are stopped and the launcher exits with that
worker's exit status (128 + N for a worker killed by signal N), after its last
lines. SIGTERM, SIGINT or SIGHUP to the launcher sends SIGTERM to every
worker: they stop after the same step, the chief checkpoints. If the
launcher itself is killed, its workers stop as on SIGTERM
(`follow_launcher`). Every wait is bounded: `--timeout` for the whole run,
`--grace` for workers to stop. Imports no framework.
"""


import argparse
import signal
import sys

from kdist.workers.processes import (
    STOP_SIGNALS,
    start,
    stop_all,
    supervise,
)


def parser():
    p = argparse.ArgumentParser(
        prog="launch.py",
        usage="launch.py [-h] --workers N [--timeout S] [--grace S] -- [train.py flags]",
        description="Start N training workers (kdist-train) on this machine (127.0.0.1, free "
                    "ports), on the backend chosen by KERAS_BACKEND. Flags after -- go to "
                    "every worker; --peers and --worker-index are added.")
    p.add_argument("--workers", type=int, required=True, help="number of worker processes")
    p.add_argument("--timeout", type=float, default=24 * 3600.0,
                   help="stop every worker and fail after this many seconds "
                        "(default: %(default)s)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds a worker gets to exit after SIGTERM before SIGKILL "
                        "(default: %(default)s)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.workers < 1:
        parser().error(f"--workers must be at least 1, got {args.workers}")
    if any(a.split("=")[0] in ("--peers", "--worker-index", "--workers") for a in train_args):
        parser().error("the launcher sets --peers and --worker-index itself; drop them")
    workers = start(args.workers, train_args)

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
        print("launch: interrupted; stopped every worker", file=sys.stderr)
        return 130
    finally:
        stop_all(workers, args.grace)  # Nothing outlives the launcher.
        for s, handler in previous.items():
            signal.signal(s, handler)
