"""kdist against Keras `fit` / `evaluate`, the reference users trust.

Each test builds the same compiled model twice from the same weights: once on
a kdist engine with 1, 2 or 4 replicas, once for Keras on one device (no
distribution), and compares one SGD step (plain SGD: its step is linear in
the gradient, so a wrong scale shows) or the evaluation of a test set whose
size divides by no global batch; one test compares a whole run of
`train_and_evaluate` with `fit` fed the same batches, epoch by epoch.
"""

import keras
import numpy as np
import pytest
from helpers import SEVERAL, prepare
from keras import ops

import kdist
from kdist import engines, tree
from kdist.inputs import arrays, base
from kdist.loop import chunks

REPLICAS = [1, 2, 4]
BATCH = 64


class DenseAddLoss(keras.layers.Dense):
    """Dense that adds 0.1 * mean(output ** 2) to the model's losses (`add_loss`).

    The model's one layer with losses of its own (this and its activity
    regularizer): `fit` on JAX calls each layer as the outermost one, and a
    second such layer could drop this one's loss at random, where the id a
    layer recorded at its last call is given again to a new tensor (Keras 3.15;
    kdist's steps are not affected, docs/log/2026-12-04-loss-ids.md)."""

    def call(self, x):
        outputs = super().call(x)
        self.add_loss(0.1 * ops.mean(ops.square(outputs)))
        return outputs


def regularized_classifier(metrics=("accuracy",)):
    inputs = keras.Input((8,))
    hidden = DenseAddLoss(16, activation="relu", kernel_regularizer=keras.regularizers.L2(0.05),
                          activity_regularizer=keras.regularizers.L1(0.01))(inputs)
    logits = keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.05))(hidden)
    model = keras.Model(inputs, logits)
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=list(metrics))
    return model


def classification_data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return x, (x[:, :3].argmax(axis=1)).astype(np.int32)


def on_kdist(model_fn, replicas, batch, weights=None, **kwargs):
    """The model after one kdist step on `batch` with `replicas` replicas (or None:
    no step), with the engine and step; starts from `weights` if given."""
    engine = engines.create_engine(replicas, distributed=replicas > 1)
    keras.utils.set_random_seed(1)
    if batch is not None:
        kwargs.setdefault("sample", tree.take_rows(batch, slice(0, 2)))
    model, step = prepare(engine, len(batch[0]) if batch else BATCH, model_fn,
                          optimizer_fn=None, learning_rate=None, **kwargs)
    if weights is not None:
        model.set_weights(weights)
        engine.compile_steps(step)  # Takes the new values (JAX).
    if batch is not None:
        engine.train_chunk(engine.distribute(chunks.stack_chunk([batch])), 1)
        engine.sync_to_model()
    return engine, model, step


def on_keras(model_fn, weights):
    """A fresh compiled model with `weights`, on one device, no distribution."""
    if keras.backend.backend() == "jax":
        keras.distribution.set_distribution(None)
    model = model_fn()
    model.set_weights(weights)
    return model


def initial_weights(model_fn):
    keras.utils.set_random_seed(1)
    return [np.array(w) for w in model_fn().get_weights()]


def assert_close(got, want, atol):
    worst = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(got, want))
    assert worst <= atol, f"max difference {worst:.3g} > {atol}"


@pytest.mark.parametrize("replicas", REPLICAS)
def test_regularizers_and_add_loss_enter_one_step_as_in_fit(replicas):
    x, y = classification_data(BATCH)
    start = initial_weights(regularized_classifier)
    _, model, _ = on_kdist(regularized_classifier, replicas, (x, y, None), start)
    reference = on_keras(regularized_classifier, start)
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_close(model.get_weights(), reference.get_weights(), 1e-6)
    # Without the model's losses the step would differ by far more than that.
    plain = on_keras(regularized_classifier, start)
    plain.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for layer in plain.layers:
        layer.kernel_regularizer = layer.activity_regularizer = None
    plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    gap = max(float(np.abs(a - b).max()) for a, b in
              zip(plain.get_weights(), reference.get_weights()))
    assert gap > 1e-3


