"""Regression: float targets, MSE loss, MAE and MSE metrics, one or three outputs.

kdist's SGD steps must move the weights as Keras `fit` does on one device
(same weights, same batches), and its evaluation must give `model.evaluate`'s
numbers on a test set that no global batch divides (1,001 examples: full
global batches, then the rest as one smaller batch).
"""

import keras
import numpy as np
import pytest
from helpers import SEVERAL

from kdist import engines
from kdist.inputs import arrays
from kdist.loop import building, chunks, training

BACKEND = keras.backend.backend()
FEATURES, TRAIN, TEST = 5, 128, 1001
STEPS, GLOBAL_BATCH = 4, 32  # One epoch of 128 rows, shuffle=False.


def no_distribution():
    """Keras `fit` and fresh models run undistributed (a JAX engine sets a global one)."""
    if BACKEND == "jax":
        keras.distribution.set_distribution(None)


def regression_data(outputs, seed=0):
    """(x, y) train and test: y a noisy smooth function of x, shape (N,) or (N, outputs)."""
    rng = np.random.default_rng(seed)
    true_weights = rng.normal(0.0, 1.0, (FEATURES, outputs))

    def make(n):
        x = rng.normal(0.0, 1.0, (n, FEATURES)).astype(np.float32)
        y = (np.tanh(x @ true_weights) + 0.1 * rng.normal(0.0, 1.0, (n, outputs)) + 2.0)
        y = y.astype(np.float32)
        return x, y[:, 0] if outputs == 1 else y

    return make(TRAIN), make(TEST)


def regression_model(outputs):
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(outputs)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                  metrics=["mae", keras.metrics.MeanSquaredError()])
    return model


METRICS = ("loss", "mae", "mean_squared_error")


