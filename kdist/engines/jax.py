"""JAX engine: `keras.distribution.DataParallel` over a device mesh (or none).

After `connect` the mesh spans every process's devices (JAX multi-process).
"""

import atexit
import contextlib
import os
import sys
import threading
from typing import Any

import jax
import keras
import numpy as np
from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from kdist.engines import contract, jax_chunks
from kdist.engines.jax_step import Primitives, traced_as_keras_allows
from kdist.errors import UsageError
from kdist.runtime import kept


def connect(spec, replicas=None):
    """Starts JAX's distributed runtime; blocks until every process has joined.

    `keras.distribution.initialize` wraps `jax.distributed.initialize`
    (worker 0 is the coordinator) and must precede any other JAX use. On CPUs
    the cross-process collectives are gloo's: the default of jax 0.10.2, set
    explicitly because without a CPU collectives implementation a step
    across processes cannot run.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    with kept.global_state_kept():
        keras.distribution.initialize(",".join(spec.addresses), spec.num_workers,
                                      spec.worker_index)
    bound_exit()  # Until a run ends together, a worker that leaves may strand the others.


def served_address(spec):
    """Worker 0 serves JAX's coordination service on the first address."""
    return spec.addresses[0] if spec.is_chief else None


def connected():
    """Whether JAX's distributed runtime has started in this process."""
    return jax_distributed.global_state.client is not None  # As jax.distributed.is_initialized.


def is_chief():
    """Whether this process is the first of JAX's processes (worker 0)."""
    return jax.process_index() == 0


def failed_collective(error):
    """Whether `error` is a collective across the processes that failed: the
    runtime error of a gloo collective or of the distributed service's
    heartbeats (JAX gives both one exception class; its message names them),
    or a gloo collective's failure JAX raises as a `ValueError` (the all-gather
    of a variable's value while a model or optimizer is built)."""
    text = str(error)
    return ((isinstance(error, jax.errors.JaxRuntimeError) and any(
        word in text for word in ("Gloo", "gloo", "heartbeat", "UNAVAILABLE")))
        or (isinstance(error, ValueError) and "Gloo" in text and "failed" in text))


# Seconds JAX's shutdown may take at the exit of a worker that may leave the others
# waiting (`bound_exit`).
EXIT_GRACE_S = 10


def bound_exit():
    """Bounds the exit of this worker, from its joining or a run's start until
    that run ends where every worker's does (`unbound_exit`).

    At exit JAX's distributed shutdown waits at a barrier for every worker
    (300 s at most), and a worker still waiting in a collective for this one
    (the all-gather of a variable while its model is built, say) never reaches
    it, so both wait, then abort with C++ stack traces. A worker that leaves
    meanwhile (its run failed, its script raised, a file is missing on its
    machine, `sys.exit`) strands them so. An exit hook, run before JAX's,
    gives the shutdown `EXIT_GRACE_S` seconds, then ends the process with
    status 1: its connections close, the other workers' collectives fail at
    once (`WorkerLost`), and `kdist-launch` sees a worker exit.
    """
    atexit.unregister(_end_after_grace)  # One hook, however many runs.
    atexit.register(_end_after_grace)


def unbound_exit():
    """Called where this worker's run ended where every worker's did (its last
    step or a coordinated stop): at exit this process then waits for the
    others as JAX does. The chief may still be at work after the run, and a
    worker gone from JAX's runtime would end it at the heartbeat timeout
    (100 s)."""
    atexit.unregister(_end_after_grace)


def _end_after_grace():
    def end():  # Quietly: the run's error or the script's traceback is already printed.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)

    timer = threading.Timer(EXIT_GRACE_S, end)
    timer.daemon = True  # A shutdown that ends in time ends the process as usual.
    timer.start()


def _replica_devices(replicas):
    devices = keras.distribution.list_devices()
    if jax.process_count() > 1:  # Every process's devices; `replicas` counts this one's.
        if replicas not in (None, jax.local_device_count()):
            raise UsageError(f"--replicas {replicas} but this worker has "
                             f"{jax.local_device_count()} devices")
        return devices
    if replicas is None:
        return devices
    if replicas > len(devices):
        raise UsageError(
            f"--replicas {replicas} but JAX sees {len(devices)} devices; on a CPU call "
            f"kdist.prepare_environment(replicas={replicas}) before keras or jax is "
            "imported (kdist-train does this for you)")
    return devices[:replicas]


