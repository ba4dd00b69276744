"""ResNet-20, the benchmark's larger model (`kdist-bench --model resnet20`).

The network of He et al. (2016) for 32x32 images: a 3x3 convolution of 16
filters, then 3 stages of 3 basic blocks with 16, 32 and 64 filters (the
first block of stages 2 and 3 halves the resolution with stride 2 and
projects its shortcut with a 1x1 convolution), every convolution followed
by BatchNormalization, then global average pooling and a Dense layer of
logits. About 0.27 M weights and 41 M multiply-adds per example forward
(about 245 MFLOP per example for a training step, against the tutorial
CNN's 15): a step dominated by convolutions, with BatchNormalization's
statistics as non-trainable state.
"""

import keras

from kdist.datasets.cifar_shaped import IMAGE_SHAPE

STAGES = (16, 32, 64)

BLOCKS_PER_STAGE = 3



def _conv_bn(x, filters, strides=1, kernel_size=3, relu=True):
    x = keras.layers.Conv2D(filters, kernel_size, strides=strides, padding="same",
                            use_bias=False, kernel_initializer="he_normal")(x)
    x = keras.layers.BatchNormalization()(x)
    return keras.layers.ReLU()(x) if relu else x


def _basic_block(x, filters, strides):
    shortcut = x
    if strides != 1 or x.shape[-1] != filters:
        shortcut = _conv_bn(x, filters, strides, kernel_size=1, relu=False)
    y = _conv_bn(x, filters, strides)
    y = _conv_bn(y, filters, relu=False)
    return keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))


def create_resnet20(num_classes=10, input_shape=IMAGE_SHAPE):
    """ResNet-20 returning logits; the last layer computes in float32 under any
    dtype policy, as the CNN's does (`kdist.models.cnn.create_model`)."""
    inputs = keras.Input(input_shape)
    x = _conv_bn(inputs, STAGES[0])
    for stage, filters in enumerate(STAGES):
        for block in range(BLOCKS_PER_STAGE):
            x = _basic_block(x, filters, strides=2 if stage > 0 and block == 0 else 1)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(num_classes, dtype="float32")(x)
    return keras.Model(inputs, outputs, name="resnet20")
