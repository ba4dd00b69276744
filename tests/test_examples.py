"""The steps of `examples/`, written once with kdist's primitives, on this backend:
2 replicas train to the weights of 1, a resumed run to those of an uninterrupted
one, and the mistakes a step can make end in one clear error.

(The backends against each other: `test_cross_backend.py`.)
"""

import os

import keras
import numpy as np
import pytest
from example_steps import (
    EXAMPLES,
    LEARNING_RATE,
    assert_same,
    config,
    dataset,
    fixed,
    load,
    train,
    weights,
)
from helpers import SEVERAL

import kdist
from kdist.errors import Interrupted, UsageError


@pytest.mark.parametrize("name", EXAMPLES)
def test_two_replicas_train_to_the_weights_of_one(tmp_path, name):
    one, one_path = train(name, 1, tmp_path / "one")
    two, two_path = train(name, 2, tmp_path / "two")
    assert_same(one_path, two_path, 1e-5)
    for key, value in one.epochs[0].items():  # The same epoch line, test included.
        if key.startswith(("train_", "test_")):
            assert two.epochs[0][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


class _StopAfter:
    """A stop request that turns true after `polls` polls (one per chunk of steps)."""

    def __init__(self, polls):
        self.polls = polls

    def __bool__(self):
        self.polls -= 1
        return self.polls < 0


def test_a_gan_resumed_mid_epoch_ends_where_the_uninterrupted_run_ends(tmp_path):
    # torch's replica processes get this process's request every 50 ms, not at each
    # chunk, so _StopAfter's count means other steps there: one replica, in this process.
    replicas = 1 if keras.backend.backend() == "torch" else 2
    _, whole = train("dcgan", replicas, tmp_path / "whole")
    with pytest.raises(Interrupted):
        train("dcgan", replicas, tmp_path / "parts", stop=_StopAfter(1))
    _, resumed = train("dcgan", replicas, tmp_path / "parts")
    assert_same(whole, resumed, 1e-6)


def test_the_tutorial_step_of_your_own_equals_the_built_in_step(tmp_path):
    _, own = train("tutorial_step", 2, tmp_path / "own")
    kdist.train_and_evaluate(config(tmp_path / "built_in", 2, learning_rate=LEARNING_RATE),
                             dataset(), model_fn=lambda: fixed(kdist.create_model()),
                             optimizer_fn=kdist.OPTIMIZERS["sgd"], log=lambda line: None)
    built_in = kdist.latest_checkpoint(str(tmp_path / "built_in"))
    mine = {k[len("cnn/"):]: v for k, v in weights(own).items() if k.startswith("cnn/")}
    theirs = {k: v for k, v in weights(built_in).items() if k.startswith("layers/")}
    assert sorted(mine) == sorted(theirs) and mine
    for key in mine:
        np.testing.assert_allclose(mine[key], theirs[key], rtol=0, atol=1e-6, err_msg=key)


class _Assigns(keras.Model):
    """A step that writes a weight itself."""

    def __init__(self):
        super().__init__()
        self.dense, self.other = keras.layers.Dense(10), keras.layers.Dense(3)
        self.dense.build((None, 784))
        self.other.build((None, 2))

    def train_step(self, data):
        self.dense.kernel.assign(self.dense.kernel * 0.5)
        return {"loss": keras.ops.mean(self.dense(keras.ops.reshape(data[0], (-1, 784))))}


class _WithSGD(_Assigns):
    """A step's model that holds a plain SGD of its own."""

    def __init__(self):
        super().__init__()
        self.sgd = keras.optimizers.SGD(0.1)


class _UnbuiltMetric(_Assigns):
    """A step that updates an F1Score, whose variables Keras makes at its first update."""

    def __init__(self):
        super().__init__()
        self.f1 = keras.metrics.F1Score(average="macro", name="f1")

    def train_step(self, data):
        logits = self.dense(keras.ops.reshape(data[0], (-1, 784)))
        self.f1.update_state(keras.ops.one_hot(data[1], 10), keras.ops.softmax(logits))
        return {"loss": keras.ops.mean(logits), "f1": self.f1.result()}


class _WrongGradient(_Assigns):
    """A step that differentiates a loss with respect to variables it never reads."""

    def train_step(self, data):
        loss, _ = kdist.value_and_grad(
            lambda: keras.ops.mean(self.dense(keras.ops.reshape(data[0], (-1, 784)))),
            self.other.trainable_variables)
        return {"loss": loss}


class _ForwardOutside(_Assigns):
    """A step whose forward pass runs before the loss that is differentiated."""

    def train_step(self, data):
        y_pred = self.dense(keras.ops.reshape(data[0], (-1, 784)))
        loss, _ = kdist.value_and_grad(lambda: keras.ops.mean(y_pred),
                                       self.dense.trainable_variables)
        return {"loss": loss}


class _BackendOp(_Assigns):
    """A step that calls the backend's own framework."""

    def train_step(self, data):
        import importlib

        module, name = {"tensorflow": ("tensorflow", "reduce_mean"), "jax": ("jax.numpy", "mean"),
                        "torch": ("torch", "mean")}[keras.backend.backend()]
        mean = getattr(importlib.import_module(module), name)
        return {"loss": mean(self.dense(keras.ops.reshape(data[0], (-1, 784))))}


class _GuideStep(_WithSGD):
    """The step of Keras' guide "Customizing what happens in fit()" for the backend at
    hand: the backend's own gradients."""

    def train_step(self, data):
        x, variables = keras.ops.reshape(data[0], (-1, 784)), self.dense.trainable_variables
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = keras.ops.mean(self.dense(x))
            grads = tape.gradient(loss, variables)
        elif keras.backend.backend() == "jax":
            import jax

            loss, grads = jax.value_and_grad(lambda values: keras.ops.mean(
                self.dense.stateless_call(values, [], x)[0]))([v.value for v in variables])
        else:
            self.zero_grad()
            loss = keras.ops.mean(self.dense(x))
            loss.backward()
            grads = [v.value.grad for v in variables]
        self.sgd.apply(grads, variables)
        return {"loss": loss}


class _NoGradients(_WithSGD):
    """A step that applies gradients it never took: the torch guide's `.grad`."""

    def train_step(self, data):
        variables = self.dense.trainable_variables
        loss, _ = kdist.value_and_grad(
            lambda: keras.ops.mean(self.dense(keras.ops.reshape(data[0], (-1, 784)))), variables)
        self.sgd.apply([None] * len(variables), variables)
        return {"loss": loss}


class _StatelessStep(_Assigns):
    """The form of step Keras' fit calls on JAX: train_step(state, data)."""

    def train_step(self, state, data):
        return {"loss": keras.ops.mean(data[0])}, state


class _ReturnsVector(_Assigns):
    def train_step(self, data):
        return {"logits": self.dense(keras.ops.reshape(data[0], (-1, 784)))}


class _Unbuilt(keras.Model):
    """A step that reads a layer's variables before anything builds it."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(10)

    def train_step(self, data):
        x = keras.ops.reshape(data[0], (-1, 784))
        loss, grads = kdist.value_and_grad(lambda: keras.ops.mean(self.dense(x)),
                                           self.dense.trainable_variables)
        return {"loss": loss}


class _TwoSubsets(_WithSGD):
    """A step that applies one optimizer to one layer, then to another."""

    def train_step(self, data):
        x = keras.ops.reshape(data[0], (-1, 784))
        for layer in (self.dense, self.other):
            inputs = x if layer is self.dense else x[:, :2]
            loss, grads = kdist.value_and_grad(lambda: keras.ops.mean(layer(inputs)),  # noqa: B023
                                               layer.trainable_variables)
            self.sgd.apply(grads, layer.trainable_variables)
        return {"loss": loss}


class _DrawsByBatchSize(_Assigns):
    def train_step(self, data):
        return {"noise": keras.ops.mean(kdist.random.normal((32, 3)))}  # Not the rows'.


class _InnerOptimizer(_Assigns):
    """A step that unscales by hand and applies a LossScaleOptimizer's inner optimizer."""

    def __init__(self):
        super().__init__()
        self.scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))

    def train_step(self, data):
        variables = self.dense.trainable_variables
        loss, grads = kdist.value_and_grad(lambda: self.scaled.scale_loss(keras.ops.mean(
            self.dense(keras.ops.reshape(data[0], (-1, 784))))), variables)
        unscaled = [g / self.scaled.scale_loss(1.0) for g in grads]
        self.scaled.inner_optimizer.apply(unscaled, variables)
        return {"loss": loss}


