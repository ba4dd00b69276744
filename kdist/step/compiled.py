"""kdist's step for a model compiled for Keras `fit`, written with kdist's public primitives.

It is what `fit` computes: the compiled loss (or your own, `compute_loss=fn`),
the model's losses (regularizers, `add_loss`), the compiled metrics, the
optimizer's loss scaling (`optimizer.scale_loss`, as `fit` applies it: a
`LossScaleOptimizer` under mixed_float16, or `loss_scale_factor`), the results
`model.compute_metrics` returns (its override, if the model has one). An
evaluation scores the model's weights, as `fit`'s validation does, also with
`use_ema=True` (the moving averages replace the weights at the end of
training: `kdist.step.optimizer.finalize_weights`).
`kdist.step.program.Program` runs these two functions for such a model as
it runs a model's own `train_step` and `test_step`.

The loss of a replica is its share's part of the global batch's loss plus
the model's losses (Keras' reductions over the global batch:
`kdist.step.reductions`); `kdist.value_and_grad` averages the gradients over
replicas (`kdist.step.api`), so training equals `fit` on the global batch.
With your own loss, `fn(model, x, y, training) ->
(per-example losses, y_pred)`, the loss is sum(sample weight x loss) / the
batch's rows + the model's losses.
"""

import re

import keras
import numpy as np
from keras import ops
from keras.src.backend import (  # Keras' symbolic call (as fit builds), a prediction's mask.
    compute_output_spec,
    get_keras_mask,
    set_keras_mask,
)
from keras.src.backend.common import global_state  # Keras' name scopes.

from kdist import tree
from kdist.errors import UsageError
from kdist.step import api
from kdist.tree import leaves as data_leaves


def train_step(model, data, compute_loss=None):
    """One optimizer step of `fit`'s math on `data`, (x, y) or (x, y, sample_weight)."""
    x, y, weight = keras.utils.unpack_x_y_sample_weight(data)
    optimizer = model.optimizer

    def loss_fn():
        loss, y_pred = _loss(model, x, y, weight, True, compute_loss)
        return optimizer.scale_loss(loss), loss, y_pred

    (_, loss, y_pred), grads = api.value_and_grad(loss_fn, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)
    return _logs(model, loss, model.compute_metrics(x, y, y_pred, weight))


def test_step(model, data, compute_loss=None):
    """The loss and metrics of `data` in inference mode."""
    x, y, weight = keras.utils.unpack_x_y_sample_weight(data)
    loss, y_pred = _loss(model, x, y, weight, False, compute_loss)
    return _logs(model, loss, model.compute_metrics(x, y, y_pred, weight))


def _loss(model, x, y, weight, training, compute_loss):
    """(the batch's loss, float32, with the model's losses; y_pred)."""
    if compute_loss is None:
        y_pred = model(x, training=training)
        # Keras' own wrapper: without `training` where an override does not take it
        # (written before Keras 3.3, as keras.io's knowledge distillation example is).
        loss = model._compute_loss(x, y, y_pred, weight, training=training)
        if len(ops.shape(loss)) != 0:
            shape = tuple(ops.shape(loss))
            what = ("is one value per example" if shape[:1] == ops.shape(data_leaves(x)[0])[:1]
                    else f"has shape {shape}")  # Not the trial batch's row count.
            raise UsageError(
                f"the model's compiled loss {what}, not one number: give its losses a "
                "reduction other than 'none' (Keras' default is 'sum_over_batch_size'), "
                "or pass compute_loss=fn returning per-example losses")
        return ops.cast(loss, "float32"), y_pred
    returned = compute_loss(model, x, y, training)
    if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
        what = (f"a {type(returned).__name__} of {len(returned)}"
                if isinstance(returned, (tuple, list))
                else "one tensor" if ops.is_tensor(returned) else type(returned).__name__)
        raise UsageError(f"compute_loss returned {what}; return (per-example losses, y_pred): "
                         "kdist weighs and averages the losses itself")
    per_example, y_pred = returned
    per_example = ops.cast(per_example, "float32")
    rows = ops.cast(ops.shape(data_leaves(x)[0])[0], "float32")
    data_sum = ops.sum(per_example if weight is None else
                       per_example * ops.cast(weight, "float32"))
    return data_sum / rows + _total(model.losses), y_pred


