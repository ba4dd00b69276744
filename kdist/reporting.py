"""What a run tells its user: the start-up banner, epoch lines, metrics files."""

import csv
import json
import os

import keras

import kdist

EPOCH_KEYS = ("epoch", "train_loss", "train_accuracy", "test_loss", "test_accuracy",
              "seconds", "samples_per_sec")


def banner(engine, config, global_batch, steps, dataset, checkpoint_note):
    """The lines printed before training: versions, devices, batch, data, checkpoints."""
    devices = ", ".join(str(d).split("device:")[-1] for d in engine.devices)
    workers, local = engine.shard[1], global_batch // engine.shard[1]
    cluster = ([f"Workers: {workers}; this chief and each worker read {local} examples of "
                "every global batch; checkpoints and metrics are written here"]
               if workers > 1 else [])
    return "\n".join(cluster + [
        f"kdist {kdist.__version__}: Keras {keras.__version__} on {engine.backend} "
        f"{engine.version}",
        f"Replicas: {engine.num_replicas} ({devices})",
        f"Batch: {config.batch_size_per_replica} per replica, {global_batch} global; "
        f"{steps} steps per epoch, {config.epochs} epochs",
        f"Data: {dataset.source} ({len(dataset.train_images):,} train, "
        f"{len(dataset.test_images):,} test examples)",
        f"Checkpoints: {os.path.abspath(config.checkpoint_dir)}, {checkpoint_note}",
    ])


def format_epoch(record, epochs):
    """The tutorial's epoch line, with accuracies in percent and the epoch's speed.

    An epoch with no steps left to train when it resumed has no speed (its
    `seconds` is None).
    """
    speed = ("trained before the resume" if record["seconds"] is None else
             f"{record['seconds']:.1f} s, {record['samples_per_sec']:,.0f} samples/s")
    return (f"Epoch {record['epoch']}/{epochs}, Loss: {record['train_loss']:.4f}, "
            f"Accuracy: {record['train_accuracy']:.2f}%, Test Loss: {record['test_loss']:.4f}, "
            f"Test Accuracy: {record['test_accuracy']:.2f}% ({speed})")


class MetricsWriter:
    """Appends records to PATH (JSON lines) and epochs to PATH's .csv sibling.

    The CSV has the layout of `keras.callbacks.CSVLogger`: `epoch` counted
    from 0, then the metrics sorted by name.
    """

    CSV_COLUMNS = ("epoch",) + tuple(sorted(k for k in EPOCH_KEYS if k != "epoch"))

    def __init__(self, path):
        self.path = path
        self.csv_path = os.path.splitext(path)[0] + ".csv" if path else None

    def epoch(self, record):
        self.restored(record)
        if self.csv_path:
            new = not os.path.exists(self.csv_path) or not os.path.getsize(self.csv_path)
            with open(self.csv_path, "a", newline="") as f:
                writer = csv.writer(f)
                if new:
                    writer.writerow(self.CSV_COLUMNS)
                writer.writerow([record["epoch"] - 1] + [record[k] for k in self.CSV_COLUMNS[1:]])

    def restored(self, record):
        """Appends `record` to the JSON lines file only."""
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
