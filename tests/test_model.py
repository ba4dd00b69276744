"""The fast layer formulations equal Keras' stock layers: outputs and gradients."""

import keras
import numpy as np
import pytest

from kdist.models import cnn as kdist_model


def gradients(layer, x):
    """Outputs and d(sum(outputs * probe))/d(inputs, weights), on any backend."""
    probe = np.random.default_rng(1).normal(size=layer.compute_output_shape(x.shape))
    probe = probe.astype("float32")
    if keras.backend.backend() == "jax":
        import jax

        def f(inputs, weights):
            out, _ = layer.stateless_call(weights, [], inputs)
            return (out * probe).sum(), out

        (_, out), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
            x, [v.value for v in layer.trainable_variables])
        return out, [grads[0]] + list(grads[1])
    if keras.backend.backend() == "torch":
        import torch

        inputs = torch.tensor(x, requires_grad=True)
        out = layer(inputs)
        total = (out * torch.as_tensor(probe)).sum()
        grads = torch.autograd.grad(total, [inputs] + [v.value for v in layer.trainable_variables])
        return out.detach().numpy(), [g.numpy() for g in grads]
    import tensorflow as tf

    inputs = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        out = layer(inputs)
        total = tf.reduce_sum(out * probe)
    grads = tape.gradient(total, [inputs] + [v.value for v in layer.trainable_variables])
    return out, grads


@pytest.mark.parametrize("height", [26, 11])  # Even and odd: "valid" drops the last row.
def test_max_pooling_matches_keras(height):
    x = np.random.default_rng(0).normal(size=(4, height, height, 8)).astype("float32")
    ours, theirs = kdist_model.MaxPooling2D(), keras.layers.MaxPooling2D()
    out_a, grads_a = gradients(ours, x)
    out_b, grads_b = gradients(theirs, x)
    np.testing.assert_array_equal(np.asarray(out_a), np.asarray(out_b))
    np.testing.assert_allclose(np.asarray(grads_a[0]), np.asarray(grads_b[0]), atol=1e-6)


def test_max_pooling_gives_a_ties_gradient_to_the_first_maximum_as_keras():
    # Ties are common where an image is flat (Fashion-MNIST's background): JAX's
    # max reduction split their gradient, so kdist's CNN trained away from the
    # stock layers' (8e-4 in 16 SGD steps) and from 1 replica on 2 (1.3e-3).
    x = np.random.default_rng(0).integers(0, 2, size=(4, 12, 12, 8)).astype("float32")
    ours, theirs = kdist_model.MaxPooling2D(), keras.layers.MaxPooling2D()
    out_a, grads_a = gradients(ours, x)
    out_b, grads_b = gradients(theirs, x)
    np.testing.assert_array_equal(np.asarray(out_a), np.asarray(out_b))
    np.testing.assert_array_equal(np.asarray(grads_a[0]), np.asarray(grads_b[0]))


@pytest.mark.parametrize("channels", [32, 1])  # The CNN's second and first layer.
def test_conv2d_matches_keras_with_the_same_weights(channels):
    x = np.random.default_rng(0).normal(size=(4, 13, 13, channels)).astype("float32")
    ours = kdist_model.Conv2D(64, 3, activation="relu")
    theirs = keras.layers.Conv2D(64, 3, activation="relu")
    ours.build(x.shape)
    theirs.build(x.shape)
    kernel, bias = ours.get_weights()
    ours.set_weights([kernel, np.random.default_rng(1).normal(size=bias.shape)])  # Not zeros.
    theirs.set_weights(ours.get_weights())
    out_a, grads_a = gradients(ours, x)
    out_b, grads_b = gradients(theirs, x)
    np.testing.assert_allclose(np.asarray(out_a), np.asarray(out_b), atol=1e-5, rtol=0)
    for a, b in zip(grads_a, grads_b):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-5)
    assert [w.shape for w in ours.get_weights()] == [(3, 3, channels, 64), (64,)]


def test_the_stock_cnn_has_keras_layers_where_the_cnn_has_kdists_and_the_same_weights():
    fast, stock = kdist_model.create_model(), kdist_model.create_model(fast_layers=False)
    kinds = [(type(a), type(b)) for a, b in zip(fast.layers, stock.layers)
             if type(a) is not type(b)]
    assert kinds == [(kdist_model.Conv2D, keras.layers.Conv2D),
                     (kdist_model.MaxPooling2D, keras.layers.MaxPooling2D)] * 2
    assert [w.shape for w in fast.get_weights()] == [w.shape for w in stock.get_weights()]
    # Layers in a row, as in the CNN: on torch each takes the one before's result
    # (channels-first in memory) as it is.
    stock.set_weights(fast.get_weights())
    x = np.random.default_rng(0).uniform(size=(8, 28, 28, 1)).astype("float32")
    out_a, grads_a = gradients(fast, x)
    out_b, grads_b = gradients(stock, x)
    np.testing.assert_allclose(np.asarray(out_a), np.asarray(out_b), atol=1e-5, rtol=0)
    for a, b in zip(grads_a, grads_b):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-5)
