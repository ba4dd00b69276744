"""Command line of scripts/train.py, scripts/evaluate.py and scripts/bench.py.

The train flags come from `kdist.TrainConfig`'s fields (`kdist.flags`).
Every main maps kdist's errors to exit statuses in one place, `_run`.
"""

import argparse
import functools
import importlib
import importlib.util
import os
import signal
import sys
import warnings

import kdist
from kdist import checks, cluster, config, errors, interrupt, launch, startup
from kdist.flags import add_config_flags, config_from_args, names, positive


def _usage(parser, error):
    parser.error(str(error))  # The usage, then "PROG: error: ...": exit status 2.


def _interrupted(parser, error):
    print(f"interrupted: {error}", file=sys.stderr)
    # A worker stopped by another's signal exits as if terminated.
    return 128 + getattr(signal, error.signal_name or "SIGTERM")


def _failed(parser, error):
    print(f"error: {error}", file=sys.stderr)
    return 1


# How each kind of error ends a script, first match wins: usage errors exit 2
# as argparse's own do, a stop on a signal 128 + the signal, the rest 1.
EXIT_STATUSES = ((errors.UsageError, _usage), (errors.Interrupted, _interrupted),
                 (errors.KdistError, _failed))


def _run(parser, argv, body, failures=()):
    """Parses `argv` and returns `body(args)`; a kdist error (or one of `failures`)
    ends as `EXIT_STATUSES` says."""
    args = parser.parse_args(argv)
    try:
        return body(args)
    except (errors.KdistError, *failures) as error:
        handler = next((h for kind, h in EXIT_STATUSES if isinstance(error, kind)), _failed)
        return handler(parser, error)


def _quiet_signals(message):
    """Makes SIGINT/SIGTERM outside training exit 128 + signal with one line on stderr."""
    def decorate(main_fn):
        @functools.wraps(main_fn)
        def wrapper(argv=None):
            with interrupt.exit_on_signals(message):
                return main_fn(argv)

        return wrapper

    return decorate


# `--synthetic` without N: as many training examples as Fashion-MNIST (and 10,000 test).
SYNTHETIC_TRAIN = 60_000


def _add_common(parser, checkpoints=True):
    if checkpoints:
        add_config_flags(parser, ["checkpoint_dir"])
    parser.add_argument("--data-dir", default=None,
                        help="folder with the four Fashion-MNIST IDX .gz files (default: "
                             "the Keras cache, then /usr/share/datasets/fashion-mnist, "
                             "then download)")
    parser.add_argument("--synthetic", nargs="?", const=SYNTHETIC_TRAIN, type=positive(int),
                        metavar="N",
                        help="use N generated training examples of Fashion-MNIST's shapes "
                             f"(default {SYNTHETIC_TRAIN:,}) and N/6 test examples instead "
                             "of the data set (smoke runs)")
    parser.add_argument("--verbose", action="store_true",
                        help="show the framework's start-up logs (TensorFlow, JAX, torch)")


def train_parser():
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Train the tutorial CNN on Fashion-MNIST, data-parallel, on the backend "
                    "chosen by KERAS_BACKEND (tensorflow, jax or torch); then restore the latest "
                    "checkpoint without distribution and evaluate it.")
    add_config_flags(parser)
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar (it is also off when stdout is not a terminal)")
    parser.add_argument("--optimizer", choices=tuple(config.OPTIMIZERS),
                        default=config.DEFAULT_OPTIMIZER,
                        help="the optimizer; sgd is plain SGD, for exact comparisons between "
                             "runs; --learning-rate applies to any (default: %(default)s)")
    _add_common(parser, checkpoints=False)
    parser.add_argument("--tfrecords", default=None, metavar="DIR",
                        help="stream the data from the TFRecord files of DIR (written by "
                             "scripts/write_tfrecords.py) instead of loading it into memory")
    _add_multiworker(parser)
    return parser


