"""The training loop, written once for every backend.

`train_and_evaluate` runs the tutorial's job: epochs of distributed train
steps, a full test-set evaluation after each, checkpoints, then the latest
checkpoint restored into a fresh model with no distribution and evaluated.
The engine (`kdist.engines`) is the only backend-specific piece.
"""

import dataclasses
import json
import math
import time

import keras

from kdist import checkpoints, data, engines, losses
from kdist.model import create_model
from kdist.startup import UsageError


@dataclasses.dataclass
class TrainConfig:
    """Everything that shapes a run; the CLI flags map onto these fields."""

    epochs: int = 10
    batch_size_per_replica: int = 64
    learning_rate: float = 1e-3
    replicas: int | None = None  # None: every visible device.
    checkpoint_dir: str = "./training_checkpoints"
    checkpoint_every: int = 2
    keep: int = 3
    resume: bool = True
    seed: int = 0
    steps_per_epoch: int | None = None  # None: the whole epoch.
    metrics_file: str | None = None
    progress: bool = False


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss)."""


def adam(learning_rate):
    return keras.optimizers.Adam(learning_rate)


def sgd(learning_rate):
    """Plain SGD: its step is linear in the gradient, so tests can compare runs exactly."""
    return keras.optimizers.SGD(learning_rate)


OPTIMIZERS = {"adam": adam, "sgd": sgd}


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


def summarize(totals):
    """Mean loss and accuracy (percent) from summed batch statistics."""
    count = totals["count"]
    return totals["loss_sum"] / count, 100.0 * totals["correct"] / count


def zero_totals():
    return dict(loss_sum=0.0, correct=0.0, count=0.0)


def run_steps(engine, step_fn, batches, totals=None, on_step=None, stop=None):
    """Runs `step_fn` over numpy batches, adding their statistics into `totals`.

    Stops early after the step during which `stop` became true. Returns
    (totals, number of steps run).
    """
    totals = zero_totals() if totals is None else dict(totals)
    done = 0
    for batch in batches:
        if len(batch[0]) % engine.num_local_replicas:
            raise UsageError(f"a batch of {len(batch[0])} does not split evenly across "
                             f"{engine.num_local_replicas} replicas; use a global batch size "
                             f"that is a multiple of {engine.num_replicas}")
        stats = step_fn(engine.distribute(batch))
        for key in totals:
            totals[key] += float(stats[key])
        done += 1
        if on_step is not None:
            on_step(done, stats, totals)
        if stop:
            break
    return totals, done


def evaluate(engine, images, labels, global_batch_size):
    """(loss, accuracy %) over every example of (images, labels)."""
    totals, _ = run_steps(engine, engine.eval_step,
                          data.eval_batches(images, labels, global_batch_size,
                                            shard=engine.shard))
    return summarize(totals)


class Interrupted(RuntimeError):
    """Training stopped on a signal after writing a checkpoint."""


def train_and_evaluate(config, dataset, model_fn=create_model, optimizer_fn=adam,
                       loss_fn=losses.sparse_categorical_crossentropy, log=print,
                       stop=None):
    """Trains data-parallel, checkpoints, restores without distribution, evaluates.

    `stop` (e.g. a `kdist.interrupt.StopRequest`) ends training at the next
    step boundary with a checkpoint and an `Interrupted` error. Returns a dict
    with `history` (one record per epoch) and `restored` (the evaluation of
    the latest checkpoint in a fresh, undistributed model).
    """
    engine = engines.create_engine(config.replicas)
    global_batch = config.batch_size_per_replica * engine.num_replicas
    steps = data.steps_per_epoch(len(dataset.train_images), global_batch, config.steps_per_epoch)
    if steps == 0:
        raise UsageError(f"{len(dataset.train_images)} training examples make no full "
                         f"global batch of {global_batch}; lower --batch-size-per-replica")
    manager = checkpoints.CheckpointManager(config.checkpoint_dir, config.keep)
    if engine.is_chief:
        manager.prepare()
    else:
        log = _quiet  # Only the chief reports; every worker trains alike.

    keras.utils.set_random_seed(config.seed)
    model, optimizer = build(engine, model_fn, optimizer_fn, config.learning_rate)
    position = _resume_position(config, manager, model, log)
    engine.prepare(model, optimizer, global_batch, loss_fn)

    def save(epoch, step_in_epoch, totals, history):
        engine.sync_to_model()
        target = manager if engine.is_chief else checkpoints.DiscardingManager()
        return target.save(model, step=epoch * steps + step_in_epoch, metadata=dict(
            epoch=epoch, step_in_epoch=step_in_epoch, totals=totals, history=history,
            seed=config.seed, backend=engine.backend, replicas=engine.num_replicas,
            global_batch_size=global_batch, steps_per_epoch=steps))

    log(f"Training on {engine.backend} with {engine.num_replicas} replica(s) "
        f"{engine.devices}: global batch {global_batch}, {steps} steps per epoch, "
        f"data {dataset.source}")
    if engine.shard[1] > 1:
        log(f"Chief of {engine.shard[1]} workers: each reads {global_batch // engine.shard[1]} "
            "examples of every global batch; checkpoints and metrics are written here")
    history = position["history"]
    for epoch in range(position["epoch"], config.epochs):
        first_step = position["step_in_epoch"] if epoch == position["epoch"] else 0
        totals = position["totals"] if epoch == position["epoch"] else None
        start = time.perf_counter()
        batches = data.train_batches(dataset.train_images, dataset.train_labels, global_batch,
                                     seed=config.seed, epoch=epoch, steps=steps,
                                     start_step=first_step, shard=engine.shard)
        totals, done = run_steps(engine, engine.train_step, batches, totals,
                                 _step_callback(config, epoch, first_step, steps), stop)
        if stop and first_step + done < steps:
            path = save(epoch, first_step + done, totals, history)
            raise Interrupted(f"{stop.signal_name}: stopped at epoch {epoch + 1}, step "
                              f"{first_step + done}; saved {path}; run the same command "
                              "to resume")
        record = _epoch_record(engine, dataset, epoch, totals, global_batch,
                               done, time.perf_counter() - start)
        history.append(record)
        log(format_epoch(record, config.epochs))
        _append_metrics(config.metrics_file if engine.is_chief else None, record)
        if (epoch + 1) % config.checkpoint_every == 0 or epoch + 1 == config.epochs or stop:
            log(f"Saved checkpoint {save(epoch + 1, 0, None, history)}")
        if stop:
            raise Interrupted(f"{stop.signal_name}: stopped after epoch {epoch + 1}; run the "
                              "same command to resume")

    latest = manager.latest() if engine.is_chief else None  # Others may not see it yet.
    if latest is None:
        return {"history": history, "restored": None}
    restored = evaluate_checkpoint(latest[0], dataset, model_fn, loss_fn, global_batch)
    log(f"Accuracy after restoring {latest[0]} without distribution: "
        f"{restored['test_accuracy']:.2f}%")
    _append_metrics(config.metrics_file, restored)
    return {"history": history, "restored": restored}


def _quiet(line):
    """The log of a worker other than the chief."""


def _resume_position(config, manager, model, log):
    """Restores the newest checkpoint unless told not to; returns where to start."""
    start = dict(epoch=0, step_in_epoch=0, totals=None, history=[])
    latest = manager.latest() if config.resume else None
    if not config.resume and manager.paths():
        log(f"--no-resume: starting over; the checkpoints in {config.checkpoint_dir} "
            "will be replaced by this run's")
    if latest is None:
        return start
    path, meta = latest
    checkpoints.restore(model, path, meta)
    if model.optimizer is not None:
        model.optimizer.learning_rate.assign(config.learning_rate)
    where = (f"epoch {meta['epoch'] + 1}, step {meta['step_in_epoch']}"
             if meta["step_in_epoch"] else f"end of epoch {meta['epoch']}")
    log(f"Resumed from {path} ({where}; written by {meta['backend']} with "
        f"{meta['replicas']} replica(s))")
    return {key: meta[key] for key in start}


def _step_callback(config, epoch, first_step, steps):
    """Checks every step's loss and drives the progress bar."""
    progbar = keras.utils.Progbar(steps, stateful_metrics=["loss", "accuracy"]) \
        if config.progress else None

    def on_step(done, stats, totals):
        step = first_step + done
        if not math.isfinite(float(stats["loss_sum"])):
            raise TrainingError(
                f"non-finite loss at epoch {epoch + 1}, step {step}; stopping. "
                "Checkpoints written before stay valid; try a lower --learning-rate")
        if progbar is not None:
            loss, accuracy = summarize(totals)
            progbar.update(step, [("loss", loss), ("accuracy", accuracy)])

    return on_step


