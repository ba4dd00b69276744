"""The training loop, written once for every backend.

`train_and_evaluate` runs the tutorial's job: epochs of distributed train
steps, a full test-set evaluation after each, checkpoints, then the latest
checkpoint restored into a fresh model with no distribution and evaluated.
The engine (`kdist.engines`) is the only backend-specific piece; the model
and its step are built by `kdist.loop.building`, one run's pieces held by
`kdist.loop.run.Run`.
"""

import contextlib
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import numpy as np

from kdist import checkpoints, checks, engines, hints
from kdist.config import OPTIMIZERS, TrainConfig, adam, sgd  # noqa: F401 (importable here)
from kdist.engines import joining
from kdist.errors import LOST_WORKERS, Interrupted, TrainingError, WorkerLost  # noqa: F401 (importable here)
from kdist.inputs import arrays, base, sources
from kdist.loop import building, callback_states, hooks, replicas, reporting, tensorboard
from kdist.loop.evaluation import model_in_hand, restore_and_evaluate
from kdist.loop.result import TrainingResult, epoch_logs, keras_history
from kdist.loop.run import Run
from kdist.models.cnn import create_model
from kdist.runtime import kept
from kdist.step.optimizer import finalize_weights
from kdist.workers import interrupt
from kdist.workers.processes import REPLICA_PROCESSES_VARIABLE


@hints.library_terms
def train_and_evaluate(
        config: TrainConfig, dataset: arrays.Dataset | base.Inputs,
        model_fn: Callable[[], keras.Model] = create_model,
        optimizer_fn: Callable[[float], keras.optimizers.Optimizer] | None = None,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        compute_loss: Callable[[keras.Model, Any, Any, bool], tuple[Any, Any]] | None = None,
        log: Callable[[str], object] = print, stop: object = None,
        callbacks: Sequence[keras.callbacks.Callback] | None = (),
        class_weight: Mapping[int, float] | None = None) -> TrainingResult:
    """Trains data-parallel, checkpoints, restores without distribution, evaluates.

    Args:
        config: a `TrainConfig`.
        dataset: a `kdist.Dataset` (NumPy arrays, or tuples/dicts of them),
            or a `kdist.Inputs` (tf.data, PyDataset, a function yielding
            batches, or arrays, for train and test; `kdist.inputs`).
        model_fn: builds the Keras model (called in the engine's scope),
            compiled as for `fit` or not (see `build`). The compiled
            optimizer's schedule, clipping and gradient accumulation act
            on the global gradient, as in `fit` on one device; with
            `use_ema=True` each epoch's evaluation scores the weights, as
            `fit` validates, and training ends with the moving averages in
            the model (the model in hand, the restored checkpoint's
            evaluation: `kdist.step.optimizer.finalize_weights`).
        optimizer_fn: for an uncompiled model: learning rate -> Keras
            optimizer (default Adam).
        loss_fn: for an uncompiled model: (y_true, y_pred) -> per-example
            losses (default sparse cross-entropy from logits).
        compute_loss: your own loss, `fn(model, x, y, training) ->
            (per-example losses, y_pred)` (see `kdist.step`); the compiled
            loss is then not used, the compiled metrics still are.
        log: called with each line to print.
        stop: if it becomes true (e.g. a `kdist.workers.interrupt.StopRequest`;
            a `threading.Event` once it is set),
            training ends after the current chunk of steps with a checkpoint
            and `Interrupted` ("asked to stop: stopped at epoch 1, step
            6; saved ..."). With several workers, every worker stops after
            the same step when any one's `stop` is true. With torch's
            replica processes this process reads it every 50 ms once they
            have joined and passes it on (`kdist.loop.replicas`); a callback,
            which runs in those processes, stops training with
            `model.stop_training`.
        callbacks: `keras.callbacks.Callback`s (or None), called as `fit` calls them
            (`kdist.loop.hooks`): `model.stop_training = True` ends training
            after the current chunk of steps (on every worker), with a
            checkpoint, and the run returns as usual. On torch each replica
            process runs copies of them.
        class_weight: {class index: weight} for a `kdist.Dataset` with one
            label array and no training sample weights: each training
            example weighs its class's weight (1 for a class not given), as
            in `fit` (`kdist.inputs.arrays.with_class_weight`).

    Returns a `TrainingResult`: the trained model with no distribution,
    `history` as Keras' `History` has it, `epochs` (one record per epoch:
    `train_loss`, `test_loss`, and train_/test_ each metric) and `restored`
    (the evaluation of the latest checkpoint in a fresh, undistributed model).
    """
    engines.bound_exit()  # Failing before this run ends with the others' strands them.
    checks.check_config(config)
    checks.check_model_fn(model_fn)
    callbacks = hooks.check_callbacks(callbacks)
    if class_weight is not None:
        dataset = arrays.with_class_weight(dataset, class_weight)
    joining.join_from_environment()  # Several workers: a script under a cluster's launcher.
    if engines.is_chief():  # Its output paths, before any work: only the chief writes.
        checkpoints.CheckpointManager(config.checkpoint_dir).check()
        checks.check_metrics_file(config.metrics_file, "metrics_file")
        checks.check_tensorboard(config.tensorboard, "tensorboard")
    with kept.global_state_kept():  # Seeds and, on JAX, the distribution: the caller's after.
        return _run(config, dataset, model_fn, optimizer_fn, loss_fn, compute_loss, log, stop,
                    callbacks)


