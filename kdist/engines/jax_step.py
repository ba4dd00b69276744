"""What runs inside the JAX engine's step: the step primitives, over the values
the step's scope holds (`jax.value_and_grad`, Keras' stateless optimizers)."""

import jax

from kdist.step import context as step_context
from kdist.step.context import StepScope, current_scope, loss_of


class Primitives(step_context.Primitives):
    """`kdist.step.context.Primitives` on JAX: `jax.value_and_grad` over the step's
    state, read through a child scope."""

    applies_in_scope = True  # Optimizers apply statelessly, in the step's scope.

    def value_and_grad(self, context, fn, variables, tensors):
        """Differentiates `fn(*tensors)` with respect to `variables`' values in the
        current scope and `tensors`. What `fn` assigns reaches the current scope.

        Keras reads every variable through the scope, so a variable whose
        value `fn` never read gets None, as TensorFlow's tape gives."""
        parent = current_scope()
        starts = [_current(parent, v) for v in variables]
        found: dict = {}

        def f(values, tensor_values):
            with StepScope(context, zip(variables, values), parent=parent) as child:
                value = fn(*tensor_values)
            overridden = {id(v) for v in variables}
            changed = {k: v for k, v in child.changed().items() if k not in overridden}
            found.update(keys=list(changed), reads=set(child.reads))
            return loss_of(value), (value, list(changed.values()))

        (_, (value, changed)), (var_grads, tensor_grads) = jax.value_and_grad(
            f, argnums=(0, 1), has_aux=True)(starts, list(tensors))
        parent.state_mapping.update(zip(found["keys"], changed))
        var_grads = [g if id(v) in found["reads"] else None
                     for v, g in zip(variables, var_grads)]
        return value, var_grads, list(tensor_grads)

    def mean_over_replicas(self, grads):
        """The program sees the whole global batch: its gradients are already global."""
        return grads

    def replicas_sharing(self):
        return 1  # The program sees the whole global batch.

    def sum_over_shares(self, values):
        return values

    def gather_shares(self, tensors):
        return list(tensors)  # The program's batch is the global batch.

    def apply(self, context, optimizer, apply, grads, variables):
        """Keras' `stateless_apply` on the scope's values; its results become the
        scope's. (A stateful `apply` would assign inside Keras' `ops.cond`
        branches, which JAX cannot trace.)"""
        scope = current_scope()
        targets = optimizer._trainable_variables  # What it was built on, in order.
        given = {id(v): g for v, g in zip(variables or targets, grads)}
        with context.optimizer_applying():
            new_targets, new_state = optimizer.stateless_apply(
                [_current(scope, v) for v in optimizer.variables],
                [given.get(id(v)) for v in targets], [_current(scope, v) for v in targets])
            for variable, value in zip(list(targets) + list(optimizer.variables),
                                       list(new_targets) + list(new_state)):
                variable.assign(value)  # Into the scope.


def _current(scope, variable):
    value = scope.get_current_value(variable)
    return variable.value if value is None else value
