"""The distribution math: N replicas == 1 replica, sharded inputs, exact eval."""

import keras
import numpy as np
import pytest
from helpers import prepare

from kdist import engines
from kdist.inputs import arrays
from kdist.loop import building, chunks, training
from kdist.models import losses
from kdist.models.cnn import create_model

# Plain SGD: Adam normalises the step and would hide a wrongly scaled gradient.
sgd = training.sgd


def weights_after_one_step(batch, replicas, distributed=True):
    engine = engines.create_engine(replicas, distributed=distributed)
    keras.utils.set_random_seed(7)
    model, _ = prepare(engine, len(batch[0]), optimizer_fn=sgd, learning_rate=0.5)
    before = [np.array(w) for w in model.get_weights()]
    stats = engine.train_chunk(engine.distribute(chunks.stack_chunk([batch])), 1)
    engine.sync_to_model()
    return before, [np.array(w) for w in model.get_weights()], \
        {k: float(np.asarray(v)[0]) for k, v in stats.items()}


@pytest.mark.parametrize("replicas", [2, 4])
def test_n_replicas_match_one_replica_after_a_step(batch, replicas):
    before, single, single_stats = weights_after_one_step(batch, 1, distributed=False)
    _, multi, multi_stats = weights_after_one_step(batch, replicas)
    # The step must move the weights far more than the tolerance, or the check is empty.
    assert max(np.abs(a - b).max() for a, b in zip(single, before)) > 1e-3
    for one, many in zip(single, multi):
        np.testing.assert_allclose(many, one, atol=1e-5, rtol=0)
    assert float(multi_stats["count"]) == float(single_stats["count"]) == 32.0
    assert np.isclose(float(multi_stats["loss_sum"]), float(single_stats["loss_sum"]), rtol=1e-5)


def test_one_mirrored_replica_matches_no_distribution(batch):
    _, plain, _ = weights_after_one_step(batch, 1, distributed=False)
    _, mirrored, _ = weights_after_one_step(batch, 1)
    for a, b in zip(plain, mirrored):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_a_doubled_loss_scale_would_be_caught(batch):
    # Guards the test above: scaling by half the global batch moves SGD weights
    # by far more than its tolerance.
    _, reference, _ = weights_after_one_step(batch, 1, distributed=False)
    doubled = (batch[0], batch[1], np.full(32, 2.0, np.float32))
    _, wrong, _ = weights_after_one_step(doubled, 1, distributed=False)
    assert max(np.abs(a - b).max() for a, b in zip(reference, wrong)) > 1e-3


