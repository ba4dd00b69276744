"""A step that works on its gradients: each layer's gradient clipped to a norm, and the
global gradient norm reported as a metric; one step for every backend.

    KERAS_BACKEND=jax python examples/clipped_gradients.py --synthetic 1200 --epochs 1
    python examples/clipped_gradients.py --epochs 10 --replicas 2   # Fashion-MNIST

The gradients a step holds are those of the global batch (`kdist.value_and_grad`
averages them over replicas), so clipping them here clips what one device
would clip.
"""

import sys

import keras
from keras import ops

import kdist
from kdist.cli import train


class Clipped(keras.Model):
    def __init__(self, learning_rate=1e-3, clip_norm=1.0):
        super().__init__()
        self.cnn = kdist.create_model()
        self.opt = keras.optimizers.SGD(learning_rate)
        self.cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
        self.clip_norm = clip_norm

    def train_step(self, data):
        x, y = data
        weights = self.cnn.trainable_variables

        def loss():
            logits = self.cnn(x, training=True)
            return self.cross_entropy(y, logits), logits

        (loss, logits), grads = kdist.value_and_grad(loss, weights)
        norms = [ops.sqrt(ops.sum(ops.square(g))) for g in grads]
        clipped = [g * ops.minimum(1.0, self.clip_norm / (n + 1e-12)) for g, n in zip(grads, norms)]
        self.opt.apply(clipped, weights)
        self.accuracy.update_state(y, logits)
        grad_norm = ops.sqrt(sum(ops.square(n) for n in norms))
        return {"loss": loss, "accuracy": self.accuracy.result(), "grad_norm": grad_norm}

    def test_step(self, data):
        x, y = data
        logits = self.cnn(x, training=False)
        self.accuracy.update_state(y, logits)
        return {"loss": self.cross_entropy(y, logits), "accuracy": self.accuracy.result()}


def model(args=None):
    """The clipped classifier (plain SGD), with `--learning-rate` (default 0.05)."""
    return Clipped(getattr(args, "learning_rate", None) or 0.05)


if __name__ == "__main__":
    sys.exit(train.main(model_fn=model, description=__doc__))
