"""Trains each example of `examples/` for a few steps with kdist, from fixed weights.

The example tests compare the checkpoints this writes: N replicas against
one (`tests/test_examples.py`) and one backend against another
(`test_cross_backend.py`, which runs this file as a script on each backend:
`python tests/example_steps.py train OUT REPLICAS`). Every trainable weight starts
from NumPy draws and every optimizer is plain SGD (Adam's normalised step
would hide a wrong gradient scale); the data, the batches and the examples'
`kdist.random` draws are the same on every backend and replica count.
"""

import importlib.util
import json
import os
import sys

import cloudpickle
import h5py
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = ("dcgan", "wgan_gp", "distillation", "tutorial_step", "clipped_gradients")
STEPS, GLOBAL_BATCH = 3, 16
# Small enough that a GAN's steps do not amplify rounding: at 0.05 the WGAN-GP critic
# moves so far per step that float32 rounding grows to 2e-3 in 3 steps.
LEARNING_RATE = 0.01
SEED = 1  # The runs' seed: their test steps' kdist.random draws come from it.


def load(name):
    """The module of examples/NAME.py; pickled by value into torch's replica processes."""
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", os.path.join(REPO, "examples", f"{name}.py"))
    if spec.name in sys.modules:
        return sys.modules[spec.name]
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


def fixed(model):
    """`model` with NumPy weights and plain SGD in place of each optimizer."""
    import keras

    rng = np.random.default_rng(0)
    for variable in model.trainable_variables:
        variable.assign(rng.normal(0.0, 0.05, variable.shape).astype(np.float32))
    for name, value in list(vars(model).items()):
        if isinstance(value, keras.optimizers.Optimizer):
            setattr(model, name, keras.optimizers.SGD(LEARNING_RATE))
    return model


def config(folder, replicas, **fields):
    import kdist

    return kdist.TrainConfig(**{**dict(
        epochs=1, steps_per_epoch=STEPS, replicas=replicas,
        batch_size_per_replica=GLOBAL_BATCH // replicas, checkpoint_dir=str(folder),
        steps_per_execution=1, seed=SEED), **fields})


def dataset():
    import kdist

    return kdist.synthetic_fashion_mnist(num_train=GLOBAL_BATCH * STEPS, num_test=40, seed=5)


def model_fn(name, folder):
    """A picklable builder of example `name`'s model, from fixed weights. The
    distillation's teacher is the tutorial CNN trained 2 steps by kdist first."""
    module = load(name)
    teacher = None
    if name == "distillation":
        teacher = train_teacher(os.path.join(folder, "teacher"))

    def build():
        return fixed(module.model(None, teacher) if teacher else module.model())

    return build


def train_teacher(folder):
    import kdist

    kdist.train_and_evaluate(
        config(folder, 1, steps_per_epoch=2, learning_rate=LEARNING_RATE), dataset(),
        model_fn=lambda: fixed(kdist.create_model()), optimizer_fn=kdist.OPTIMIZERS["sgd"],
        log=lambda line: None)
    return kdist.latest_checkpoint(folder)


def train(name, replicas, folder, stop=None):
    """Trains example `name` STEPS steps on `replicas` replicas into `folder` (until
    `stop`, as `train_and_evaluate`'s); returns (its result, its last checkpoint)."""
    import kdist

    os.makedirs(folder, exist_ok=True)
    result = kdist.train_and_evaluate(config(os.path.join(folder, "run"), replicas), dataset(),
                                      model_fn=model_fn(name, folder), log=lambda line: None,
                                      stop=stop)
    return result, kdist.latest_checkpoint(os.path.join(folder, "run"))


def weights(path):
    """{h5 path: array} of every array in a checkpoint."""
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda key, item: found.__setitem__(key, item[()])
                     if isinstance(item, h5py.Dataset) and item.dtype.kind == "f" else None)
    return found


def assert_same(a, b, tolerance):
    """Every float array of checkpoint `a` within `tolerance` of `b`'s (relative and absolute)."""
    left, right = weights(a), weights(b)
    assert sorted(left) == sorted(right)
    for key in left:
        np.testing.assert_allclose(left[key], right[key], rtol=tolerance, atol=tolerance,
                                   err_msg=key)


def evaluate(name, checkpoint):
    """`kdist.evaluate_checkpoint` of example `name`'s `checkpoint`, on one device."""
    import kdist

    teacher = os.path.join(os.path.dirname(os.path.dirname(checkpoint)), "teacher")
    module = load(name)
    build = (lambda: module.model(None, kdist.latest_checkpoint(teacher))) \
        if name == "distillation" else module.model
    return kdist.evaluate_checkpoint(checkpoint, dataset(), model_fn=build,
                                     batch_size=GLOBAL_BATCH, seed=SEED)


if __name__ == "__main__":
    # train OUT REPLICAS [NAME...]: one line per example, its checkpoint and restored results.
    # evaluate NAME CHECKPOINT [NAME CHECKPOINT...]: one line of restored results for each.
    command, *rest = sys.argv[1:]
    sys.path.insert(0, REPO)
    from kdist.runtime import startup

    startup.prepare_environment(replicas=int(rest[1]) if command == "train" else None)
    if command == "evaluate":
        for name, checkpoint in zip(rest[::2], rest[1::2], strict=True):
            print(json.dumps(dict(evaluate(name, checkpoint), example=name)))
    for example in (rest[2:] or EXAMPLES) if command == "train" else ():
        result, path = train(example, int(rest[1]), os.path.join(rest[0], example))
        print(json.dumps(dict(result.restored, example=example, path=path)))
