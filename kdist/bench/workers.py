"""What several workers cost: `scripts/bench_workers.py` (`python -m kdist.bench.workers`).

Runs kdist's loop (`kdist-bench --no-fit`, the same flags for every run) in
three arrangements of the same per-device work, one after the other, on
this machine, and compares their training samples/s:

1. "one process": one process with N devices (`--replicas N`), on every
   core of this process's affinity mask; gradients are summed inside the
   process.
2. "workers": N processes connected over loopback (`--peers` and
   `--worker-index`, as `kdist-launch` sets them; `kdist.engines.connect`
   joins them before anything else), one device each, each pinned with
   `os.sched_setaffinity` to its own share of the cores; the all-reduce
   crosses processes (TensorFlow: RING over gRPC; JAX: gloo).
3. "alone": the same N pinned processes, started together, each training
   its own slice-sized batch with no peers: the workers' computation
   without any communication. They share the memory bus and caches as the
   workers do; their timed epochs overlap as far as their start-ups take
   equally long.

Every run has B examples per device (`--batch-size-per-replica`, passed
through with the other kdist-bench flags), so each device computes the same
step: the global batch is N * B in 1 and 2, and B in each process of 3.
The workers' share of step time spent communicating is

    1 - (workers' samples/s) / (sum of the alone processes' samples/s),

the step time of 3 against that of 2: it counts the all-reduce, the
gradients' transfer and serialisation, and waiting for the slower worker.
"workers / one process" compares 2 with 1: processes against devices in one
process. With fewer cores than N nothing is pinned and the output says so.
Each run prints its own lines (prefixed `[worker I]`); then one JSON line
per precision sums it up. The figures are only meaningful on a quiet
machine.
"""

import argparse
import json
import os
import sys

from kdist.workers.processes import (
    CLUSTER_VARIABLES,
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
        usage="bench_workers.py [-h] [--workers N] [--timeout S] -- [kdist-bench flags]",
        description="Measure kdist's training speed with N worker processes on loopback "
                    "against one process with N devices, and the share of the workers' "
                    "step time spent communicating (N pinned processes with no peers "
                    "doing the same work). Flags after -- go to every kdist-bench run.")
    p.add_argument("--workers", type=int, default=2, help="N (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds each of the three runs may take (default: %(default)s)")
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


def run_benches(commands, timeout, grace=10.0):
    """Starts every command at once (`Worker`: output printed with a
    prefix), waits for all, and returns their JSON lines: one dict per
    precision, per command. A failure stops the others and raises RuntimeError."""
    env = {k: v for k, v in os.environ.items()
           if k not in CLUSTER_VARIABLES + ("XLA_FLAGS",)}
    env["PYTHONUNBUFFERED"] = "1"
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


def measure(num_workers, bench_args, timeout):
    """The three runs (see the module's docstring); returns (one process's JSON
    lines, the chief worker's, each alone process's, whether they were pinned)."""
    groups = core_groups(os.sched_getaffinity(0), num_workers)
    pins = groups or [None] * num_workers
    print(f"workerbench: one process, {num_workers} devices", flush=True)
    [one] = run_benches([_command(None, bench_args, "--replicas", str(num_workers))], timeout)
    print(f"workerbench: {num_workers} workers on loopback, pinned to {groups}", flush=True)
    peers = ",".join(f"127.0.0.1:{port}" for port in free_ports(num_workers))
    workers = run_benches([_command(pins[i], bench_args, "--replicas", "1", "--peers", peers,
                                    "--worker-index", str(i))
                           for i in range(num_workers)], timeout)
    print(f"workerbench: {num_workers} processes alone, pinned to {groups}", flush=True)
    alone = run_benches([_command(pin, bench_args, "--replicas", "1") for pin in pins],
                        timeout)
    return one, workers[0], alone, groups is not None


def summarize(one, chief, alone, pinned):
    """One dict per precision: the three runs' samples/s, workers against one
    process, and the workers' communication share (module docstring)."""
    rows = []
    for i, mine in enumerate(chief):
        alone_rates = [process[i]["kdist_samples_per_sec"] for process in alone]
        workers_rate, one_rate = mine["kdist_samples_per_sec"], one[i]["kdist_samples_per_sec"]
        rows.append(dict(
            model=mine["model"], backend=mine["backend"], precision=mine["precision"],
            workers=mine["workers"], pinned=pinned, global_batch=mine["global_batch"],
            one_process_samples_per_sec=one_rate, workers_samples_per_sec=workers_rate,
            alone_samples_per_sec=alone_rates,
            workers_vs_one_process=round(workers_rate / one_rate, 3),
            communication_share=round(1 - workers_rate / sum(alone_rates), 3),
            cpu_model=mine["cpu_model"], cpu_cores=one[i]["cpu_cores"]))
    return rows


def main(argv=None):
    args = parser().parse_args(argv)
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if args.workers < 2:
        parser().error(f"--workers must be at least 2, got {args.workers}")
    if any(a.split("=")[0] in OWN_FLAGS for a in bench_args):
        parser().error(f"the runs set {', '.join(OWN_FLAGS)} themselves; drop them")
    try:
        rows = summarize(*measure(args.workers, bench_args, args.timeout))
    except RuntimeError as error:
        print(f"workerbench: error: {error}", file=sys.stderr)
        return 1
    for row in rows:
        print(f"{row['precision']}: one process {row['one_process_samples_per_sec']:,}, "
              f"{row['workers']} workers {row['workers_samples_per_sec']:,} samples/s "
              f"({row['workers_vs_one_process']:.2f}x); alone "
              f"{' + '.join(f'{r:,}' for r in row['alone_samples_per_sec'])}; communication "
              f"{row['communication_share']:.0%} of the workers' step time")
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
