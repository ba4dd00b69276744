"""How long a checkpoint pauses the step loop, against the time of one train step.

For the tutorial CNN and an MLP of about 100 MB of float32 weights (Adam: 300 MB
in the file), both compiled with Adam on one replica of the session's backend,
it times train chunks of 8 steps and a checkpoint written as the loop writes it
(`kdist.checkpoints.background`): the pause is taking the snapshot (Keras'
`save_weights` into memory); the check, checksum, write, fsync, rename and prune
then run on a background thread while the loop trains, and the steps trained
meanwhile are timed too (they share the CPU with the write: `cost_ms` adds
their extra time to the pause). For comparison it also times the same checkpoint
written in the foreground (`CheckpointManager.save`). Prints one JSON line per
model with the medians of 5 rounds and the CPU.

    KERAS_BACKEND=jax python scripts/checkpoint_pause.py [--folder DIR]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdist.runtime import startup  # noqa: E402

startup.prepare_environment()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from kdist import engines  # noqa: E402
from kdist.bench import cpuinfo  # noqa: E402
from kdist.checkpoints import CheckpointManager, background  # noqa: E402
from kdist.loop import building, chunks  # noqa: E402
from kdist.models.cnn import create_model  # noqa: E402

CHUNK, ROUNDS, BATCH = 8, 5, 64


def big_mlp():
    """About 25M float32 weights (100 MB): 784 -> 3500 -> 3500 -> 3500 -> 10."""
    return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                             keras.layers.Dense(3500, activation="relu"),
                             keras.layers.Dense(3500, activation="relu"),
                             keras.layers.Dense(3500, activation="relu"),
                             keras.layers.Dense(10)])


def measure(name, model_fn, folder):
    engine = engines.create_engine(1, distributed=False)
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(BATCH, 28, 28, 1)).astype(np.float32)
    y = rng.integers(0, 10, BATCH).astype(np.int32)
    model, program = building.prepare_model(engine, BATCH, (x[:2], y[:2] * 0, None), model_fn)
    engine.compile_steps(program)
    chunk = engine.distribute(chunks.stack_chunk([(x, y, None, ())] * CHUNK))

    def train():  # Seconds per step of one chunk.
        start = time.perf_counter()
        engine.train_chunk(chunk, CHUNK)
        return (time.perf_counter() - start) / CHUNK

    train()  # Compiles.
    manager = CheckpointManager(folder, keep=2)
    manager.prepare()
    writer = background.BackgroundWriter(manager)
    steps, pauses, during, foreground = [], [], [], []
    for round_ in range(ROUNDS):
        steps.append(train())
        start = time.perf_counter()
        engine.sync_to_model()
        writer.save(model, 2 * round_, {"epoch": 0, "step_in_epoch": 2 * round_})
        pauses.append(time.perf_counter() - start)
        while writer.busy and not writer.written():  # Training goes on meanwhile.
            during.append(train())
        start = time.perf_counter()
        engine.sync_to_model()
        path = manager.save(model, 2 * round_ + 1, {"epoch": 0, "step_in_epoch": 2 * round_ + 1})
        foreground.append(time.perf_counter() - start)
    step, pause, slow, fore = (statistics.median(v) for v in (steps, pauses, during, foreground))
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.weights)
    return dict(model=name, backend=keras.backend.backend(), weights_mb=round(weights / 1e6, 1),
                file_mb=round(os.path.getsize(path) / 1e6, 1), step_ms=round(1000 * step, 2),
                pause_ms=round(1000 * pause, 1), pause_steps=round(pause / step, 1),
                step_during_write_ms=round(1000 * slow, 2),
                steps_during_write=len(during) * CHUNK // ROUNDS,
                # The loop's time lost to a checkpoint: the pause, and the steps slowed meanwhile.
                cost_ms=round(1000 * (pause + len(during) * CHUNK // ROUNDS * (slow - step)), 1),
                foreground_ms=round(1000 * fore, 1), foreground_steps=round(fore / step, 1),
                **{k: v for k, v in cpuinfo.describe(measure_peak=False).items()
                   if k in ("cpu_model", "cpu_cores")})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary "
                                                       "folder, removed after)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        for name, model_fn in (("cnn", create_model), ("mlp-100mb", big_mlp)):
            print(json.dumps(measure(name, model_fn, os.path.join(folder, name))), flush=True)


if __name__ == "__main__":
    main()
