"""The tutorial's CNN, written once for every backend."""

import keras
from keras import ops


class MaxPooling2D(keras.layers.MaxPooling2D):
    """`keras.layers.MaxPooling2D` whose 2x2/stride-2 case is fast on JAX, and
    which pools channels-first on torch (`channels_first`).

    XLA:CPU compiles the gradient of `reduce_window` max pooling into a slow
    select-and-scatter. Each 2x2 window's four values, from a reshape, times a
    one-hot of their first maximum, summed, give the same outputs and
    gradients (ties included: the first maximum takes the gradient) through
    plain element-wise operations, much faster on JAX CPU
    (docs/performance.md). On TensorFlow the native pooling kernel is faster,
    so it is kept there.

    The class keeps Keras' name on purpose: weight files index layers by
    class name, so checkpoints stay loadable into a stock Keras model.
    """

    def call(self, inputs):
        if keras.backend.backend() == "torch" and self.data_format == "channels_last":
            return channels_first(inputs, lambda x: ops.max_pool(
                x, self.pool_size, self.strides, self.padding, "channels_first"))
        if (keras.backend.backend() != "jax" or self.pool_size != (2, 2)
                or self.strides != (2, 2) or self.padding != "valid"
                or self.data_format != "channels_last"):
            return super().call(inputs)
        batch, height, width, channels = inputs.shape
        h, w = height // 2, width // 2
        x = inputs[:, :2 * h, :2 * w, :]  # "valid" drops an odd last row/column.
        x = ops.reshape(x, (-1, h, 2, w, 2, channels))
        x = ops.reshape(ops.transpose(x, (0, 1, 3, 5, 2, 4)), (-1, h, w, channels, 4))
        # The window's first maximum, in row order, takes the gradient, as in
        # `reduce_window`: a max reduction's would split it among tied maxima.
        first = ops.one_hot(ops.argmax(ops.stop_gradient(x), axis=-1), 4, dtype=x.dtype)
        return ops.sum(x * first, axis=-1)


class Conv2D(keras.layers.Conv2D):
    """`keras.layers.Conv2D` whose 3x3 valid convolutions run as one matmul on JAX,
    and which convolves channels-first on torch (`channels_first`).

    On XLA:CPU a convolution with several input channels is faster as im2col:
    the nine shifted slices of the input concatenated on the channel axis,
    times the kernel reshaped from (3, 3, in, out) to (9 * in, out). The
    kernel keeps Keras' layout, so weights and checkpoints are unchanged; with
    one input channel (the first layer) XLA's own convolution is faster and is
    kept, as it is on TensorFlow.
    """

    def call(self, inputs):
        if (keras.backend.backend() == "torch" and self.data_format == "channels_last"
                and self.groups == 1):
            return channels_first(inputs, self._channels_first_call)
        if (keras.backend.backend() != "jax" or inputs.shape[-1] < 2
                or self.kernel_size != (3, 3) or self.strides != (1, 1)
                or self.padding != "valid" or self.dilation_rate != (1, 1)
                or self.groups != 1 or self.data_format != "channels_last"):
            return super().call(inputs)
        height, width = inputs.shape[1] - 2, inputs.shape[2] - 2
        patches = ops.concatenate(
            [inputs[:, i:i + height, j:j + width, :] for i in range(3) for j in range(3)],
            axis=-1)
        outputs = ops.matmul(patches, ops.reshape(self.kernel, (-1, self.filters)))
        if self.use_bias:
            outputs = outputs + self.bias
        return self.activation(outputs) if self.activation is not None else outputs

    def _channels_first_call(self, inputs):
        """Keras' `Conv2D.call` on channels-first `inputs`."""
        outputs = ops.conv(inputs, self.kernel, strides=list(self.strides),
                           padding=self.padding, dilation_rate=self.dilation_rate,
                           data_format="channels_first")
        if self.use_bias:
            outputs = outputs + ops.reshape(self.bias, (1, self.filters, 1, 1))
        return self.activation(outputs) if self.activation is not None else outputs


def channels_first(inputs, fn):
    """`fn` applied to channels-last `inputs` seen channels-first, its result
    seen channels-last again: on torch both are views (`torch.permute`), no copy.

    Keras' torch backend runs a channels-last convolution or pooling as
    channels-first on a transposed view and transposes its result back, so
    the tensor between layers is channels-last in memory: the pooling and
    the activation's gradient then run on torch's slow strided paths, 1.8x
    the CNN's step time. These layers keep their results channels-first in
    memory, so that the next one's view is plain channels-first (measured:
    docs/performance.md). The weights are Keras' own either way.
    """
    return ops.transpose(fn(ops.transpose(inputs, (0, 3, 1, 2))), (0, 2, 3, 1))


def create_model(num_classes: int = 10, fast_layers: bool = True) -> keras.Model:
    """Conv2D(32,3,relu)-MaxPool-Conv2D(64,3,relu)-MaxPool-Flatten-Dense(64,relu)-Dense(10).

    `fast_layers` False builds it from Keras' stock Conv2D and MaxPooling2D,
    without the formulations above (JAX's; torch's channels-first memory):
    `kdist-bench --model cnn-stock` measures what they gain on a CPU. The
    weights are the same either way.

    The last layer returns logits; the loss applies the softmax. It computes
    in float32 under every dtype policy (`kdist.precision`): under a mixed
    policy the layers before it compute in bfloat16 or float16, and logits
    rounded to those (bfloat16 keeps 8 significant bits: a logit of 10 is
    off by up to 0.03) would enter the float32 loss with that error, as
    Keras' mixed precision guide warns.
    """
    conv, pool = (Conv2D, MaxPooling2D) if fast_layers else (keras.layers.Conv2D,
                                                             keras.layers.MaxPooling2D)
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            conv(32, 3, activation="relu"),
            pool(),
            conv(64, 3, activation="relu"),
            pool(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(num_classes, dtype="float32"),
        ],
        name="fashion_cnn",
    )
