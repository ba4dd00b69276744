"""`kdist-train` (`scripts/train.py`, `python -m kdist`): train, checkpoint, evaluate.

The train flags come from `kdist.TrainConfig`'s fields (`kdist.cli.flags`).
"""

import argparse
import dataclasses
import functools
import sys
from typing import Any

import kdist
from kdist import checks, config
from kdist.cli import common
from kdist.cli.flags import add_config_flags, command_name, config_from_args
from kdist.errors import UsageError
from kdist.workers.processes import follow_launcher


def train_parser(description=None, model_flag=True, flags=None):
    """kdist-train's flags; a script's `description` (its docstring, shown as
    written) and its own `flags` (an `argparse.ArgumentParser(add_help=False)`)
    replace the command's description and join its flags."""
    parser = argparse.ArgumentParser(
        prog=command_name("python -m kdist"), parents=[flags] if flags else [],
        formatter_class=(argparse.RawDescriptionHelpFormatter if description
                         else argparse.HelpFormatter),
        description=description or (
            "Train the tutorial CNN on Fashion-MNIST, data-parallel, on the backend "
            "chosen by KERAS_BACKEND (tensorflow, jax or torch); then restore the latest "
            "checkpoint without distribution and evaluate it."))
    add_config_flags(parser)
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar (it is also off when stdout is not a terminal)")
    parser.add_argument("--optimizer", choices=tuple(config.OPTIMIZERS), default=None,
                        help="the optimizer; sgd is plain SGD, for exact comparisons between "
                             "runs; --learning-rate applies to any (default: "
                             f"{config.DEFAULT_OPTIMIZER})")
    if model_flag:
        common.add_model_flag(parser, "your model, compiled as for fit (its optimizer, loss "
                                      "and metrics; --optimizer and --learning-rate then do "
                                      "not apply), or with its own train_step")
    common.add_data_flags(parser, checkpoints=False)
    parser.add_argument("--tfrecords", default=None, metavar="DIR",
                        help="stream the data from the TFRecord files of DIR (written by "
                             "scripts/write_tfrecords.py) instead of loading it into memory")
    common.add_multiworker_flags(parser)
    return parser


@common.quiet_signals("stopped while starting; nothing was trained")
def main(argv=None, model_fn=None, description=None, after=None, flags=None):
    """`kdist-train`; with `model_fn(args) -> keras.Model`, a script's own model
    (its own `train_step`, its own optimizers) takes the tutorial CNN's place,
    with the same flags (`--optimizer` and `--learning-rate` are then the
    script's to read from `args`) and its own `flags` (`train_parser`).
    `after(args)` runs once training has ended well. Returns the exit status."""
    parser = (train_parser(description, model_flag=False, flags=flags) if model_fn
              else train_parser(flags=flags))
    for action in parser._actions if model_fn else ():  # The script's model reads these.
        if action.dest in ("optimizer", "learning_rate"):
            action.help = ("for the script's model, which reads it from args if at all "
                           "(see the script; unset: the model's own choice)")

    def body(args):
        status = _train(args) if model_fn is None else _train(args, model_fn)
        if after is not None:
            after(args)
        return status

    return common.run(parser, argv, body)


def _train(args, model_fn=None):
    model_file = getattr(args, "model", None)  # --model: its function, no flags.
    if model_file:
        common.check_model_file(model_file)
        for flag, value in (("--optimizer", args.optimizer),
                            ("--learning-rate", args.learning_rate)):
            if value is not None:
                raise UsageError(f"{flag}: the model of --model {model_file} brings its own "
                                 "optimizer; set it where the model is built")
    args.optimizer = args.optimizer or config.DEFAULT_OPTIMIZER  # A script's model reads it.
    stop = kdist.StopRequest()
    supervised = follow_launcher(stop)  # Under kdist-launch: stop when it is gone.
    spec = common.cluster_spec(args)
    common.check_paths(args)
    checks.check_output_folder(args.checkpoint_dir, "--checkpoint-dir")
    common.start(args, args.replicas)
    common.connect(spec, args.replicas)
    if model_file:  # After `start`: the file may import Keras.
        from_file = common.model_function(model_file)
        model_fn = lambda args: from_file()  # noqa: E731
    run_config = config_from_args(
        args, progress=sys.stdout.isatty() and not args.quiet and spec.is_chief)
    model: dict[str, Any] = dict(optimizer_fn=config.OPTIMIZERS[args.optimizer])
    if model_fn is not None:  # The model's optimizers are its own; it reads the flags.
        model = dict(model_fn=functools.partial(model_fn, args))
        run_config = dataclasses.replace(run_config, learning_rate=None)
    # From here a signal is a stop request that every worker agrees on: a
    # worker that exited alone would leave the others waiting in a step.
    with kdist.stop_on_signals(stop, escalate=not supervised):
        dataset = common.load_data(args)
        kdist.train_and_evaluate(run_config, dataset, log=common.log, stop=stop, **model)
    return 0