def _logs(model, loss, results):
    """What `fit` logs for a step: the results `model.compute_metrics` returns (the
    model's own override, if it has one), the loss first and kdist's own: Keras'
    loss tracker, whose result they include, counts only in Keras' own step."""
    tracker = getattr(model, "_loss_tracker", None)
    return {"loss": loss, **{name: value for name, value in (results or {}).items()
                             if tracker is None or name != tracker.name}}


def _total(losses):
    """The sum of the model's losses (regularizers, `add_loss`), a float32 scalar."""
    return sum((ops.sum(ops.cast(loss, "float32")) for loss in losses), ops.zeros((), "float32"))


def reported_metrics(model, own_step=False):
    """The model's metrics that kdist reports: all but Keras' total-loss tracker,
    which only Keras' own train step updates (kdist reports the loss itself);
    with the model's own train step (`own_step`), all, as `fit` reports them: its
    steps may update the tracker (`metric.update_state(loss)` for each of
    `self.metrics`, as Keras' guides write)."""
    tracker = getattr(model, "_loss_tracker", None)
    return [m for m in model.metrics if own_step or m is not tracker]


def build_metrics(model, x, y, sample_weight=None):
    """Builds the model (if its layers build at their first call), the compiled
    loss and metrics from a few examples, then resets them.

    A model not yet built is built as `fit` builds it: by a symbolic call,
    which assigns nothing (`build_as_fit`). Keras builds the loss and
    metrics at their first call; kdist makes that call eagerly, before
    tracing, so every metric variable exists (in the engine's scope). The
    model's variables are put back after it: a model may assign in its call
    (a counter; a Keras RNN with dropout draws its masks, moving its seed
    state, even outside training), and the first step must start where
    `fit`'s first step starts.
    """
    if not model.compiled:
        raise UsageError("the model is not compiled: call model.compile(optimizer=..., "
                         "loss=..., metrics=[...]) in model_fn, as for fit")
    # Tensors, as `fit` hands a step: a metric function may compute `y_true - y_pred`
    # (on torch, a NumPy array minus a tensor that needs gradients fails).
    x, y, sample_weight = loss_rows(model, (x, y, sample_weight))
    x, y, sample_weight = tree.map_arrays(ops.convert_to_tensor, (x, y, sample_weight))
    kept = [(v, np.array(v.numpy())) for v in model.variables]
    y_pred = call_on_data(model, x)
    if model.loss is not None or type(model).compute_loss is not keras.Model.compute_loss:
        model._compute_loss(x, y, y_pred, sample_weight, training=False)
    model.compute_metrics(x, y, y_pred, sample_weight)
    _check_sums(model, (x, y, y_pred, sample_weight))
    for metric in model.metrics:
        metric.reset_state()
    for variable, value in kept:
        variable.assign(value)


# Keras' own checks of a model's inputs (`InputSpec`, a functional model's inputs).
_INPUT_CHECKS = ("is incompatible with the layer", "but input has incompatible shape",
                 "input tensors. ")


def call_on_data(model, x):
    """`model(x, training=False)`; Keras refusing `x`'s shapes (a model built for
    other inputs) is one UsageError naming the data's inputs and Keras' reason."""
    try:
        return model(x, training=False)
    except ValueError as e:
        reason = next((part.strip() for part in re.sub(r"\x1b\[[0-9;]*m", "", str(e)).split("\n\n")
                       if any(check in part for check in _INPUT_CHECKS)), None)
        if reason is None or isinstance(e, UsageError):
            raise
        inputs = ", ".join(f"{keras.backend.standardize_dtype(a.dtype)} {(None, *a.shape[1:])}"
                           for a in data_leaves(x))
        raise UsageError(f"the model does not take the data's inputs ({inputs}): {reason}; "
                         "build it for inputs of these shapes") from e


def loss_rows(model, batch):
    """`batch` (x, y, sample_weight) as rows to build a step on: its rows repeated
    where Keras' compiled loss could read `y`, one array, as a label per output.

    Keras splits one label array into the model's outputs where it has as many
    rows as the model has outputs (a loss given for one output of several,
    `None` for the others, takes the whole array in `fit`, whose batches are
    larger). Builds `model` as `fit` does (`build_as_fit`).
    """
    x, y, _ = batch
    build_as_fit(model, x)
    if y is None or isinstance(y, (list, tuple, dict)):
        return batch
    outputs = _output_count(model, x)
    rows = len(y)
    count = rows
    while outputs > 1 and outputs in (count, 2 * count):  # (`_check_sums` doubles them.)
        count += 1
    return batch if count == rows else tree.take_rows(batch, np.arange(count) % rows)


