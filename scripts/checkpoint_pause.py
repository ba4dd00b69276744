"""How long a checkpoint pauses the step loop, against the time of one train step.

For the tutorial CNN and an MLP of about 100 MB of float32 weights (Adam: 300 MB
in the file), both compiled with Adam on one replica of the session's backend,
it times train chunks of 8 steps, then each part of a checkpoint write as the
loop does it (`CheckpointManager.save`): encoding the file in memory
(`ckptfile.encode`: the variables read, checked finite, checksummed) and
writing it (temporary file, fsync, rename, prune). Prints one JSON line per
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
from kdist.checkpoints import CheckpointManager, ckptfile  # noqa: E402
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
    engine.train_chunk(chunk, CHUNK)  # Compiles.
    manager = CheckpointManager(folder, keep=2)
    manager.prepare()
    steps, encodes, writes = [], [], []
    for round_ in range(ROUNDS):
        start = time.perf_counter()
        engine.train_chunk(chunk, CHUNK)
        steps.append((time.perf_counter() - start) / CHUNK)
        start = time.perf_counter()
        engine.sync_to_model()
        data = ckptfile.encode(model, {"epoch": 0, "step_in_epoch": round_})
        encodes.append(time.perf_counter() - start)
        start = time.perf_counter()
        manager._write(os.path.join(folder, f"ckpt-{round_:08d}.weights.h5"), data)
        writes.append(time.perf_counter() - start)
    step, encode, write = (statistics.median(v) for v in (steps, encodes, writes))
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.weights)
    return dict(model=name, backend=keras.backend.backend(), weights_mb=round(weights / 1e6, 1),
                file_mb=round(len(data) / 1e6, 1), step_ms=round(1000 * step, 2),
                encode_ms=round(1000 * encode, 1), write_ms=round(1000 * write, 1),
                pause_steps=round((encode + write) / step, 1),
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
