"""Command line of scripts/train.py and scripts/evaluate.py."""

import argparse
import functools
import importlib
import importlib.util
import math
import os
import signal
import sys
import warnings

import kdist
from kdist import checks, cluster, interrupt, launch, startup


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _seed(text):
    try:
        checks.check_seed(int(text), name="the seed")
    except (ValueError, startup.UsageError) as e:
        low, high = checks.SEED_RANGE
        raise argparse.ArgumentTypeError(
            f"expected a whole number in {low}..{high}, got {text!r}") from e
    return int(text)


def _quiet_signals(message):
    """Makes SIGINT/SIGTERM outside training exit 128 + signal with one line on stderr."""
    def decorate(main_fn):
        @functools.wraps(main_fn)
        def wrapper(argv=None):
            with interrupt.exit_on_signals(message):
                return main_fn(argv)

        return wrapper

    return decorate


def _add_batching(parser):
    """Flags that shape the distributed steps, shared by train.py and bench.py."""
    parser.add_argument("--batch-size-per-replica", type=_positive(int), default=64,
                        help="examples per replica per step; the global batch is this "
                             "times the replica count (default: %(default)s)")
    parser.add_argument("--replicas", type=_positive(int), default=None,
                        help="data-parallel replicas (default: every visible device; on a "
                             "CPU-only machine N splits the CPU into N devices)")
    parser.add_argument("--steps-per-execution", type=_positive(int), default=8,
                        help="train steps run by one compiled call; statistics come back "
                             "once per call (default: %(default)s)")


def _add_common(parser, checkpoints=True):
    if checkpoints:
        parser.add_argument("--checkpoint-dir", default="./training_checkpoints",
                            help="folder for checkpoints (default: %(default)s)")
    parser.add_argument("--data-dir", default=None,
                        help="folder with the four Fashion-MNIST IDX .gz files (default: "
                             "the Keras cache, then /usr/share/datasets/fashion-mnist, "
                             "then download)")
    parser.add_argument("--synthetic", action="store_true",
                        help="use generated data of Fashion-MNIST's shapes instead of "
                             "the data set (smoke runs)")
    parser.add_argument("--verbose", action="store_true",
                        help="show TensorFlow/JAX start-up logs")


def train_parser():
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Train the tutorial CNN on Fashion-MNIST, data-parallel, on the backend "
                    "chosen by KERAS_BACKEND (tensorflow or jax); then restore the latest "
                    "checkpoint without distribution and evaluate it.")
    parser.add_argument("--epochs", type=_positive(int), default=10,
                        help="training epochs (default: %(default)s)")
    _add_batching(parser)
    parser.add_argument("--learning-rate", type=_positive(float), default=1e-3,
                        help="learning rate of --optimizer (default: %(default)s)")
    parser.add_argument("--checkpoint-every", type=_positive(int), default=2,
                        help="checkpoint every N epochs, and always after the last "
                             "(default: %(default)s)")
    parser.add_argument("--keep", type=_positive(int), default=3,
                        help="checkpoints to keep (default: %(default)s)")
    parser.add_argument("--no-resume", dest="resume", action="store_false",
                        help="start over even if --checkpoint-dir holds a checkpoint "
                             "(default: resume from the newest one)")
    parser.add_argument("--seed", type=_seed, default=0,
                        help="seed for weights and data order (default: %(default)s)")
    parser.add_argument("--steps-per-epoch", type=_positive(int), default=None,
                        help="train on only the first N global batches of each epoch "
                             "(default: the whole epoch)")
    parser.add_argument("--metrics-file", default=None,
                        help="write one JSON object per epoch (and one for the restored "
                             "model) to this file, and the epochs as CSV to PATH with .csv in "
                             "place of its suffix; a fresh run empties both, a resumed one "
                             "rewrites them from its checkpoint")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar (it is also off when stdout is not a terminal)")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                        help="adam, or plain sgd (for exact comparisons between runs; "
                             "--learning-rate applies to either) (default: %(default)s)")
    parser.add_argument("--break-lock", action="store_true",
                        help="take --checkpoint-dir even if another run holds its lock "
                             "(only when that run is gone; a lock whose process has ended "
                             "on this host is taken over without it)")
    _add_common(parser)
    _add_multiworker(parser)
    return parser


def _add_multiworker(parser):
    group = parser.add_argument_group(
        "several workers", "Run this script once per worker, with the same --peers and each "
        "its own --worker-index (scripts/launch.py does so on one machine). Without these "
        "flags, TF_CONFIG (TensorFlow) or KERAS_DISTRIBUTION_JOB_ADDRESSES, "
        "KERAS_DISTRIBUTION_NUM_PROCESSES and KERAS_DISTRIBUTION_PROCESS_ID (JAX) are read. "
        "--replicas then counts this worker's devices.")
    group.add_argument("--peers", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                       help="every worker's address, in worker order; worker 0 is the chief "
                            "(it alone writes checkpoints and metrics) and JAX's "
                            "coordinator. JAX needs only worker 0's address")
    group.add_argument("--workers", type=_positive(int), default=None,
                       help="number of workers (default: the number of --peers)")
    group.add_argument("--worker-index", type=int, default=None,
                       help="this worker's place in --peers, from 0")
    group.add_argument("--connect-timeout", type=_positive(float), default=120.0,
                       help="seconds to wait for every worker to join before exiting with "
                            "an error (default: %(default)s)")


def _cluster_spec(parser, args):
    """This worker's ClusterSpec from the flags or the environment; bad input exits 2."""
    try:
        return cluster.from_flags_and_env(args.workers, args.worker_index, args.peers,
                                          args.connect_timeout,
                                          backend=startup.selected_backend())
    except startup.UsageError as e:
        parser.error(str(e))


