"""The random numbers behind `kdist.random`: drawn on the host, fed with each batch.

The building run of a step (`kdist.step.program.Program.build`) records
the draws the step makes: per call, its kind and the shape of one example's
row. For every batch the loop then draws them for the whole global batch
with NumPy, from (seed, phase, epoch, step), and each worker keeps the
rows of its examples, as it does with the data (`kdist.inputs.batching.worker_rows`);
the engine splits them over replicas along with the batch. Inside the
step, `take` hands them out in call order.
"""

import numpy as np
from keras import ops
from keras.src.backend.common.symbolic_scope import in_symbolic_scope  # Keras inferring shapes.

from kdist.errors import UsageError
from kdist.step import context as step_context

TRAIN, EVALUATE = 0, 1
"""Phases: training steps draw by (epoch, step); evaluation by step alone, so every
epoch's evaluation sees the same numbers."""


def take(kind, shape):
    """The next draw of the step in progress: standard normal or uniform in [0, 1);
    zeros of `shape` where Keras calls a layer symbolically to infer its output
    (a functional model built on `keras.Input`s)."""
    if step_context.active_or_none() is None and in_symbolic_scope():
        return ops.zeros(shape)
    context = step_context.current()
    shape = tuple(int(d) for d in shape)
    if not shape or shape[0] != context.rows:
        building = (" in the run that builds the step, on a few sample rows; take them from "
                    "ops.shape(x)[0], not from the batch size") if context.dry else ""
        raise UsageError(f"kdist.random.{kind}{shape}: its first axis must be the rows of the "
                         f"batch the step sees ({context.rows}{building}), one row per "
                         "example, so that every replica draws its examples' rows")
    if context.dry:
        context.recorded_draws.append((kind, shape[1:]))
        rng = np.random.default_rng(len(context.recorded_draws))
        return ops.convert_to_tensor(_draw(rng, kind, shape))
    index = context.draws_taken
    context.draws_taken += 1
    if index >= len(context.draws):
        raise UsageError(f"the step made more kdist.random draws than in its first run "
                         f"({len(context.draws)}); draw the same each step")
    value = context.draws[index]
    if tuple(ops.shape(value)) != shape:
        raise UsageError(f"kdist.random.{kind}{shape} where the step's first run drew "
                         f"{tuple(ops.shape(value))}; draw the same shapes each step")
    return value


def _draw(rng, kind, shape):
    if kind == "normal":
        return rng.standard_normal(shape, dtype=np.float32)
    return rng.random(shape, dtype=np.float32)


def for_batch(specs, seed, phase, epoch, step, global_rows, rows=slice(None)):
    """The draws of one batch: per spec, the global batch's rows, then `rows` of them."""
    if not specs:
        return ()
    rng = np.random.default_rng([seed, phase, epoch, step])
    return tuple(_draw(rng, kind, (global_rows,) + tuple(shape))[rows] for kind, shape in specs)


def attach(batches, specs, seed, phase, epoch, first_step, global_rows, rows):
    """(x, y, sample_weight, draws) for each (x, y, sample_weight) of `batches`,
    counted from step `first_step`."""
    for step, batch in enumerate(batches, start=first_step):
        yield tuple(batch) + (for_batch(specs, seed, phase, epoch, step, global_rows, rows),)
