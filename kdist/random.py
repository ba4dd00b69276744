"""Random draws for a step: the same numbers on any backend, replica count and resume.

Inside a step that kdist runs, `kdist.random.normal((rows, 128))` gives
one row per example of the batch the replica sees. kdist draws them on the
host with NumPy, for the whole global batch, from the run's seed and the
step's place in training, and hands each replica its rows with its batch
(`kdist.step.draws`). So N replicas draw what one device draws, every
backend draws the same numbers, and a resumed run draws what the
uninterrupted run drew. A step makes the same draws, of the same shapes,
at every step.

Keras' own `keras.random` functions work in a step too, with a
`keras.random.SeedGenerator` held by a model (checkpointed with it), but
there each replica draws its own stream and each backend its own numbers.
"""

from typing import Any

from keras import ops

from kdist.step import draws


def normal(shape: tuple[int, ...], mean: float = 0.0, stddev: float = 1.0,
           dtype: str = "float32") -> Any:
    """Normally distributed values of `shape`, whose first axis is the batch's rows."""
    return ops.cast(draws.take("normal", shape) * stddev + mean, dtype)


def uniform(shape: tuple[int, ...], minval: float = 0.0, maxval: float = 1.0,
            dtype: str = "float32") -> Any:
    """Values uniform in [minval, maxval) of `shape`, whose first axis is the batch's rows."""
    return ops.cast(draws.take("uniform", shape) * (maxval - minval) + minval, dtype)
