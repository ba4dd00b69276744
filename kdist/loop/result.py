"""What `train_and_evaluate` returns: the trained model, its history, the restored evaluation."""

import dataclasses
import warnings
from typing import Any, ClassVar

from kdist.records import EpochRecord


@dataclasses.dataclass
class TrainingResult:
    """The outcome of `kdist.train_and_evaluate`.

    Attributes:
        model: the trained model, built again by `model_fn` with no
            distribution and holding the trained weights (as they are after
            every callback's `on_train_end`: `EarlyStopping(
            restore_best_weights=True)` leaves the best ones, as in `fit`;
            with `use_ema=True` the optimizer's moving averages, as `fit`
            ends), ready for `predict`, `save` and `export`. Its optimizers and
            random seed states are the newest checkpoint's (step counter,
            moments, learning rate), so `fit` goes on from it as from that
            checkpoint.
        history: per Keras name, a list of one value per epoch, as
            `keras.callbacks.History().history`: "loss" and each metric on
            the training data, "val_loss" and "val_" each metric on the test
            data.
        epochs: one `EpochRecord.as_dict()` per epoch ("epoch", "train_loss",
            "test_loss", "seconds", "samples_per_sec", ...), as in the
            metrics file.
        restored: the evaluation of the newest checkpoint in a fresh model
            with no distribution ({"restored": True, "checkpoint": path,
            "test_loss": ..., ...}); None on a worker other than the chief and
            for a model with no `test_step`.
        stopped_by_callback: whether a callback ended training early
            (`model.stop_training = True`).
    """

    model: Any
    history: dict[str, list[float | str]]
    epochs: list[dict[str, Any]]
    restored: dict[str, Any] | None
    stopped_by_callback: bool = False
    # What a replica process sends to the process that started it, in place of a model
    # and callbacks: the trained weights as NumPy arrays, and the callbacks' attributes
    # (`kdist.loop.callback_states.portable_states`).
    weights: list[Any] | None = dataclasses.field(default=None, repr=False)
    callback_states: list[dict[str, Any]] | None = dataclasses.field(default=None, repr=False)

    _OLD_KEYS: ClassVar[dict[str, str]] = {"history": "epochs", "restored": "restored"}

    def __getitem__(self, key: str) -> Any:
        """The dict that kdist 0.1's `train_and_evaluate` returned: `result.epochs`
        is `result.epochs`, `result.restored` is `result.restored` (deprecated)."""
        if key not in self._OLD_KEYS:
            raise KeyError(key)
        warnings.warn(f'result["{key}"] is deprecated: use result.{self._OLD_KEYS[key]}',
                      DeprecationWarning, stacklevel=2)
        return getattr(self, self._OLD_KEYS[key])


def keras_history(records: tuple[EpochRecord, ...]) -> dict[str, list[float | str]]:
    """{"loss": [...], "accuracy": [...], "val_loss": [...], ...} of `records`, with
    the keys in the order of the first record."""
    history: dict[str, list[float | str]] = {}
    for record in records:
        for key, value in epoch_logs(record).items():
            history.setdefault(key, []).append(value)
    return history


def epoch_logs(record: EpochRecord, extra: bool = True) -> dict[str, float | str]:
    """An epoch's results under the names `fit` gives its callbacks' logs, with what
    callbacks added, changed or removed there if `extra` (`on_train_end` gets
    them without)."""
    logs = {**record.train, **{f"val_{k}": v for k, v in record.test.items()},
            **(record.extra if extra else {})}
    return {k: v for k, v in logs.items() if v is not None}
