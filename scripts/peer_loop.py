"""What kdist-bench's peer scripts share: their flags and their one JSON line.

The peers (`tf_tutorial_loop.py`, `jax_optax_loop.py`, `ddp_baseline.py`) each
train the tutorial CNN their framework's own way; this module imports no
framework and no kdist, so each peer stays a plain program of its framework.
"""

import argparse
import statistics


def parse_args(doc, steps, windows):
    """The peers' flags, described by the first line of `doc`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--batch-size-per-replica", type=int, default=64)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--windows", type=int, default=windows)
    return parser.parse_args()


def summary(seconds, steps, global_batch, **fields):
    """The JSON line's fields: `fields`, then the first epoch's seconds and the
    median samples/s of the epochs after it (`seconds`: each epoch's)."""
    return dict(fields, global_batch=global_batch, steps=steps,
                first_epoch_seconds=round(seconds[0], 2),
                samples_per_sec=round(statistics.median(steps * global_batch / s
                                                        for s in seconds[1:])))
