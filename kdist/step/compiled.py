"""One step's math, written once for every backend: the loss, its scaling, the metrics.

A `Step` turns a model compiled for Keras `fit` (optimizer, loss, metrics,
`loss_weights`, the model's own `compute_loss` / `compute_metrics`) into a
pure function of the variables' values and a batch, which every engine
calls: `loss_and_updates(trainable, non_trainable, batch, training)`. It runs
inside one `keras.StatelessScope`, so nothing is assigned while it traces;
the engine differentiates the loss and applies what it returns.

The loss scaling rule, for every engine: a program that sees a fraction
`share` of the global batch (TensorFlow: one replica, 1/R of it; JAX: the
whole sharded batch, 1; torch: one process, 1/R) differentiates its share
of the global-batch loss, and the engine SUMS gradients over programs.
That share is:

- with the compiled loss (`model.compute_loss`): what Keras computes, the
  mean over the batch it sees (reduction "sum_over_batch_size") plus the
  model's losses (regularizers, `add_loss`), times `share`: inside a
  TensorFlow replica Keras itself divides both by the replica count (the
  engine passes `keras_share`); elsewhere the step does. So kdist equals
  `fit`.
- with your own loss (`compute_loss=fn`, `fn(model, x, y, training) ->
  (per-example losses, y_pred)`): kdist computes sum(sample weight x loss)
  / GLOBAL batch + share x the model's losses.

Loss scaling for mixed precision (`kdist.precision`; the optimizer's side in
`kdist.step.optimizer`): when the optimizer scales the loss (a
`keras.optimizers.LossScaleOptimizer`, which Keras' `compile` puts around the
optimizer of a mixed_float16 model, or an optimizer with `loss_scale_factor`),
the engine passes `loss_scale(optimizer)` and the step differentiates its loss
times that factor, as Keras' `optimizer.scale_loss` does in `fit`. The engine
sums the scaled gradients over programs; the optimizer divides the sum by the
scale and, with a `LossScaleOptimizer`, skips a step whose summed gradients are
not finite, on every replica alike (`skipped`). Statistics stay unscaled.

Statistics come back per step as a dict of arrays, summed over programs by
the engine and over steps by the loop (`kdist.loop.chunks`): `loss_sum` (the
loss times the examples it is the mean of), `count` (the examples),
`skipped` (1 for a train step the optimizer skipped, counted once however
many programs ran it; 0 otherwise) and one entry per metric variable, the
change the batch made to it from its reset value. Keras metrics merge by
summing their variables (their declared `aggregation`), so the sum of the
changes over replicas, workers and steps is the state one metric would
hold after seeing every example once; `Step.results` reads it through the
metrics' own `result()`.
"""

import keras
import numpy as np
from keras import ops

from kdist.errors import UsageError
from kdist.tree import leaves as data_leaves

LOSS_KEYS = ("loss_sum", "count", "skipped")


def metric_key(index):
    return f"metric_{index:03d}"


