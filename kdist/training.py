"""The training loop, written once for every backend.

`train_and_evaluate` runs the tutorial's job: epochs of distributed train
steps, a full test-set evaluation after each, checkpoints, then the latest
checkpoint restored into a fresh model with no distribution and evaluated.
The engine (`kdist.engines`) is the only backend-specific piece.
"""

import dataclasses
import math
import os
import time

import keras

from kdist import checkpoints, checks, data, engines, interrupt, losses, records, reporting
from kdist.config import OPTIMIZERS, TrainConfig, adam, sgd  # noqa: F401 (importable here)
from kdist.errors import Interrupted, TrainingError, UsageError
from kdist.model import create_model
from kdist.steps import evaluate, run_steps, summarize


def build(engine, model_fn, optimizer_fn, learning_rate):
    """Creates model and optimizer in the engine's scope.

    The optimizer is built eagerly in scope (on TF, building it later inside a
    replica function fails with 2+ replicas, keras#23085) and compiled into
    the model, so that `save_weights` writes and `load_weights` restores its
    state (iteration count, moments) with the weights.
    """
    with engine.scope():
        model = model_fn()
        optimizer = optimizer_fn(learning_rate) if optimizer_fn else None
        if optimizer is not None:
            optimizer.build(model.trainable_variables)
            model.compile(optimizer=optimizer)
    return model, optimizer


def train_and_evaluate(config, dataset, model_fn=create_model, optimizer_fn=adam,
                       loss_fn=losses.sparse_categorical_crossentropy, log=print,
                       stop=None):
    """Trains data-parallel, checkpoints, restores without distribution, evaluates.

    Args:
        config: a `TrainConfig`.
        dataset: a `kdist.data.Dataset` (NumPy arrays of any shapes).
        model_fn: builds the Keras model (called in the engine's scope).
        optimizer_fn: maps the learning rate to a Keras optimizer.
        loss_fn: (labels, predictions) -> per-example losses, shape (batch,).
        log: called with each line to print.
        stop: if it becomes true (e.g. a `kdist.interrupt.StopRequest`),
            training ends after the current chunk of steps with a checkpoint
            and `Interrupted`. With several workers, every worker stops
            after the same step when any one's `stop` is true.

    Returns a dict with `history` (one record per epoch) and `restored` (the
    evaluation of the latest checkpoint in a fresh, undistributed model).
    """
    checks.check_config(config)
    data.check_dataset(dataset)
    run = _Run(config, dataset, model_fn, optimizer_fn, loss_fn)
    try:
        return _train(run, log, interrupt.AgreedStop(stop, run.engine))
    finally:
        run.manager.release()


def _train(run, log, stop):
    """The epochs, checkpoints and final evaluation of `train_and_evaluate`;
    `stop` is an `AgreedStop`."""
    config, dataset = run.config, run.dataset
    chief = run.engine.is_chief  # With several workers, only the chief reports and writes.
    if chief:
        checks.check_metrics_file(config.metrics_file, "metrics_file")
    else:
        log = _quiet
    log(reporting.banner(run.engine, config, run.global_batch, run.steps, dataset, run.note,
                         run.train_chunk))
    metrics = reporting.MetricsWriter(config.metrics_file if chief else None)
    position = run.position
    metrics.start(position.history)  # Each epoch once, even after a crash and a resume.
    while position.epoch < config.epochs:
        position, record = run.train_epoch(position, stop)
        if record is not None:  # The epoch's steps are done and it is evaluated.
            log(reporting.format_epoch(record, config.epochs))
            stop.poll()  # A signal may have come during the evaluation.
        if stop or _checkpoint_due(config, position):
            path = run.save(position)
            log(f"Saved checkpoint {path}")
        if record is not None:
            metrics.epoch(record)  # After its checkpoint: a failed write loses none.
        if stop:
            raise _interrupted(stop, position, path)

    history = [record.as_dict() for record in position.history]
    if not chief:  # The chief's checkpoint may not be visible here yet.
        return {"history": history, "restored": None}
    latest = run.manager.latest()
    restored = evaluate_checkpoint(latest[0], dataset, run.model_fn, run.loss_fn,
                                   run.global_batch, config.steps_per_execution)
    log(f"Accuracy after restoring {latest[0]} without distribution: "
        f"{restored['test_accuracy']:.2f}%")
    metrics.restored(restored)
    return {"history": history, "restored": restored}


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
    """One training run's engine, model, checkpoints and starting position."""

    def __init__(self, config, dataset, model_fn, optimizer_fn, loss_fn):
        self.config, self.dataset = config, dataset
        self.model_fn, self.loss_fn = model_fn, loss_fn
        self.engine = engines.create_engine(config.replicas)
        self.global_batch = config.batch_size_per_replica * self.engine.num_replicas
        self.steps = data.steps_per_epoch(len(dataset.train_images), self.global_batch,
                                          config.steps_per_epoch)
        if self.steps == 0:
            raise UsageError(f"{len(dataset.train_images)} training examples make no full "
                             f"global batch of {self.global_batch}; lower "
                             "--batch-size-per-replica")
        self.train_chunk = min(config.steps_per_execution, self.steps)  # Compiled steps.
        self.manager = checkpoints.CheckpointManager(config.checkpoint_dir, config.keep)
        if self.engine.is_chief:  # Only the chief writes there, so only it locks.
            self.manager.prepare(lock=True, break_lock=config.break_lock)
        try:
            keras.utils.set_random_seed(config.seed)
            self.model, optimizer = build(self.engine, model_fn, optimizer_fn,
                                          config.learning_rate)
            data.check_labels(dataset, self.model.output_shape[-1])
            self.position, self.note = _resume_position(config, self.manager, self.model)
            self.engine.compile_steps(self.model, optimizer, self.global_batch, loss_fn)
        except BaseException:
            self.manager.release()
            raise

    def train_epoch(self, position, stop):
        """Trains from `position` to the end of its epoch, then evaluates.

        Stops early after the step at which every worker agrees to stop.
        Returns (the position reached, the epoch's `EpochRecord`, or None if
        it stopped before the epoch's end).
        """
        epoch, first_step = position.epoch, position.step_in_epoch
        start = time.perf_counter()
        batches = data.train_batches(
            self.dataset.train_images, self.dataset.train_labels, self.global_batch,
            seed=self.config.seed, epoch=epoch, steps=self.steps, start_step=first_step,
            shard=self.engine.shard)
        on_step = _step_callback(self.config, epoch, first_step, self.steps, self.global_batch)
        totals, done = run_steps(self.engine, self.engine.train_chunk, batches,
                                 position.totals, on_step, stop.poll, self.train_chunk)
        if first_step + done < self.steps:
            return dataclasses.replace(position, step_in_epoch=first_step + done,
                                       totals=totals), None
        seconds = time.perf_counter() - start if done else None  # None: all trained before.
        train_loss, train_accuracy = summarize(totals)
        test_loss, test_accuracy = evaluate(
            self.engine, self.dataset.test_images, self.dataset.test_labels,
            self.global_batch, self.config.steps_per_execution)
        record = records.EpochRecord(
            epoch + 1, train_loss, train_accuracy, test_loss, test_accuracy, seconds,
            done * self.global_batch / seconds if done else None)
        return records.Position(epoch + 1, 0, None, position.history + (record,)), record

    def save(self, position):
        """Checkpoints `position`; only the chief's copy is kept."""
        self.engine.sync_to_model()
        manager = self.manager if self.engine.is_chief else checkpoints.DiscardingManager()
        return manager.save(
            self.model, step=position.global_step(self.steps), metadata=dict(
                position.as_metadata(), seed=self.config.seed, backend=self.engine.backend,
                replicas=self.engine.num_replicas, global_batch_size=self.global_batch,
                steps_per_epoch=self.steps))


