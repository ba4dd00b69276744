"""The workers of a run start alike, and its replicas stay alike, or none trains on.

Each worker runs its own copy of the script; kdist broadcasts the chief's
weights, but nothing else of one worker's reaches the others. Workers given
other flags, data or models (another activation, loss weight, precision or
learning rate), or checkpoint folders that are not one folder, would train
on (some hang in a collective, some train from other steps or another model,
some end first). So before the first step every worker sends what its run counts
in, and every worker raises the same `UsageError` where they differ. After
each epoch the replicas compare checksums of their variables
(`check_replicas_equal`).
"""

import json
import os
import re
import zlib

from kdist import tree
from kdist.errors import TrainingError, UsageError

_LIMIT = tree.CHECKSUM_LIMIT  # What `Engine.workers_values` carries exactly.


def check_start(run, sample, latest):
    """The workers of `run` (a `kdist.loop.run.Run`) count in the same batches,
    epochs, data and checkpoint (`latest`: the newest one each sees), or all stop
    here. Where each reads its own share, its sizes and first rows are its own."""
    if run.engine.shard[1] == 1:
        return
    config, dataset = run.config, run.dataset
    facts = {"global batch sizes": run.global_batch, "epochs": config.epochs,
             "seeds": config.seed, "steps per execution": config.steps_per_execution,
             "checkpoint intervals (checksums)": digest(
                 [config.checkpoint_every, config.checkpoint_every_steps,
                  config.checkpoint_every_minutes]),
             "models (checksums of their layers, compiled loss and optimizers)":
                 model_digest(run.step),
             # The step in the checkpoint's name (`ckpt-00000024.weights.h5`): its
             # metadata is checked only as it is restored, after this.
             "resume steps": None if latest is None else int(
                 re.findall(r"\d+", os.path.basename(latest[0]))[0])}
    if not getattr(dataset.train, "own_shares", False):
        facts.update({"steps per epoch": run.steps,
                      "numbers of training examples": dataset.size("train"),
                      "numbers of test examples": dataset.size("test"),
                      "data (checksums of the first rows)": fingerprint(sample)})
        if dataset.test is not None and not getattr(dataset.test, "own_shares", False):
            facts["test data (checksums of the first rows)"] = fingerprint(
                dataset.test.sample())
    _agree(run.engine, facts)


def _agree(engine, facts):
    """Raises the same UsageError on every worker where their `facts`, {name:
    int or None}, differ."""
    names = list(facts)
    encoded = [_encode(facts[name]) for name in names]
    rows = engine.workers_values(encoded)
    for column, name in enumerate(names):
        seen = [row[column] for row in rows]
        if len(set(seen)) > 1:
            values = ", ".join(f"worker {i}: {_decode(v)}" for i, v in enumerate(seen))
            hint = (" (each worker resumes from the newest checkpoint it sees: give every "
                    "worker one checkpoint folder, on a file system they share)"
                    if name == "resume steps" else "")
            raise UsageError(f"the workers start with different {name} ({values}){hint}; "
                             "start every worker with the same script, flags and data")


def check_replicas_equal(engine, epoch, variables):
    """Raises the same TrainingError on every worker where the replicas' `variables`
    (the program's) differ after `epoch` (1-based), naming them: a step changed
    the averaged gradients with what differs between replicas, and each
    replica trained its own model, or it assigned a variable from its
    replica's own share of the batch."""
    local = engine.replica_checksums()
    width = len(local[0])
    rows = engine.workers_values([value for replica in local for value in replica])
    replicas = [row[i:i + width] for row in rows for i in range(0, len(row), width)]
    differ = [v for j, v in enumerate(variables) if len({r[j] for r in replicas}) > 1]
    if not differ:
        return
    names = ", ".join(repr(v.path) for v in differ[:3]) + (
        f" and {len(differ) - 3} more" if len(differ) > 3 else "")
    if any(v.path.endswith("learning_rate") for v in differ):
        why = ("a callback set the learning rate differently on the replicas (each worker, "
               "and on torch each replica process, runs its own copy of the callbacks); "
               "decide it from the logs and the epoch, which every replica shares, not from "
               "a clock, a file or an unseeded draw")
    elif any(v.trainable for v in differ):
        why = ("the step changes the averaged gradients with what differs between replicas "
               "(a replica's own loss value, data, keras.random draws or kdist.random rows), "
               "so each replica trained another model; change them only with what every "
               "replica shares (the gradients, the optimizer's step, constants)")
    else:
        why = ("the step assigns them from each replica's own share of the batch; a "
               "count or a sum of the rows adds up over replicas where the variable is "
               "declared with aggregation=\"sum\", other values must be the same on every "
               "replica")
    raise TrainingError(f"the replicas' variables differ after epoch {epoch} ({names}): "
                        f"{why}; this epoch's checkpoint is not written")


def model_digest(program):
    """A number for what the workers' models must share (a built `Program`'s model,
    layers and optimizers): each layer's class, config
    (its units, activation, dtype policy; not its name) and weight shapes, the
    compiled loss, loss weights and metrics, and each optimizer's config (its
    learning rate). A config Keras cannot give counts as its class alone."""
    def config(thing, method="get_config"):
        try:
            return _nameless(getattr(thing, method)())
        except Exception:  # noqa: BLE001 - a layer of the user's without a config.
            return type(thing).__qualname__

    model = program.model
    layers = [(type(layer).__qualname__, config(layer), [list(w.shape) for w in layer.weights])
              for layer in program.layers if layer is not model]
    compiled = config(model, "get_compile_config") if model.compiled else None
    return digest([layers, compiled, [config(o) for o in program.optimizers]])


def _nameless(value):
    """`value` (a config) without its "name" entries, which Keras numbers per process."""
    if isinstance(value, dict):
        return {k: _nameless(v) for k, v in value.items() if k != "name"}
    if isinstance(value, (list, tuple)):
        return [_nameless(v) for v in value]
    return value


def digest(value):
    """A number for a structure of JSON values; an object else counts as its class."""
    text = json.dumps(value, sort_keys=True, default=lambda o: type(o).__qualname__)
    return zlib.crc32(text.encode())


def fingerprint(batch):
    """A number for some rows of data (`tree` arrays): equal rows, equal numbers."""
    return tree.checksum(tree.leaves(batch))


def _encode(value):
    return _LIMIT - 1 if value is None else int(value) % (_LIMIT - 1)


def _decode(value):
    return "none" if value == _LIMIT - 1 else value
