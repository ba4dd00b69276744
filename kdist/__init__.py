"""kdist: one custom Keras 3 training loop, data-parallel on TensorFlow, JAX and PyTorch.

The public API is what this module exports. `import kdist` loads no
framework, so `kdist.prepare_environment(replicas=N)` can still set device
counts before Keras loads; the other names load their modules on first use.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "TrainConfig": "kdist.config",
    "OPTIMIZERS": "kdist.config",
    "train_and_evaluate": "kdist.loop.training",
    "evaluate_checkpoint": "kdist.loop.training",
    "create_model": "kdist.models.cnn",
    "Dataset": "kdist.inputs.arrays",
    "Inputs": "kdist.inputs.base",
    "TFRecords": "kdist.inputs.tfrecords",
    "load_fashion_mnist": "kdist.datasets.fashion_mnist",
    "synthetic_fashion_mnist": "kdist.datasets.fashion_mnist",
    "latest_checkpoint": "kdist.checkpoints",
    "StopRequest": "kdist.workers.interrupt",
    "stop_on_signals": "kdist.workers.interrupt",
    "prepare_environment": "kdist.runtime.startup",
    # Errors, all `KdistError`s (kdist.errors, which loads no framework).
    "KdistError": "kdist.errors",
    "UsageError": "kdist.errors",
    "DataError": "kdist.errors",
    "CheckpointError": "kdist.errors",
    "InvalidCheckpoint": "kdist.errors",
    "LockHeld": "kdist.errors",
    "MetricsError": "kdist.errors",
    "TrainingError": "kdist.errors",
    "Interrupted": "kdist.errors",
}
__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kdist' has no attribute {name!r}")
