"""A step program: a model's train and test steps, as every engine runs them.

A `Program` wraps one `keras.Model` that holds everything a step uses: its
layers and sub-models, its optimizers (attributes, or the compiled one),
its metrics. Its steps are the model's own `train_step(data)` and
`test_step(data)` where the model's class defines them, written with
`keras.ops` and kdist's primitives (`kdist.step.api`, `kdist.random`), or
else kdist's step for a model compiled for `fit` (`kdist.step.compiled`),
which is one user of the same primitives.

An engine runs a step with `run(primitives, training, batch, mapping)`
inside its own program (a replica function, a jitted function, a process),
and gets back the step's statistics, summed later over replicas, workers
and steps (`kdist.loop.chunks`), and the step's scope, whose assignments it
keeps (`kdist.step.context.StepScope.changed`). The statistics are:

- `count`: the examples the step saw; `skipped`: 1 where a
  `LossScaleOptimizer` skipped its update (non-finite gradients), counted
  once per step by the engine;
- `<name>_sum` for each scalar the step returns (not a metric's result):
  its value times the examples, so totals give the example-weighted mean;
- `metric_NNN` for each metric variable: the change the step made to it
  from its reset value. Keras metrics merge by summing their variables
  (their declared `aggregation`), so the sum over replicas, workers and
  steps is the state one metric would hold after seeing every example once;
  `results` reads it through the metrics' own `result()`.
"""

import contextlib
from typing import Any

import keras
import numpy as np
from keras import ops

from kdist import tree
from kdist.errors import UsageError
from kdist.step import compiled, portable, reductions, refusals
from kdist.step import context as step_context
from kdist.step import logs as step_logs
from kdist.step import optimizer as step_optimizer

PHASES = ("train", "test")


def metric_key(index):
    return f"metric_{index:03d}"


