"""What several workers cost: `scripts/bench_workers.py` (`python -m kdist.bench.workers`).

Runs kdist's loop (`kdist-bench --no-fit`, the same flags for every run) in
three arrangements of the same per-device work, on this machine, and
compares their training samples/s:

1. "one process": one process with N devices (`--replicas N`), on every
   core of this process's affinity mask; gradients are summed inside the
   process.
2. "workers": N processes connected over loopback (`--peers` and
   `--worker-index`, as `kdist-launch` sets them; `kdist.engines.connect`
   joins them before anything else), one device each; the all-reduce
   crosses processes (TensorFlow: RING over gRPC; JAX: gloo).
3. "alone": the same N processes, started together, each training its own
   slice-sized batch with no peers: the workers' computation without any
   communication. They share the cores, memory bus and caches as the
   workers do; their timed epochs overlap as far as their start-ups take
   equally long.

As `kdist-launch` starts workers, the processes of 2 and 3 share every core
of the affinity mask, each told how many they are (`KDIST_LOCAL_PROCESSES`,
by which TensorFlow and torch split the cores' threads). With `--pin` each
is pinned (`os.sched_setaffinity`) to its own share of the cores instead, as
on machines of their own; with one core each, a worker's collectives share
it with the thread that serves its sockets (gloo on JAX: 3-4x the unpinned
time per all-reduce of several arrays,
docs/log/2026-12-04-pinned-workers.md). With fewer cores than N nothing is
pinned and the output says so.

Every run has B examples per device (`--batch-size-per-replica`, passed
through with the other kdist-bench flags), so each device computes the same
step: the global batch is N * B in 1 and 2, and B in each process of 3.
The workers' share of step time spent communicating is

    1 - (workers' samples/s) / (sum of the alone processes' samples/s),

the step time of 3 against that of 2: it counts the all-reduce, the
gradients' transfer and serialisation, and waiting for the slower worker.
"workers / one process" compares 2 with 1: processes against devices in one
process. `--rounds R` runs the three arrangements R times, in turn (1, 2, 3,
then 3, 2, 1, ...), and reports both ratios as the median over the rounds
of each round's own ratio, with their spread: a drift of the machine's
speed falls on both sides of each round's ratio. Each run prints its own
lines (prefixed `[worker I]`); then one JSON line per precision sums it up.
The figures are only meaningful on a quiet machine.
"""

import argparse
import json
import os
import statistics
import sys

from kdist.workers.processes import (
    CLUSTER_VARIABLES,
    LOCAL_PROCESSES_VARIABLE,
    Worker,
    free_ports,
    stop_all,
    supervise,
)

# Run by each pinned process: pin to the CPUs of argv[1], then kdist-bench argv[2:].
PINNED_BENCH = [sys.executable, "-c",
                "import sys; from kdist.bench import workers; "
                "sys.exit(workers.pinned_bench(sys.argv[1:]))"]
# Flags the runs set themselves.
OWN_FLAGS = ("--replicas", "--peers", "--worker-index", "--workers", "--no-fit")


