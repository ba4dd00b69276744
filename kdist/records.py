"""The records the loop keeps: where training stands, and what each epoch measured.

They cross into files and results as plain dicts: a checkpoint's metadata
holds a `Position` (`as_metadata` / `from_metadata`), the metrics files and
`train_and_evaluate`'s result hold `EpochRecord.as_dict()`.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    """One epoch's results; accuracies in percent."""

    epoch: int  # Counted from 1.
    train_loss: float
    train_accuracy: float
    test_loss: float
    test_accuracy: float
    seconds: float | None  # Its training time; None if all of it was trained before a resume.
    samples_per_sec: float | None

    def as_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values):
        return cls(**{key: values[key] for key in EPOCH_KEYS})


EPOCH_KEYS = tuple(field.name for field in dataclasses.fields(EpochRecord))


@dataclasses.dataclass(frozen=True)
class Position:
    """Where training stands: what a checkpoint records and a resumed run starts from."""

    epoch: int = 0  # The epoch in progress, counted from 0.
    step_in_epoch: int = 0  # Its steps done.
    totals: dict | None = None  # Their summed statistics (`kdist.losses.STATISTICS`).
    history: tuple = ()  # The `EpochRecord`s of the epochs done.

    def global_step(self, steps_per_epoch):
        """The step count that names a checkpoint of this position."""
        return self.epoch * steps_per_epoch + self.step_in_epoch

    def as_metadata(self):
        return dict(epoch=self.epoch, step_in_epoch=self.step_in_epoch, totals=self.totals,
                    history=[record.as_dict() for record in self.history])

    @classmethod
    def from_metadata(cls, meta):
        return cls(meta["epoch"], meta["step_in_epoch"], meta["totals"],
                   tuple(EpochRecord.from_dict(r) for r in meta["history"]))
