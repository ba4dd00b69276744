"""Options of issue 26 for a torch step, in one process, taking turns round by round.

    KERAS_BACKEND=torch python scripts/torch_options_check.py --steps 60 --rounds 5

The tutorial CNN (`kdist.create_model`), batch 64, Adam, synthetic batches:
- `eager`: Keras' forward and loss, autograd, Keras' Adam (a kdist step without
  kdist's bookkeeping);
- `compiled`: the same with the forward and loss under
  `torch.compile(mode="max-autotune-no-cudagraphs")` (inductor; AOTAutograd compiles
  the backward);
- `fusedadam`: `eager` with `torch.optim.Adam(fused=True)` over the Keras variables'
  tensors (torch's Adam puts epsilon inside the bias correction: not Keras' math);
- `plain`, `plaincompiled`: the same network in torch.nn (`ddp_baseline.py`'s), eager
  and with its forward and loss compiled as above.
Prints each one's ms per step and its speed against `eager`: the median of the rounds'
paired ratios [their spread]. Results: docs/log/2026-12-04-big-steps-heap.md.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kdist.runtime import startup  # noqa: E402

startup.prepare_environment()  # kdist-bench's heap settings, for every contender.

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from ddp_baseline import cnn  # noqa: E402

import kdist  # noqa: E402

COMPILE_MODE = "max-autotune-no-cudagraphs"


def keras_steps(batches, mode):
    """A function running `count` Keras steps (`mode`: eager, compiled, fusedadam)."""
    keras.utils.set_random_seed(0)
    model = kdist.create_model()
    model.build((None, 28, 28, 1))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    params = [v.value for v in model.trainable_variables]

    def forward(x, y):
        return loss_fn(y, model(x, training=True))

    loss_of = torch.compile(forward, mode=COMPILE_MODE) if mode == "compiled" else forward
    fused = (torch.optim.Adam(params, lr=1e-3, eps=1e-7, fused=True)
             if mode == "fusedadam" else None)

    def run(count):
        for k in range(count):
            x, y = batches[k % len(batches)]
            with torch.enable_grad():
                loss = loss_of(x, y)
                grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                if fused is None:
                    optimizer.apply(grads, model.trainable_variables)
                else:
                    for param, grad in zip(params, grads):
                        param.grad = grad
                    fused.step()
        return float(loss.detach())

    return run


def plain_steps(batches, compiled):
    """The same steps in torch.nn with torch.optim.Adam."""
    torch.manual_seed(0)
    model = cnn()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    tensors = [(x.permute(0, 3, 1, 2).contiguous(), y) for x, y in batches]

    def forward(x, y):
        return loss_fn(model(x), y)

    loss_of = torch.compile(forward, mode=COMPILE_MODE) if compiled else forward

    def run(count):
        for k in range(count):
            x, y = tensors[k % len(tensors)]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(x, y)
            loss.backward()
            optimizer.step()
        return float(loss.detach())

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per round (default 60)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batches = [(torch.from_numpy(rng.uniform(0, 1, (64, 28, 28, 1)).astype(np.float32)),
                torch.from_numpy(rng.integers(0, 10, 64))) for _ in range(8)]
    makers = {"eager": lambda: keras_steps(batches, "eager"),
              "compiled": lambda: keras_steps(batches, "compiled"),
              "fusedadam": lambda: keras_steps(batches, "fusedadam"),
              "plain": lambda: plain_steps(batches, False),
              "plaincompiled": lambda: plain_steps(batches, True)}
    runs = {}
    for name, make in makers.items():
        start = time.perf_counter()
        runs[name] = make()
        runs[name](23)  # Compiles where it compiles, then warms up.
        print(f"{name}: ready in {time.perf_counter() - start:.1f} s", flush=True)
    seconds = {name: [] for name in runs}
    for k in range(args.rounds):
        for name in (list(runs) if k % 2 == 0 else list(runs)[::-1]):
            start = time.perf_counter()
            runs[name](args.steps)
            seconds[name].append(time.perf_counter() - start)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.2f}, {args.steps} steps x {args.rounds} rounds")
    for name, times in seconds.items():
        ratios = [e / t for e, t in zip(seconds["eager"], times)]
        print(f"{name}: {1e3 * statistics.median(times) / args.steps:.2f} ms per step; speed "
              f"/ eager's {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
