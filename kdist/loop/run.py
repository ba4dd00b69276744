"""One training run: its engine, model, step, checkpoints and position.

`Run` builds what `kdist.loop.training` trains: the engine, the compiled model
and its step, the checkpoint folder (with its `BackgroundWriter`) and the
position to start from (a checkpoint's, when resuming). `train_epoch` trains
and evaluates one epoch; `save` checkpoints a position.
"""

import dataclasses
import math
import os
import time
import warnings

import keras

from kdist import checkpoints, engines, records
from kdist.checkpoints import background
from kdist.errors import CheckpointError, TrainingError, UsageError
from kdist.inputs import pipelines
from kdist.inputs.batching import worker_rows
from kdist.loop import agreement, building, reporting, resuming
from kdist.loop.chunks import evaluate_totals, run_steps, zero_totals
from kdist.runtime import memory
from kdist.step import draws


class Run:
    """One training run's engine, model, step, checkpoints and starting position."""

    def __init__(self, config, dataset, model_fn, optimizer_fn, loss_fn, compute_loss,
                 names=None):
        self.config, self.dataset, self.names = config, dataset, names
        self.model_fn, self.loss_fn, self.compute_loss = model_fn, loss_fn, compute_loss
        self.optimizer_fn = optimizer_fn
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
        # What a position in an epoch counts in; in every checkpoint's metadata.
        self.order = dict(global_batch_size=self.global_batch, seed=config.seed,
                          workers=self.engine.shard[1], train_examples=dataset.size("train"))
        self.train_chunk = min(config.steps_per_execution,  # Compiled steps.
                               self.limit or config.steps_per_execution)
        self.manager = checkpoints.CheckpointManager(config.checkpoint_dir, config.keep)
        self.faults = memory.FaultMeter()  # Steps that fault in fresh memory: one hint.
        if self.engine.is_chief:  # Only the chief writes there, so only it locks.
            self.manager.prepare(lock=True, break_lock=config.break_lock)
        self.writer = background.BackgroundWriter(
            self.manager if self.engine.is_chief else checkpoints.DiscardingManager())
        try:
            sample = building.sample_rows(dataset)
            self.model, self.step = building.prepare_model(
                self.engine, self.global_batch, sample, model_fn,
                optimizer_fn, config.learning_rate, loss_fn, compute_loss,
                precision=config.precision, names=names, test=dataset.test is not None,
                seed=config.seed)
            # Whether the optimizer may skip steps: the epoch lines then count them.
            self.dynamic_loss_scale = any(isinstance(o, keras.optimizers.LossScaleOptimizer)
                                          for o in self.step.optimizers)
            building.check_labels(dataset, self.model)
            latest = self.manager.latest() if config.resume else None
            agreement.check_start(self, sample, latest)
            self.compiled_rates = resuming.compiled_rates(self.step)  # Recorded by `save`.
            self.position, self.note, steps = resuming.resume_position(
                config, self.manager, latest, self.model, self.step, self.order,
                own_shares=getattr(dataset.train, "own_shares", False),
                compiled=self.compiled_rates)
            self.steps = self.steps if self.steps is not None else steps
            self.note += pipelines.resume_note(dataset.train, self.position.step_in_epoch,
                                               self.global_batch, self.engine.shard[1])
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
                                  worker_rows(self.global_batch, self.engine.shard))
        progress = (reporting.ProgressBar(self.steps, first_step) if self.config.progress
                    else None)
        on_step = step_callback(self.step, epoch, first_step, self.global_batch, progress,
                                 calls)
        totals = position.totals if position.totals is not None else zero_totals(self.step)

        def after_chunk(done, totals, stopping):  # A checkpoint by steps or minutes,
            self.faults.after_chunk(done)  # mid-epoch; at a stop, the stop's own one.
            here = dataclasses.replace(position, step_in_epoch=first_step + done,
                                       totals=totals)
            if not stopping and here.step_in_epoch != self.steps and self.periodic_due(here):
                self.save(here, log, progress)
            self.report_writes(log, progress=progress)

        self.faults.start_epoch()
        try:
            totals, done = run_steps(
                self.engine, self.engine.train_chunk, with_draws, totals, on_step,
                lambda: stop.poll() or calls.poll_stop(), self.train_chunk,
                before_chunk=lambda done: calls.batch_begin(first_step + done),
                after_chunk=after_chunk,
                ending=batches if batches.shared_end and self.engine.shard[1] > 1 else None)
        finally:
            if progress is not None:
                progress.close()
        if not batches.finished(done):  # Stopped with steps left in the epoch.
            return dataclasses.replace(position, step_in_epoch=first_step + done,
                                       totals=totals), None
        if self.steps is None:  # Its length is known now.
            self.steps = first_step + done
        if self.engine.num_replicas > 1:
            agreement.check_replicas_equal(self.engine, epoch + 1, self.step.variables)
        if hint := self.faults.hint():
            log(hint)
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
        totals = evaluate_totals(self.engine, self.step, self.dataset.test, self.global_batch,
                                 self.config.steps_per_execution, self.config.seed)
        results = self.step.results(totals, "test")
        calls.test_end(results, totals)
        return results

    def save(self, position, log, progress=None):
        """Checkpoints `position` in the background (`kdist.checkpoints.background`);
        only the chief's copy is kept. Logs the writes that ended before it."""
        self.engine.sync_to_model()
        step = position.global_step(self.steps or 0)
        self._log_writes(log, progress, self.writer.save(
            self.model, step=step, metadata=dict(
                position.as_metadata(), **self.order, backend=self.engine.backend,
                replicas=self.engine.num_replicas, steps_per_epoch=self.steps,
                learning_rate=self.config.learning_rate, compiled_rates=self.compiled_rates)))
        self.saved_step, self.saved_time = step, time.monotonic()

    def report_writes(self, log, wait=False, progress=None):
        """Logs the checkpoint writes that ended (all, with `wait`); returns their
        paths. Raises the `CheckpointError` a write ended with."""
        return self._log_writes(log, progress, self.writer.written(wait))

    def end_writes_together(self, log):
        """At a stop: waits for the writes in flight, then for every worker (one
        `any_worker`, also where the chief's write failed), so that no worker exits
        before the chief's checkpoint is on disk (a launcher stops the others when
        one exits). Logs the writes; returns the newest path (on another worker,
        which writes into a folder of its own, since removed: the chief's folder)."""
        try:
            paths, failure = self.writer.written(wait=True), None
        except CheckpointError as error:
            paths, failure = [], error
        self.engine.any_worker(failure is not None)
        if failure is not None:
            raise failure
        newest = self._log_writes(log, None, paths)[-1]
        return newest if self.engine.is_chief else (
            f"worker 0's checkpoint in {os.path.abspath(self.config.checkpoint_dir)}")

    @staticmethod
    def _log_writes(log, progress, paths):
        if paths and progress is not None:
            progress.close()  # Its line ends; the next update draws it again.
        for path in paths:
            log(f"Saved checkpoint {path}")
        return paths

    def abandon_writes(self):
        """Lets the write in flight end, as the run fails: a failure of its own is
        a warning then, so that the run's error is the one raised."""
        try:
            self.writer.written(wait=True)
        except CheckpointError as e:
            warnings.warn(str(e), checkpoints.CheckpointWarning, stacklevel=2)

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


