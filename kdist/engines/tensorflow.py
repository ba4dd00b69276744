"""TensorFlow engine: `tf.distribute.MirroredStrategy` (or no strategy), or
`MultiWorkerMirroredStrategy` across workers once `connect` ran."""

import functools
from typing import Any

import numpy as np
import tensorflow as tf

from kdist import tree
from kdist.engines import contract, tf_cluster, tf_function, tf_optimizer, tf_step
from kdist.engines.tf_cluster import connect as connect  # The engine module API: joining.
from kdist.engines.tf_cluster import connected as connected
from kdist.engines.tf_cluster import failed_collective as failed_collective
from kdist.engines.tf_cluster import is_chief as is_chief
from kdist.engines.tf_cluster import served_address as served_address


class Engine(contract.Engine):
    """Runs kdist's steps under a MirroredStrategy.

    Args:
        replicas: replica count (None: every GPU, or one CPU).
        distributed: False runs under TF's default strategy (no distribution),
            as for evaluating a restored model.
    """

    backend = "tensorflow"
    version = tf.__version__

    def __init__(self, replicas=None, distributed=True):
        self.shard, self.is_chief = (0, 1), True
        self.distributed = distributed
        if distributed and tf_cluster.connected():
            self.strategy, spec = tf_cluster.joined()
            self.devices = list(self.strategy.extended.worker_devices)
            self.shard, self.is_chief = (spec.worker_index, spec.num_workers), spec.is_chief
        elif distributed:
            devices = tf_cluster.replica_devices(replicas)
            # On CPUs, reduce on one device: TF's default collectives key their
            # groups per strategy, and a second strategy in the same process
            # with another device count then aborts ("joining a group with size").
            on_cpu = not tf.config.list_physical_devices("GPU")
            self.strategy = tf.distribute.MirroredStrategy(
                devices, cross_device_ops=tf.distribute.ReductionToOneDevice() if on_cpu else None)
            self.devices = list(self.strategy.extended.worker_devices)
        else:
            self.strategy = tf.distribute.get_strategy()
            self.devices = [None]  # No placement: TF's default device.
        self.num_replicas = self.strategy.num_replicas_in_sync
        self.num_local_replicas = len(self.devices)
        self.batch_shares = self.num_replicas  # Each replica runs its own step.
        self._sum_over_replicas = None  # The tf.function of `any_worker`, traced once.

    def scope(self):
        """Context in which the model, optimizer and variables must be created."""
        return self.strategy.scope()

    def outside_scope(self, variables):
        """Variables no strategy or another one holds: created outside `scope()`,
        a replica function cannot update them. Without a strategy, none."""
        if not self.distributed:
            return []
        return [v for v in variables
                if getattr(v.value, "_distribute_strategy", None) is not self.strategy]

    def primitives(self):
        """The step primitives of this engine (`kdist.step.context.Primitives`)."""
        return tf_step.Primitives()

    def compile_steps(self, program):
        """Builds the two chunk functions of `program` (a built
        `kdist.step.program.Program`), traced at their first call.

        Each replica runs the step on its slice of the batch
        (`tf_step.run_step`: its losses are its batch's, as on one device,
        and `kdist.value_and_grad` averages the gradients over replicas). The
        optimizers apply them in place, the same on every replica (their own
        per-replica sum is turned off, see `tf_optimizer.apply_reduced`).
        """
        self.program = program
        for optimizer in program.optimizers:
            tf_optimizer.apply_reduced(optimizer)
            tf_optimizer.apply_without_cond(optimizer)
        shapes = program.statistic_shapes()
        replica_step = functools.partial(tf_step.run_step, program, program.variables)

        self._train_chunk: Any = (self._distributed(lambda b: replica_step(b, True), shapes)
                             if program.trains else None)
        self._eval_chunk = self._distributed(lambda b: replica_step(b, False), shapes)
        self._eval_whole = self._counted_once(lambda b: replica_step(b, False, whole=True))

    def _counted_once(self, replica_fn):
        """A tf.function running `replica_fn` on one batch that every replica gets
        whole; the statistics of the first replica alone are returned."""
        strategy = self.strategy

        def first_replica_only(batch):
            first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
            return {key: tf.where(first, value, tf.zeros_like(value))
                    for key, value in replica_fn(batch).items()}

        def whole(batch):
            stats = strategy.run(first_replica_only, args=(batch,))
            return {key: strategy.reduce(tf.distribute.ReduceOp.SUM, value, None)
                    for key, value in stats.items()}

        return tf_function.own_function(whole)

    def _distributed(self, replica_fn, shapes):
        """A tf.function running `replica_fn` on each step of a stacked chunk.

        `tf.range` makes the loop a `tf.while_loop`: one trace whatever the
        chunk length K and step count, so compiling costs what one step costs
        (an unrolled loop of 8 steps on 2 replicas doubled the first epoch's time).
        Each step's statistics (`shapes`: {key: shape}) are summed over replicas.
        Across workers each replica keeps its steps' statistics packed in one
        (K, n) matrix, summed once at the chunk's end: one collective per
        chunk. In one process each statistic of each step is summed apart,
        which costs less there.
        """
        if self.shard[1] > 1:
            return self._summed_per_chunk(replica_fn, shapes)
        strategy = self.strategy

        def replica_fn_at(k):
            return lambda chunk: replica_fn(_map_arrays(lambda a: a[k], chunk))

        def steps(chunk, num_steps):
            per_step = {key: tf.TensorArray(tf.float32, size=num_steps) for key in shapes}
            for k in tf.range(num_steps):  # Batches from num_steps on are padding.
                stats = strategy.run(replica_fn_at(k), args=(chunk,))
                per_step = {key: values.write(k, strategy.reduce(
                    tf.distribute.ReduceOp.SUM, stats[key], None))
                    for key, values in per_step.items()}
            return {key: values.stack() for key, values in per_step.items()}

        return tf_function.own_function(steps)

    def _summed_per_chunk(self, replica_fn, shapes):
        """`_distributed` across workers: row k of each replica's (K, n) matrix
        holds step k's statistics, packed; one collective sums the matrices."""
        strategy = self.strategy
        sizes = [int(np.prod(shape)) for shape in shapes.values()]

        def replica_fn_at(k):
            def run(chunk, rows):
                stats = replica_fn(_map_arrays(lambda a: a[k], chunk))
                row = tf.concat([tf.reshape(stats[key], [-1]) for key in shapes], 0)
                return tf.tensor_scatter_nd_update(rows, [[k]], row[None])
            return run

        def steps(chunk, num_steps):
            rows = strategy.run(lambda: tf.zeros([num_steps, sum(sizes)]))
            for k in tf.range(num_steps):  # Batches from num_steps on are padding.
                rows = strategy.run(replica_fn_at(k), args=(chunk, rows))
            total = strategy.reduce(tf.distribute.ReduceOp.SUM, rows, None)
            return {key: tf.reshape(part, [num_steps, *shape]) for (key, shape), part in
                    zip(shapes.items(), tf.split(total, sizes, axis=1))}

        return tf_function.own_function(steps)

    def distribute(self, stacked):
        """Splits a stacked chunk, numpy arrays of (K, batch, ...), along the
        batch axis over this worker's replicas.

        With one worker a batch is the whole global batch; with several, this
        worker's shard. Replica ids count across workers, worker by worker.
        """
        per_replica = tf.nest.flatten(stacked)[0].shape[1] // self.num_local_replicas
        first = self.shard[0] * self.num_local_replicas

        def value_fn(ctx):
            i = ctx.replica_id_in_sync_group - first
            with tf.device(self.devices[i]):
                return _map_arrays(
                    lambda a: tf.constant(a[:, i * per_replica:(i + 1) * per_replica]), stacked)

        return self.strategy.experimental_distribute_values_from_function(value_fn)

    def train_chunk(self, chunk, num_steps):
        """The chunk's first `num_steps` optimizer steps; returns each step's
        summed statistics."""
        return self._train_chunk(chunk, tf.constant(num_steps))  # A tensor: no retrace.

    def eval_chunk(self, chunk, num_steps):
        """The chunk's first `num_steps` eval steps; returns each step's statistics."""
        return self._eval_chunk(chunk, tf.constant(num_steps))

    def eval_whole(self, batch):
        """Evaluates one batch (x, y, sample_weight) of any size, whole, counted once."""
        return self._eval_whole(_map_arrays(tf.constant, batch))

    def compiled_train_programs(self):
        """Traces of the train chunk's tf.function."""
        return self._train_chunk.experimental_get_tracing_count()

    def any_worker(self, flag):
        """Whether `flag` is true on any worker: an all-reduce every worker calls
        at the same point. With one worker, no communication."""
        if self.shard[1] == 1:
            return bool(flag)
        if self._sum_over_replicas is None:
            self._sum_over_replicas = tf_function.own_function(
                lambda values: self.strategy.reduce(tf.distribute.ReduceOp.SUM, values, None))
        values = self.strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(float(bool(flag))))
        return float(self._sum_over_replicas(values)) > 0

    def replica_checksums(self):
        """Per replica: each variable's component on that replica's device."""
        parts = [getattr(v.value, "values", (v.value,)) for v in self.program.variables]
        return [[tree.checksum([part[i].numpy()]) for part in parts]
                for i in range(len(parts[0]) if parts else 1)]

    def workers_values(self, values):
        """Every worker's `values`: each worker's first replica puts them in its
        row, and the strategy sums the rows over replicas."""
        index, workers = self.shard
        if workers == 1:
            return [list(values)]
        if self._sum_over_replicas is None:
            self._sum_over_replicas = tf_function.own_function(
                lambda values: self.strategy.reduce(tf.distribute.ReduceOp.SUM, values, None))
        local = self.num_replicas // workers

        def row(context):
            first = context.replica_id_in_sync_group % local == 0
            rows = np.zeros((workers, len(values)), np.float32)
            if first:
                rows[index] = values
            return tf.constant(rows)

        rows = self._sum_over_replicas(
            self.strategy.experimental_distribute_values_from_function(row))
        return np.rint(np.asarray(rows)).astype(np.int64).tolist()

    def keras_fit_callbacks(self):
        """Keras' fit needs nothing extra under a TF strategy."""
        return []

    def sync_to_model(self):
        """Variables are updated in place on TF: nothing to write back."""

    def sync_from_model(self):
        """The steps read the variables themselves: nothing to take back."""


def _map_arrays(fn, structure):
    """`fn` over a structure's arrays; None (no sample weights) stays None."""
    return tf.nest.map_structure(lambda a: None if a is None else fn(a), structure)
