"""The JAX engine's chunk functions, to be jitted: one step of a stacked chunk
by index, a chunk's train steps unrolled in one program, its eval steps each
under `lax.cond`."""

import jax


def one_step(step):
    """(state, stacked chunk, k) -> `step(state, the chunk's batch k)`: one program
    serves every step of every chunk (`k` is traced, not a constant)."""

    def indexed(state, chunk, k):
        return step(state, jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, k, keepdims=False), chunk))

    return indexed


def unrolled_train(step):
    """(state, stacked chunk, num_steps) -> (state, stats stacked per step): the
    chunk's K steps unrolled in one program. Batches from `num_steps` on are
    padding: their step is computed and its state dropped by an element-wise
    select, so an epoch's last, shorter chunk runs the same program (`lax.cond`
    would read its predicate on the host each step)."""

    def steps(state, chunk, num_steps):
        per_step = []
        for k in range(chunk_length(chunk)):
            new_state, stats = step(state, jax.tree.map(lambda a: a[k], chunk))  # noqa: B023
            state = jax.tree.map(lambda new, old: jax.numpy.where(k < num_steps, new, old),  # noqa: B023
                                 new_state, state)
            per_step.append(stats)
        return state, stack(per_step)

    return steps


def conditioned_eval(step, zero_statistics):
    """(state, stacked chunk, num_steps) -> stats stacked per step.

    Each batch runs under `lax.cond`, which skips the padding and, on XLA:CPU,
    keeps the K forward passes one after another: unconditioned, the eval
    chunk runs several times slower (docs/performance.md).
    """

    def skip(state, batch):
        return zero_statistics()

    def steps(state, chunk, num_steps):
        return stack([jax.lax.cond(k < num_steps, step, skip, state,
                                    jax.tree.map(lambda a: a[k], chunk))  # noqa: B023
                       for k in range(chunk_length(chunk))])

    return steps


def chunk_length(chunk):
    """K, the steps a stacked chunk holds."""
    return jax.tree.leaves(chunk)[0].shape[0]


def stack(per_step):
    """Per-step statistics (dicts) as one dict of arrays stacked per step."""
    return {key: jax.numpy.stack([s[key] for s in per_step]) for key in per_step[0]}
