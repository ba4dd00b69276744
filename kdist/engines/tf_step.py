"""What runs inside one TensorFlow replica's step: the step primitives (a
`tf.GradientTape`, the replica context's all-reduce), each replica's seed
offsets, the updates a step assigns, and Keras' losses as on one device."""

import contextlib

import keras
import tensorflow as tf
from keras.src.losses import loss as loss_module  # Its replica scaling (see below).

from kdist.engines import contract
from kdist.runtime import patches
from kdist.step import context as step_context
from kdist.step.context import current_scope, loss_of, substituted


def seed_offsets(variables, replica_id, training):
    """Per variable, what replica `replica_id` adds to it before its train step: a
    shift of each `keras.random.SeedGenerator` state, so every replica draws
    its own dropout masks (replica 0 draws what one device would); None for
    other variables, and for all in evaluation."""
    def offset(variable):
        if not training or not variable.path.endswith("seed_generator_state"):
            return None
        shift = tf.cast(replica_id * contract.SEED_STRIDE, variable.dtype)
        return tf.stack([shift, tf.zeros((), variable.dtype)])
    return [offset(v) for v in variables]


def assign_updates(context, variables, changed, offsets):
    """Writes what a train step assigned (outside its optimizers), equal on every replica.

    Seed states lose their replica's shift (every replica then holds the
    same advanced state). A variable declared with an `aggregation` moves
    as one device's would where its update adds up over the rows: "sum" by
    the sum of the replicas' changes (a running count or sum), "mean" by
    their mean, "only_first_replica" to the first replica's value. Other
    float updates (BatchNormalization's moving statistics) move by the mean
    of the replicas' changes, which for a moving mean is the change the
    global batch's mean would make; the rest are assigned as they are.
    """
    updated = [(v, changed[id(v)], o) for v, o in zip(variables, offsets) if id(v) in changed]
    declared = [(v, new) for v, new, o in updated if o is None and v.aggregation != "none"]
    floats = [(v, new) for v, new, o in updated
              if o is None and v.aggregation == "none" and keras.backend.is_float_dtype(v.dtype)]
    first = tf.equal(context.replica_id_in_sync_group, 0)
    for variable, new in declared:  # TensorFlow aggregates what each replica assigns:
        if variable.aggregation == "sum":  # it sums the first replica's new value
            variable.assign(tf.where(first, new, new - variable.value))  # and the others' changes.
        else:  # "mean": the mean of the new values; "only_first_replica": the first's.
            variable.assign(new)
    if floats:
        changes = context.all_reduce(tf.distribute.ReduceOp.MEAN,
                                     [new - v.value for v, new in floats])
        for (variable, _), change in zip(floats, changes):
            variable.assign(variable.value + change)
    for variable, new, offset in updated:
        if offset is not None:
            variable.assign(new - offset)
        elif variable.aggregation == "none" and not keras.backend.is_float_dtype(variable.dtype):
            variable.assign(new)


def keras_losses_unscaled():
    """Keras' losses as on one device while a replica's step is traced.

    Under a `tf.distribute` strategy, Keras divides every mean loss by the
    replica count (`keras.src.losses.loss.scale_loss_for_distribution`) for
    its own train step, which sums gradients over replicas. kdist's rule is
    the same on every backend: a step's losses are its batch's, and
    `kdist.value_and_grad` averages the gradients. So the division is
    turned off here (and its inverse, which Keras' loss trackers apply), on
    every replica's thread (`kdist.runtime.patches`).
    """
    return _UNSCALED.active()


def _unchanged(value):
    return value


_UNSCALED = patches.Patch([(loss_module, "scale_loss_for_distribution", _unchanged),
                           (loss_module, "unscale_loss_for_distribution", _unchanged)])


class Primitives(step_context.Primitives):
    """`kdist.step.context.Primitives` on TensorFlow: a `tf.GradientTape`, and the
    replica context's all-reduce."""

    applies_in_scope = False  # Keras' TF optimizers update the tf.Variables themselves.

    def __init__(self, whole=False):
        self.whole = whole  # Every replica sees the whole batch (`eval_whole`).

    def value_and_grad(self, context, fn, variables, tensors, scale):
        """Differentiates `fn(*tensors)` on a tape. Outside a replica (the building
        run, under the strategy's scope) a distributed variable cannot be
        differentiated, so the variables are read as watched copies there, and
        in every building run: eagerly, Keras' float8 layers' custom gradients
        fail on the variables they read (as `fit(run_eagerly=True)` does).
        A gradient the tape gives as `tf.IndexedSlices` (an `Embedding`'s: one
        slice per row looked up) comes back as the dense tensor it sums to, as
        on JAX and torch: `keras.ops` then read the gradient, not its slices."""
        cross_replica = tf.distribute.in_cross_replica_context() or context.dry
        scope = current_scope()
        sources = [tf.identity(v.value) if cross_replica else scope.get_current_value(v)
                   for v in variables]
        with (substituted(list(zip(variables, sources))) if cross_replica
              else contextlib.nullcontext()), tf.GradientTape() as tape:
            for watched in list(tensors) + sources:  # Non-trainable variables too.
                if watched.dtype.is_floating:
                    tape.watch(watched)
            value = fn(*tensors)
            loss = loss_of(value, scale)
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in tape.gradient(loss, sources + list(tensors))]
        return value, grads[:len(sources)], grads[len(sources):]

    def sum_over_replicas(self, grads):
        if self.replicas_sharing() == 1:
            return grads
        context = tf.distribute.get_replica_context()
        present = [i for i, g in enumerate(grads) if g is not None]
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in present])
        out = list(grads)
        for i, g in zip(present, reduced):
            out[i] = g
        return out

    def replicas_sharing(self):
        context = tf.distribute.get_replica_context()
        return 1 if self.whole or context is None else context.num_replicas_in_sync

    def sum_over_shares(self, values):
        context = tf.distribute.get_replica_context()
        return context.all_reduce(tf.distribute.ReduceOp.SUM, list(values))

    def gather_shares(self, tensors):
        # TensorFlow's all-gather is differentiable: its gradient all-reduces. One
        # call per tensor: the gradient of one call packs all its tensors' into one.
        context = tf.distribute.get_replica_context()
        return [context.all_gather(tensor, axis=0) for tensor in tensors]

    def apply(self, context, optimizer, apply, grads, variables):
        with context.optimizer_applying():
            return apply(grads, variables)


def run_step(program, variables, batch, training, whole=False):
    """One replica's step of `program` on its slice `batch` (`whole`: every replica
    sees the whole batch), in a replica context.

    Its seed states are shifted by its replica id (`seed_offsets`), Keras'
    losses are unscaled (`keras_losses_unscaled`), and in training what the
    step assigned outside its optimizers is written back equal on every
    replica (`assign_updates`). The first replica alone reports a skipped
    step, so the sum over replicas counts it once.
    """
    context = tf.distribute.get_replica_context()
    offsets = seed_offsets(variables, context.replica_id_in_sync_group, training)
    mapping = [(v, v.value + o) for v, o in zip(variables, offsets) if o is not None]
    with keras_losses_unscaled():
        stats, scope = program.run(Primitives(whole), training, batch, mapping)
    if training:
        assign_updates(context, variables, scope.changed(), offsets)
    first = tf.equal(context.replica_id_in_sync_group, 0)
    return dict(stats, skipped=tf.where(first, stats["skipped"], 0.0))
