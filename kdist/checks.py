"""Checks of a run's settings and output paths, made before any work starts.

Importing this module imports no framework (nor NumPy), so the command line
runs the same checks before TensorFlow or JAX load; `train_and_evaluate`
runs them again for library callers. Every failure is a `UsageError`: one
line that names the setting and what to change.
"""

import importlib.util
import math
import os
import sys

from kdist.errors import UsageError
from kdist.precision import check_precision

SEED_RANGE = (0, 2**32 - 1)  # What NumPy's global seed (keras.utils.set_random_seed) takes.


def check_seed(seed, name="seed"):
    """Raises UsageError unless `seed` is a whole number NumPy's seeding takes."""
    low, high = SEED_RANGE
    if isinstance(seed, bool) or not isinstance(seed, int) or not low <= seed <= high:
        raise UsageError(f"{name} must be a whole number in {low}..{high}, got {seed!r}")


def check_model_fn(model_fn, name="model_fn"):
    """Raises UsageError unless `model_fn` is a function to call, not a Keras model
    (a model is callable too: calling it with no inputs fails in Keras)."""
    keras = sys.modules.get("keras")  # A model exists only once Keras is imported.
    if keras is not None and isinstance(model_fn, keras.Model):
        raise UsageError(f"{name} is the model {model_fn.name!r} itself; pass the function "
                         "that builds it (kdist calls it in its engine's scope)")
    if not callable(model_fn):
        raise UsageError(f"{name} must be a function that builds the model, got "
                         f"{type(model_fn).__name__}")


def check_positive(value, name, kind=int, optional=False):
    """Raises UsageError unless `value` is a finite `kind` above 0 (or None if `optional`)."""
    if value is None and optional:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        number = number and isinstance(value, int)
    if not number or not math.isfinite(value) or value <= 0:
        what = "a whole number" if kind is int else "a finite number"
        raise UsageError(f"{name} must be {what} greater than 0, got {value!r}")


def check_config(config):
    """Checks the fields of a `kdist.TrainConfig`; raises UsageError for the first bad one."""
    for name in ("epochs", "batch_size_per_replica", "checkpoint_every", "keep",
                 "steps_per_execution"):
        check_positive(getattr(config, name), name)
    if config.learning_rate is not None:
        check_positive(config.learning_rate, "learning_rate", kind=float)
    check_positive(config.replicas, "replicas", optional=True)
    check_positive(config.steps_per_epoch, "steps_per_epoch", optional=True)
    check_positive(config.checkpoint_every_steps, "checkpoint_every_steps", optional=True)
    check_positive(config.checkpoint_every_minutes, "checkpoint_every_minutes", kind=float,
                   optional=True)
    check_seed(config.seed)
    for name in ("checkpoint_dir", "metrics_file", "tensorboard"):
        path = getattr(config, name)
        if not (isinstance(path, str) and path) and (path is not None or name == "checkpoint_dir"):
            raise UsageError(f"{name} must be a path (text or a pathlib.Path), got {path!r}")
    if config.precision is not None:
        check_precision(config.precision)


def metrics_csv_path(path):
    """The CSV sibling of metrics file `path`: `path` with `.csv` in place of its suffix."""
    return os.path.splitext(path)[0] + ".csv"


def check_metrics_file(path, name="--metrics-file"):
    """Raises UsageError unless the metrics file and its CSV sibling can be written.

    `path` must not end in `.csv` (its CSV sibling would be the file itself);
    both files must be in an existing, writable folder and must not be
    folders or read-only files themselves.
    """
    if path is None:
        return
    if os.path.splitext(path)[1].lower() == ".csv":
        raise UsageError(f"{name} {path}: the JSON lines file must not end in .csv (the CSV "
                         f"goes beside it, named with .csv in place of its suffix); use e.g. "
                         f"{os.path.splitext(path)[0]}.jsonl")
    for target in (path, metrics_csv_path(path)):
        check_writable_file(target, name)


def check_tensorboard(path, name="--tensorboard"):
    """Raises UsageError unless the `tensorboard` package is installed and `path` can
    hold its event files (None: nothing to check). Imports nothing."""
    if path is None:
        return
    if importlib.util.find_spec("tensorboard") is None:
        raise UsageError(f"{name} needs the tensorboard package: pip install "
                         "'kdist[tensorboard]'")
    check_output_folder(path, name)


def check_output_folder(path, name):
    """Raises UsageError unless `path` is a writable folder or can be created as one."""
    if path is None:
        return
    existing = nearest_existing(path)
    if not os.path.isdir(existing):
        raise UsageError(f"{name} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK):
        raise UsageError(f"{name} {path}: {existing} is not writable")


def nearest_existing(path):
    """`path`, made absolute, or its nearest ancestor that exists: where that is a
    file, `path` cannot be made as a folder."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing


def check_writable_file(path, name):
    """Raises UsageError unless `path` can be created or overwritten as a file."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        problem = "is a folder"
    elif not os.path.isdir(folder):
        problem = f"is in {folder}, which is not an existing folder"
    elif os.path.exists(path) and not os.access(path, os.W_OK):
        problem = "is not writable"
    elif not os.access(folder, os.W_OK | os.X_OK):
        problem = f"is in {folder}, which is not writable"
    else:
        return
    raise UsageError(f"{name} {path}: {problem}; pass a file path in a folder you can write")