class Program:
    """The steps of `model`, ready for an engine.

    Args:
        model: a `keras.Model` whose class defines `train_step(data)` (and
            optionally `test_step(data)`) with kdist's primitives, or a model
            compiled for `fit` (optimizer, loss, metrics).
        compute_loss: for a compiled model only: `fn(model, x, y, training) ->
            (per-example losses, y_pred)` in place of the compiled loss.
        train: whether the program trains (False: evaluation only).
        test: whether it evaluates (False: the run has no test data).
    """

    def __init__(self, model, compute_loss=None, train=True, test=True):
        self.model = model
        own = defines(model, "train_step")
        if own and compute_loss is not None:
            raise UsageError("compute_loss= is for a model compiled for fit; a model with its "
                             "own train_step computes its loss there")
        refusals.refuse_other_arguments(
            model, [name for name in ("train_step", "test_step") if defines(model, name)])
        self.steps: dict[str, Any] = {
            "train": model.train_step if own else (
                lambda data: compiled.train_step(model, data, compute_loss)),
            "test": _test_step(model, compute_loss, own) if test else None,
        }
        self.trains = train and (own or getattr(model, "optimizer", None) is not None)
        self.optimizers = step_optimizer.held_by(model)
        for optimizer in self.optimizers:
            step_optimizer.route_apply(optimizer)
        step_optimizer.refuse_nested(model, self.optimizers)
        self.metrics = compiled.reported_metrics(model, own_step=own)
        self.metric_variables = [v for m in self.metrics for v in m.variables]
        refusals.refuse_unmerged(self.metric_variables)
        self.reset_values = [np.array(v.numpy()) for v in self.metric_variables]
        self._take_variables()
        self.names: dict[str, list[str]] = {"train": [], "test": []}
        self.results_as: dict[str, dict[str, str]] = {"train": {}, "test": {}}
        self.draws: dict[str, list] = {"train": [], "test": []}
        self.scalar_keys: list[str] = []
        self.keys: tuple[str, ...] = ()

    def _take_variables(self):
        """`variables`: every variable the steps read or change, but the metrics';
        `guarded`: the ids of those only optimizers may assign. Taken again once
        `build` has built the optimizers (their state exists from then on);
        `layers`: the model and every layer in it, which steps may call."""
        model = self.model
        self.layers = list(model._flatten_layers(include_self=True))
        metric_ids = {id(v) for v in self.metric_variables}
        self.variables = _unique(
            [v for v in model.trainable_variables + model.non_trainable_variables
             + [v for o in self.optimizers for v in o.variables] if id(v) not in metric_ids])
        self.guarded = frozenset(id(v) for v in model.trainable_variables) | frozenset(
            id(v) for o in self.optimizers for v in o.variables)

    def _known_ids(self):
        """The ids of the variables a step may assign: the program's, the metrics',
        and `fit`'s loss tracker's (kdist reports the loss itself)."""
        tracker = getattr(self.model, "_loss_tracker", None)
        return {id(v) for v in self.variables + self.metric_variables + list(
            getattr(tracker, "variables", ()))}

    @property
    def evaluates(self):
        """Whether the program has a test step (and test data to run it on)."""
        return self.steps["test"] is not None

    def build(self, engine, sample):
        """Runs each step once, eagerly, on `sample` rows (x, y, sample_weight), in
        `engine`'s scope, keeping nothing: it builds the optimizers on the
        variables they are applied to and learns what the steps return and
        draw. Call before restoring a checkpoint (its optimizer state needs
        the built optimizers) and before `engine.compile_steps(program)`."""
        by_name = self._metric_names()
        own = defines(self.model, "train_step")
        tracker = getattr(self.model, "_loss_tracker", None)
        builtin = {"train": not own, "test": not defines(self.model, "test_step")}
        scalars: dict[str, None] = {}
        contexts = {}
        for phase in PHASES:
            if self.steps[phase] is None or (phase == "train" and not (self.trains or own)):
                continue  # (A model's own train step builds its optimizers, even to evaluate.)
            context = contexts[phase] = step_context.StepContext(
                engine.primitives(), self.guarded, dry=True, layers=self.layers)
            with engine.scope():
                tensors = tuple(tree.map_arrays(ops.convert_to_tensor, part) for part in sample)
                watch: Any = portable.watching() if own else contextlib.nullcontext([])
                calls: list = []  # Bound even where a context fails to enter.
                try:
                    with watch as calls, step_optimizer.refusing_unknown(self.optimizers), \
                            step_logs.results_recorded(self.metrics) as returned_as:
                        logs, _ = self._call(context, phase, tensors + ((),))
                except Exception as error:  # A framework's call first, where it failed.
                    refusals.refuse_framework_calls(phase, calls, cause=error)
                    raise
            refusals.refuse_framework_calls(phase, calls)
            self.names[phase] = list(logs)
            # A key is a metric's where its value is that metric's `result()`; where
            # the keys are the metrics' names exactly, each is its metric (`fit` then
            # reports `get_metrics_result()`, whatever the step returned).
            # (kdist's own step reports the loss itself, not Keras' loss tracker.)
            names = {k: m for k, m in by_name.items() if not (builtin[phase] and m is tracker)}
            self.results_as[phase] = ({key: key for key in logs} if set(logs) == set(names)
                                      else returned_as(logs))
            self.draws[phase] = context.recorded_draws
            for name, value in logs.items():
                if name not in self.results_as[phase]:
                    refusals.refuse_non_scalar_log(phase, name, value)
                    scalars[name] = None
        self.scalar_keys = list(scalars)
        # A model of sub-models is never called itself: its layers are built now, so
        # Keras may save its weights.
        self.model.built = True
        self._take_variables()
        for phase, context in contexts.items():
            refusals.refuse_outside(phase, context, self._known_ids())
            refusals.refuse_overwritten(context, engine.batch_shares)
        self.keys = ("count", "skipped") + tuple(f"{k}_sum" for k in self.scalar_keys) + tuple(
            metric_key(i) for i in range(len(self.metric_variables)))

    def run(self, primitives, training, batch, mapping=()):
        """Runs the train (or test) step on `batch`, (x, y, sample_weight, draws),
        inside a `StepContext`; `mapping` gives (variable, value) pairs the
        step reads in place of the variables. Returns (statistics, scope)."""
        phase = "train" if training else "test"
        context = step_context.StepContext(primitives, self.guarded,
                                           batch[3] if len(batch) > 3 else (), layers=self.layers)
        logs, scope = self._call(context, phase, batch, mapping)
        if context.draws_taken != len(context.draws):
            raise UsageError(f"the {phase}_step made {context.draws_taken} kdist.random draws "
                             f"where its first run made {len(context.draws)}; draw the same "
                             "each step")
        return self._statistics(logs, scope, context), scope

    def _call(self, context, phase, batch, mapping=()):
        x, y, sample_weight = batch[:3]
        context.rows = int(ops.shape(tree.leaves(x)[0])[0])
        data = (x, y) if sample_weight is None else (x, y, sample_weight)
        resets = [(v, ops.convert_to_tensor(r))
                  for v, r in zip(self.metric_variables, self.reset_values)]
        with reductions.over_global_batch(), step_optimizer.counting_control_flow(context), \
                context.active(list(mapping) + resets) as scope:
            logs = self.steps[phase](data)
            if not isinstance(logs, dict):
                raise UsageError(f"the {phase}_step returns {type(logs).__name__}; return a "
                                 "dict of scalars or metric results, as Keras' train_step does")
            logs = {name: step_logs.read(phase, name, value)
                    for name, value in step_logs.flat(logs).items()}
        return logs, scope

    def _statistics(self, logs, scope, context):
        rows = ops.cast(context.rows, "float32")
        stats = {"count": rows, "skipped": (
            ops.max(ops.stack(context.skipped)) if context.skipped
            else ops.zeros((), "float32"))}
        for key in self.scalar_keys:
            value = logs.get(key)
            stats[f"{key}_sum"] = (ops.zeros((), "float32") if value is None
                                   else ops.cast(value, "float32") * rows)
        for i, (variable, reset) in enumerate(zip(self.metric_variables, self.reset_values)):
            stats[metric_key(i)] = (ops.cast(scope.get_current_value(variable), "float32")
                                    - ops.convert_to_tensor(reset, "float32"))
        return stats

    def _metric_names(self):
        """{result name: metric} of the metrics' results, read at their reset state.
        A result that is not a scalar is refused: kdist reports numbers."""
        names = {}
        for metric in self.metrics:
            try:
                value = metric.result()
            except AttributeError as error:  # F1Score, R2Score: variables made at first update.
                refusals.refuse_unready(metric, error)
            results = step_logs.flat(value) if isinstance(value, dict) else {metric.name: value}
            for name, result in results.items():
                refusals.refuse_non_scalar_result(name, result)
                names[name] = metric
        return names

    def results(self, totals, phase="train"):
        """{name: value} of summed statistics, in the order the step returns them:
        a metric's merged result, or a scalar's example-weighted mean."""
        count = float(totals["count"])
        merged = {}
        with keras.StatelessScope(state_mapping=self.metric_state(totals)):  # Assigns nothing.
            for metric in self.metrics:
                value = metric.result()
                values = (step_logs.flat(value) if isinstance(value, dict)
                          else {metric.name: value})
                merged.update({k: float(np.asarray(keras.ops.convert_to_numpy(v)))
                               for k, v in values.items()})
        result_of = self.results_as[phase]
        return {name: merged[result_of[name]] if name in result_of else
                float(totals[f"{name}_sum"]) / count for name in self.names[phase]}

    def metric_state(self, totals):
        """[(metric variable, value)] of summed statistics: each metric's state after
        the steps they sum, as `fit` leaves it in the model; with the built-in step,
        Keras' loss tracker's too (the loss summed over examples, and their count).
        `totals` None: their reset state."""
        def total(key):
            return 0 if totals is None else np.asarray(totals[key])

        state = [(v, (reset + total(metric_key(i))).astype(reset.dtype))
                 for i, (v, reset) in enumerate(zip(self.metric_variables, self.reset_values))]
        tracker = getattr(self.model, "_loss_tracker", None)
        if (tracker is not None and "loss" in self.scalar_keys
                and not defines(self.model, "train_step")):
            state += [(tracker.total, np.float32(total("loss_sum"))),
                      (tracker.count, np.float32(total("count")))]
        return state

    def metric_names(self, phase="train"):
        """The names `results` gives for `phase`."""
        return list(self.names[phase])

    def statistic_shapes(self):
        """{key: shape} of the statistics a step returns (`keys`, in order)."""
        shapes = [()] * (len(self.keys) - len(self.reset_values)) + [
            np.shape(r) for r in self.reset_values]
        return dict(zip(self.keys, shapes))

    def zero_statistics(self):
        """Statistics of a step that counts nothing (a skipped padding step)."""
        return {key: ops.zeros(shape, "float32") for key, shape in self.statistic_shapes().items()}


def _test_step(model, compute_loss, own):
    """The model's own `test_step`; else the built-in one (`fit`'s math), also for
    a model with its own `train_step` where Keras' inherited `test_step` has a
    loss to compute (compiled with one, or defining `compute_loss`), as `fit`
    validates it; else None (no evaluation)."""
    if defines(model, "test_step"):
        return model.test_step
    if own and getattr(model, "_compile_loss", None) is None and not defines(
            model, "compute_loss"):
        return None
    return lambda data: compiled.test_step(model, data, compute_loss)


def defines(model, name):
    """Whether a class of `model` below `keras.Model` defines method `name`."""
    for cls in type(model).__mro__:
        if cls is keras.Model or cls.__module__.startswith("keras."):
            return False
        if name in vars(cls):
            return True
    return False


def _unique(items):
    return list({id(item): item for item in items}.values())