def fit_reference(outputs, train):
    """Initial weights, weights after one epoch of Keras fit and its history."""
    no_distribution()
    keras.utils.set_random_seed(1)
    model = regression_model(outputs)
    initial = model.get_weights()
    history = model.fit(*train, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    return model, initial, model.get_weights(), {k: v[-1] for k, v in history.history.items()}


@pytest.mark.parametrize("outputs", [1, 3])
@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_sgd_steps_and_evaluation_equal_keras(replicas, outputs):
    train, test = regression_data(outputs)
    reference, initial, fitted, fit_logs = fit_reference(outputs, train)

    engine = engines.create_engine(replicas)
    sample = tuple(a[:2] for a in train) + (None,)
    model, step = building.prepare_model(engine, GLOBAL_BATCH, sample,
                                         lambda: regression_model(outputs))
    model.set_weights(initial)  # Before compile_steps: the engine takes the values then.
    engine.compile_steps(step)
    batches = [tuple(a[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH] for a in train)
               + (None,) for i in range(STEPS)]
    totals, done = chunks.run_steps(engine, engine.train_chunk, batches, chunks.zero_totals(step),
                                   steps_per_execution=STEPS)
    engine.sync_to_model()
    assert done == STEPS

    trained = model.get_weights()
    moved = max(float(np.abs(f - i).max()) for f, i in zip(fitted, initial))
    worst = max(float(np.abs(t - f).max()) for t, f in zip(trained, fitted))
    train_results = step.results(totals)
    # The train loss and metrics of the epoch, as fit's history has them.
    train_gap = max(abs(train_results[k] / fit_logs[k] - 1) for k in METRICS)

    # kdist's evaluation of 1,001 rows (full global batches and the rest) vs Keras
    # evaluate, both on kdist's trained weights.
    results = chunks.evaluate(engine, step, *test, None, GLOBAL_BATCH, steps_per_execution=3)
    no_distribution()
    reference.set_weights(trained)
    expected = reference.evaluate(*test, batch_size=50, verbose=0, return_dict=True)
    eval_gap = max(abs(results[k] / expected[k] - 1) for k in METRICS)
    print(f"\n[{BACKEND}, {replicas} replicas, {outputs} outputs] weights moved {moved:.3f}, "
          f"differ from fit's by {worst:.1e}; train metrics relative gap {train_gap:.1e}; "
          f"evaluation relative gap {eval_gap:.1e}")
    assert moved > 1e-2  # The steps move the weights far beyond the tolerance.
    assert worst <= 1e-6
    assert train_gap <= 1e-6, (train_results, fit_logs)
    assert eval_gap <= 1e-6, (results, expected)
    assert set(results) == set(METRICS)


def test_sample_weights_go_to_weighted_metrics_only_as_in_keras():
    """`metrics` ignore sample weights and `weighted_metrics` use them, as in
    Keras fit and evaluate, also on a test set no global batch divides."""
    train, test = regression_data(3)
    rng = np.random.default_rng(7)
    train_weight = rng.uniform(0.0, 2.0, TRAIN).astype(np.float32)
    test_weight = rng.uniform(0.0, 2.0, TEST).astype(np.float32)

    def model_fn():
        model = regression_model(3)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"],
                      weighted_metrics=[keras.metrics.MeanAbsoluteError(name="weighted_mae")])
        return model

    no_distribution()
    keras.utils.set_random_seed(1)
    reference = model_fn()
    initial = reference.get_weights()
    logs = reference.fit(*train, sample_weight=train_weight, batch_size=GLOBAL_BATCH, epochs=1,
                         shuffle=False, verbose=0).history

    engine = engines.create_engine(2)
    model, step = building.prepare_model(engine, GLOBAL_BATCH,
                                         (train[0][:2], train[1][:2], train_weight[:2]), model_fn)
    model.set_weights(initial)
    engine.compile_steps(step)
    batches = [tuple(a[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]
                     for a in (*train, train_weight))
               for i in range(STEPS)]
    totals, _ = chunks.run_steps(engine, engine.train_chunk, batches, chunks.zero_totals(step),
                                steps_per_execution=STEPS)
    engine.sync_to_model()
    trained = step.results(totals)
    results = chunks.evaluate(engine, step, *test, test_weight, GLOBAL_BATCH,
                             steps_per_execution=3)
    no_distribution()
    reference.set_weights(model.get_weights())
    expected = reference.evaluate(*test, sample_weight=test_weight, batch_size=50, verbose=0,
                                  return_dict=True)
    names = ("loss", "mae", "weighted_mae")
    for name in names:
        assert trained[name] == pytest.approx(logs[name][-1], rel=1e-6), name
        assert results[name] == pytest.approx(expected[name], rel=1e-6), name
    # The weights matter: weighted and unweighted MAE differ by far more than that.
    assert abs(results["weighted_mae"] / results["mae"] - 1) > 1e-3


def test_train_and_evaluate_reports_keras_evaluate_numbers_for_float_targets(tmp_path):
    (train_x, train_y), (test_x, test_y) = regression_data(3)
    dataset = arrays.Dataset(train_x, train_y, test_x, test_y)
    built = []

    def model_fn():
        built.append(regression_model(3))
        return built[-1]

    config = training.TrainConfig(epochs=2, batch_size_per_replica=32 // SEVERAL, replicas=SEVERAL,
                                  checkpoint_dir=str(tmp_path / "run"), seed=3)
    result = training.train_and_evaluate(config, dataset, model_fn=model_fn,
                                         log=lambda line: None)
    last, restored = result.epochs[-1], result.restored
    no_distribution()
    expected = built[-1].evaluate(test_x, test_y, batch_size=50, verbose=0, return_dict=True)
    for name in METRICS:  # 1,001 rows: the last of 32 batches of 32 holds 9.
        assert last[f"test_{name}"] == pytest.approx(expected[name], rel=1e-6), name
        assert restored[f"test_{name}"] == pytest.approx(expected[name], rel=1e-6), name
    assert last["train_loss"] < result.epochs[0]["train_loss"]
