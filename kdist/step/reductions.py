"""Keras' loss reductions over the global batch where each replica holds a share of it.

Keras reduces a loss over the batch its call sees (`keras.src.losses.loss`):
"sum" adds the entries' losses; "sum_over_batch_size" (and "mean") divides
that sum by the number of entries, or, where the predictions carry a mask,
by the number of valid ones (`apply_mask` weighs each valid entry
total / valid); "mean_with_sample_weight" divides it by the sum of the
sample weights. On one device the batch is the global batch.

Where R replicas each hold an equal, disjoint share of the global batch
(TensorFlow's replicas, torch's processes), kdist averages their losses and
gradients (`kdist.step.api`). So a replica's loss must be R times its share
of the global batch's loss: its sum times R ("sum", of values with a row per
example of the replica's batch: a sum over anything else, such as a kernel,
is the same on every replica and stays as it is), its weighted sum over
the global batch's valid entries or sample weights, which the replicas sum
(`Primitives.sum_over_shares`: one all-reduce of the counts, which carry no
gradient). A mean over all entries without a mask needs nothing: every
share has the same size.

A loss whose values are not one per example of a batch its predictions
have a row per example of (Dice or Tversky over `axis=None`,
`CosineSimilarity(axis=0)`, a function returning one number for its batch) is
a statistic of the whole batch, which no sum of shares gives. There each
replica computes it on the global batch, gathered (`Primitives.gather_shares`,
an all-gather whose gradient gives a replica's own rows the sum of every
replica's gradient for them, R times one's): the average over replicas is then
one device's gradient, and the value one device's.

Where one program sees the whole batch (JAX, or a batch every replica
evaluates whole), and inside a `value_and_grad` with respect to tensors only
(whose gradients are each example's own, not averaged), Keras' own functions
run unchanged.
"""

from collections.abc import Callable
from typing import Any

from keras import ops, tree
from keras.src.backend.common import masking
from keras.src.losses import loss as loss_module  # The reductions replaced here.

from kdist.runtime import patches
from kdist.step import context as step_context

_KERAS: dict[str, Callable[..., Any]] = {
    "apply_mask": loss_module.apply_mask, "reduce_values": loss_module.reduce_values,
    "reduce_weighted_values": loss_module.reduce_weighted_values}
_KERAS_CALL = loss_module.Loss.__call__


def over_global_batch():
    """Keras' losses reduce over the global batch while a step runs (on any thread:
    `kdist.runtime.patches`)."""
    return _PATCH.active()


def _loss_call(self, y_true, y_pred, sample_weight=None):
    """Keras' `Loss.__call__`, its arguments kept on the context meanwhile: a
    reduction of values that are not one per example computes them again over
    the gathered global batch (`_reduce_values`)."""
    context = _shares()
    if context is None:
        return _KERAS_CALL(self, y_true, y_pred, sample_weight)
    context.loss_calls.append((self, y_true, y_pred, sample_weight))
    try:
        return _KERAS_CALL(self, y_true, y_pred, sample_weight)
    finally:
        context.loss_calls.pop()


def _shares():
    """The context of a running step whose batch R > 1 replicas share, outside a
    `value_and_grad` with respect to tensors only; else None."""
    context = step_context.active_or_none()
    if (context is None or context.dry or context.own_rows
            or context.primitives.replicas_sharing() == 1):
        return None
    return context


def _apply_mask(sample_weight, mask, dtype, reduction):
    context = _shares()
    if context is None or mask is None or reduction not in ("mean", "sum_over_batch_size"):
        return _KERAS["apply_mask"](sample_weight, mask, dtype, reduction)
    primitives = context.primitives
    # Keras' weights, total / valid for a valid entry, with the global batch's counts.
    total = ops.cast(ops.prod(ops.convert_to_tensor(ops.shape(mask), dtype="int32")), dtype)
    valid = ops.sum(ops.cast(mask, dtype=dtype))
    total, valid = primitives.sum_over_shares([total, ops.stop_gradient(valid)])
    weighted = ops.where(ops.cast(mask, "bool"), ops.divide_no_nan(total, valid), 0)
    return _KERAS["apply_mask"](sample_weight, ops.cast(weighted, dtype), dtype, "sum")


def _reduce_weighted_values(values, sample_weight=None, mask=None,
                            reduction="sum_over_batch_size", dtype=None):
    """Keras' reduction of a loss's values (`Loss.__call__` calls it); values that
    are a statistic of the batch, over the gathered global batch."""
    context = _shares()
    if context is not None and context.loss_calls and _of_the_batch(
            values, context.loss_calls[-1][2], context.rows):
        return _over_gathered_batch(context, *context.loss_calls[-1])
    return _KERAS["reduce_weighted_values"](values, sample_weight, mask, reduction, dtype)


def _reduce_values(values, sample_weight=None, reduction="sum_over_batch_size"):
    context = _shares()
    primitives = None if context is None else context.primitives
    if primitives is not None and reduction == "mean_with_sample_weight" and (
            sample_weight is not None and tuple(values.shape) not in ((), (0,))):
        loss = ops.sum(values)
        local = ops.stop_gradient(ops.cast(ops.sum(sample_weight), loss.dtype))
        (total,) = primitives.sum_over_shares([local])
        replicas = ops.cast(primitives.replicas_sharing(), loss.dtype)
        return ops.divide_no_nan(loss, total / replicas)
    loss = _KERAS["reduce_values"](values, sample_weight, reduction)
    if (primitives is not None and reduction == "sum" and len(values.shape)
            and values.shape[0] == context.rows):  # A row per example: the share's sum.
        return loss * ops.cast(primitives.replicas_sharing(), loss.dtype)
    return loss


def _of_the_batch(values, y_pred, rows):
    """Whether `values` are a statistic of the batch: not one per example, of
    predictions that have a row per example of the batch of `rows`."""
    per_example = len(values.shape) and values.shape[0] == rows
    leaves = tree.flatten(y_pred)
    return not per_example and bool(leaves) and all(
        len(leaf.shape) and leaf.shape[0] == rows for leaf in leaves)


def _over_gathered_batch(context, loss, y_true, y_pred, sample_weight):
    """`loss` of the global batch, gathered from the replicas' shares: every replica
    computes it, and the gather's gradient gives this replica's rows the sum of
    the replicas' gradients for them, R times one's."""
    rows, mask = context.rows, masking.get_keras_mask(y_pred)
    extras = [t for t in (sample_weight, mask) if _has_rows(t, rows)]
    trues, preds = tree.flatten(y_true), tree.flatten(y_pred)
    whole = context.primitives.gather_shares(trues + preds + extras)
    y_true = tree.pack_sequence_as(y_true, whole[:len(trues)])
    y_pred = tree.pack_sequence_as(y_pred, whole[len(trues):len(trues) + len(preds)])
    gathered = dict(zip(map(id, extras), whole[len(trues) + len(preds):]))
    if mask is not None:
        masking.set_keras_mask(y_pred, gathered.get(id(mask), mask))
    context.own_rows += 1  # Keras' reductions, unchanged, over the gathered batch.
    try:
        return _KERAS_CALL(loss, y_true, y_pred, gathered.get(id(sample_weight), sample_weight))
    finally:
        context.own_rows -= 1


def _has_rows(value, rows):
    return value is not None and len(value.shape) > 0 and value.shape[0] == rows


_PATCH = patches.Patch([
    (loss_module, "apply_mask", _apply_mask), (loss_module, "reduce_values", _reduce_values),
    (loss_module, "reduce_weighted_values", _reduce_weighted_values),
    (loss_module.Loss, "__call__", _loss_call)])