def _output_count(model, x):
    """How many arrays `model` returns for `x` (1 if it cannot be called
    symbolically)."""
    spec = _symbolic_call(model, x)
    return 1 if spec is None else len(keras.tree.flatten(spec))


def build_as_fit(model, x):
    """Builds each layer of `model` not yet built as `fit` does, by calling it
    on symbolic inputs shaped as `x` (`compute_output_spec`): the variables
    are created and nothing is assigned. A model that cannot be called
    symbolically is built by the eager call after (which says why if it
    cannot be called at all)."""
    if not all(layer.built for layer in model._flatten_layers()):
        _symbolic_call(model, x)


def _symbolic_call(model, x):
    """`model`'s output spec for inputs shaped as `x`, by a symbolic call; None
    where it cannot be called so."""
    def symbolic(a):  # NumPy's strings (TensorFlow's, read) are Keras' "string".
        dtype = "string" if a.dtype.kind in "OSU" else keras.backend.standardize_dtype(a.dtype)
        return keras.KerasTensor(a.shape, dtype)

    spec = tree.map_arrays(symbolic, x)
    scopes = global_state.get_global_attribute("name_scope_stack", default=[],
                                               set_to_default=True)
    entered = list(scopes)
    try:
        return compute_output_spec(model, spec, training=False)
    except Exception:  # noqa: BLE001 - the eager call raises the model's own error.
        scopes[:] = entered  # A failed symbolic call on TensorFlow leaves its scopes open.
        return None


def _check_sums(model, batch):
    """Refuses a compiled metric whose variables do not add up over examples.

    kdist merges a metric over steps, replicas and workers by summing its
    variables' changes from their reset values, each step starting from
    them. That is exact for a metric whose update adds per-example terms
    (every Keras metric), and wrong for one that reads its own state in
    other ways (a running maximum) or counts batches. Tried on `batch`, (x,
    y, y_pred, sample_weight): the change from the batch twice over, in one
    update, must be twice the batch's (a NaN, which a sum may hold on the
    sample's zero targets, counts as equal to a NaN). (A variable aggregated
    otherwise than by "sum" is refused by `kdist.step.program.Program`.)
    """
    metrics = [m for m in reported_metrics(model)
               if all(getattr(v, "aggregation", "sum") == "sum" for v in m.variables)]
    variables = [v for m in metrics for v in m.variables]
    for metric in metrics:
        metric.reset_state()
    resets = [np.array(v.numpy()) for v in variables]

    def change(data):
        # In a scope, as in a step: no variable is assigned (a TensorFlow
        # strategy's integer sums would be split over its replicas).
        with keras.StatelessScope([(v, ops.convert_to_tensor(r))
                                   for v, r in zip(variables, resets)]) as scope:
            model.compute_metrics(*data)
            return [ops.convert_to_numpy(scope.get_current_value(v)).astype(np.float64)
                    - r.astype(np.float64) for v, r in zip(variables, resets)]

    twice = tuple(tree.map_arrays(_twice, part) for part in batch)
    owners = [m for m in metrics for _ in m.variables]
    for metric, variable, once, both in zip(owners, variables, change(batch), change(twice)):
        if not np.allclose(2 * once, both, rtol=1e-4, atol=1e-6, equal_nan=True):
            name = _owner(metric, variable).name
            raise UsageError(
                f"metric {name!r} does not add up over examples: its variable "
                f"{variable.path!r} changes by {both.ravel()[:3].tolist()} for a batch twice "
                f"over but by {once.ravel()[:3].tolist()} for the batch once; kdist merges "
                "metrics over steps and replicas by summing their variables' changes, so a "
                "metric function must return one value per example (Keras averages them), "
                "not one number for the batch, and a Metric's update must add up over "
                "examples (a running maximum cannot be merged)")


def _owner(metric, variable):
    """The innermost metric of `metric` (compiled metrics hold others, in lists)
    whose variables hold `variable`: the one the user named."""
    for inner in getattr(metric, "_metrics", ()):
        for candidate in inner if isinstance(inner, (list, tuple)) else (inner,):
            if candidate is not None and any(v is variable for v in candidate.variables):
                return _owner(candidate, variable)
    return metric


def _twice(array):
    """`array` twice over along its rows, with its Keras mask (a masked prediction's)."""
    both = ops.concatenate([array, array])
    mask = get_keras_mask(array)
    if mask is not None:
        set_keras_mask(both, ops.concatenate([mask, mask]))
    return both
