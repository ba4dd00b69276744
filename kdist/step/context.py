"""The context a step runs in: its scope, its random draws, and the engine's primitives.

An engine runs a step (`kdist.step.program.Program`) by opening a
`StepContext` around the step's Python function. While it is open, the
public primitives (`kdist.value_and_grad`, `kdist.random`) find it with
`current()` and call the engine's `Primitives`; outside one they raise.
The context lives in a `contextvars.ContextVar`, so nothing is global and
a context belongs to the thread that traces the step.

Every step runs inside a `StepScope`, a `keras.StatelessScope`: what the
step assigns to a variable is recorded there, and the engine decides what
becomes of it (`updates`). The metrics start each step from their reset
values (their change is the step's statistic, `kdist.step.program`). Only
optimizers change weights: a step that assigns a trainable or optimizer
variable itself gets a `UsageError`, because kdist keeps the replicas equal
by applying the same averaged gradients on each.

Keras counts a layer's losses (`add_loss`, activity regularizers) by the
ids of the tensors it added (`Layer._loss_ids`), and a model called as the
outermost layer first drops from the scope the losses whose ids its layers
recorded at their last call. Once those tensors are freed, CPython hands
their ids to new objects, so a loss another model added in the same step
could be dropped in their place: a silent wrong loss. A `StepContext`
therefore empties the step's layers' records when it opens and keeps every
loss its scopes collect alive until it closes, so each recorded id names a
tensor of the running step (`forget_loss_ids`).
"""

import contextlib
import contextvars
from typing import Any, Protocol

import keras
from keras.src.backend.common import global_state  # The active StatelessScope lives here.

from kdist.errors import UsageError

_ACTIVE: contextvars.ContextVar["StepContext | None"] = contextvars.ContextVar(
    "kdist_step", default=None)


class Primitives(Protocol):
    """What differs per backend inside a step; each engine module provides one."""

    applies_in_scope: bool
    """Whether an optimizer's `apply` runs inside the step's scope (JAX: stateless,
    its updates are the scope's) or outside it, on the variables in place
    (TensorFlow, torch: Keras' optimizers there update the variables' own tensors)."""

    def value_and_grad(self, context: "StepContext", fn: Any, variables: list,
                       tensors: list, scale: float, /) -> tuple[Any, list, list]:
        """(fn's value, gradients for `variables`, gradients for `tensors`) of the
        loss `fn(*tensors)` returns, times `scale` (`loss_of`); None for a
        variable the loss does not read. The gradients are this program's own:
        `kdist.step.api` sums them over replicas."""

    def sum_over_replicas(self, grads: list, /) -> list:
        """Gradients summed over the replicas that share the step's batch
        (`replicas_sharing`), of every worker; as they are where this program
        sees the whole batch. None stays None."""

    def replicas_sharing(self) -> int:
        """How many replicas each hold an equal, disjoint share of the step's batch:
        1 where this program sees the whole batch (`kdist.step.reductions`)."""

    def sum_over_shares(self, values: list, /) -> list:
        """`values` (scalars, no gradient) summed over those replicas."""

    def gather_shares(self, tensors: list, /) -> list:
        """Each of `tensors` (a row per example of this replica's share) over the
        global batch: every replica's rows in replica order, on every replica.
        Differentiable as an all-gather is: the gradient of a replica's own rows
        is the sum of every replica's gradient for them."""

    def apply(self, context: "StepContext", optimizer: Any, apply: Any, grads: list,
              variables: list | None, /) -> Any:
        """Applies `grads` to `variables` (None: all the optimizer's) with `optimizer`,
        whose Keras `apply` is `apply`, inside `context.optimizer_applying()`."""


class StepScope(keras.StatelessScope):
    """The step's `keras.StatelessScope`: records reads and refuses direct weight writes.

    `mapping` holds (variable, value) pairs as for `keras.StatelessScope`;
    `parent` (a `StepScope`) gives a child scope the parent's values first.
    """

    def __init__(self, context, mapping=(), parent=None):
        super().__init__(state_mapping=list(mapping), collect_losses=True)
        if parent is not None:
            self.state_mapping = {**parent.state_mapping, **self.state_mapping}
        self.initial = dict(self.state_mapping)
        self.context, self.parent = context, parent
        self.reads: set[int] = set()

    def __exit__(self, *exception):
        if self.parent is not None:  # What a nested function read, its caller read.
            self.parent.reads |= self.reads
        self.context.kept_losses.extend(self.losses)  # Their ids stay theirs (see above).
        return super().__exit__(*exception)

    def get_current_value(self, variable):
        """The variable's value in the step: the scope's, else the variable's own
        (which Keras reads itself where a scope holds no value, except for
        regularizers, which expect one)."""
        self.reads.add(id(variable))
        value = super().get_current_value(variable)
        return getattr(variable, "_value", None) if value is None else value

    def add_update(self, update):
        variable, _ = update
        if id(variable) in self.context.guarded and not self.context.applying:
            raise UsageError(
                f"the step assigns {variable.path!r} itself; in a kdist step only an "
                "optimizer changes weights and optimizer state: pass gradients to "
                "optimizer.apply(grads, variables) (a layer whose call assigns its own "
                "weights, such as SpectralNormalization, is not supported)")
        if self.context.dry:
            self.context.assigned[id(variable)] = variable
        super().add_update(update)

    def changed(self):
        """{variable id: value} assigned in this scope since it opened."""
        return {key: value for key, value in self.state_mapping.items()
                if self.initial.get(key) is not value}


