"""`kdist-evaluate` (`scripts/evaluate.py`): the newest checkpoint, restored into a
fresh model with no distribution, evaluated on the test data."""

import argparse
import os

import kdist
from kdist import errors
from kdist.cli import common
from kdist.cli.flags import add_config_flags, command_name


@common.quiet_signals("stopped")
def main(argv=None):
    parser = argparse.ArgumentParser(
        prog=command_name("kdist-evaluate"),
        description="Restore the newest checkpoint of --checkpoint-dir into a fresh model "
                    "with no distribution, on the backend chosen by KERAS_BACKEND, and "
                    "print its test accuracy.")
    common.add_data_flags(parser)
    add_config_flags(parser, ["precision", "seed"], helps={
        "seed": "seed of the test step's kdist.random draws and of the random state the "
                "model is built in: the run's seed gives the run's figures (default: "
                "%(default)s)"})
    common.add_model_flag(parser, "the model the checkpoint was trained with, a model of "
                                  "your own such as examples/dcgan.py")
    return common.run(parser, argv, _evaluate)


def _evaluate(args):
    # The paths first: a wrong one is one line before the frameworks load (seconds).
    if args.model:
        common.check_model_file(args.model)
    common.check_paths(args)
    folder = os.path.abspath(args.checkpoint_dir)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise errors.UsageError(f"--checkpoint-dir {folder} is a file, not a folder")
    common.start(args)
    model_fn = common.model_function(args.model) if args.model else kdist.create_model
    path = kdist.latest_checkpoint(folder)  # After the model file's own mistakes.
    if path is None:
        raise errors.CheckpointError(f"no checkpoint in {folder}; train first or pass "
                                     "--checkpoint-dir")
    result = kdist.evaluate_checkpoint(path, common.load_data(args), model_fn=model_fn,
                                       precision=args.precision, seed=args.seed)
    from kdist.loop import reporting  # Loads Keras: only after common.start.

    print(f"{path}: {reporting.format_results(result, 'test_')}")
    return 0
