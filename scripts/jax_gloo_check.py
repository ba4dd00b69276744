"""Plain JAX, no kdist: what a cross-process gradient all-reduce costs a CNN step on CPUs.

    python scripts/jax_gloo_check.py [--steps 100] [--pin]

Two processes, one CPU device each, sharing the cores (with `--pin`: each
pinned to its own core), joined by `jax.distributed` with gloo's collectives
(as kdist's JAX workers are). A step is a small CNN's gradient (two
convolutions, two max-poolings, a dense layer) on 64 images per process and an
SGD update; the global batch is sharded over the processes, so XLA all-reduces
the gradient. The same step runs joined but on each process's own device (no
collective), and alone (not joined). Under `shard_map` the same per-process
gradient runs on the processes' mesh with its mean taken explicitly (`pmean`)
of the three arrays, of one array that packs them, or not at all. Without
arithmetic: the all-reduce of the gradient's three arrays alone, of the same
floats packed in one array, of one scalar, and of the 10 arrays kdist's CNN's
step all-reduces (XLA:CPU makes one gloo call per array it all-reduces).
Prints ms per step, process 0's, for each.
"""

import argparse
import os
import subprocess
import sys
import time

import numpy as np

MODES = ("all-reduce", "joined, no collective", "alone", "shard_map, pmean",
         "shard_map, pmean of one packed array", "shard_map, no collective",
         "the gradient's 3 arrays all-reduced, no arithmetic",
         "the same floats in one array, no arithmetic", "one scalar all-reduced, no arithmetic",
         "kdist's CNN's 10 arrays all-reduced, no arithmetic")
SHAPES = ((3, 3, 1, 32), (3, 3, 32, 64), (1600, 64))  # This script's CNN's weights.
# What kdist's CNN's compiled step all-reduces: its 8 gradient arrays, 2 scalar statistics.
KDIST_CNN = ((3, 3, 1, 32), (32,), (64, 288), (64,), (64, 1600), (64,), (10, 64), (10,), (), ())
# Modes run under `shard_map`: (whether the step computes the gradient, its mean).
SHARD_MAPPED = {"shard_map, pmean": (True, "arrays"),
                "shard_map, pmean of one packed array": (True, "packed"),
                "shard_map, no collective": (True, None),
                "the gradient's 3 arrays all-reduced, no arithmetic": (False, "arrays"),
                "the same floats in one array, no arithmetic": (False, "packed"),
                "kdist's CNN's 10 arrays all-reduced, no arithmetic": (False, "arrays")}


def loss(params, x):
    import jax
    import jax.numpy as jnp

    def conv(a, w):
        return jax.nn.relu(jax.lax.conv_general_dilated(
            a, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")))

    def pool(a):
        return jax.lax.reduce_window(a, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                                     "VALID")

    a = pool(conv(pool(conv(x, params[0])), params[1]))
    return jnp.mean((a.reshape(a.shape[0], -1) @ params[2]) ** 2)


def scalar_loss(params, x):
    """A loss whose gradient XLA computes from one all-reduced scalar, the mean of x."""
    import jax.numpy as jnp

    return sum(jnp.sum(w) for w in params) * jnp.mean(x)


def packed(grads, fn):
    """`fn` of the gradient's arrays packed in one flat array, unpacked."""
    import jax.numpy as jnp

    flat = fn(jnp.concatenate([g.reshape(-1) for g in grads]))
    out, start = [], 0
    for g in grads:
        out.append(flat[start:start + g.size].reshape(g.shape))
        start += g.size
    return tuple(out)


def shard_mapped(mesh, grad, mean):
    """Each process's SGD step on its own shard, the gradient averaged over the
    processes (`mean`: "arrays" or "packed") or not (None: each process then
    keeps its own parameters)."""
    import jax
    from jax.sharding import PartitionSpec

    def per_shard(params, x):
        grads = grad(params, x)
        if mean == "arrays":
            grads = jax.lax.pmean(grads, "batch")
        elif mean == "packed":
            grads = packed(grads, lambda flat: jax.lax.pmean(flat, "batch"))
        return jax.tree.map(lambda w, g: w - 1e-6 * g, params, grads)

    return jax.shard_map(per_shard, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec("batch")),
                         out_specs=PartitionSpec(), check_vma=False)


def process(index, port, mode, steps, pin):
    """One process's run; prints its ms per step."""
    if pin:
        os.sched_setaffinity(0, {index % os.cpu_count()})
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if mode != "alone":
        jax.distributed.initialize(f"127.0.0.1:{port}", 2, index)
    rng = np.random.default_rng(0)
    params = tuple(rng.normal(size=s).astype(np.float32) * 0.1
                   for s in (KDIST_CNN if mode.startswith("kdist") else SHAPES))
    local = rng.normal(size=(64, 28, 28, 1)).astype(np.float32)
    if mode not in ("alone", "joined, no collective"):
        mesh = Mesh(np.array(jax.devices()), ("batch",))
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
        x = jax.make_array_from_process_local_data(
            NamedSharding(mesh, PartitionSpec("batch")), local)
    else:
        params, x = jax.device_put((params, local), jax.local_devices()[0])
    grad = jax.grad(scalar_loss if mode.startswith("one scalar") else loss)
    step = jax.jit(lambda p, x: jax.tree.map(lambda w, g: w - 1e-6 * g, p, grad(p, x)))
    if mode in SHARD_MAPPED:
        computes, mean = SHARD_MAPPED[mode]
        step = jax.jit(shard_mapped(mesh, grad if computes else lambda p, x: p, mean))
    for _ in range(5):
        params = step(params, x)
    jax.block_until_ready(params)
    start = time.perf_counter()
    for _ in range(steps):
        params = step(params, x)
    jax.block_until_ready(params)
    if index == 0:
        print(f"{mode}: {(time.perf_counter() - start) * 1000 / steps:.2f} ms per step",
              flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--pin", action="store_true", help="pin each process to its own core")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        index, port, mode = args.child
        return process(int(index), port, mode, args.steps, args.pin)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from kdist.workers.processes import free_ports

    for mode in MODES:
        port = str(free_ports(1)[0])
        flags = ["--steps", str(args.steps), *(["--pin"] if args.pin else [])]
        children = [subprocess.Popen([sys.executable, __file__, *flags, "--child", str(i), port,
                                      mode]) for i in (0, 1)]
        for child in children:
            child.wait(timeout=600)


if __name__ == "__main__":
    sys.exit(main())