@pytest.mark.parametrize("replicas", [2, 4])
def test_batches_are_split_across_replicas(batch, replicas):
    engine = engines.create_engine(replicas)
    distributed = engine.distribute(chunks.stack_chunk([batch, batch]))  # Two steps.
    if engine.backend == "jax":
        images = distributed[0]  # Stacked: (steps, batch, 28, 28, 1).
        assert tuple(images.sharding.spec)[:2] == (None, "batch")
        shards = images.addressable_shards
        assert len({s.device for s in shards}) == replicas
        assert [s.data.shape[:2] for s in shards] == [(2, 32 // replicas)] * replicas
        np.testing.assert_array_equal(np.asarray(images)[1], batch[0])
    else:
        parts = distributed[0].values  # Stacked per replica: (steps, batch, 28, 28, 1).
        assert len({p.device for p in parts}) == replicas
        assert [tuple(p.shape[:2]) for p in parts] == [(2, 32 // replicas)] * replicas
        np.testing.assert_array_equal(np.concatenate([p.numpy()[1] for p in parts]), batch[0])


def test_variables_are_replicated_on_every_device():
    engine = engines.create_engine(4)
    model, _ = building.build(engine, create_model, train=False)
    for variable in model.weights:
        if engine.backend == "jax":
            sharding = variable.value.sharding
            assert sharding.is_fully_replicated
            assert len(sharding.device_set) == 4
        else:
            copies = variable.value.values  # A MirroredVariable: one copy per device.
            assert len({c.device for c in copies}) == 4


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_evaluation_counts_every_example_once(small_dataset, replicas):
    engine = engines.create_engine(replicas)
    keras.utils.set_random_seed(1)
    global_batch = 16 * replicas  # 1,001 is a multiple of none of 16, 32, 64.
    model, step = prepare(engine, global_batch, train=False)
    images, labels = small_dataset.test_x, small_dataset.test_y
    results = chunks.evaluate(engine, step, images, labels, None, global_batch,
                             steps_per_execution=3)  # Chunks of 3, a shorter last one, a tail.
    logits = keras.ops.convert_to_numpy(model(images, training=False))
    correct = float((logits.argmax(-1) == labels).sum())
    assert results["accuracy"] == pytest.approx(correct / 1001, rel=1e-6)
    expected = np.asarray(losses.sparse_categorical_crossentropy(labels, logits)).mean()
    assert results["loss"] == pytest.approx(expected, rel=1e-5)


def test_replica_count_beyond_devices_is_a_clear_error():
    with pytest.raises(engines.UsageError, match="--replicas 64"):
        engines.create_engine(64)


def test_batch_that_does_not_split_across_replicas_is_a_clear_error(batch):
    engine = engines.create_engine(4)
    _, step = prepare(engine, 32, train=False)
    odd = (batch[0][:30], batch[1][:30], None)
    with pytest.raises(engines.UsageError, match="30 does not split evenly across 4"):
        chunks.run_steps(engine, engine.eval_chunk, [odd], chunks.zero_totals(step))


# JAX runs a chunk's steps in one program on accelerators, one call per step on CPUs.
ONE_PROGRAM = [False, True] if keras.backend.backend() == "jax" else [None]


@pytest.mark.parametrize("one_program", ONE_PROGRAM)
@pytest.mark.parametrize("replicas", [1, 2])
def test_chunked_steps_match_single_steps(small_dataset, replicas, one_program):
    def weights(steps_per_execution, one_program=None):
        engine = engines.create_engine(replicas)
        if one_program is not None:
            engine.steps_in_one_program = one_program
        keras.utils.set_random_seed(3)
        # Adam: a padding step applied by mistake would move the weights even
        # with zero gradients (momentum), where SGD would not show it.
        model, step = prepare(engine, 32, optimizer_fn=training.adam, learning_rate=1e-2)
        batches = arrays.train_batches(*small_dataset.split("train"),
                                     32, seed=0, epoch=0, steps=5)
        totals, done = chunks.run_steps(engine, engine.train_chunk, batches,
                                       chunks.zero_totals(step),
                                       steps_per_execution=steps_per_execution)
        engine.sync_to_model()
        assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 5
        assert engine.compiled_train_programs() == 1
        return [np.array(w) for w in model.get_weights()], totals, done

    single, single_totals, _ = weights(1)
    # A chunk of 4, then 1 step + 3 of padding.
    chunked, chunked_totals, done = weights(4, one_program)
    assert done == 5 and chunked_totals["count"] == single_totals["count"] == 160
    np.testing.assert_allclose(chunked_totals["loss_sum"], single_totals["loss_sum"],
                               rtol=1e-5)
    for a, b in zip(single, chunked):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)


@pytest.mark.parametrize("replicas", [1, 2])
def test_an_epoch_compiles_one_train_program(small_dataset, replicas):
    # Chunks of 3 over 7 steps: two full chunks, then a padded one. A state
    # that comes back with other shardings than it went in with (JAX, 1
    # device) or a new step count (TF) would compile the chunk again.
    engine = engines.create_engine(replicas)
    _, step = prepare(engine, 32, optimizer_fn=training.adam, learning_rate=1e-3)
    batches = arrays.train_batches(*small_dataset.split("train"), 32, seed=0, epoch=0, steps=7)
    _, done = chunks.run_steps(engine, engine.train_chunk, batches, chunks.zero_totals(step),
                              steps_per_execution=3)
    assert done == 7
    assert engine.compiled_train_programs() == 1


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA compiles on JAX only")
def test_jax_releases_the_compilers_memory_before_a_chunk_first_runs(small_dataset,
                                                                     monkeypatch):
    from kdist.runtime import memory

    released = []
    monkeypatch.setattr(memory, "release_freed_memory", lambda: released.append(True))
    monkeypatch.setattr(memory, "LONG_COMPILE_SECONDS", 0.0)  # Any compile counts.
    engine = engines.create_engine(2)
    prepare(engine, 32, optimizer_fn=training.adam, learning_rate=1e-3)
    chunk = engine.distribute(chunks.stack_chunk(list(arrays.train_batches(
        *small_dataset.split("train"), 32, seed=0, epoch=0, steps=2))))
    released.clear()  # Eager ops compiled while building the model.
    engine.train_chunk(chunk, 2)
    # JAX reports the chunk's compile under the event the engine listens to.
    assert released
    released.clear()
    engine.train_chunk(chunk, 2)
    assert not released  # Compiled once: later calls release nothing.