def _run(config, dataset, model_fn, optimizer_fn, loss_fn, compute_loss, log, stop, callbacks):
    """`train_and_evaluate` after its checks: the run here, or in torch's replica
    processes, then the model in hand."""
    names = building.object_names()  # Every model this run builds names its objects alike.
    with interrupt.stop_of_run(stop, engines.connected()) as stop:
        processes = engines.replica_processes(config.replicas)
        prepared = sources.prepare(dataset, splits=("train",))  # Test data: optional.
        if processes:  # torch: this process starts one per replica and waits for them.
            result = replicas.run(processes, train_and_evaluate, dict(
                config=config, dataset=dataset, model_fn=model_fn, optimizer_fn=optimizer_fn,
                loss_fn=loss_fn, compute_loss=compute_loss, callbacks=callbacks),
                log=log, stop=stop)
        else:
            with _workers_lost(config):
                run = Run(config, prepared, model_fn, optimizer_fn, loss_fn, compute_loss,
                          names)
                try:
                    result = _train(run, log, interrupt.AgreedStop(stop, run.engine), callbacks)
                except BaseException:
                    run.abandon_writes()
                    raise
                finally:
                    run.manager.release()
    if os.environ.get(REPLICA_PROCESSES_VARIABLE) == "1":  # A replica process of `run`:
        # the process that started it builds the model and takes the callbacks' state.
        return dataclasses.replace(result, model=None,
                                   callback_states=callback_states.portable_states(callbacks))
    result = model_in_hand(result, prepared, model_fn, loss_fn, compute_loss, config, names,
                           optimizer_fn)
    callback_states.take_states(callbacks, result.callback_states, result.model)
    return dataclasses.replace(result, callback_states=None)


def _train(run, log, stop, callbacks):
    """The epochs, checkpoints and final evaluation of `train_and_evaluate`;
    `stop` is an `AgreedStop`. Returns a `TrainingResult` with the trained weights."""
    config, dataset = run.config, run.dataset
    chief = run.engine.is_chief  # With several workers, only the chief reports and writes.
    if not chief:
        log = _quiet
    banner = reporting.banner(run.engine, config, run.global_batch, run.steps, dataset,
                              run.note, run.train_chunk)
    log(banner)
    metrics = reporting.MetricsWriter(config.metrics_file if chief else None,
                                      run.step.metric_names("train"),
                                      run.step.metric_names("test"))
    position = run.position
    metrics.start(position.history)  # Each epoch once, even after a crash and a resume.
    own = [_to_tensorboard(run, position, banner)] if config.tensorboard else []
    calls = hooks.Hooks([*callbacks, *own], run.model, run.engine, config.epochs, run.steps,
                        run.step.metric_state, keras_history(position.history))
    calls.train_begin()
    try:
        position = _epochs(run, log, stop, calls, metrics, position)
    finally:  # An error or `Interrupted` too: the curves so far are on disk.
        for callback in own:
            callback.close()
    run.report_writes(log, wait=True)
    run.engine.sync_to_model()
    finalize_weights(run.model)  # After the last checkpoint, which keeps the weights.
    run.engine.sync_from_model()
    calls.train_end(epoch_logs(position.history[-1], extra=False) if position.history else {})
    run.engine.sync_to_model()
    result = TrainingResult(
        None, keras_history(position.history), [r.as_dict() for r in position.history],
        None, position.stopped, weights=[np.asarray(w) for w in run.model.get_weights()])
    if not chief or not run.step.evaluates:  # No test step, or the chief's checkpoint
        return result  # may not be visible here yet.
    latest = run.manager.latest()
    model, restored = restore_and_evaluate(
        latest[0], run.dataset, run.model_fn, run.loss_fn, run.compute_loss, run.global_batch,
        config.steps_per_execution, precision=config.precision, seed=config.seed,
        names=run.names, optimizer_fn=run.optimizer_fn, learning_rate=config.learning_rate)
    log(f"Restored {latest[0]} without distribution: "
        f"{reporting.format_results(restored, 'test_')}")
    metrics.restored(restored)
    return dataclasses.replace(result, restored=restored, model=model)  # Its weights next.


