"""Loss scaling and batch statistics, shared by both engines.

The one scaling scheme kdist uses: each replica sums its per-example losses
and divides by the GLOBAL batch size; the engines then SUM gradients across
replicas (TF's `apply_gradients` all-reduces with SUM; on JAX the loss is
already the sum over the sharded global batch). Losses are built with
`reduction=None`, so Keras' own division by the replica count inside a TF
strategy never applies on top.
"""

import keras
from keras import ops

STATISTICS = ("loss_sum", "correct", "count")  # The keys of `batch_statistics`.


def sparse_categorical_crossentropy(labels, logits):
    """Per-example cross-entropy from logits, shape (batch,)."""
    return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)


def scale_loss(per_example_loss, sample_weight, global_batch_size):
    """sum(weight * loss) / global batch size: the loss whose gradient replicas sum."""
    weighted = per_example_loss * ops.cast(sample_weight, per_example_loss.dtype)
    return ops.sum(weighted) / ops.cast(global_batch_size, per_example_loss.dtype)


def batch_statistics(labels, logits, per_example_loss, sample_weight):
    """Weighted sums from which epoch metrics are exact ratios.

    Returns a dict of scalars: `loss_sum` (sum of weight * loss), `correct`
    (weighted count of right predictions) and `count` (sum of weights).
    Padding (weight 0) contributes nothing, so any replica count and any
    batch size give the same metrics over a data set.
    """
    weight = ops.cast(sample_weight, "float32")
    predicted = ops.argmax(logits, axis=-1)
    hits = ops.cast(ops.equal(predicted, ops.cast(labels, predicted.dtype)), "float32")
    return {
        "loss_sum": ops.sum(ops.cast(per_example_loss, "float32") * weight),
        "correct": ops.sum(hits * weight),
        "count": ops.sum(weight),
    }


def forward(model_call, batch, global_batch_size, loss_fn, training):
    """Runs the model on one (per-replica or global) batch.

    Returns (scaled loss to differentiate, statistics dict). `model_call`
    maps images to logits; the engines pass a stateful or stateless call.
    """
    images, labels, weights = batch
    logits = model_call(images, training)
    per_example = loss_fn(labels, logits)
    loss = scale_loss(per_example, weights, global_batch_size)
    return loss, batch_statistics(labels, logits, per_example, weights)
