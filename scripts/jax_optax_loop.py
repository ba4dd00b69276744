"""The reference job as a JAX user writes it with optax: no Keras, no kdist.

The tutorial CNN in plain JAX (`jax.lax.conv_general_dilated` and
`jax.lax.reduce_window`, as flax's Conv and max_pool; Keras' initializers),
`optax.adam`, softmax cross-entropy averaged over the global batch, and the
batch's correct predictions counted for a training accuracy. One `jax.jit`
step on a mesh of the CPU devices: the batch sharded over them, the weights
and the optimizer's state replicated, so XLA inserts the gradients' all-reduce
(JAX's "Distributed arrays and automatic parallelization"). Synthetic
Fashion-MNIST-shaped data, the same global batch as kdist-bench, each batch
put on the devices from NumPy. Each step is dispatched while the one before
runs and waits for the one before that: with forced host devices, steps
queued without bound ended 2 of 6 runs on 2 devices in XLA's "Termination
timeout for `all reduce RendezvousKey`" abort; kdist's JAX engine waits the
same way. 1 + --windows epochs of --steps steps, the
median samples/s of the epochs after the first, then one JSON line. The peer
of `kdist-bench` on JAX (docs/performance.md). Needs `pip install optax`
(kdist itself does not).

    KERAS_BACKEND=jax python scripts/jax_optax_loop.py --replicas 1 --steps 150 --windows 5
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("KERAS_BACKEND", "jax")

import peer_loop  # noqa: E402 (scripts/peer_loop.py, beside this file)

from kdist.runtime import startup  # noqa: E402

# (kernel height, width, in, out) of the convolutions; (in, out) of the dense layers.
CONVS = ((3, 3, 1, 32), (3, 3, 32, 64))
DENSES = ((5 * 5 * 64, 64), (64, 10))


def init_params(key):
    """Glorot-uniform kernels and zero biases, as Keras initializes the CNN."""
    import jax

    params = []
    for shape in CONVS + DENSES:
        key, sub = jax.random.split(key)
        receptive = shape[0] * shape[1] if len(shape) == 4 else 1
        fan_in, fan_out = shape[-2] * receptive, shape[-1] * receptive
        limit = (6.0 / (fan_in + fan_out)) ** 0.5
        params.append({"kernel": jax.random.uniform(sub, shape, minval=-limit, maxval=limit),
                       "bias": jax.numpy.zeros(shape[-1])})
    return params


def forward(params, images):
    """Conv(32)-ReLU-MaxPool-Conv(64)-ReLU-MaxPool-Flatten-Dense(64)-ReLU-Dense(10): logits."""
    import jax

    x = images
    for layer in params[:len(CONVS)]:
        x = jax.lax.conv_general_dilated(x, layer["kernel"], (1, 1), "VALID",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        x = jax.nn.relu(x + layer["bias"])
        x = jax.lax.reduce_window(x, -jax.numpy.inf, jax.lax.max, (1, 2, 2, 1),
                                  (1, 2, 2, 1), "VALID")
    x = x.reshape(x.shape[0], -1)
    hidden, logits = params[len(CONVS):]
    x = jax.nn.relu(x @ hidden["kernel"] + hidden["bias"])
    return x @ logits["kernel"] + logits["bias"]


def main():
    args = peer_loop.parse_args(__doc__, steps=150, windows=5)
    startup.prepare_environment(args.replicas)  # kdist-bench's process settings, for a fair match.
    import jax
    import numpy as np
    try:
        import optax
    except ImportError:
        sys.exit("jax_optax_loop.py: error: needs optax, which kdist does not install: "
                 "pip install optax")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:args.replicas]), ("batch",))
    replicated = NamedSharding(mesh, PartitionSpec())
    by_batch = NamedSharding(mesh, PartitionSpec("batch"))
    global_batch = args.batch_size_per_replica * args.replicas
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 1, (args.steps * global_batch, 28, 28, 1)).astype(np.float32)
    labels = rng.integers(0, 10, args.steps * global_batch).astype(np.int32)
    optimizer = optax.adam(1e-3)
    params = jax.device_put(init_params(jax.random.key(0)), replicated)
    opt_state = jax.device_put(optimizer.init(params), replicated)

    def loss_fn(params, x, y):
        logits = forward(params, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, (logits.argmax(-1) == y).sum()

    @jax.jit
    def train_step(params, opt_state, x, y):
        (loss, correct), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, correct

    seconds = []
    for _ in range(1 + args.windows):
        start = time.perf_counter()
        total, correct, before = 0.0, 0, None
        for k in range(args.steps):
            batch = slice(k * global_batch, (k + 1) * global_batch)
            x, y = jax.device_put((images[batch], labels[batch]), by_batch)
            params, opt_state, loss, right = train_step(params, opt_state, x, y)
            if before is not None:
                before.block_until_ready()  # At most two steps in flight, as kdist's.
            total, correct, before = total + loss, correct + right, loss
        float(total), int(correct)  # Ends on the host.
        seconds.append(time.perf_counter() - start)
    print(json.dumps(peer_loop.summary(
        seconds, args.steps, global_batch, baseline="JAX with optax", jax=jax.__version__,
        optax=optax.__version__, replicas=args.replicas)))


if __name__ == "__main__":
    main()
