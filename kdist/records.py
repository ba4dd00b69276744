"""The records the loop keeps: where training stands, and what each epoch measured.

They cross into files and results as plain dicts: a checkpoint's metadata
holds a `Position` (`as_metadata` / `from_metadata`), the metrics files and
`train_and_evaluate`'s result hold `EpochRecord.as_dict()`.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    """One epoch's results: "loss" and each metric by its Keras name, for train and test."""

    epoch: int  # Counted from 1.
    train: dict[str, float]
    test: dict[str, float]
    seconds: float | None  # Its training time; None if all of it was trained before a resume.
    samples_per_sec: float | None
    # Train steps the optimizer skipped (non-finite gradients under dynamic loss scaling).
    skipped_steps: int = 0
    # What callbacks added to the epoch's logs ("learning_rate", say; `kdist.loop.hooks`)
    # or changed there; None for a key they removed.
    extra: dict[str, float | str | None] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """{"epoch", "train_<name>"..., "test_<name>"..., "seconds", "samples_per_sec",
        "skipped_steps", and what callbacks added}."""
        return dict(epoch=self.epoch, **{f"train_{k}": v for k, v in self.train.items()},
                    **{f"test_{k}": v for k, v in self.test.items()},
                    seconds=self.seconds, samples_per_sec=self.samples_per_sec,
                    skipped_steps=self.skipped_steps, **self.extra)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "EpochRecord":
        """The record of `as_dict`; a record written before kdist counted skipped
        steps has none."""
        def part(prefix: str) -> dict[str, float]:
            return {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}

        own = {"epoch", "seconds", "samples_per_sec", "skipped_steps"}
        extra = {k: v for k, v in values.items()
                 if k not in own and not k.startswith(("train_", "test_"))}
        return cls(values["epoch"], part("train_"), part("test_"), values["seconds"],
                   values["samples_per_sec"], values.get("skipped_steps", 0), extra)


@dataclasses.dataclass(frozen=True)
class Position:
    """Where training stands: what a checkpoint records and a resumed run starts from."""

    epoch: int = 0  # The epoch in progress, counted from 0.
    step_in_epoch: int = 0  # Its steps done.
    # Their summed statistics (`kdist.loop.chunks`) by key: arrays, or the lists of a
    # checkpoint's metadata until the loop checks them against the model's.
    totals: dict[str, npt.ArrayLike] | None = None
    history: tuple[EpochRecord, ...] = ()  # The `EpochRecord`s of the epochs done.
    stopped: bool = False  # Whether a callback ended training here (`model.stop_training`).

    def global_step(self, steps_per_epoch: int) -> int:
        """The step count that names a checkpoint of this position."""
        return self.epoch * steps_per_epoch + self.step_in_epoch

    def as_metadata(self) -> dict[str, Any]:
        totals = None if self.totals is None else {
            key: np.asarray(value).tolist() for key, value in self.totals.items()}
        return dict(epoch=self.epoch, step_in_epoch=self.step_in_epoch, totals=totals,
                    history=[record.as_dict() for record in self.history],
                    stopped=self.stopped)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "Position":
        """The position a checkpoint's metadata records; format 1 records no
        statistics or history."""
        return cls(meta["epoch"], meta["step_in_epoch"], meta.get("totals"),
                   tuple(EpochRecord.from_dict(r) for r in meta.get("history", ())),
                   meta.get("stopped", False))
