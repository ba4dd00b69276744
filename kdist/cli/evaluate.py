"""`kdist-evaluate` (`scripts/evaluate.py`): the newest checkpoint, restored into a
fresh model with no distribution, evaluated on the test data."""

import argparse
import os

import kdist
from kdist import errors
from kdist.cli import common
from kdist.cli.flags import add_config_flags


@common.quiet_signals("stopped")
def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="evaluate.py",
        description="Restore the newest checkpoint of --checkpoint-dir into a fresh model "
                    "with no distribution, on the backend chosen by KERAS_BACKEND, and "
                    "print its test accuracy.")
    common.add_data_flags(parser)
    add_config_flags(parser, ["precision", "seed"])
    parser.add_argument("--model", metavar="FILE.py", default=None,
                        help="a Python file whose function model() builds the model the "
                             "checkpoint was trained with, a model of your own (e.g. "
                             "examples/dcgan.py; default: the tutorial CNN)")
    return common.run(parser, argv, _evaluate)


def model_function(path):
    """The function `model` of the Python file at `path`."""
    import importlib.util

    if not os.path.isfile(path):
        raise errors.UsageError(f"--model {path}: no such file")
    spec = importlib.util.spec_from_file_location("kdist_evaluated_model", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as e:  # A file that does not run: one line, as for other flags.
        raise errors.UsageError(f"--model {path} does not run: {type(e).__name__}: {e}") from e
    if not callable(getattr(module, "model", None)):
        raise errors.UsageError(f"--model {path} defines no function model() that builds "
                                "the model")
    return module.model


def _evaluate(args):
    common.start(args)
    model_fn = model_function(args.model) if args.model else kdist.create_model  # First.
    path = kdist.latest_checkpoint(args.checkpoint_dir)
    if path is None:
        raise errors.CheckpointError(f"no checkpoint in {os.path.abspath(args.checkpoint_dir)}; "
                                     "train first or pass --checkpoint-dir")
    result = kdist.evaluate_checkpoint(path, common.load_data(args), model_fn=model_fn,
                                       precision=args.precision, seed=args.seed)
    from kdist.loop import reporting  # Loads Keras: only after common.start.

    print(f"{path}: {reporting.format_results(result, 'test_')}")
    return 0
