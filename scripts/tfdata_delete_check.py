"""How long deleting a tf.data iterator at the end of an epoch takes on a busy CPU.

    python scripts/tfdata_delete_check.py [--epochs 8] [--busy-threads 2]

Reads whole epochs of the benchmark's tf.data pipeline (`kdist.bench.input_kinds.input_source`,
read as kdist reads it) while threads keep the cores busy with matmuls, as a
training step does, and prints per epoch how long deleting the exhausted
iterator took on the reading thread, and, for comparison, with
`autotune.enabled = False`. kdist deletes its iterators on a thread of their
own (`kdist.inputs.tfdata.numpy_batches`) because this took seconds on a 2-core
CPU (docs/performance.md, "Input pipelines"); this script shows whether a
TensorFlow release still needs that. Needs TensorFlow.
"""

import argparse
import threading
import time

from kdist.runtime import startup

startup.prepare_environment()
with startup.native_logs_silenced():
    import numpy as np
    import tensorflow as tf

    from kdist.bench import input_kinds
    from kdist.cli.flags import positive
    from kdist.inputs import tfdata


def keep_busy():
    """Matmuls for ever, as a training step keeps the cores busy."""
    a = tf.random.normal((1024, 1024))
    while True:
        tf.linalg.matmul(a, a).numpy()


def deletion_ms(dataset, pause):
    """Reads one epoch of `dataset`, `pause` seconds per read; the ms `del` took."""
    iterator = dataset.as_numpy_iterator()
    for _ in iterator:
        time.sleep(pause)
    start = time.perf_counter()
    del iterator
    return 1e3 * (time.perf_counter() - start)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=positive(int), default=8, help="epochs per setting")
    parser.add_argument("--busy-threads", type=int, default=2, help="matmul threads")
    args = parser.parse_args(argv)
    for _ in range(args.busy_threads):
        threading.Thread(target=keep_busy, daemon=True).start()
    rng = np.random.default_rng(0)
    x, y = rng.random((60000, 28, 28, 1), np.float32), rng.integers(0, 10, 60000)
    source = input_kinds.input_source("tfdata", (x, y, None), 64, "train")
    dataset = tfdata.for_reading(source.dataset, 64)
    no_autotune = tf.data.Options()
    no_autotune.autotune.enabled = False
    for label, read in (("autotune on (the default)", dataset),
                        ("autotune off", dataset.with_options(no_autotune))):
        times = [deletion_ms(read, 0.03) for _ in range(args.epochs)]
        print(f"{label}: deleting the iterator took " + ", ".join(f"{t:.0f}" for t in times)
              + " ms", flush=True)


if __name__ == "__main__":
    main()
