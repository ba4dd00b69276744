"""The active engine meets the engine contract (`kdist.engines.contract`) in use.

Each engine class declares the contract's Protocol as its base, so mypy (`nox -s
lint`) checks every engine's method signatures against it, installed or not.
"""

import logging
import os
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest
from conftest import REPO
from helpers import prepare

import kdist
from kdist import engines
from kdist.engines import contract
from kdist.inputs import arrays
from kdist.loop import chunks, training
from kdist.workers.processes import free_ports

# In one process: 2 replicas where the engine runs them in-process (tests/test_torch.py
# runs torch's, one process each, through the same contract).
IN_PROCESS = [(1, False)] + ([] if keras.backend.backend() == "torch" else [(2, True)])


@pytest.mark.parametrize("replicas, distributed", IN_PROCESS)
def test_the_active_engine_meets_the_contract_when_used(small_dataset, replicas, distributed):
    engine = engines.create_engine(replicas, distributed=distributed)
    assert isinstance(engine, contract.Engine)
    assert engine.backend == keras.backend.backend() and isinstance(engine.version, str)
    assert engine.num_replicas == engine.num_local_replicas == replicas
    assert len(engine.devices) == replicas
    assert engine.shard == (0, 1) and engine.is_chief
    assert engine.any_worker(True) and not engine.any_worker(False)  # One worker.

    model, step = prepare(engine, 32, optimizer_fn=training.sgd, learning_rate=0.1)
    initial = [np.array(w) for w in model.get_weights()]
    batches = list(arrays.train_batches(*small_dataset.split("train"), 32, seed=0, epoch=0,
                                      steps=2))
    chunk = engine.distribute(chunks.stack_chunk(batches + batches[:1]))  # 3rd: padding.
    for run in (engine.train_chunk, engine.eval_chunk):
        stats = {k: np.asarray(v) for k, v in run(chunk, 2).items()}
        assert sorted(stats) == sorted(step.keys)
        assert all(len(v) >= 2 for v in stats.values())
        np.testing.assert_array_equal(stats["count"][:2], [32, 32])
    assert engine.compiled_train_programs() == 1
    engine.sync_to_model()  # The optimizer steps reach the Keras variables.
    assert any(np.abs(a - b).max() > 0 for a, b in zip(initial, model.get_weights()))


@pytest.mark.parametrize("made_outside", ["model", "optimizer"])
def test_a_model_or_optimizer_made_before_the_engine(tmp_path, made_outside):
    """TensorFlow's strategy does not hold variables made outside its scope, and
    a replica function cannot update them (Keras failed with an AssertionError,
    or 'Mixing different tf.distribute.Strategy objects'): one clear error. JAX
    trains such a model as one made in model_fn."""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)

    def make():
        keras.utils.set_random_seed(0)
        return (keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
                keras.optimizers.SGD(0.1))

    def model_fn(outside=None):
        model, optimizer = make()
        if outside is not None:
            model = outside[0] if made_outside == "model" else model
            optimizer = outside[1] if made_outside == "optimizer" else optimizer
        model.compile(optimizer=optimizer, loss="mse")
        return model

    def train(fn, folder):
        config = kdist.TrainConfig(epochs=1, batch_size_per_replica=8, replicas=2,
                                   checkpoint_dir=str(tmp_path / folder), progress=False)
        return kdist.train_and_evaluate(config, kdist.Dataset(x, x[:, :1], x, x[:, :1], "toy"),
                                        model_fn=fn, log=lambda line: None).history

    outside = make()
    if keras.backend.backend() == "tensorflow":
        named = "a model created" if made_outside == "model" else "optimizer .SGD. was created"
        with pytest.raises(kdist.UsageError, match=f"{named} outside .*inside model_fn"):
            train(lambda: model_fn(outside), "outside")
        assert list((tmp_path / "outside").iterdir()) == []
    elif keras.backend.backend() == "jax":
        assert train(lambda: model_fn(outside), "outside") == train(model_fn, "inside")


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="TensorFlow's strategy holds only the variables made in its scope")
def test_a_layer_made_before_the_engine_is_named(tmp_path):
    """A layer adapted or built outside model_fn, in a model made inside it."""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    outside = keras.layers.Dense(1)
    outside.build((None, 4))

    def model_fn():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), outside])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    config = kdist.TrainConfig(epochs=1, batch_size_per_replica=8, replicas=2,
                               checkpoint_dir=str(tmp_path), progress=False)
    with pytest.raises(kdist.UsageError, match=(
            r"model with variables created outside it, before kdist's engine existed "
            r"\(dense\w*/kernel, dense\w*/bias\), so the replicas do not hold them")):
        kdist.train_and_evaluate(config, kdist.Dataset(x, x[:, :1], x, x[:, :1], "toy"),
                                 model_fn=model_fn, log=lambda line: None)


