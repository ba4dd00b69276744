"""The built-in step's statistics (`kdist.step.program.Program` running
`kdist.step.compiled`), eagerly on one device: the loss, the model's losses, metrics;
and each model's losses in a step that calls two."""

import dataclasses
import gc
import os
import types

import keras
import numpy as np
import pytest
from helpers import SEVERAL
from keras import ops

import kdist
from kdist import engines
from kdist.inputs import arrays
from kdist.loop import chunks
from kdist.models import losses
from kdist.step import context, portable
from kdist.step.compiled import build_metrics
from kdist.step.program import Program


def one_hot_model(regularization=0.0, compute_loss=None):
    """Logits = 5 * x (x one-hot rows), plus an L2 term when `regularization` > 0."""
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(
        10, use_bias=False, kernel_initializer=keras.initializers.Identity(5.0),
        kernel_regularizer=keras.regularizers.L2(regularization) if regularization else None)])
    model.compile(optimizer="sgd",
                  loss=None if compute_loss else losses.sparse_categorical_crossentropy,
                  metrics=["accuracy"])
    x = np.eye(10, dtype=np.float32)[[1, 2, 3]]
    labels = np.array([1, 2, 0], np.int32)  # Two right, one wrong.
    build_metrics(model, x, labels)
    return model, x, labels


def evaluate(model, batch, compute_loss=None):
    """(program, statistics of the test step on `batch`) on one undistributed device."""
    engine = engines.create_engine(distributed=False)
    program = Program(model, compute_loss)
    program.build(engine, batch)
    stats, _ = program.run(engine.primitives(), False, tuple(
        None if part is None else ops.convert_to_tensor(part) for part in batch))
    return program, {k: np.asarray(keras.ops.convert_to_numpy(v), np.float64)
                     for k, v in stats.items()}


@pytest.mark.parametrize("regularization", [0.0, 0.01])
def test_statistics_sum_the_loss_and_count_the_model_losses_per_example(regularization):
    model, x, labels = one_hot_model(regularization)
    program, stats = evaluate(model, (x, labels, None))
    per_example = keras.ops.convert_to_numpy(
        losses.sparse_categorical_crossentropy(labels, model(x)))
    penalty = regularization * 25.0 * 10  # L2 of 5 * I (10 x 10).
    assert stats["count"] == 3.0
    assert stats["loss_sum"] == pytest.approx(per_example.sum() + 3 * penalty, rel=1e-6)
    totals = chunks.zero_totals(program)
    for key in totals:
        totals[key] = totals[key] + stats[key]
    assert program.results(totals, "test")["accuracy"] == pytest.approx(2 / 3, rel=1e-6)


def test_own_loss_is_its_weighted_sum_over_the_batch_plus_the_model_losses():
    def compute_loss(model, x, y, training):
        return ops.convert_to_tensor(np.array([1.0, 2.0, 3.0], np.float32)), model(x)

    model, x, labels = one_hot_model(0.01, compute_loss=compute_loss)
    weights = np.array([2.0, 1.0, 1.0], np.float32)
    _, stats = evaluate(model, (x, labels, weights), compute_loss)
    penalty = 0.01 * 25.0 * 10
    # The loss is the weighted sum / the batch's 3 rows + the penalty; its sum is 3 times that.
    assert stats["loss_sum"] == pytest.approx(7 + 3 * penalty, rel=1e-6)
    assert stats["count"] == 3.0


def test_a_metric_that_does_not_merge_by_summing_is_refused():
    class Last(keras.metrics.Metric):
        def __init__(self):
            super().__init__(name="last")
            self.value = self.add_variable((), "zeros", aggregation="mean", name="value")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.value.assign(ops.mean(y_pred))

        def result(self):
            return self.value

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", metrics=[Last()])
    build_metrics(model, np.zeros((2, 3), np.float32), np.zeros((2, 1), np.float32))
    with pytest.raises(Exception, match="'last/value' is aggregated by 'mean'"):
        Program(model)


def test_a_metric_whose_variables_do_not_add_up_over_examples_is_refused():
    class MaxError(keras.metrics.Metric):  # Declared "sum" (Keras' default), merges otherwise.
        def __init__(self):
            super().__init__(name="max_error")
            self.worst = self.add_variable((), "zeros", name="worst")

        def update_state(self, y_true, y_pred, sample_weight=None):
            error = ops.abs(ops.convert_to_tensor(y_true) - y_pred)
            self.worst.assign(ops.maximum(self.worst, ops.max(error)))

        def result(self):
            return self.worst

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae", MaxError()])
    x = np.array([[1.0, 2.0, 3.0], [-2.0, 1.0, 0.5]], np.float32)
    with pytest.raises(kdist.UsageError, match="metric 'max_error' does not add up over "
                                               "examples: its variable 'max_error/worst'"):
        build_metrics(model, x, np.zeros((2, 1), np.float32))

    def rmse(y_true, y_pred):  # One number for the batch: fit averages it over batches.
        return ops.sqrt(ops.mean(ops.square(y_true - y_pred)))

    model.compile(optimizer="sgd", loss="mse", metrics=[rmse])
    with pytest.raises(kdist.UsageError, match="metric 'rmse' does not add up over examples"
                                               ".* must return one value per example"):
        build_metrics(model, x, np.zeros((2, 1), np.float32))
    model.compile(optimizer="sgd", loss="mse", metrics=["mae", "mse"])
    build_metrics(model, x, np.zeros((2, 1), np.float32))  # Keras' own add up.

    class Ratio(keras.metrics.Sum):  # A sum, NaN on the sample's zero targets.
        def update_state(self, y_true, y_pred, sample_weight=None):
            y_true = ops.convert_to_tensor(y_true)
            super().update_state(y_true / y_true)

    model.compile(optimizer="sgd", loss="mse", metrics=[Ratio(name="ratio")])
    build_metrics(model, x, np.zeros((2, 1), np.float32))


def test_a_metric_whose_result_is_not_a_number_is_refused_before_training():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", metrics=[keras.metrics.F1Score()])
    sample = (np.zeros((2, 3), np.float32), np.zeros((2, 2), np.float32), None)
    build_metrics(model, *sample[:2])
    with pytest.raises(kdist.UsageError, match=r"metric 'f1_score' has a result of shape "
                                               r"\(2,\).*average='macro'"):
        Program(model).build(engines.create_engine(1, distributed=False), sample)


