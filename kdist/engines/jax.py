"""JAX engine: `keras.distribution.DataParallel` over a device mesh (or none).

After `connect` the mesh spans every process's devices (JAX multi-process).
"""

import contextlib
from typing import Any

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from kdist.engines import contract
from kdist.errors import UsageError
from kdist.step.optimizer import ema_variables, loss_scale, skipped


def connect(spec, replicas=None):
    """Starts JAX's distributed runtime; blocks until every process has joined.

    `keras.distribution.initialize` wraps `jax.distributed.initialize`
    (worker 0 is the coordinator) and must precede any other JAX use. On CPUs
    the cross-process collectives are gloo's: the default of jax 0.10.2, set
    explicitly because without a CPU collectives implementation a step
    across processes cannot run.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    keras.distribution.initialize(",".join(spec.addresses), spec.num_workers,
                                  spec.worker_index)


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
            f"--replicas {replicas} but JAX sees {len(devices)} devices; on a CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={replicas} before jax "
            "is imported (scripts/train.py does this for you)")
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
        self.is_chief = jax.process_index() == 0
        # Set before any Keras object exists, so variables are laid out on the mesh.
        keras.distribution.set_distribution(self.distribution)
        self.devices = ([str(d) for d in self.distribution.device_mesh.devices.flat]
                        if self.distribution else [str(jax.local_devices()[0])])
        if self.distribution is not None:  # Variables everywhere; chunks split on batch.
            mesh = self.distribution.device_mesh.backend_mesh
            self._replicated = NamedSharding(mesh, PartitionSpec())
            self._chunk_sharding = NamedSharding(
                mesh, PartitionSpec(None, self.distribution.batch_dim_name))

    def scope(self):
        """Context in which the model, optimizer and variables must be created."""
        return self.distribution.scope() if self.distribution else contextlib.nullcontext()

    def compile_steps(self, step, optimizer):
        """Takes the model's state as arrays and jits the two chunk functions
        of `step` (a `kdist.step.compiled.Step`); `optimizer` (None: evaluation only)
        must already be built.

        The program sees the whole sharded global batch, so the step's
        loss is the global-batch loss (share 1, times the optimizer's loss
        scale read from its state, `kdist.step.optimizer.loss_scale`) and its
        gradients are already summed over devices (XLA all-reduces them).
        A `LossScaleOptimizer`'s `stateless_apply` unscales them and skips
        a step whose gradients are not finite (`skipped`). Evaluation uses
        the optimizer's moving averages of the weights if it keeps them
        (`kdist.step.optimizer.ema_variables`).
        """
        self.model, self.optimizer = step.model, optimizer
        self._read_state()

        def compute(trainable, non_trainable, batch, training, scale=None):
            return step.loss_and_updates(trainable, non_trainable, batch, training,
                                         loss_scale=scale)

        def train_step(state, batch):
            trainable, non_trainable, opt_vars = state
            grad_fn = jax.value_and_grad(compute, has_aux=True)
            (_, (stats, updated)), grads = grad_fn(trainable, non_trainable, batch, True,
                                                   loss_scale(optimizer, opt_vars))
            stats = dict(stats, skipped=skipped(optimizer, grads))
            trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
            non_trainable = [old if new is None else new
                             for old, new in zip(non_trainable, updated)]
            return (trainable, non_trainable, opt_vars), stats

        averages = ema_variables(optimizer, self.model.trainable_variables)
        # Where in the optimizer's state each weight's moving average is.
        ema_index = None if averages is None else [
            next(i for i, v in enumerate(optimizer.variables) if v is a) for a in averages]

        def eval_step(state, batch):
            trainable, non_trainable, opt_vars = state
            if ema_index is not None:
                trainable = [opt_vars[i] for i in ema_index]
            _, (stats, _) = compute(trainable, non_trainable, batch, False)
            return stats

        # Each step is jitted on its own, so it is traced once and called K
        # times in the chunk's program (faster tracing and compiling).
        self._train_chunk: Any = jax.jit(_train_chunk(jax.jit(train_step)), donate_argnums=0)
        self._eval_chunk = jax.jit(_eval_chunk(jax.jit(eval_step), step.zero_statistics))
        self._eval_whole = jax.jit(eval_step)

    def _read_state(self):
        """Takes the variables' values as the state, replicated over the mesh.

        On one device Keras keeps variables on that device, while the train
        step returns them on the 1-device mesh: placing them there first
        gives every call the same input types, so the program compiles once,
        not twice.
        """
        values = tuple([v.value for v in vs] for vs in self._variable_lists())
        if self.distribution is not None:
            values = jax.device_put(values, self._replicated)
        self.state = values

    def _variable_lists(self):
        """The Keras variables behind the three parts of `self.state`."""
        opt_vars = self.optimizer.variables if self.optimizer is not None else []
        return (self.model.trainable_variables, self.model.non_trainable_variables, opt_vars)

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
        """Runs the chunk's first `num_steps` optimizer steps in one compiled call;
        blocks until done.

        Blocking on every call's result keeps one multi-device program in
        flight at a time: on a CPU with forced host devices, letting calls
        queue up can deadlock XLA's all-reduce rendezvous ("RendezvousKey ...
        may be stuck"). Within one call the steps' all-reduces run in order.
        """
        self.state, stats = self._train_chunk(self.state, chunk, num_steps)
        jax.block_until_ready(self.state)
        return stats

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
        """Programs in the train chunk's compile cache."""
        return self._train_chunk._cache_size()  # A private method of jax.jit.

    def any_worker(self, flag):
        """Whether `flag` is true on any worker: an all-gather every process calls
        at the same point; it returns host values, so it is waited for. With
        one process, no communication."""
        if self.shard[1] == 1:
            return bool(flag)
        flags = multihost_utils.process_allgather(np.array([bool(flag)], np.int32))
        return bool(np.any(flags))

    def keras_fit_callbacks(self):
        """Callbacks that keep Keras' fit/evaluate alive on several CPU devices."""
        return [_BlockEachBatch()] if self.num_replicas > 1 else []

    def sync_to_model(self):
        """Writes the functional state back into the Keras variables."""
        for variables, values in zip(self._variable_lists(), self.state):
            for variable, value in zip(variables, values):
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


