"""Building a compiled model and its step on an engine, as the loop does, for tests."""

import numpy as np

from kdist import training
from kdist.model import create_model

# Two rows of the tutorial's data shapes: enough to build the compiled loss and metrics.
SAMPLE = (np.zeros((2, 28, 28, 1), np.float32), np.zeros(2, np.int32), None)


def prepare(engine, global_batch, model_fn=create_model, optimizer_fn=training.sgd,
            learning_rate=0.5, sample=SAMPLE, train=True, **kwargs):
    """(model, step), compiled by `engine`; plain SGD by default (see test_distribution)."""
    if not train:
        optimizer_fn = learning_rate = None
    model, step = training.prepare_model(engine, global_batch, sample, model_fn, optimizer_fn,
                                         learning_rate, train=train, **kwargs)
    engine.compile_steps(step, model.optimizer)
    return model, step
