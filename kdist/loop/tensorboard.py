"""TensorBoard event files of a run, on every backend, with TensorBoard's own writer.

The `tensorboard` package writes them (its `EventFileWriter` and protocol
buffers, as `torch.utils.tensorboard` does), so no TensorFlow is needed. The
layout is Keras' `TensorBoard` callback's, so a dashboard reads a kdist run
like a `fit` run: `DIR/train` and `DIR/validation`, scalars `epoch_loss`,
`epoch_<metric>` at each epoch (counted from 0; `epoch_learning_rate` in
train), and in `DIR/train`, after every compiled chunk of steps, `batch_loss`,
`batch_<metric>` (the epoch's results so far), `batch_learning_rate` and
`batch_samples_per_sec` at the global step, and the run's configuration as
text (tag `config`).

`RunToTensorBoard` is a Keras callback the loop adds for `--tensorboard DIR`
(`TrainConfig.tensorboard`); only the chief runs it (`kdist.loop.hooks`).
"""

import os
import time
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np


class EventWriter:
    """Writes a run's scalars and configuration under `folder` (see the module)."""

    def __init__(self, folder: str):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.folder = folder
        self.writers = {split: EventFileWriter(os.path.join(folder, split))
                        for split in ("train", "validation")}

    def text(self, tag: str, markdown: str, step: int = 0) -> None:
        """A text summary (shown by TensorBoard's Text tab, as Markdown)."""
        from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2

        metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
        tensor = tensor_pb2.TensorProto(
            dtype=7, string_val=[markdown.encode()],  # 7: DT_STRING.
            tensor_shape=tensor_shape_pb2.TensorShapeProto(
                dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]))
        self._write("train", step, [summary_pb2.Summary.Value(
            tag=tag, metadata=metadata, tensor=tensor)])

    def scalars(self, split: str, step: int, values: dict[str, Any]) -> None:
        """`values` (name -> number) as scalars at `step` in `split` ("train" or
        "validation")."""
        from tensorboard.compat.proto import summary_pb2

        self._write(split, step, [summary_pb2.Summary.Value(tag=tag, simple_value=float(v))
                                  for tag, v in values.items()
                                  if isinstance(v, (int, float, np.number))])

    def _write(self, split: str, step: int, values: list[Any]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        self.writers[split].add_event(event_pb2.Event(
            wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=values)))

    def flush(self) -> None:
        for writer in self.writers.values():
            writer.flush()

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()


def config_markdown(fields: dict[str, Any], engine_line: str) -> str:
    """The run's configuration as a Markdown table, for the `config` text."""
    rows = "\n".join(f"| {name} | `{value}` |" for name, value in fields.items())
    return f"{engine_line}\n\n| setting | value |\n|---|---|\n{rows}\n"


def learning_rates(optimizers: Sequence[keras.optimizers.Optimizer]) -> dict[str, float]:
    """{"learning_rate": value} for one optimizer; `learning_rate_<name>` for several,
    as Keras' `ReduceLROnPlateau` names them."""
    def rate(optimizer: keras.optimizers.Optimizer) -> float:
        value: Any = keras.ops.convert_to_numpy(optimizer.learning_rate)
        return float(value)

    if len(optimizers) == 1:
        return {"learning_rate": rate(optimizers[0])}
    return {f"learning_rate_{o.name}": rate(o) for o in optimizers}


class RunToTensorBoard(keras.callbacks.Callback):
    """Writes the run's curves and configuration under `folder` (see the module).

    Args:
        folder: the event files' folder (created if missing).
        optimizers: the run's optimizers, for the learning rate.
        global_batch: examples per step, for samples/s.
        first_step: the global step the run starts from (after a resume).
        config: the run's settings, shown as text.
        engine_line: the banner's first lines (versions, replicas), shown above them.
    """

    def __init__(self, folder: str, optimizers: Sequence[keras.optimizers.Optimizer],
                 global_batch: int, first_step: int, config: dict[str, Any],
                 engine_line: str):
        super().__init__()
        self.folder = os.path.abspath(folder)  # Whatever os.chdir comes before training.
        self.optimizers, self.global_batch = optimizers, global_batch
        self.config, self.engine_line = config, engine_line
        self.step = first_step  # Global steps done.
        self.writer: EventWriter | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.writer = EventWriter(self.folder)
        settings = dict(self.config)
        if settings.get("learning_rate") is None:  # The model's own optimizers set it:
            del settings["learning_rate"]  # their rates at the run's start.
            settings.update(learning_rates(self.optimizers))
        self.writer.text("config", config_markdown(settings, self.engine_line), self.step)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epoch_start = time.perf_counter()
        self.epoch_first_batch: int | None = None

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.epoch_first_batch is None:
            self.epoch_first_batch = batch
            self.step_base = self.step - batch  # The global step of the epoch's batch 0.

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        assert self.writer is not None and self.epoch_first_batch is not None
        self.step = self.step_base + batch + 1
        done = batch + 1 - self.epoch_first_batch
        values = {f"batch_{k}": v for k, v in (logs or {}).items()}
        values.update({f"batch_{k}": v for k, v in learning_rates(self.optimizers).items()})
        values["batch_samples_per_sec"] = (done * self.global_batch
                                           / (time.perf_counter() - self.epoch_start))
        self.writer.scalars("train", self.step, values)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        assert self.writer is not None
        logs = logs or {}
        train = {f"epoch_{k}": v for k, v in logs.items() if not k.startswith("val_")}
        for name, rate in learning_rates(self.optimizers).items():  # Unless a callback
            train.setdefault(f"epoch_{name}", rate)  # put it in the logs already.
        self.writer.scalars("train", epoch, train)
        self.writer.scalars("validation", epoch, {f"epoch_{k[4:]}": v for k, v in logs.items()
                                                   if k.startswith("val_")})
        self.writer.flush()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.close()

    def close(self) -> None:
        """Writes out and closes the event files; the loop calls it on every way
        out of training (an error, `Interrupted`), where `on_train_end` is not called."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