def _quiet(line):
    """The log of a worker other than the chief."""


def _resume_position(config, manager, model):
    """Restores the newest checkpoint unless told not to.

    Returns (the `Position` to start from, a note for the banner).
    """
    if not config.resume and manager.paths():
        return records.Position(), ("starting over (--no-resume): this run's first "
                                    "checkpoint replaces the ones there")
    latest = manager.latest() if config.resume else None
    if latest is None:
        return records.Position(), "starting fresh"
    path, meta = latest
    checkpoints.restore(model, path, meta)
    if model.optimizer is not None:
        model.optimizer.learning_rate.assign(config.learning_rate)
    where = (f"epoch {meta['epoch'] + 1}, step {meta['step_in_epoch']}"
             if meta["step_in_epoch"] else f"end of epoch {meta['epoch']}")
    return records.Position.from_metadata(meta), (
        f"resumed from {os.path.basename(path)} ({where}; written by {meta['backend']} "
        f"with {meta['replicas']} replica(s))")


def _step_callback(config, epoch, first_step, steps_per_epoch, global_batch):
    """Checks every step's loss and drives the progress bar."""
    progbar = keras.utils.Progbar(steps_per_epoch, stateful_metrics=["loss", "accuracy", "samples/s"]) \
        if config.progress else None
    start = time.perf_counter()

    def on_step(done, stats, totals):
        step = first_step + done
        if not math.isfinite(float(stats["loss_sum"])):
            raise TrainingError(
                f"non-finite loss at epoch {epoch + 1}, step {step}; stopping. "
                "Checkpoints written before stay valid; try a lower --learning-rate")
        if progbar is not None:
            loss, accuracy = summarize(totals)
            rate = round(done * global_batch / (time.perf_counter() - start))
            progbar.update(step, [("loss", loss), ("accuracy", accuracy), ("samples/s", rate)])

    return on_step


def evaluate_checkpoint(path, dataset, model_fn=create_model,
                        loss_fn=losses.sparse_categorical_crossentropy,
                        batch_size=TrainConfig.batch_size_per_replica,
                        steps_per_execution=TrainConfig.steps_per_execution):
    """Restores `path` into a fresh model with no distribution and evaluates it."""
    engine = engines.create_engine(distributed=False)
    model, _ = build(engine, model_fn, None, None)
    checkpoints.restore(model, path)
    data.check_labels(dataset, model.output_shape[-1], splits=("test",))
    engine.compile_steps(model, None, batch_size, loss_fn)
    test_loss, test_accuracy = evaluate(
        engine, dataset.test_images, dataset.test_labels, batch_size, steps_per_execution)
    return dict(restored=True, checkpoint=path, test_loss=test_loss,
                test_accuracy=test_accuracy)
