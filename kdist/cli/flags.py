"""Command-line flags: parsers of their values, and the train flags of `TrainConfig`.

The train flags are derived from `TrainConfig`'s fields (their help is
in the fields' metadata, see `kdist.config`), so a field and its flag cannot
drift apart.
"""

import argparse
import math
import os
import sys
import typing

from kdist import checks, config
from kdist.config import TrainConfig


def command_name(fallback):
    """What a command calls itself in its usage and error lines: the name it was
    started by (`kdist-train`, `train.py`, `dcgan.py`), or `fallback` where
    Python ran it as a module (`python -m kdist`)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return fallback if name in ("", "-c", "__main__.py") else name


def positive(kind):
    """A parser of a `kind` (int or float) greater than 0 and finite."""
    return _number(kind, lambda value: value > 0, "must be greater than 0")


def non_negative(kind):
    """A parser of a `kind` (int or float) of 0 or more and finite."""
    return _number(kind, lambda value: value >= 0, "must be 0 or more")


def _number(kind, allowed, requirement):
    """A parser of a finite `kind` for which `allowed(value)` holds."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if not allowed(value):
            raise argparse.ArgumentTypeError(f"{requirement}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def seed(text):
    """A seed: a whole number in `kdist.checks.SEED_RANGE`."""
    try:
        checks.check_seed(int(text), name="the seed")
    except ValueError as e:  # Not a whole number, or a UsageError (a ValueError too).
        low, high = checks.SEED_RANGE
        raise argparse.ArgumentTypeError(
            f"expected a whole number in {low}..{high}, got {text!r}") from e
    return int(text)


def names(choices):
    """A parser of comma-separated names out of `choices`, each kept once, in order."""
    def parse(text):
        names = [name.strip() for name in text.split(",")]
        if any(name not in choices for name in names):
            raise argparse.ArgumentTypeError(
                f"expected one or more of {', '.join(choices)} separated by commas, "
                f"got {text!r}")
        return tuple(dict.fromkeys(names))

    return parse


_PARSERS = {"seed": seed}  # Number fields that are not simply "greater than 0".


def config_argument(field):
    """(flag, add_argument keywords) of a `TrainConfig` field."""
    kind = next(t for t in typing.get_args(field.type) + (field.type,) if t is not type(None))
    help = field.metadata["help"]
    if field.default is not None and kind is not bool and "(default" not in help:
        help += " (default: %(default)s)"
    keywords = dict(dest=field.name, default=field.default, help=help)
    for key in ("choices", "metavar"):
        if key in field.metadata:
            keywords[key] = field.metadata[key]
    if kind is bool:
        keywords["action"] = "store_false" if field.default else "store_true"
    elif kind in (int, float):
        keywords["type"] = _PARSERS.get(field.name) or positive(kind)
    return config.flag_name(field), keywords


def add_config_flags(parser, names=None, helps=None):
    """Adds the flags of `TrainConfig`'s fields `names` (default: every field with a
    flag); `helps` gives some of them another help text (what they mean there)."""
    for field in config.flag_fields():
        if names is None or field.name in names:
            flag, keywords = config_argument(field)
            if helps and field.name in helps:
                keywords["help"] = helps[field.name]
            parser.add_argument(flag, **keywords)


def config_from_args(args, **fields):
    """The `TrainConfig` of parsed train flags; `fields` sets those without a flag."""
    values = {f.name: getattr(args, f.name) for f in config.flag_fields()}
    return TrainConfig(**values, **fields)
