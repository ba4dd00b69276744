"""Run as a script: restore a checkpoint with no distribution and save predictions.

Usage: KERAS_BACKEND=... python tests/predict_helper.py CHECKPOINT OUT.npz
Writes the logits for a fixed batch and the restored optimizer state.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdist.runtime import startup  # noqa: E402

startup.prepare_environment()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from kdist import checkpoints
from kdist.datasets import fashion_mnist
from kdist.loop import building, training
from kdist.models.cnn import create_model

checkpoint, out = sys.argv[1:3]
engine = training.engines.create_engine(distributed=False)
model, optimizer = building.build(engine, create_model, training.adam, 1e-3)
checkpoints.restore(model, checkpoint)
images = fashion_mnist.synthetic_fashion_mnist(num_train=0, num_test=256, seed=11).test_x
np.savez(out, logits=keras.ops.convert_to_numpy(model(images, training=False)),
         iterations=int(keras.ops.convert_to_numpy(optimizer.iterations)),
         optimizer_state=np.concatenate(
             [np.ravel(keras.ops.convert_to_numpy(v)) for v in optimizer.variables]),
         backend=keras.backend.backend())
