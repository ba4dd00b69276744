"""What the commands share: exit statuses, the data and multi-worker flags, start-up.

Every main maps kdist's errors to exit statuses in one place, `run`.
"""

import functools
import os
import sys
import warnings

import kdist
from kdist import checks, errors, hints
from kdist.cli.flags import add_config_flags, positive
from kdist.datasets.sizes import FASHION_MNIST_TRAIN
from kdist.runtime import startup
from kdist.workers import cluster, interrupt, processes


def _usage(parser, error):
    # "PROG: error: ..." and exit status 2, as argparse; argparse's own flag errors
    # print the usage first, a setting refused after parsing does not repeat it.
    parser.exit(2, f"{parser.prog}: error: {error}\n")


def _interrupted(parser, error):
    print(f"interrupted: {error}", file=sys.stderr)
    return error.exit_status


def _failed(parser, error):
    print(f"{parser.prog}: error: {error}", file=sys.stderr)  # As argparse names its own.
    return 1


# How each kind of error ends a script, first match wins: usage errors exit 2
# as argparse's own do, a stop on a signal 128 + the signal, the rest 1.
EXIT_STATUSES = ((errors.UsageError, _usage), (errors.Interrupted, _interrupted),
                 (errors.KdistError, _failed))


def run(parser, argv, body, failures=()):
    """Parses `argv` and returns `body(args)`; a kdist error (or one of `failures`)
    ends as `EXIT_STATUSES` says."""
    args = parser.parse_args(argv)
    try:
        with hints.command_line():  # Messages name this command's flags.
            return body(args)
    except (errors.KdistError, *failures) as error:
        handler = next((h for kind, h in EXIT_STATUSES if isinstance(error, kind)), _failed)
        return handler(parser, error)
    except Exception as error:
        if getattr(error, "replica_traceback", None) is None:
            raise
        # A replica process's own exception, its traceback printed already: one line.
        return _failed(parser, f"{type(error).__name__}: {error}")


def quiet_signals(message):
    """Makes SIGINT/SIGTERM outside training exit 128 + signal with one line on stderr."""
    def decorate(main_fn):
        @functools.wraps(main_fn)
        def wrapper(argv=None, **kwargs):
            with interrupt.exit_on_signals(message):
                return main_fn(argv, **kwargs)

        return wrapper

    return decorate


def add_data_flags(parser, checkpoints=True):
    if checkpoints:
        add_config_flags(parser, ["checkpoint_dir"])
    parser.add_argument("--data-dir", default=None,
                        help="folder with the four Fashion-MNIST IDX .gz files (default: "
                             "the Keras cache, then /usr/share/datasets/fashion-mnist, "
                             "then download)")
    parser.add_argument("--synthetic", nargs="?", const=FASHION_MNIST_TRAIN, type=positive(int),
                        metavar="N",
                        help="use N generated training examples of Fashion-MNIST's shapes "
                             f"(default {FASHION_MNIST_TRAIN:,}) and N/6 test examples instead "
                             "of the data set (smoke runs)")
    parser.add_argument("--verbose", action="store_true",
                        help="show the framework's start-up logs (TensorFlow, JAX, torch)")


