"""The process-wide state a run changes for its own work and gives back after it."""

import contextlib
import random
import sys

import keras
import numpy as np
from keras.src.backend.common import global_state
from keras.src.random import seed_generator
from keras.src.utils import rng_utils

# Keras' global random state, as `keras.utils.set_random_seed` sets it.
_KERAS_RANDOM = (rng_utils.GLOBAL_RANDOM_SEED, seed_generator.GLOBAL_SEED_GENERATOR)


@contextlib.contextmanager
def global_state_kept():
    """Leaves Python's, NumPy's, TensorFlow's, torch's and Keras' global random
    state, and Keras' distribution, as they were, however the block ends.

    A run seeds them all with its `seed` and, on JAX, sets its own
    distribution; a script that draws its next trial's settings from NumPy,
    or calls `fit` after a run, finds them as `fit` leaves them: untouched.
    `keras.distribution.initialize` also seeds them, where Keras has no
    global seed, with a number drawn anew in every run.
    """
    python, numpy = random.getstate(), np.random.get_state()
    own = [global_state.get_global_attribute(name) for name in _KERAS_RANDOM]
    tf_random, distribution = _tf_random(), keras.distribution.distribution()
    torch = sys.modules.get("torch")
    torch_state = None if torch is None else torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        for name, value in zip(_KERAS_RANDOM, own):
            global_state.set_global_attribute(name, value)
        _restore_tf_random(tf_random)
        if torch is not None:
            torch.set_rng_state(torch_state)
        if keras.distribution.distribution() is not distribution:
            keras.distribution.set_distribution(distribution)


def _tf_random():
    """TensorFlow's global seed (None, its default, where TensorFlow is not loaded)
    and the state of the stream its eager ops draw their seeds from."""
    module = sys.modules.get("tensorflow.python.eager.context")
    if module is None:
        return None, None
    stream = getattr(module.context(), "_rng", None)
    return module.global_seed(), None if stream is None else stream.getstate()


def _restore_tf_random(before):
    """Gives TensorFlow's global seed and op-seed stream back (`_tf_random`): setting
    the seed restarts the stream, so the caller's next `tf.random` draw repeated one."""
    seed, stream = before
    module = sys.modules.get("tensorflow.python.eager.context")
    if module is None:
        return
    if module.global_seed() != seed:
        module.set_global_seed(seed)
    own = getattr(module.context(), "_rng", None)
    if stream is not None and own is not None:
        own.setstate(stream)
