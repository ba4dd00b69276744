"""What kdist asks of a Keras optimizer: the ones a model holds, its `apply` routed
through kdist's step, the one inside a loss-scaling wrapper, whether a step is
skipped, and the variables of its EMA."""

import contextlib

import keras
from keras import ops
from keras.src.ops import core as keras_core
from keras.src.optimizers.base_optimizer import BaseOptimizer  # Defines every `apply`.

from kdist.errors import UsageError
from kdist.step import context as step_context


def inner_optimizer(optimizer):
    """The optimizer that updates the weights: the one a `LossScaleOptimizer`
    wraps, else `optimizer` itself (clipping, accumulation, EMA live there)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def updating_optimizers(optimizer):
    """The optimizers whose `apply` updates weights when `optimizer` applies: the
    one a `LossScaleOptimizer` wraps, each one a `keras.optimizers.MultiOptimizer`
    dispatches to, else `optimizer` itself."""
    inner = inner_optimizer(optimizer)
    if isinstance(inner, keras.optimizers.MultiOptimizer):
        return [o for sub in inner._inner_optimizers for o in updating_optimizers(sub)]
    return [inner]


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
    average of every weight as an optimizer variable; Keras' `fit` validates
    each epoch with the weights and ends by copying the averages into the
    model (`optimizer.finalize_variable_values`), and so does kdist
    (`finalize_weights`: the model in hand, and a restored checkpoint's
    evaluation). A checkpoint holds both: the weights as the model's, the
    averages with the optimizer's variables. The averages hold zeros until
    the first train step (Keras' initial value), so a model that never
    trained ends with zero trainable weights, as with `fit`.
    """
    optimizer = inner_optimizer(optimizer)  # A LossScaleOptimizer's inner one keeps them.
    if optimizer is None or not getattr(optimizer, "use_ema", False):
        return None
    averages = optimizer._model_variables_moving_average
    return [averages[optimizer._get_variable_index(v)] for v in variables]


def finalize_weights(model):
    """Ends training as `fit` does (`optimizer.finalize_variable_values`): with
    `use_ema=True` the model's trainable weights take the optimizer's moving
    averages (the model in hand, and a restored checkpoint's evaluation); a
    `MultiOptimizer`'s, each of its optimizers' averages of the weights it updates."""
    if getattr(model, "optimizer", None) is None:
        return
    for optimizer in updating_optimizers(model.optimizer):  # A MultiOptimizer's each.
        if optimizer.built:
            updated = {id(v) for v in optimizer._trainable_variables}
            mine = [v for v in model.trainable_weights if id(v) in updated]
            for variable, average in zip(mine, ema_variables(optimizer, mine) or ()):
                variable.assign(average.value)


def learning_rates(optimizers):
    """The learning-rate variables of `optimizers` (those with a schedule have none:
    their rate follows their step count)."""
    rates = [getattr(inner_optimizer(o), "_learning_rate", None) for o in optimizers]
    return [r for r in rates if isinstance(r, keras.Variable)]


def held_by(model):
    """The model's optimizers: the compiled one and any held as an attribute, or in a
    list or dict attribute."""
    found = [model.optimizer] if getattr(model, "optimizer", None) is not None else []
    for value in vars(model).values():
        found += _optimizers_in(value)
    return list({id(o): o for o in found}.values())


def refuse_nested(model, found):
    """Makes each optimizer held inside a sub-model or layer, not by the model
    (`held_by` does not look there), raise `UsageError` when a step kdist
    runs applies it: kdist applies (and checkpoints) only the optimizers it
    found, and another would update the weights outside the engine, in the
    building run too. Outside kdist's steps it works as before, and one no
    step applies (a trained teacher's) is no error."""
    known = {id(o) for o in found}
    for layer in model._flatten_layers(include_self=False):
        named: dict = {}  # The first name of each, public names first.
        for name, value in sorted(vars(layer).items(), key=lambda item: item[0].startswith("_")):
            for optimizer in _optimizers_in(value):
                named.setdefault(id(optimizer), (name, optimizer))
        for name, optimizer in named.values():
            if id(optimizer) not in known and not hasattr(optimizer, "_kdist_apply"):
                _refuse_apply(optimizer, f"{layer.name}.{name}")


def _optimizers_in(value):
    """The optimizers an attribute holds: itself, or in a list, tuple or dict."""
    values = value.values() if isinstance(value, dict) else (
        value if isinstance(value, (list, tuple)) else [value])
    return [v for v in values if isinstance(v, keras.optimizers.Optimizer)]


def _refuse_apply(optimizer, where):
    def apply(original, grads, trainable_variables=None):
        if step_context.active_or_none() is not None:
            raise UsageError(_not_held(optimizer, f"held by a sub-model ({where})"))
        return original(grads, trainable_variables)

    _replace_apply(optimizer, apply)


def _not_held(optimizer, where):
    return (f"the step applies an optimizer ({type(optimizer).__name__}) {where}: kdist "
            "finds a step's optimizers among the model's own attributes (an attribute "
            "each, or in a list or dict attribute), and applies and checkpoints those "
            "only; hold it on the model")


