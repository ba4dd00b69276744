"""What a step program refuses, each as one `UsageError` before any training:
a metric kdist cannot merge, a step that calls a framework directly, returns
what kdist cannot average, or changes a variable kdist would not keep.
`kdist.step.program.Program` calls them while it builds."""

import inspect

from keras import ops

from kdist.errors import UsageError


def refuse_unmerged(metric_variables):
    """A metric variable aggregated otherwise than by summing: kdist merges
    metrics over replicas and steps by summing their variables."""
    for variable in metric_variables:
        if getattr(variable, "aggregation", "sum") != "sum":
            raise UsageError(
                f"metric variable {variable.path!r} is aggregated by "
                f"{variable.aggregation!r}; kdist merges metrics over replicas and "
                "steps by summing their variables, as Keras' own metrics declare")


def refuse_unready(metric, error):
    """A metric whose variables Keras makes at its first update (F1Score, R2Score)."""
    raise UsageError(
        f"metric {metric.name!r} ({type(metric).__name__}) has no variables yet "
        f"({error}): Keras makes them at its first update_state; make them where "
        "the model makes the metric: call its update_state once on zeros of the "
        "shapes it takes, then its reset_state()") from error


def refuse_non_scalar_result(name, result):
    """A metric result that is not a number."""
    if len(ops.shape(result)) != 0:
        raise UsageError(
            f"metric {name!r} has a result of shape {tuple(ops.shape(result))}; "
            "kdist reports a number per metric: give it one (F1Score and "
            "FBetaScore: average='macro', 'micro' or 'weighted')")


def refuse_non_scalar_log(phase, name, value):
    """A value the step returns that is neither a scalar nor a metric's result."""
    if value is None or len(ops.shape(value)) != 0:
        what = "as None" if value is None else f"of shape {tuple(ops.shape(value))}"
        raise UsageError(
            f"the {phase}_step returns {name!r} {what}; return scalars (kdist averages "
            "them over examples, replicas and workers) or the results of the model's "
            "metrics")


_GRADIENTS = {"GradientTape", "gradient", "grad", "value_and_grad", "backward", "vjp",
              "zero_grad"}


def refuse_other_arguments(model, names):
    """A model's own step (each of `names`) that cannot be called as `step(data)`,
    as kdist calls it on every backend: the stateless `train_step(self, state,
    data)` that Keras' `fit` calls on JAX, for one."""
    for name in names:
        step = getattr(model, name)
        try:
            inspect.signature(step).bind(None)
        except TypeError:
            raise UsageError(
                f"{type(model).__name__}.{name} takes {inspect.signature(step)}; kdist calls "
                f"{name}(data) on every backend (Keras' fit on JAX calls {name}(state, "
                "data)): write it with keras.ops, kdist.value_and_grad and "
                "optimizer.apply, its state in the model's variables") from None


def refuse_framework_calls(phase, calls, cause=None):
    """A step that called a framework's own function (`portable.watching`); `cause`,
    what the step raised after it, if anything, is chained."""
    if calls:
        function, path, line = calls[0]
        gradients = any(found.rsplit(".", 1)[-1] in _GRADIENTS for found, _, _ in calls)
        raise UsageError(
            f"the {phase}_step calls {function} ({path}:{line}); write a step with "
            "keras, keras.ops and kdist's primitives only, so that it runs on every "
            "backend" + ("; take gradients with kdist.value_and_grad and apply them with "
                         "optimizer.apply" if gradients else "")) from cause


def refuse_outside(phase, context, known):
    """A step that assigned, or applied an optimizer to, a variable whose id is not
    in `known`: kdist keeps (over steps, in checkpoints, in the model it
    returns) only those, and on JAX an assignment to another would be dropped
    at each step."""
    for doing, found in (("assigns", context.assigned),
                         ("applies an optimizer to", context.applied_to)):
        outside = [v for key, v in found.items() if key not in known]
        if outside:
            raise UsageError(
                f"the {phase}_step {doing} {outside[0].path!r}, a variable the model "
                "does not hold: kdist keeps, averages and checkpoints the variables of "
                "the model, its layers and sub-models, its optimizers and metrics (as "
                "its attributes) only; make whatever holds it an attribute of the model")


def refuse_overwritten(context, shares):
    """A step whose replicas each run on a share of the batch and that
    differentiates a variable whose "gradient" is its next value (Keras'
    `overwrite_with_gradient`: float8 training's scales and amax histories):
    each replica's comes from its own share, and no average of them is the
    global batch's (the largest magnitude in it)."""
    overwritten = list(context.overwritten.values())
    if overwritten and shares > 1:
        paths = ", ".join(v.path for v in overwritten[:2])
        more = f" and {len(overwritten) - 2} more" if len(overwritten) > 2 else ""
        raise UsageError(
            f"{paths}{more} take their gradient as their next value (float8 training's "
            f"scales and amax histories); {shares} replicas each compute it from their own "
            "share of the batch, which kdist cannot combine into the global batch's: train "
            "float8 on one replica, or on JAX")
