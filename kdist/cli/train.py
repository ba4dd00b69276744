"""`kdist-train` (`scripts/train.py`, `python -m kdist`): train, checkpoint, evaluate.

The train flags come from `kdist.TrainConfig`'s fields (`kdist.cli.flags`).
"""

import argparse
import sys

import kdist
from kdist import config
from kdist.cli import common
from kdist.cli.flags import add_config_flags, config_from_args
from kdist.workers.processes import follow_launcher


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
    common.add_data_flags(parser, checkpoints=False)
    parser.add_argument("--tfrecords", default=None, metavar="DIR",
                        help="stream the data from the TFRecord files of DIR (written by "
                             "scripts/write_tfrecords.py) instead of loading it into memory")
    common.add_multiworker_flags(parser)
    return parser


@common.quiet_signals("stopped while starting; nothing was trained")
def main(argv=None):
    return common.run(train_parser(), argv, _train)


def _train(args):
    stop = kdist.StopRequest()
    supervised = follow_launcher(stop)  # Under kdist-launch: stop when it is gone.
    spec = common.cluster_spec(args)
    common.check_paths(args)
    common.start(args, args.replicas)
    common.connect(spec, args.replicas)
    run_config = config_from_args(
        args, progress=sys.stdout.isatty() and not args.quiet and spec.is_chief)
    # From here a signal is a stop request that every worker agrees on: a
    # worker that exited alone would leave the others waiting in a step.
    with kdist.stop_on_signals(stop, escalate=not supervised):
        dataset = common.load_data(args)
        kdist.train_and_evaluate(run_config, dataset, log=common.log, stop=stop,
                                 optimizer_fn=config.OPTIMIZERS[args.optimizer])
    return 0