@pytest.mark.parametrize("model_class, message", [
    (_Assigns, "assigns '.*kernel' itself"),
    (_UnbuiltMetric, r"metric 'f1' \(F1Score\) has no variables yet .* call its update_state "
                     r"once on zeros of the shapes it takes, then its reset_state\(\)"),
    (_InnerOptimizer, r"applies the inner optimizer \(SGD\) of the model's LossScaleOptimizer"),
    (_WrongGradient, "reads none of the variables"),
    (_ForwardOutside, "reads none of the variables"),  # torch: autograd's RuntimeError.
    (_TwoSubsets, r"applies SGD to '\w+/kernel', which it was not built on"),
    (_Unbuilt, r"kdist.value_and_grad with respect to nothing \(an empty list\): a layer "
               "has variables once it is built"),
    (_DrawsByBatchSize, r"normal\(32, 3\): its first axis must be the rows of the batch the "
                        r"step sees \(2 in the run that builds the step, .* ops.shape\(x\)\[0\]"),
    (_ReturnsVector, "returns 'logits' of shape"),
    (_BackendOp, r"the train_step calls (tensorflow|jax|torch)\S* \(.*test_examples.py:\d+\)"),
    # TensorFlow's tape failed with its own "DistributedVariable.handle is not
    # available outside the replica context", naming no kdist primitive.
    (_GuideStep, r"the train_step calls (tensorflow|jax|torch)\S* \(.*test_examples.py:\d+\); "
                 r".*; take gradients with kdist.value_and_grad and apply them with "
                 r"optimizer.apply$"),
    # Trained nothing, silently (Keras' apply raises "No gradients provided").
    (_NoGradients, r"the step applies SGD with no gradient for any of its 2 variables \(each "
                   r"is None\): take them with kdist.value_and_grad"),
    (_StatelessStep, r"_StatelessStep.train_step takes \(state, data\); kdist calls "
                     r"train_step\(data\) on every backend"),  # Was Python's TypeError.
])
def test_a_step_that_breaks_a_rule_is_one_clear_error(tmp_path, model_class, message):
    from keras.src.backend.common.name_scope import current_path

    with pytest.raises(UsageError, match=message):
        kdist.train_and_evaluate(config(tmp_path, 1), dataset(), model_fn=model_class,
                                 log=lambda line: None)
    # On TensorFlow the symbolic call that builds the model as fit does (these
    # models have no call) left its name scope open: later variables were named in it.
    assert current_path() == ""