class CountingModel(keras.Model):
    """A subclassed model whose layers build at its first call; it counts its calls."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.logits = keras.layers.Dense(3)

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x, training=False):
        self.calls.assign_add(1.0)
        return self.logits(self.hidden(x))


def without_input(model):
    """`model_fn` of `model()`, compiled as `regularized_classifier`."""
    def model_fn():
        built = model()
        built.compile(optimizer=keras.optimizers.SGD(0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return built
    return model_fn


@pytest.mark.parametrize("replicas", sorted({1, SEVERAL}))
@pytest.mark.parametrize("model", [
    CountingModel, lambda: keras.Sequential([keras.layers.Dense(16), keras.layers.Dense(3)])],
    ids=["subclassed", "Sequential"])
def test_a_model_that_builds_at_its_first_call_trains_as_fit_builds_it(replicas, model):
    # fit builds such a model by a symbolic call, which assigns nothing.
    model_fn = without_input(model)
    x, y = classification_data(BATCH)
    engine, ours, step = on_kdist(model_fn, replicas, None, sample=(x[:2], y[:2], None))
    start = [np.array(w) for w in ours.get_weights()]
    assert start and not any(np.any(w) for w in start if w.ndim == 0)  # 0 calls counted.
    engine.compile_steps(step)
    engine.train_chunk(engine.distribute(chunks.stack_chunk([(x, y, None)])), 1)
    engine.sync_to_model()
    reference = model_fn()
    reference(x[:1])
    reference.set_weights(start)
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_close(ours.get_weights(), reference.get_weights(), 1e-6)


class ProbabilityStats(keras.metrics.Metric):
    """A user's metric whose result is a dict: `fit` reports each entry by its key."""

    def __init__(self, name="probability_stats"):
        super().__init__(name=name)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(ops.sum(y_pred))
        self.count.assign_add(ops.sum(ops.ones_like(y_pred)))

    def result(self):
        return {"mean_probability": ops.divide_no_nan(self.total, self.count),
                "examples": ops.multiply(self.count, 1.0)}


def binary_classifier():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    probability = keras.layers.Dense(1, activation="sigmoid")(hidden)
    model = keras.Model(inputs, probability)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision"),
                           keras.metrics.Recall(name="recall"), "accuracy",
                           keras.metrics.MeanSquaredError(name="brier"), ProbabilityStats()])
    return model


class MeanConfidence(keras.metrics.Mean):
    """A user's metric: the mean top probability of a classifier's logits."""

    def __init__(self, name="confidence", **kwargs):
        super().__init__(name=name, **kwargs)

    def update_state(self, y_true, y_pred, sample_weight=None):
        probabilities = ops.softmax(y_pred, axis=-1)
        return super().update_state(ops.max(probabilities, axis=-1), sample_weight)


def multiclass_classifier():
    model = regularized_classifier()
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy",
                           keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2"),
                           MeanConfidence()])
    return model


class LogsTopTwoOnly(keras.Model):
    """A model whose `compute_metrics` returns only some of the results it updates."""

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        results = super().compute_metrics(x, y, y_pred, sample_weight)
        return {"loss": results["loss"], "top2": results["top2"]}


