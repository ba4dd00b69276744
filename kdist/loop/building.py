"""The compiled model and its `Step`, built in an engine's scope.

The loop (`kdist.loop.training`), the benchmarks and the tests build models
here: `build` compiles what `model_fn` returns (or keeps its compile, as
`fit` would), `prepare_model` adds the `kdist.step.compiled.Step` that the engines
compile, and `sample_rows` gives the few rows that build the compiled loss
and metrics.
"""

import collections
import contextlib

import keras
import numpy as np
from keras.src.backend.common import global_state  # Keras' counters of automatic names.

from kdist import tree
from kdist.config import DEFAULT_LEARNING_RATE, adam
from kdist.errors import UsageError
from kdist.inputs import arrays
from kdist.models import losses
from kdist.models.cnn import create_model
from kdist.precision import policy
from kdist.step import optimizer as step_optimizer
from kdist.step import program
from kdist.step.compiled import build_as_fit, build_metrics, loss_rows


def build(engine, model_fn, optimizer_fn=None, learning_rate=None, loss_fn=None,
          compute_loss=None, sample=None, train=True, precision=None, names=None):
    """Creates the compiled model in the engine's scope; returns (model, optimizer).

    `precision` (`kdist.precision.PRECISIONS`; None: Keras' global policy as
    it is) is the Keras dtype policy set while `model_fn` builds the model
    and it is compiled, then the caller's policy is back. Under
    mixed_float16, Keras' `compile` wraps the optimizer in a
    `LossScaleOptimizer` (dynamic loss scaling), for a model kdist compiles
    and for one `model_fn` compiles alike. `names` (`object_names()`, taken
    once per run): Keras names the objects `model_fn` makes without a name
    from these counters, so every model a run builds names its metrics alike
    (`auc`, not `auc` then `auc_1`).

    A model that `model_fn` returns compiled (optimizer, loss, metrics, as
    for `fit`) is used as it is. A model not yet built, its own step's too,
    is built as `fit` builds it, by a symbolic call on `sample`'s shapes.
    An uncompiled one is compiled here with `optimizer_fn(learning_rate)`
    (default Adam; none when `train` is false and no `optimizer_fn` is
    given: with one, a checkpoint's moving averages can be read), `loss_fn`
    (default sparse cross-entropy from logits) and the accuracy metric. The
    optimizer is built eagerly in scope (on TF, building it later inside a
    replica function fails with 2+ replicas, keras#23085), so `save_weights`
    writes and `load_weights` restores its state with the weights. `sample`,
    a few (x, y) rows, builds the compiled loss and metrics (`kdist.step.build`).
    """
    with engine.scope(), policy(precision), _names_from(names):
        model = model_fn()
        if not isinstance(model, keras.Model):
            raise UsageError(f"model_fn returned {type(model).__name__}, not a Keras model: "
                             "return the model it builds")
        _refuse_outside_scope(engine, model)
        _refuse_stateful(model)
        if program.defines(model, "train_step"):  # The model's own step.
            if optimizer_fn is not None or loss_fn is not None or learning_rate is not None:
                raise UsageError(
                    "model_fn returned a model with its own train_step: its optimizers and "
                    "losses are its own, so optimizer_fn, loss_fn and learning_rate must be "
                    "None")
            if sample is not None:
                build_as_fit(model, sample[0])  # Before its step reads its variables.
                if getattr(model, "_compile_metrics", None) is not None:
                    build_metrics(model, *sample)  # Its step may update them.
            return model, None
        if model.compiled:
            if optimizer_fn is not None or loss_fn is not None or learning_rate is not None:
                raise UsageError(
                    "model_fn returned a compiled model: its optimizer, learning rate and "
                    "loss are used, so optimizer_fn, loss_fn and learning_rate must be None")
        else:
            optimizer = (optimizer_fn or adam)(learning_rate or DEFAULT_LEARNING_RATE) \
                if train or optimizer_fn is not None else None
            if loss_fn is None and compute_loss is None:
                loss_fn = losses.sparse_categorical_crossentropy
            model.compile(optimizer=optimizer, loss=loss_fn, metrics=["accuracy"])
        if train and model.optimizer is None:
            raise UsageError("the compiled model has no optimizer; compile it with one")
        if sample is not None:
            build_metrics(model, *sample)  # Builds a model not yet built, as fit does.
        optimizer = model.optimizer
        if optimizer is not None:
            optimizer.build(model.trainable_variables)
    return model, optimizer


def _refuse_outside_scope(engine, model):
    """A model, or an optimizer it holds, created before the engine (outside
    `model_fn`) whose variables the engine's replicas cannot update
    (`outside_scope`: on TensorFlow, variables no strategy holds) is a UsageError."""
    outside = engine.outside_scope(model.variables)
    if outside and len(outside) == len(model.variables):
        raise UsageError(
            "model_fn returned a model created outside it, before kdist's engine existed, "
            "so the replicas do not hold its variables; create the model inside model_fn")
    if outside:
        raise UsageError(
            f"model_fn returned a model with variables created outside it, before kdist's "
            f"engine existed ({_names(outside)}), so the replicas do not hold them; create "
            "their layers inside model_fn (a layer adapted outside: adapt it there, or give "
            "the new layer its values, e.g. Normalization(mean=..., variance=...))")
    for optimizer in step_optimizer.held_by(model):
        if engine.outside_scope(optimizer.variables):
            raise UsageError(
                f"the model's optimizer ({type(optimizer).__name__}) was created outside "
                "model_fn, before kdist's engine existed, so the replicas do not hold its "
                "variables; create it inside model_fn")