def parser():
    p = argparse.ArgumentParser(
        prog="bench_workers.py",
        usage="bench_workers.py [-h] [--workers N] [--rounds R] [--pin] [--timeout S] "
              "-- [kdist-bench flags]",
        description="Measure kdist's training speed with N worker processes on loopback "
                    "against one process with N devices, and the share of the workers' "
                    "step time spent communicating (N processes with no peers "
                    "doing the same work). Flags after -- go to every kdist-bench run.")
    p.add_argument("--workers", type=int, default=2, help="N (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="times the three arrangements run, in turn; the ratios are the "
                        "medians of the rounds' own (default: %(default)s)")
    p.add_argument("--pin", action="store_true",
                   help="pin each worker and alone process to its own share of the cores "
                        "(default: they share every core, as under kdist-launch)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds each run may take (default: %(default)s)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def pinned_bench(argv):
    """Pins this process to the CPUs `argv[0]` ("0,1"; "" for no pinning), then
    runs kdist-bench with `argv[1:]`; before any framework loads, so their
    thread pools size themselves to the pinned cores."""
    if argv[0]:
        os.sched_setaffinity(0, {int(cpu) for cpu in argv[0].split(",")})
    from kdist.bench.command import main as bench_main

    return bench_main(argv[1:])


def core_groups(cores, count):
    """`count` disjoint, equal groups of `cores` (sorted), or None if there are
    fewer cores than groups."""
    cores = sorted(cores)
    if len(cores) < count:
        return None
    size = len(cores) // count
    return [cores[i * size:(i + 1) * size] for i in range(count)]


def run_benches(commands, timeout, grace=10.0, sharing=False):
    """Starts every command at once (`Worker`: output printed with a
    prefix), waits for all, and returns their JSON lines: one dict per
    precision, per command. With `sharing`, each is told how many processes
    share the machine's cores, as `kdist-launch` tells its workers. A
    failure stops the others and raises RuntimeError."""
    env = {k: v for k, v in os.environ.items()
           if k not in CLUSTER_VARIABLES + ("XLA_FLAGS",)}
    env["PYTHONUNBUFFERED"] = "1"
    if sharing:
        env[LOCAL_PROCESSES_VARIABLE] = str(len(commands))
    workers = [Worker(i, command, env) for i, command in enumerate(commands)]
    try:
        status = supervise(workers, timeout, grace)
    finally:
        stop_all(workers, grace)
    if status != 0:
        raise RuntimeError(f"a benchmark process failed (exit status {status})")
    return [[json.loads(line) for line in worker.last if line.startswith("{")]
            for worker in workers]


def _command(cpus, bench_args, *flags):
    return [*PINNED_BENCH, ",".join(map(str, cpus or ())), *bench_args, "--no-fit", *flags]


def measure(num_workers, bench_args, timeout, rounds=1, pin=False):
    """The three runs (see the module's docstring), `rounds` times in turn;
    returns a list per round of (one process's JSON lines, the chief
    worker's, each alone process's), and whether the processes were pinned."""
    groups = core_groups(os.sched_getaffinity(0), num_workers) if pin else None
    pins = groups or [None] * num_workers

    def one():
        print(f"workerbench: one process, {num_workers} devices", flush=True)
        [lines] = run_benches([_command(None, bench_args, "--replicas", str(num_workers))],
                              timeout)
        return lines

    def workers():
        print(f"workerbench: {num_workers} workers on loopback, pinned to {groups}", flush=True)
        peers = ",".join(f"127.0.0.1:{port}" for port in free_ports(num_workers))
        return run_benches([_command(pins[i], bench_args, "--replicas", "1", "--peers", peers,
                                     "--worker-index", str(i))
                            for i in range(num_workers)], timeout, sharing=not groups)[0]

    def alone():
        print(f"workerbench: {num_workers} processes alone, pinned to {groups}", flush=True)
        return run_benches([_command(pin, bench_args, "--replicas", "1") for pin in pins],
                           timeout, sharing=not groups)

    runs = []
    for r in range(rounds):
        order = (one, workers, alone) if r % 2 == 0 else (alone, workers, one)
        results = {run: run() for run in order}
        runs.append((results[one], results[workers], results[alone]))
    return runs, groups is not None


def _median_and_spread(values):
    return round(statistics.median(values), 3), [round(min(values), 3), round(max(values), 3)]


def summarize(runs, pinned):
    """One dict per precision: the runs' samples/s (a list, one per round), and
    workers against one process and the workers' communication share (module
    docstring), each the median of the rounds' own, with its spread."""
    rows = []
    for i, mine in enumerate(runs[0][1]):
        one_rates = [one[i]["kdist_samples_per_sec"] for one, _, _ in runs]
        workers_rates = [chief[i]["kdist_samples_per_sec"] for _, chief, _ in runs]
        alone_rates = [[process[i]["kdist_samples_per_sec"] for process in alone]
                       for _, _, alone in runs]
        vs_one, vs_one_spread = _median_and_spread(
            [w / o for w, o in zip(workers_rates, one_rates)])
        share, share_spread = _median_and_spread(
            [1 - w / sum(a) for w, a in zip(workers_rates, alone_rates)])
        rows.append(dict(
            model=mine["model"], backend=mine["backend"], precision=mine["precision"],
            workers=mine["workers"], pinned=pinned, global_batch=mine["global_batch"],
            rounds=len(runs), one_process_samples_per_sec=one_rates,
            workers_samples_per_sec=workers_rates, alone_samples_per_sec=alone_rates,
            workers_vs_one_process=vs_one, workers_vs_one_process_spread=vs_one_spread,
            communication_share=share, communication_share_spread=share_spread,
            load_average=[one[i].get("load_average") for one, _, _ in runs],
            cpu_model=mine["cpu_model"], cpu_flags=mine.get("cpu_flags"),
            cpu_cores=runs[0][0][i]["cpu_cores"]))
    return rows


def main(argv=None):
    args = parser().parse_args(argv)
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if args.workers < 2:
        parser().error(f"--workers must be at least 2, got {args.workers}")
    if any(a.split("=")[0] in OWN_FLAGS for a in bench_args):
        parser().error(f"the runs set {', '.join(OWN_FLAGS)} themselves; drop them")
    if args.rounds < 1:
        parser().error(f"--rounds must be at least 1, got {args.rounds}")
    try:
        rows = summarize(*measure(args.workers, bench_args, args.timeout, args.rounds, args.pin))
    except RuntimeError as error:
        print(f"workerbench: error: {error}", file=sys.stderr)
        return 1
    for row in rows:
        print(_line(row))
    for row in rows:
        print(json.dumps(row))
    return 0


def _line(row):
    """A row of `summarize` as one line of text."""
    def rates(values):
        return " / ".join(f"{r:,}" for r in values)

    def spread(key):
        low, high = row[f"{key}_spread"]
        return f" [{low:.2f}-{high:.2f}]" if row["rounds"] > 1 else ""

    alone = " | ".join(" + ".join(f"{r:,}" for r in a) for a in row["alone_samples_per_sec"])
    return (f"{row['precision']}: one process {rates(row['one_process_samples_per_sec'])}, "
            f"{row['workers']} workers {rates(row['workers_samples_per_sec'])} samples/s: "
            f"{row['workers_vs_one_process']:.2f}x{spread('workers_vs_one_process')}; "
            f"alone {alone}; communication {row['communication_share']:.0%} of the workers' "
            f"step time{spread('communication_share')}")


if __name__ == "__main__":
    sys.exit(main())