def top_two_only_classifier():
    plain = regularized_classifier()
    model = LogsTopTwoOnly(plain.inputs, plain.outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy",
                           keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")])
    return model


@pytest.mark.parametrize("replicas", REPLICAS)
@pytest.mark.parametrize("model_fn", [binary_classifier, multiclass_classifier,
                                      top_two_only_classifier])
def test_test_metrics_equal_keras_evaluate_on_an_uneven_test_set(replicas, model_fn):
    x, y = classification_data(BATCH * 3, seed=1)
    test_x, test_y = classification_data(1001, seed=2)  # 1,001: no global batch divides it.
    if model_fn is binary_classifier:
        y, test_y = (y == 0).astype(np.float32)[:, None], (test_y == 0).astype(np.float32)[:, None]
    engine, model, step = on_kdist(model_fn, replicas, (x[:BATCH], y[:BATCH], None))
    results = chunks.evaluate(engine, step, test_x, test_y, None, BATCH, steps_per_execution=4)
    reference = on_keras(model_fn, model.get_weights())
    expected = reference.evaluate(test_x, test_y, batch_size=BATCH, verbose=0,
                                  return_dict=True)
    assert set(results) == set(expected)  # What compute_metrics returns, as in fit's logs.
    for name, value in expected.items():
        assert results[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    if model_fn is binary_classifier:  # AUC as Keras computes it over all the data at once.
        auc = keras.metrics.AUC()
        auc.update_state(test_y, reference.predict(test_x, batch_size=2048, verbose=0))
        assert results["auc"] == pytest.approx(float(auc.result()), rel=1e-6)
        assert results["examples"] == len(test_x)  # ProbabilityStats' entries, as fit's.


def two_in_two_out():
    """A functional model with dict inputs and outputs: a class and a value."""
    image = keras.Input((6,), name="image")
    side = keras.Input((2,), name="side")
    hidden = keras.layers.Dense(12, activation="relu")(
        keras.layers.Concatenate()([image, side]))
    model = keras.Model({"image": image, "side": side},
                        {"label": keras.layers.Dense(3, name="label")(hidden),
                         "value": keras.layers.Dense(1, name="value")(hidden)})
    model.compile(optimizer=keras.optimizers.SGD(0.2),
                  loss={"label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        "value": "mse"},
                  loss_weights={"label": 1.0, "value": 0.5},
                  metrics={"label": ["accuracy"], "value": ["mae"]})
    return model


def two_in_two_out_data(n, seed):
    rng = np.random.default_rng(seed)
    x = {"image": rng.normal(size=(n, 6)).astype(np.float32),
         "side": rng.normal(size=(n, 2)).astype(np.float32)}
    y = {"label": x["image"][:, :3].argmax(axis=1).astype(np.int32),
         "value": (x["side"].sum(axis=1, keepdims=True) * 2).astype(np.float32)}
    weights = rng.uniform(0.5, 2.0, n).astype(np.float32)
    return x, y, weights


def step_and_evaluation_as_in_fit(model_fn, batch, test, replicas):
    """One kdist step on `batch` (x, y, sample weights) from `fit`'s start, its
    weights asserted equal to `fit`'s after the same step (1e-6); then both
    evaluations of `test`, with the same names. Returns (kdist's, `evaluate`'s)
    results and the reference model."""
    start = initial_weights(model_fn)
    engine, model, step = on_kdist(model_fn, replicas, batch, start)
    reference = on_keras(model_fn, start)
    reference.fit(batch[0], batch[1], sample_weight=batch[2], batch_size=BATCH, epochs=1,
                  shuffle=False, verbose=0)
    assert_close(model.get_weights(), reference.get_weights(), 1e-6)
    results = chunks.evaluate(engine, step, *test, BATCH)
    expected = reference.evaluate(*test[:2], sample_weight=test[2], batch_size=BATCH,
                                  verbose=0, return_dict=True)
    assert set(results) == set(expected)  # Per-output losses and metrics by Keras' names.
    return results, expected, reference


@pytest.mark.parametrize("replicas", [2, 4])
def test_dict_inputs_and_outputs_with_sample_weights_train_and_evaluate_as_in_fit(replicas):
    test_x, test_y, test_weights = two_in_two_out_data(1001, seed=4)
    results, expected, reference = step_and_evaluation_as_in_fit(
        two_in_two_out, two_in_two_out_data(BATCH, seed=3), (test_x, test_y, test_weights),
        replicas)
    # Keras' per-output loss trackers weight each batch by its static row count,
    # which TensorFlow's evaluate does not know for the shorter last batch: it
    # then averages batch means (label_loss 1.36338 for 1.35594). kdist's equal
    # the exact weighted means, computed here in float64.
    expected.update(exact_output_losses(reference, test_x, test_y, test_weights))
    for name, value in expected.items():
        assert results[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name


def auxiliary_output_classifier():
    """Two outputs, a loss and a metric for the second only: `fit` takes one
    label array for it."""
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(4, name="auxiliary")(hidden),
                                 keras.layers.Dense(3, name="label")(hidden)])
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=[None, keras.losses.SparseCategoricalCrossentropy(from_logits=True)],
                  metrics=[None, ["accuracy"]])
    return model


@pytest.mark.parametrize("replicas", sorted({1, SEVERAL}))
def test_one_label_array_for_the_one_loss_of_two_outputs_trains_as_in_fit(replicas):
    # kdist built the loss on 2 rows, which Keras split into the 2 outputs' labels.
    x, y = classification_data(BATCH, seed=6)
    results, expected, _ = step_and_evaluation_as_in_fit(
        auxiliary_output_classifier, (x, y, None), (*classification_data(1001, seed=7), None),
        replicas)
    for name, value in expected.items():
        assert results[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name


def exact_output_losses(model, x, y, weights):
    """{"label_loss", "value_loss"}: sum(weight x loss) / examples, in float64."""
    predicted = model.predict(x, batch_size=2048, verbose=0)
    logits = predicted["label"].astype(np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    log_softmax = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    cross_entropy = -log_softmax[np.arange(len(logits)), y["label"]]
    squared = (predicted["value"][:, 0].astype(np.float64) - y["value"][:, 0]) ** 2
    w = weights.astype(np.float64)
    return {"label_loss": (w * cross_entropy).sum() / len(w),
            "value_loss": (w * squared).sum() / len(w)}


def own_loss(model, x, y, training):
    """A cross-entropy plus a penalty on the logits' size, per example."""
    logits = model(x, training=training)
    per_example = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    return per_example + 0.1 * ops.sum(ops.square(logits), axis=-1), logits


class OwnLossModel(keras.Model):
    """Keras' own hook for the same loss: `compute_loss` overridden for `fit`."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        per_example = keras.losses.sparse_categorical_crossentropy(y, y_pred, from_logits=True)
        per_example = per_example + 0.1 * ops.sum(ops.square(y_pred), axis=-1)
        return ops.mean(per_example) + sum(self.losses)


def own_loss_classifier(model_class=keras.Model):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu",
                                kernel_regularizer=keras.regularizers.L2(0.05))(inputs)
    model = model_class(inputs, keras.layers.Dense(3)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.5), metrics=["accuracy"])
    return model


@pytest.mark.parametrize("replicas", REPLICAS)
def test_your_own_loss_trains_as_keras_compute_loss_does_in_fit(replicas):
    x, y = classification_data(BATCH, seed=5)
    start = initial_weights(own_loss_classifier)
    _, model, _ = on_kdist(own_loss_classifier, replicas, (x, y, None), start,
                           compute_loss=own_loss)
    reference = on_keras(lambda: own_loss_classifier(OwnLossModel), start)
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_close(model.get_weights(), reference.get_weights(), 1e-6)


class LossWithoutTraining(keras.Model):
    """`compute_loss` without `training`, as Keras before 3.3 and keras.io's
    knowledge distillation example write it: `fit` calls it without."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        return OwnLossModel.compute_loss(self, x, y, y_pred, sample_weight)


@pytest.mark.parametrize("replicas", sorted({1, SEVERAL}))
def test_a_compute_loss_written_without_training_trains_as_in_fit(replicas):
    # kdist called it with training=...: a TypeError where fit trains.
    x, y = classification_data(BATCH, seed=5)
    start = initial_weights(own_loss_classifier)
    model_fn = lambda: own_loss_classifier(LossWithoutTraining)  # noqa: E731
    _, model, _ = on_kdist(model_fn, replicas, (x, y, None), start)
    reference = on_keras(model_fn, start)
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_close(model.get_weights(), reference.get_weights(), 1e-6)


class TopLogit(keras.metrics.Mean):
    """The mean of the largest logit, made without a name: Keras names it
    `top_logit`, and each one made after it `top_logit_1`, `top_logit_2`..."""

    def __init__(self):
        super().__init__(name=None)

    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(ops.max(y_pred, axis=-1), sample_weight)


@pytest.mark.parametrize("replicas", sorted({1, SEVERAL}))
def test_a_whole_run_ends_where_fit_ends_on_the_same_batches(replicas, tmp_path):
    """Three epochs of `train_and_evaluate` (chunks of 4 steps, the last one
    short) against `fit`, one call per epoch on kdist's batches of that epoch
    in kdist's order (a permutation of (seed, epoch), full batches only): the
    whole loop, not one step, equals `fit` epoch by epoch. A metric made
    without a name has one name in the history, the restored evaluation and
    the model in hand (each model kdist builds names it alike)."""
    x, y = classification_data(1000, seed=4)  # 15 global batches of 64, 40 rows left over.
    test_x, test_y = classification_data(301, seed=5)
    seed, epochs, built = 3, 3, []

    def model_fn():
        model = regularized_classifier(["accuracy", TopLogit()])
        built.append([np.array(w) for w in model.get_weights()])
        return model

    config = kdist.TrainConfig(epochs=epochs, seed=seed, replicas=replicas,
                               batch_size_per_replica=BATCH // replicas,
                               steps_per_execution=4, checkpoint_dir=str(tmp_path))
    result = kdist.train_and_evaluate(config, kdist.Dataset(x, y, test_x, test_y, "toy"),
                                      model_fn=model_fn, log=lambda line: None)
    history = result.epochs
    names = {key for key in result.history if not key.startswith("val_")}
    assert len(names) == 3 and {"loss", "accuracy"} < names  # And top_logit(_N).
    assert set(result.history) == names | {f"val_{name}" for name in names}
    assert {key for key in result.restored if key.startswith("test_")} == {
        f"test_{name}" for name in names}  # Not a test_top_logit_1 of a history's top_logit.
    assert set(result.model.evaluate(test_x, test_y, verbose=0, return_dict=True)) == names
    reference = on_keras(regularized_classifier, built[0])
    rows = base.steps_per_epoch(len(x), BATCH) * BATCH
    for epoch, ours in enumerate(history):
        order = arrays.epoch_order(len(x), seed, epoch)[:rows]
        fitted = reference.fit(x[order], y[order], batch_size=BATCH, epochs=1, shuffle=False,
                               verbose=0).history
        theirs = reference.evaluate(test_x, test_y, batch_size=BATCH, verbose=0,
                                    return_dict=True)
        assert ours["train_loss"] == pytest.approx(fitted["loss"][0], rel=1e-5), epoch
        assert ours["test_loss"] == pytest.approx(theirs["loss"], rel=1e-5), epoch
        assert ours["test_accuracy"] == pytest.approx(theirs["accuracy"], abs=1e-6), epoch


@pytest.mark.parametrize("replicas", sorted({1, SEVERAL}))
@pytest.mark.parametrize("one_hot", [False, True])
def test_class_weight_weighs_each_example_by_its_class_as_in_fit(replicas, one_hot, tmp_path):
    """`class_weight` (class 0 not given: weight 1) for class indices or one-hot
    labels: an epoch of `train_and_evaluate` ends at the weights and loss of
    `fit(class_weight=...)` on kdist's batches, weights far from `fit`'s without it."""
    x, y = classification_data(640, seed=6)
    if one_hot:
        y = np.eye(3, dtype=np.float32)[y]
    loss = keras.losses.CategoricalCrossentropy if one_hot else \
        keras.losses.SparseCategoricalCrossentropy
    class_weight, seed, built = {1: 3.0, 2: 0.25}, 2, []

    def model_fn():
        model = regularized_classifier()
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss(from_logits=True))
        built.append([np.array(w) for w in model.get_weights()])
        return model

    config = kdist.TrainConfig(epochs=1, seed=seed, replicas=replicas,
                               batch_size_per_replica=BATCH // replicas,
                               checkpoint_dir=str(tmp_path))
    result = kdist.train_and_evaluate(config, kdist.Dataset(x, y, x[:64], y[:64], "toy"),
                                      model_fn=model_fn, log=lambda line: None,
                                      class_weight=class_weight)
    order = arrays.epoch_order(len(x), seed, 0)
    for weighed in (class_weight, None):
        reference = on_keras(model_fn, built[0])
        fitted = reference.fit(x[order], y[order], batch_size=BATCH, shuffle=False, verbose=0,
                               class_weight=weighed).history
        if weighed:
            assert_close(result.model.get_weights(), reference.get_weights(), 1e-5)
            assert result.epochs[0]["train_loss"] == pytest.approx(fitted["loss"][0], rel=1e-5)
        else:
            with pytest.raises(AssertionError):
                assert_close(result.model.get_weights(), reference.get_weights(), 1e-3)


class GuideStepModel(keras.Model):
    """Keras' guide "Customizing what happens in fit()": every metric in
    `self.metrics` updated, their results returned (the compiled ones as a dict),
    with `kdist.value_and_grad` in place of the backend's gradients."""

    def train_step(self, data):
        x, y = data

        def loss_fn():
            y_pred = self(x, training=True)
            return self.compute_loss(y=y, y_pred=y_pred), y_pred

        (loss, y_pred), grads = kdist.value_and_grad(loss_fn, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return self.update_metrics(loss, y, y_pred)

    def update_metrics(self, loss, y, y_pred):
        """As the guide does: the loss tracker with the loss, the others with y."""
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def guide_classifier(model_class=keras.Model):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = model_class(inputs, keras.layers.Dense(3)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


@pytest.mark.parametrize("replicas", sorted({1, SEVERAL}))
def test_the_keras_guides_own_train_step_with_compiled_metrics_trains_as_fit(replicas):
    x, y = classification_data(BATCH, seed=6)
    start = initial_weights(guide_classifier)
    engine, model, step = on_kdist(lambda: guide_classifier(GuideStepModel), replicas, None,
                                   sample=(x[:2], y[:2], None))
    model.set_weights(start)
    engine.compile_steps(step)
    per_step = engine.train_chunk(engine.distribute(chunks.stack_chunk([(x, y, None)])), 1)
    engine.sync_to_model()
    ours = step.results({k: np.sum(v, axis=0) for k, v in per_step.items()})
    reference = on_keras(guide_classifier, start)
    theirs = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    assert_close(model.get_weights(), reference.get_weights(), 1e-6)
    assert sorted(ours) == ["accuracy", "loss"]
    assert ours["loss"] == pytest.approx(theirs["loss"][0], rel=1e-5)
    assert ours["accuracy"] == pytest.approx(theirs["accuracy"][0], abs=1e-6)


class GuideSteps(GuideStepModel):
    """The guide's `test_step` too: every metric updated once per call, the loss
    tracker with the batch's loss."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        return self.update_metrics(loss, y, y_pred)


def test_the_keras_guides_own_test_step_reports_its_loss_tracker_as_evaluate():
    """Keras' loss tracker, which the guide's steps update once per batch, is the
    reported loss, as `evaluate` reports it: the mean of the batches' losses, the
    last, partial batch one of them. kdist reported the loss weighted by rows."""
    x, y = classification_data(BATCH + BATCH // 4, seed=8)
    engine, model, step = on_kdist(lambda: guide_classifier(GuideSteps), 1, None,
                                   sample=(x[:2], y[:2], None))
    engine.compile_steps(step)
    ours = chunks.evaluate(engine, step, x, y, None, BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    batches = [float(loss(y[i:i + BATCH], model.predict_on_batch(x[i:i + BATCH])))
               for i in range(0, len(x), BATCH)]
    assert ours["loss"] == pytest.approx(np.mean(batches), rel=1e-5)
    assert abs(np.mean(batches) - float(loss(y, model.predict_on_batch(x)))) > 1e-3


def batch_sum_of_squares(y_true, y_pred):
    """A loss function returning one number for its batch: the sum over every row."""
    return ops.sum(ops.square(y_true - y_pred))


def counted_losses():
    """Five outputs whose losses Keras divides by a count of the batch, or not at all,
    or computes over the whole batch: a masked sequence (sparse cross-entropy over the
    valid steps: Embedding's mask reaches the per-step logits), a sum, a mean over the
    sample weights, Dice over the batch (its default axis=None) and a function that
    sums over the batch."""
    tokens = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Dense(6, activation="tanh")(
        keras.layers.Embedding(7, 4, mask_zero=True)(tokens))
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    model = keras.Model(tokens, {
        "steps": keras.layers.Dense(3, name="steps")(hidden),
        "total": keras.layers.Dense(1, activation="sigmoid", name="total")(pooled),
        "weighted": keras.layers.Dense(1, name="weighted")(pooled),
        "overlap": keras.layers.Dense(1, activation="sigmoid", name="overlap")(pooled),
        "spread": keras.layers.Dense(2, name="spread")(pooled)})
    model.compile(
        optimizer=keras.optimizers.SGD(0.2),
        loss={"steps": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              "total": keras.losses.BinaryCrossentropy(reduction="sum"),
              "weighted": keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
              "overlap": keras.losses.Dice(), "spread": batch_sum_of_squares},
        loss_weights={"steps": 1.0, "total": 0.05, "weighted": 1.0, "overlap": 1.0,
                      "spread": 0.02},
        # A masked accuracy, and an IoU of integer sums (on TensorFlow's replicas too).
        metrics={"steps": ["accuracy", keras.metrics.MeanIoU(3, sparse_y_pred=False,
                                                              name="iou")]})
    return model


def counted_data(n, seed):
    """Sequences of 1 to 5 tokens (0 pads them), so each share of a batch holds
    another number of valid steps; per-step classes, a flag, a value; weights."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 6, n)
    tokens = np.where(np.arange(5) < lengths[:, None], rng.integers(1, 7, (n, 5)), 0)
    y = {"steps": (tokens % 3).astype(np.int32),
         "total": (lengths > 2).astype(np.float32)[:, None],
         "weighted": (tokens.sum(axis=1, keepdims=True) / 10).astype(np.float32),
         "overlap": (lengths > 3).astype(np.float32)[:, None],
         "spread": np.stack([lengths, tokens[:, 0]], axis=1).astype(np.float32) / 5}
    # Weights per output, per step for the steps: Keras' fit refuses weights of shape
    # (n,) (JAX, torch) or (n, 1) (torch) against the masked (n, 5) losses.
    weights = rng.uniform(0.2, 3.0, (n, 1)).astype(np.float32)
    return tokens.astype(np.int32), y, {"steps": np.repeat(weights, 5, axis=1),
                                        "total": weights, "weighted": weights,
                                        "overlap": weights, "spread": weights}


@pytest.mark.parametrize("replicas", [2, 4])
def test_losses_divided_by_a_count_of_the_batch_use_the_global_batchs(replicas):
    """A masked loss, a sum, a mean over sample weights and two statistics of the whole
    batch: each replica's share holds other counts and statistics than the global
    batch, and one step equals `fit`'s on it. (Dice and the function's sum were each
    replica's own before: the average of Dice over shares, half the batch's sum.)"""
    results, expected, _ = step_and_evaluation_as_in_fit(
        counted_losses, counted_data(BATCH, seed=6), counted_data(1001, seed=7), replicas)
    for name, value in expected.items():
        if name.endswith("_loss") and keras.backend.backend() == "tensorflow":
            continue  # TensorFlow's evaluate: its per-output losses of the last batch (above).
        assert results[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