class Engine(contract.Engine):
    """Runs kdist's steps as jitted stateless functions over sharded batches.

    Variables are replicated on every device; each batch is sharded along
    its first axis (`P('batch')`), so every device computes on its slice and
    XLA all-reduces the gradients.

    Args:
        replicas: device count (None: every visible device).
        distributed: False sets no distribution and runs on one device, as
            for evaluating a restored model.
    """

    backend = "jax"
    version = jax.__version__

    def __init__(self, replicas=None, distributed=True):
        self.distribution: keras.distribution.DataParallel | None
        if distributed:
            self.distribution = keras.distribution.DataParallel(
                devices=_replica_devices(replicas))
            self.num_replicas = self.distribution.num_model_replicas
            self.shard = (jax.process_index(), jax.process_count())
        else:
            self.distribution = None
            self.num_replicas = 1
            self.shard = (0, 1)
        self.num_local_replicas = self.num_replicas // self.shard[1]
        self.batch_shares = 1  # One program, over every process, sees the global batch.
        self.is_chief = jax.process_index() == 0
        # Set before any Keras object exists, so variables are laid out on the mesh.
        keras.distribution.set_distribution(self.distribution)
        self.devices = ([str(d) for d in self.distribution.device_mesh.devices.flat]
                        if self.distribution else [str(jax.local_devices()[0])])
        # Read by `compile_steps`: a CPU runs one call per step, an accelerator a
        # chunk's steps in one program (`train_chunk` says why).
        self.steps_in_one_program = jax.local_devices()[0].platform != "cpu"
        if self.distribution is not None:  # Variables everywhere; chunks split on batch.
            mesh = self.distribution.device_mesh.backend_mesh
            self._replicated = NamedSharding(mesh, PartitionSpec())
            self._chunk_sharding = NamedSharding(
                mesh, PartitionSpec(None, self.distribution.batch_dim_name))

    def scope(self):
        """Context in which the model, optimizer and variables must be created."""
        return self.distribution.scope() if self.distribution else contextlib.nullcontext()

    def outside_scope(self, variables):
        """Any variable serves: the engine places the state itself."""
        return []

    def primitives(self):
        """The step primitives of this engine (`kdist.step.context.Primitives`)."""
        return Primitives()

    def compile_steps(self, program):
        """Takes the program's variables' values as the state and jits the two chunk
        functions of `program` (a built `kdist.step.program.Program`).

        Each step runs statelessly: every variable is read from the state
        through the step's scope, and what the step assigns (optimizers'
        updates, moving statistics, seeds) is the next state. The program
        sees the whole sharded global batch, so a loss that is a mean over
        its batch is the global batch's, and its gradients are summed over
        devices by XLA.
        """
        self.program = program
        variables = program.variables
        self.sync_from_model()

        def run(state, batch, training):  # Runs as jax.jit traces it.
            with traced_as_keras_allows(program.model):
                stats, scope = program.run(Primitives(), training, batch, zip(variables, state))
            return [scope.get_current_value(v) for v in variables], stats

        def train_step(state, batch):
            return run(state, batch, True)

        def eval_step(state, batch):
            return run(state, batch, False)[1]

        # One optimizer step per compiled call, or a chunk's steps (`train_chunk`).
        train = (jax_chunks.unrolled_train(jax.jit(train_step)) if self.steps_in_one_program
                 else jax_chunks.one_step(train_step))
        self._train_step: Any = (jax.jit(train, donate_argnums=0) if program.trains else None)
        self._eval_chunk = jax.jit(jax_chunks.conditioned_eval(jax.jit(eval_step),
                                                               program.zero_statistics))
        self._eval_whole = jax.jit(eval_step)

    def sync_from_model(self):
        """Takes the variables' values as the state, replicated over the mesh.

        On one device Keras keeps variables on that device, while the train
        step returns them on the 1-device mesh: placing them there first
        gives every call the same input types, so the program compiles once,
        not twice.
        """
        values = [v.value for v in self.program.variables]
        if self.distribution is not None:
            values = jax.device_put(values, self._replicated)
        self.state = values

    def distribute(self, stacked):
        """Shards a stacked chunk, a structure of numpy arrays of (K, batch,
        ...), along the batch axis (`P(None, 'batch')`) over the mesh.

        `make_array_from_process_local_data` takes this process's part of the
        global batches, so the same call serves one or many processes.
        """
        if self.distribution is None:
            return jax.tree.map(jax.numpy.asarray, stacked)
        return jax.tree.map(
            lambda a: jax.make_array_from_process_local_data(self._chunk_sharding, a), stacked)

    def train_chunk(self, chunk, num_steps):
        """Runs the chunk's first `num_steps` optimizer steps; blocks until done.

        On a CPU, one compiled call per step: XLA:CPU runs Keras' stock
        convolutions and pooling faster per step so than K steps unrolled in
        one program. Each call is dispatched while the one before runs, and
        waits for the one before that: at most two calls are in flight, and
        the second needs the first's state. With forced host devices, letting
        calls queue up without bound can deadlock XLA's all-reduce rendezvous
        ("RendezvousKey ... may be stuck"). On a GPU or TPU
        (`steps_in_one_program`), the chunk's steps in one program: there the
        host takes about as long to dispatch a call as the device to run a
        small step (docs/performance.md).
        """
        if self.steps_in_one_program:
            self.state, stats = self._train_step(self.state, chunk, num_steps)
            return jax.device_get(jax.block_until_ready(stats))
        per_step: list[dict] = []
        for k in range(num_steps):
            self.state, stats = self._train_step(self.state, chunk, k)
            if per_step:
                jax.block_until_ready(per_step[-1])
            per_step.append(stats)
        jax.block_until_ready(self.state)
        if not per_step:
            return {key: np.zeros((0, *shape), np.float32)
                    for key, shape in self.program.statistic_shapes().items()}
        return {key: np.stack([s[key] for s in jax.device_get(per_step)]) for key in per_step[0]}

    def eval_chunk(self, chunk, num_steps):
        """The chunk's eval steps; blocks on every device (see `train_chunk`).

        Reading a replicated result on the host waits for one device only, so
        the block is explicit here too.
        """
        return jax.block_until_ready(self._eval_chunk(self.state, chunk, num_steps))

    def eval_whole(self, batch):
        """Evaluates one batch (x, y, sample_weight) of any size, whole, counted once:
        replicated on every device, which all compute the same statistics."""
        if self.distribution is None:
            placed = jax.tree.map(jax.numpy.asarray, batch)
        else:
            placed = jax.tree.map(
                lambda a: jax.make_array_from_process_local_data(self._replicated, a), batch)
        return jax.block_until_ready(self._eval_whole(self.state, placed))

    def compiled_train_programs(self):
        """Programs in the train step's compile cache."""
        return self._train_step._cache_size()  # A private method of jax.jit.

    def any_worker(self, flag):
        """Whether `flag` is true on any worker: an all-gather every process calls
        at the same point; it returns host values, so it is waited for. With
        one process, no communication."""
        if self.shard[1] == 1:
            return bool(flag)
        flags = multihost_utils.process_allgather(np.array([bool(flag)], np.int32))
        return bool(np.any(flags))

    def replica_checksums(self):
        """One replica's: the program's state is one set of arrays, replicated by XLA."""
        return [[0] * len(self.program.variables)]

    def workers_values(self, values):
        if self.shard[1] == 1:
            return [list(values)]
        rows = multihost_utils.process_allgather(np.array(values, np.int32))
        return np.asarray(rows).reshape(self.shard[1], len(values)).tolist()

    def keras_fit_callbacks(self):
        """Callbacks that keep Keras' fit/evaluate alive on several CPU devices."""
        return [_BlockEachBatch()] if self.num_replicas > 1 else []

    def sync_to_model(self):
        """Writes the functional state back into the Keras variables."""
        for variable, value in zip(self.program.variables, self.state):
            variable.assign(value)


class _BlockEachBatch(keras.callbacks.Callback):
    """Waits for each batch's results in Keras' fit/evaluate.

    With several forced CPU devices, Keras' asynchronous JAX loop lets
    programs queue up and XLA's all-reduce rendezvous deadlocks (4 of 4
    `bench.py --replicas 2 --batch-size-per-replica 8` runs aborted without
    this), the same hazard `Engine.train_chunk` blocks against.
    """

    def on_train_batch_end(self, batch, logs=None):
        jax.block_until_ready(logs)

    on_test_batch_end = on_train_batch_end