def _epoch_record(engine, dataset, epoch, totals, global_batch, steps_run, seconds):
    train_loss, train_accuracy = summarize(totals)
    test_loss, test_accuracy = evaluate(
        engine, dataset.test_images, dataset.test_labels, global_batch)
    return dict(epoch=epoch + 1, train_loss=train_loss, train_accuracy=train_accuracy,
                test_loss=test_loss, test_accuracy=test_accuracy, seconds=seconds,
                samples_per_sec=steps_run * global_batch / seconds)


def evaluate_checkpoint(path, dataset, model_fn=create_model,
                        loss_fn=losses.sparse_categorical_crossentropy, batch_size=64):
    """Restores `path` into a fresh model with no distribution and evaluates it."""
    engine = engines.create_engine(distributed=False)
    model, _ = build(engine, model_fn, None, None)
    checkpoints.restore(model, path)
    engine.prepare(model, None, batch_size, loss_fn)
    test_loss, test_accuracy = evaluate(
        engine, dataset.test_images, dataset.test_labels, batch_size)
    return dict(restored=True, checkpoint=path, test_loss=test_loss,
                test_accuracy=test_accuracy)


def format_epoch(record, epochs):
    return (f"Epoch {record['epoch']}/{epochs}, Loss: {record['train_loss']:.4f}, "
            f"Accuracy: {record['train_accuracy']:.2f}%, Test Loss: {record['test_loss']:.4f}, "
            f"Test Accuracy: {record['test_accuracy']:.2f}% "
            f"({record['seconds']:.1f} s, {record['samples_per_sec']:,.0f} samples/s)")


def _append_metrics(path, record):
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
