"""How far 1 and 2 replicas' training parts by rounding alone, with and without kinks.

    KERAS_BACKEND=jax python scripts/replica_rounding.py --steps 40

Without kdist: Keras' `stateless_call` and `jax.grad` train the tutorial CNN on the first
global batches of 32 of Fashion-MNIST with plain SGD at 0.05, once on the whole batch's
gradient (1 replica) and once on the mean of its two halves' gradients (2 replicas), from
the same weights. The two sum the same numbers in another order, so they differ by float32
rounding after a step. Each line gives the largest difference of any weight after some
steps, for Keras' stock layers, for kdist's JAX layers (`kdist/models/cnn.py`), and for
the stock model with tanh and average pooling (no kinks). The first two grow by orders of
magnitude, the last does not: docs/log/2026-12-07-replica-rounding.md.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(kind):
    import keras

    from kdist.models import cnn

    keras.utils.set_random_seed(1)  # The same initial weights for every kind.
    if kind == "smooth":
        return keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, activation="tanh"),
            keras.layers.AveragePooling2D(2), keras.layers.Conv2D(64, 3, activation="tanh"),
            keras.layers.AveragePooling2D(2), keras.layers.Flatten(),
            keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(10)])
    return cnn.create_model(fast_layers=kind == "kdist")


def train(kind, halves, x, y, steps, learning_rate=0.05):
    """The trainable weights after each step, as NumPy arrays."""
    import jax
    import keras
    import numpy as np

    model = build(kind)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss(weights, xb, yb):
        return loss_fn(yb, model.stateless_call(weights, [], xb)[0])

    grad = jax.jit(jax.grad(loss))
    weights = [v.value for v in model.trainable_variables]
    after = []
    for step in range(steps):
        xb, yb = x[32 * step:32 * (step + 1)], y[32 * step:32 * (step + 1)]
        if halves:
            first, second = grad(weights, xb[:16], yb[:16]), grad(weights, xb[16:], yb[16:])
            grads = [(a + b) / 2 for a, b in zip(first, second)]
        else:
            grads = grad(weights, xb, yb)
        weights = [w - learning_rate * g for w, g in zip(weights, grads)]
        after.append([np.asarray(w) for w in weights])
    return after


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="SGD steps (default: 40)")
    args = parser.parse_args(argv)
    if os.environ.setdefault("KERAS_BACKEND", "jax") != "jax":
        parser.error("it differentiates with jax.grad: run it with KERAS_BACKEND=jax")
    import numpy as np

    from kdist.datasets.fashion_mnist import load_fashion_mnist

    data = load_fashion_mnist()
    x, y = data.train_x[:32 * args.steps], data.train_y[:32 * args.steps]
    marks = [s for s in (1, 2, 4, 8, 16, 24, 32, 40, 80, 160) if s <= args.steps]
    for kind in ("stock", "kdist", "smooth"):
        one, two = train(kind, False, x, y, args.steps), train(kind, True, x, y, args.steps)
        parted = [max(float(np.abs(a - b).max()) for a, b in zip(one[s - 1], two[s - 1]))
                  for s in marks]
        print(f"{kind:6} 1 vs 2 replicas, largest weight difference after "
              + ", ".join(f"{s}: {d:.1e}" for s, d in zip(marks, parted)))


if __name__ == "__main__":
    main()