class Step:
    """The pure step function of a compiled model.

    Args:
        model: a Keras model compiled with an optimizer (or none, to only
            evaluate) and a loss unless `compute_loss` is given.
        global_batch_size: the examples of one global batch.
        compute_loss: None, or `fn(model, x, y, training) -> (per-example
            losses of shape (batch,), y_pred)`, written with `keras.ops`.
    """

    def __init__(self, model, global_batch_size, compute_loss=None):
        self.model = model
        self.global_batch_size = global_batch_size
        self.compute_loss = compute_loss
        self.metrics = reported_metrics(model)
        self.metric_variables = [v for m in self.metrics for v in m.variables]
        for variable in self.metric_variables:
            if getattr(variable, "aggregation", "sum") != "sum":
                raise UsageError(
                    f"metric variable {variable.path!r} is aggregated by "
                    f"{variable.aggregation!r}; kdist merges metrics over replicas and "
                    "steps by summing their variables, as Keras' own metrics declare")
        self.reset_values = [np.array(v.numpy())
                             for v in self.metric_variables]
        self.keys = LOSS_KEYS + tuple(metric_key(i) for i in range(len(self.metric_variables)))

    def loss_and_updates(self, trainable, non_trainable, batch, training, share=1.0,
                         loss_scale=None, keras_share=1.0):
        """(loss to differentiate, (statistics, new non-trainable values)).

        `batch` is (x, y, sample_weight), every example real (evaluation
        never pads: `kdist.loop.chunks.evaluate`); `sample_weight` is the user's
        (None: all 1). `share` is the fraction of the global batch this
        program sees (1/replicas inside a TensorFlow replica, 1 on JAX).
        `loss_scale` (`loss_scale(optimizer)`, None: 1) multiplies the loss
        to differentiate, not the statistics. `keras_share` is the share
        that the compiled loss has already divided itself by: `share` inside
        a tf.distribute replica (Keras' `scale_loss_for_distribution`), 1
        elsewhere; the step applies the rest of `share`. The statistics' `skipped` is
        0: whether the optimizer skips the step is known only after the
        gradients are summed (`skipped`), so the engine sets it.
        """
        model = self.model
        x, y, weight = batch
        rows = ops.cast(ops.shape(data_leaves(x)[0])[0], "float32")
        mapping = (list(zip(model.trainable_variables, trainable))
                   + list(zip(model.non_trainable_variables, non_trainable))
                   + [(v, ops.convert_to_tensor(r))
                      for v, r in zip(self.metric_variables, self.reset_values)])
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            before = [scope.get_current_value(v) for v in model.non_trainable_variables]
            if self.compute_loss is None:
                y_pred = model(x, training=training)
                loss = model.compute_loss(x, y, y_pred, weight, training=training)
                model_losses = _total(model.losses)
                # Keras' mean over this batch, undone: the weighted sum it averages.
                data_sum = (ops.cast(loss, "float32") / keras_share - model_losses) * rows
                if keras_share != share:  # The share Keras did not apply.
                    loss = ops.cast(loss, "float32") * (share / keras_share)
            else:
                per_example, y_pred = self.compute_loss(model, x, y, training)
                per_example = ops.cast(per_example, "float32")
                model_losses = _total(model.losses)
                data_sum = ops.sum(per_example if weight is None else
                                   per_example * ops.cast(weight, "float32"))
                loss = data_sum / self.global_batch_size + share * model_losses
            model.compute_metrics(x, y, y_pred, weight)
        stats = {"loss_sum": data_sum + model_losses * rows, "count": rows,
                 "skipped": ops.zeros((), "float32")}
        for i, (variable, reset) in enumerate(zip(self.metric_variables, self.reset_values)):
            value = scope.get_current_value(variable)
            stats[metric_key(i)] = (ops.cast(value, "float32")
                                    - ops.convert_to_tensor(reset, "float32"))
        # None where the step assigned nothing (frozen weights): engines skip those.
        new_non_trainable = [None if new is old else new for new, old in zip(
            (scope.get_current_value(v) for v in model.non_trainable_variables), before)]
        if loss_scale is not None:
            loss = ops.cast(loss, "float32") * loss_scale
        return loss, (stats, new_non_trainable)

    def results(self, totals):
        """{"loss": mean loss, then each metric's Keras result by its name} of summed
        statistics (`kdist.loop.chunks`), through the metrics' own `result()`."""
        results = {"loss": float(totals["loss_sum"]) / float(totals["count"])}
        mapping = [(v, (reset + np.asarray(totals[metric_key(i)])).astype(reset.dtype))
                   for i, (v, reset) in enumerate(zip(self.metric_variables, self.reset_values))]
        with keras.StatelessScope(state_mapping=mapping):  # Reads these; assigns nothing.
            for metric in self.metrics:
                value = metric.result()
                values = value if isinstance(value, dict) else {metric.name: value}
                results.update({k: float(np.asarray(keras.ops.convert_to_numpy(v)))
                                for k, v in values.items()})
        return results

    def metric_names(self):
        """"loss", then the names of the metrics' results, as `results` gives them."""
        names = ["loss"]
        for metric in self.metrics:
            value = metric.result()
            names += list(value) if isinstance(value, dict) else [metric.name]
        return names

    def statistic_shapes(self):
        """{key: shape} of the statistics a step returns (`keys`, in order)."""
        shapes = [()] * len(LOSS_KEYS) + [np.shape(r) for r in self.reset_values]
        return dict(zip(self.keys, shapes))

    def zero_statistics(self):
        """Statistics of a step that counts nothing (a skipped padding step)."""
        return {key: ops.zeros(shape, "float32") for key, shape in self.statistic_shapes().items()}


def _total(losses):
    """The sum of the model's losses (regularizers, `add_loss`), a float32 scalar."""
    return sum((ops.sum(ops.cast(loss, "float32")) for loss in losses), ops.zeros((), "float32"))


def reported_metrics(model):
    """The model's metrics that kdist reports: all but Keras' total-loss tracker,
    which only Keras' own train step updates (kdist reports the loss itself)."""
    tracker = getattr(model, "_loss_tracker", None)
    return [m for m in model.metrics if m is not tracker]


def build_metrics(model, x, y, sample_weight=None):
    """Builds the compiled loss and metrics from a few examples, then resets them.

    Keras builds them at their first call; kdist makes that call eagerly,
    before tracing, so every metric variable exists (in the engine's scope).
    """
    if not model.compiled:
        raise UsageError("the model is not compiled: call model.compile(optimizer=..., "
                         "loss=..., metrics=[...]) in model_fn, as for fit")
    y_pred = model(x, training=False)
    if model.loss is not None or type(model).compute_loss is not keras.Model.compute_loss:
        model.compute_loss(x, y, y_pred, sample_weight, training=False)
    model.compute_metrics(x, y, y_pred, sample_weight)
    for metric in model.metrics:
        metric.reset_state()
