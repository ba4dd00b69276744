"""The tutorial CNN's weights with next to no arithmetic: `kdist-bench --model cnn-weights`.

Its step takes each weight as the matrix of a bilinear form of the images'
pixels, so its gradients are the CNN's (the same tensors, of the same shapes),
each a sum over the batch of per-image products: XLA and TensorFlow must
all-reduce every one whole (a gradient of one value would be all-reduced as a
scalar). The forward and backward passes cost about 40 MFLOP a step of 64
images, a 25th of the CNN's. What is left of a step is kdist's loop, the
gradient all-reduce and the optimizer's update: with several workers, the
floor their communication sets under the CNN's step
(`scripts/bench_workers.py --model cnn-weights`).
"""

import math

import keras
from keras import ops

from kdist.models.cnn import create_model


def bilinear(pixels, weight):
    """Per image `b`: `pixels[b, :rows] @ W @ pixels[b]`, where W is `weight`
    flattened, padded with zeros and laid out in rows of the pixels' length."""
    width, size = pixels.shape[1], math.prod(weight.shape)
    rows = -(-size // width)
    matrix = ops.reshape(ops.pad(ops.reshape(weight, (-1,)), [(0, rows * width - size)]),
                         (rows, width))
    return ops.sum(ops.matmul(pixels[:, :rows], matrix) * pixels, axis=1)


class WeightsOnly(keras.Model):
    """Logits from the images' means and a bilinear form of them in every CNN weight."""

    def __init__(self, num_classes: int = 10):
        super().__init__(name="cnn_weights_only")
        self.num_classes = num_classes
        self.cnn = create_model(num_classes)

    def call(self, images):
        pixels = ops.cast(ops.reshape(images, (ops.shape(images)[0], -1)), "float32")
        forms = ops.sum(ops.stack([bilinear(pixels, w) for w in self.cnn.trainable_weights],
                                  axis=1), axis=1)
        classes = ops.arange(self.num_classes, dtype="float32")
        return (ops.expand_dims(ops.mean(pixels, axis=1), 1) * classes
                + 1e-3 * ops.expand_dims(forms, 1) * (classes + 1) / self.num_classes)


def create_weights_only(num_classes: int = 10) -> keras.Model:
    return WeightsOnly(num_classes)
