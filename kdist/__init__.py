"""kdist: one custom Keras 3 training loop, data-parallel on TensorFlow and JAX.

`import kdist` loads no framework, so `kdist.startup.prepare_environment`
can still set device counts. The heavy modules load on first use:
`kdist.training`, `kdist.data`, `kdist.model`, `kdist.checkpoints`.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "TrainConfig": "kdist.training",
    "train_and_evaluate": "kdist.training",
    "evaluate_checkpoint": "kdist.training",
    "create_model": "kdist.model",
    "load_fashion_mnist": "kdist.data",
    "synthetic_fashion_mnist": "kdist.data",
    "prepare_environment": "kdist.startup",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kdist' has no attribute {name!r}")
