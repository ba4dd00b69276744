"""The optimizer features of `fit` on a model compiled by the user, on N replicas.

Learning-rate schedules, `clipnorm` / `global_clipnorm`, gradient
accumulation and `use_ema`: N replicas equal one undistributed replica and
Keras' own `fit` on one device, and a resumed run equals an uninterrupted one.
Plain SGD throughout: its step is linear in the gradient, so a wrongly
scaled or wrongly clipped gradient shows (Adam would normalise it away).
"""

import warnings

import keras
import numpy as np
import pytest
from helpers import SEVERAL
from test_training import StopAfter, checkpoint_arrays

from kdist import checkpoints, engines
from kdist.inputs import arrays
from kdist.loop import building, chunks, evaluation, training
from kdist.step.optimizer import ema_variables, finalize_weights

TOLERANCE = 1e-6
BATCH = 8  # Global batch: splits over 1, 2 and 4 replicas.
FEATURES, CLASSES = 5, 3

rng = np.random.default_rng(0)
X = (3.0 * rng.normal(size=(64, FEATURES))).astype(np.float32)  # Large: clipping bites.
Y = rng.integers(0, CLASSES, 64).astype(np.int32)


def model_fn(optimizer_fn):
    """A model_fn: a tiny classifier compiled as for `fit` with `optimizer_fn()`."""

    def build():
        model = keras.Sequential([keras.Input((FEATURES,)),
                                  keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(CLASSES)])
        model.compile(optimizer=optimizer_fn(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    return build


def batches(batch, count):
    """The first `count` batches of `batch` rows of (X, Y), as the loop makes them."""
    return [(X[i * batch:(i + 1) * batch], Y[i * batch:(i + 1) * batch], None)
            for i in range(count)]


def trained(optimizer_fn, replicas, batch=BATCH, count=1):
    """Trains `count` steps of `batch` rows in one chunk on `replicas` replicas
    (None: the undistributed engine). Returns (initial weights, model, engine)."""
    engine = engines.create_engine(replicas or 1, distributed=replicas is not None)
    keras.utils.set_random_seed(1)
    model, step = building.prepare_model(engine, batch, (X[:batch], Y[:batch], None),
                                         model_fn(optimizer_fn))
    initial = [np.array(w) for w in model.get_weights()]
    engine.compile_steps(step)
    engine.train_chunk(engine.distribute(chunks.stack_chunk(batches(batch, count))), count)
    engine.sync_to_model()
    return initial, model, engine


def train(optimizer_fn, replicas, batch=BATCH, count=1):
    """`trained`, returning (initial weights, weights, model)."""
    initial, model, _ = trained(optimizer_fn, replicas, batch, count)
    return initial, [np.array(w) for w in model.get_weights()], model


class WeightsAtEpochEnd(keras.callbacks.Callback):
    """The weights before `fit` ends (and, with `use_ema`, puts the averages in)."""

    def on_epoch_end(self, epoch, logs=None):
        self.weights = [np.array(w) for w in self.model.get_weights()]


def fit(optimizer_fn, initial, batch=BATCH, count=1):
    """Keras' own `fit` on one device from `initial`: `count` steps of `batch` rows.

    Returns (the weights fit ends with, the model)."""
    return fit_with_trained_weights(optimizer_fn, initial, batch, count)[1:]


def fit_with_trained_weights(optimizer_fn, initial, batch=BATCH, count=1):
    """`fit`, returning (the weights at the epoch's end, the final weights, the model)."""
    engines.create_engine(1, distributed=False)  # Sets no distribution (JAX).
    model = model_fn(optimizer_fn)()
    model.set_weights(initial)
    at_end = WeightsAtEpochEnd()
    model.fit(X[:batch * count], Y[:batch * count], batch_size=batch, epochs=1,
              shuffle=False, verbose=0, callbacks=[at_end])
    return at_end.weights, [np.array(w) for w in model.get_weights()], model


def assert_replicas_match_one(optimizer_fn, one, count=1):
    """2 and 4 replicas train `count` steps to the weights `one` of 1 replica."""
    for replicas in (2, 4):
        _, many, _ = train(optimizer_fn, replicas, count=count)
        worst = difference(many, one)
        assert worst <= TOLERANCE, f"{replicas} replicas differ from 1 by {worst}"


def difference(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def iterations(optimizer):
    """(optimizer.iterations: updates applied, its raw counter: batches seen)."""
    return (int(keras.ops.convert_to_numpy(optimizer.iterations)),
            int(keras.ops.convert_to_numpy(optimizer._iterations)))


@pytest.mark.parametrize("clip", ["clipnorm", "global_clipnorm"])
def test_clipping_clips_the_global_gradient(clip):
    def clipped():
        return keras.optimizers.SGD(0.5, **{clip: 0.2})

    initial, one, _ = train(clipped, None)
    _, unclipped, _ = train(lambda: keras.optimizers.SGD(0.5), None)
    # The clip must change the step by far more than the tolerance, or the test is empty.
    assert difference(one, unclipped) > 1e-2
    reference, _ = fit(clipped, initial)
    assert difference(one, reference) <= TOLERANCE, "kdist differs from Keras fit"
    assert_replicas_match_one(clipped, one)  # Clipping each replica's gradient would differ here.


def test_schedule_advances_once_per_step():
    def scheduled():
        return keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(
            0.5, decay_steps=1, decay_rate=0.5))

    initial, one, model = train(scheduled, None, count=3)
    assert iterations(model.optimizer) == (3, 3)
    # The rate the next step would use: 0.5 * 0.5^3.
    assert np.isclose(float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)), 0.0625)
    _, constant, _ = train(lambda: keras.optimizers.SGD(0.5), None, count=3)
    assert difference(one, constant) > 1e-2
    reference, _ = fit(scheduled, initial, count=3)
    assert difference(one, reference) <= TOLERANCE, "kdist differs from Keras fit"
    assert_replicas_match_one(scheduled, one, count=3)


