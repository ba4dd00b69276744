"""A run's settings and their one source: `TrainConfig`, its defaults, help and choices.

Each `TrainConfig` field carries its command-line help in its metadata
(`"help"`, and `"flag"` where the flag is not `--` plus the field name with
dashes, or None where the field has no flag), so `kdist.cli` derives the
train flags from the fields; other callers (`evaluate_checkpoint`,
`kdist.bench.measure`) take their defaults from `TrainConfig`'s class attributes.
`OPTIMIZERS` is the registry behind `--optimizer`, `DEFAULT_LEARNING_RATE` their
learning rate where a run sets none.

Importing this module imports no framework: the command line builds its
parser from it before TensorFlow or JAX load (the optimizers import Keras
when called).
"""

import dataclasses
import numbers
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from kdist import checks
from kdist.precision import PRECISIONS

if TYPE_CHECKING:
    import keras

DEFAULT_LEARNING_RATE = 1e-3  # Of the optimizers kdist builds (--optimizer).


def _setting(default, help, flag="", choices=None, metavar=None):
    """A field with a default and its flag's help; `flag` None: no flag, "": the default
    name; `choices`: the values the flag takes; `metavar`: its value's name in --help."""
    metadata = {"help": help} if flag == "" else {"help": help, "flag": flag}
    if choices is not None:
        metadata["choices"] = choices
    if metavar is not None:
        metadata["metavar"] = metavar
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class TrainConfig:
    """Everything that shapes a run; each field is also a train.py flag (see the metadata)."""

    epochs: int = _setting(10, "training epochs")
    batch_size_per_replica: int = _setting(
        64, "examples per replica per step; the global batch is this times the replica count")
    learning_rate: float | None = _setting(
        None, f"learning rate of --optimizer (default {DEFAULT_LEARNING_RATE:g}); for a model "
              "compiled in model_fn, None: its optimizer has its own")
    replicas: int | None = _setting(
        None, "data-parallel replicas (default: every visible device; on a CPU-only machine "
              "N splits the CPU into N devices; on torch, N processes, which kdist starts)")
    checkpoint_dir: str = _setting("./training_checkpoints", "folder for checkpoints",
                                   metavar="DIR")
    checkpoint_every: int = _setting(2, "checkpoint every N epochs, and always after the last")
    checkpoint_every_steps: int | None = _setting(
        None, "also checkpoint after the compiled chunk of steps in which the global step "
              "reaches a multiple of N, in the middle of an epoch too")
    checkpoint_every_minutes: float | None = _setting(
        None, "also checkpoint after the first chunk of steps that ends M minutes or more "
              "after the run's start or its last checkpoint (workers agree on the step)",
        metavar="M")
    keep: int = _setting(3, "checkpoints to keep")
    resume: bool = _setting(
        True, "start over even if --checkpoint-dir holds a checkpoint (default: resume from "
              "the newest one)", flag="--no-resume")
    seed: int = _setting(0, "seed for weights and data order")
    steps_per_epoch: int | None = _setting(
        None, "train on only the first N global batches of each epoch (default: the whole "
              "epoch)")
    steps_per_execution: int = _setting(
        8, "train steps run per chunk (TensorFlow: one compiled call); statistics come "
        "back once per chunk")
    precision: str | None = _setting(
        None, "the Keras dtype policy the model is built under: float32; mixed_bfloat16 or "
        "mixed_float16, layers computing in bfloat16 or float16 with float32 variables "
        "(mixed_float16 adds dynamic loss scaling); default: Keras' global policy, as "
        "keras.config.set_dtype_policy or set_floatx left it (float32 unless changed); a "
        "layer created with its own dtype keeps it",
        choices=PRECISIONS)
    metrics_file: str | None = _setting(
        None, "write one JSON object per epoch (and one for the restored model) to this file, "
              "and the epochs as CSV to PATH with .csv in place of its suffix; a fresh run "
              "empties both, a resumed one rewrites them from its checkpoint", metavar="PATH")
    tensorboard: str | None = _setting(
        None, "write TensorBoard event files to this folder, laid out as Keras' TensorBoard "
              "callback's: per epoch, and after every compiled chunk of steps (needs the "
              "tensorboard package: pip install 'kdist[tensorboard]')", metavar="DIR")
    progress: bool = _setting(False, "show a progress bar (the CLI: on in a terminal, "
                                     "unless --quiet)", flag=None)
    break_lock: bool = _setting(
        False, "take --checkpoint-dir even if another run holds its lock (only when that run "
               "is gone; a lock whose process has ended on this host is taken over without "
               "it)")

    def __post_init__(self):
        for field in dataclasses.fields(self):  # NumPy's numbers as Python's, paths as text.
            value = getattr(self, field.name)
            if isinstance(value, bool) or type(value) in (int, float, str):
                continue
            if isinstance(value, numbers.Integral):  # np.int64(16), read from an array.
                setattr(self, field.name, int(value))
            elif isinstance(value, numbers.Real) and "float" in str(field.type):
                setattr(self, field.name, float(value))
            elif isinstance(value, os.PathLike):
                setattr(self, field.name, os.fspath(value))
        checks.check_config(self)


def flag_fields():
    """The `TrainConfig` fields that are command-line flags, in field order."""
    return [f for f in dataclasses.fields(TrainConfig) if f.metadata.get("flag", "") is not None]


def flag_name(field):
    """The flag of `field`: its metadata's "flag", else `--` and its name with dashes."""
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def adam(learning_rate: float) -> "keras.optimizers.Optimizer":
    import keras  # Here, not above: this module loads before any framework.

    return keras.optimizers.Adam(learning_rate)


def sgd(learning_rate: float) -> "keras.optimizers.Optimizer":
    """Plain SGD: its step is linear in the gradient, so tests can compare runs exactly."""
    import keras

    return keras.optimizers.SGD(learning_rate)


# --optimizer's choices; the first is the default.
OPTIMIZERS: dict[str, Callable[[float], "keras.optimizers.Optimizer"]] = {"adam": adam, "sgd": sgd}
DEFAULT_OPTIMIZER = next(iter(OPTIMIZERS))
