"""The reference job as TensorFlow's tutorial writes it today: no kdist.

TensorFlow's "Custom training with tf.distribute.Strategy": a MirroredStrategy,
`experimental_distribute_dataset` over a tf.data pipeline, a `tf.function` that
runs `strategy.run(train_step)` once per batch, the loss summed per example over
the global batch (`tf.nn.compute_average_loss`), Adam, and a training accuracy
metric. The tutorial CNN (`kdist.create_model(fast_layers=False)`: Keras' own
layers, as the tutorial's), synthetic Fashion-MNIST-shaped data, the same
global batch as kdist-bench; 1 + --windows epochs of --steps steps, the median
samples/s of the epochs after the first, then one JSON line. The peer of
`kdist-bench` on TensorFlow (docs/performance.md).

    KERAS_BACKEND=tensorflow python scripts/tf_tutorial_loop.py --replicas 1 --steps 150 --windows 5
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import peer_loop  # noqa: E402 (scripts/peer_loop.py, beside this file)

from kdist.runtime import startup  # noqa: E402


def main():
    args = peer_loop.parse_args(__doc__, steps=150, windows=5)
    startup.prepare_environment(args.replicas)  # kdist-bench's process settings, for a fair match.
    import keras
    import numpy as np
    import tensorflow as tf

    import kdist

    # The GPUs where there are some (as kdist's engine), else the CPU's logical devices.
    kind = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
    devices = [d.name for d in tf.config.list_logical_devices(kind)][:args.replicas]
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    global_batch = args.batch_size_per_replica * strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 1, (args.steps * global_batch, 28, 28, 1)).astype(np.float32)
    labels = rng.integers(0, 10, args.steps * global_batch).astype(np.int64)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((images, labels)).batch(global_batch).prefetch(2))
    with strategy.scope():
        model = kdist.create_model(fast_layers=False)
        loss_object = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None)
        optimizer = keras.optimizers.Adam()
        accuracy = keras.metrics.SparseCategoricalAccuracy()

    def train_step(inputs):
        x, y = inputs
        with tf.GradientTape() as tape:
            predictions = model(x, training=True)
            loss = tf.nn.compute_average_loss(loss_object(y, predictions),
                                              global_batch_size=global_batch)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        accuracy.update_state(y, predictions)
        return loss

    @tf.function
    def distributed_train_step(inputs):
        losses = strategy.run(train_step, args=(inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    seconds = []
    for _ in range(1 + args.windows):
        start = time.perf_counter()
        total = 0.0
        for batch in dataset:
            total += distributed_train_step(batch)
        float(total)
        seconds.append(time.perf_counter() - start)
    print(json.dumps(peer_loop.summary(
        seconds, args.steps, global_batch, baseline="TensorFlow tutorial loop",
        tensorflow=tf.__version__, replicas=strategy.num_replicas_in_sync)))


if __name__ == "__main__":
    main()