def _connect(parser, spec, replicas):
    """Joins the other workers (bounded by --connect-timeout) before anything else runs."""
    if spec.num_workers == 1:
        return
    from kdist import engines

    try:
        with cluster.connect_deadline(spec):
            engines.connect(spec, replicas)
    except startup.UsageError as e:
        parser.error(str(e))


def load_data(args):
    if args.synthetic:
        return kdist.synthetic_fashion_mnist(seed=0)
    return kdist.load_fashion_mnist(args.data_dir)


def _log(line):
    print(line, flush=True)  # Line by line, also into pipes and `tee`.


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Shows kdist's checkpoint warnings as one `warning: ...` line on stderr."""
    from kdist.checkpoints import CheckpointWarning

    if issubclass(category, CheckpointWarning):
        print(f"warning: {message}", file=sys.stderr, flush=True)
    else:
        _DEFAULT_SHOWWARNING(message, category, filename, lineno, file, line)


_DEFAULT_SHOWWARNING = warnings.showwarning


def _fail(message):
    print(f"error: {message}", file=sys.stderr)
    return 1


def _start(parser, args, replicas=None):
    """Sets devices, log levels and warning lines, then imports the frameworks (quietly)."""
    warnings.showwarning = _show_warning
    try:
        startup.prepare_environment(replicas, args.verbose)
    except startup.UsageError as e:
        parser.error(str(e))

    with startup.native_logs_silenced(not args.verbose):
        importlib.import_module("keras")  # Loads the backend now, notices hidden.
        if importlib.util.find_spec("tensorflow"):
            # Keras on any backend loads TF when it is installed (seeding, tf.data).
            importlib.import_module("tensorflow")


def _check_paths(parser, args):
    """Checks the output files and the data folder before the frameworks load."""
    try:
        checks.check_metrics_file(args.metrics_file)
        if args.data_dir is not None and not args.synthetic:
            from kdist import data

            data.check_data_dir(args.data_dir)
    except startup.UsageError as e:
        parser.error(str(e))


@_quiet_signals("stopped while starting; nothing was trained")
def main(argv=None):
    launch.follow_launcher()
    parser = train_parser()
    args = parser.parse_args(argv)
    spec = _cluster_spec(parser, args)
    _check_paths(parser, args)
    _start(parser, args, args.replicas)
    _connect(parser, spec, args.replicas)
    config = kdist.TrainConfig(
        epochs=args.epochs, batch_size_per_replica=args.batch_size_per_replica,
        learning_rate=args.learning_rate, replicas=args.replicas,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        keep=args.keep, resume=args.resume, seed=args.seed,
        steps_per_epoch=args.steps_per_epoch, metrics_file=args.metrics_file,
        steps_per_execution=args.steps_per_execution,
        progress=sys.stdout.isatty() and not args.quiet and spec.is_chief,
        break_lock=args.break_lock)
    stop = kdist.StopRequest()
    try:
        # From here a signal is a stop request that every worker agrees on: a
        # worker that exited alone would leave the others waiting in a step.
        with kdist.stop_on_signals(stop):
            dataset = load_data(args)
            kdist.train_and_evaluate(config, dataset, log=_log, stop=stop,
                                     optimizer_fn=kdist.OPTIMIZERS[args.optimizer])
    except kdist.Interrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        # A worker stopped by another's signal exits as if terminated.
        return 128 + getattr(signal, e.signal_name or "SIGTERM")
    except kdist.UsageError as e:
        parser.error(str(e))
    except (kdist.DataError, kdist.CheckpointError, kdist.TrainingError,
            kdist.MetricsError) as e:
        return _fail(e)
    return 0


@_quiet_signals("stopped")
def evaluate_main(argv=None):
    parser = argparse.ArgumentParser(
        prog="evaluate.py",
        description="Restore the newest checkpoint of --checkpoint-dir into a fresh model "
                    "with no distribution, on the backend chosen by KERAS_BACKEND, and "
                    "print its test accuracy.")
    _add_common(parser)
    args = parser.parse_args(argv)
    _start(parser, args)
    try:
        path = kdist.latest_checkpoint(args.checkpoint_dir)
        if path is None:
            return _fail(f"no checkpoint in {os.path.abspath(args.checkpoint_dir)}; "
                         "train first or pass --checkpoint-dir")
        result = kdist.evaluate_checkpoint(path, load_data(args))
    except (kdist.DataError, kdist.CheckpointError) as e:
        return _fail(e)
    print(f"{path}: test loss {result['test_loss']:.4f}, "
          f"test accuracy {result['test_accuracy']:.2f}%")
    return 0


@_quiet_signals("stopped")
def bench_main(argv=None):
    parser = argparse.ArgumentParser(
        prog="bench.py",
        description="Measure kdist's training loop against Keras fit on the backend chosen "
                    "by KERAS_BACKEND: same model, data, batch and devices, one process. "
                    "Prints a table, then one JSON line.")
    _add_batching(parser)
    parser.add_argument("--steps", type=_positive(int), default=None,
                        help="steps per timed epoch (default: a whole epoch)")
    parser.add_argument("--windows", type=_positive(int), default=4,
                        help="steady epochs timed after the first; their median counts "
                             "(default: %(default)s)")
    _add_common(parser, checkpoints=False)
    args = parser.parse_args(argv)
    _start(parser, args, args.replicas)
    from kdist import bench

    try:
        bench.run(load_data(args), args.replicas, args.batch_size_per_replica, args.steps,
                  args.windows, args.steps_per_execution, log=_log)
    except kdist.UsageError as e:
        parser.error(str(e))
    except (kdist.DataError, ValueError) as e:
        return _fail(e)
    return 0
