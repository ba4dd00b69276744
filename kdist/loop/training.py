"""The training loop, written once for every backend.

`train_and_evaluate` runs the tutorial's job: epochs of distributed train
steps, a full test-set evaluation after each, checkpoints, then the latest
checkpoint restored into a fresh model with no distribution and evaluated.
The engine (`kdist.engines`) is the only backend-specific piece; the model
and its step are built by `kdist.loop.building`.
"""

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from kdist import checkpoints, checks, engines, records
from kdist.config import OPTIMIZERS, TrainConfig, adam, sgd  # noqa: F401 (importable here)
from kdist.errors import Interrupted, TrainingError, UsageError
from kdist.inputs import arrays, base, pipelines, sources
from kdist.loop import building, hooks, replicas, reporting, tensorboard
from kdist.loop.chunks import evaluate_source, run_steps, totals_from_json, zero_totals
from kdist.loop.evaluation import model_in_hand, restore_and_evaluate
from kdist.loop.result import TrainingResult, epoch_logs, keras_history
from kdist.models.cnn import create_model
from kdist.step import draws
from kdist.workers import interrupt
from kdist.workers.processes import REPLICA_PROCESSES_VARIABLE


def train_and_evaluate(
        config: TrainConfig, dataset: arrays.Dataset | base.Inputs,
        model_fn: Callable[[], keras.Model] = create_model,
        optimizer_fn: Callable[[float], keras.optimizers.Optimizer] | None = None,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        compute_loss: Callable[[keras.Model, Any, Any, bool], tuple[Any, Any]] | None = None,
        log: Callable[[str], object] = print, stop: object = None,
        callbacks: Sequence[keras.callbacks.Callback] = ()) -> TrainingResult:
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
            `use_ema=True` every evaluation (each epoch's, the restored
            checkpoint's) uses its moving averages of the weights
            (`kdist.step.optimizer.ema_variables`).
        optimizer_fn: for an uncompiled model: learning rate -> Keras
            optimizer (default Adam).
        loss_fn: for an uncompiled model: (y_true, y_pred) -> per-example
            losses (default sparse cross-entropy from logits).
        compute_loss: your own loss, `fn(model, x, y, training) ->
            (per-example losses, y_pred)` (see `kdist.step`); the compiled
            loss is then not used, the compiled metrics still are.
        log: called with each line to print.
        stop: if it becomes true (e.g. a `kdist.workers.interrupt.StopRequest`),
            training ends after the current chunk of steps with a checkpoint
            and `Interrupted`. With several workers, every worker stops
            after the same step when any one's `stop` is true.
        callbacks: `keras.callbacks.Callback`s, called as `fit` calls them
            (`kdist.loop.hooks`): `model.stop_training = True` ends training
            after the current chunk of steps (on every worker), with a
            checkpoint, and the run returns as usual. On torch each replica
            process runs copies of them.

    Returns a `TrainingResult`: the trained model with no distribution,
    `history` as Keras' `History` has it, `epochs` (one record per epoch:
    `train_loss`, `test_loss`, and train_/test_ each metric) and `restored`
    (the evaluation of the latest checkpoint in a fresh, undistributed model).
    """
    checks.check_config(config)
    processes = engines.replica_processes(config.replicas)
    prepared = sources.prepare(dataset)
    if processes:  # torch: this process starts one per replica and waits for them.
        result = replicas.run(processes, train_and_evaluate, dict(
            config=config, dataset=dataset, model_fn=model_fn, optimizer_fn=optimizer_fn,
            loss_fn=loss_fn, compute_loss=compute_loss, callbacks=callbacks),
            log=log, stop=stop)
    else:
        run = _Run(config, prepared, model_fn, optimizer_fn, loss_fn, compute_loss)
        try:
            result = _train(run, log, interrupt.AgreedStop(stop, run.engine), callbacks)
        finally:
            run.manager.release()
    if os.environ.get(REPLICA_PROCESSES_VARIABLE) == "1":  # A replica process of `run`:
        # the process that started it builds the model and takes the callbacks' state.
        return dataclasses.replace(result, model=None,
                                   callback_states=hooks.portable_states(callbacks))
    result = model_in_hand(result, prepared, model_fn, loss_fn, compute_loss, config)
    hooks.take_states(callbacks, result.callback_states, result.model)
    return dataclasses.replace(result, callback_states=None)


def _train(run, log, stop, callbacks):
    """The epochs, checkpoints and final evaluation of `train_and_evaluate`;
    `stop` is an `AgreedStop`. Returns a `TrainingResult` with the trained weights."""
    config, dataset = run.config, run.dataset
    chief = run.engine.is_chief  # With several workers, only the chief reports and writes.
    if chief:
        checks.check_metrics_file(config.metrics_file, "metrics_file")
        checks.check_tensorboard(config.tensorboard, "tensorboard")
    else:
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
    calls = hooks.Hooks([*callbacks, *own], run.model, run.engine, config.epochs, run.steps)
    calls.train_begin()
    while position.epoch < config.epochs and not position.stopped:
        calls.epoch_begin(position.epoch)
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
            path = run.save(position)
            log(f"Saved checkpoint {path}")
        if record is not None:
            metrics.epoch(record)  # After its checkpoint: a failed write loses none.
        if stop:
            raise _interrupted(stop, position, path)
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
        config.steps_per_execution, precision=config.precision, seed=config.seed)
    log(f"Restored {latest[0]} without distribution: "
        f"{reporting.format_results(restored, 'test_')}")
    metrics.restored(restored)
    return dataclasses.replace(result, restored=restored, model=model)  # Its weights next.


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
    return Interrupted(f"{stop.reason()}: {where}; run the same command to resume",
                       stop.signal_name)


class _Run:
    """One training run's engine, model, step, checkpoints and starting position."""

    def __init__(self, config, dataset, model_fn, optimizer_fn, loss_fn, compute_loss):
        self.config, self.dataset = config, dataset
        self.model_fn, self.loss_fn, self.compute_loss = model_fn, loss_fn, compute_loss
        self.engine = engines.create_engine(config.replicas)
        self.global_batch = config.batch_size_per_replica * self.engine.num_replicas
        # Steps per epoch: None while unknown (a pipeline of unknown length), then
        # learned from the first epoch or the checkpoint. `limit` caps a pass.
        self.steps = dataset.train.steps_per_epoch(self.global_batch, config.steps_per_epoch)
        if self.steps == 0:
            raise UsageError(f"{dataset.size('train')} training examples make no full "
                             f"global batch of {self.global_batch}; lower "
                             "--batch-size-per-replica")
        self.limit = self.steps if self.steps is not None else config.steps_per_epoch
        self.train_chunk = min(config.steps_per_execution,  # Compiled steps.
                               self.limit or config.steps_per_execution)
        self.manager = checkpoints.CheckpointManager(config.checkpoint_dir, config.keep)
        if self.engine.is_chief:  # Only the chief writes there, so only it locks.
            self.manager.prepare(lock=True, break_lock=config.break_lock)
        try:
            keras.utils.set_random_seed(config.seed)
            self.model, self.step = building.prepare_model(
                self.engine, self.global_batch, building.sample_rows(dataset), model_fn,
                optimizer_fn, config.learning_rate, loss_fn, compute_loss,
                precision=config.precision)
            # Whether the optimizer may skip steps: the epoch lines then count them.
            self.dynamic_loss_scale = any(isinstance(o, keras.optimizers.LossScaleOptimizer)
                                          for o in self.step.optimizers)
            building.check_labels(dataset, self.model)
            self.position, self.note, steps = _resume_position(config, self.manager,
                                                               self.model, self.step)
            self.steps = self.steps if self.steps is not None else steps
            self.note += pipelines.resume_note(dataset.train, self.position.step_in_epoch,
                                               self.global_batch)
            self.engine.compile_steps(self.step)
            self.saved_step = self.position.global_step(self.steps or 0)
            self.saved_time = time.monotonic()
        except BaseException:
            self.manager.release()
            raise

    def train_epoch(self, position, stop, calls, log):
        """Trains from `position` to the end of its epoch, then evaluates.

        Stops early after the step at which every worker agrees to stop (`stop`)
        or a callback stopped training (`calls`, a `kdist.loop.hooks.Hooks`).
        Returns (the position reached, the epoch's `EpochRecord`, or None if
        it stopped before the epoch's end).
        """
        epoch, first_step = position.epoch, position.step_in_epoch
        start = time.perf_counter()
        batches = self.dataset.train.train(
            self.global_batch, seed=self.config.seed, epoch=epoch, start_step=first_step,
            limit=self.limit, shard=self.engine.shard)
        with_draws = draws.attach(batches, self.step.draws["train"], self.config.seed,
                                  draws.TRAIN, epoch, first_step, self.global_batch,
                                  base.worker_rows(self.global_batch, self.engine.shard))
        progress = (reporting.ProgressBar(self.steps, first_step) if self.config.progress
                    else None)
        on_step = _step_callback(self.step, epoch, first_step, self.global_batch, progress,
                                 calls)
        totals = position.totals if position.totals is not None else zero_totals(self.step)

        def after_chunk(done, totals):  # A checkpoint by steps or minutes, mid-epoch.
            here = dataclasses.replace(position, step_in_epoch=first_step + done,
                                       totals=totals)
            if here.step_in_epoch != self.steps and self.periodic_due(here):
                if progress is not None:
                    progress.close()  # Its line ends; the next update draws it again.
                log(f"Saved checkpoint {self.save(here)}")

        try:
            totals, done = run_steps(
                self.engine, self.engine.train_chunk, with_draws, totals, on_step,
                lambda: stop.poll() or calls.poll_stop(), self.train_chunk,
                before_chunk=lambda done: calls.batch_begin(first_step + done),
                after_chunk=after_chunk)
        finally:
            if progress is not None:
                progress.close()
        if not batches.finished(done):  # Stopped with steps left in the epoch.
            return dataclasses.replace(position, step_in_epoch=first_step + done,
                                       totals=totals), None
        if self.steps is None:  # Its length is known now.
            self.steps = first_step + done
        seconds = time.perf_counter() - start if done else None  # None: all trained before.
        test = self.evaluate(calls) if self.step.evaluates else {}
        record = records.EpochRecord(
            epoch + 1, self.step.results(totals), test, seconds,
            done * self.global_batch / seconds if done else None,
            skipped_steps=round(float(totals["skipped"])))
        return records.Position(epoch + 1, 0, None, position.history + (record,)), record

    def evaluate(self, calls):
        """The epoch's evaluation on the test data, between the callbacks' test hooks."""
        calls.test_begin()
        results = evaluate_source(self.engine, self.step, self.dataset.test, self.global_batch,
                                  self.config.steps_per_execution, self.config.seed)
        calls.test_end(results)
        return results

    def save(self, position):
        """Checkpoints `position`; only the chief's copy is kept."""
        self.engine.sync_to_model()
        manager = self.manager if self.engine.is_chief else checkpoints.DiscardingManager()
        step = position.global_step(self.steps or 0)
        path = manager.save(
            self.model, step=step, metadata=dict(
                position.as_metadata(), seed=self.config.seed, backend=self.engine.backend,
                replicas=self.engine.num_replicas, global_batch_size=self.global_batch,
                steps_per_epoch=self.steps))
        self.saved_step, self.saved_time = step, time.monotonic()
        return path

    def periodic_due(self, position):
        """Whether `--checkpoint-every-steps` or `--checkpoint-every-minutes` asks for a
        checkpoint at `position`. With minutes, a collective on every worker: any
        worker's clock past the mark makes every worker save at the same step."""
        config, step = self.config, position.global_step(self.steps or 0)
        every = config.checkpoint_every_steps
        due = every is not None and step // every > self.saved_step // every
        if config.checkpoint_every_minutes is not None:
            late = time.monotonic() - self.saved_time >= 60 * config.checkpoint_every_minutes
            due = self.engine.any_worker(late) or due
        return due


