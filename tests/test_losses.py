"""Loss scaling and batch statistics: the math every engine shares."""

import numpy as np
from keras import ops

from kdist import losses


def test_scale_loss_divides_weighted_sum_by_global_batch():
    per_example = ops.convert_to_tensor(np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    weights = np.array([1.0, 1.0, 1.0, 0.0], np.float32)
    # A replica holding 4 of a global batch of 16 contributes sum/16, not mean.
    value = float(losses.scale_loss(per_example, weights, 16))
    assert np.isclose(value, (1 + 2 + 3) / 16)


def test_replica_losses_sum_to_the_global_mean():
    rng = np.random.default_rng(0)
    per_example = rng.uniform(0, 3, 64).astype(np.float32)
    weights = np.ones(64, np.float32)
    shards = [float(losses.scale_loss(ops.convert_to_tensor(p), w, 64))
              for p, w in zip(np.split(per_example, 4), np.split(weights, 4))]
    assert np.isclose(sum(shards), per_example.mean(), rtol=1e-6)


def test_batch_statistics_ignore_zero_weight_padding():
    logits = ops.convert_to_tensor(np.eye(10, dtype=np.float32)[[1, 2, 3, 4]] * 5.0)
    labels = np.array([1, 2, 0, 0], np.int32)  # two right, then a wrong one, then padding
    weights = np.array([1, 1, 1, 0], np.float32)
    per_example = losses.sparse_categorical_crossentropy(labels, logits)
    stats = losses.batch_statistics(labels, logits, per_example, weights)
    expected_loss = float(ops.sum(per_example[:3]))
    assert float(stats["count"]) == 3.0
    assert float(stats["correct"]) == 2.0
    assert np.isclose(float(stats["loss_sum"]), expected_loss, rtol=1e-6)


def test_loss_is_unreduced_so_no_replica_division_applies():
    labels = np.array([3, 7], np.int32)
    logits = ops.zeros((2, 10))
    per_example = losses.sparse_categorical_crossentropy(labels, logits)
    assert tuple(per_example.shape) == (2,)
    np.testing.assert_allclose(np.asarray(per_example), [np.log(10)] * 2, rtol=1e-6)
