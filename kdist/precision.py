"""Mixed precision: the Keras dtype policy a run's model is built under.

`--precision` (`TrainConfig.precision`) names a Keras dtype policy, or none:

- None (the default): Keras' global policy as the caller left it (float32
  unless changed with `keras.config.set_dtype_policy` or `set_floatx`).
- "float32": everything in float32.
- "mixed_bfloat16": layers compute in bfloat16, their variables stay float32.
- "mixed_float16": layers compute in float16, variables stay float32, and
  Keras' `compile` wraps the optimizer in a `keras.optimizers.LossScaleOptimizer`
  (dynamic loss scaling; `kdist.step` scales the loss, the optimizer unscales
  the summed gradients and skips a step whose gradients are not finite).

`policy(precision)` sets Keras' global policy while `model_fn` builds and
compiles the model (`kdist.loop.building.build`) and restores the caller's policy
afterwards. Layers keep the policy they were created with, so a user's layer
with its own `dtype=` keeps it. Variables stay float32 under every policy,
so checkpoints move between precisions (`kdist.checkpoints.ckptfile.load`).

Importing this module imports no framework: the command line checks the
flag before TensorFlow or JAX load.
"""

import contextlib

from kdist.errors import UsageError

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")  # --precision's choices.
DEFAULT_PRECISION = PRECISIONS[0]  # kdist-bench's.


def check_precision(precision, name="precision"):
    """Raises UsageError unless `precision` is one of `PRECISIONS`."""
    if precision not in PRECISIONS:
        raise UsageError(f"{name} must be one of {', '.join(PRECISIONS)}, got {precision!r}")


@contextlib.contextmanager
def policy(precision):
    """Keras' global dtype policy set to `precision` inside the block, the
    previous one restored after it (also on an error). None: unchanged."""
    if precision is None:
        yield
        return
    check_precision(precision)
    import keras  # Here: this module loads before any framework.

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)
