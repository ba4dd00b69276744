"""`kdist-bench` (`scripts/bench.py`): kdist's loop against Keras `fit`."""

import argparse
import importlib.util

from kdist import errors, precision
from kdist.bench import choices
from kdist.cli import common
from kdist.cli.flags import add_config_flags, command_name, names, positive


@common.quiet_signals("stopped")
def main(argv=None):
    parser = argparse.ArgumentParser(
        prog=command_name("kdist-bench"),
        description="Measure kdist's training loop against Keras fit on the backend chosen "
                    "by KERAS_BACKEND: same model, data, batch and devices, one process. "
                    "Prints a table, then one JSON line.")
    add_config_flags(parser, ["batch_size_per_replica", "replicas", "steps_per_execution"])
    parser.add_argument("--steps", type=positive(int), default=None,
                        help="steps per timed epoch (default: a whole epoch)")
    parser.add_argument("--windows", type=positive(int), default=choices.WINDOWS,
                        help="steady epochs timed after the first; their median counts "
                             "(default: %(default)s)")
    parser.add_argument("--precision", type=names(precision.PRECISIONS),
                        default=(precision.DEFAULT_PRECISION,), metavar="P[,P...]",
                        help="the dtype policies to measure, each one table row: "
                             f"{', '.join(precision.PRECISIONS)}, or several separated by "
                             "commas (default: float32)")
    _add_bench_choices(parser)
    common.add_data_flags(parser, checkpoints=False)
    common.add_multiworker_flags(parser)
    # Keras' fit raises ValueError for inputs it cannot take: one line, as kdist's errors.
    return common.run(parser, argv, _bench, failures=(ValueError,))


def _add_bench_choices(parser):
    parser.add_argument("--model", choices=choices.MODELS, default=choices.MODELS[0],
                        help="the network: the tutorial CNN; the same with Keras' stock "
                             "Conv2D and MaxPooling2D (cnn-stock: what kdist's layers "
                             "gain); its weights with next to no arithmetic (cnn-weights: "
                             "what is left of a step is the loop, the gradients' all-reduce "
                             "and the update); ResNet-20 on synthetic 32x32x3 images of 10 classes "
                             "(--data-dir and --synthetic apply to the others only); or "
                             "examples/dcgan.py's GAN against fit with the train step "
                             "Keras' guide writes for this backend (default: %(default)s)")
    parser.add_argument("--input", type=names(choices.INPUTS), default=("numpy",),
                        metavar="I[,I...]",
                        help="how kdist is fed the same arrays, each one table row: "
                        "directly or through tf.data, a PyDataset or Grain "
                        f"({', '.join(choices.INPUTS)}), or several separated by "
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
    spec = common.cluster_spec(args)
    common.start(args, args.replicas)
    common.connect(spec, args.replicas)
    from kdist.bench import measure
    from kdist.datasets import cifar_shaped

    dataset = cifar_shaped.synthetic_cifar() if args.model == "resnet20" else common.load_data(args)
    if args.model == "dcgan":
        from kdist.bench import gan

        gan.run(dataset, args.replicas, args.batch_size_per_replica, args.steps, args.windows,
                log=common.log)
        return 0
    measure.run(dataset, args.replicas, args.batch_size_per_replica, args.steps,
              args.windows, args.steps_per_execution, log=common.log, precisions=args.precision,
              model=args.model, fit=args.fit, measure_peak=args.peak, input_kinds=args.input)
    return 0
