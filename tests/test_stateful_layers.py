"""Stateful layers: BatchNormalization's moving statistics, Dropout's random masks, and
a layer's own count and running sum.

On TensorFlow each replica draws its own dropout masks (its seed state
shifted, `tf_step.seed_offsets`) and moving statistics move by the mean of the
replicas' changes (`tf_step.assign_updates`); on JAX the program sees the global
sharded batch, so both are the global batch's. Either way they must train
like Keras `fit`, survive a checkpoint and resume bit for bit, and be
reproducible from the seed. A variable declared with aggregation="sum" moves by the
sum of the replicas' changes, as one device's count or sum.
"""

import keras
import numpy as np
import pytest
from helpers import SEVERAL
from keras import ops
from test_training import StopAfter, checkpoint_arrays, without_timing

import kdist
from kdist import checkpoints, engines
from kdist.datasets import fashion_mnist
from kdist.errors import Interrupted, UsageError
from kdist.inputs import arrays
from kdist.loop import building, chunks, training
from kdist.step.program import metric_key

BACKEND = keras.backend.backend()


def no_distribution():
    """Keras `fit` and fresh models run undistributed (a JAX engine sets a global one)."""
    if BACKEND == "jax":
        keras.distribution.set_distribution(None)


# On torch an unseeded Dropout draws from torch's own generator, which no checkpoint
# holds (docs/library.md); a seeded one draws from Keras' seed state, as on the others.
DROPOUT_SEED = 1 if keras.backend.backend() == "torch" else None


