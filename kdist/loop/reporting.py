"""What a run tells its user: the start-up banner, the progress bar, epoch lines,
metrics files."""

import csv
import io
import json
import os
import sys
import time

import keras

import kdist
from kdist import checks
from kdist.errors import MetricsError
from kdist.workers.processes import REPLICA_PROCESSES_VARIABLE


def banner(engine, config, global_batch, steps, dataset, checkpoint_note, chunk=None):
    """The lines printed before training: versions, devices, batch, data, checkpoints.

    `chunk` is the number of train steps per compiled call; when it is below
    `config.steps_per_execution` the Batch line says so.
    """
    devices = ", ".join(str(d).split("device:")[-1] for d in engine.devices)
    precision = config.precision or keras.config.dtype_policy().name  # None: Keras' global.
    workers, local = engine.shard[1], global_batch // engine.shard[1]
    # The processes `kdist.loop.replicas` starts are one machine's replicas, not workers.
    replica_processes = os.environ.get(REPLICA_PROCESSES_VARIABLE) == "1"
    cluster = ([f"Workers: {workers}; this chief and each worker feed {local} examples of "
                "every global batch; checkpoints and metrics are written here"]
               if workers > 1 and not replica_processes else [])
    return "\n".join(cluster + [
        f"kdist {kdist.__version__}: Keras {keras.__version__} on {engine.backend} "
        f"{engine.version}",
        f"Replicas: {engine.num_replicas} ({devices})",
        f"Batch: {config.batch_size_per_replica} per replica, {global_batch} global; "
        f"{_steps_per_epoch(steps, config.steps_per_epoch)}, {_count(config.epochs, 'epoch')}"
        + _capped_epoch(config, steps, global_batch, dataset.size("train")) + (
            f"; --steps-per-execution {config.steps_per_execution} capped at {chunk}, the "
            "steps of an epoch" if chunk is not None and chunk < config.steps_per_execution
            else ""),
        f"Data: {dataset.source} ({_examples(dataset, 'train')} train, "
        + (f"{_examples(dataset, 'test')} test examples)" if dataset.test is not None
           else "no test examples: no evaluation)"),
        f"Checkpoints: {os.path.abspath(config.checkpoint_dir)}, {checkpoint_note}",
    ] + ([f"Precision: {precision}" + (
        " (dynamic loss scaling)" if precision == "mixed_float16" else "")]
         if precision != "float32" else []))


def _steps_per_epoch(steps, asked):
    """"16 steps per epoch"; for a stream of unknown length, "at most 5 steps per
    epoch" (`asked`: `--steps-per-epoch`) or "as many steps per epoch as the data holds"."""
    if steps is not None:
        return f"{steps} steps per epoch"
    if asked is not None:
        return f"at most {asked} steps per epoch"
    return "as many steps per epoch as the data holds"


def _capped_epoch(config, steps, global_batch, examples):
    """"; --steps-per-epoch 50 capped at 15, the full global batches of the data" where
    `config.steps_per_epoch` asks for more steps than the training data fills."""
    asked = config.steps_per_epoch
    full = None if examples is None else examples // global_batch
    if asked is None or steps is None or steps != full or asked <= steps:
        return ""
    return f"; --steps-per-epoch {asked} capped at {steps}, the full global batches of the data"


def _count(number, noun):
    """"1 epoch", "10 epochs"."""
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def _examples(dataset, split):
    """The examples of a split, "?" while a pipeline has not been read to its end."""
    size = dataset.size(split)
    return "?" if size is None else f"{size:,}"


def format_results(results, prefix=""):
    """"Loss: 0.3012, Accuracy: 89.10%, auc: 0.9712" for {"loss": ..., ...}.

    Accuracy-type metrics (their name ends in "accuracy") read as percent, as
    in the tutorial; the others keep their Keras name and value, written as
    Keras' progress bar writes it (`number`). `prefix`
    ("test_") selects and strips the keys of one split; its name leads
    each label.
    """
    lead = prefix.rstrip("_").capitalize() + " " if prefix else ""
    parts = []
    for key, value in results.items():
        if not key.startswith(prefix) or not isinstance(value, float):
            continue
        name = key[len(prefix):]
        if name == "loss":
            parts.append(f"{lead}Loss: {number(value)}")
        elif name.endswith("accuracy"):
            label = name.replace("_", " ").capitalize()
            parts.append(f"{lead}{label}: {100 * value:.2f}%")
        else:
            parts.append(f"{lead}{name}: {number(value)}")
    return ", ".join(parts)


def number(value):
    """`value` to 4 decimals, or to 4 significant digits where it is smaller than
    0.001 in size but not 0 (Keras' Progbar: a loss of 3.2e-06 is not 0.0000)."""
    return f"{value:.4f}" if abs(value) > 1e-3 or value == 0 else f"{value:.4e}"