def add_multiworker_flags(parser):
    group = parser.add_argument_group(
        "several workers", "Run this script once per worker, with the same --peers and each "
        "its own --worker-index (kdist-launch does so on one machine). Without these "
        "flags, KDIST_PEERS and KDIST_WORKER_INDEX, a SLURM job step's variables, TF_CONFIG "
        "(TensorFlow), KERAS_DISTRIBUTION_JOB_ADDRESSES, KERAS_DISTRIBUTION_NUM_PROCESSES and "
        "KERAS_DISTRIBUTION_PROCESS_ID (JAX), or torchrun's RANK, WORLD_SIZE, MASTER_ADDR and "
        "MASTER_PORT (torch) are read (docs/library.md, Multiple machines). "
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


def cluster_spec(args):
    """This worker's ClusterSpec from the flags or the environment."""
    return cluster.from_flags_and_env(args.workers, args.worker_index, args.peers,
                                      args.connect_timeout, backend=startup.selected_backend())


def connect(spec, replicas):
    """Joins the other workers (bounded by --connect-timeout) before anything else runs."""
    from kdist.engines import joining

    joining.join(spec, replicas)


def load_data(args):
    if getattr(args, "tfrecords", None):
        from kdist.inputs import tfrecords

        return tfrecords.fashion_mnist(args.tfrecords)
    if args.synthetic:
        try:
            return kdist.synthetic_fashion_mnist(args.synthetic, seed=0)
        except MemoryError as error:  # NumPy's names the size: "Unable to allocate 74.5 GiB ..."
            raise errors.UsageError(f"--synthetic {args.synthetic:,}: more examples than this "
                                    f"machine's memory holds ({error})") from None
    return kdist.load_fashion_mnist(args.data_dir)


def log(line):
    try:
        print(line, flush=True)  # Line by line, also into pipes and `tee`.
    except BrokenPipeError:  # Its reader is gone (a killed launcher): the run goes on,
        processes.silence_output()  # to its agreed stop and checkpoint.


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Shows kdist's checkpoint warnings as one `warning: ...` line on stderr."""
    from kdist.checkpoints import CheckpointWarning

    if issubclass(category, CheckpointWarning):
        print(f"warning: {message}", file=sys.stderr, flush=True)
    else:
        _DEFAULT_SHOWWARNING(message, category, filename, lineno, file, line)


_DEFAULT_SHOWWARNING = warnings.showwarning


def start(args, replicas=None):
    """Sets devices, log levels and warning lines, then imports the frameworks (quietly)."""
    warnings.showwarning = _show_warning
    startup.prepare_environment(replicas, args.verbose)
    startup.load_frameworks(quiet=not args.verbose)


def check_paths(args):
    """Checks the output files and the data folder before the frameworks load."""
    checks.check_metrics_file(getattr(args, "metrics_file", None))
    checks.check_tensorboard(getattr(args, "tensorboard", None))
    if args.data_dir is not None and not args.synthetic:
        from kdist.datasets import fashion_mnist

        fashion_mnist.check_data_dir(args.data_dir)


def add_model_flag(parser, what):
    """--model SPEC: the function that builds `what` (`model_function`)."""
    parser.add_argument("--model", metavar="SPEC", default=None,
                        help=f"FILE.py, FILE.py:FN or MODULE:FN: the function (FN, default "
                             f"model) that builds {what}, in a Python file or an importable "
                             "module (default: the tutorial CNN)")


def _model_spec(spec):
    """(file or module, function name) of a --model value."""
    where, colon, name = spec.rpartition(":")
    return (where, name) if colon and name.isidentifier() else (spec, "model")


def check_model_file(spec):
    """Raises UsageError unless --model's file exists or its module can be found
    (before anything starts)."""
    where, _ = _model_spec(spec)
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise errors.UsageError(f"--model {spec}: no such file")
        return
    import importlib.util

    if os.getcwd() not in sys.path:  # As `python -m` and uvicorn: the current folder's modules.
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise errors.UsageError(f"--model {spec}: no such file, nor a module Python can "
                                f"import (give FILE.py, FILE.py:FN or MODULE:FN)")


def model_function(spec):
    """The function `--model spec` names: FN (default `model`) of a Python file
    (`mine.py`, `mine.py:build`) or of an importable module (`mine:build`),
    wrapped so that what it returns is checked (`_checked_model`). A file's
    folder is put first on `sys.path`, as `python FILE.py` does, so the file
    imports the modules beside it (in torch's replica processes too)."""
    import importlib
    import importlib.util
    import inspect

    check_model_file(spec)
    where, name = _model_spec(spec)
    try:
        if where.endswith(".py"):
            folder = os.path.dirname(os.path.abspath(where))
            if folder not in sys.path:
                sys.path.insert(0, folder)
            loaded = importlib.util.spec_from_file_location("kdist_user_model", where)
            module = importlib.util.module_from_spec(loaded)  # type: ignore[arg-type]
            loaded.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(where)
    except Exception as e:  # A file that does not run: one line, as for other flags.
        raise errors.UsageError(f"--model {spec} does not run: {type(e).__name__}: {e}") from e
    function = getattr(module, name, None)
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(function, keras.Model):
        raise errors.UsageError(f"--model {spec}: {name} is a model, not a function: define "
                                f"{name}() that builds and returns it")
    if not callable(function):
        raise errors.UsageError(f"--model {spec} defines no function {name}() that builds "
                                "the model")
    try:
        inspect.signature(function).bind()
    except TypeError as e:
        raise errors.UsageError(f"--model {spec}: kdist calls {name}() with no arguments, "
                                f"and it needs some ({e})") from e
    except ValueError:  # A callable whose signature Python cannot read: it is called.
        pass
    return functools.partial(_checked_model, function, f"--model {spec}: {name}()")


def _checked_model(function, named):
    """`function()`, a compiled Keras model or one with its own `train_step`;
    anything else is a UsageError naming the flag (`named`). kdist would compile
    an uncompiled one with its defaults, which are not the flags'."""
    import keras

    from kdist.step import program

    model = function()
    if not isinstance(model, keras.Model):
        raise errors.UsageError(f"{named} returned {type(model).__name__}, not a Keras model: "
                                "return the model it builds")
    if not model.compiled and not program.defines(model, "train_step"):
        raise errors.UsageError(f"{named} returned a model that is not compiled: compile it "
                                "there with its optimizer, loss and metrics, as for fit (or "
                                "give it its own train_step)")
    return model
