"""What a step returns: its logs, flattened and read as `fit` reads them.

A step returns a dict of scalars and metric results. `flat` flattens nested
dicts as Keras' `pythonify_logs` does; `read` turns each value into a tensor
or refuses it; `results_recorded` tells which log keys are a metric's
`result()` returned under another name (the Keras guides' VAE returns its
"total_loss" tracker as "loss"), so that kdist merges them as the metric.
"""

import contextlib
from typing import Any

import keras
import numpy as np
from keras import ops

from kdist.errors import UsageError


def flat(logs):
    """`logs` with each nested dict's entries in its place, as `fit` flattens them:
    the Keras guide's step returns the compiled metrics' `result()`, a dict,
    under "compile_metrics", and a metric whose result is a dict reports its
    entries. Where a name repeats, the value is the one `fit` keeps (it walks
    the keys sorted, the last one wins); the keys keep the order of their
    first appearance."""
    kept = _entries(logs, key=lambda item: item[0])
    return {name: kept[name] for name in _entries(logs, key=None)}


def _entries(logs, key):
    items = sorted(logs.items(), key=key) if key else logs.items()
    entries: dict[str, Any] = {}
    for name, value in items:
        entries.update(_entries(value, key) if isinstance(value, dict) else {name: value})
    return entries


def read(phase, name, logged):
    """What a step returned under `name`, read inside its scope: a variable's value
    after the step's assignments (not the variable, read later), a Python or
    NumPy number as a tensor; None and tensors as they are. Anything else (a
    string, a list) is a `UsageError`: kdist reports numbers."""
    if isinstance(logged, keras.Variable):
        return logged.value
    if isinstance(logged, (int, float, np.number, np.ndarray)):
        return ops.convert_to_tensor(logged, "float32")
    if logged is None or ops.is_tensor(logged):
        return logged
    raise UsageError(
        f"the {phase}_step returns {name!r}, a {type(logged).__name__}; return scalars "
        "(kdist averages them over examples, replicas and workers) or the results of "
        "the model's metrics")


@contextlib.contextmanager
def results_recorded(metrics):
    """Yields `returned_as(logs)`: {key: metric result name} for each key of a
    step's flat logs whose value is the very tensor a metric's `result()`
    returned while inside."""
    returned: dict[int, tuple[str, Any]] = {}

    def recording(metric, result):
        def recorded(*args, **kwargs):
            value = result(*args, **kwargs)
            named = flat(value) if isinstance(value, dict) else {metric.name: value}
            returned.update({id(v): (name, v) for name, v in named.items()})
            return value
        return recorded

    def returned_as(logs):
        return {key: returned[id(value)][0] for key, value in logs.items()
                if id(value) in returned and returned[id(value)][1] is value}

    for metric in metrics:
        metric.__dict__["result"] = recording(metric, metric.result)
    try:
        yield returned_as
    finally:
        for metric in metrics:
            metric.__dict__.pop("result", None)
