"""The tutorial CNN's weights with next to no arithmetic: `kdist-bench --model cnn-weights`.

Its step computes the loss from each weight's sum, so its gradients are the
CNN's (the same tensors, of the same shapes), each filled with one number,
while the forward and backward passes cost a few microseconds. What is left
of a step is kdist's loop, the gradient all-reduce and the optimizer's
update: with several workers, the floor their communication sets under the
CNN's step (`scripts/bench_workers.py --model cnn-weights`).
"""

import keras
from keras import ops

from kdist.models.cnn import create_model


class WeightsOnly(keras.Model):
    """Logits from the images' means and the sum of every CNN weight."""

    def __init__(self, num_classes: int = 10):
        super().__init__(name="cnn_weights_only")
        self.num_classes = num_classes
        self.cnn = create_model(num_classes)

    def call(self, images):
        total = ops.sum(ops.stack([ops.sum(w) for w in self.cnn.trainable_weights]))
        means = ops.mean(ops.reshape(images, (ops.shape(images)[0], -1)), axis=1)
        classes = ops.arange(self.num_classes, dtype="float32")
        return ops.expand_dims(ops.cast(means, "float32"), 1) * classes + 1e-3 * total


def create_weights_only(num_classes: int = 10) -> keras.Model:
    return WeightsOnly(num_classes)
