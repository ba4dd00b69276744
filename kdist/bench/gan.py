"""`kdist-bench --model dcgan`: kdist's DCGAN step against Keras `fit` on the same GAN.

kdist runs the step of `examples/dcgan.py`, written once. `fit` runs the
same networks, optimizers and batch with the train step Keras' guide
"Customizing what happens in fit()" writes for this backend (a
`tf.GradientTape` on TensorFlow, `backward()` on torch). They take turns
epoch by epoch in one process, and the figure is the median of the
rounds' paired ratios (`kdist.bench.measure.paired_ratios`), so a drift of
the machine's speed falls on both. On JAX, Keras' trainer carries the state
of one optimizer, so a two-optimizer GAN has no guide step to run under
`fit`: kdist is measured alone there. On torch `fit` runs in one process,
so the comparison is on one replica.
"""

import importlib.util
import json
import os
import statistics
import time
from typing import Any

import keras

from kdist import engines
from kdist.bench import cpuinfo
from kdist.bench.measure import EpochTimes, paired_ratios
from kdist.errors import UsageError
from kdist.inputs import base
from kdist.inputs.arrays import ArraySource
from kdist.inputs.batching import worker_rows
from kdist.loop import building
from kdist.loop.chunks import run_steps, zero_totals
from kdist.step import draws

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples", "dcgan.py")


def load_example():
    """The module of examples/dcgan.py (in a kdist checkout)."""
    if not os.path.exists(EXAMPLE):
        raise UsageError(f"--model dcgan runs {EXAMPLE}, which this installation lacks; "
                         "run kdist-bench from a kdist checkout")
    spec: Any = importlib.util.spec_from_file_location("kdist_bench_dcgan", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tensorflow_step(self, data):
    import tensorflow as tf

    real = data[0] if isinstance(data, tuple) else data
    rows = tf.shape(real)[0]
    fake = self.generator(keras.random.normal((rows, self.latent), seed=self.seeds))
    images = tf.concat([fake, real], axis=0)
    labels = tf.concat([tf.ones((rows, 1)), tf.zeros((rows, 1))], axis=0)
    with tf.GradientTape() as tape:
        d_loss = self.bce(labels, self.discriminator(images))
    grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
    self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
    z = keras.random.normal((rows, self.latent), seed=self.seeds)
    with tf.GradientTape() as tape:
        g_loss = self.bce(tf.zeros((rows, 1)), self.discriminator(self.generator(z)))
    grads = tape.gradient(g_loss, self.generator.trainable_weights)
    self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
    return {"d_loss": d_loss, "g_loss": g_loss}


def _torch_step(self, data):
    import torch

    real = data[0] if isinstance(data, (tuple, list)) else data
    rows = real.shape[0]
    fake = self.generator(keras.random.normal((rows, self.latent), seed=self.seeds))
    images = torch.concat([fake, real], dim=0)
    labels = torch.concat([torch.ones((rows, 1)), torch.zeros((rows, 1))], dim=0)
    self.zero_grad()
    d_loss = self.bce(labels, self.discriminator(images))
    d_loss.backward()
    grads = [v.value.grad for v in self.discriminator.trainable_weights]
    with torch.no_grad():
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
    z = keras.random.normal((rows, self.latent), seed=self.seeds)
    self.zero_grad()
    g_loss = self.bce(torch.zeros((rows, 1)), self.discriminator(self.generator(z)))
    g_loss.backward()
    grads = [v.value.grad for v in self.generator.trainable_weights]
    with torch.no_grad():
        self.g_optimizer.apply(grads, self.generator.trainable_weights)
    return {"d_loss": d_loss, "g_loss": g_loss}


GUIDE_STEPS = {"tensorflow": _tensorflow_step, "torch": _torch_step}


def keras_gan(example):
    """The example's GAN with the train step of Keras' guide for this backend, compiled
    for `fit`; None where the guide has none (JAX)."""
    step = GUIDE_STEPS.get(keras.backend.backend())
    if step is None:
        return None

    class GuideGAN(example.GAN):  # type: ignore[name-defined]
        def __init__(self):
            super().__init__()
            self.latent, self.seeds = example.LATENT, keras.random.SeedGenerator(0)

        train_step = step

    model = GuideGAN()
    model.compile()
    model.built = True  # Its two networks are; fit need not call it.
    return model


def run(dataset, replicas, batch_size_per_replica, steps, windows, log=print):
    """Times kdist's and the guide's DCGAN epoch by epoch; logs a line and a JSON line."""
    if keras.backend.backend() == "torch" and (replicas or 1) > 1:
        raise UsageError("--model dcgan on torch compares one process with fit's one: "
                         "leave out --replicas")
    example = load_example()
    engine = engines.create_engine(replicas)
    global_batch = batch_size_per_replica * engine.num_replicas
    steps = base.steps_per_epoch(dataset.size("train"), global_batch, steps)
    keras.utils.set_random_seed(0)
    _, program = building.prepare_model(engine, global_batch, building.sample_rows(dataset),
                                        example.model)
    engine.compile_steps(program)
    with engine.scope():
        theirs = keras_gan(example)
    source = ArraySource(dataset.train_x, dataset.train_y, None, "the training data")
    times: dict[str, list[float]] = {"kdist": [], "fit": []}
    count = steps * global_batch
    for epoch in range(1 + windows):
        start = time.perf_counter()
        batches = source.train(global_batch, seed=0, epoch=epoch, limit=steps,
                               shard=engine.shard)
        run_steps(engine, engine.train_chunk, draws.attach(
            batches, program.draws["train"], 0, draws.TRAIN, epoch, 0, global_batch,
            worker_rows(global_batch, engine.shard)), zero_totals(program))
        times["kdist"].append(time.perf_counter() - start)
        if theirs is not None:
            timer = EpochTimes()
            theirs.fit(dataset.train_x[:count], batch_size=global_batch, epochs=1, verbose=0,
                       callbacks=[timer] + engine.keras_fit_callbacks())
            times["fit"] += timer.seconds
    kdist_rate = count / statistics.median(times["kdist"][1:])
    ratio = paired_ratios({"fit": times["fit"], "kdist": times["kdist"]})["kdist"] \
        if theirs is not None else None
    cpu = cpuinfo.describe(False)
    log(f"{engine.backend} {engine.version}, {engine.num_replicas} replica(s), model dcgan, "
        f"global batch {global_batch}, {steps} steps per epoch, 1 + {windows} epochs each")
    log(cpuinfo.format_record(cpu))
    log(f"kdist {kdist_rate:,.0f} samples/s; against fit with the guide's "
        f"{engine.backend} train step, the median of each round's ratio: "
        + ("-" if ratio is None else f"{ratio:.3f}x"))
    summary = dict(model="dcgan", backend=engine.backend, replicas=engine.num_replicas,
                   global_batch=global_batch, steps=steps, kdist_samples_per_sec=round(kdist_rate),
                   ratio=None if ratio is None else round(ratio, 3),
                   kdist_epoch_seconds=[round(s, 3) for s in times["kdist"]],
                   fit_epoch_seconds=[round(s, 3) for s in times["fit"]] or None, **cpu)
    log(json.dumps(summary))
    return summary