def _quiet(line):
    """The log of a worker other than the chief."""


def _resume_position(config, manager, model, step):
    """Restores the newest checkpoint unless told not to.

    Returns (the `Position` to start from, a note for the banner, the steps
    per epoch the checkpoint records, if any).
    """
    if not config.resume and manager.paths():
        return records.Position(), ("starting over (--no-resume): this run's first "
                                    "checkpoint replaces the ones there"), None
    latest = manager.latest() if config.resume else None
    if latest is None:
        return records.Position(), "starting fresh", None
    path, meta = latest
    checkpoints.restore(model, path, hint="use another --checkpoint-dir, or --no-resume to "
                                          "start over")
    if config.learning_rate is not None:  # kdist built the optimizer: the flag may change.
        model.optimizer.learning_rate.assign(config.learning_rate)
    position = records.Position.from_metadata(meta)
    if position.step_in_epoch:
        totals = totals_from_json(position.totals, step)
        if totals is None:
            raise UsageError(f"{path} stops in the middle of epoch {position.epoch + 1} and "
                             "its statistics do not fit this model's metrics; resume with "
                             "the metrics it was written with, or --no-resume")
        position = dataclasses.replace(position, totals=totals)
    where = (f"epoch {meta['epoch'] + 1}, step {meta['step_in_epoch']}"
             if meta["step_in_epoch"] else f"end of epoch {meta['epoch']}")
    if position.stopped:
        where += ", where a callback stopped training: nothing left to train"
    return position, (
        f"resumed from {os.path.basename(path)} ({where}; written by {meta['backend']} "
        f"with {meta['replicas']} replica(s))"), meta.get("steps_per_epoch")


def _step_callback(step, epoch, first_step, global_batch, progress, calls):
    """`on_step` for `run_steps`: checks every step's loss, then once per chunk
    draws `progress` (a `reporting.ProgressBar`, or None) and calls the callbacks'
    `on_train_batch_end`."""
    start = time.perf_counter()

    def on_step(done, stats, totals, chunk_end):
        step_in_epoch = first_step + done
        for name in step.scalar_keys:  # The loss, or what a step of your own returns.
            if not math.isfinite(float(stats[f"{name}_sum"])):
                raise TrainingError(
                    f"non-finite {name} at epoch {epoch + 1}, step {step_in_epoch}; stopping. "
                    "Checkpoints written before stay valid; try a lower --learning-rate")
        if chunk_end and (progress is not None or calls.active):
            results = step.results(totals)
            if progress is not None:
                rate = done * global_batch / (time.perf_counter() - start)
                progress.update(step_in_epoch, results, rate)
            calls.batch_end(step_in_epoch - 1, results)

    return on_step
