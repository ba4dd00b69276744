"""The TensorFlow engine's `tf.function`s: each traced apart from the others, each
run with grappler's dependency optimizer off."""

import functools

import tensorflow as tf


def own_function(fn):
    """`fn` as a `_Function`, its traces counted apart from those of other functions
    of the same code. TensorFlow warns of frequent retracing after five traces of
    one code object, so each engine's first traces would count as retraces of an
    earlier engine's where a process trains more than once."""
    return _Function(tf.function(functools.partial(fn)))


class _Function:
    """A `tf.function` that runs with grappler's dependency optimizer off.

    With it on, TensorFlow 2.21 runs a variable's read in a replica function of
    a `tf.distribute` strategy, now and then, before an update ahead of it (one
    that its automatic control dependencies order first): a step that applies
    an optimizer several times (a critic trained k times per step) then
    computes a loss from the weights before the update, in some runs and not
    others, and its replicas can differ.
    `docs/log/2026-12-05-tf-update-order.md` has a reproduction with
    TensorFlow alone. TensorFlow reads the option when it prepares a function
    for a call, so the option is set for the call and restored after it: the
    user's own functions keep theirs.
    """

    def __init__(self, function):
        self.function = function

    def __call__(self, *args):
        saved = tf.config.optimizer.get_experimental_options().get("dependency_optimization")
        tf.config.optimizer.set_experimental_options({"dependency_optimization": False})
        try:
            return self.function(*args)
        finally:
            tf.config.optimizer.set_experimental_options(
                {"dependency_optimization": True if saved is None else saved})

    def experimental_get_tracing_count(self):
        return self.function.experimental_get_tracing_count()
