"""What runs inside the JAX engine's step: the step primitives, over the values
the step's scope holds (`jax.value_and_grad`, Keras' stateless optimizers)."""

import contextlib
import re

import jax

from kdist.errors import UsageError
from kdist.step import context as step_context
from kdist.step.context import StepScope, current_scope, loss_of


class Primitives(step_context.Primitives):
    """`kdist.step.context.Primitives` on JAX: `jax.value_and_grad` over the step's
    state, read through a child scope."""

    applies_in_scope = True  # Optimizers apply statelessly, in the step's scope.

    def value_and_grad(self, context, fn, variables, tensors, scale):
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
            return loss_of(value, scale), (value, list(changed.values()))

        (_, (value, changed)), (var_grads, tensor_grads) = jax.value_and_grad(
            f, argnums=(0, 1), has_aux=True)(starts, list(tensors))
        parent.state_mapping.update(zip(found["keys"], changed))
        var_grads = [g if id(v) in found["reads"] else None
                     for v, g in zip(variables, var_grads)]
        return value, var_grads, list(tensor_grads)

    def sum_over_replicas(self, grads):
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


@contextlib.contextmanager
def traced_as_keras_allows(model):
    """Around a step's trace by `jax.jit`: an error there, in a model holding layers
    Keras marks as not compilable (`supports_jit=False`, as `RandomCrop`,
    whose offsets slice with traced numbers), is a `UsageError` naming them.
    Keras' `fit` runs such a model without jit on JAX; kdist's JAX engine
    compiles every step. Other errors pass as they are."""
    try:
        yield
    except Exception as e:
        layers = [f"{type(layer).__name__} {layer.name!r}" for layer in model._flatten_layers()
                  if not getattr(layer, "supports_jit", True)]
        if not layers:
            raise
        said = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).split("Arguments received")[0]
        said = " ".join(line.strip() for line in said.splitlines() if line.strip())
        raise UsageError(
            f"the step could not be compiled by jax.jit ({type(e).__name__}: {said:.200}); "
            f"the model holds layers Keras marks as not compilable (supports_jit=False): "
            f"{', '.join(layers)}. kdist compiles every step on JAX, where Keras' fit runs "
            "such a model without jit: apply the layer in the input pipeline, or train on "
            "TensorFlow or torch") from e
