"""Where a run starts: the newest checkpoint restored, and the checks that
a resume in the middle of an epoch counts the examples it was written in."""

import dataclasses
import math
import os

from kdist import checkpoints, records
from kdist.errors import UsageError
from kdist.loop.chunks import totals_from_json
from kdist.step.optimizer import learning_rates


def resume_position(config, manager, latest, model, step, order, own_shares=False,
                    compiled=()):
    """Restores the newest checkpoint unless told not to.

    Returns (the `Position` to start from, a note for the banner, the steps
    per epoch the checkpoint records, if any, and if it was written with
    this run's global batch). `latest`: the manager's newest checkpoint, read
    if `config.resume`; `order`: this run's `Run.order`; `own_shares`:
    whether each worker reads its own share of the training data;
    `compiled`: the optimizers' `compiled_rates` before the restore. A
    checkpoint in the middle of an epoch resumes only where it counts the
    same examples (`_check_mid_epoch`).
    """
    if not config.resume and manager.paths():
        return records.Position(), ("starting over (--no-resume): this run's first "
                                    "checkpoint replaces the ones there"), None
    if latest is None:
        return records.Position(), "starting fresh", None
    path, meta = latest
    checkpoints.restore(model, path, hint="use another --checkpoint-dir, or --no-resume to "
                                          "start over")
    # kdist built the optimizer: a rate other than the checkpoint's run was given
    # replaces the checkpoint's (the same one keeps what callbacks set).
    changed_rate = config.learning_rate not in (None, meta.get("learning_rate"))
    if changed_rate:
        model.optimizer.learning_rate.assign(config.learning_rate)
    position = records.Position.from_metadata(meta)
    written = {key: meta.get(key, now) for key, now in order.items()}  # Older: not all.
    if position.step_in_epoch:
        _check_mid_epoch(path, position, written, order, own_shares)
        totals = totals_from_json(position.totals, step)
        if totals is None:
            raise UsageError(f"{path} stops in the middle of epoch {position.epoch + 1} and "
                             "its statistics do not fit this model's metrics; resume with "
                             "the metrics it was written with, or --no-resume")
        position = dataclasses.replace(position, totals=totals)
    where = (f"epoch {position.epoch + 1}, step {position.step_in_epoch}"
             if position.step_in_epoch else f"end of epoch {position.epoch}")
    if position.stopped:
        where += ", where a callback stopped training: nothing left to train"
    elif position.epoch >= config.epochs:
        where += f", and --epochs is {config.epochs}: nothing left to train"
    same_batch = written["global_batch_size"] == order["global_batch_size"]
    steps = meta.get("steps_per_epoch") if same_batch else None
    writer = (f"{meta['backend']} with {meta['replicas']} replica(s)" if "backend" in meta
              else "an older kdist")  # Format 1.
    rate = (f"; learning rate {config.learning_rate:g} from now on" if changed_rate else
            _kept_rates(meta.get("compiled_rates"), compiled, compiled_rates(step))
            if config.learning_rate is None else "")
    return (position, f"resumed from {os.path.basename(path)} ({where}; written by "
                      f"{writer}){rate}", steps)


def compiled_rates(step):
    """The rates of the step's optimizers, but those following a schedule: as
    compiled before a checkpoint is restored, the checkpoint's after."""
    return [float(rate.numpy()) for rate in learning_rates(step.optimizers)]


def _kept_rates(written, compiled, restored):
    """"; learning rate 0.1 from the checkpoint, not the 0.01 compiled" where this
    run compiles other rates than the checkpoint's run did (`written`; None: not
    recorded) and the checkpoint's (what callbacks set) go on, as `fit`'s
    `BackupAndRestore` restores them; else ""."""
    return "".join(
        f"; learning rate {new:g} from the checkpoint, not the {now:g} compiled"
        for old, now, new in zip(written or (), compiled, restored)
        if not math.isclose(old, now, rel_tol=1e-6))


def _check_mid_epoch(path, position, written, order, own_shares):
    """Raises UsageError unless a checkpoint in the middle of an epoch resumes in
    the example order it was written in (`written`, its `Run.order` with this
    run's values where it records none): the same global batch, seed and
    training examples and, where each worker reads its own share
    (`own_shares`), as many workers (`engine.shard`; on torch, replicas).
    Another would train some examples twice and skip others. What an older
    checkpoint does not record, or a stream of unknown size, is not checked."""
    where = f"{path} stops in the middle of epoch {position.epoch + 1}"
    if written["global_batch_size"] != order["global_batch_size"]:
        raise UsageError(
            f"{where}, after {position.step_in_epoch} global batches of "
            f"{written['global_batch_size']}; this run's global batch is "
            f"{order['global_batch_size']} (--batch-size-per-replica x replicas): resume "
            f"with a global batch of {written['global_batch_size']} to finish the epoch, "
            "or --no-resume")
    if written["seed"] != order["seed"]:
        raise UsageError(
            f"{where}, in the example order of seed {written['seed']}; this run's is "
            f"{order['seed']}: resume with --seed {written['seed']} to finish the epoch, "
            "or --no-resume")
    if written["train_examples"] != order["train_examples"] and None not in (
            written["train_examples"], order["train_examples"]):
        raise UsageError(
            f"{where}, in an order of {written['train_examples']:,} training examples; "
            f"this run has {order['train_examples']:,}: resume with that training data to "
            "finish the epoch, or --no-resume")
    if own_shares and written["workers"] != order["workers"]:
        raise UsageError(
            f"{where}, where each of {written['workers']} processes read its own share of "
            f"the training data; this run has {order['workers']} such: resume with "
            f"{written['workers']} (workers; on torch, replicas) to finish the epoch, or "
            "--no-resume")