def test_accumulated_steps_equal_one_step_of_their_batches():
    # K steps of B rows, accumulated, are one update with the mean gradient of
    # K * B rows: one step of K * B. Clipping acts on that mean gradient.
    def accumulating():
        return keras.optimizers.SGD(0.5, global_clipnorm=0.5, gradient_accumulation_steps=2)

    def big_batch():
        return keras.optimizers.SGD(0.5, global_clipnorm=0.5)

    initial, big, _ = train(big_batch, None, batch=2 * BATCH)
    _, half, _ = train(accumulating, None, count=1)
    assert difference(half, initial) == 0  # The first step only accumulates.
    _, one, model = train(accumulating, None, count=2)
    assert iterations(model.optimizer) == (1, 2)
    assert difference(one, initial) > 1e-2
    assert difference(one, big) <= TOLERANCE, "2 x 8 rows accumulated differ from 16 rows"
    reference, _ = fit(accumulating, initial, count=2)
    assert difference(one, reference) <= TOLERANCE, "kdist differs from Keras fit"
    assert_replicas_match_one(accumulating, one, count=2)


def test_a_multi_optimizer_applies_each_share_of_the_gradient_once_as_fit_does():
    # Each of its optimizers gets the averaged gradient of its variables (on
    # TensorFlow each would sum it over replicas again: 2x the update on 2), and
    # one of them accumulates (its conditional update, under a MirroredStrategy).
    def multi():
        return keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
            keras.optimizers.SGD(0.5),
            {".*bias": keras.optimizers.SGD(0.2, gradient_accumulation_steps=2)}))

    initial, one, _ = train(multi, None, count=2)
    assert min(float(np.abs(w - i).max()) for w, i in zip(one, initial)) > 1e-3  # All moved.
    reference, _ = fit(multi, initial, count=2)
    assert difference(one, reference) <= TOLERANCE, "kdist differs from Keras fit"
    assert_replicas_match_one(multi, one, count=2)


def test_a_multi_optimizers_averages_end_training_as_fit_ends_it():
    # fit ends by copying each of its optimizers' moving averages into the
    # weights that optimizer updates (`use_ema` on one of them).
    def multi():
        return keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
            keras.optimizers.SGD(0.5),
            {".*kernel": keras.optimizers.SGD(0.2, use_ema=True, ema_momentum=0.5)}))

    initial, model, _ = trained(multi, None, count=3)
    trained_weights, reference, _ = fit_with_trained_weights(multi, initial, count=3)
    assert difference(trained_weights, reference) > 1e-2  # The averages are not the weights.
    assert difference(values(model.weights), trained_weights) <= TOLERANCE
    finalize_weights(model)
    assert difference(values(model.weights), reference) <= TOLERANCE


def test_a_schedule_with_accumulation_counts_batches_as_keras_does():
    # Keras evaluates the schedule at the optimizer's raw counter, the batches
    # seen (K per update), while `optimizer.iterations` counts the updates.
    # So update u uses the rate at batch K*u + K-1: a staircase schedule with
    # decay_steps=K decays once per update, as decay_steps=1 does without
    # accumulation.
    def schedule(decay_steps):
        return keras.optimizers.schedules.ExponentialDecay(
            0.5, decay_steps=decay_steps, decay_rate=0.5, staircase=True)

    def accumulating():
        return keras.optimizers.SGD(schedule(2), gradient_accumulation_steps=2)

    initial, big, _ = train(lambda: keras.optimizers.SGD(schedule(1)), None,
                            batch=2 * BATCH, count=2)
    _, one, model = train(accumulating, None, count=4)
    assert iterations(model.optimizer) == (2, 4)
    assert difference(one, big) <= TOLERANCE
    reference, _ = fit(accumulating, initial, count=4)
    assert difference(one, reference) <= TOLERANCE, "kdist differs from Keras fit"
    _, many, _ = train(accumulating, 4, count=4)
    assert difference(many, one) <= TOLERANCE


