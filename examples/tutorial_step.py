"""The tutorial's train step, written with kdist's primitives: the CNN, sparse
cross-entropy, SGD or Adam, accuracy. What `kdist-train` runs for a compiled
model, as a step of your own; it trains to the same weights.

    KERAS_BACKEND=tensorflow python examples/tutorial_step.py --synthetic 1200 --epochs 1
    python examples/tutorial_step.py --epochs 10 --replicas 2     # Fashion-MNIST
"""

import sys

import keras

import kdist
from kdist.cli import train


class Tutorial(keras.Model):
    def __init__(self, optimizer):
        super().__init__()
        self.cnn = kdist.create_model()
        self.opt = optimizer
        self.cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")

    def train_step(self, data):
        x, y = data

        def loss():
            logits = self.cnn(x, training=True)
            return self.cross_entropy(y, logits), logits

        (loss, logits), grads = kdist.value_and_grad(loss, self.cnn.trainable_variables)
        self.opt.apply(grads, self.cnn.trainable_variables)
        self.accuracy.update_state(y, logits)
        return {"loss": loss, "accuracy": self.accuracy.result()}

    def test_step(self, data):
        x, y = data
        logits = self.cnn(x, training=False)
        self.accuracy.update_state(y, logits)
        return {"loss": self.cross_entropy(y, logits), "accuracy": self.accuracy.result()}


def model(args=None):
    """The tutorial's model and step, with `--optimizer` and `--learning-rate`."""
    make = kdist.OPTIMIZERS[getattr(args, "optimizer", None) or "adam"]
    return Tutorial(make(getattr(args, "learning_rate", None) or 1e-3))


if __name__ == "__main__":
    sys.exit(train.main(model_fn=model, description=__doc__))