def _refuse_stateful(model):
    """A stateful RNN (`stateful=True`) carries each row's state on to the same
    row of the next batch, for a batch size fixed in the model; replicas that
    each see their share of every batch cannot: a UsageError."""
    stateful = [layer.name for layer in model._flatten_layers()
                if getattr(layer, "stateful", False) is True]
    if stateful:
        raise UsageError(
            f"model_fn returned a model with stateful RNN layers ({', '.join(stateful)}): "
            "kdist trains each batch's rows on their own; use stateful=False (each batch "
            "starts from zero states), or fit for state carried from batch to batch")


def _names(variables):
    paths = [v.path for v in variables[:3]]
    return ", ".join(paths) + (f" and {len(variables) - 3} more" if len(variables) > 3 else "")


def object_names():
    """A copy of Keras' counters of automatic object names as they are now: what
    `build(names=...)` starts from."""
    return dict(_name_counters())


def continue_object_names(names):
    """Keras' counters of automatic names go on from `names` (`object_names()`
    of another process), so this process names what that one would."""
    _name_counters().update(names)


@contextlib.contextmanager
def _names_from(start):
    """Keras' name counters at `start` inside the block (None: as they are); after
    it, each counter at the larger of its value before and after the block, so
    objects named later stay apart from those named before it."""
    if start is None:
        yield
        return
    counters = _name_counters()
    before = dict(counters)
    counters.clear()
    counters.update(start)
    try:
        yield
    finally:
        for name, count in before.items():
            counters[name] = max(counters[name], count)


def _name_counters():
    return global_state.get_global_attribute(
        "object_name_uids", default=collections.defaultdict(int), set_to_default=True)


def prepare_model(engine, global_batch_size, sample, model_fn=create_model, optimizer_fn=None,
                  learning_rate=None, loss_fn=None, compute_loss=None, train=True,
                  precision=None, names=None, test=True, seed=None):
    """`build`, then the model's built `kdist.step.program.Program`: returns
    (model, program).

    `sample` is a few (x, y, sample_weight) rows (`sample_rows`). `seed` (the
    run's): the global random state is seeded with it just before `model_fn`
    is called, so every model a run builds (its own, the restored
    evaluation's, the model in hand; each torch replica process's) draws
    alike, state that is not a variable too (a layer adapted on a random
    sample). Restore a checkpoint, if any, before
    `engine.compile_steps(program)`: an engine may take the variables' values
    when it compiles.
    """
    if seed is not None:
        keras.utils.set_random_seed(seed)
    model, _ = build(engine, model_fn, optimizer_fn, learning_rate, loss_fn,
                     compute_loss, sample=sample, train=train, precision=precision, names=names)
    steps = program.Program(model, compute_loss, train=train, test=test)
    steps.build(engine, loss_rows(model, sample))
    return model, steps


def sample_rows(dataset, rows=2):
    """The first `rows` training examples of a `kdist.Dataset` or prepared inputs
    (`kdist.inputs.base.Prepared`: the test data's if it has no training data), as
    (x, zero targets, sample_weight): what builds the compiled loss and
    metrics, which need only shapes and dtypes (zero targets fit every loss,
    so bad labels are reported by the checks). Few rows: the eager call that
    builds them runs on every device."""
    if isinstance(dataset, arrays.Dataset):
        x, y, sample_weight = tree.take_rows(dataset.split("train"), slice(0, rows))
    else:
        x, y, sample_weight = dataset.sample(rows)
    return x, tree.map_arrays(np.zeros_like, y), sample_weight


def check_labels(prepared, model, splits=("train", "test")):
    """Makes class-index targets checked against a one-output classifier's class
    count (its output's last axis: per example, per time step or per pixel): a
    `kdist.Dataset`'s arrays here, at once; any other source's labels as they
    stream (`kdist.inputs.base.Source.expect_classes`). Only where the compiled
    loss reads its targets as class indices (`_takes_class_indices`): integer
    targets may be counts for another loss."""
    shape = getattr(model, "output_shape", None)
    if not (isinstance(shape, tuple) and len(shape) >= 2
            and _takes_class_indices(getattr(model, "loss", None))):
        return
    if shape[-1] == 1:  # Its loss is 0 for every target: nothing trains.
        raise UsageError(
            f"model {model.name!r} has one output unit (shape {shape}), and its loss, a "
            "sparse categorical cross-entropy, needs one per class: with one class its "
            "loss is always 0; give the output a unit per class, or, for two classes "
            "(labels 0 and 1), compile it with loss=\"binary_crossentropy\"")
    if not shape[-1]:
        return
    dataset = prepared.arrays
    if dataset is None:
        for split in splits:
            source = getattr(prepared, split)
            if source is not None:
                source.expect_classes(shape[-1])
        return
    arrays.check_labels(dataset, shape[-1], splits)


def _takes_class_indices(loss):
    """Whether the compiled `loss` is a sparse categorical cross-entropy, whose
    targets are class indices, none of them ignored (`ignore_class`: any
    target may then be the ignored value); a list or dict of one loss is that loss."""
    if isinstance(loss, (list, tuple, dict)) and len(loss) == 1:
        loss = next(iter(loss.values() if isinstance(loss, dict) else loss))
    if isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
        return loss.get_config().get("ignore_class") is None
    name = loss if isinstance(loss, str) else getattr(loss, "__name__", None)
    return name in ("sparse_categorical_crossentropy", "SparseCategoricalCrossentropy")