class _FrameworkLayer(keras.Model):
    """An own step through Keras' layer for the backend's own code: `JaxLayer` (a
    function of `jax.numpy`) on JAX, `TorchModuleWrapper` (a module calling
    `torch.tanh`) on torch."""

    def __init__(self):
        super().__init__()
        kernel = np.random.default_rng(1).normal(size=(4, 6)).astype(np.float32) * 0.5
        if keras.backend.backend() == "jax":
            import jax.numpy as jnp

            self.hidden = keras.layers.JaxLayer(
                call_fn=lambda params, inputs: jnp.tanh(inputs @ params["kernel"]),
                init_fn=lambda rng, inputs: {"kernel": jnp.asarray(kernel)})
        else:
            import torch

            class Tanh(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.kernel = torch.nn.Parameter(torch.tensor(kernel))

                def forward(self, inputs):
                    return torch.tanh(inputs @ self.kernel)

            self.hidden = keras.layers.TorchModuleWrapper(Tanh())
        self.hidden.build((None, 4))
        self.out = keras.layers.Dense(2)
        self.out.build((None, 6))
        self.sgd = keras.optimizers.SGD(0.5)

    def train_step(self, data):
        x, y = data
        loss, grads = kdist.value_and_grad(lambda: keras.ops.mean(
            keras.losses.sparse_categorical_crossentropy(y, self.out(self.hidden(x)),
                                                         from_logits=True)),
            self.trainable_variables)
        self.sgd.apply(grads, self.trainable_variables)
        return {"loss": loss}


@pytest.mark.skipif(keras.backend.backend() == "tensorflow",
                    reason="Keras' layers for a framework's code: JAX's and torch's")
def test_keras_layers_for_the_backends_own_code_train_in_a_step_of_your_own(tmp_path):
    """Its framework calls were refused as the step's ("the train_step calls
    jax._src.pjit...; write a step with keras, keras.ops ..."), though `fit` trains it."""
    if keras.backend.backend() == "jax":  # Keras 3.15's JaxLayer builds through TensorFlow.
        pytest.importorskip("tensorflow")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    data = kdist.Dataset(x, (x[:, 0] > 0).astype(np.int32), x[:16], np.zeros(16, np.int32),
                         "toy")
    ends = []
    for replicas in (1, 2):  # On torch, 2 processes.
        run = kdist.train_and_evaluate(
            kdist.TrainConfig(epochs=2, batch_size_per_replica=16 // replicas,
                              replicas=replicas, seed=0, progress=False,
                              checkpoint_dir=str(tmp_path / str(replicas))),
            data, model_fn=_FrameworkLayer, log=lambda line: None)
        ends.append((run.history["loss"], run.model.get_weights()))
    (loss_1, weights_1), (loss_2, weights_2) = ends
    assert loss_1[1] < loss_1[0]
    np.testing.assert_allclose(loss_2, loss_1, rtol=1e-5)
    for one, two in zip(weights_1, weights_2, strict=True):
        np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-6)


