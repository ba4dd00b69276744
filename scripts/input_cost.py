"""What each input kind of `kdist-bench --input` costs per batch, with no training.

    KERAS_BACKEND=tensorflow python scripts/input_cost.py [--kinds numpy,tfdata,...]

Reads whole training epochs of synthetic Fashion-MNIST-shaped data through
kdist's source of each kind (`kdist.bench.input_kinds.input_source`, the pipelines the
benchmark trains on) and prints, per kind and epoch, the wall time and the
process's CPU time per batch. The CPU time is what the pipeline takes from
the training step on a machine whose cores the step keeps busy, however
well it overlaps. Needs kdist installed (`pip install -e ".[all]"`).
"""

import argparse
import time

from kdist.runtime import startup

startup.prepare_environment()  # Before Keras loads: quiet logs, kdist-bench's memory settings.
with startup.native_logs_silenced():  # The frameworks' start-up notices.
    import importlib.util

    import numpy as np

    if importlib.util.find_spec("tensorflow"):  # For --kinds tfdata, on any backend.
        import tensorflow  # noqa: F401

    from kdist.bench import choices, input_kinds
    from kdist.cli.flags import names, positive


def epoch_cost(source, batch, epoch):
    """(batches, wall ms per batch, CPU ms per batch) of one training epoch of `source`."""
    wall, cpu = time.perf_counter(), time.process_time()
    count = sum(1 for _ in source.train(batch, seed=0, epoch=epoch))
    return (count, 1e3 * (time.perf_counter() - wall) / count,
            1e3 * (time.process_time() - cpu) / count)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", type=names(choices.INPUTS), default=choices.INPUTS,
                        help="the input kinds, separated by commas (default: all)")
    parser.add_argument("--batch", type=positive(int), default=64, help="rows per batch")
    parser.add_argument("--epochs", type=positive(int), default=2, help="epochs per kind")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    x = rng.random((60000, 28, 28, 1), np.float32)
    y = rng.integers(0, 10, 60000)
    for kind in args.kinds:
        source = input_kinds.input_source(kind, (x, y, None), args.batch, "train")
        for epoch in range(args.epochs):
            count, wall, cpu = epoch_cost(source, args.batch, epoch)
            print(f"{kind:10s} epoch {epoch}: {count} batches, {wall:.3f} ms wall and "
                  f"{cpu:.3f} ms CPU per batch", flush=True)


if __name__ == "__main__":
    main()
