"""kdist's whole training run against Keras `fit` on the same batches, epoch by epoch.

    KERAS_BACKEND=tensorflow python scripts/fit_order_check.py [--epochs 10] [--seed 0]
        [--precision float32|mixed_bfloat16|mixed_float16] [--synthetic N]
        [--repeat-first-order]

Trains the tutorial's CNN (Adam 1e-3, batch 64, one replica) with
`kdist.train_and_evaluate`, then trains a second model from the same initial
weights with `fit`, fed each epoch's batches in the order kdist used
(`kdist.inputs.arrays.epoch_order`, full batches only), and prints both test
accuracies after every epoch and their largest difference. The tests compare
single steps and short runs; this script compares a whole run, so that a run's
final accuracy (one seed's 89.73% in docs/performance.md) can be told apart from
a difference between kdist and `fit`: equal columns mean `fit` ends where kdist
ends on that data order. `--repeat-first-order` feeds `fit` epoch 1's batches in
every epoch, as `fit` on TensorFlow orders arrays after
`keras.utils.set_random_seed`, to measure what that costs.
"""

import argparse
import json
import tempfile

from kdist.cli.flags import positive, seed
from kdist.config import TrainConfig
from kdist.inputs import base
from kdist.precision import PRECISIONS
from kdist.runtime import startup

startup.prepare_environment()
with startup.native_logs_silenced():
    import keras

    import kdist
    from kdist import tree
    from kdist.datasets import fashion_mnist
    from kdist.inputs import arrays
    from kdist.models.cnn import create_model
    from kdist.precision import policy


def compiled_cnn(initial_weights):
    """The tutorial's CNN and optimizer; appends its initial weights to `initial_weights`."""
    model = create_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    initial_weights.append(model.get_weights())
    return model


def kdist_accuracies(dataset, epochs, seed, precision, initial_weights):
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        config = TrainConfig(epochs=epochs, seed=seed, precision=precision,
                             checkpoint_dir=checkpoint_dir, checkpoint_every=epochs)
        result = kdist.train_and_evaluate(config, dataset,
                                          model_fn=lambda: compiled_cnn(initial_weights))
    return [epoch["test_accuracy"] for epoch in result.epochs]


def fit_accuracies(dataset, epochs, seed, precision, weights, repeat_first_order=False):
    """`fit` from `weights`, one call per epoch on kdist's batches of that epoch (or
    of the first epoch), in order."""
    if keras.backend.backend() == "jax":
        keras.distribution.set_distribution(None)  # kdist's engine set one; fit runs without.
    with policy(precision):
        model = compiled_cnn([])
    model.set_weights(weights)
    batch = TrainConfig.batch_size_per_replica
    count = tree.num_examples(dataset.train_x)
    rows = base.steps_per_epoch(count, batch) * batch
    accuracies = []
    for epoch in range(epochs):
        drawn_for = 0 if repeat_first_order else epoch
        order = arrays.epoch_order(count, seed, drawn_for)[:rows]
        model.fit(dataset.train_x[order], dataset.train_y[order], batch_size=batch, epochs=1,
                  shuffle=False, verbose=0)
        accuracies.append(model.evaluate(dataset.test_x, dataset.test_y, batch_size=batch,
                                         verbose=0, return_dict=True)["accuracy"])
    return accuracies


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=positive(int), default=TrainConfig.epochs,
                        help="epochs of each run (default %(default)s)")
    parser.add_argument("--seed", type=seed, default=TrainConfig.seed,
                        help="kdist's seed: initial weights and data order (default %(default)s)")
    parser.add_argument("--precision", choices=PRECISIONS, default=TrainConfig.precision,
                        help="the dtype policy of both models (default %(default)s)")
    parser.add_argument("--synthetic", type=positive(int), metavar="N",
                        help="N generated training examples (N/6 test) instead of Fashion-MNIST")
    parser.add_argument("--repeat-first-order", action="store_true",
                        help="feed fit the first epoch's batches in every epoch")
    args = parser.parse_args(argv)
    dataset = (fashion_mnist.synthetic_fashion_mnist(args.synthetic) if args.synthetic
               else fashion_mnist.load_fashion_mnist())
    initial_weights = []
    ours = kdist_accuracies(dataset, args.epochs, args.seed, args.precision, initial_weights)
    theirs = fit_accuracies(dataset, args.epochs, args.seed, args.precision, initial_weights[0],
                            args.repeat_first_order)
    batches = "epoch 1's batches" if args.repeat_first_order else "same batches"
    print(f"epoch  kdist test accuracy  fit test accuracy ({batches})")
    for epoch, (a, b) in enumerate(zip(ours, theirs), 1):
        print(f"{epoch:5d}  {100 * a:18.2f}%  {100 * b:16.2f}%")
    gap = max(abs(a - b) for a, b in zip(ours, theirs))
    print(f"largest difference: {100 * gap:.2f} points")
    print(json.dumps({"backend": keras.backend.backend(), "seed": args.seed,
                      "precision": args.precision,
                      "repeat_first_order": args.repeat_first_order,
                      "kdist": ours, "fit": theirs}))


if __name__ == "__main__":
    main()