class ProgressBar:
    """An epoch's progress on one terminal line, in the epoch line's units and formats:
    ``312/937 [━━━━━━━━━         ] 4s, ETA 9s - Loss: 0.5077, Accuracy: 81.84%, 8,932
    samples/s``. (Keras' `Progbar` shows every value as a plain number, "accuracy:
    0.8184 - samples/s: 8932.0000", so kdist draws its own.)

    `update` redraws the line; `close` ends it, so the next line starts clean.
    """

    WIDTH = 20

    def __init__(self, steps, first_step=0, stream=None):
        self.steps, self.first_step = steps, first_step  # `steps` None: not known yet.
        self.stream = stream if stream is not None else sys.stdout
        self.start = time.perf_counter()
        self._drawn = 0  # Characters on the line now.

    def update(self, step, results, samples_per_sec):
        """Draws the line at step `step` of the epoch with `results` (`format_results`)."""
        elapsed = time.perf_counter() - self.start
        if self.steps:
            filled = min(self.WIDTH, self.WIDTH * step // self.steps)
            where = f"{step}/{self.steps} [{'━' * filled}{' ' * (self.WIDTH - filled)}]"
            done = step - self.first_step
            left = elapsed / done * (self.steps - step) if done and step < self.steps else 0
            timing = f"{elapsed:.0f}s" + (f", ETA {left:.0f}s" if step < self.steps else "")
        else:
            where, timing = f"{step}/?", f"{elapsed:.0f}s"
        line = (f"{where} {timing} - {format_results(results)}, "
                f"{samples_per_sec:,.0f} samples/s")
        self.stream.write("\r" + line + " " * max(0, self._drawn - len(line)))
        self.stream.flush()
        self._drawn = len(line)

    def close(self):
        """Ends the line, if one was drawn."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = 0


def format_epoch(record, epochs, show_skipped=False):
    """The tutorial's epoch line for an `EpochRecord`, with its speed.

    An epoch with no steps left to train when it resumed has no speed (its
    `seconds` is None). With `show_skipped` (a run with dynamic loss
    scaling), or when a step was skipped, the line ends with the skipped
    steps: "(2.0 s, 512 samples/s; 1 step skipped)".
    """
    speed = ("trained before the resume" if record.seconds is None else
             f"{record.seconds:.1f} s, {record.samples_per_sec:,.0f} samples/s")
    if show_skipped or record.skipped_steps:
        speed += f"; {_count(record.skipped_steps, 'step')} skipped"
    parts = [f"Epoch {record.epoch}/{epochs}", format_results(record.train),
             format_results({f"test_{k}": v for k, v in record.test.items()}, "test_")]
    return f"{', '.join(p for p in parts if p)} ({speed})"


class MetricsWriter:
    """Writes a run's records to PATH (JSON lines) and its epochs to PATH's .csv sibling.

    `start(history)` rewrites both files from the epochs done so far (none on
    a fresh run; a resumed checkpoint's history otherwise), each atomically
    (a temporary file, then `os.replace`), so every epoch appears once even
    after a crash; `epoch` and `restored` then append. The CSV has the layout
    of `keras.callbacks.CSVLogger`: `epoch` counted from 0, then the metrics
    sorted by name. With no PATH (or on a worker other than the chief) it
    writes nothing. A failed write raises `MetricsError`.
    """

    def __init__(self, path, metric_names=("loss", "accuracy"), test_names=None):
        self.path = os.path.abspath(path) if path else None  # Whatever os.chdir comes later.
        self.csv_path = checks.metrics_csv_path(path) if path else None
        test_names = metric_names if test_names is None else test_names
        keys = ([f"train_{name}" for name in metric_names]
                + [f"test_{name}" for name in test_names])
        self.csv_columns = ("epoch",) + tuple(sorted(keys + ["seconds", "samples_per_sec",
                                                             "skipped_steps"]))

    def start(self, history):
        """Replaces both files with `history`, the `EpochRecord`s of the epochs done so far."""
        if self.path:
            self._replace(self.path, "".join(_json_line(r.as_dict()) for r in history))
            self._replace(self.csv_path, "".join(self._csv_line(r) for r in
                                                 [None] + list(history)))

    def epoch(self, record):
        """Appends an `EpochRecord` to both files."""
        if self.path:
            self._append(self.path, _json_line(record.as_dict()))
            self._append(self.csv_path, self._csv_line(record))

    def restored(self, record):
        """Appends `record`, the restored model's dict, to the JSON lines file only."""
        if self.path:
            self._append(self.path, _json_line(record))

    def _csv_line(self, record):
        """The CSV row of `record`; the header row for None."""
        buffer = io.StringIO()
        if record is None:
            csv.writer(buffer).writerow(self.csv_columns)
        else:
            values = record.as_dict()
            csv.writer(buffer).writerow([record.epoch - 1] +
                                        [values.get(k) for k in self.csv_columns[1:]])
        return buffer.getvalue()

    def _append(self, path, text):
        try:
            with open(path, "a", newline="") as f:
                f.write(text)
        except OSError as e:
            raise _error(path, e) from e

    def _replace(self, path, text):
        tmp = os.path.join(os.path.dirname(os.path.abspath(path)),
                           f".tmp-{os.getpid()}-{os.path.basename(path)}")
        try:
            with open(tmp, "w", newline="") as f:
                f.write(text)
            os.replace(tmp, path)
        except OSError as e:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise _error(path, e) from e


def _json_line(record):
    return json.dumps(record) + "\n"


def _error(path, e):
    return MetricsError(f"cannot write the metrics file {path} ({e.strerror or e}); "
                        "free space or pass another --metrics-file, then run the same "
                        "command to resume from the last checkpoint")