def _epochs(run, log, stop, calls, metrics, position):
    """The epochs from `position` on, each checkpointed and reported; returns the
    position after them. Raises `Interrupted` after a stop's checkpoint."""
    config = run.config
    while position.epoch < config.epochs and not position.stopped:
        # Resumed mid-epoch, the checkpoint holds what the callbacks set at the start.
        calls.epoch_begin(position.epoch, run.step.variables if position.step_in_epoch else ())
        position, record = run.train_epoch(position, stop, calls, log)
        if record is not None:  # The epoch's steps are done and it is evaluated.
            log(reporting.format_epoch(record, config.epochs, run.dynamic_loss_scale))
            stop.poll()  # A signal may have come during the evaluation.
            record = dataclasses.replace(
                record, extra=calls.epoch_end(record.epoch - 1, epoch_logs(record)))
            position = dataclasses.replace(position, history=position.history[:-1] + (record,))
        if calls.poll_stop():
            position = dataclasses.replace(position, stopped=True)
            log(f"A callback stopped training (model.stop_training) at epoch "
                f"{position.epoch + (1 if position.step_in_epoch else 0)}, step "
                f"{position.step_in_epoch or run.steps}")
        if (stop or position.stopped or _checkpoint_due(config, position)
                or run.periodic_due(position)):
            with calls.weights_in_model():
                run.save(position, log)
        if record is not None:
            metrics.epoch(record)  # After its snapshot; a resume rewrites the file.
        if stop:
            raise _interrupted(stop, position, run.end_writes_together(log))
        run.report_writes(log)
    return position


@contextlib.contextmanager
def _workers_lost(config):
    """Turns a collective with the other workers that failed (`engines.lost_peer`)
    into one `WorkerLost` line; an end every worker shares (the run's or a
    coordinated stop) unbounds this worker's wait for the others at its exit
    (`engines.unbound_exit`; `train_and_evaluate` bounds it)."""
    try:
        yield
    except Interrupted:
        engines.unbound_exit()
        raise
    except BaseException as error:
        cause = engines.lost_peer(error)
        if cause is None:
            raise
        raise WorkerLost(
            f"{LOST_WORKERS} ({cause}): another worker stopped or its "
            "machine went away (see its output); the same command on every worker resumes "
            f"from the newest checkpoint in {config.checkpoint_dir}") from error
    engines.unbound_exit()


def _to_tensorboard(run, position, banner):
    """The callback that writes `config.tensorboard` (`kdist.loop.tensorboard`), showing
    the run's `banner` above its settings."""
    return tensorboard.RunToTensorBoard(
        run.config.tensorboard, run.step.optimizers, run.global_batch,
        position.global_step(run.steps or 0), dataclasses.asdict(run.config),
        banner.replace("\n", "  \n"))


def _checkpoint_due(config, position):
    """After every `checkpoint_every`-th epoch and after the last (a stop always saves)."""
    return position.step_in_epoch == 0 and (position.epoch % config.checkpoint_every == 0
                                            or position.epoch == config.epochs)


def _interrupted(stop, position, path):
    where = (f"stopped at epoch {position.epoch + 1}, step {position.step_in_epoch}; "
             f"saved {path}" if position.step_in_epoch else
             f"stopped after epoch {position.epoch}")
    where += "; run again with the same settings to resume"
    return Interrupted(f"{stop.reason()}: {where}", stop.signal_name, where)


def _quiet(line):
    """The log of a worker other than the chief."""