def values(variables):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def evaluated_loss(engine, rows):
    """The mean loss of the engine's evaluation of `rows` of (X, Y)."""
    x, y = X[rows], Y[rows]
    stats = engine.eval_chunk(engine.distribute(chunks.stack_chunk([(x, y, None)])), 1)
    return float(np.asarray(stats["loss_sum"])[0]) / float(np.asarray(stats["count"])[0])


def keras_loss(model, rows):
    """The mean loss of `model`'s own weights on `rows` of (X, Y)."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return float(keras.ops.convert_to_numpy(loss(Y[rows], model(X[rows], training=False))))


@pytest.mark.parametrize("overwrite", [None, pytest.param(2, marks=pytest.mark.skipif(
    keras.backend.backend() == "torch",
    reason="on torch, fit's weights after 3 steps with ema_overwrite_frequency=2 equal its "
           "averages to 5e-4: this reference cannot tell the two apart"))])
def test_evaluation_scores_the_weights_as_fits_validation_and_the_end_the_averages(overwrite):
    # With use_ema, fit trains the weights, keeps their moving averages in the
    # optimizer (every `overwrite` steps it also copies them into the weights),
    # validates with the weights and ends by copying the averages into the model.
    # kdist trains the same weights and averages, evaluates as fit validates, and
    # ends as fit ends.
    def averaging():
        return keras.optimizers.SGD(0.5, use_ema=True, ema_momentum=0.5,
                                    ema_overwrite_frequency=overwrite)

    eval_rows = slice(32, 48)  # Rows no step trained on.
    runs = {None: trained(averaging, None, count=3)}
    trained_weights, averaged, model = fit_with_trained_weights(averaging, runs[None][0],
                                                                count=3)
    assert difference(trained_weights, averaged) > 1e-2  # The averages are not the weights.
    for replicas in (None, 2, 4):
        _, ours, engine = runs.get(replicas) or trained(averaging, replicas, count=3)
        weights = values(ours.trainable_variables)
        worst = max(difference(weights, trained_weights),
                    difference(values(ema_variables(ours.optimizer, ours.trainable_variables)),
                               averaged))
        assert worst <= TOLERANCE, f"{replicas} replica(s) differ from fit by {worst}"
        loss = evaluated_loss(engine, eval_rows)
        assert abs(loss - keras_loss(ours, eval_rows)) <= TOLERANCE, "not the weights' loss"
        finalize_weights(ours)
        assert difference(values(ours.trainable_variables), averaged) <= TOLERANCE
        assert abs(keras_loss(ours, eval_rows) - keras_loss(model, eval_rows)) <= TOLERANCE
        assert abs(keras_loss(ours, eval_rows) - loss) > 1e-3  # The averages score otherwise.


# The loop: a resume continues the schedule and the accumulation window.


def tiny_dataset():
    return arrays.Dataset(X, Y, X[:20], Y[:20], source="test_optimizer_features")


def config(tmp_path, name, **overrides):
    settings = dict(epochs=2, batch_size_per_replica=8 // SEVERAL, replicas=SEVERAL,
                    steps_per_epoch=5,
                    steps_per_execution=1, checkpoint_every=1,
                    checkpoint_dir=str(tmp_path / name), seed=5)
    settings.update(overrides)
    return training.TrainConfig(**settings)


def run(cfg, optimizer_fn, stop=None):
    return training.train_and_evaluate(cfg, tiny_dataset(), model_fn(optimizer_fn),
                                       log=lambda line: None, stop=stop)


def latest(tmp_path, name):
    return checkpoints.CheckpointManager(str(tmp_path / name)).latest()[0]


def restored_optimizer(path, optimizer_fn):
    """The optimizer of a fresh undistributed model restored from `path`."""
    engine = engines.create_engine(1, distributed=False)
    model, _ = building.prepare_model(engine, 4, (X[:4], Y[:4], None), model_fn(optimizer_fn))
    checkpoints.restore(model, path)
    return model.optimizer


def test_a_resume_inside_an_accumulation_window_continues_it_the_schedule_and_the_averages(
        tmp_path):
    def optimizer():
        return keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=2, decay_rate=0.5),
            gradient_accumulation_steps=2, use_ema=True, ema_momentum=0.5)

    straight = run(config(tmp_path, "straight"), optimizer)
    with pytest.raises(training.Interrupted, match="epoch 1, step 3"):
        run(config(tmp_path, "resumed"), optimizer, stop=StopAfter(3))
    # Three batches: one update, and the third batch's gradient in the accumulators.
    saved = restored_optimizer(latest(tmp_path, "resumed"), optimizer)
    assert iterations(saved) == (1, 3)
    assert any(np.abs(keras.ops.convert_to_numpy(a)).max() > 1e-3
               for a in saved._accumulated_gradients)
    resumed = run(config(tmp_path, "resumed"), optimizer)

    a, b = (checkpoint_arrays(latest(tmp_path, name)) for name in ("straight", "resumed"))
    assert a.keys() == b.keys() and any(k.startswith("optimizer") for k in a)
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert worst <= TOLERANCE, f"resumed run differs by {worst}"
    assert iterations(restored_optimizer(latest(tmp_path, "resumed"), optimizer)) == (5, 10)
    # Train and test scores of each epoch, as in the straight run.
    assert [{k: v for k, v in r.items() if k not in ("seconds", "samples_per_sec")}
            for r in resumed.epochs] == \
        [{k: v for k, v in r.items() if k not in ("seconds", "samples_per_sec")}
         for r in straight.epochs]


def test_epochs_score_the_weights_and_the_run_ends_with_the_moving_averages(tmp_path):
    """As fit: each epoch's evaluation is the weights' (callbacks watching val_loss
    save and restore the weights it scored); the model in hand and the restored
    checkpoint's evaluation hold the averages. Before, every evaluation scored the
    averages, and EarlyStopping and ReduceLROnPlateau decided other epochs than fit's."""
    def averaging():
        return keras.optimizers.SGD(0.5, use_ema=True, ema_momentum=0.5)

    result = run(config(tmp_path, "ema", epochs=1, steps_per_epoch=4), averaging)
    last, restored = result.epochs[-1], result.restored
    # The checkpoint's model weights are the trained ones (a resume continues from
    # them): a model without use_ema restored from it scores what the epoch reported.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Its optimizer has fewer variables to load.
        plain = evaluation.evaluate_checkpoint(
            restored["checkpoint"], tiny_dataset(), model_fn(lambda: keras.optimizers.SGD(0.5)),
            batch_size=8)
    assert abs(plain["test_loss"] - last["test_loss"]) <= TOLERANCE
    assert abs(restored["test_loss"] - last["test_loss"]) > 1e-3  # The averages'.
    # The model in hand holds the averages, as `fit` ends: it scores what the
    # restored evaluation reported.
    in_hand = result.model.evaluate(X[:20], Y[:20], batch_size=20, verbose=0, return_dict=True)
    assert abs(in_hand["loss"] - restored["test_loss"]) <= 1e-5, (in_hand, restored)


