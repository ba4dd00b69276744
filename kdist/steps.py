"""Running a backend's compiled chunks over NumPy batches, and the statistics they return.

The loop (`kdist.training`) and the benchmarks call these; the engine
(`kdist.engines.contract.Engine`) runs each chunk.
"""

import itertools

import numpy as np

from kdist import data
from kdist.errors import UsageError


def summarize(totals):
    """Mean loss and accuracy (percent) from summed batch statistics."""
    count = totals["count"]
    return totals["loss_sum"] / count, 100.0 * totals["correct"] / count


def zero_totals():
    return dict(loss_sum=0.0, correct=0.0, count=0.0)


def run_steps(engine, step_fn, batches, totals=None, on_step=None, should_stop=None,
              steps_per_execution=1):
    """Runs `step_fn` over numpy batches, adding their statistics into `totals`.

    Batches go to the engine in chunks of `steps_per_execution`, one compiled
    call each (a short last chunk is padded with zero-weight batches that the
    engine skips, so every call has the same shapes); statistics come back
    once per chunk and are then accounted step by step (`on_step(steps done,
    step stats, totals)`). After each chunk `should_stop()` is called, on
    every worker at the same point; when it returns true, no further chunk
    runs. Returns (totals, steps run).
    """
    totals = zero_totals() if totals is None else dict(totals)
    done = 0
    for chunk in _chunks(batches, steps_per_execution):
        for batch in chunk:  # This worker's part of a global batch, over its replicas.
            if len(batch[0]) % engine.num_local_replicas:
                raise UsageError(f"a batch of {len(batch[0])} does not split evenly across "
                                 f"{engine.num_local_replicas} replicas; use a global batch "
                                 f"size that is a multiple of {engine.num_replicas}")
        padding = (chunk[-1][0], chunk[-1][1], np.zeros_like(chunk[-1][2]))
        padded = stack_chunk(chunk + [padding] * (steps_per_execution - len(chunk)))
        per_step = {k: np.asarray(v) for k, v in
                    step_fn(engine.distribute(padded), len(chunk)).items()}
        for i in range(len(chunk)):
            stats = {k: float(v[i]) for k, v in per_step.items()}
            for key in totals:
                totals[key] += stats[key]
            done += 1
            if on_step is not None:
                on_step(done, stats, totals)
        if should_stop is not None and should_stop():
            break
    return totals, done


def stack_chunk(batches):
    """K numpy batches of (x, y, weights) -> (x, y, weights) of shape (K, batch, ...)."""
    return tuple(np.stack(parts) for parts in zip(*batches))


def _chunks(iterable, size):
    iterator = iter(iterable)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def evaluate(engine, images, labels, global_batch_size, steps_per_execution=1):
    """(loss, accuracy %) over every example of (images, labels).

    A compiled call runs at most as many steps as there are batches.
    """
    chunk = min(steps_per_execution, data.eval_steps(len(images), global_batch_size))
    totals, _ = run_steps(engine, engine.eval_chunk,
                          data.eval_batches(images, labels, global_batch_size,
                                            shard=engine.shard),
                          steps_per_execution=chunk)
    return summarize(totals)