def _train_chunk(step):
    """(state, stacked chunk, num_steps) -> (state, stats stacked per step).

    A Python loop over the chunk's K batches, unrolled when traced: on XLA:CPU
    this runs faster than one call per step and than `lax.scan`. Batches from
    `num_steps` on are padding: their step is computed but its state is
    dropped by an element-wise select, so an epoch's last, shorter chunk
    reuses the same program instead of compiling another (`lax.cond` there
    slows training on XLA:CPU; docs/performance.md has the figures).
    """

    def steps(state, chunk, num_steps):
        per_step = []
        for k in range(_chunk_length(chunk)):
            new_state, stats = step(state, jax.tree.map(lambda a: a[k], chunk))  # noqa: B023
            active = k < num_steps
            state = jax.tree.map(lambda new, old: jax.numpy.where(active, new, old),  # noqa: B023
                                 new_state, state)
            per_step.append(stats)
        return state, _stack(per_step)

    return steps


def _eval_chunk(step, zero_statistics):
    """(state, stacked chunk, num_steps) -> stats stacked per step.

    Each batch runs under `lax.cond`, which skips the padding and, on XLA:CPU,
    keeps the K forward passes one after another: unconditioned, the eval
    chunk runs several times slower (docs/performance.md).
    """

    def skip(state, batch):
        return zero_statistics()

    def steps(state, chunk, num_steps):
        return _stack([jax.lax.cond(k < num_steps, step, skip, state,
                                    jax.tree.map(lambda a: a[k], chunk))  # noqa: B023
                       for k in range(_chunk_length(chunk))])

    return steps


def _chunk_length(chunk):
    return jax.tree.leaves(chunk)[0].shape[0]


def _stack(per_step):
    return {key: jax.numpy.stack([s[key] for s in per_step]) for key in per_step[0]}
