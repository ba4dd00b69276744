"""What kdist asks of a Keras optimizer: the one inside a loss-scaling wrapper,
whether a step is skipped, and the variables of its EMA."""

import keras
from keras import ops


def inner_optimizer(optimizer):
    """The optimizer that updates the weights: the one a `LossScaleOptimizer`
    wraps, else `optimizer` itself (clipping, accumulation, EMA live there)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def skipped(optimizer, grads):
    """1.0 (float32) if `optimizer` skips a step with these gradients, else 0.0.

    A `LossScaleOptimizer` skips a step (updates no weight, halves its
    scale) when a gradient is not finite (`check_finite`). `grads` must be
    the gradients summed over every replica, which are the same on each, so
    every replica decides alike. Other optimizers never skip.
    """
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return ops.zeros((), "float32")
    return 1.0 - ops.cast(optimizer.check_finite(grads), "float32")


def ema_variables(optimizer, variables):
    """The optimizer's moving averages of `variables`, or None without `use_ema`.

    An optimizer compiled with `use_ema=True` keeps an exponential moving
    average of every weight as an optimizer variable; Keras' `fit` ends by
    copying them into the model (`optimizer.finalize_variable_values`).
    kdist's engines evaluate with them in place of the trainable weights
    (`kdist.engines.contract.Engine.eval_chunk`), so every evaluation, per
    epoch and of a restored checkpoint, scores the averaged model, while
    training continues from the weights themselves. A checkpoint holds both:
    the weights as the model's, the averages with the optimizer's variables.
    The averages hold zeros until the first train step (Keras' initial
    value), so a model that never trained evaluates with zero trainable weights.
    """
    optimizer = inner_optimizer(optimizer)  # A LossScaleOptimizer's inner one keeps them.
    if optimizer is None or not getattr(optimizer, "use_ema", False):
        return None
    averages = optimizer._model_variables_moving_average
    return [averages[optimizer._get_variable_index(v)] for v in variables]


def finalize_weights(model):
    """Ends training as `fit` does (`optimizer.finalize_variable_values`): with
    `use_ema=True` the model's trainable weights take the optimizer's moving
    averages, so the model in hand is the one every evaluation scored."""
    trainable = model.trainable_weights
    averages = ema_variables(getattr(model, "optimizer", None), trainable)
    for variable, average in zip(trainable, averages or ()):
        variable.assign(average.value)
