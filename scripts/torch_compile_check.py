"""Whether `torch.compile` speeds up kdist's torch step on this machine.

    python scripts/torch_compile_check.py eager|compile|fit|fitjit [STEPS]

`eager` runs kdist's torch engine on one replica, step by step; `compile` the
same with the model's forward pass under `torch.compile` (AOTAutograd
compiles the backward);
`fit` and `fitjit` Keras' own `fit`, without and with `jit_compile=True`.
One process, the tutorial CNN, batches of 64 random images; prints the time
of the first 10 steps and the samples/s of two passes of STEPS steps
(default 150).
Results: docs/performance.md.
"""

import os
import sys
import time

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from kdist import engines  # noqa: E402
from kdist.loop import building  # noqa: E402
from kdist.loop.chunks import stack_chunk  # noqa: E402
from kdist.models.cnn import create_model  # noqa: E402

BATCH = 64


def build(mode):
    keras.utils.set_random_seed(0)
    model = create_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=mode == "fitjit")
    return model


def time_fit(model, x, y):
    model.fit(x[:10 * BATCH], y[:10 * BATCH], batch_size=BATCH, verbose=0)
    for attempt in range(2):
        start = time.perf_counter()
        model.fit(x, y, batch_size=BATCH, verbose=0)
        print(f"pass {attempt + 1}: {len(x) / (time.perf_counter() - start):,.0f} samples/s")


def time_step(model, x, y, compiled):
    if compiled:  # The forward pass; AOTAutograd compiles its backward.
        model.call = torch.compile(model.call, dynamic=False)
    engine = engines.create_engine(1)
    _, program = building.prepare_model(engine, BATCH, (x[:2], y[:2], None), lambda: model)
    engine.compile_steps(program)

    def one(k):
        rows = slice(k * BATCH, (k + 1) * BATCH)
        engine.train_chunk(engine.distribute(stack_chunk([(x[rows], y[rows], None)])), 1)

    start, first = time.perf_counter(), min(10, len(x) // BATCH)
    for k in range(first):
        one(k)
    print(f"first {first} steps: {time.perf_counter() - start:.2f} s")
    for attempt in range(2):
        start = time.perf_counter()
        for k in range(len(x) // BATCH):
            one(k)
        print(f"pass {attempt + 1}: {len(x) / (time.perf_counter() - start):,.0f} samples/s")


def main(mode, steps=150):
    rng = np.random.default_rng(0)
    x = rng.random((steps * BATCH, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, steps * BATCH).astype(np.int32)
    model = build(mode)
    if mode.startswith("fit"):
        time_fit(model, x, y)
    else:
        time_step(model, x, y, compiled=mode == "compile")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("eager", "compile", "fit", "fitjit"):
        sys.exit(__doc__)
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
