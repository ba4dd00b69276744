"""A bounded soak: short runs, each killed at a random point, then resumed and compared.

Each round picks a fault at random, runs a short kdist-train command, injects
the fault after a random delay (up to 0.8 of the uninterrupted run's time, which
varies with the machine's load), waits (bounded) for every process of the run to
end, runs the same command again to its end, and compares the final checkpoint
with that of the same command run once without a fault. The faults, on the
session's backend (`KERAS_BACKEND`):

- `process`: SIGKILL or SIGTERM to a one-process run (torch: the parent of its
  2 replica processes);
- `replica` (torch): SIGKILL to one of the 2 replica processes;
- `worker`: SIGKILL or SIGTERM to one of 2 workers under `kdist-launch`;
- `launcher`: SIGKILL to `kdist-launch` itself.

An outcome is `equal` (the resumed run ends bitwise on the uninterrupted
run's weights), `differs`, `left processes` (one still alive 60 s after the
fault), `resume failed` or `no fault` (the run ended before the delay).
Prints a table of faults and outcomes, and exits 1 unless every round ended
`equal` or `no fault`.

    KERAS_BACKEND=torch python scripts/chaos.py --minutes 30 [--seed 1] [--folder DIR]
"""

import argparse
import collections
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = [sys.executable, os.path.join(HERE, "train.py")]
LAUNCH = [sys.executable, os.path.join(HERE, "launch.py"), "--workers", "2", "--timeout",
          "600", "--grace", "60", "--"]
# 2 epochs of 40 steps, a checkpoint every 10 steps, plain SGD (a wrong resume shows).
RUN = ["--synthetic", "2400", "--epochs", "2", "--steps-per-epoch", "40",
       "--batch-size-per-replica", "16", "--checkpoint-every-steps", "10", "--optimizer",
       "sgd", "--learning-rate", "0.05", "--seed", "3", "--quiet"]
FINAL = "ckpt-00000080.weights.h5"
TORCH = os.environ.get("KERAS_BACKEND") == "torch"


def faults():
    """[(name, command prefix, its extra flags, signal)] for this backend."""
    one = ["--replicas", "2"] if TORCH else []
    found = [("process SIGKILL", TRAIN, one, signal.SIGKILL),
             ("process SIGTERM", TRAIN, one, signal.SIGTERM),
             ("worker SIGKILL", LAUNCH, [], signal.SIGKILL),
             ("worker SIGTERM", LAUNCH, [], signal.SIGTERM),
             ("launcher SIGKILL", LAUNCH, [], signal.SIGKILL)]
    if TORCH:
        found.append(("replica SIGKILL", TRAIN, one, signal.SIGKILL))
    return found


def weights(path):
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
    return found


def descendants(pid):
    """Every process below `pid`, from /proc."""
    children = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                children[_parent(int(entry))].append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], [pid]
    while todo:
        for child in children[todo.pop()]:
            found.append(child)
            todo.append(child)
    return found


def marked(mark):
    """Every live process whose environment holds `mark` (a round's processes, also
    those a dead parent left behind)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark.encode() in f.read().split(b"\0") and alive(int(entry)):
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def run_to_end(prefix, flags, folder):
    result = subprocess.run([*prefix, *RUN, *flags, "--checkpoint-dir", folder],
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0 or not os.path.exists(os.path.join(folder, FINAL)):
        return None, result.stdout[-2000:] + result.stderr[-2000:]
    return weights(os.path.join(folder, FINAL)), ""


def _parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(") ", 1)[1].split()[1])


def _command(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def target(name, process):
    """The pid the fault goes to."""
    kind = name.split()[0]
    if kind in ("process", "launcher"):
        return process.pid
    below = [p for p in descendants(process.pid) if alive(p)]
    if kind == "worker":  # The launcher's children are the workers.
        below = [p for p in below if _parent(p) == process.pid]
    return random.choice(below) if below else None


def one_round(fault, reference, folder, max_delay):
    """Runs one faulted run and its resume; returns (outcome, detail)."""
    name, prefix, flags, sig = fault
    mark = f"KDIST_CHAOS_ROUND={folder}"
    process = subprocess.Popen([*prefix, *RUN, *flags, "--checkpoint-dir", folder],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True,
                               env=dict(os.environ, KDIST_CHAOS_ROUND=folder))
    delay = random.uniform(0.5, max_delay)
    time.sleep(delay)
    pid = target(name, process)
    if process.poll() is not None or pid is None:
        process.wait()
        return "no fault", ""
    os.kill(pid, sig)
    deadline = time.monotonic() + 60
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
        process.poll()  # Reaps the child, so it no longer counts as alive.
    left = marked(mark)
    if left:
        commands = "; ".join(_command(p)[:90] for p in left)
        for p in left:
            os.kill(p, signal.SIGKILL)
        process.wait(timeout=30)
        return "left processes", (f"{len(left)} alive 60 s after the fault at {delay:.1f} s: "
                                  f"{commands}")
    resumed, output = run_to_end(prefix, flags, folder)
    if resumed is None:
        return "resume failed", output
    worst = max(float(np.abs(resumed[k].astype(np.float64) - reference[k]).max())
                for k in reference)
    return ("equal", "") if worst == 0 else ("differs", f"max |difference| {worst:.3g}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--folder", default=None, help="where the runs go (default: a "
                        "temporary folder)")
    args = parser.parse_args(argv)
    random.seed(args.seed)
    root = args.folder or tempfile.mkdtemp(prefix="kdist-chaos-")
    references, timings, table = {}, {}, collections.Counter()
    end = time.monotonic() + args.minutes * 60
    rounds = 0
    while time.monotonic() < end:
        fault = random.choice(faults())
        key = (tuple(fault[1][:2]), tuple(fault[2]))
        if key not in references:
            start = time.monotonic()
            references[key], output = run_to_end(fault[1], fault[2],
                                                 os.path.join(root, f"reference-{len(references)}"))
            timings[key] = time.monotonic() - start
            if references[key] is None:
                sys.exit(f"chaos: the uninterrupted run failed:\n{output}")
        rounds += 1
        outcome, detail = one_round(fault, references[key], os.path.join(root, f"round-{rounds}"),
                                    max_delay=0.8 * timings[key])
        table[(fault[0], outcome)] += 1
        print(f"round {rounds}: {fault[0]}: {outcome} {detail}".rstrip(), flush=True)
    print(f"\n{os.environ.get('KERAS_BACKEND', 'tensorflow')}, {rounds} rounds, "
          f"{args.minutes:g} minutes\n\n| fault | outcome | rounds |\n|---|---|---|")
    for (name, outcome), count in sorted(table.items()):
        print(f"| {name} | {outcome} | {count} |")
    bad = [k for k in table if k[1] not in ("equal", "no fault")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
