"""One small module per backend behind one narrow interface.

An engine has `num_replicas`, `devices`, `scope()`, `prepare(model,
optimizer, global_batch_size, loss_fn)`, `distribute(stacked)` (K global
numpy batches stacked by `kdist.training.stack_chunk`), `train_step(chunk,
num_steps)`, `eval_step(chunk, num_steps)` and `sync_to_model()`. A step
call runs the chunk's first `num_steps` steps in one compiled call (the
rest is padding, so every call has one shape) and returns the dict of
`kdist.losses.batch_statistics`, summed over replicas, as arrays of shape
(K,): one value per step.
`keras_fit_callbacks()` is what Keras' own `fit` needs to run safely on
the same devices (used by `scripts/bench.py`).

With several workers (`connect`), an engine also says where this process
stands: `shard` = (worker index, worker count) (the slice of every global
batch it feeds), `num_local_replicas` (its own devices) and `is_chief`;
`any_worker(flag)` tells whether `flag` is true on any worker (a collective
that every worker calls at the same point; no communication with one).
"""

import importlib

import keras

from kdist.errors import UsageError  # noqa: F401 (kdist.engines.UsageError, as before)
from kdist.startup import BACKENDS, check_backend  # noqa: F401 (one registry, in startup)


def _backend_module():
    """The engine module of the active Keras backend (`KERAS_BACKEND`)."""
    backend = check_backend(keras.backend.backend())
    return importlib.import_module(f"kdist.engines.{backend}")


def create_engine(replicas=None, distributed=True):
    """The engine of the active Keras backend (`KERAS_BACKEND`)."""
    return _backend_module().Engine(replicas=replicas, distributed=distributed)


def connect(spec, replicas=None):
    """Joins the workers of `spec` (a `kdist.cluster.ClusterSpec`) on the active backend.

    Must run first, before any tensor or Keras object exists: TensorFlow's
    MultiWorkerMirroredStrategy and JAX's distributed runtime both have to be
    set up before the framework runs anything. Engines created afterwards span
    every worker's devices. `replicas` is the device count of this worker.
    """
    _backend_module().connect(spec, replicas)