class Outside(keras.Model):
    """An own step that trains `net` with an optimizer or variables of `kind`:
    "sub-model": the optimizer `net` is compiled with; "nowhere": one no model
    holds (a module's global); "own": its own, leaving `net`'s alone (a trained
    teacher's); "other model": its own, on `net` and a model it does not hold;
    "variable": its own, and it counts its steps in a variable it does not hold;
    "cond": its own, applied inside `keras.ops.cond`; "grad in cond": its own, applied
    to gradients taken inside `keras.ops.cond`."""

    def __init__(self, kind):
        super().__init__()
        self.net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        self.net.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        self.kind = kind
        unheld = {"nowhere": keras.optimizers.SGD(0.5),
                  "other model": keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
                  "variable": keras.Variable(0.0, trainable=False)}
        self.unheld = lambda: unheld.get(kind)  # Out of Keras' tracking, as a global is.
        if kind not in ("sub-model", "nowhere"):
            self.own = keras.optimizers.SGD(0.5)

    def train_step(self, data):
        x, y = data
        other = self.unheld() if self.kind == "other model" else None
        weights = self.net.trainable_variables + (other.trainable_variables if other else [])
        loss, grads = kdist.value_and_grad(
            lambda: ops.mean((self.net(x) + (other(x) if other else 0.0) - y) ** 2), weights)
        if self.kind == "grad in cond":
            grads = ops.cond(loss > 0.0, lambda: kdist.grad(
                lambda: ops.mean(self.net(x) ** 2), weights), lambda: grads)
        optimizer = {"sub-model": self.net.optimizer, "nowhere": self.unheld()}.get(
            self.kind, getattr(self, "own", None))
        if self.kind == "cond":
            ops.cond(loss > 0.0, lambda: optimizer.apply(grads, weights), lambda: None)
        else:
            optimizer.apply(grads, weights)
        if self.kind == "variable":
            self.unheld().assign_add(1.0)
        return {"loss": loss}


@pytest.mark.parametrize("kind, refused", [
    ("sub-model", r"the step applies an optimizer \(SGD\) held by a sub-model "
                  r"\(sequential\w*\.optimizer\)"),
    ("nowhere", r"the step applies an optimizer \(SGD\) that the model does not hold"),
    ("other model", r"the train_step applies an optimizer to 'sequential\w*/dense\w*/kernel', "
                    "a variable the model does not hold"),
    ("variable", r"the train_step assigns 'variable\w*', a variable the model does not hold"),
    ("cond", r"the step applies SGD inside keras.ops.cond \(or another control-flow op\)"),
    ("grad in cond", r"kdist.value_and_grad with respect to variables inside keras.ops.cond "
                     r"\(or another control-flow op\): their gradients are summed"),
    ("own", None)])
def test_a_step_whose_updates_kdist_cannot_keep_is_refused(kind, refused):
    """On JAX the updates of what the model does not hold were dropped each step,
    TensorFlow failed in Keras, torch kept them out of the checkpoints; an
    optimizer applied in a branch failed inside TensorFlow and JAX; gradients of
    variables taken in a branch failed inside TensorFlow's strategy at 2 replicas
    (`merge_call called while defining a new graph`), at 1 and elsewhere not."""
    model = Outside(kind)
    before = [np.array(w) for w in model.net.get_weights()]
    sample = (np.ones((2, 3), np.float32), np.zeros((2, 2), np.float32), None)
    program = Program(model)
    if refused:
        with pytest.raises(kdist.UsageError, match=refused):
            program.build(engines.create_engine(1, distributed=False), sample)
        after = model.net.get_weights()  # The building run updated nothing.
        assert all(np.array_equal(a, b) for a, b in zip(before, after))
    else:
        program.build(engines.create_engine(1, distributed=False), sample)
        assert [id(o) for o in program.optimizers] == [id(model.own)]


class InputGradientNorms(keras.Model):
    """A penalty on each example's input-gradient norm, taken in `vectorized_map`."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)
        self.dense.build((None, 3))
        self.sgd = keras.optimizers.SGD(0.1)

    def train_step(self, data):
        x, y = data

        def loss_fn():
            norms = ops.vectorized_map(lambda row: ops.sum(ops.square(kdist.grad(
                lambda r: ops.sum(self.dense(r[None])), row))), x)
            return ops.mean(norms) + ops.mean(ops.square(self.dense(x) - y))

        loss, grads = kdist.value_and_grad(loss_fn, self.dense.trainable_variables)
        self.sgd.apply(grads, self.dense.trainable_variables)
        return {"loss": loss}


def test_gradients_inside_vectorized_map_build_or_are_one_line_on_torch():
    """torch's autograd raised its own RuntimeError from inside its vmap."""
    program = Program(InputGradientNorms())
    sample = (np.ones((2, 3), np.float32), np.zeros((2, 2), np.float32), None)
    engine = engines.create_engine(1, distributed=False)
    if keras.backend.backend() == "torch":
        with pytest.raises(kdist.UsageError, match=(
                r"^kdist.value_and_grad inside keras.ops.vectorized_map: torch's autograd "
                r"cannot differentiate inside its vmap; .* kdist.grad\(lambda x: ops.sum")):
            program.build(engine, sample)
    else:
        program.build(engine, sample)


def test_an_uncompiled_model_is_a_clear_error():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(Exception, match="model is not compiled"):
        build_metrics(model, np.zeros((2, 3), np.float32), np.zeros((2, 1), np.float32))


def test_a_model_fn_that_returns_no_model_is_a_clear_error(tmp_path):
    config = kdist.TrainConfig(epochs=1, batch_size_per_replica=8, checkpoint_dir=str(tmp_path),
                               progress=False)
    with pytest.raises(kdist.UsageError, match="^model_fn returned NoneType, not a Keras model"):
        kdist.train_and_evaluate(config, kdist.synthetic_fashion_mnist(60, seed=0),
                                 model_fn=lambda: None, log=lambda line: None)


class Constant(keras.layers.Layer):
    """x + w (w a weight, 0) that adds `value`, one tensor made once, as its loss at
    every call."""

    def __init__(self, value):
        super().__init__()
        self.value = ops.convert_to_tensor(value, "float32")
        self.w = self.add_weight((), initializer="zeros")

    def call(self, x):
        self.add_loss(self.value)
        return x + self.w


