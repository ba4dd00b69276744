"""TensorFlow engine: `tf.distribute.MirroredStrategy` (or no strategy), or
`MultiWorkerMirroredStrategy` across workers once `connect` ran."""

import os

import tensorflow as tf

from kdist import losses
from kdist.errors import UsageError


def split_cpu(count):
    """Splits the CPU into `count` logical devices, if TF has not started yet.

    The split must precede TensorFlow's first op, which is why engines are
    created before any tensor exists. Returns the logical CPU devices.
    """
    if count > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * count)
        except RuntimeError:
            pass  # Runtime already started: use the logical devices it has.
    return tf.config.list_logical_devices("CPU")


def _replica_devices(replicas):
    """Device names for `replicas` replicas: GPUs if any, else a split CPU."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if replicas is not None and replicas > len(gpus):
            raise UsageError(f"--replicas {replicas} but only {len(gpus)} GPUs are "
                             f"visible; pass --replicas {len(gpus)} or fewer")
        return [f"/gpu:{i}" for i in range(replicas or len(gpus))]
    replicas = replicas or 1
    cpus = split_cpu(replicas)
    if replicas > len(cpus):
        raise UsageError(f"--replicas {replicas} but TensorFlow already started with "
                         f"{len(cpus)} CPU devices; create the engine before any "
                         "TensorFlow op runs")
    return [d.name for d in cpus[:replicas]]


_connected = None  # (MultiWorkerMirroredStrategy, ClusterSpec) once connect() ran.


def connect(spec, replicas=None):
    """Creates the MultiWorkerMirroredStrategy of `spec`; blocks until every worker joins.

    TensorFlow requires this strategy before any other op. Flags become
    `TF_CONFIG`, which the strategy reads. On CPUs the collectives use RING
    (gRPC); each worker then has one replica, its CPU. On GPUs each worker
    uses all its GPUs.
    """
    global _connected
    if spec.source != "TF_CONFIG":
        os.environ["TF_CONFIG"] = spec.tf_config()
    on_cpu = not tf.config.list_physical_devices("GPU")
    implementation = tf.distribute.experimental.CommunicationImplementation
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=implementation.RING if on_cpu else implementation.AUTO)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    local = len(strategy.extended.worker_devices)
    if replicas is not None and replicas != local:
        raise UsageError(f"--replicas {replicas}: with several workers, each TensorFlow "
                         f"worker uses all its GPUs, or one CPU ({local} here); "
                         "leave --replicas out")
    _connected = (strategy, spec)


class Engine:
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
        if distributed and _connected:
            self.strategy, spec = _connected
            self.devices = list(self.strategy.extended.worker_devices)
            self.shard, self.is_chief = (spec.worker_index, spec.num_workers), spec.is_chief
        elif distributed:
            devices = _replica_devices(replicas)
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
        self._sum_over_replicas = None  # The tf.function of `any_worker`, traced once.

    def scope(self):
        """Context in which the model, optimizer and variables must be created."""
        return self.strategy.scope()

    def compile_steps(self, model, optimizer, global_batch_size, loss_fn):
        """Builds the two chunk functions (traced at their first call);
        `optimizer` must already be built."""
        self.model, self.optimizer = model, optimizer

        def model_call(images, training):
            return model(images, training=training)

        def replica_train_step(images, labels, weights):
            with tf.GradientTape() as tape:
                loss, stats = losses.forward(
                    model_call, (images, labels, weights), global_batch_size, loss_fn, True)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))  # All-reduces (SUM).
            return stats

        def replica_eval_step(images, labels, weights):
            _, stats = losses.forward(
                model_call, (images, labels, weights), global_batch_size, loss_fn, False)
            return stats

        self._train_chunk = self._distributed(replica_train_step)
        self._eval_chunk = self._distributed(replica_eval_step)

    def _distributed(self, replica_fn):
        """A tf.function running `replica_fn` on each step of a stacked chunk.

        `tf.range` makes the loop a `tf.while_loop`: one trace whatever the
        chunk length K and step count, so compiling costs what one step costs
        (an unrolled loop of 8 steps on 2 replicas doubled the first epoch's time).
        """
        strategy = self.strategy

        def replica_fn_at(k):
            return lambda images, labels, weights: replica_fn(images[k], labels[k], weights[k])

        @tf.function
        def steps(chunk, num_steps):
            per_step = tuple(tf.TensorArray(tf.float32, size=num_steps)
                             for _ in losses.STATISTICS)
            for k in tf.range(num_steps):  # Batches from num_steps on are padding.
                stats = strategy.run(replica_fn_at(k), args=chunk)
                per_step = tuple(
                    values.write(k, strategy.reduce(tf.distribute.ReduceOp.SUM, stats[key], None))
                    for values, key in zip(per_step, losses.STATISTICS))
            return {key: values.stack() for key, values in zip(losses.STATISTICS, per_step)}

        return steps

    def distribute(self, stacked):
        """Splits a stacked chunk, numpy arrays of (K, batch, ...), along the
        batch axis over this worker's replicas.

        With one worker a batch is the whole global batch; with several, this
        worker's shard. Replica ids count across workers, worker by worker.
        """
        per_replica = stacked[0].shape[1] // self.num_local_replicas
        first = self.shard[0] * self.num_local_replicas

        def value_fn(ctx):
            i = ctx.replica_id_in_sync_group - first
            with tf.device(self.devices[i]):
                return tuple(tf.constant(a[:, i * per_replica:(i + 1) * per_replica])
                             for a in stacked)

        return self.strategy.experimental_distribute_values_from_function(value_fn)

    def train_chunk(self, chunk, num_steps):
        """The chunk's first `num_steps` optimizer steps; returns each step's
        summed statistics."""
        return self._train_chunk(chunk, tf.constant(num_steps))  # A tensor: no retrace.

    def eval_chunk(self, chunk, num_steps):
        """The chunk's first `num_steps` eval steps; returns each step's statistics."""
        return self._eval_chunk(chunk, tf.constant(num_steps))

    def compiled_train_programs(self):
        """Traces of the train chunk's tf.function."""
        return self._train_chunk.experimental_get_tracing_count()

    def any_worker(self, flag):
        """Whether `flag` is true on any worker: an all-reduce every worker calls
        at the same point. With one worker, no communication."""
        if self.shard[1] == 1:
            return bool(flag)
        if self._sum_over_replicas is None:
            self._sum_over_replicas = tf.function(
                lambda values: self.strategy.reduce(tf.distribute.ReduceOp.SUM, values, None))
        values = self.strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(float(bool(flag))))
        return float(self._sum_over_replicas(values)) > 0

    def keras_fit_callbacks(self):
        """Keras' fit needs nothing extra under a TF strategy."""
        return []

    def sync_to_model(self):
        """Variables are updated in place on TF: nothing to write back."""
