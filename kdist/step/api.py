"""The gradient primitives of a step written once for every backend.

Inside a `train_step` (or `test_step`) that kdist runs, with `keras.ops` only:

    loss, grads = kdist.value_and_grad(loss_fn, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)

The scaling rule: gradients with respect to variables are averaged over
every replica of every worker. A step computes its losses on the batch its
replica sees, as on one device; for a loss that is a mean over that batch
(Keras' losses, `keras.ops.mean`), the average over R replicas of equal
batches is the gradient one device computes on the whole global batch.
Each replica differentiates its loss divided by R, and the replicas' gradients
are summed: so what a gradient passes through inside the loss (the upstream
gradient a `keras.ops.custom_gradient` clips, the gradient of an input
differentiated with the variables) is one device's too. Gradients with
respect to tensors alone (an input, for a gradient penalty) are each
replica's own, one per example, and can be nested inside the loss of an
outer `value_and_grad`.
"""

from typing import Any

import keras

from kdist.errors import UsageError
from kdist.step import context as step_context


def value_and_grad(fn: Any, wrt: Any) -> tuple[Any, Any]:
    """(what `fn` returns, the gradients of its loss with respect to `wrt`).

    Args:
        fn: returns the loss, a scalar, or a tuple whose first item is the
            loss and the rest anything to take along (predictions...). It
            is called with the tensors among `wrt`, in order, as its
            arguments; variables are read through the layers that hold them.
        wrt: a `keras.Variable` or tensor, or a list or tuple of them.

    Returns the gradients in the structure of `wrt`. A variable's gradient
    is averaged over replicas and workers (the module's scaling rule), or
    None where the loss does not read the variable (as
    `tf.GradientTape.gradient`; `optimizer.apply` skips it; on JAX a variable
    read only under `keras.ops.stop_gradient` gets zeros). A loss that
    reads none of the variables, or does not depend on a tensor named, is a
    `UsageError`.
    """
    context = step_context.current()
    items = list(wrt) if isinstance(wrt, (list, tuple)) else [wrt]
    if not items:
        raise UsageError("kdist.value_and_grad with respect to nothing (an empty list): a "
                         "layer has variables once it is built; build the model in model_fn "
                         "(call it on a batch, or layer.build(input_shape)) before a step "
                         "reads its trainable_variables")
    is_variable = [isinstance(item, keras.Variable) for item in items]
    variables = [item for item, var in zip(items, is_variable) if var]
    tensors = [item for item, var in zip(items, is_variable) if not var]
    if variables and context.depth:
        raise UsageError("kdist.value_and_grad with respect to variables inside the loss of "
                         "another value_and_grad; nest gradients with respect to tensors "
                         "only (a gradient penalty's input)")
    if variables and context.control_flow:
        context.refusal = UsageError(
            "kdist.value_and_grad with respect to variables inside keras.ops.cond (or "
            "another control-flow op): their gradients are summed over the replicas, which "
            "TensorFlow's strategies cannot do from a branch or loop; take them at the "
            "step's top level and choose with them there, e.g. keras.ops.where (gradients "
            "with respect to tensors alone work inside)")
        raise context.refusal
    own_rows = not variables  # Each example's gradient is its own.
    # The replicas' sum of their shares' gradients is one device's (the module's rule).
    shares = 1 if own_rows or context.dry else context.primitives.replicas_sharing()
    context.depth += 1
    context.own_rows += own_rows
    try:
        value, var_grads, tensor_grads = context.primitives.value_and_grad(
            context, fn, variables, tensors, 1 / shares)
    finally:
        context.depth -= 1
        context.own_rows -= own_rows
    if variables and all(g is None for g in var_grads):
        raise UsageError("the loss given to kdist.value_and_grad reads none of the variables "
                         f"it is differentiated with respect to ({_names(variables)}); pass "
                         "the variables of the model that computes it")
    if any(g is None for g in tensor_grads):
        raise UsageError("the loss given to kdist.value_and_grad does not depend on a tensor "
                         "it is differentiated with respect to; pass that tensor to the "
                         "model inside the function, as its argument")
    if variables and context.dry:  # What `Program.build` checks.
        context.overwritten.update({id(v): v for v, g in zip(variables, var_grads)
                                    if g is not None and getattr(v, "overwrite_with_gradient",
                                                                 False)})
    if variables and not context.dry:
        var_grads = context.primitives.sum_over_replicas(var_grads)
    var_iter, tensor_iter = iter(var_grads), iter(tensor_grads)
    grads = [next(var_iter) if var else next(tensor_iter) for var in is_variable]
    if isinstance(wrt, (list, tuple)):
        return value, type(wrt)(grads)
    return value, grads[0]


def grad(fn: Any, wrt: Any) -> Any:
    """The gradients of `value_and_grad(fn, wrt)`, without the value."""
    return value_and_grad(fn, wrt)[1]


def global_batch(x: Any) -> Any:
    """`x` over the whole global batch: every replica's rows, in the global batch's
    order, on every replica, as one device's step would see them.

    For what needs every example of the step: a contrastive loss whose negatives
    are the whole batch's, a queue of every replica's keys (MoCo). On JAX, whose
    one program sees the global batch, it is `x`. Differentiable: a replica's
    own rows get the sum of every replica's gradient for them, so the gradients
    `value_and_grad` averages are one device's (the module's scaling rule),
    whether every replica computes a loss of the whole batch or each the loss of
    its own rows against the whole batch's.

    Args:
        x: a tensor, or a list, tuple or dict of them, each with a row per
            example of the batch the step sees.
    """
    context = step_context.current()
    leaves = keras.tree.flatten(x)
    for leaf in leaves:
        rows = leaf.shape[0] if len(leaf.shape) else None
        if rows is not None and context.rows is not None and rows != context.rows:
            raise UsageError(f"kdist.global_batch takes a row per example of the step's batch "
                             f"({context.rows} rows); got a tensor of shape {tuple(leaf.shape)}")
    if context.dry or context.primitives.replicas_sharing() == 1:
        return x
    return keras.tree.pack_sequence_as(x, context.primitives.gather_shares(leaves))


def _names(variables):
    names = [v.path for v in variables[:3]]
    return ", ".join(names) + (f" and {len(variables) - 3} more" if len(variables) > 3 else "")