class StepContext:
    """One run of a step function: the engine's primitives, the draws, what it did.

    Args:
        primitives: the engine's `Primitives`.
        guarded: ids of the variables only optimizers may assign.
        draws: the arrays `kdist.random` hands out, in call order (`kdist.step.draws`).
        dry: the building run (`kdist.step.program.Program.build`): no
            collectives, optimizers only build; the draws, the variables the
            step assigns and those it applies optimizers to are recorded.
        layers: every layer the step may call, whose records of loss ids
            are emptied when the context opens.
    """

    def __init__(self, primitives, guarded=frozenset(), draws=(), dry=False, layers=()):
        self.primitives = primitives
        self.layers = layers
        self.kept_losses: list[Any] = []  # Every loss the step's scopes collected.
        self.guarded = guarded
        self.draws = list(draws)
        self.dry = dry
        self.recorded_draws: list[tuple[str, tuple]] = []  # (kind, row shape), when dry.
        self.draws_taken = 0
        self.skipped: list[Any] = []  # Per LossScaleOptimizer.apply: 1.0 where it skipped.
        self.depth = 0  # `value_and_grad` calls in progress.
        # Those of them with respect to tensors only: their losses reduce over the
        # replica's own rows (`kdist.step.reductions`), so each example's gradient is its own.
        self.own_rows = 0
        self.applying = False  # Inside an optimizer's `apply`.
        self.control_flow = 0  # Keras control-flow ops in progress (`kdist.step.optimizer`).
        self.refusal: Exception | None = None  # The error an `apply` in one of them raised.
        self.rows: int | None = None  # The rows of the batch the step sees.
        # (loss, y_true, y_pred, sample_weight) of each Keras loss being called
        # (`kdist.step.reductions`).
        self.loss_calls: list[tuple] = []
        # When dry, {id: variable} the step assigns, and those it applies optimizers to.
        self.assigned: dict[int, Any] = {}
        self.applied_to: dict[int, Any] = {}
        # When dry, {id: variable} differentiated whose "gradient" is its next value.
        self.overwritten: dict[int, Any] = {}

    @contextlib.contextmanager
    def active(self, mapping=()):
        """Opens this context and the step's `StepScope`; yields the scope."""
        forget_loss_ids(self.layers)
        token = _ACTIVE.set(self)
        try:
            with StepScope(self, mapping) as scope:
                yield scope
        finally:
            _ACTIVE.reset(token)
            self.kept_losses.clear()

    @contextlib.contextmanager
    def optimizer_applying(self, leave_scope=None):
        """Marks an optimizer's `apply` (or its building, with `leave_scope`); where
        the engine's optimizers update their variables in place, the step's
        scope is left for its duration."""
        self.applying = True
        scope = global_state.get_global_attribute("stateless_scope")
        if leave_scope or (leave_scope is None and not self.primitives.applies_in_scope):
            global_state.set_global_attribute("stateless_scope", None)
        try:
            yield
        finally:
            global_state.set_global_attribute("stateless_scope", scope)
            self.applying = False


def forget_loss_ids(layers):
    """Empties each layer's record of the ids of the losses it added at its last
    call (Keras' `Layer._loss_ids`; see the module's docstring)."""
    for layer in layers:
        ids = getattr(layer, "_loss_ids", None)
        if ids:
            ids.clear()


def current():
    """The open `StepContext`; a `UsageError` outside a step that kdist runs."""
    context = _ACTIVE.get()
    if context is None:
        raise UsageError("kdist.value_and_grad, kdist.grad, kdist.random and "
                         "kdist.global_batch work inside a "
                         "train_step or test_step that kdist runs (train_and_evaluate, "
                         "kdist-train)")
    return context


def active_or_none():
    return _ACTIVE.get()


def current_scope():
    """The innermost `StepScope` open now."""
    scope = global_state.get_global_attribute("stateless_scope")
    if not isinstance(scope, StepScope):
        raise UsageError("kdist's primitives run inside the step's own scope; do not open "
                         "a keras.StatelessScope inside a kdist step")
    return scope


@contextlib.contextmanager
def substituted(pairs):
    """A child scope of the current one in which `pairs` (variable, value) hold;
    what the child assigns to other variables reaches the parent on exit."""
    parent = current_scope()
    with StepScope(parent.context, pairs, parent=parent) as child:
        yield child
    overridden = {id(v) for v, _ in pairs}
    propagate(parent, child, overridden)


def propagate(parent, child, skip=frozenset(), values=None):
    """Copies `child`'s assignments (or `values`, {id: value} in their place) into
    `parent`, with its losses; `skip` holds ids left out."""
    changed = child.changed() if values is None else values
    for key, value in changed.items():
        if key not in skip:
            parent.state_mapping[key] = value
    parent.losses.extend(child.losses)


def loss_of(value, scale=1.0):
    """The loss in what a differentiated function returns, the value itself or the
    first item of a tuple or list, times `scale`."""
    loss = value[0] if isinstance(value, (tuple, list)) else value
    if len(keras.ops.shape(loss)) != 0:
        raise UsageError(f"the function given to kdist.value_and_grad or kdist.grad returns "
                         f"a loss of shape {tuple(keras.ops.shape(loss))}; return a scalar, or "
                         "a tuple whose first item is one: keras.ops.sum of it is what "
                         "tf.GradientTape differentiates for such a target (a gradient "
                         "penalty's), keras.ops.mean a loss's mean")
    return loss if scale == 1 else loss * scale
