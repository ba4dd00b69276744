"""Run as a script: restore checkpoints with no distribution, save predictions, evaluate.

Usage: KERAS_BACKEND=... python tests/predict_helper.py FOLDER OUT.npz [FOLDER OUT.npz ...]
For the newest checkpoint of each FOLDER, writes to OUT.npz the logits for a
fixed batch, the restored optimizer state, and the line that the evaluate
command (`kdist.cli.evaluate`, on `--synthetic 1200`) prints for FOLDER.
"""

import contextlib
import io
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdist.runtime import startup  # noqa: E402

startup.prepare_environment()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from kdist import checkpoints
from kdist.cli import evaluate
from kdist.datasets import fashion_mnist
from kdist.loop import building, training
from kdist.models.cnn import create_model

images = fashion_mnist.synthetic_fashion_mnist(num_train=0, num_test=256, seed=11).test_x
for folder, out in zip(sys.argv[1::2], sys.argv[2::2], strict=True):
    engine = training.engines.create_engine(distributed=False)
    model, optimizer = building.build(engine, create_model, training.adam, 1e-3)
    checkpoints.restore(model, checkpoints.CheckpointManager(folder).latest()[0])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = evaluate.main(["--synthetic", "1200", "--checkpoint-dir", folder])
    assert status == 0, printed.getvalue()
    np.savez(out, logits=keras.ops.convert_to_numpy(model(images, training=False)),
             iterations=int(keras.ops.convert_to_numpy(optimizer.iterations)),
             optimizer_state=np.concatenate(
                 [np.ravel(keras.ops.convert_to_numpy(v)) for v in optimizer.variables]),
             backend=keras.backend.backend(), evaluated=printed.getvalue())