def bn_dropout_cnn(dropouts=1):
    """Conv-BN-ReLU-pool, Dropout, Dense: compiled for `fit`, Adam, logits."""
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(8, 3, use_bias=False),
        keras.layers.BatchNormalization(momentum=0.9),  # Keras' 0.99 lags a 100-step run.
        keras.layers.Activation("relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        *[keras.layers.Dropout(0.3, seed=DROPOUT_SEED) for _ in range(dropouts)],
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


class Recording:
    """A model_fn that keeps every model it builds and their initial weights."""

    def __init__(self, model_fn):
        self.model_fn, self.models, self.initial = model_fn, [], []

    def __call__(self):
        model = self.model_fn()
        self.models.append(model)
        self.initial.append([np.array(w) for w in model.get_weights()])
        return model


def values(variables):
    return [np.array(keras.ops.convert_to_numpy(v.value)) for v in variables]


def seed_states(model):
    return values([v for v in model.non_trainable_variables
                   if v.path.endswith("seed_generator_state")])


# -- a. kdist trains a BN + Dropout CNN like Keras fit --------------------------------
#
# "Within noise": Keras fit from four seeds gives four test results, whose
# sample standard deviation s measures how much one training run's result
# varies with its initial weights, batch order and dropout masks. kdist and
# fit from the same seed start from the same weights but see batches in
# another order and draw other masks: at most two independent runs, whose
# difference has standard deviation sqrt(2) s. kdist is within noise if it
# is within three of those: |kdist - fit| <= 3 sqrt(2) s, for the test
# accuracy and for the test loss. The task must be learnt (accuracy well
# above chance), and the bound must stay well below the accuracy lost when
# the moving statistics are not updated (kdist then scores near chance).

FIT_SEEDS = (11, 12, 13, 14)  # kdist trains from the first.
EPOCHS, BATCH = 3, 32


def fit_once(dataset, seed):
    """Keras fit from `set_random_seed(seed)`: (initial weights, test loss, test accuracy)."""
    no_distribution()
    keras.utils.set_random_seed(seed)
    model = bn_dropout_cnn()
    initial = [np.array(w) for w in model.get_weights()]
    model.fit(dataset.train_x, dataset.train_y, batch_size=BATCH, epochs=EPOCHS,
              shuffle=True, verbose=0)
    loss, accuracy = model.evaluate(dataset.test_x, dataset.test_y, batch_size=128, verbose=0)
    return initial, loss, accuracy


def test_bn_dropout_cnn_trains_like_keras_fit_within_noise(tmp_path):
    dataset = fashion_mnist.synthetic_fashion_mnist(num_train=1024, num_test=512, seed=2)
    fits = [fit_once(dataset, seed) for seed in FIT_SEEDS]
    recording = Recording(bn_dropout_cnn)
    config = training.TrainConfig(epochs=EPOCHS, batch_size_per_replica=BATCH // SEVERAL,
                                  replicas=SEVERAL,
                                  checkpoint_dir=str(tmp_path / "run"), seed=FIT_SEEDS[0],
                                  steps_per_execution=2)  # Compiles fast on JAX.
    result = training.train_and_evaluate(config, dataset, model_fn=recording,
                                         log=lambda line: None)
    for a, b in zip(recording.initial[0], fits[0][0]):  # The same initial weights.
        np.testing.assert_array_equal(a, b)
    last = result.epochs[-1]
    assert result.restored["test_accuracy"] == last["test_accuracy"]
    report = [f"\n[{BACKEND}] kdist vs fit (seeds {FIT_SEEDS}), after {EPOCHS} epochs:"]
    for name, column in (("accuracy", 2), ("loss", 1)):
        fit = np.array([f[column] for f in fits])
        kdist = last[f"test_{name}"]
        gap, bound = abs(kdist - fit[0]), 3 * np.sqrt(2) * fit.std(ddof=1)
        report.append(f"{name}: kdist {kdist:.4f}, fit {np.round(fit, 4)}, gap {gap:.4f}, "
                      f"s {fit.std(ddof=1):.4f}, bound {bound:.4f}")
        assert gap <= bound, report
    print("\n".join(report))
    accuracy = np.array([f[2] for f in fits])
    assert accuracy.min() > 0.6 and last["test_accuracy"] > 0.6  # Learnt: chance is 0.1.
    assert 3 * np.sqrt(2) * accuracy.std(ddof=1) < 0.25


# -- b. a resumed run is bit for bit the uninterrupted one -----------------------------


def test_resume_mid_epoch_is_bitwise_the_uninterrupted_run(tmp_path):
    dataset = fashion_mnist.synthetic_fashion_mnist(num_train=256, num_test=64, seed=4)

    def config(name):
        return training.TrainConfig(
            epochs=2, batch_size_per_replica=16 // SEVERAL, replicas=SEVERAL, steps_per_epoch=6,
            steps_per_execution=2, checkpoint_every=1, checkpoint_dir=str(tmp_path / name),
            seed=9)

    def run(name, stop=None):
        recording = Recording(bn_dropout_cnn)
        result = training.train_and_evaluate(config(name), dataset, model_fn=recording,
                                             log=lambda line: None, stop=stop)
        return result, recording.models[0]

    straight, straight_model = run("straight")
    # Two compiled calls of two steps: stopped at epoch 1, step 4 of 6.
    with pytest.raises(Interrupted, match="epoch 1, step 4"):
        run("resumed", stop=StopAfter(2))
    resumed, resumed_model = run("resumed")

    a = checkpoint_arrays(checkpoints.latest_checkpoint(str(tmp_path / "straight")))
    b = checkpoint_arrays(checkpoints.latest_checkpoint(str(tmp_path / "resumed")))
    assert a.keys() == b.keys()
    # BN's moving mean and variance (its variables 2 and 3), moved from 0 and 1, and
    # the dropout seed's state are in the file.
    assert (a["layers/batch_normalization/vars/2"] != 0).all()
    assert (a["layers/batch_normalization/vars/3"] != 1).all()
    assert int(a["kdist_seed_generators/0"][1]) == 12
    for key in a:
        np.testing.assert_array_equal(b[key], a[key], err_msg=key)
    # Every variable of the trained models, seed generator states included; the
    # dropout layer's counter advanced once per train step (12), none in evaluation.
    for part in (lambda m: m.variables, lambda m: m.optimizer.variables):
        mine, theirs = values(part(resumed_model)), values(part(straight_model))
        assert len(mine) == len(theirs)
        for x, y in zip(mine, theirs):
            np.testing.assert_array_equal(x, y)
    (state,) = seed_states(straight_model)
    assert int(state[1]) == 12
    assert without_timing(resumed.epochs) == without_timing(straight.epochs)
    # The checkpoint carries the seed state into a fresh, undistributed model, and
    # stays loadable by Keras' own load_weights (which ignores that part).
    no_distribution()
    path = checkpoints.latest_checkpoint(str(tmp_path / "straight"))
    fresh = bn_dropout_cnn()
    checkpoints.restore(fresh, path)
    np.testing.assert_array_equal(seed_states(fresh)[0], state)
    for x, y in zip(values(fresh.variables), values(straight_model.variables)):
        np.testing.assert_array_equal(x, y)
    stock = bn_dropout_cnn()
    stock.load_weights(path)
    for x, y in zip(stock.get_weights(), straight_model.get_weights()):
        np.testing.assert_array_equal(x, y)


def test_a_checkpoint_for_other_seed_generators_is_refused(tmp_path):
    no_distribution()
    model = bn_dropout_cnn()
    manager = checkpoints.CheckpointManager(str(tmp_path))
    path = manager.save(model, 1, {})
    two_dropouts = bn_dropout_cnn(dropouts=2)  # The same weights: only the seeds tell.
    with pytest.raises(checkpoints.CheckpointError,
                       match=r"state of 1 random seed generator\(s\); the model has 2"):
        checkpoints.restore(two_dropouts, path)
    # A checkpoint of none (its file has no group of them) into a model with one: a
    # Dropout added between two runs in one folder had resumed silently.
    path = manager.save(bn_dropout_cnn(dropouts=0), 2, {})
    with pytest.raises(checkpoints.CheckpointError,
                       match=r"state of 0 random seed generator\(s\); the model has 1"):
        checkpoints.restore(model, path)


# -- c. dropout masks: per replica, per step, from the seed, off in evaluation ---------

ROWS, UNITS, RATE = 16, 64, 0.5  # One global batch of 16 rows of 64 ones.


class Scale(keras.layers.Layer):
    """x * w, one trainable scalar (1; SGD at learning rate 0 keeps it so)."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(), initializer="ones")

    def call(self, x):
        return x * self.w


class Outputs(keras.metrics.Metric):
    """Adds each row's output into the row of a (ROWS, UNITS) table the target names.

    The engine sums a step's metric changes over replicas, so a step's
    statistics hold the output of the whole global batch, row by row: with
    inputs of ones, 1 / (1 - RATE) where dropout kept a unit and 0 where it dropped it.
    """

    def __init__(self):
        super().__init__(name="outputs")
        self.table = self.add_variable((ROWS, UNITS), "zeros", name="table")

    def update_state(self, y_true, y_pred, sample_weight=None):
        rows = ops.one_hot(ops.cast(y_true[:, 0], "int32"), ROWS)
        self.table.assign_add(ops.matmul(ops.transpose(rows), y_pred))

    def result(self):
        return ops.sum(self.table)


def dropout_model():
    model = keras.Sequential([keras.Input((UNITS,)), Scale(), keras.layers.Dropout(RATE)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", metrics=[Outputs()])
    return model


ONES = np.ones((ROWS, UNITS), np.float32)
ROW_IDS = np.repeat(np.arange(ROWS, dtype=np.float32)[:, None], UNITS, axis=1)


def dropout_outputs(replicas, seed, train_steps=2):
    """The outputs, (steps, ROWS, UNITS), of `train_steps` train steps on one
    batch, then of one evaluation step."""
    engine = engines.create_engine(replicas)
    keras.utils.set_random_seed(seed)
    model, step = building.prepare_model(engine, ROWS, (ONES[:2], ROW_IDS[:2], None),
                                         dropout_model)
    engine.compile_steps(step)
    (key,) = [metric_key(i) for i, v in enumerate(step.metric_variables)
              if tuple(v.shape) == (ROWS, UNITS)]
    batch = (ONES, ROW_IDS, None)
    chunk = engine.distribute(chunks.stack_chunk([batch] * train_steps))
    trained = np.asarray(engine.train_chunk(chunk, train_steps)[key])
    evaluated = np.asarray(engine.eval_chunk(engine.distribute(chunks.stack_chunk([batch])),
                                             1)[key])
    return trained, evaluated[0]


@pytest.mark.parametrize("replicas", [2, 4])
def test_dropout_masks_differ_per_replica_and_step_repeat_per_seed_and_stop_in_eval(
        replicas):
    trained, evaluated = dropout_outputs(replicas, seed=21)
    assert set(np.unique(trained)) == {0.0, 1.0 / (1.0 - RATE)}
    masks = trained > 0
    assert 0.4 < masks.mean() < 0.6  # Keeps 1 - RATE of the units (16 x 64 x 2 draws).
    # Each replica's rows, within one step: none has another's mask.
    per_replica = masks.reshape(2, replicas, ROWS // replicas, UNITS)
    for s in range(2):
        for i in range(replicas):
            for j in range(i):
                assert (per_replica[s, i] != per_replica[s, j]).any(), (s, i, j)
    assert (masks[0] != masks[1]).any()  # A new mask each step.
    np.testing.assert_array_equal(evaluated, ONES)  # Evaluation: no dropout, no scaling.

    again, _ = dropout_outputs(replicas, seed=21)
    np.testing.assert_array_equal(again, trained)  # The same seed, the same masks.
    other, _ = dropout_outputs(replicas, seed=22)
    assert (other != trained).any()
    single, _ = dropout_outputs(1, seed=21)
    if BACKEND == "jax":  # One program draws the global batch's masks, however sharded.
        np.testing.assert_array_equal(trained, single)
    else:  # Replica 0 draws what one device would for its rows; the others their own.
        rows = ROWS // replicas
        np.testing.assert_array_equal(trained[:, :rows], single[:, :rows])
        assert (trained[:, rows:] != single[:, rows:]).any()


# -- d. BatchNormalization's moving statistics after one step ---------------------------

FEATURES, MOMENTUM = 3, 0.9


def bn_model(dtype=None):
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.BatchNormalization(momentum=MOMENTUM, dtype=dtype)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def bn_batch():
    """16 rows whose quarters have different means, so per-replica moments differ."""
    rng = np.random.default_rng(5)
    x = rng.normal(0.0, 1.0, (16, FEATURES)) + np.repeat([0.0, 2.0, 6.0, 9.0], 4)[:, None]
    return x.astype(np.float32), np.zeros((16, FEATURES), np.float32)


def moving_statistics_after_a_step(replicas, tmp_path, dtype=None):
    """(moving mean, moving variance) after one train step on `bn_batch`, and the
    same read back from its checkpoint by a fresh, undistributed model."""
    engine = engines.create_engine(replicas)
    keras.utils.set_random_seed(3)
    x, y = bn_batch()
    model, step = building.prepare_model(engine, len(x), (x[:2], y[:2], None),
                                         lambda: bn_model(dtype))
    engine.compile_steps(step)
    engine.train_chunk(engine.distribute(chunks.stack_chunk(
        [(x, y, None)])), 1)
    engine.sync_to_model()
    layer = model.layers[0]
    moved = np.array(layer.moving_mean.numpy()), np.array(layer.moving_variance.numpy())
    manager = checkpoints.CheckpointManager(str(tmp_path / f"r{replicas}"))
    manager.prepare()
    path = manager.save(model, 1, {})
    no_distribution()
    fresh = bn_model(dtype)
    checkpoints.restore(fresh, path)
    restored = (np.array(fresh.layers[0].moving_mean.numpy()),
                np.array(fresh.layers[0].moving_variance.numpy()))
    return moved, restored


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_batch_norm_moving_statistics_after_one_step(replicas, tmp_path):
    x, _ = bn_batch()
    (mean, variance), restored = moving_statistics_after_a_step(replicas, tmp_path)
    # The checkpoint carries them exactly.
    np.testing.assert_array_equal(restored[0], mean)
    np.testing.assert_array_equal(restored[1], variance)

    keep, new = MOMENTUM, 1.0 - MOMENTUM  # From the initial 0 and 1.
    global_mean = new * x.mean(0, dtype=np.float64)
    global_variance = keep + new * x.var(0, dtype=np.float64)
    parts = x.reshape(replicas, -1, FEATURES).astype(np.float64)
    replicas_variance = keep + new * parts.var(1).mean(0)
    # Every engine: the moving mean is the global batch's (the mean of equal-size
    # replica means).
    np.testing.assert_allclose(mean, global_mean, rtol=0, atol=1e-6)
    if BACKEND == "jax" or replicas == 1:
        # JAX normalizes the global sharded batch: the global batch's variance.
        np.testing.assert_allclose(variance, global_variance, rtol=0, atol=1e-6)
    else:
        # TensorFlow normalizes each replica's rows: the mean of their variances,
        # below the global batch's by the variance of the replicas' means.
        np.testing.assert_allclose(variance, replicas_variance, rtol=0, atol=1e-6)
        assert (global_variance - variance > 0.1).all()
    expected = global_variance if BACKEND == "jax" or replicas == 1 else replicas_variance
    print(f"\n[{BACKEND}, {replicas}] moving mean {mean} (off by "
          f"{np.abs(mean - global_mean).max():.1e}), variance {variance} (off by "
          f"{np.abs(variance - expected).max():.1e}); global batch's {global_variance}, "
          f"replicas' {replicas_variance}")


def test_batch_norm_statistics_in_bfloat16_move_as_float32_ones_do(tmp_path):
    """Moving statistics held in bfloat16 (the layer's dtype) merge over replicas as
    float32 ones do; TensorFlow had kept each replica's own, and the check after the
    epoch ended the run. Equal to bfloat16's 8 bits."""
    (mean, variance), restored = moving_statistics_after_a_step(SEVERAL, tmp_path / "bf16",
                                                                dtype="bfloat16")
    (mean32, variance32), _ = moving_statistics_after_a_step(SEVERAL, tmp_path / "f32")
    assert str(mean.dtype) == "bfloat16"
    np.testing.assert_allclose(mean.astype(np.float32), mean32, rtol=2**-7)
    np.testing.assert_allclose(variance.astype(np.float32), variance32, rtol=2**-7)
    np.testing.assert_array_equal(restored[0], mean)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX: N replicas are one program")
def test_jax_batch_norm_statistics_of_n_replicas_are_those_of_one(tmp_path):
    one, _ = moving_statistics_after_a_step(1, tmp_path)
    for replicas in (2, 4):
        many, _ = moving_statistics_after_a_step(replicas, tmp_path)
        for a, b in zip(many, one):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
        print(f"\n[jax] {replicas} vs 1 replica: largest difference "
              f"{max(float(np.abs(a - b).max()) for a, b in zip(many, one)):.2e}")


# -- e. State a layer adds up: a count and a running sum ---------------------------------

class RunningSum(keras.layers.Layer):
    """Counts and sums what it trains on, declared with aggregation="sum" (Keras' way
    to say that the replicas' updates add up), and sums it once more undeclared."""

    def build(self, shape):
        def weight(name, dtype="float32", **declared):
            return self.add_weight(shape=(), dtype=dtype, initializer="zeros",
                                   trainable=False, name=name, **declared)
        self.count = weight("count", "int32", aggregation="sum")
        self.total = weight("total", aggregation="sum")
        self.undeclared = weight("undeclared")

    def call(self, x, training=False):
        if training:
            self.count.assign(self.count + ops.shape(x)[0])
            self.total.assign(self.total + ops.sum(x))
            self.undeclared.assign(self.undeclared + ops.sum(x))
        return x


def around(layer):
    """`layer` between 4 inputs and a Dense(1), compiled with SGD and MSE."""
    model = keras.Sequential([keras.Input((4,)), layer, keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def running_sum_model():
    return around(RunningSum())


def test_a_count_and_a_sum_declared_to_add_up_do_over_replicas(tmp_path):
    """2 replicas, 2 epochs of 256 rows: what one device counts. Before, TensorFlow
    summed the values the replicas assigned (the sum doubled every step: 4,288,260
    against 1,053.8) and torch averaged them (526.9)."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (256, 4)).astype(np.float32)
    y = rng.normal(size=(256, 1)).astype(np.float32)
    config = training.TrainConfig(epochs=2, batch_size_per_replica=16, replicas=2,
                                  checkpoint_dir=str(tmp_path))
    result = training.train_and_evaluate(config, kdist.Dataset(x, y, x[:64], y[:64], "toy"),
                                         running_sum_model, log=lambda line: None)
    layer, total = result.model.layers[0], 2 * x.sum(dtype=np.float64)
    assert int(layer.count.numpy()) == 2 * 256
    np.testing.assert_allclose(float(layer.total.numpy()), total, rtol=1e-6)
    # Undeclared, a float moves by the mean of the replicas' changes (a moving
    # statistic's rule); JAX's one program sees the global batch.
    np.testing.assert_allclose(float(layer.undeclared.numpy()),
                               total if BACKEND == "jax" else total / 2, rtol=1e-6)


def recurrent_dropout_model():
    """A seeded LSTM with dropout: Keras' RNN draws its masks at every call, in
    evaluation too, so a call before training would move its seed state."""
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(
        4, dropout=0.3, recurrent_dropout=0.3, seed=4), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def assert_one_fit_epoch_alike(result, model_fn, x, y, batch_size):
    """`result.model`'s weights equal, to 1e-6, a fresh `model_fn()`'s after one epoch of
    `fit` on `x`, `y` in kdist's order of epoch 0 for seed 3."""
    no_distribution()
    reference = model_fn()
    order = arrays.epoch_order(len(x), 3, 0)
    reference.fit(x[order], y[order], batch_size=batch_size, epochs=1, shuffle=False,
                  verbose=0)
    for ours, theirs in zip(result.model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)


def test_an_epoch_of_recurrent_dropout_draws_fits_masks(tmp_path):
    """Before, kdist's call that builds the metrics advanced the LSTM's seed state
    (8 draws): every mask differed from fit's (7.7e-3 to 1.2e-2 apart)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5, 3)).astype(np.float32)
    y = rng.integers(0, 2, 64).astype(np.int32)
    config = training.TrainConfig(epochs=1, batch_size_per_replica=16, replicas=1, seed=3,
                                  checkpoint_dir=str(tmp_path))
    result = training.train_and_evaluate(config, kdist.Dataset(x, y, x, y, "toy"),
                                         recurrent_dropout_model, log=lambda line: None)
    assert_one_fit_epoch_alike(result, recurrent_dropout_model, x, y, batch_size=16)


class MaskTotals(keras.layers.Layer):
    """Adds a seeded Dropout's mask of a replica's rows of ones (16 each) into a
    variable declared to add up over replicas: after one step, the sum of the
    replicas' masks row by row (JAX's one program: of its two halves)."""

    def __init__(self):
        super().__init__()
        self.dropout = keras.layers.Dropout(0.5, seed=DROPOUT_SEED or 5)

    def build(self, shape):
        self.totals = self.add_weight(shape=(16, 4), initializer="zeros", trainable=False,
                                      name="totals", aggregation="sum")

    def call(self, x, training=False):
        if training and x.shape[0] % 16 == 0:  # Not the building run's 2 sample rows.
            mask = self.dropout(ops.ones_like(x), training=True)
            self.totals.assign(self.totals + ops.sum(ops.reshape(mask, (-1, 16, 4)), axis=0))
        return x


def test_each_replica_draws_its_own_dropout_mask_from_a_seeded_layer(tmp_path):
    """Before, torch's processes all drew process 0's masks: each total 0 or 4."""
    x = np.ones((32, 4), np.float32)

    def model_fn():
        return around(MaskTotals())

    config = training.TrainConfig(epochs=1, batch_size_per_replica=16, replicas=2,
                                  checkpoint_dir=str(tmp_path))
    result = training.train_and_evaluate(config, kdist.Dataset(x, x[:, :1], x, x[:, :1], "toy"),
                                         model_fn, log=lambda line: None)
    totals = result.model.layers[0].totals.numpy()
    assert set(np.unique(totals)) == {0.0, 2.0, 4.0}  # 2: one replica kept it, one not.


class Positives(keras.layers.Layer):
    """Counts the inputs above 0.5 it trains on, undeclared: each replica its own."""

    def build(self, shape):
        self.positives = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                         trainable=False, name="positives")

    def call(self, x, training=False):
        if training:
            self.positives.assign(self.positives + ops.sum(ops.cast(x > 0.5, "int32")))
        return x


def test_a_count_undeclared_that_differs_per_replica_is_named(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (256, 4)).astype(np.float32)
    y = rng.normal(size=(256, 1)).astype(np.float32)

    def model_fn():
        return around(Positives())

    config = training.TrainConfig(epochs=1, batch_size_per_replica=16, replicas=2,
                                  checkpoint_dir=str(tmp_path))
    run = lambda: training.train_and_evaluate(  # noqa: E731
        config, kdist.Dataset(x, y, x[:64], y[:64], "toy"), model_fn, log=lambda line: None)
    if BACKEND == "jax":  # One program: the global batch's count.
        assert int(run().model.layers[0].positives.numpy()) == int((x > 0.5).sum())
        return
    with pytest.raises(kdist.TrainingError, match=(
            "^the replicas' variables differ after epoch 1 "
            "\\('(sequential\\w*/)?positives/positives'\\): the step assigns them "
            "from each replica's own share of the batch; a count")):
        run()


# -- LoRA: Keras writes a kernel with its factors merged, and zeroes them on load ------


def three_classes(n, seed):
    """`n` rows of 8 normal features and the argmax of a random linear map of them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    return x, np.argmax(x @ rng.normal(size=(8, 3)), axis=1).astype("int32")


def lora_mlp(lora=True):
    """Two Dense layers fine-tuned with rank-2 LoRA factors (their kernels frozen)."""
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    if lora:
        for layer in model.layers:
            layer.enable_lora(2)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_lora_run_resumes_as_the_uninterrupted_run(tmp_path):
    x, y = three_classes(320, seed=0)
    dataset = kdist.Dataset(x[:256], y[:256], x[256:], y[256:], source="toy data")

    def run(name, epochs):
        cfg = training.TrainConfig(epochs=epochs, batch_size_per_replica=32 // SEVERAL,
                                   replicas=SEVERAL, checkpoint_every=1, seed=3,
                                   checkpoint_dir=str(tmp_path / name))
        return training.train_and_evaluate(cfg, dataset, model_fn=lora_mlp,
                                           log=lambda line: None)

    straight = run("straight", 2)
    run("resumed", 1)
    resumed = run("resumed", 2)  # Epoch 2 from the checkpoint of epoch 1.
    assert without_timing(resumed.epochs) == without_timing(straight.epochs)
    for part in (lambda m: m.variables, lambda m: m.optimizer.variables):
        mine, theirs = values(part(resumed.model)), values(part(straight.model))
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            np.testing.assert_array_equal(a, b)
    # The model in hand holds the trained factors, not Keras' zeros.
    factors = [v for v in straight.model.trainable_variables if "lora_kernel" in v.path]
    assert len(factors) == 4 and all(np.abs(f).max() > 0 for f in values(factors))
    # Keras' own load_weights reads the kernel merged: the same function without LoRA.
    no_distribution()
    stock = lora_mlp(lora=False)
    stock.load_weights(checkpoints.latest_checkpoint(str(tmp_path / "straight")))
    np.testing.assert_allclose(stock.predict(x[256:], verbose=0),
                               straight.model.predict(x[256:], verbose=0), rtol=1e-5, atol=1e-5)


def test_a_checkpoint_for_other_lora_layers_is_refused(tmp_path):
    no_distribution()
    path = checkpoints.CheckpointManager(str(tmp_path)).save(lora_mlp(), 1, {})
    one_layer = lora_mlp(lora=False)
    one_layer.layers[0].enable_lora(2)
    for other in (one_layer, lora_mlp(lora=False)):  # Keras' load_weights reads the latter.
        with pytest.raises(checkpoints.CheckpointError, match=r"written for a different model"):
            checkpoints.restore(other, path)


# -- float8: Keras overwrites the scales and amax histories with their "gradient" --------


class OwnStepSequential(keras.Sequential):
    """The guide's train step, in keras.ops with kdist.value_and_grad."""

    def train_step(self, data):
        x, y = data[:2]

        def loss_fn():
            logits = self(x, training=True)
            return ops.mean(keras.losses.sparse_categorical_crossentropy(
                y, logits, from_logits=True))

        loss, grads = kdist.value_and_grad(loss_fn, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def float8_mlp(model_class=keras.Sequential):
    model = model_class([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                         keras.layers.Dense(3)])
    rng = np.random.default_rng(42)  # The same weights in every model built.
    model.set_weights([rng.normal(scale=0.3, size=w.shape) for w in model.get_weights()])
    model.quantize("float8")
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_float8_trains_as_fit_where_one_program_sees_the_batch_and_is_refused_elsewhere(
        tmp_path):
    """TensorFlow's replicas each took their amax from their own share and kdist averaged
    them: the kernels 0.0118 from fit's after 2 epochs, silently."""
    x, y = three_classes(128, seed=0)
    config = training.TrainConfig(epochs=1, batch_size_per_replica=32 // SEVERAL,
                                  replicas=SEVERAL, seed=3, checkpoint_dir=str(tmp_path))

    def train():
        return training.train_and_evaluate(config, kdist.Dataset(x, y, x[:32], y[:32], "toy"),
                                           float8_mlp, log=lambda line: None)

    if SEVERAL > 1 and BACKEND != "jax":  # TensorFlow's replicas share the batch.
        with pytest.raises(UsageError, match=r"amax_history.* take their gradient as their "
                                             r"next value .* 2 replicas"):
            train()
        return
    result = train()  # JAX's 2 replicas: one program; torch: this process's one.
    assert_one_fit_epoch_alike(result, float8_mlp, x, y, batch_size=32)


def test_a_float8_model_with_its_own_step_trains_as_fit_on_one_replica(tmp_path):
    """On TensorFlow the model in hand's building run, eager, differentiated the
    variables themselves, where Keras' float8 gradients fail (ValueError)."""
    x, y = three_classes(64, seed=1)
    config = training.TrainConfig(epochs=1, batch_size_per_replica=32, replicas=1, seed=3,
                                  checkpoint_dir=str(tmp_path))
    result = training.train_and_evaluate(config, kdist.Dataset(x, y, x, y, "toy"),
                                         lambda: float8_mlp(OwnStepSequential),
                                         log=lambda line: None)
    assert_one_fit_epoch_alike(result, float8_mlp, x, y, batch_size=32)