def test_a_stateful_rnn_is_refused_before_training(tmp_path):
    """Its state carries each row to the next batch's same row; a replica sees a share."""
    x = np.random.default_rng(0).normal(size=(32, 5, 3)).astype(np.float32)

    def model_fn():
        model = keras.Sequential([keras.Input((5, 3), batch_size=8),
                                  keras.layers.LSTM(4, stateful=True, name="carried"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    config = kdist.TrainConfig(epochs=1, batch_size_per_replica=8, replicas=1,
                               checkpoint_dir=str(tmp_path), progress=False)
    with pytest.raises(kdist.UsageError, match=r"stateful RNN layers \(carried\)"):
        kdist.train_and_evaluate(config, kdist.Dataset(x, x[:, 0, :1], x, x[:, 0, :1], "toy"),
                                 model_fn=model_fn, log=lambda line: None)
    assert not list(tmp_path.iterdir())  # No checkpoint written.


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's warning")
def test_engines_made_one_after_another_trace_once_each_and_warn_of_no_retracing(
        small_dataset):
    """As where a process trains more than once (a teacher, then a student): TensorFlow
    warns of frequent retracing after five traces of one code object."""
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("tensorflow").addHandler(handler)
    try:
        for _ in range(3):
            engine = engines.create_engine(2, distributed=True)
            prepare(engine, 32, optimizer_fn=training.sgd, learning_rate=0.1)
            batches = list(arrays.train_batches(*small_dataset.split("train"), 32, seed=0,
                                              epoch=0, steps=2))
            chunk = engine.distribute(chunks.stack_chunk(batches))
            engine.train_chunk(chunk, 2)
            engine.eval_chunk(chunk, 2)
            engine.eval_whole(batches[0])
            assert engine.compiled_train_programs() == 1
    finally:
        logging.getLogger("tensorflow").removeHandler(handler)
    assert [w for w in warnings if "retracing" in w] == []


def test_every_contract_method_is_the_engines_own():
    """An engine that lacked a method would inherit the Protocol's empty body, which
    returns None; each must define every method itself."""
    engine_class = type(engines.create_engine(1, distributed=False))
    methods = [name for name, value in vars(contract.Engine).items()
               if callable(value) and not name.startswith("_")]
    assert methods and [name for name in methods if name not in vars(engine_class)] == []


# A fresh process joins a one-worker cluster, as a worker kdist-launch starts with
# KDIST_LOCAL_PROCESSES set, and prints its engine's thread counts (intra-op, inter-op).
THREADS_AFTER_JOINING = """
import sys
sys.path.insert(0, {repo!r})
import keras
import kdist
from kdist import engines
from kdist.workers import cluster
engines.connect(cluster.ClusterSpec(1, 0, ("127.0.0.1:{port}",), 60.0, source="test"))
if keras.backend.backend() == "tensorflow":
    import tensorflow as tf
    print(tf.config.threading.get_intra_op_parallelism_threads(),
          tf.config.threading.get_inter_op_parallelism_threads())
else:
    import torch
    print(torch.get_num_threads(), torch.get_num_threads())
"""


@pytest.mark.skipif(keras.backend.backend() == "jax",
                    reason="the JAX engine leaves XLA's threads as they are: a worker with one "
                           "thread was no faster (docs/log/2026-12-03-workers.md)")
@pytest.mark.parametrize("local", [2, None])
def test_workers_sharing_a_machine_share_its_cores(local):
    # Two TensorFlow workers on 2 cores, each with a thread per core: 1.10x [1.09-1.24]
    # with one thread each (docs/performance.md).
    env = {k: v for k, v in os.environ.items()
           if k not in ("KDIST_LOCAL_PROCESSES", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS",
                        "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "TF_CONFIG")}
    if local:
        env["KDIST_LOCAL_PROCESSES"] = str(local)
    script = THREADS_AFTER_JOINING.format(repo=REPO, port=free_ports(1)[0])
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    threads = [int(word) for word in result.stdout.split()[-2:]]
    cores = len(os.sched_getaffinity(0))
    if local:
        assert threads == [max(1, cores // local)] * 2
    elif keras.backend.backend() == "tensorflow":
        assert threads == [0, 0]  # TensorFlow's own choice, as before kdist.
    else:
        assert threads == [cores, cores]


# A fresh process joins a one-worker cluster and says whether Python's, NumPy's and
# Keras' global random state are as before (and TensorFlow's global seed, where loaded).
RANDOM_STATE_AFTER_JOINING = """
import random, sys
sys.path.insert(0, {repo!r})
import numpy as np
import keras
from keras.src.utils import rng_utils
from kdist import engines
from kdist.workers import cluster
before = random.getstate(), np.random.get_state()[1].tolist()
engines.connect(cluster.ClusterSpec(1, 0, ("127.0.0.1:{port}",), 60.0, source="test"))
tf = sys.modules.get("tensorflow.python.eager.context")
print(before == (random.getstate(), np.random.get_state()[1].tolist()),
      rng_utils.get_random_seed(), tf and tf.global_seed())
"""


def test_joining_the_workers_leaves_the_random_state_as_it_was():
    # keras.distribution.initialize (JAX) seeds them all with a number drawn anew in
    # every run where Keras has no seed: a tf.data shuffle built after kdist.connect
    # took another order in every run, and on resume, than in one process.
    script = RANDOM_STATE_AFTER_JOINING.format(repo=REPO, port=free_ports(1)[0])
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-3:] == ["True", "None", "None"], result.stdout


# A fresh TensorFlow process that split its CPU for 2 replicas, then joins 2 workers.
SPLIT_THEN_JOINING = """
import sys
sys.path.insert(0, {repo!r})
import kdist
kdist.prepare_environment(replicas=2)
from kdist import engines
from kdist.workers import cluster
try:
    engines.connect(cluster.ClusterSpec(2, 0, ("127.0.0.1:{port}", "127.0.0.1:{other}"), 60.0,
                                        source="test"))
except kdist.UsageError as error:
    print(error)
"""


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="TensorFlow's workers hold one CPU replica each")
def test_a_tensorflow_worker_that_split_its_cpu_is_told_to_leave_replicas_out():
    # It was told "this process ran tensorflow before joining ...; call kdist.connect()
    # first", which the script did: the split had started TensorFlow's runtime.
    ports = free_ports(2)
    script = SPLIT_THEN_JOINING.format(repo=REPO, port=ports[0], other=ports[1])
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith(
        "--replicas 2: with several workers, each TensorFlow worker uses all its GPUs, or one "
        "CPU (1 here); leave --replicas out: this process split its CPU before joining "
        "(kdist.prepare_environment(replicas=N)); call kdist.connect() first thing in the "
        "script, without replicas"), result.stdout


# A fresh process joins 2 workers as worker 0, whose port another program holds.
JOINING_ON_A_TAKEN_PORT = """
import sys
sys.path.insert(0, {repo!r})
import kdist
try:
    kdist.connect(peers="127.0.0.1:{port},127.0.0.1:{other}", worker_index=0, timeout=20)
except kdist.UsageError as error:
    print(error, flush=True)  # JAX may crash at exit, its server half made.
"""


def test_a_worker_whose_port_is_taken_is_one_line():
    # Worker 0 died in the framework's own traceback (JAX "Failed to start RPC server",
    # torch EADDRINUSE, TensorFlow "Could not start gRPC server").
    ports = free_ports(2)
    script = JOINING_ON_A_TAKEN_PORT.format(repo=REPO, port=ports[0], other=ports[1])
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    with socket.create_server(("127.0.0.1", ports[0])):
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                text=True, timeout=120)
    assert result.stdout.strip(), (result.returncode, result.stderr[-3000:])
    line = result.stdout.strip().splitlines()[-1]
    assert f": worker 0 cannot listen at 127.0.0.1:{ports[0]} (" in line, line
    assert line.endswith("): another program holds that port, or another worker was given "
                         "the same index"), line


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's errors")
def test_a_gloo_failure_jax_raises_as_a_value_error_is_a_lost_worker():
    # 3 workers, worker 1's step raising in the building run: the others' all-gather of
    # an optimizer variable ended in this raw ValueError, not the one WorkerLost line.
    from kdist.engines import jax as jax_engine

    lost = ValueError("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/"
                      "pair.cc:547] Connection closed by peer [127.0.0.1]:18832")
    assert jax_engine.failed_collective(lost)
    assert not jax_engine.failed_collective(ValueError("deliberate failure in the step"))
