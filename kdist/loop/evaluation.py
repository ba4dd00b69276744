"""The model with no distribution: a checkpoint evaluated, or the trained weights in hand."""

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import keras

from kdist import checkpoints, checks, engines, hints
from kdist.config import TrainConfig
from kdist.errors import UsageError
from kdist.inputs import arrays, base, sources
from kdist.loop import building
from kdist.loop.chunks import evaluate_source
from kdist.loop.result import TrainingResult
from kdist.models.cnn import create_model
from kdist.runtime import kept
from kdist.step.optimizer import finalize_weights


@hints.library_terms
def evaluate_checkpoint(
        path: str, dataset: arrays.Dataset | base.Inputs,
        model_fn: Callable[[], keras.Model] = create_model,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        compute_loss: Callable[[keras.Model, Any, Any, bool], tuple[Any, Any]] | None = None,
        batch_size: int | None = None,
        steps_per_execution: int = TrainConfig.steps_per_execution, *,
        precision: str | None = TrainConfig.precision,
        seed: int = TrainConfig.seed,
        optimizer_fn: Callable[[float], keras.optimizers.Optimizer] | None = None,
) -> dict[str, Any]:
    """Restores `path` into a fresh model with no distribution and evaluates it.

    With an optimizer compiled with `use_ema=True`, the model evaluated holds
    the optimizer's moving averages, as `fit` ends: for a model `model_fn`
    returns uncompiled, give the run's `optimizer_fn` (without it the model
    has no optimizer, and the raw weights are evaluated).

    The model is built under dtype policy `precision` (`kdist.precision`;
    None: Keras' global policy): a checkpoint of any precision restores into
    any (its variables are float32). `dataset` is a `kdist.Dataset` or a `kdist.Inputs` (only its
    test data is read). `batch_size` (default: the global batch of the run
    that wrote `path`, as its metadata records it) and `seed` (the run's) cut
    and draw a test step's `kdist.random` numbers as each epoch's evaluation
    did; `seed` also seeds the global random state just before `model_fn` is
    called, as the run did (a layer adapted on a random sample draws the
    same sample), and the caller's state is given back after. Returns {"restored":
    True, "checkpoint": path, "test_loss": ..., and test_ each metric}. A bad
    argument raises `kdist.UsageError` before any work.
    """
    _check_arguments(path, batch_size, steps_per_execution, seed)
    checks.check_model_fn(model_fn)
    if batch_size is None:
        batch_size = _global_batch_of(path)
    with kept.global_state_kept():  # The caller's random state, after the seeded build.
        return restore_and_evaluate(path, dataset, model_fn, loss_fn, compute_loss,
                                    batch_size, steps_per_execution, precision=precision,
                                    seed=seed, optimizer_fn=optimizer_fn)[1]


def _check_arguments(path, batch_size, steps_per_execution, seed):
    """Raises UsageError for the first bad argument of `evaluate_checkpoint`, before
    any work: a path that is no path (None: `latest_checkpoint` found none), a batch
    size or steps per execution that is not a whole number above 0, a bad seed."""
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"no checkpoint to evaluate: path is {path!r} (kdist.latest_checkpoint "
                         "returns None for a folder that holds no valid checkpoint)")
    if os.path.isdir(path):
        raise UsageError(f"path {os.fspath(path)} is a folder; pass a checkpoint file, such "
                         f"as its newest: kdist.latest_checkpoint({os.fspath(path)!r})")
    checks.check_positive(batch_size, "batch_size", optional=True)
    checks.check_positive(steps_per_execution, "steps_per_execution")
    checks.check_seed(seed)


def _global_batch_of(path):
    """The global batch of the run that wrote checkpoint `path`; kdist's default
    batch where the file does not say (restoring it reports why it cannot)."""
    try:
        recorded = checkpoints.read_metadata(path).get("global_batch_size")
    except Exception:  # noqa: BLE001 (`restore` raises the clear error for the file)
        recorded = None
    return recorded or TrainConfig.batch_size_per_replica


def restore_and_evaluate(path, dataset, model_fn, loss_fn, compute_loss, batch_size,
                         steps_per_execution, *, precision, seed, names=None,
                         optimizer_fn=None, learning_rate=None):
    """`evaluate_checkpoint`, returning (the restored model, its results); `names`:
    Keras' name counters of the run (`kdist.loop.building.object_names`);
    `optimizer_fn` and `learning_rate` compile a model `model_fn` returns
    uncompiled, as the run did."""
    prepared = sources.prepare(dataset, splits=("test",))
    engine = engines.create_engine(distributed=False)
    model, step = building.prepare_model(engine, batch_size, building.sample_rows(prepared),
                                         model_fn, optimizer_fn, learning_rate, loss_fn=loss_fn,
                                         compute_loss=compute_loss, train=False,
                                         precision=precision, names=names, seed=seed)
    # Evaluation does not read the optimizers' state (`optimizers=False`), but with
    # use_ema=True the model fit ends with holds their averages.
    checkpoints.restore(model, path, optimizers=False,
                        hint="evaluate it with the model it was trained with (--model)")
    finalize_weights(model)
    if not step.evaluates:
        raise UsageError(f"{type(model).__name__} defines train_step but no test_step, and "
                         "has no compiled loss for Keras' own; define test_step(data) to "
                         "evaluate it")
    building.check_labels(prepared, model, splits=("test",))
    engine.compile_steps(step)
    results = evaluate_source(engine, step, prepared.test, batch_size, steps_per_execution,
                              seed)
    return model, dict(restored=True, checkpoint=path,
                       **{f"test_{k}": v for k, v in results.items()})


def model_in_hand(result: TrainingResult, prepared: base.Prepared,
                  model_fn: Callable[[], keras.Model], loss_fn: Any, compute_loss: Any,
                  config: TrainConfig, names: dict | None = None,
                  optimizer_fn: Any = None) -> TrainingResult:
    """`result` with its model: built by `model_fn` with no distribution (unless the
    restored evaluation built it already), holding `result.weights`; `names` as
    `restore_and_evaluate`'s. A model built here holds the newest checkpoint's
    optimizer and seed states, as the restored evaluation's model does."""
    if result.model is not None:
        result.model.set_weights(result.weights)
        return dataclasses.replace(result, weights=None)
    engine = engines.create_engine(distributed=False)
    model, _ = building.prepare_model(
        engine, config.batch_size_per_replica, building.sample_rows(prepared), model_fn,
        optimizer_fn, config.learning_rate, loss_fn=loss_fn, compute_loss=compute_loss,
        train=False, precision=config.precision, names=names, seed=config.seed)
    latest = checkpoints.CheckpointManager(config.checkpoint_dir).latest()
    if latest is not None:
        checkpoints.restore(model, latest[0], optimizers=False)
    model.set_weights(result.weights)
    return dataclasses.replace(result, model=model, weights=None)
