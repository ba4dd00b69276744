"""Running a backend's compiled chunks over NumPy batches, and adding up what they return.

The loop (`kdist.training`) and the benchmarks call these; the engine
(`kdist.engines.contract.Engine`) runs each chunk. Statistics are the dicts
of `kdist.step.Step`: `totals` is their sum over steps, as float64 NumPy
arrays (as lists in a checkpoint's metadata, `kdist.records.Position`).
"""

import itertools

import numpy as np

from kdist import data
from kdist.errors import UsageError
from kdist.step import LOSS_KEYS


def zero_totals(step):
    """Totals of no steps, for `step` (a `kdist.step.Step`)."""
    return {key: np.zeros(np.shape(reset), np.float64)
            for key, reset in zip(step.keys, [0.0] * len(LOSS_KEYS) + step.reset_values)}


def totals_from_json(values, step):
    """Totals read back from a checkpoint; None unless they fit `step`'s metrics.

    Totals written before kdist counted skipped steps have no `skipped`:
    none was skipped then."""
    if values is not None and "skipped" not in values:
        values = dict(values, skipped=0.0)
    if values is None or set(values) != set(step.keys):
        return None
    totals = {k: np.asarray(v, np.float64) for k, v in values.items()}
    zero = zero_totals(step)
    return totals if all(totals[k].shape == zero[k].shape for k in zero) else None


def run_steps(engine, step_fn, batches, totals, on_step=None, should_stop=None,
              steps_per_execution=1):
    """Runs `step_fn` over numpy batches, adding their statistics into `totals`.

    Batches go to the engine in chunks of `steps_per_execution`, one compiled
    call each (a short last chunk is padded with copies of its last batch
    that the engine skips, so every call has the same shapes); statistics come back
    once per chunk and are then accounted step by step (`on_step(steps done,
    step stats, totals, last step of its chunk)`). After each chunk
    `should_stop()` is called, on every worker at the same point; when it
    returns true, no further chunk runs. Returns (totals, steps run).
    """
    totals = {k: np.array(v, np.float64) for k, v in totals.items()}
    done = 0
    for chunk in _chunks(batches, steps_per_execution):
        for batch in chunk:  # This worker's part of a global batch, over its replicas.
            rows = data.num_examples(batch[0])
            if rows % engine.num_local_replicas:
                raise UsageError(f"a batch of {rows} does not split evenly across "
                                 f"{engine.num_local_replicas} replicas; use a global batch "
                                 f"size that is a multiple of {engine.num_replicas}")
        padded = stack_chunk(chunk + [chunk[-1]] * (steps_per_execution - len(chunk)))
        per_step = {k: np.asarray(v) for k, v in
                    step_fn(engine.distribute(padded), len(chunk)).items()}
        for i in range(len(chunk)):
            stats = {k: v[i] for k, v in per_step.items()}
            for key in totals:
                totals[key] += stats[key]
            done += 1
            if on_step is not None:
                on_step(done, stats, totals, i == len(chunk) - 1)
        if should_stop is not None and should_stop():
            break
    return totals, done


def stack_chunk(batches):
    """K batches of (x, y, sample_weight) -> one of arrays shaped (K, batch, ...)."""
    return tuple(data.map_arrays(lambda *arrays: np.stack(arrays), *parts)
                 for parts in zip(*batches))


def _chunks(iterable, size):
    iterator = iter(iterable)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def evaluate(engine, step, x, y, sample_weight, global_batch_size, steps_per_execution=1):
    """{"loss": ..., each metric: ...} over every example of (x, y, sample_weight), once.

    Full global batches run in chunks as in training (a compiled call runs
    at most as many steps as there are batches); the examples left over run
    as one smaller batch (`engine.eval_whole`), so nothing is padded and
    every metric, whatever it computes, sees exactly the evaluation set.
    """
    totals = zero_totals(step)
    full = data.eval_steps(data.num_examples(x), global_batch_size)
    if full:
        totals, _ = run_steps(engine, engine.eval_chunk,
                              data.eval_batches(x, y, sample_weight, global_batch_size,
                                                shard=engine.shard),
                              totals, steps_per_execution=min(steps_per_execution, full))
    tail = data.eval_tail(x, y, sample_weight, global_batch_size)
    if tail is not None:
        for key, value in engine.eval_whole(tail).items():
            totals[key] += np.asarray(value, np.float64)
    return step.results(totals)