def _add_multiworker(parser):
    group = parser.add_argument_group(
        "several workers", "Run this script once per worker, with the same --peers and each "
        "its own --worker-index (scripts/launch.py does so on one machine). Without these "
        "flags, TF_CONFIG (TensorFlow) or KERAS_DISTRIBUTION_JOB_ADDRESSES, "
        "KERAS_DISTRIBUTION_NUM_PROCESSES and KERAS_DISTRIBUTION_PROCESS_ID (JAX), or torchrun's "
        "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torch) are read. "
        "--replicas then counts this worker's devices (on torch a worker is one replica).")
    group.add_argument("--peers", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                       help="every worker's address, in worker order; worker 0 is the chief "
                            "(it alone writes checkpoints and metrics) and the coordinator "
                            "of JAX and torch, which need only worker 0's address")
    group.add_argument("--workers", type=positive(int), default=None,
                       help="number of workers (default: the number of --peers)")
    group.add_argument("--worker-index", type=int, default=None,
                       help="this worker's place in --peers, from 0")
    group.add_argument("--connect-timeout", type=positive(float), default=120.0,
                       help="seconds to wait for every worker to join before exiting with "
                            "an error (default: %(default)s)")


def _cluster_spec(args):
    """This worker's ClusterSpec from the flags or the environment."""
    return cluster.from_flags_and_env(args.workers, args.worker_index, args.peers,
                                      args.connect_timeout, backend=startup.selected_backend())


def _connect(spec, replicas):
    """Joins the other workers (bounded by --connect-timeout) before anything else runs."""
    if spec.num_workers == 1:
        return
    from kdist import engines

    with cluster.connect_deadline(spec):
        engines.connect(spec, replicas)


def load_data(args):
    if getattr(args, "tfrecords", None):
        from kdist import tfrecords

        return tfrecords.fashion_mnist(args.tfrecords)
    if args.synthetic:
        try:
            return kdist.synthetic_fashion_mnist(args.synthetic, seed=0)
        except MemoryError as error:  # NumPy's names the size: "Unable to allocate 74.5 GiB ..."
            raise errors.UsageError(f"--synthetic {args.synthetic:,}: more examples than this "
                                    f"machine's memory holds ({error})") from None
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


def _start(args, replicas=None):
    """Sets devices, log levels and warning lines, then imports the frameworks (quietly)."""
    warnings.showwarning = _show_warning
    startup.prepare_environment(replicas, args.verbose)
    startup.load_frameworks(quiet=not args.verbose)


def _check_paths(args):
    """Checks the output files and the data folder before the frameworks load."""
    checks.check_metrics_file(args.metrics_file)
    if args.data_dir is not None and not args.synthetic:
        from kdist import data

        data.check_data_dir(args.data_dir)


@_quiet_signals("stopped while starting; nothing was trained")
def main(argv=None):
    return _run(train_parser(), argv, _train)


def _train(args):
    stop = kdist.StopRequest()
    supervised = launch.follow_launcher(stop)  # Under kdist-launch: stop when it is gone.
    spec = _cluster_spec(args)
    _check_paths(args)
    _start(args, args.replicas)
    _connect(spec, args.replicas)
    run_config = config_from_args(
        args, progress=sys.stdout.isatty() and not args.quiet and spec.is_chief)
    # From here a signal is a stop request that every worker agrees on: a
    # worker that exited alone would leave the others waiting in a step.
    with kdist.stop_on_signals(stop, escalate=not supervised):
        dataset = load_data(args)
        kdist.train_and_evaluate(run_config, dataset, log=_log, stop=stop,
                                 optimizer_fn=config.OPTIMIZERS[args.optimizer])
    return 0


@_quiet_signals("stopped")
def evaluate_main(argv=None):
    parser = argparse.ArgumentParser(
        prog="evaluate.py",
        description="Restore the newest checkpoint of --checkpoint-dir into a fresh model "
                    "with no distribution, on the backend chosen by KERAS_BACKEND, and "
                    "print its test accuracy.")
    _add_common(parser)
    add_config_flags(parser, ["precision"])
    return _run(parser, argv, _evaluate)


