"""Plot train/test loss and accuracy per epoch: `python scripts/plot.py METRICS -o curves.png`."""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdist import plot  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="plot.py", description="Draw the learning curves of a --metrics-file as a PNG.")
    parser.add_argument("metrics_file", help="JSON lines written by train.py --metrics-file")
    parser.add_argument("-o", "--output", default="curves.png",
                        help="PNG to write (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        print(plot.plot_curves(args.metrics_file, args.output))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ImportError:
        print("error: plotting needs matplotlib; pip install 'kdist[plot]'", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
