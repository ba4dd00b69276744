"""Running a backend's compiled chunks over NumPy batches, and adding up what they return.

The loop (`kdist.loop.training`) and the benchmarks call these; the engine
(`kdist.engines.contract.Engine`) runs each chunk. Statistics are the dicts
of `kdist.step.compiled.Step`: `totals` is their sum over steps, as float64 NumPy
arrays (as lists in a checkpoint's metadata, `kdist.records.Position`).
"""

import itertools

import numpy as np

from kdist import tree
from kdist.errors import UsageError
from kdist.inputs import arrays
from kdist.inputs.batching import worker_rows
from kdist.loop import prefetch
from kdist.step import draws


def zero_totals(step):
    """Totals of no steps, for `step` (a `kdist.step.compiled.Step`)."""
    return {key: np.zeros(shape, np.float64) for key, shape in step.statistic_shapes().items()}


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
              steps_per_execution=1, before_chunk=None, after_chunk=None, ending=None):
    """Runs `step_fn` over numpy batches, adding their statistics into `totals`.

    Batches go to the engine in chunks of `steps_per_execution`, one engine
    call each (a short last chunk is padded with copies of its last batch
    that the engine skips, so every call has the same shapes); the next
    chunk is read, stacked and placed on the replicas (`engine.distribute`)
    on a background thread while the current one runs (`kdist.loop.prefetch`),
    so this thread only dispatches the calls. Statistics come back once per chunk and are
    then accounted step by step (`on_step(steps done, step stats, totals,
    last step of its chunk)`); `before_chunk(steps done)` is called before each
    chunk runs. After each chunk `should_stop()` is called, on every worker at
    the same point, then `after_chunk(steps done, totals, stopping)` with its
    answer; when it is true, no further chunk runs. `ending`, the
    `kdist.inputs.base.Stream` of a worker's own share (whose length may differ
    between workers): before each chunk the workers
    agree on its step count (`_agreed_steps`), and the epoch ends, on every
    worker, at the first step some worker lacks. Returns (totals, steps run).
    """
    totals = {k: np.array(v, np.float64) for k, v in totals.items()}
    done = 0
    chunks = prefetch.Prefetched((engine.distribute(padded), count) for padded, count
                                 in _stacked_chunks(engine, batches, steps_per_execution))
    read = chunks if ending is None else itertools.chain(chunks, [(None, 0)])
    try:
        for chunk, count in read:
            if ending is not None:
                agreed = _agreed_steps(engine, count, steps_per_execution)
                if agreed < steps_per_execution:
                    ending.end_agreed()  # After this chunk, if any: some share ran out.
                if agreed == 0:
                    break
                count = agreed
            if before_chunk is not None:
                before_chunk(done)
            per_step = {k: np.asarray(v) for k, v in step_fn(chunk, count).items()}
            for i in range(count):
                stats = {k: v[i] for k, v in per_step.items()}
                for key in totals:
                    totals[key] += stats[key]
                done += 1
                if on_step is not None:
                    on_step(done, stats, totals, i == count - 1)
            stopping = should_stop is not None and should_stop()
            if after_chunk is not None:
                after_chunk(done, totals, stopping)
            if stopping:
                break
            if ending is not None and count < steps_per_execution:
                break
    finally:
        chunks.close()
    return totals, done


def _agreed_steps(engine, count, size):
    """The step count every worker has for the next chunk: `count` where every
    worker has a full chunk of `size` (one collective), else the smallest of the
    workers' counts (one collective more per step it counts, once an epoch)."""
    if not engine.any_worker(count < size):
        return count
    agreed = 0
    while agreed < size and not engine.any_worker(count <= agreed):
        agreed += 1
    return agreed


def _stacked_chunks(engine, batches, size):
    """Yields (chunk stacked to `size` steps, its real step count) from `batches`."""
    for chunk in _chunks(batches, size):
        chunk = [tuple(b) if len(b) == 4 else tuple(b) + ((),) for b in chunk]  # Draws: none.
        for batch in chunk:  # This worker's part of a global batch, over its replicas.
            rows = tree.num_examples(batch[0])
            if rows % engine.num_local_replicas:
                raise UsageError(f"a batch of {rows} does not split evenly across "
                                 f"{engine.num_local_replicas} replicas; use a global batch "
                                 f"size that is a multiple of {engine.num_replicas}")
        yield stack_chunk(chunk + [chunk[-1]] * (size - len(chunk))), len(chunk)


def stack_chunk(batches):
    """K batches of (x, y, sample_weight) -> one of arrays shaped (K, batch, ...)."""
    return tuple(tree.map_arrays(lambda *arrays: np.stack(arrays), *parts)
                 for parts in zip(*batches))


def _chunks(iterable, size):
    iterator = iter(iterable)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def evaluate(engine, step, x, y, sample_weight, global_batch_size, steps_per_execution=1):
    """{"loss": ..., each metric: ...} over every example of (x, y, sample_weight), once
    (`evaluate_source` of the arrays)."""
    source = arrays.ArraySource(x, y, sample_weight, "the test data")
    return evaluate_source(engine, step, source, global_batch_size, steps_per_execution)


def evaluate_source(engine, step, source, global_batch_size, steps_per_execution=1, seed=0):
    """{"loss": ..., each metric: ...} over every example of `source` (`kdist.inputs`), once
    (`evaluate_totals`)."""
    return step.results(evaluate_totals(engine, step, source, global_batch_size,
                                        steps_per_execution, seed), "test")


def evaluate_totals(engine, step, source, global_batch_size, steps_per_execution=1, seed=0):
    """The summed statistics of the test step over every example of `source`, once.

    Full global batches run in chunks as in training (a compiled call runs
    at most as many steps as there are batches, where the source knows
    their number); the examples left over run as one smaller batch
    (`engine.eval_whole`), so nothing is padded and every metric, whatever
    it computes, sees exactly the evaluation set. `kdist.random` draws in the
    test step come from `seed` and the batch's place in the evaluation.
    """
    totals = zero_totals(step)
    full = source.eval_steps(global_batch_size)
    chunk = steps_per_execution if full is None else min(steps_per_execution, full)
    tails = []
    specs, rows = step.draws["test"], worker_rows(global_batch_size, engine.shard)

    def full_batches():
        for index, (batch, whole) in enumerate(source.evaluate(global_batch_size,
                                                               engine.shard)):
            if whole:  # Every worker evaluates it whole.
                tails.append(tuple(batch) + (draws.for_batch(
                    specs, seed, draws.EVALUATE, 0, index, tree.num_examples(batch[0])),))
            else:
                yield tuple(batch) + (draws.for_batch(
                    specs, seed, draws.EVALUATE, 0, index, global_batch_size, rows),)

    if chunk:
        totals, _ = run_steps(engine, engine.eval_chunk, full_batches(), totals,
                              steps_per_execution=chunk)
    else:
        for _ in full_batches():  # No full batch: only the tail.
            pass
    for tail in tails:
        for key, value in engine.eval_whole(tail).items():
            totals[key] += np.asarray(value, np.float64)
    return totals
