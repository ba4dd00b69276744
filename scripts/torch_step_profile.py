"""Where one torch process spends a training step: kdist's against plain PyTorch's.

    KERAS_BACKEND=torch python scripts/torch_step_profile.py --steps 100 --rounds 5

The tutorial CNN at a batch of 64 with Adam, built by kdist as `kdist-bench` builds it,
the same with Keras' stock layers, and the same network in torch.nn
(`scripts/ddp_baseline.py`'s), on the same synthetic batches in one process, on the
GPU where there is one (the operators' CPU time is then their dispatch and launch). They take
turns, `--steps` steps each per round; each line gives kdist's speed / the other's, the
median of the rounds' paired ratios (below 1: the other is faster). Then one round of
each under `torch.profiler`: the operators' own CPU time by kind, and the rest of the
wall time, which no operator accounts for (Python: Keras' layers and optimizer, kdist's
step, autograd's bookkeeping). Last, kdist's round under cProfile: the functions' own time
by where their code lives (cProfile slows Python code more than operators: compare the
shares within that table only).

The process starts as kdist's commands start theirs (`kdist.prepare_environment`): glibc
keeps freed blocks for reuse, for plain PyTorch as for kdist (on glibc's defaults both
fault their activations in again each step: docs/log/2026-12-03-torch-heap.md).
"""

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdist.runtime import startup  # noqa: E402

startup.prepare_environment()  # Before Keras loads: kdist-bench's memory settings.

import numpy as np  # noqa: E402
import torch  # noqa: E402
from ddp_baseline import cnn  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # As kdist's engine.

# Operator name fragments -> the kind the table reports them under (first match wins).
KINDS = (("convolution", "convolution"), ("conv2d", "convolution"), ("addmm", "matmul"),
         ("matmul", "matmul"), ("aten::mm", "matmul"), ("max_pool", "pooling"),
         ("max_pool2d", "pooling"), ("log_softmax", "loss"), ("nll_loss", "loss"),
         ("cross_entropy", "loss"), ("all_reduce", "all-reduce"))


def kind_of(name):
    return next((kind for fragment, kind in KINDS if fragment in name), "other operators")


def kdist_steps(batches, fast_layers=True):
    """A function running kdist's torch engine one step per batch (as `kdist-bench`),
    on `kdist.models.cnn`'s layers or (`fast_layers` False) Keras' stock ones."""
    import kdist
    from kdist import engines
    from kdist.loop import building
    from kdist.loop.chunks import stack_chunk

    engine = engines.create_engine(1)
    images, labels = batches[0]
    sample = (images[:2], labels[:2], None)
    _, step = building.prepare_model(engine, len(labels), sample,
                                     lambda: kdist.create_model(fast_layers=fast_layers))
    engine.compile_steps(step)
    chunks = [engine.distribute(stack_chunk([(x, y, None)])) for x, y in batches]

    def run(count):
        for k in range(count):
            stats = engine.train_chunk(chunks[k % len(chunks)], 1)
        float(stats["loss_sum"][0])  # Ends on the host.

    return run


def plain_steps(batches):
    """The same steps in plain PyTorch: torch.nn, torch.optim.Adam, cross-entropy,
    on kdist's device (the GPU where there is one), the batches there already."""
    torch.manual_seed(0)
    model = cnn().to(DEVICE)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    tensors = [(torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().to(DEVICE),
                torch.from_numpy(y).long().to(DEVICE)) for x, y in batches]

    def run(count):
        for k in range(count):
            x, y = tensors[k % len(tensors)]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
        float(loss.detach())

    return run


def timed(fn, steps):
    start = time.perf_counter()
    fn(steps)
    return time.perf_counter() - start


def profile(fn, steps):
    """(wall seconds, {kind: operators' own CPU seconds}) of `steps` steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = timed(fn, steps)
    kinds = collections.Counter()
    for event in prof.key_averages():
        if event.key.startswith("aten::") or "all_reduce" in event.key:
            kinds[kind_of(event.key)] += event.self_cpu_time_total / 1e6
    return wall, kinds


# Code locations -> the area the cProfile table reports them under (first match wins).
AREAS = (("keras/src/optimizers", "Keras optimizers"), ("keras/src/metrics", "Keras metrics"),
         ("keras/src/losses", "Keras losses"), ("keras/src/layers", "Keras layers"),
         ("keras/src/backend/torch", "Keras torch backend"), ("keras/src/ops", "Keras ops"),
         ("keras/src", "Keras, other"), ("kdist/", "kdist"), ("torch/autograd", "autograd"),
         ("torch/distributed", "torch.distributed"), ("torch/", "torch Python"))


def python_profile(fn, steps):
    """{area: seconds of own time} of `steps` steps under cProfile, and the total."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(fn, steps)
    areas = collections.Counter()
    for (path, _, name), (_, _, own, _, _) in pstats.Stats(profiler).stats.items():
        if path == "~":  # A builtin: an operator or a C function.
            area = "torch operators" if "torch" in name else "Python builtins"
        else:
            area = next((a for fragment, a in AREAS if fragment in path), "other Python")
        areas[area] += own
    return areas


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps per round (default 100)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batches = [(rng.uniform(0, 1, (args.batch_size, 28, 28, 1)).astype(np.float32),
                rng.integers(0, 10, args.batch_size).astype(np.int32)) for _ in range(16)]
    runs = {"kdist": kdist_steps(batches), "plain": plain_steps(batches),
            "kdist, stock layers": kdist_steps(batches, fast_layers=False)}
    for fn in runs.values():
        fn(20)  # Warm-up.
    seconds = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            seconds[name].append(timed(fn, args.steps))
    print(f"torch {torch.__version__} on {DEVICE}, {torch.get_num_threads()} threads, batch "
          f"{args.batch_size}, {args.steps} steps x {args.rounds} rounds")
    for name, times in seconds.items():
        ratios = [t / k for k, t in zip(seconds["kdist"], times)]
        print(f"{name}: {1e3 * statistics.median(times) / args.steps:.2f} ms per step "
              f"(rounds {', '.join(f'{t:.2f}' for t in times)} s); kdist's speed / its, "
              f"median of paired rounds: {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}-{max(ratios):.3f}]")
    print(f"\nper step, ms | {' | '.join(runs)}")
    profiles = {name: profile(fn, args.steps) for name, fn in runs.items()}
    kinds = sorted({k for _, found in profiles.values() for k in found})
    for kind in kinds + ["no operator (Python)", "wall"]:
        cells = []
        for wall, found in profiles.values():
            value = {"wall": wall, "no operator (Python)": wall - sum(found.values())}.get(
                kind, found.get(kind, 0.0))
            cells.append(f"{1e3 * value / args.steps:.2f}")
        print(f"{kind} | {' | '.join(cells)}")
    areas = python_profile(runs["kdist"], args.steps)
    total = sum(areas.values())
    print(f"\nkdist under cProfile, own time: {1e3 * total / args.steps:.2f} ms per step")
    for area, own in areas.most_common():
        print(f"{area} | {1e3 * own / args.steps:.2f} ms | {100 * own / total:.0f}%")


if __name__ == "__main__":
    main()
