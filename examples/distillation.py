"""Knowledge distillation: a teacher trained first, restored from its kdist checkpoint
and frozen; a smaller student learns from its soft targets and the labels. One step
for every backend.

    KERAS_BACKEND=jax python examples/distillation.py --synthetic 1200 --epochs 1
    python examples/distillation.py --epochs 5 --replicas 2   # Fashion-MNIST

It takes kdist-train's flags (`--help`). Without `--teacher CKPT` it first trains
the tutorial CNN as the teacher, with the same flags, into CHECKPOINT_DIR/teacher
(its TensorBoard logs into DIR/teacher, its metrics into NAME-teacher.jsonl).
"""

import argparse
import os
import sys

import keras
from keras import layers, ops

import kdist
from kdist import checkpoints
from kdist.cli import train


class Distiller(keras.Model):
    def __init__(self, teacher, learning_rate=1e-3, temperature=3.0, alpha=0.1):
        super().__init__()
        self.teacher = teacher
        self.teacher.trainable = False
        self.student = keras.Sequential([
            keras.Input((28, 28, 1)), layers.Conv2D(16, 3, activation="relu"),
            layers.MaxPooling2D(), layers.Flatten(), layers.Dense(10)], name="student")
        self.opt = keras.optimizers.Adam(learning_rate)
        self.cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.divergence = keras.losses.KLDivergence()
        self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
        self.temperature, self.alpha = temperature, alpha

    def losses_of(self, x, y, logits):
        """(the distillation loss, the labels' loss) of the student's logits."""
        t = self.temperature
        soft = self.divergence(ops.softmax(self.teacher(x, training=False) / t),
                               ops.softmax(logits / t)) * t ** 2
        hard = self.cross_entropy(y, logits)
        return self.alpha * hard + (1 - self.alpha) * soft, hard

    def train_step(self, data):
        x, y = data
        weights = self.student.trainable_variables

        def loss():
            logits = self.student(x, training=True)
            return (*self.losses_of(x, y, logits), logits)

        (loss, hard, logits), grads = kdist.value_and_grad(loss, weights)
        self.opt.apply(grads, weights)
        self.accuracy.update_state(y, logits)
        return {"loss": loss, "student_loss": hard, "accuracy": self.accuracy.result()}

    def test_step(self, data):
        x, y = data
        logits = self.student(x, training=False)
        loss, hard = self.losses_of(x, y, logits)
        self.accuracy.update_state(y, logits)
        return {"loss": loss, "student_loss": hard, "accuracy": self.accuracy.result()}


def teacher_from(checkpoint):
    """The tutorial CNN with the weights of a kdist checkpoint of it."""
    teacher = kdist.create_model()
    teacher.load_weights(checkpoint)
    return teacher


def model(args=None, teacher=None):
    """The distiller around the teacher of checkpoint `teacher` (None: an untrained
    CNN, as to restore a checkpoint of the distiller, which holds the teacher too),
    with `--learning-rate`."""
    cnn = kdist.create_model() if teacher is None else teacher_from(teacher)
    return Distiller(cnn, getattr(args, "learning_rate", None) or 1e-3)


def teacher_flags(rest):
    """kdist-train's flags for the teacher's run: the student's, with its checkpoints,
    TensorBoard logs and metrics file beside the student's (a `teacher` folder,
    `NAME-teacher.jsonl`), not in them."""
    flags = train.train_parser().parse_args(rest)
    folder = os.path.join(flags.checkpoint_dir, "teacher")
    own = ["--checkpoint-dir", folder]
    if flags.tensorboard:
        own += ["--tensorboard", os.path.join(flags.tensorboard, "teacher")]
    if flags.metrics_file:
        stem, suffix = os.path.splitext(flags.metrics_file)
        own += ["--metrics-file", f"{stem}-teacher{suffix}"]
    return rest + own, folder


def main(argv=None):
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--teacher", metavar="CKPT",
                       help="a kdist checkpoint of the tutorial CNN, or a folder of them (the "
                            "newest; default: train one first, with these flags, into "
                            "CHECKPOINT_DIR/teacher)")
    argv = sys.argv[1:] if argv is None else list(argv)
    known, rest = extra.parse_known_args(argv)
    teacher = known.teacher
    if teacher is not None:  # Before any training: one line, exit 2, for a wrong path.
        found = kdist.latest_checkpoint(teacher) if os.path.isdir(teacher) else (
            teacher if os.path.isfile(teacher) else None)
        if found is None:
            extra.error(f"--teacher {teacher}: no such file, nor a folder with a kdist "
                        "checkpoint")
        try:
            checkpoints.read_metadata(found)
        except Exception:  # noqa: BLE001 - h5py and Keras raise several types.
            extra.error(f"--teacher {found}: not a kdist checkpoint")
        teacher = found
    if teacher is None and not {"-h", "--help"} & set(argv):
        flags, folder = teacher_flags(rest)
        status = train.main(flags)
        if status:
            return status
        teacher = kdist.latest_checkpoint(folder)
    return train.main(argv, model_fn=lambda args: model(args, teacher), description=__doc__,
                      flags=extra)


if __name__ == "__main__":
    sys.exit(main())