def test_the_primitives_outside_a_kdist_step_say_where_they_work():
    with pytest.raises(UsageError, match="inside a train_step or test_step that kdist runs"):
        kdist.random.normal((2, 3))


class _Scaled(_Assigns):
    """A step of your own with dynamic loss scaling: its loss, about 1e5 (a kernel of
    ones sums 784 pixels of about 0.5, squared), overflows float32 once scaled by 2**127."""

    def __init__(self):
        super().__init__()
        self.dense.kernel.assign(np.ones(self.dense.kernel.shape, np.float32))
        self.opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01),
                                                       initial_scale=2.0 ** 127)

    def train_step(self, data):
        x = keras.ops.reshape(data[0], (-1, 784))

        def loss():
            value = keras.ops.mean(keras.ops.square(self.dense(x)))
            return self.opt.scale_loss(value), value

        (_, value), grads = kdist.value_and_grad(loss, self.dense.trainable_variables)
        self.opt.apply(grads, self.dense.trainable_variables)
        return {"loss": value}


def test_a_step_of_your_own_scales_its_loss_through_the_optimizer_and_counts_skips(tmp_path):
    result = kdist.train_and_evaluate(config(tmp_path, 1), dataset(), model_fn=_Scaled,
                                      log=lambda line: None)
    # Each scaled step overflows: skipped, counted, and the scale halved; nothing applied.
    record = result.epochs[0]
    assert record["skipped_steps"] == 3 and np.isfinite(record["train_loss"])
    model = _Scaled()
    model.opt.build(model.dense.trainable_variables)
    model.built = True
    model.load_weights(kdist.latest_checkpoint(str(tmp_path)))
    assert float(model.opt.dynamic_scale) == 2.0 ** 124
    assert np.all(keras.ops.convert_to_numpy(model.dense.kernel) == 1.0)


