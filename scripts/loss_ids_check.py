"""How often a layer's loss is dropped, traced many times (`jax.make_jaxpr`, no compiling).

    KERAS_BACKEND=jax python scripts/loss_ids_check.py fit --traces 1200
    KERAS_BACKEND=jax python scripts/loss_ids_check.py kdist --traces 2000 [--without-fix]

Keras finds a layer's losses by the ids of the tensors it added, and an outermost call
drops those its layers recorded at their last call, whose ids CPython may have given to
new tensors (docs/log/2026-12-04-loss-ids.md).
- `fit`: Keras' own train and test steps of `tests/test_fit_parity.py`'s
  `regularized_classifier` (`--two-layers`: its earlier form, whose activity regularizer
  and `add_loss` sit in two layers) traced as `fit` traces them: train on 64 rows, test
  on 64, test on 45. Prints {(training, rows, losses found): traces}; the model has 4.
- `kdist`: a kdist step calling two models, each with two losses, inside each of two
  `kdist.value_and_grad`, as a GAN's step does. Prints {(first's, second's losses
  found): calls}; each has 2. `--without-fix` turns off kdist's emptying of the records
  and its keeping of the step's losses.
"""

import argparse
import collections
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from test_fit_parity import BATCH, classification_data  # noqa: E402
from test_fit_parity import regularized_classifier as one_layer  # noqa: E402

import kdist  # noqa: E402
from kdist import engines  # noqa: E402
from kdist.step import context  # noqa: E402
from kdist.step.program import Program  # noqa: E402


class AddLoss(keras.layers.Layer):
    """Identity that adds 0.1 * mean(x ** 2) to the model's losses."""

    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
        return x


def two_layers():
    """`regularized_classifier` before: its own losses in two layers."""
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu",
                                kernel_regularizer=keras.regularizers.L2(0.05),
                                activity_regularizer=keras.regularizers.L1(0.01))(inputs)
    logits = keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.05))(
        AddLoss()(hidden))
    model = keras.Model(inputs, logits)
    model.compile(optimizer=keras.optimizers.SGD(0.5), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def check_fit(traces, model_fn):
    x, y = classification_data(400, seed=5)
    counts: collections.Counter = collections.Counter()
    stateless_call = keras.Model.stateless_call

    def counting(self, *args, **kwargs):
        result = stateless_call(self, *args, **kwargs)
        if kwargs.get("return_losses"):
            counts[(kwargs.get("training"), args[2].shape[0], len(result[2]))] += 1
        return result

    keras.Model.stateless_call = counting
    for i in range(traces):
        if i % 20 == 0:  # A new model now and then, as each test builds its own.
            model = model_fn()
            model.fit(x[:BATCH], y[:BATCH], verbose=0)
            state = [[v.value for v in vs] for vs in (
                model.trainable_variables, model.non_trainable_variables,
                model.optimizer.variables, model.metrics_variables)]
        jax.make_jaxpr(lambda s, d, m=model: m.train_step(s, d))(state, (x[:64], y[:64]))
        for rows in (64, 45):
            jax.make_jaxpr(lambda s, d, m=model: m.test_step(s, d))(
                (state[0], state[1], state[3]), (x[:rows], y[:rows]))
    return dict(counts)


CALLS: collections.Counter = collections.Counter()  # Of Pair's loss: (losses found).


class Pair(keras.Model):
    """Two models, each a Dense with an activity regularizer and an `add_loss` layer."""

    def __init__(self):
        super().__init__()
        self.first, self.second = (keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(
                8, activity_regularizer=keras.regularizers.L1(0.01)), AddLoss()])
            for _ in range(2))

    def train_step(self, data):
        def loss(model):
            out = self.second(self.first(data[0]))
            CALLS[(len(self.first.losses), len(self.second.losses))] += 1
            return keras.ops.mean(out) + sum(model.losses)

        return {"loss": sum(kdist.value_and_grad(lambda m=m: loss(m), m.trainable_variables)[0]
                            for m in (self.first, self.second))}


def check_kdist(traces):
    x = np.random.default_rng(0).normal(size=(300, 8)).astype(np.float32)
    engine, model = engines.create_engine(distributed=False), Pair()
    program = Program(model)
    program.build(engine, (x[:2], np.zeros(2, np.float32), None))
    CALLS.clear()
    values = [v.value for v in program.variables]
    for i in range(traces):
        rows = 1 + i % 300

        def step(vals, xs, rows=rows):
            batch = (xs, np.zeros(rows, np.float32), None)
            return program.run(engine.primitives(), True, batch,
                               list(zip(program.variables, vals)))[0]

        jax.make_jaxpr(step)(values, x[:rows])
    return dict(CALLS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["fit", "kdist"])
    parser.add_argument("--traces", type=int, default=1000)
    parser.add_argument("--two-layers", action="store_true")
    parser.add_argument("--without-fix", action="store_true")
    args = parser.parse_args()
    if keras.backend.backend() != "jax":
        parser.error("run with KERAS_BACKEND=jax")
    if args.what == "fit":
        print(check_fit(args.traces, two_layers if args.two_layers else one_layer))
        return
    if args.without_fix:
        context.forget_loss_ids = lambda layers: None

        def exit_keeping_nothing(scope, *exception):
            if scope.parent is not None:
                scope.parent.reads |= scope.reads
            return keras.StatelessScope.__exit__(scope, *exception)

        context.StepScope.__exit__ = exit_keeping_nothing
    print(check_kdist(args.traces))


if __name__ == "__main__":
    main()
