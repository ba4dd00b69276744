"""What a tf.data pipeline costs Keras `fit` against the same arrays, on the active backend.

    KERAS_BACKEND=jax python scripts/fit_tfdata_check.py [ROUNDS]

The reference for kdist's own figure (`kdist-bench --input numpy,tfdata`):
one model, compiled once, takes `fit` epochs of 200 batches of 64 in turn,
from the arrays and from the tf.data pipeline that `kdist-bench --input
tfdata` uses (the same rows gathered per batch, the batches shuffled), for
1 + ROUNDS rounds (default 10). Prints the median samples/s of each, after
the first round, and the ratio tf.data / arrays: the median of the rounds'
ratios and the ratio of the medians. Each `fit` call sets up its data
anew, which `fit` over many epochs does once, so compare the ratio, not the
samples/s with `kdist-bench`'s. Needs TensorFlow and kdist installed.
"""

import statistics
import sys
import time

from kdist.runtime import startup

startup.prepare_environment()  # Before Keras loads: quiet logs, kdist-bench's memory settings.
with startup.native_logs_silenced():  # The frameworks' start-up notices.
    import keras
    import numpy as np
    import tensorflow as tf

    from kdist.models.cnn import create_model

STEPS, BATCH = 200, 64


def main(rounds=10):
    rng = np.random.default_rng(0)
    x = rng.random((60000, 28, 28, 1), np.float32)
    y = rng.integers(0, 10, 60000)
    order = rng.permutation(len(x))[:STEPS * BATCH]
    x_rows, y_rows = x[order], y[order]
    images, labels = tf.constant(x), tf.constant(y)
    pipeline = (tf.data.Dataset.from_tensor_slices(order.reshape(STEPS, BATCH))
                .shuffle(STEPS, seed=0)
                .map(lambda rows: (tf.gather(images, rows), tf.gather(labels, rows)))
                .prefetch(tf.data.AUTOTUNE))
    keras.utils.set_random_seed(0)
    model = create_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    feeds = {"arrays": lambda: model.fit(x_rows, y_rows, batch_size=BATCH, verbose=0),
             "tf.data": lambda: model.fit(pipeline, verbose=0)}
    seconds = {kind: [] for kind in feeds}
    for _ in range(1 + rounds):
        for kind, fit in feeds.items():
            start = time.perf_counter()
            fit()
            seconds[kind].append(time.perf_counter() - start)
    arrays, pipelined = seconds["arrays"][1:], seconds["tf.data"][1:]
    print(f"{keras.backend.backend()}: fit from arrays "
          f"{STEPS * BATCH / statistics.median(arrays):,.0f} samples/s, from tf.data "
          f"{STEPS * BATCH / statistics.median(pipelined):,.0f}; tf.data / arrays: median of "
          f"the rounds' ratios {statistics.median(a / p for a, p in zip(arrays, pipelined)):.3f}"
          f", ratio of the medians {statistics.median(arrays) / statistics.median(pipelined):.3f}")


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:2]))