def test_kdist_evaluate_restores_a_step_of_your_own_from_its_file(tmp_path, capsys):
    from example_steps import REPO

    from kdist.cli import evaluate

    _, path = train("dcgan", 1, tmp_path / "gan")
    status = evaluate.main(["--checkpoint-dir", os.path.dirname(path), "--synthetic", "240",
                            "--model", os.path.join(REPO, "examples", "dcgan.py")])
    out = capsys.readouterr().out
    assert status == 0 and f"{path}: Test d_loss: " in out and ", Test g_loss: " in out, out


MINE_PARTS = """import keras

def classifier():
    return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                             keras.layers.Dense(10)])
"""

MINE = """import keras
from kdist_test_mine_parts import classifier  # A module beside the file.

def model():
    model = classifier()
    model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
"""


def test_kdist_train_and_evaluate_take_your_compiled_model_from_a_file(tmp_path, capsys,
                                                                        monkeypatch):
    """`kdist-train --model mine.py` trains the file's compiled model (its optimizer,
    loss and metrics; built by a module beside the file, as `python mine.py` would
    import it) with the CLI's flags and checkpoints; `kdist-evaluate --model
    mine.py` (or `mine:model`, the module's function) restores it with the same
    accuracy."""
    from kdist.cli import evaluate
    from kdist.cli import train as train_cli

    path, folder = tmp_path / "mine.py", str(tmp_path / "ckpt")
    path.write_text(MINE)
    (tmp_path / "kdist_test_mine_parts.py").write_text(MINE_PARTS)
    common = ["--synthetic", "1200", "--checkpoint-dir", folder, "--model", str(path)]
    assert train_cli.main([*common, "--epochs", "1", "--steps-per-epoch", "6", "--quiet",
                           "--replicas", str(SEVERAL)]) == 0
    trained = capsys.readouterr().out
    assert "Saved checkpoint" in trained and "Test Accuracy: " in trained
    restored = trained.split("without distribution: ")[-1].strip()
    assert evaluate.main(common[:-2] + ["--model", str(path)]) == 0
    assert capsys.readouterr().out.strip().endswith(restored)
    monkeypatch.chdir(tmp_path)  # MODULE:FN, importable from the current folder.
    assert evaluate.main(common[:-2] + ["--model", "mine:model"]) == 0
    assert capsys.readouterr().out.strip().endswith(restored)


