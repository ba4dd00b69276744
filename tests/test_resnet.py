"""ResNet-20 (`kdist.models.resnet`), the benchmark's larger model: its shape, and one
kdist step on 2 replicas."""

import keras
import numpy as np
import pytest
from helpers import prepare

from kdist import engines
from kdist.datasets import cifar_shaped
from kdist.loop import chunks
from kdist.models import resnet
from kdist.precision import policy


def layers_of(model, kind):
    return [layer for layer in model.layers if type(layer) is kind]


@pytest.fixture(scope="module")
def trained():
    """ResNet-20 compiled on 2 replicas (one build: on JAX each new weight shape
    compiles its initializer), and 16 examples of its data."""
    engine = engines.create_engine(2)
    keras.utils.set_random_seed(0)
    dataset = cifar_shaped.synthetic_cifar(num_train=16, num_test=2, seed=0)
    sample = (dataset.train_x[:2], dataset.train_y[:2], None)
    model, _ = prepare(engine, 16, model_fn=resnet.create_resnet20, sample=sample,
                       learning_rate=0.1)
    return engine, model, dataset


def test_resnet20_has_its_layers_and_returns_float32_logits(trained):
    _, model, _ = trained
    convs = layers_of(model, keras.layers.Conv2D)
    # 19 convolutions of 3x3 (1 + 3 stages x 3 blocks x 2) and the Dense layer are the
    # name's 20 layers; the 2 shortcut projections of 1x1 are not counted in it.
    assert sorted(c.kernel_size for c in convs) == [(1, 1)] * 2 + [(3, 3)] * 19
    assert len(layers_of(model, keras.layers.BatchNormalization)) == len(convs)
    assert len(layers_of(model, keras.layers.Add)) == 9
    assert [c.filters for c in convs if c.strides == (2, 2)] == [32, 32, 64, 64]
    assert 250_000 < model.count_params() < 300_000
    assert tuple(model.output.shape) == (None, 10)  # The forward pass runs in the step test.
    with policy("mixed_bfloat16"):
        mixed = resnet.create_resnet20()
    assert mixed.layers[1].compute_dtype == "bfloat16"
    assert mixed.layers[-1].compute_dtype == "float32"


def test_synthetic_cifar_has_cifar_shapes_and_ten_classes():
    dataset = cifar_shaped.synthetic_cifar(num_train=64, num_test=16, seed=1)
    assert dataset.train_x.shape == (64, 32, 32, 3) and dataset.test_x.shape == (16, 32, 32, 3)
    assert dataset.train_x.dtype == np.float32 and 0 <= dataset.train_x.min() <= 1
    assert set(np.unique(dataset.train_y)) <= set(range(10))
    assert "32x32x3" in dataset.source


def test_one_kdist_step_on_two_replicas_changes_weights_and_batch_statistics(trained):
    engine, model, dataset = trained
    before = {v.path: np.array(v) for v in model.variables}
    stats = engine.train_chunk(engine.distribute(chunks.stack_chunk(
        [(dataset.train_x, dataset.train_y, None)])), 1)
    engine.sync_to_model()
    after = {v.path: np.array(v) for v in model.variables}
    moved = {path for path in before if not np.array_equal(before[path], after[path])}
    assert {v.path for v in model.trainable_variables} <= moved
    assert any("moving_mean" in path for path in moved)  # BatchNormalization's state.
    assert float(np.asarray(stats["count"])[0]) == 16.0
    assert np.isfinite(float(np.asarray(stats["loss_sum"])[0]))
