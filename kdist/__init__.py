"""kdist: one custom Keras 3 training loop, data-parallel on TensorFlow, JAX and PyTorch.

The public API is what this module exports. `import kdist` loads no
framework, so `kdist.prepare_environment(replicas=N)` can still set device
counts before Keras loads; the other names load their modules on first use.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # What type checkers see; at run time `__getattr__` loads each name.
    from kdist import random as random
    from kdist.checkpoints import latest_checkpoint as latest_checkpoint
    from kdist.config import OPTIMIZERS as OPTIMIZERS
    from kdist.config import TrainConfig as TrainConfig
    from kdist.datasets.fashion_mnist import load_fashion_mnist as load_fashion_mnist
    from kdist.datasets.fashion_mnist import synthetic_fashion_mnist as synthetic_fashion_mnist
    from kdist.engines.joining import connect as connect
    from kdist.engines.joining import is_chief as is_chief
    from kdist.errors import CheckpointError as CheckpointError
    from kdist.errors import DataError as DataError
    from kdist.errors import Interrupted as Interrupted
    from kdist.errors import InvalidCheckpoint as InvalidCheckpoint
    from kdist.errors import KdistError as KdistError
    from kdist.errors import LockHeld as LockHeld
    from kdist.errors import MetricsError as MetricsError
    from kdist.errors import TrainingError as TrainingError
    from kdist.errors import UsageError as UsageError
    from kdist.errors import WorkerLost as WorkerLost
    from kdist.inputs.arrays import Dataset as Dataset
    from kdist.inputs.base import Inputs as Inputs
    from kdist.inputs.tfrecords import TFRecords as TFRecords
    from kdist.loop.evaluation import evaluate_checkpoint as evaluate_checkpoint
    from kdist.loop.result import TrainingResult as TrainingResult
    from kdist.loop.training import train_and_evaluate as train_and_evaluate
    from kdist.models.cnn import create_model as create_model
    from kdist.runtime.startup import prepare_environment as prepare_environment
    from kdist.step.api import global_batch as global_batch
    from kdist.step.api import grad as grad
    from kdist.step.api import value_and_grad as value_and_grad
    from kdist.workers.interrupt import StopRequest as StopRequest
    from kdist.workers.interrupt import stop_on_signals as stop_on_signals

__version__ = "0.1.0"

_LAZY = {
    "TrainConfig": "kdist.config",
    "OPTIMIZERS": "kdist.config",
    "train_and_evaluate": "kdist.loop.training",
    "evaluate_checkpoint": "kdist.loop.evaluation",
    "TrainingResult": "kdist.loop.result",
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
    "connect": "kdist.engines.joining",  # Several workers: your script joins the others.
    "is_chief": "kdist.engines.joining",
    # Your own step (`kdist.step.api`); `kdist.random` is a module.
    "value_and_grad": "kdist.step.api",
    "grad": "kdist.step.api",
    "global_batch": "kdist.step.api",
    # Errors, all `KdistError`s (kdist.errors, which loads no framework).
    "KdistError": "kdist.errors",
    "UsageError": "kdist.errors",
    "DataError": "kdist.errors",
    "CheckpointError": "kdist.errors",
    "InvalidCheckpoint": "kdist.errors",
    "LockHeld": "kdist.errors",
    "MetricsError": "kdist.errors",
    "TrainingError": "kdist.errors",
    "WorkerLost": "kdist.errors",
    "Interrupted": "kdist.errors",
}
__all__ = sorted([*_LAZY, "random"])


def __getattr__(name: str) -> Any:
    if name == "random":
        return importlib.import_module("kdist.random")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kdist' has no attribute {name!r}")