@pytest.mark.parametrize("command", ["train", "evaluate"])
@pytest.mark.parametrize("text, spec, message", [
    (None, "{path}", "no such file"),
    ("def model(:\n", "{path}", "does not run: SyntaxError"),
    ("x = 1\n", "{path}", "defines no function model()"),
    ("def model():\n    pass\n", "{path}:build", "defines no function build()"),
    ("def model(size):\n    pass\n", "{path}", "calls model() with no arguments"),
    (None, "kdist_no_such_module:build", "no such file, nor a module Python can import"),
    # A model where the function goes: Keras' "missing a required argument: 'inputs'".
    ("import keras\nbuild = keras.Sequential([keras.Input((784,)), keras.layers.Dense(10)])\n",
     "{path}:build", "build is a model, not a function: define build() that builds"),
])
def test_model_file_mistakes_are_one_line(tmp_path, capsys, command, text, spec, message):
    from kdist.cli import evaluate
    from kdist.cli import train as train_cli

    path = tmp_path / "mine.py"
    if text is not None:
        path.write_text(text)
    (tmp_path / "ckpt").mkdir()
    main = train_cli.main if command == "train" else evaluate.main
    with pytest.raises(SystemExit) as exit_:
        main(["--checkpoint-dir", str(tmp_path / "ckpt"), "--synthetic", "240",
              "--model", spec.format(path=path)])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("text, message", [
    ("def model():\n    pass\n", "model() returned NoneType, not a Keras model"),
    ("import keras\ndef model():\n    return keras.Sequential([keras.Input((28, 28, 1)), "
     "keras.layers.Flatten(), keras.layers.Dense(10)])\n", "returned a model that is not compiled"),
])
def test_a_model_file_whose_function_builds_no_compiled_model_is_one_line(tmp_path, capsys, text,
                                                                          message):
    """An uncompiled model would be compiled with kdist's defaults, not the flags'."""
    from kdist.cli import train as train_cli

    path = tmp_path / "mine.py"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        train_cli.main(["--checkpoint-dir", str(tmp_path / "ckpt"), "--synthetic", "240",
                        "--epochs", "1", "--batch-size-per-replica", "8", "--model", str(path)])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("build, problem", [
    ("keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Flatten(), keras.layers.Dense(10)])",
     "expected axis -1 of input shape to have value 3072"),
    ("keras.Model(inputs := keras.Input((32, 32, 3)), keras.layers.Dense(10)(keras.layers.Flatten()"
     "(inputs)))", "expected shape=(None, 32, 32, 3)"),
])
def test_a_model_built_for_other_inputs_is_one_line_naming_the_datas(tmp_path, capsys, build,
                                                                     problem):
    """Keras' ValueError was a 54-line traceback; the refusal then printed the usage."""
    from kdist.cli import train as train_cli

    path = tmp_path / "mine.py"
    path.write_text(f"import keras\ndef model():\n    m = {build}\n    m.compile(optimizer='sgd', "
                    "loss='sparse_categorical_crossentropy')\n    return m\n")
    with pytest.raises(SystemExit) as exit_:
        train_cli.main(["--checkpoint-dir", str(tmp_path / "ckpt"), "--synthetic", "240",
                        "--epochs", "1", "--batch-size-per-replica", "8", "--model", str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].split(": error: ")[1].startswith(
        "the model does not take the data's inputs (float32 (None, 28, 28, 1)): Input 0 with "
        "name ") and problem in err.splitlines()[-1]
    assert "usage:" not in err and "Traceback" not in err


def test_a_teacher_path_without_a_checkpoint_is_one_line_before_training(tmp_path, capsys):
    # A missing file was a 59-line h5py traceback after the frameworks built the model;
    # a folder of checkpoints, Keras' "File format not supported".
    (tmp_path / "notes.txt").write_text("not a checkpoint")  # Keras' ValueError before.
    for path, problem in ((tmp_path / "nothere.h5", "no such file, nor a folder with a kdist "
                           "checkpoint"), (tmp_path, "no such file, nor a folder with a kdist "
                           "checkpoint"), (tmp_path / "notes.txt", "not a kdist checkpoint")):
        with pytest.raises(SystemExit) as exit_:
            load("distillation").main(["--teacher", str(path), "--synthetic", "600",
                                       "--checkpoint-dir", str(tmp_path / "student")])
        assert exit_.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].endswith(
            f"error: --teacher {path}: {problem}")
    assert not (tmp_path / "student").exists()


@pytest.mark.parametrize("name, flag", [("dcgan", "--grid PNG"),
                                        ("distillation", "--teacher CKPT")])
def test_an_examples_help_shows_its_own_flags_and_its_commands_as_written(name, flag, capsys):
    """`distillation.py --help` printed kdist-train's help (the tutorial CNN's text,
    no --teacher); `dcgan.py --help` had no --grid; argparse ran the docstring's
    command lines together."""
    with pytest.raises(SystemExit) as exit_:
        load(name).main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert flag in text and "--checkpoint-dir" in text and "tutorial CNN on Fashion" not in text
    assert f"\n    KERAS_BACKEND=jax python examples/{name}.py --synthetic 1200" in text