class TwoModels(keras.Model):
    """A step calling two models, each with a loss (1 and 2), as a GAN's does; its
    `check(self)`, if set, runs in the step after both calls."""

    def __init__(self):
        super().__init__()
        self.first, self.second = (keras.Sequential([keras.Input((2,)), Constant(v)])
                                   for v in (1.0, 2.0))
        self.check = None

    def train_step(self, data):
        return self.test_step(data)

    def test_step(self, data):
        def loss(model):  # The losses: the mean output is 0 (x and w are 0).
            return ops.mean(self.second(self.first(data[0]))) + sum(model.losses)

        total = sum(kdist.value_and_grad(lambda m=m: loss(m), m.trainable_variables)[0]
                    for m in (self.first, self.second))
        if self.check is not None:
            self.check(self)
        return {"losses": total}


def run_two_models(check=None, plant=False):
    """Statistics of TwoModels' test step on 3 rows; with `plant`, the second model's
    layer has recorded, at its last call, the id of the first one's loss."""
    model, x = TwoModels(), np.zeros((3, 2), np.float32)
    program = Program(model)
    engine = engines.create_engine(distributed=False)
    program.build(engine, (x, None, None))
    model.check = check
    if plant:
        model.second.layers[0]._loss_ids.add(id(model.first.layers[0].value))
    stats, _ = program.run(engine.primitives(), False, (ops.convert_to_tensor(x), None, None))
    return float(keras.ops.convert_to_numpy(stats["losses_sum"]))


def test_a_loss_id_recorded_at_a_layers_last_call_drops_no_loss_of_the_step():
    """CPython gives a freed tensor's id to a new one: here, the id the second
    model's layer recorded at its last call is that of the loss the first model
    adds now. Keras' call of the second model drops the losses its layers
    recorded; kdist empties the records before a step, so both losses count."""
    assert run_two_models(plant=True) == pytest.approx(3 * (1.0 + 2.0))


def test_every_loss_id_keras_records_in_a_step_names_a_loss_the_step_holds():
    """A loss of an inner scope (JAX's `value_and_grad`) stays alive until the
    step ends, so no tensor made later in the step can take its id."""
    seen = []

    def check(model):
        step = context.current()
        held = {id(t) for t in step.kept_losses + context.current_scope().losses}
        seen.append([layer._loss_ids <= held and len(layer._loss_ids) == 1
                     for m in (model.first, model.second) for layer in m.layers])

    assert run_two_models(check) == pytest.approx(3 * (1.0 + 2.0))
    assert seen == [[True, True]]


class HiddenFirst(keras.Model):
    """A step that computes its first layer before `kdist.value_and_grad`, and
    returns a variable it assigns and Python numbers."""

    def __init__(self):
        super().__init__()
        self.first, self.second = keras.layers.Dense(4), keras.layers.Dense(3)
        self.steps_seen = keras.Variable(0.0, trainable=False, name="steps_seen")
        self.opt = keras.optimizers.SGD(0.1)

    def call(self, x):
        return self.second(self.first(x))

    def train_step(self, data):
        x, y = data
        hidden = self.first(x)  # A constant to the differentiated function.

        def loss_fn():
            return ops.mean(keras.losses.sparse_categorical_crossentropy(
                y, self.second(hidden), from_logits=True))

        loss, grads = kdist.value_and_grad(loss_fn, self.trainable_variables)
        self.opt.apply(grads, self.trainable_variables)
        self.steps_seen.assign_add(1.0)
        return {"loss": loss, "unread": float(sum(g is None for g in grads)),
                "steps_seen": self.steps_seen, "half": 0.5}


