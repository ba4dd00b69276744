"""One small module per backend behind one narrow interface.

An engine has `num_replicas`, `devices`, `scope()`, `prepare(model,
optimizer, global_batch_size, loss_fn)`, `distribute(chunk)` (a list of K
global numpy batches), `train_step(chunk)`, `eval_step(chunk)` and
`sync_to_model()`. A step call runs the K steps in one compiled call and
returns the dict of `kdist.losses.batch_statistics`, summed over replicas,
as arrays of shape (K,): one value per step.
"""

import importlib

import keras

from kdist.startup import UsageError

BACKENDS = ("tensorflow", "jax")


def create_engine(replicas=None, distributed=True):
    """The engine of the active Keras backend (`KERAS_BACKEND`)."""
    backend = keras.backend.backend()
    if backend not in BACKENDS:
        raise UsageError(f"KERAS_BACKEND={backend} is not supported; "
                         f"use one of {', '.join(BACKENDS)}")
    module = importlib.import_module(f"kdist.engines.{backend}")
    return module.Engine(replicas=replicas, distributed=distributed)
