"""How the TensorFlow engine has Keras' optimizer apply gradients summed over replicas.

Keras' TensorFlow optimizer is written for its own train step: it sums
gradients over replicas inside `apply`, and chooses between updates with a
`tf.cond` that MirroredStrategy refuses. kdist's engine calls `apply` with
gradients it has already summed, so these two adjustments make the
optimizer do, on every replica alike, what one device would do with the
global gradient. Both replace methods of the one optimizer instance.
"""

import tensorflow as tf
from keras import ops

from kdist.step.optimizer import inner_optimizer, updating_optimizers


def apply_reduced(optimizer):
    """Makes `optimizer.apply` take gradients already summed over replicas.

    Keras' TensorFlow optimizer sums the gradients over replicas inside
    `apply`, after clipping each replica's own (so `clipnorm` would clip
    the wrong norm); kdist sums first and turns that sum off here, so
    clipping, accumulation and the update all see the global gradient.

    A `LossScaleOptimizer` (mixed_float16) unscales the gradients and hands
    them to the optimizer it wraps, and a `MultiOptimizer` its share to each
    of its optimizers, whose `apply` would sum them: the sum is turned off on
    every one (`updating_optimizers`).
    """
    every = [optimizer, inner_optimizer(optimizer)] + updating_optimizers(optimizer)
    for each in {id(o): o for o in every}.values():
        if not hasattr(each, "_all_reduce_sum_gradients"):
            raise RuntimeError("this Keras version's TensorFlow optimizer has no "
                               "_all_reduce_sum_gradients; kdist cannot apply summed "
                               "gradients")
        each._all_reduce_sum_gradients = lambda grads_and_vars: grads_and_vars


def apply_without_cond(optimizer):
    """Makes the optimizer's conditional steps run without `tf.cond` in a replica.

    With `gradient_accumulation_steps` or `ema_overwrite_frequency`, Keras'
    TensorFlow optimizer chooses between two updates with `ops.cond`, and
    its updates inside the branches call `merge_call`, which TensorFlow
    refuses inside a control-flow branch of a replica function, so such an
    optimizer fails under any MirroredStrategy (keras-team/keras#20582).
    Here both are computed and the result selected, as Keras' own JAX
    optimizer does (`keras/src/backend/jax/optimizer.py`): the update runs
    on every step, and on a step that only accumulates, the variables it
    changed get their previous values back. The values are those of Keras'
    `_backend_apply_gradients`; the same code runs with one replica or many.
    With a `LossScaleOptimizer` this applies to the optimizer it wraps, with a
    `MultiOptimizer` to each of its optimizers: those hold these settings.
    """
    for each in updating_optimizers(optimizer):
        _select_without_cond(each)


def _select_without_cond(optimizer):
    accumulate = optimizer.gradient_accumulation_steps
    overwrite = optimizer.use_ema and optimizer.ema_overwrite_frequency
    if not (accumulate or overwrite):
        return

    def backend_apply_gradients(grads, trainable_variables):
        if accumulate:
            is_update_step = ops.equal((optimizer._iterations + 1) % accumulate, 0)
            accumulators = [optimizer._accumulated_gradients[optimizer._get_variable_index(v)]
                            for v in trainable_variables]
            fixed = [optimizer._iterations, optimizer._learning_rate] + accumulators
            restored = [v for v in list(trainable_variables) + optimizer.variables
                        if not any(v is f for f in fixed)]
            # Reads now (`ops.convert_to_tensor` would return the variables themselves).
            before = [tf.identity(v.value) for v in restored]
            summed = [g + tf.identity(a.value) for g, a in zip(grads, accumulators)]
            grads = optimizer._clip_gradients([g / accumulate for g in summed])
            optimizer._apply_weight_decay(trainable_variables)
            optimizer._backend_update_step(grads, trainable_variables, optimizer.learning_rate)
            for variable, old in zip(restored, before):
                variable.assign(ops.where(is_update_step, variable, old))
            for accumulator, total in zip(accumulators, summed):
                accumulator.assign(ops.where(is_update_step, ops.zeros_like(total), total))
        else:
            grads = optimizer._clip_gradients(grads)
            optimizer._apply_weight_decay(trainable_variables)
            optimizer._backend_update_step(grads, trainable_variables, optimizer.learning_rate)
        if optimizer.use_ema:
            optimizer._update_model_variables_moving_average(optimizer._trainable_variables)
            if overwrite:
                due = ops.equal((optimizer.iterations + 1) % overwrite, 0)
                for variable, average in zip(optimizer._trainable_variables,
                                             optimizer._model_variables_moving_average):
                    variable.assign(ops.where(due, average, variable))

    optimizer._backend_apply_gradients = backend_apply_gradients
