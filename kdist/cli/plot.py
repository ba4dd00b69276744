"""Learning curves from a metrics file (needs matplotlib: `pip install kdist[plot]`)."""

import argparse
import json
import os
import sys

from kdist import checks
from kdist.cli.flags import command_name
from kdist.errors import UsageError


def read_epochs(metrics_file):
    """The per-epoch records of a JSON-lines metrics file, last run's value per
    epoch; blank lines are skipped, a line that is no JSON object is a ValueError."""
    by_epoch = {}
    with open(metrics_file) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{metrics_file}:{number}: not JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{metrics_file}:{number}: not a JSON object, so not a "
                                 "kdist record")
            if "epoch" in record:
                by_epoch[record["epoch"]] = record  # A resumed run repeats no epoch.
    if not by_epoch:
        raise ValueError(f"{metrics_file} has no epoch records; pass the file written by "
                         "kdist-train --metrics-file")
    return [by_epoch[e] for e in sorted(by_epoch)]


def metric_names(records):
    """The metrics that any record holds for either split ("loss" first), by their
    Keras names: a run without test data, or a test step of other names, has train
    curves; a metric some epochs lack (a callback's, a resumed run's) has gaps."""
    names = {k.split("_", 1)[1] for r in records for k in r if k.startswith(("train_", "test_"))}
    return sorted(names, key=lambda name: (name != "loss", name))


def image_path(path):
    """The file written for output `path`: `path` with `.png` appended where it has
    no suffix (`curves` and `curves.` are `curves.png`), else `path` itself (an existing
    folder too)."""
    root, suffix = os.path.splitext(path)
    return root + ".png" if suffix in ("", ".") and not os.path.isdir(path) else path


def plot_curves(metrics_file, output):
    """Draws train/test curves per epoch, one panel per metric, into one image at
    `image_path(output)` (its suffix names the format); returns that path."""
    output = image_path(output)
    import matplotlib

    matplotlib.use("Agg")  # Files only; no display needed.
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records = read_epochs(metrics_file)
    epochs = [r["epoch"] for r in records]
    names = metric_names(records)
    if not names:
        raise ValueError(f"{metrics_file} has epoch records but no train_ or test_ values "
                         "to draw; pass the file written by kdist-train --metrics-file")
    figure, panels = plt.subplots(1, len(names), figsize=(5 * len(names), 4), dpi=120,
                                  squeeze=False)
    for axes, name in zip(panels[0], names):
        for split, style in (("train", "o-"), ("test", "s--")):
            values = [r.get(f"{split}_{name}") for r in records]  # None: a gap.
            if any(value is not None for value in values):
                axes.plot(epochs, values, style, label=split)
        axes.set_xlabel("Epoch")
        axes.set_ylabel(name)
        axes.set_title(name)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(metrics_file)
    figure.tight_layout()
    figure.savefig(output)
    plt.close(figure)
    return output


def main(argv=None):
    """`kdist-plot METRICS -o IMAGE`; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog=command_name("kdist-plot"),
        description="Draw the learning curves of a --metrics-file as an image (PNG by "
                    "default) and print its path.")
    parser.add_argument("metrics_file", help="JSON lines written by kdist-train --metrics-file")
    parser.add_argument("-o", "--output", default="curves.png",
                        help="an image file; .png unless its suffix names another format "
                             "matplotlib writes (.svg, .pdf, .jpg, ...); .png is appended "
                             "to a path without a suffix (default: %(default)s)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.metrics_file):
        parser.error(f"{args.metrics_file}: no such file")
    try:
        checks.check_writable_file(image_path(args.output), "--output")
    except UsageError as e:
        parser.error(str(e))
    try:
        print(plot_curves(args.metrics_file, args.output))
    except (OSError, ValueError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    except ImportError:
        print(f"{parser.prog}: error: plotting needs matplotlib; pip install 'kdist[plot]'",
              file=sys.stderr)
        return 1
    return 0