@contextlib.contextmanager
def refusing_unknown(held=()):
    """Makes an optimizer that kdist neither routes nor refuses (one the model does
    not hold: a module's global, a closure's) raise `UsageError` when a step
    applies it, while this is open (the building run). Keras' own calls from
    within a routed `apply` (a `LossScaleOptimizer`'s inner optimizer) pass;
    the step's own call of the inner optimizer of one of `held` (the model's
    optimizers) is refused with the ways to apply it."""
    keras_apply = BaseOptimizer.apply
    wrapped = {id(o.inner_optimizer) for o in held
               if isinstance(o, keras.optimizers.LossScaleOptimizer)} - {id(o) for o in held}

    def apply(optimizer, grads, trainable_variables=None):
        context = step_context.active_or_none()
        if context is not None and not context.applying:
            if id(optimizer) in wrapped:
                raise UsageError(
                    f"the step applies the inner optimizer ({type(optimizer).__name__}) of "
                    "the model's LossScaleOptimizer, which kdist does not find there: apply "
                    "the LossScaleOptimizer (it unscales the gradients and skips a "
                    "non-finite step), or hold the inner one as an attribute of the model "
                    "too and unscale and skip yourself")
            raise UsageError(_not_held(optimizer, "that the model does not hold"))
        return keras_apply(optimizer, grads, trainable_variables)

    setattr(BaseOptimizer, "apply", apply)  # noqa: B010 (a method, for mypy)
    try:
        yield
    finally:
        setattr(BaseOptimizer, "apply", keras_apply)  # noqa: B010


# Keras' control-flow ops, whose functions a backend traces as branches or loops.
_CONTROL_FLOW = (keras_core.Cond, keras_core.Switch, keras_core.WhileLoop,
                 keras_core.ForiLoop, keras_core.Scan, keras_core.Map)


@contextlib.contextmanager
def counting_control_flow(context):
    """Counts, in `context.control_flow`, the Keras control-flow ops running now
    (`keras.ops.cond`, `switch`, `while_loop`, `fori_loop`, `scan`, `map`), so
    that an optimizer applied inside one is refused: TensorFlow's strategies
    cannot update variables from a branch, and JAX's stateless update would
    leave the traced function. Keras' own use inside an optimizer's `apply`
    passes. The refusal leaves the op as raised, not in Keras' report of the
    op's arguments."""
    own = {cls: vars(cls).get("__call__") for cls in _CONTROL_FLOW}

    def counted(keras_call):
        def call(op, *args, **kwargs):
            context.control_flow += 1
            try:
                return keras_call(op, *args, **kwargs)
            except Exception:
                if context.refusal is not None:
                    raise context.refusal from None
                raise
            finally:
                context.control_flow -= 1
        return call

    for cls in _CONTROL_FLOW:
        setattr(cls, "__call__", counted(cls.__call__))  # noqa: B010
    try:
        yield
    finally:
        for cls, keras_call in own.items():
            if keras_call is None:
                delattr(cls, "__call__")  # Back to the one Keras' Operation defines.
            else:
                setattr(cls, "__call__", keras_call)  # noqa: B010


def _replace_apply(optimizer, apply):
    """Makes `optimizer.apply(grads, variables)` call `apply(Keras' apply, grads,
    variables)`; Keras' own stays at `optimizer._kdist_apply`."""
    original = optimizer.apply
    optimizer._kdist_apply = original
    optimizer.apply = lambda grads, trainable_variables=None: apply(
        original, grads, trainable_variables)


def _refuse_unbuilt_on(optimizer, variables):
    """A `UsageError` where a built optimizer is applied to a variable it was not
    built on (Keras: "Unknown variable", or on JAX "No gradients provided")."""
    if not optimizer.built or variables is None:
        return
    known = {id(v) for v in optimizer._trainable_variables}
    unknown = [v for v in variables if id(v) not in known]
    if unknown:
        raise UsageError(
            f"the step applies {type(optimizer).__name__} to {unknown[0].path!r}, which it "
            "was not built on: an optimizer updates the variables of its first apply (or "
            "of optimizer.build); give each set of variables its own optimizer, or apply "
            "one to all of them at once")


def route_apply(optimizer):
    """Routes `optimizer.apply` through the step's context (once per optimizer).

    In a step kdist runs: the building run only builds the optimizer on the
    variables it is applied to; a real step leaves out variables without a
    gradient (as Keras does), records whether a `LossScaleOptimizer` skips
    the update, and applies it where the engine's optimizers work
    (`StepContext.optimizer_applying`). Outside a kdist step, `apply` is Keras'."""
    if getattr(optimizer, "_kdist_apply", None) is not None:
        return

    def apply(original, grads, trainable_variables=None):
        context = step_context.active_or_none()
        if context is None or context.applying:  # Outside kdist, or Keras' own call.
            return original(grads, trainable_variables)
        if context.control_flow:
            context.refusal = UsageError(
                f"the step applies {type(optimizer).__name__} inside keras.ops.cond (or "
                "another control-flow op): TensorFlow's strategies and JAX cannot update "
                "variables from a branch or loop; apply it at the step's top level (a "
                "Python loop of steps works) and choose with the gradients, e.g. "
                "keras.ops.where")
            raise context.refusal
        if trainable_variables is not None:
            pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
            if not pairs and trainable_variables:  # Keras: "No gradients provided".
                raise UsageError(
                    f"the step applies {type(optimizer).__name__} with no gradient for any "
                    f"of its {len(trainable_variables)} variables (each is None): take them "
                    "with kdist.value_and_grad (a backend's own, such as a torch "
                    "variable's .grad, are not there in a kdist step)")
            grads, trainable_variables = [g for g, _ in pairs], [v for _, v in pairs]
        if context.dry:
            if trainable_variables is None and not optimizer.built:
                raise UsageError(
                    f"the step applies {type(optimizer).__name__} without variables before "
                    "it is built; pass them: optimizer.apply(grads, variables)")
            context.applied_to.update({id(v): v for v in trainable_variables or ()})
            _refuse_unbuilt_on(optimizer, trainable_variables)
            if not optimizer.built:
                with context.optimizer_applying(leave_scope=True):
                    optimizer.build(trainable_variables)
            return None
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            context.skipped.append(skipped(optimizer, grads))
        return context.primitives.apply(context, optimizer, original, grads,
                                        trainable_variables)

    _replace_apply(optimizer, apply)