def test_a_tensor_computed_before_value_and_grad_and_the_logs_a_step_returns(tmp_path):
    """On every backend: the first layer, computed outside the differentiated
    function, gets None (torch recorded its graph and trained it); a returned
    variable is reported after the step's assignment (it was read before it, or
    at 0 on JAX); a Python number is a statistic (JAX and torch failed on it)."""
    x = np.random.default_rng(0).normal(size=(64, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    built = []

    def model_fn():
        model = HiddenFirst()
        model(x[:2])
        built.append([np.array(w) for w in model.first.get_weights()])
        return model

    config = kdist.TrainConfig(epochs=2, batch_size_per_replica=16, replicas=1,
                               checkpoint_dir=str(tmp_path), progress=False)
    result = kdist.train_and_evaluate(config, kdist.Dataset(x, y, x, y, "toy"),
                                      model_fn=model_fn, log=lambda line: None)
    assert result.history["unread"] == [2.0, 2.0]
    assert result.history["steps_seen"] == [2.5, 6.5]  # Steps 1-4, then 5-8.
    assert result.history["half"] == [0.5, 0.5]
    for before, after in zip(built[0], result.model.first.get_weights()):
        np.testing.assert_array_equal(after, before)


class FrozenGradient(keras.Model):
    """A step that reports the gradient of a frozen layer's kernel (units 1, no
    bias, under a mean of its outputs: the mean of the batch's rows)."""

    def __init__(self):
        super().__init__()
        self.frozen = keras.layers.Dense(1, use_bias=False, trainable=False)

    def call(self, x):
        return self.frozen(x)

    def train_step(self, data):
        x, _ = data
        grad = kdist.grad(lambda: ops.mean(self.frozen(x)), self.frozen.kernel)
        return {"grad_sum": ops.sum(grad)}


def test_a_gradient_with_respect_to_a_frozen_layer(tmp_path):
    """Every backend gives it (torch refused: the parameter did not require one),
    and the frozen weights stay as they were."""
    x = np.random.default_rng(1).normal(size=(64, 5)).astype(np.float32)
    built = []

    def model_fn():
        model = FrozenGradient()
        model(x[:2])
        built.append(np.array(model.frozen.kernel.numpy()))
        return model

    config = kdist.TrainConfig(epochs=1, batch_size_per_replica=16, replicas=1,
                               checkpoint_dir=str(tmp_path), progress=False)
    result = kdist.train_and_evaluate(config, kdist.Dataset(x, x[:, 0], x, x[:, 0], "toy"),
                                      model_fn=model_fn, log=lambda line: None)
    np.testing.assert_allclose(result.history["grad_sum"], [x.mean(axis=0).sum()], rtol=1e-5)
    np.testing.assert_array_equal(result.model.frozen.kernel.numpy(), built[0])


class ClippedEmbedding(keras.Model):
    """A step that clips an `Embedding`'s gradient (TensorFlow's tape gives it as one
    slice per token looked up) before applying it with SGD(1)."""

    def __init__(self):
        super().__init__()
        self.embedding = keras.layers.Embedding(6, 1, embeddings_initializer="zeros")
        self.embedding.build((None, 1))
        self.optimizer = keras.optimizers.SGD(1.0)

    def call(self, tokens):
        return self.embedding(tokens)

    def train_step(self, data):
        tokens, _ = data
        grads = kdist.grad(lambda: ops.mean(self(tokens)), self.trainable_variables)
        self.optimizer.apply([ops.clip(g, -0.25, 0.25) for g in grads],
                             self.trainable_variables)
        return {"grad_of_3": ops.sum(grads[0][3])}


def test_a_step_reads_and_clips_an_embeddings_gradient_as_one_tensor(tmp_path):
    """Token 3 is 4 of 8 rows: its gradient is 4/8, clipped to 0.25, on every backend
    and replica count (clipping TensorFlow's slices, 1/8 each, would clip none)."""
    tokens = np.array([[3], [0], [3], [1], [3], [2], [3], [4]], np.int32)
    config = kdist.TrainConfig(epochs=1, batch_size_per_replica=8 // SEVERAL,
                               replicas=SEVERAL, checkpoint_dir=str(tmp_path))
    result = kdist.train_and_evaluate(config, kdist.Dataset(
        tokens, tokens[:, 0], tokens, tokens[:, 0], "toy"), model_fn=ClippedEmbedding,
        log=lambda line: None)
    assert result.history["grad_of_3"] == [pytest.approx(0.5)]
    np.testing.assert_allclose(result.model.embedding.embeddings.numpy()[:, 0],
                               [-0.125, -0.125, -0.125, -0.25, -0.125, 0.0], rtol=1e-6)


class DenseThree(keras.Model):
    """One Dense layer of 3 units, built at its first call (no `Input`)."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)


class OwnLossScaled(DenseThree):
    """A step that scales the averaged gradients by its replica's own loss."""

    def __init__(self):
        super().__init__()
        self.opt = keras.optimizers.SGD(0.1)

    def train_step(self, data):
        x, y = data

        def loss_fn():
            return ops.mean(keras.losses.sparse_categorical_crossentropy(
                y, self.dense(x), from_logits=True))

        loss, grads = kdist.value_and_grad(loss_fn, self.trainable_variables)
        self.opt.apply([g * loss for g in grads], self.trainable_variables)
        return {"loss": loss}


def test_replicas_made_to_differ_by_a_step_stop_the_run_at_the_epochs_end(tmp_path):
    """On TensorFlow and torch each replica's loss is its share's, so the replicas
    applied other updates and trained other models, silently; the run stops
    before the epoch's checkpoint. On JAX one program sees the global batch's loss."""
    x = np.random.default_rng(0).normal(size=(64, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    config = kdist.TrainConfig(epochs=2, batch_size_per_replica=8, replicas=2,
                               checkpoint_dir=str(tmp_path), progress=False)

    def model_fn():
        model = OwnLossScaled()
        model(x[:2])  # Built: the step differentiates its variables.
        return model

    run = lambda: kdist.train_and_evaluate(  # noqa: E731
        config, kdist.Dataset(x, y, x, y, "toy"), model_fn=model_fn, log=lambda line: None)
    if keras.backend.backend() == "jax":
        assert len(run().history["loss"]) == 2
        return
    with pytest.raises(kdist.TrainingError, match=(
            "the replicas' variables differ after epoch 1 \\('.*kernel'.*\\): the step "
            "changes the averaged gradients with what differs between")):
        run()
    assert os.listdir(tmp_path) == []  # No checkpoint of either replica's model.


def test_a_compiled_loss_that_is_not_one_number_is_one_clear_error():
    model, x, labels = one_hot_model()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none"))
    with pytest.raises(kdist.UsageError, match="compiled loss is one value per example, not "
                                               "one number: give its losses a reduction"):
        evaluate(model, (x, labels, None))
    model.compile(optimizer="sgd", loss=PerClass(reduction=None))
    with pytest.raises(kdist.UsageError, match=r"compiled loss has shape \(10,\), not one"):
        evaluate(model, (x, labels, None))


class PerClass(keras.losses.Loss):
    """One value per class: the batch's summed predictions."""

    def call(self, y_true, y_pred):
        return ops.sum(y_pred, axis=0)


class CriticLoop(keras.Model):
    """Three critic updates per step, each on fresh `kdist.random` draws, then one
    generator update: each update reads the weights the one before it wrote."""

    def __init__(self):
        super().__init__()
        self.critic = keras.Sequential([keras.Input((8,)),
                                        keras.layers.Dense(16, activation="tanh"),
                                        keras.layers.Dense(1)])
        self.generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
        self.critic_optimizer = keras.optimizers.SGD(0.05)
        self.generator_optimizer = keras.optimizers.SGD(0.05)

    def train_step(self, data):
        real, _ = data
        rows = ops.shape(real)[0]
        critic = self.critic.trainable_variables
        logs = {}
        for i in range(3):
            fake = self.generator(kdist.random.normal((rows, 4)))
            weight = kdist.random.uniform((rows, 1))
            logs[f"critic_{i}"], grads = kdist.value_and_grad(
                lambda fake=fake, weight=weight: (ops.mean(self.critic(fake) * weight)
                                                  - ops.mean(self.critic(real))),
                critic)
            self.critic_optimizer.apply(grads, critic)
        z = kdist.random.normal((rows, 4))
        logs["generator"], grads = kdist.value_and_grad(
            lambda: -ops.mean(self.critic(self.generator(z))),
            self.generator.trainable_variables)
        self.generator_optimizer.apply(grads, self.generator.trainable_variables)
        return logs

    def test_step(self, data):
        return {"critic_0": ops.mean(self.critic(data[0]))}


def test_each_update_in_a_step_reads_the_weights_the_update_before_it_wrote(tmp_path):
    """On TensorFlow with 2 replicas, grappler's dependency optimizer let a read run
    before the update ahead of it, in about half the runs (kdist turns it off for
    its functions): three runs of 2 replicas must each train as 1 replica does."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    data = kdist.Dataset(x, np.zeros(64, np.int32), x[:16], np.zeros(16, np.int32), "toy")

    def model_fn():
        keras.utils.set_random_seed(0)
        return CriticLoop()

    histories = [kdist.train_and_evaluate(
        kdist.TrainConfig(epochs=1, batch_size_per_replica=16 // replicas, replicas=replicas,
                          steps_per_execution=2, checkpoint_dir=str(tmp_path / str(run)),
                          progress=False, seed=1),
        data, model_fn=model_fn, log=lambda line: None).history
        for run, replicas in enumerate([1, 2, 2, 2])]
    for history in histories[1:]:
        for key in ("critic_1", "critic_2", "generator"):
            np.testing.assert_allclose(history[key], histories[0][key], rtol=1e-5, err_msg=key)


class BuildsAtFirstCall(DenseThree):
    """An own step whose model makes its weights at its first call (no `Input`, as a
    subclassed model or a `Sequential` without one)."""

    def train_step(self, data):
        x, y = data

        def loss_fn():
            return ops.mean(keras.losses.sparse_categorical_crossentropy(
                y, self(x, training=True), from_logits=True))

        loss, grads = kdist.value_and_grad(loss_fn, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


class FirstWeights(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.weights = [np.array(w) for w in self.model.get_weights()]


def test_an_own_step_whose_model_builds_at_its_first_call_is_built_as_fit_builds_it(tmp_path):
    """`fit` builds such a model by a symbolic call before its first step (kdist
    refused it: "value_and_grad with respect to nothing"). An epoch on SEVERAL
    replicas equals SGD on the softmax's gradient written in NumPy, from the
    weights the run began with, over kdist's batches."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype(np.float32)
    y = rng.integers(0, 3, 64).astype(np.int32)

    def model_fn():
        model = BuildsAtFirstCall()
        model.compile(optimizer=keras.optimizers.SGD(0.5))
        return model

    first = FirstWeights()
    config = kdist.TrainConfig(epochs=1, batch_size_per_replica=16 // SEVERAL,
                               replicas=SEVERAL, seed=3, checkpoint_dir=str(tmp_path),
                               progress=False)
    result = kdist.train_and_evaluate(config, kdist.Dataset(x, y, x, y, "toy"),
                                      model_fn=model_fn, callbacks=[first],
                                      log=lambda line: None)
    kernel, bias = first.weights
    for rows in arrays.epoch_order(len(x), 3, 0).reshape(-1, 16):
        logits = x[rows] @ kernel + bias
        gradient = np.exp(logits - logits.max(1, keepdims=True))
        gradient /= gradient.sum(1, keepdims=True)
        gradient[np.arange(16), y[rows]] -= 1  # d(mean cross-entropy)/d(logits), x16.
        gradient /= 16
        kernel, bias = kernel - 0.5 * x[rows].T @ gradient, bias - 0.5 * gradient.sum(0)
    for ours, theirs in zip(result.model.get_weights(), (kernel, bias), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


class NoisyEvaluation(keras.Model):
    """A test step that adds `kdist.random` noise to its inputs."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)
        self.dense.build((None, 4))
        self.opt = keras.optimizers.SGD(0.1)

    def train_step(self, data):
        x, y = data

        def loss_fn():
            return ops.mean(keras.losses.sparse_categorical_crossentropy(
                y, self.dense(x), from_logits=True))

        loss, grads = kdist.value_and_grad(loss_fn, self.dense.trainable_variables)
        self.opt.apply(grads, self.dense.trainable_variables)
        return {"loss": loss}

    def test_step(self, data):
        x, y = data
        noisy = self.dense(x + kdist.random.normal(ops.shape(x)))
        return {"loss": ops.mean(keras.losses.sparse_categorical_crossentropy(
            y, noisy, from_logits=True))}


def test_evaluate_checkpoint_draws_a_test_steps_numbers_as_the_run_did(tmp_path):
    """The draws are cut per evaluation batch: by default `evaluate_checkpoint`
    evaluates in the global batch of the run that wrote the checkpoint (it used
    64, and reported another figure than the run's restored evaluation)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    dataset = kdist.Dataset(x[:192], y[:192], x[192:], y[192:], "toy")
    config = kdist.TrainConfig(epochs=1, batch_size_per_replica=16 // SEVERAL,
                               replicas=SEVERAL, seed=0, checkpoint_dir=str(tmp_path),
                               progress=False)
    result = kdist.train_and_evaluate(config, dataset, model_fn=NoisyEvaluation,
                                      log=lambda line: None)
    path, figure = result.restored["checkpoint"], result.restored["test_loss"]
    again = kdist.evaluate_checkpoint(path, dataset, model_fn=NoisyEvaluation)
    assert again["test_loss"] == pytest.approx(figure, rel=1e-6)
    other = kdist.evaluate_checkpoint(path, dataset, model_fn=NoisyEvaluation, batch_size=64)
    assert abs(other["test_loss"] - figure) > 1e-3  # Other batches, other draws.


class Sampling(keras.layers.Layer):
    """The Keras VAE example's layer, drawing with `kdist.random`."""

    def call(self, inputs):
        mean, log_var = inputs
        return mean + ops.exp(0.5 * log_var) * kdist.random.normal(ops.shape(mean))


class FunctionalVAE(keras.Model):
    """An encoder built on `keras.Input`, as the Keras VAE example builds it."""

    def __init__(self):
        super().__init__()
        x = keras.Input((4,))
        mean, log_var = keras.layers.Dense(2)(x), keras.layers.Dense(2)(x)
        self.encoder = keras.Model(x, [mean, log_var, Sampling()([mean, log_var])])
        self.decoder = keras.layers.Dense(4)
        self.decoder.build((None, 2))
        self.opt = keras.optimizers.SGD(0.1)

    def loss_of(self, x):
        mean, log_var, z = self.encoder(x)
        kl = -0.5 * ops.sum(1 + log_var - ops.square(mean) - ops.exp(log_var), axis=1)
        return ops.mean(ops.mean(ops.square(self.decoder(z) - x), axis=1) + kl)

    def train_step(self, data):
        variables = self.encoder.trainable_variables + self.decoder.trainable_variables
        loss, grads = kdist.value_and_grad(lambda: self.loss_of(data[0]), variables)
        self.opt.apply(grads, variables)
        return {"loss": loss}

    def test_step(self, data):
        return {"loss": self.loss_of(data[0])}


def test_a_layer_drawing_with_kdist_random_builds_in_a_functional_model(tmp_path):
    # Keras calls the layer outside any step to infer its output shape while the
    # functional encoder is built: kdist.random raised there (a 47-line traceback).
    x = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
    dataset = kdist.Dataset(x[:64], x[:64, 0], x[64:], x[64:, 0], "toy")
    runs = []
    for replicas in sorted({1, SEVERAL}):
        config = kdist.TrainConfig(epochs=2, batch_size_per_replica=16 // replicas,
                                   replicas=replicas, seed=0, progress=False,
                                   checkpoint_dir=str(tmp_path / str(replicas)))
        runs.append(kdist.train_and_evaluate(config, dataset, model_fn=FunctionalVAE,
                                             log=lambda line: None))
    assert runs[0].history["loss"][1] < runs[0].history["loss"][0]
    for ours, theirs in zip(runs[0].model.get_weights(), runs[-1].model.get_weights(),
                            strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


class SumPenalties(keras.Model):
    """Keras losses with reduction="sum" over a kernel (a weight penalty) and, inside
    a `value_and_grad` with respect to the inputs, over the batch (a gradient
    penalty: each example's gradient is its own)."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)
        self.dense.build((None, 4))
        self.opt = keras.optimizers.SGD(0.1)
        self.summed = keras.losses.MeanSquaredError(reduction="sum")

    def train_step(self, data):
        x, y = data

        def loss_fn():
            def outputs(inputs):
                return self.summed(ops.zeros((ops.shape(inputs)[0], 2)), self.dense(inputs))

            slopes = kdist.grad(outputs, x)
            gradient_penalty = ops.mean(ops.sum(ops.square(slopes), axis=1))
            weight_penalty = self.summed(ops.zeros(self.dense.kernel.shape), self.dense.kernel)
            loss = ops.mean(keras.losses.sparse_categorical_crossentropy(
                y, self.dense(x), from_logits=True))
            return loss + gradient_penalty + weight_penalty, (gradient_penalty, weight_penalty)

        (loss, (gradient, weight)), grads = kdist.value_and_grad(
            loss_fn, self.dense.trainable_variables)
        self.opt.apply(grads, self.dense.trainable_variables)
        return {"loss": loss, "gradient_penalty": gradient, "weight_penalty": weight}


def test_keras_sums_over_a_kernel_or_inside_an_input_gradient_train_as_on_one_replica(tmp_path):
    """Only a sum over the replica's rows stands for its share of the global
    batch's sum. On TensorFlow's 2 replicas (torch's processes alike) the weight
    penalty was doubled and the gradient penalty quadrupled: this run diverged."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    runs = []
    for replicas in (1, 2):  # On torch, 2 processes.
        config = kdist.TrainConfig(epochs=2, batch_size_per_replica=16 // replicas,
                                   replicas=replicas, seed=0, progress=False,
                                   checkpoint_dir=str(tmp_path / str(replicas)))
        keras.utils.set_random_seed(0)
        runs.append(kdist.train_and_evaluate(config, kdist.Dataset(x, y, x, y, "toy"),
                                             model_fn=SumPenalties, log=lambda line: None))
    one, several = runs
    for name in ("loss", "gradient_penalty", "weight_penalty"):
        assert several.history[name] == pytest.approx(one.history[name], rel=1e-5), name
    for ours, theirs in zip(several.model.get_weights(), one.model.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@ops.custom_gradient
def clipped_upstream(x):
    """`x`, its upstream gradient clipped elementwise (what it sees depends on the
    loss's scale, so on how the replicas share the batch)."""
    def grad(*args, upstream=None):
        if upstream is None:
            (upstream,) = args
        return ops.clip(upstream, -0.002, 0.002)
    return x, grad


class ClippedUpstream(keras.Model):
    """A custom gradient inside the loss, and an input differentiated with the
    variables: the gradients inside the loss are one device's at any replica count."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out = keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)
        self.hidden.build((None, 4))
        self.out.build((None, 8))
        self.opt = keras.optimizers.SGD(0.5)

    def train_step(self, data):
        x, y = data
        weights = self.trainable_variables

        def loss_fn(inputs):
            logits = self.out(clipped_upstream(self.hidden(inputs)))
            return ops.mean(keras.losses.sparse_categorical_crossentropy(
                y, logits, from_logits=True))

        loss, grads = kdist.value_and_grad(loss_fn, [x, *weights])
        self.opt.apply(grads[1:], weights)
        return {"loss": loss, "input_gradient": ops.mean(ops.sum(ops.abs(grads[0]), axis=1))}


def test_a_custom_gradient_and_an_inputs_gradient_inside_the_loss_are_one_devices(tmp_path):
    """Each replica differentiated the mean over its own rows: the upstream gradient
    the clip saw, and the input's gradient, were R times one device's (TensorFlow,
    torch: weights 0.07 from 1 replica's after 2 epochs, the input gradient 2x)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(128, 4)).astype(np.float32)
    y = (np.abs(x[:, 0]) * 2).astype(np.int32).clip(0, 2)
    runs = []
    for replicas in (1, 2):  # On torch, 2 processes.
        config = kdist.TrainConfig(epochs=2, batch_size_per_replica=32 // replicas,
                                   replicas=replicas, seed=0, progress=False,
                                   checkpoint_dir=str(tmp_path / str(replicas)))
        keras.utils.set_random_seed(0)
        runs.append(kdist.train_and_evaluate(config, kdist.Dataset(x, y, x, y, "toy"),
                                             model_fn=ClippedUpstream, log=lambda line: None))
    one, several = runs
    assert one.history["loss"][1] < one.history["loss"][0]
    for name in ("loss", "input_gradient"):
        assert several.history[name] == pytest.approx(one.history[name], rel=1e-5), name
    for ours, theirs in zip(several.model.get_weights(), one.model.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


class GuideStep(keras.Model):
    """The Keras guide's first own `train_step`: the compiled loss and metrics, no
    `test_step` of its own (`fit` validates it with Keras' inherited one); without
    a compiled loss, its own mean squared error."""

    def train_step(self, data):
        x, y = data

        def loss_fn():
            y_pred = self(x, training=True)
            return (self.compute_loss(y=y, y_pred=y_pred) if self.loss
                    else ops.mean(ops.square(y_pred - y))), y_pred

        (loss, y_pred), grads = kdist.value_and_grad(loss_fn, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss, "mae": self.compute_metrics(x, y, y_pred)["mae"]}


def guide_model(compiled=True):
    inputs = keras.Input((4,))
    model = GuideStep(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse" if compiled else None,
                  metrics=["mae"])
    return model


def test_an_own_train_step_of_a_compiled_model_is_evaluated_as_fit_validates_it(tmp_path):
    """Its test set is evaluated with the compiled loss and metrics after every
    epoch and restored, as `evaluate` on the same weights; without a compiled
    loss there is nothing to evaluate (`fit` would raise), as without a test_step."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(356, 4)).astype(np.float32)
    y = x @ np.array([[1.0], [2.0], [-1.0], [0.5]], np.float32)
    dataset = kdist.Dataset(x[:256], y[:256], x[256:], y[256:], "toy")
    config = kdist.TrainConfig(epochs=2, batch_size_per_replica=32 // SEVERAL,
                               replicas=SEVERAL, seed=0, checkpoint_dir=str(tmp_path / "a"),
                               progress=False)
    result = kdist.train_and_evaluate(config, dataset, model_fn=guide_model,
                                      log=lambda line: None)
    model = guide_model()
    model.set_weights(result.model.get_weights())
    expected = model.evaluate(x[256:], y[256:], batch_size=100, verbose=0, return_dict=True)
    for name in ("loss", "mae"):
        assert result.history[f"val_{name}"][-1] == pytest.approx(expected[name], rel=1e-5)
        assert result.restored[f"test_{name}"] == pytest.approx(expected[name], rel=1e-5)
    bare = kdist.train_and_evaluate(dataclasses.replace(config, checkpoint_dir=str(
        tmp_path / "b")), dataset, model_fn=lambda: guide_model(compiled=False),
        log=lambda line: None)
    assert bare.restored is None and "val_mae" not in bare.history


class Tracked(keras.Model):
    """The Keras guides' VAE way: a `Mean` tracker's result returned under
    another key ("loss" for the tracker `name`), beside a nested dict that
    repeats the key (`fit` keeps the top-level one); `note` adds a log. An `idle`
    train step leaves the tracker alone and returns the loss under its name."""

    def __init__(self, name="total_loss", nested=True, note=(), idle=False):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.dense.build((None, 4))
        self.opt = keras.optimizers.SGD(0.1)
        self.tracker = keras.metrics.Mean(name=name)
        self.nested, self.note, self.idle = nested, note, idle

    @property
    def metrics(self):
        return [self.tracker]

    def loss_of(self, x, y):
        return ops.mean(ops.square(self.dense(x)[:, 0] - y))

    def train_step(self, data):
        x, y = data
        loss, grads = kdist.value_and_grad(lambda: self.loss_of(x, y),
                                           self.dense.trainable_variables)
        self.opt.apply(grads, self.dense.trainable_variables)
        if self.idle:
            return {"loss": loss, "twice": 2 * loss}
        self.tracker.update_state(loss)
        logs = {"loss": self.tracker.result()}
        if self.nested:
            logs["extra"] = {"loss": 2 * loss}
        return logs if self.note == () else {**logs, "note": self.note}

    def test_step(self, data):
        self.tracker.update_state(self.loss_of(*data))
        return {"loss": self.tracker.result()}


def test_a_trackers_result_under_another_key_is_merged_as_the_tracker(tmp_path):
    """The tracker weighs each test batch alike, as `evaluate` does: 40 test rows in
    batches of 16 end in a batch of 8, which kdist weighed by its rows where the
    key was not the tracker's name (1.2090 against `evaluate`'s 1.2334 for the
    Keras guide's VAE); a nested "loss" won over the top-level one `fit` keeps
    (2x the loss); a string log failed in the backend; a loss returned under the
    name of a tracker the train step leaves alone read the tracker (0.0, where
    `fit` shows the loss)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(104, 4)).astype(np.float32)
    y = (x @ np.arange(1.0, 5.0, dtype=np.float32)).astype(np.float32)
    dataset = kdist.Dataset(x[:64], y[:64], x[64:], y[64:], "toy")
    histories = []
    for i, model_fn in enumerate((Tracked, lambda: Tracked(name="loss", nested=False))):
        config = kdist.TrainConfig(epochs=2, batch_size_per_replica=16, replicas=1, seed=0,
                                   checkpoint_dir=str(tmp_path / str(i)), progress=False)
        result = kdist.train_and_evaluate(config, dataset, model_fn=model_fn,
                                          log=lambda line: None)
        histories.append(result.history)
    assert histories[0] == histories[1]
    kernel, bias = result.model.dense.get_weights()
    batches = [slice(64, 80), slice(80, 96), slice(96, 104)]
    by_batch = [np.mean(np.square(x[s] @ kernel[:, 0] + bias[0] - y[s])) for s in batches]
    assert histories[0]["val_loss"][-1] == pytest.approx(np.mean(by_batch), rel=1e-5)
    assert abs(np.mean(by_batch) - np.mean(np.square(x[64:] @ kernel[:, 0] + bias[0]
                                                     - y[64:]))) > 1e-3  # Not per example.
    config = dataclasses.replace(config, checkpoint_dir=str(tmp_path / "idle"))
    idle = kdist.train_and_evaluate(config, dataset, log=lambda line: None,
                                    model_fn=lambda: Tracked(name="loss", idle=True)).history
    assert idle["loss"][0] > 1 and idle["twice"] == pytest.approx(
        [2 * loss for loss in idle["loss"]], rel=1e-6)  # The steps' mean loss.
    config = dataclasses.replace(config, checkpoint_dir=str(tmp_path / "note"))
    with pytest.raises(kdist.UsageError, match="returns 'note', a str; return scalars"):
        kdist.train_and_evaluate(config, dataset, model_fn=lambda: Tracked(note="hello"),
                                 log=lambda line: None)
    with pytest.raises(kdist.UsageError, match="returns 'note' as None; return scalars"):
        kdist.train_and_evaluate(config, dataset, model_fn=lambda: Tracked(note=None),
                                 log=lambda line: None)


class PenaltyAsWritten(Tracked):
    """WGAN-GP's gradient penalty as Keras' example writes it: the critic's
    output, one value per row, differentiated with respect to its input."""

    def train_step(self, data):
        x, _ = data
        kdist.grad(lambda t: self.dense(t), x)
        return {"loss": 0.0}


def test_a_loss_of_several_values_is_refused_naming_the_tapes_sum(tmp_path):
    # The message suggested keras.ops.mean alone; for a gradient penalty, which
    # differentiates a (rows, 1) output as tf.GradientTape does (its sum), the
    # mean trains 1 replica 0.34 away from the tape and 2 replicas away from 1.
    x = np.ones((32, 4), np.float32)
    dataset = kdist.Dataset(x, x[:, 0], x, x[:, 0], "toy")
    config = kdist.TrainConfig(epochs=1, batch_size_per_replica=16, replicas=1, seed=0,
                               checkpoint_dir=str(tmp_path), progress=False)
    with pytest.raises(kdist.UsageError, match=r"kdist.grad returns a loss of shape \(\d+, 1\); "
                                               r"return a scalar.*keras.ops.sum of it is what "
                                               r"tf.GradientTape differentiates"):
        kdist.train_and_evaluate(config, dataset, model_fn=PenaltyAsWritten,
                                 log=lambda line: None)


class WholeBatch(keras.Model):
    """A step over every example of the global batch (`kdist.global_batch`): each
    replica's rows against the whole batch's (their log-sum-exp), a term of the
    whole batch alone, and a MoCo-style queue of every replica's rows with an
    integer pointer the step moves by the global batch's rows."""

    def __init__(self):
        super().__init__()
        self.encoder = keras.layers.Dense(3)
        self.encoder.build((None, 4))
        self.opt = keras.optimizers.SGD(0.5)
        self.queue = self.add_weight(shape=(12, 3), initializer="zeros", trainable=False,
                                     name="queue")
        self.pointer = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                       trainable=False, name="pointer")

    def train_step(self, data):
        x, _ = data

        def loss_fn():
            z = self.encoder(x)
            every = kdist.global_batch(z)
            own = ops.mean(ops.logsumexp(ops.matmul(z, ops.transpose(every)), axis=1))
            return own + 0.1 * ops.mean(ops.square(every)), every

        (loss, every), grads = kdist.value_and_grad(loss_fn, self.encoder.trainable_variables)
        self.opt.apply(grads, self.encoder.trainable_variables)
        self.queue.assign(ops.concatenate([ops.stop_gradient(every), self.queue], 0)[:12])
        self.pointer.assign((self.pointer + ops.shape(every)[0]) % 12)
        return {"loss": loss}


def test_a_step_over_the_whole_global_batch_trains_as_one_device(tmp_path):
    """Without a gather, a replica's negatives and queue held its share's rows
    only (library.md: the mean of the replicas' rows, its pointer moved by a
    share); with `kdist.global_batch`, 2 replicas end where 1 does."""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    dataset = kdist.Dataset(x, np.zeros(64, np.float32), x[:16], np.zeros(16, np.float32),
                            "toy")
    ends = []
    for replicas in (1, 2):  # On torch, 2 processes.
        config = kdist.TrainConfig(epochs=2, batch_size_per_replica=16 // replicas,
                                   replicas=replicas, seed=0, progress=False,
                                   checkpoint_dir=str(tmp_path / str(replicas)))
        result = kdist.train_and_evaluate(config, dataset, model_fn=WholeBatch,
                                          log=lambda line: None)
        model = result.model
        ends.append((result.history["loss"], [np.array(w) for w in model.get_weights()]))
    (loss_1, weights_1), (loss_n, weights_n) = ends
    np.testing.assert_allclose(loss_n, loss_1, rtol=1e-5)
    assert [w.shape for w in weights_n] == [w.shape for w in weights_1]
    for one, several in zip(weights_1, weights_n):
        np.testing.assert_allclose(several, one, rtol=1e-5, atol=1e-6)
    assert int(result.model.pointer.numpy()) == (8 * 16) % 12


class GatherWrongRows(WholeBatch):
    """`kdist.global_batch` of a tensor that has no row per example of the batch."""

    def train_step(self, data):
        kdist.global_batch(self.encoder.kernel.value)
        return super().train_step(data)


def test_global_batch_refuses_what_has_no_row_per_example_and_works_only_in_a_step(tmp_path):
    x = np.zeros((64, 4), np.float32)
    config = kdist.TrainConfig(epochs=1, batch_size_per_replica=16, replicas=1,
                               checkpoint_dir=str(tmp_path), progress=False)
    with pytest.raises(kdist.UsageError, match=r"^kdist.global_batch takes a row per example "
                       r"of the step's batch \(2 rows\); got a tensor of shape \(4, 3\)"):
        kdist.train_and_evaluate(config, kdist.Dataset(x, x[:, 0], x, x[:, 0], "toy"),
                                 model_fn=GatherWrongRows, log=lambda line: None)
    assert not os.listdir(tmp_path)  # Refused by the building run: nothing written.
    with pytest.raises(kdist.UsageError):
        kdist.global_batch(x)


class LossAfterUpdate(keras.Model):
    """Logs a Keras loss object's value after the optimizer's `apply`, outside
    `kdist.value_and_grad`, with sample weights and without."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.dense.build((None, 4))
        self.opt = keras.optimizers.SGD(0.1)
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def train_step(self, data):
        x, y, weights = data
        variables = self.dense.trainable_variables
        _, grads = kdist.value_and_grad(lambda: self.bce(y[:, None], self.dense(x)), variables)
        self.opt.apply(grads, variables)
        return {"after": self.bce(y[:, None], self.dense(x)),
                "weighted": self.bce(y[:, None], self.dense(x), sample_weight=weights)}


@pytest.mark.skipif(keras.backend.backend() == "torch", reason="torch's replicas are processes")
def test_a_loss_logged_after_the_update_reads_alike_on_every_replica_thread(tmp_path):
    """TensorFlow runs each replica's step on its own thread: a replica that left
    the step first put Keras' reductions back while the other still traced its
    last lines (0.5969 logged where 1 replica logs 0.8064), and the other then put
    kdist's back for good (a later `fit` under MirroredStrategy trained 2x)."""
    from keras.src.losses import loss as loss_module

    keras_functions = [getattr(loss_module, name) for name in (
        "reduce_values", "scale_loss_for_distribution")] + [loss_module.Loss.__call__]
    rng = np.random.default_rng(7)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.float32)
    weights = rng.uniform(0.2, 2.0, 64).astype(np.float32)
    histories = []
    for replicas in (1, 2):
        config = kdist.TrainConfig(epochs=1, batch_size_per_replica=32 // replicas,
                                   replicas=replicas, seed=0, progress=False,
                                   checkpoint_dir=str(tmp_path / str(replicas)))
        histories.append(kdist.train_and_evaluate(
            config, kdist.Dataset(x, y, x[:8], y[:8], "toy", train_sample_weight=weights),
            model_fn=LossAfterUpdate, log=lambda line: None).history)
        assert keras_functions == [getattr(loss_module, name) for name in (
            "reduce_values", "scale_loss_for_distribution")] + [loss_module.Loss.__call__]
    for key in ("after", "weighted"):
        assert histories[1][key] == pytest.approx(histories[0][key], rel=1e-5), key


class _Made:
    """An object of a Python class: making one allocates while the caller is at its call."""


@pytest.mark.any_backend
def test_the_watch_over_a_step_ignores_what_pythons_collector_calls():
    # JAX's gc callback (every backend imports JAX), run by the collector from the
    # step's frame, was taken for the step's call: a correct step was refused.
    fake = types.FunctionType((lambda phase, info: None).__code__, {"__name__": "jax._src.lib"})
    threshold = gc.get_threshold()
    gc.callbacks.append(fake)
    gc.set_threshold(1)  # The collector runs at nearly every call.
    try:
        with portable.watching() as found:
            kept = [_Made() for _ in range(2000)]  # Alive: the collector's count grows.
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(fake)
    assert found == [] and len(kept) == 2000