def _evaluate(args):
    _start(args)
    path = kdist.latest_checkpoint(args.checkpoint_dir)
    if path is None:
        raise errors.CheckpointError(f"no checkpoint in {os.path.abspath(args.checkpoint_dir)}; "
                                     "train first or pass --checkpoint-dir")
    result = kdist.evaluate_checkpoint(path, load_data(args), precision=args.precision)
    from kdist import reporting  # Loads Keras: only after _start.

    print(f"{path}: {reporting.format_results(result, 'test_')}")
    return 0


@_quiet_signals("stopped")
def bench_main(argv=None):
    parser = argparse.ArgumentParser(
        prog="bench.py",
        description="Measure kdist's training loop against Keras fit on the backend chosen "
                    "by KERAS_BACKEND: same model, data, batch and devices, one process. "
                    "Prints a table, then one JSON line.")
    add_config_flags(parser, ["batch_size_per_replica", "replicas", "steps_per_execution"])
    parser.add_argument("--steps", type=positive(int), default=None,
                        help="steps per timed epoch (default: a whole epoch)")
    parser.add_argument("--windows", type=positive(int), default=config.BENCH_WINDOWS,
                        help="steady epochs timed after the first; their median counts "
                             "(default: %(default)s)")
    parser.add_argument("--precision", type=names(config.PRECISIONS),
                        default=(config.DEFAULT_PRECISION,), metavar="P[,P...]",
                        help="the dtype policies to measure, each one table row: "
                             f"{', '.join(config.PRECISIONS)}, or several separated by "
                             "commas (default: float32)")
    _add_bench_choices(parser)
    _add_common(parser, checkpoints=False)
    _add_multiworker(parser)
    # Keras' fit raises ValueError for inputs it cannot take; one line, as before.
    return _run(parser, argv, _bench, failures=(ValueError,))


def _add_bench_choices(parser):
    parser.add_argument("--model", choices=config.BENCH_MODELS, default=config.BENCH_MODELS[0],
                        help="the network: the tutorial CNN; the same with Keras' stock "
                             "Conv2D and MaxPooling2D (cnn-stock: what kdist's JAX layers "
                             "gain); or ResNet-20 on synthetic 32x32x3 images of 10 classes "
                             "(--data-dir and --synthetic apply to the CNNs only) "
                             "(default: %(default)s)")
    parser.add_argument("--input", type=names(config.BENCH_INPUTS), default=("numpy",),
                        metavar="I[,I...]",
                        help="how kdist is fed the same arrays, each one table row: "
                        "directly or through tf.data, a PyDataset or Grain "
                        f"({', '.join(config.BENCH_INPUTS)}), or several separated by "
                        "commas, measured in turn in this process; fit always takes the "
                        "arrays (default: numpy)")
    parser.add_argument("--no-fit", dest="fit", action="store_false",
                        help="measure kdist only, not Keras fit (several workers never "
                             "measure fit)")
    parser.add_argument("--no-peak", dest="peak", action="store_false",
                        help="skip measuring the CPU's matmul GFLOP/s (about 3 s; null in "
                             "the JSON)")


def _bench(args):
    for kind in args.input:
        needs = {"tfdata": "tensorflow", "grain": "grain"}.get(kind)
        if needs and importlib.util.find_spec(needs) is None:
            raise errors.UsageError(f"--input {kind} needs {needs}, not installed: "
                                    f"pip install kdist[{needs}]")
    spec = _cluster_spec(args)
    _start(args, args.replicas)
    _connect(spec, args.replicas)
    from kdist import bench, resnet

    dataset = resnet.synthetic_cifar() if args.model == "resnet20" else load_data(args)
    bench.run(dataset, args.replicas, args.batch_size_per_replica, args.steps,
              args.windows, args.steps_per_execution, log=_log, precisions=args.precision,
              model=args.model, fit=args.fit, measure_peak=args.peak, input_kinds=args.input)
    return 0