def _diverged(first):
    """What to do about a non-finite loss, at the run's `first` step or later."""
    if first:  # Nothing has trained: the optimizer is not the cause.
        return ("It is not finite at the starting weights: check the model, its loss and "
                "the data (kdist refuses NaN and infinity in the data, not values too large "
                "for the model)")
    return ("Checkpoints written before stay valid; training diverged: try a lower "
            "learning rate (--learning-rate, or that of the optimizer your model is "
            "compiled with)")


def step_callback(step, epoch, first_step, global_batch, progress, calls):
    """`on_step` for `run_steps`: checks every step's loss, then once per chunk
    draws `progress` (a `reporting.ProgressBar`, or None) and calls the callbacks'
    `on_train_batch_end`."""
    start = time.perf_counter()

    def on_step(done, stats, totals, chunk_end):
        step_in_epoch = first_step + done
        skipped = float(stats["skipped"]) > 0  # As `fit`, a LossScaleOptimizer goes on.
        for name in step.scalar_keys:  # The loss, or what a step of your own returns.
            if not skipped and not math.isfinite(float(stats[f"{name}_sum"])):
                raise TrainingError(f"non-finite {name} at epoch {epoch + 1}, step "
                                    f"{step_in_epoch}; stopping. " + _diverged(
                                        epoch == 0 and step_in_epoch == 1))
        if chunk_end and (progress is not None or calls.active):
            results = step.results(totals)
            if progress is not None:
                rate = done * global_batch / (time.perf_counter() - start)
                progress.update(step_in_epoch, results, rate)
            calls.batch_end(step_in_epoch - 1, results, totals)

    return on_step