def test_a_model_kdist_compiles_with_an_averaging_optimizer_fn_ends_with_the_averages(tmp_path):
    """`model_fn` returns the model uncompiled and `optimizer_fn` averages: as for a
    compiled model, the restored evaluation and the model in hand hold the
    averages (the restored model had no optimizer, and scored the trained
    weights: the last epoch's figure); the model in hand has the checkpoint's
    optimizer, so `fit` goes on from it. `evaluate_checkpoint` reads the
    averages when given the run's `optimizer_fn`."""
    def averaging(learning_rate):
        return keras.optimizers.SGD(learning_rate, use_ema=True, ema_momentum=0.5)

    def uncompiled():
        return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(CLASSES)])

    cfg = config(tmp_path, "ema", epochs=1, steps_per_epoch=4, learning_rate=0.5)
    result = training.train_and_evaluate(cfg, tiny_dataset(), uncompiled, optimizer_fn=averaging,
                                         log=lambda line: None)
    last, restored = result.epochs[-1], result.restored
    assert abs(restored["test_loss"] - last["test_loss"]) > 1e-3  # The averages'.
    in_hand = result.model.evaluate(X[:20], Y[:20], batch_size=20, verbose=0, return_dict=True)
    assert abs(in_hand["loss"] - restored["test_loss"]) <= 1e-5, (in_hand, restored)
    assert iterations(result.model.optimizer) == (4, 4)
    path, data = restored["checkpoint"], tiny_dataset()
    again = evaluation.evaluate_checkpoint(path, data, uncompiled, optimizer_fn=averaging,
                                           batch_size=8)
    assert abs(again["test_loss"] - restored["test_loss"]) <= TOLERANCE
    weights = evaluation.evaluate_checkpoint(path, data, uncompiled, batch_size=8)
    assert abs(weights["test_loss"] - last["test_loss"]) <= TOLERANCE
