"""Data from anywhere (kdist.inputs, kdist.inputs.pipelines): tf.data, PyDataset, functions, arrays.

Every kind trains like the same batches as arrays, evaluates every example
once, resumes mid-epoch exactly, and refuses bad data with one clear error
before anything is written. tf.data tests need TensorFlow (absent from the
JAX test environment: they skip there).
"""

import importlib.util
import os
import shutil
import threading
import time
import weakref

import keras
import numpy as np
import pytest
from helpers import SEVERAL
from test_training import StopAfter, checkpoint_arrays, without_timing

import kdist
from kdist import engines
from kdist.errors import DataError, UsageError
from kdist.inputs import base, batching, pipelines, sources, tfdata
from kdist.loop import building, chunks, prefetch, training

needs_tf = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                              reason="tf.data needs TensorFlow, not installed here")
SEED = 5


def toy(n, seed=0):
    """(x, y): 8 features, 4 classes from their signs."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = ((x[:, 0] > 0).astype("int32") * 2 + (x[:, 1] > 0)).astype("int32")
    return x, y


TRAIN, TEST = toy(400), toy(1001, seed=1)


def make_mlp():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class Batches(keras.utils.PyDataset):
    """A PyDataset of (x, y) in batches of `size` (the last one smaller)."""

    def __init__(self, x, y, size, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.size = x, y, size
        self.epochs = 0

    def __len__(self):
        return -(-len(self.x) // self.size)

    def __getitem__(self, index):
        rows = slice(index * self.size, (index + 1) * self.size)
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        self.epochs += 1


def in_batches(x, y, size):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def tf_data(x, y, size, shuffle=None):
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle is not None:  # Seeded, reshuffled at every iteration (the default).
        dataset = dataset.shuffle(len(x), seed=shuffle)
    return dataset.batch(size)


def config(tmp_path, name, **overrides):
    settings = dict(epochs=2, batch_size_per_replica=32 // SEVERAL, replicas=SEVERAL,
                    checkpoint_every=1, checkpoint_dir=str(tmp_path / name), seed=SEED,
                    progress=False)
    settings.update(overrides)
    return training.TrainConfig(**settings)


def train(tmp_path, name, data, log=lambda line: None, **overrides):
    return training.train_and_evaluate(config(tmp_path, name, **overrides), data,
                                       model_fn=make_mlp, log=log)


def final_weights(tmp_path, name):
    folder = tmp_path / name
    newest = sorted(os.listdir(folder))[-1]
    return checkpoint_arrays(str(folder / newest))


def max_difference(a, b):
    assert a.keys() == b.keys()
    return max(float(np.abs(np.asarray(a[k], np.float64) - b[k]).max()) for k in a)


# Re-cutting and checking batches.

def test_batches_of_any_size_are_recut_into_global_batches():
    x, y = TRAIN
    sizes = [5, 7, 3, 9, 1, 15]
    edges = np.cumsum([0] + sizes)
    check = batching.BatchCheck("the data")
    pairs = (check((x[a:b], y[a:b]), i) for i, (a, b) in enumerate(zip(edges, edges[1:])))
    got = list(batching.cut(batching.drop_rows(pairs, 4), 8))
    assert [rows for _, rows in got] == [8, 8, 8, 8, 4]
    np.testing.assert_array_equal(np.concatenate([b[0] for b, _ in got]), x[4:40])
    np.testing.assert_array_equal(np.concatenate([b[1] for b, _ in got]), y[4:40])


@pytest.mark.parametrize("batches, message", [
    ([(np.zeros((4, 8)), np.zeros(4)), (np.zeros((4, 9)), np.zeros(4))],
     r"batch 1 changes shape: its x holds float64 \(9,\) where the first batch's held "
     r"float64 \(8,\)"),
    ([(np.zeros((4, 8), "float32"), np.zeros(4)), (np.zeros((4, 8)), np.zeros(4))],
     "batch 1 changes shape: its x holds float64"),
    ([(np.zeros((4, 8)), np.zeros(3))],
     r"batch 0 holds arrays of different lengths \(x 4, y 3\)"),
    ([(np.zeros(8), np.zeros(()))], "batch 0 has a scalar y, a single example"),
    ([np.zeros((4, 8))], r"batch 0 is a ndarray; every batch must be a tuple \(x, y\) or "
                         r"\(x, y, sample_weight\) \(kdist reads y with every batch, unlike "
                         "fit, which also takes x alone: for a step of your own"),
])
def test_bad_batches_are_named(batches, message):
    check = batching.BatchCheck("the train data")
    with pytest.raises(DataError, match="the train data: " + message):
        for index, batch in enumerate(batches):
            check(batch, index)


@pytest.mark.parametrize("kind", ["arrays", "pydataset", "function", "tf.data"])
def test_workers_slices_make_the_global_batch_and_share_the_tail(kind):
    if kind == "tf.data" and importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tf.data needs TensorFlow, not installed here")
    x, y = TEST
    given = {"arrays": (x, y), "pydataset": Batches(x, y, 64),
             "function": lambda: iter(in_batches(x, y, 37)),
             "tf.data": lambda: tf_data(x, y, 100)}[kind]
    if kind == "tf.data":
        given = given()
    source = sources.source_for(given, "test")
    assert isinstance(source, base.Source)  # The interface every kind shares.
    one = list(source.evaluate(40))
    two = [list(source.evaluate(40, shard=(i, 2))) for i in range(2)]
    assert [whole for _, whole in one] == [False] * 25 + [True]
    for (batch, whole), first, second in zip(one, *two):
        if whole:  # The last 1 example, whole on every worker.
            assert first[1] and second[1] and len(batch[0]) == 1
            np.testing.assert_array_equal(first[0][0], batch[0])
        else:
            np.testing.assert_array_equal(np.concatenate([first[0][0], second[0][0]]),
                                          batch[0])
    np.testing.assert_array_equal(np.concatenate([b[0] for b, _ in one]), x)


def check_evaluation_shards(source, x):
    """`source`'s evaluation of `x` (1,001 examples) in global batches of 40: 25 full
    ones, each two workers' slices, then 1 example whole on every worker."""
    assert isinstance(source, base.Source)  # The interface every kind shares.
    one = list(source.evaluate(40))
    halves = [list(source.evaluate(40, shard=(i, 2))) for i in range(2)]
    assert [whole for _, whole in one] == [False] * 25 + [True]
    for (batch, whole), first, second in zip(one, *halves):
        parts = [first[0][0]] if whole else [first[0][0], second[0][0]]
        np.testing.assert_array_equal(np.concatenate(parts), batch[0])
    np.testing.assert_array_equal(np.concatenate([b[0] for b, _ in one]), x)


def test_pydataset_workers_read_only_the_batches_holding_their_rows():
    x, y = TRAIN
    read = []

    class Recording(Batches):
        def __getitem__(self, index):
            read.append(index)
            return super().__getitem__(index)

    source = sources.source_for(Recording(x, y, 8), "train")  # Reads batches 0 and 49.
    read.clear()
    slices = list(source.train(32, seed=SEED, epoch=0, shard=(1, 2)))
    order = np.random.default_rng([SEED, 0]).permutation(50)  # fit-like batch shuffle.
    assert len(slices) == 12 and sorted(read) == sorted(
        order[s * 4 + j] for s in range(12) for j in (2, 3))
    np.testing.assert_array_equal(slices[0][0], np.concatenate([x[8 * i:8 * i + 8]
                                                                for i in order[2:4]]))
    assert source.dataset.epochs == 1  # on_epoch_end after the epoch's batches.


# The background thread that prepares the next chunk.

def test_the_next_chunk_is_prepared_on_another_thread_while_one_runs():
    made = []

    def batches():
        for i in range(6):
            made.append((i, threading.current_thread() is threading.main_thread()))
            yield np.full((2, 1), i, np.float32), np.zeros(2, np.int32), None

    class Engine:
        num_local_replicas = num_replicas = 1
        shard = (0, 1)

        def distribute(self, stacked):
            return stacked

    seen = []

    def step_fn(chunk, count):
        deadline = time.monotonic() + 30
        while len(made) < min(6, 2 * (len(seen) + 2)) and time.monotonic() < deadline:
            time.sleep(0.01)  # The next chunk's batches are read while this one "runs".
        seen.append((int(chunk[0][0, 0, 0]), count, len(made)))
        return {"loss_sum": np.zeros(2)}

    _, done = chunks.run_steps(Engine(), step_fn, batches(), {"loss_sum": 0.0},
                              steps_per_execution=2)
    assert done == 6 and [s[:2] for s in seen] == [(0, 2), (2, 2), (4, 2)]
    assert seen[0][2] >= 4  # Chunk 2 was read before chunk 1 finished.
    assert not any(on_main for _, on_main in made)


def test_a_producer_error_reaches_the_consumer_and_close_stops_early():
    def failing():
        yield 1
        raise DataError("batch 1 is bad")

    items = prefetch.Prefetched(failing())
    assert next(items) == 1
    with pytest.raises(DataError, match="batch 1 is bad"):
        next(items)
    endless = prefetch.Prefetched(iter(range(10**9)))
    assert next(endless) == 0
    endless.close()  # Returns: the producer stops after the item it was making.


# Training: every kind equals the same batches as arrays; resume; bad input.

def test_every_kind_trains_like_the_same_batches(tmp_path):
    """A function of the epoch yielding kdist's own array order (in batches of 50)
    equals the arrays, and so do they without test data (no evaluation); a
    PyDataset equals a function yielding its batches in the (seed, epoch) order
    kdist takes them; tf.data (one epoch) equals the arrays."""
    x, y = TRAIN
    arrays = train(tmp_path, "arrays", base.Inputs((x, y), TEST))
    lines = []
    alone = train(tmp_path, "alone", base.Inputs((x, y)), log=lines.append)
    assert alone.restored is None and list(alone.history) == ["loss", "accuracy"]
    assert [{k: v for k, v in e.items() if not k.startswith("test_")}
            for e in without_timing(arrays.epochs)] == without_timing(alone.epochs)
    assert "(400 train, no test examples: no evaluation)" in lines[0], lines[0]
    assert max_difference(final_weights(tmp_path, "arrays"), final_weights(tmp_path, "alone")) == 0

    def arrays_order(epoch):
        order = np.random.default_rng([SEED, epoch]).permutation(len(x))
        return iter(in_batches(x[order], y[order], 50))

    function = train(tmp_path, "function", base.Inputs(arrays_order, TEST))
    worst = max_difference(final_weights(tmp_path, "arrays"), final_weights(tmp_path, "function"))
    print(f"\nmax weight difference {worst:.3g}")
    assert worst <= 1e-6, worst
    assert without_timing(function.epochs) == without_timing(arrays.epochs)

    batches = in_batches(x, y, 25)
    train(tmp_path, "pydataset", base.Inputs(Batches(x, y, 25), TEST))
    train(tmp_path, "its order", base.Inputs(lambda epoch: iter(
        [batches[i] for i in np.random.default_rng([SEED, epoch]).permutation(16)]), TEST))
    worst = max_difference(final_weights(tmp_path, "pydataset"),
                           final_weights(tmp_path, "its order"))
    print(f"\nmax weight difference {worst:.3g}")
    assert worst <= 1e-6, worst


@needs_tf
def test_tf_data_trains_like_the_same_batches_as_arrays(tmp_path):
    x, y = TRAIN
    train(tmp_path, "arrays", base.Inputs((x, y), TEST), epochs=1)
    order = np.random.default_rng([SEED, 0]).permutation(len(x))
    result = train(tmp_path, "tf", base.Inputs(tf_data(x[order], y[order], 30),
                                                 tf_data(*TEST, 100)), epochs=1)
    worst = max_difference(final_weights(tmp_path, "arrays"), final_weights(tmp_path, "tf"))
    print(f"\nmax weight difference {worst:.3g}")
    assert worst <= 1e-6, worst
    assert result.restored["checkpoint"].endswith("ckpt-00000012.weights.h5")


@needs_tf
def test_one_tf_data_pipeline_as_train_and_test_is_refused():
    """Each evaluation's pass moved the pipeline's reshuffling, which a resumed run
    did not replay: weights 9.1e-3 from the uninterrupted run's (TensorFlow)."""
    both = tf_data(*TRAIN, 25, shuffle=7)
    with pytest.raises(UsageError, match=r"^the train and test data are one tf.data pipeline: "
                                         "each evaluation's pass moves its reshuffling"):
        sources.prepare(base.Inputs(both, both))


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="strings in a model: TensorFlow's tensors alone hold them")
def test_string_inputs_train_as_fit_trains_them(tmp_path):
    """kdist's symbolic call gave Keras the strings' NumPy dtype: "Invalid dtype: object"."""
    import tensorflow as tf

    words = np.array(["red", "green", "blue", "cyan"])[np.arange(96) % 4]
    labels = (np.arange(96) % 4 < 2).astype(np.int32)

    def pipeline():
        return tf.data.Dataset.from_tensor_slices((words, labels)).batch(16)

    def make_model():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((), dtype="string"), keras.layers.StringLookup(
                vocabulary=["red", "green", "blue", "cyan"], output_mode="one_hot"),
            keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.5), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    reference = make_model()
    reference.fit(pipeline(), epochs=1, shuffle=False, verbose=0)
    result = kdist.train_and_evaluate(
        kdist.TrainConfig(epochs=1, batch_size_per_replica=16, replicas=1, progress=False,
                          checkpoint_dir=str(tmp_path / "ckpt")),
        base.Inputs(pipeline(), pipeline()), model_fn=make_model, log=lambda line: None)
    for ours, theirs in zip(result.model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    assert result.restored["test_accuracy"] == pytest.approx(
        reference.evaluate(pipeline(), verbose=0, return_dict=True)["accuracy"])


def test_evaluation_counts_every_example_once_whatever_the_kind():
    engine = engines.create_engine(2)
    keras.utils.set_random_seed(0)
    model, step = building.prepare_model(engine, 32, building.sample_rows(
        sources.prepare(base.Inputs(TRAIN, TEST))), make_mlp)
    engine.compile_steps(step)
    x, y = TEST
    kinds = [(x, y), Batches(x, y, 64), lambda: iter(in_batches(x, y, 37))]
    if importlib.util.find_spec("tensorflow"):
        kinds.append(tf_data(x, y, 100))
    results = [chunks.evaluate_source(engine, step, sources.source_for(k, "test"), 32, 4)
               for k in kinds]
    engine.sync_to_model()
    kernel, bias, out_kernel, out_bias = (np.asarray(w, np.float64) for w in model.get_weights())
    logits = np.maximum(x @ kernel + bias, 0) @ out_kernel + out_bias  # In NumPy, at once.
    shifted = logits - logits.max(axis=1, keepdims=True)
    losses = np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(y)), y]
    accuracy = float(np.mean(logits.argmax(axis=1) == y))
    for result in results:
        print(f"\nloss {result['loss'] - losses.mean():+.3g} from NumPy's, "
              f"accuracy {result['accuracy'] - accuracy:+.3g}")
        assert abs(result["loss"] - losses.mean()) <= 1e-5, (result, losses.mean())
        assert result["accuracy"] == pytest.approx(accuracy, abs=1e-7)


def resume_matches(tmp_path, make_inputs, stop_after=16):
    """Straight 2 epochs, and stopped in epoch 2 then resumed: the same weights and
    history; returns the resumed run's banner.

    Each run makes its inputs anew after the same global seed, as a new
    process running the same script would (a tf.data shuffle's seeds
    depend on TensorFlow's global seed when the dataset is made)."""
    def fresh_inputs():
        keras.utils.set_random_seed(1)
        return make_inputs()

    straight = train(tmp_path, "straight", fresh_inputs(), steps_per_execution=1)
    with pytest.raises(training.Interrupted, match="stopped at epoch 2, step"):
        training.train_and_evaluate(config(tmp_path, "resumed", steps_per_execution=1),
                                    fresh_inputs(), model_fn=make_mlp, log=lambda line: None,
                                    stop=StopAfter(stop_after))
    lines = []
    resumed = train(tmp_path, "resumed", fresh_inputs(), lines.append, steps_per_execution=1)
    worst = max_difference(final_weights(tmp_path, "straight"),
                           final_weights(tmp_path, "resumed"))
    print(f"\nmax |resumed - straight| = {worst:.3g}")
    assert worst <= 1e-6, worst
    assert without_timing(resumed.epochs) == without_timing(straight.epochs)
    return lines[0]


@needs_tf
def test_tf_data_that_reshuffles_every_epoch_resumes_mid_epoch_exactly(tmp_path):
    x, y = TRAIN
    source = sources.source_for(tf_data(x, y, 25, shuffle=7), "train")
    first = [next(iter(source.train(32, seed=0, epoch=e)))[0] for e in (0, 1)]
    assert not np.array_equal(*first)  # Each epoch has its own order: the replay matters.
    resume_matches(tmp_path, lambda: base.Inputs(tf_data(x, y, 25, shuffle=7),
                                                   tf_data(*TEST, 100)))


@needs_tf
@pytest.mark.parametrize("drop_remainder", [False, True], ids=["skip read", "tf skip"])
def test_a_tf_data_pass_resumed_at_a_step_is_the_rest_of_the_epoch(drop_remainder):
    x, y = TRAIN

    def made():
        keras.utils.set_random_seed(1)
        dataset = tf_data(x, y, 1, shuffle=7).unbatch().batch(24, drop_remainder=drop_remainder)
        return sources.prepare(base.Inputs(dataset, TEST)).train

    straight = made()
    epochs = [list(straight.train(32, seed=0, epoch=e)) for e in (0, 1)]
    resumed = list(made().train(32, seed=0, epoch=1, start_step=5))
    assert straight.batch == (24 if drop_remainder else None) and len(epochs[1]) == 12
    assert len(resumed) == 7 and not np.array_equal(epochs[0][5][0], epochs[1][5][0])
    for a, b in zip(epochs[1][5:], resumed):
        np.testing.assert_array_equal(a[0], b[0])


def test_pydataset_resumes_mid_epoch_exactly(tmp_path):
    banner = resume_matches(tmp_path, lambda: base.Inputs(Batches(*TRAIN, 25),
                                                            Batches(*TEST, 64)))
    assert "Data: train PyDataset, test PyDataset (400 train, 1,001 test examples)" in banner
    assert "train function" not in banner


def test_a_function_of_the_epoch_resumes_mid_epoch_exactly(tmp_path):
    x, y = TRAIN

    def shuffled(epoch):
        order = np.random.default_rng([9, epoch]).permutation(len(x))
        return iter(in_batches(x[order], y[order], 30))

    banner = resume_matches(tmp_path, lambda: base.Inputs(shuffled, TEST))
    assert ("; the train function is called again and its first 96 examples dropped: exact "
            "if it yields the same batches as before") in banner


@pytest.mark.any_backend  # The banner's note, the same for every engine.
def test_a_resumed_function_told_its_shard_drops_its_share_of_the_trained_batches():
    def told(epoch, shard):
        return iter(())

    def untold(epoch):
        return iter(())

    # 8 global batches of 16 trained, 2 workers: each function told its shard drops 64.
    for make, dropped in ((told, 64), (untold, 128)):
        note = pipelines.resume_note(pipelines.GeneratorSource(make, "train"), 8, 16, 2)
        assert f"its first {dropped} examples dropped" in note, note


def own_shares(told):
    """A train function yielding this replica's rows of each global batch of 32 (torch:
    one process each); it marks each shard it is told with a file in the folder `told`."""
    def batches(epoch, shard):
        index, count = shard
        (told / f"{index}-of-{count}").touch()
        x, y = TRAIN
        order, local = np.random.default_rng([4, epoch]).permutation(len(x)), 32 // count
        for start in range(0, len(x) - 31, 32):
            rows = order[start + index * local:start + (index + 1) * local]
            yield x[rows], y[rows]

    return batches


def test_a_function_told_its_shard_trains_two_replicas_like_one(tmp_path):
    """On torch each replica process reads only its share (`shard` = (rank, 2));
    in one process (TensorFlow, JAX) the function is told (0, 1) and read whole."""
    told = tmp_path / "told"
    told.mkdir()
    train(tmp_path, "two", base.Inputs(own_shares(told), TEST), replicas=2,
          batch_size_per_replica=16)
    shards = sorted(os.listdir(told))  # "0-of-1" also: the batch read to build the model.
    assert shards == (["0-of-1", "0-of-2", "1-of-2"] if keras.backend.backend() == "torch"
                      else ["0-of-1"])
    train(tmp_path, "one", base.Inputs(own_shares(told), TEST), replicas=1,
          batch_size_per_replica=32)
    worst = max_difference(final_weights(tmp_path, "two"), final_weights(tmp_path, "one"))
    assert worst <= 1e-5, worst


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """A checkpoint folder after one epoch of the toy data."""
    folder = tmp_path_factory.mktemp("one_epoch")
    train(folder, "run", base.Inputs(TRAIN, TEST), epochs=1)
    return folder / "run"


def changing_shape():
    x, y = TRAIN
    yield x[:50], y[:50]
    yield np.zeros((50, 9), "float32"), y[:50]


@pytest.mark.parametrize("train_data, error, message", [
    (changing_shape, DataError, r"the train data: batch 1 changes shape: its x holds "
                                r"float32 \(9,\) where the first batch's held float32 \(8,\)"),
    (lambda: iter([(TRAIN[0][:50], TRAIN[1][:49])]), DataError,
     r"the train data: batch 0 holds arrays of different lengths \(x 50, y 49\)"),
    (lambda: iter([]), DataError, "the train data is empty"),
    (lambda: iter([(TRAIN[0][:20], TRAIN[1][:20])]), DataError,
     "the train data holds 20 examples, fewer than one global batch of 32"),
    (Batches(TRAIN[0][:0], TRAIN[1][:0], 8), DataError, "the train data is empty"),
    (lambda epoch: iter(in_batches(*TRAIN, 50)) if not epoch else iter([]), DataError,
     "^epoch 2 of the train data is empty: every epoch of a stream needs one global batch$"),
    (iter(in_batches(*TRAIN, 50)), UsageError, "is an iterator, which can be read only once"),
    ((TRAIN[0], TRAIN[1][:-1]), DataError, r"train arrays differ in length \(x 400, y 399"),
])
def test_bad_training_data_is_one_clear_error_and_nothing_is_written(
        tmp_path, one_epoch, train_data, error, message):
    folder = tmp_path / "run"
    shutil.copytree(one_epoch, folder)
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    with pytest.raises(error, match=message):
        train(tmp_path, "run", base.Inputs(train_data, TEST), epochs=2)
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before


@needs_tf
def test_tf_data_must_be_batched_finite_and_non_empty():
    import tensorflow as tf

    x, y = TRAIN
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    with pytest.raises(DataError, match=r"a tf.data.Dataset of single examples .*batch it, "
                                        r"e.g. dataset.batch\(64\)"):
        sources.source_for(examples, "train")
    with pytest.raises(DataError, match="infinite tf.data.Dataset.*drop repeat"):
        sources.source_for(examples.batch(8).repeat(), "train")
    with pytest.raises(DataError, match="the test data is empty"):
        sources.prepare(base.Inputs(TRAIN, examples.batch(8).take(0)))
    with pytest.raises(DataError, match="the test data is empty"):
        sources.prepare(base.Inputs(TRAIN, examples.batch(8).filter(lambda a, b: False)))
    assert isinstance(sources.source_for(examples.batch(8), "train"), pipelines.TfDataSource)


@needs_tf
def test_tf_data_is_read_several_global_batches_at_a_time_where_shapes_allow():
    import tensorflow as tf

    x, y = TRAIN  # 400 rows of 8 float32 features.
    batched = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)
    assert tfdata.read_rows(batched.element_spec, 16) == 16 * tfdata.READ_BATCHES
    wide = tf.TensorSpec((None, tfdata.READ_BYTES // 4 // 32), tf.float32)
    assert tfdata.read_rows((wide, wide), 16) == 16  # Capped by READ_BYTES: one batch.
    ragged = batched.map(lambda a, b: (a[:, :tf.shape(a)[0] % 8 + 1], b))
    assert tfdata.read_rows(ragged.element_spec, 16) is None  # A dimension not known.
    source = sources.source_for(batched, "train")
    read = list(tfdata.numpy_batches(tfdata.for_reading(batched, 16), "the train data"))
    assert [len(b[0]) for b in read] == [128, 128, 128, 16]
    np.testing.assert_array_equal(np.concatenate([b[0] for b in read]), x)
    got = [b for b in source.train(16, seed=0, epoch=0, start_step=3)]
    np.testing.assert_array_equal(np.concatenate([b[0] for b in got]), x[48:400])
    assert source._reading(16) is source._reading(16)  # Made once, not once per epoch.


@needs_tf
def test_tf_data_parts_of_different_lengths_are_one_clear_error():
    import tensorflow as tf

    x, y = TRAIN
    unequal = tf.data.Dataset.zip((tf.data.Dataset.from_tensor_slices(x).batch(10),
                                   tf.data.Dataset.from_tensor_slices(y).batch(9)))
    source = sources.source_for(unequal, "train")
    with pytest.raises(DataError, match=r"the train data: .*holds arrays of different lengths"):
        list(source.train(16, seed=0, epoch=0))


@needs_tf
def test_a_tf_data_iterator_left_mid_epoch_is_deleted_off_the_reading_thread(monkeypatch):
    import tensorflow as tf

    x, y = TRAIN
    batched = tf.data.Dataset.from_tensor_slices((x, y)).batch(10).prefetch(tf.data.AUTOTUNE)
    deleted_on, finalizers, hand_over = [], [], tfdata.delete_later

    def watched(held):  # Records the thread on which the iterator is deleted.
        finalizers.append(weakref.finalize(
            held[0], lambda: deleted_on.append(threading.current_thread().name)))
        hand_over(held)

    monkeypatch.setattr(tfdata, "delete_later", watched)
    read = tfdata.numpy_batches(batched, "the train data")
    assert len(next(read)[0]) == 10
    read.close()  # As at an epoch's step limit: the rest of the epoch is not read.
    deadline = time.monotonic() + 30
    while not deleted_on and time.monotonic() < deadline:
        time.sleep(0.01)
    assert deleted_on == ["kdist-delete-iterator"]


def test_an_empty_test_set_fails_before_training():
    with pytest.raises(DataError, match="the test data is empty"):
        sources.prepare(base.Inputs(TRAIN, lambda: iter([])))
    with pytest.raises(UsageError, match="kdist.Inputs has no train data"):
        sources.prepare(base.Inputs(test=TEST))


# The README's examples.

def readme_blocks():
    """The Python blocks of the README's "Bring your data" section: the setup, then
    one example per kind of input."""
    import re

    from conftest import REPO

    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("## Bring your data", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.mark.parametrize("index, name, needs", [
    (1, "arrays", None), (2, "tf.data", "tensorflow"), (3, "PyDataset", None),
    (4, "generator", None), (5, "Grain", "grain"), (6, "TFRecord", "tensorflow")])
def test_readme_examples_train_from_each_kind(tmp_path, monkeypatch, capsys, index, name, needs):
    blocks = readme_blocks()
    assert len(blocks) == 7
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"the {name} example needs {needs}, not installed here")
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0] + blocks[index], f"README.md ({name})", "exec"), {})
    out = capsys.readouterr().out
    accuracy = float(out.split(f"{name}: test accuracy ")[1].split("%")[0])
    print(f"\n{name}: {accuracy}%")
    assert accuracy > 85.0, out
    assert sorted(os.listdir(tmp_path / f"{name}_checkpoints")) and "Epoch 2/2" in out


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="TensorFlow's CPU split precedes its first op")
def test_prepare_environment_splits_tensorflow_before_a_pipeline_is_built(tmp_path):
    import subprocess
    import sys

    script = """
import kdist
kdist.prepare_environment(replicas=2)
import tensorflow as tf
import kdist
from kdist import engines
tf.data.Dataset.range(4).batch(2)  # Starts TensorFlow.
print("replicas", engines.create_engine(2).num_replicas)
"""
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["replicas", "2"]


@pytest.mark.cross_backend
@needs_tf
@pytest.mark.skipif(keras.backend.backend() != "jax", reason="tf.data feeding JAX")
def test_tf_data_feeds_jax_as_it_feeds_tensorflow(tmp_path):
    """In the session with both frameworks (nox tests(backend='both'), on JAX)."""
    tests = [test_tf_data_trains_like_the_same_batches_as_arrays,
             test_tf_data_that_reshuffles_every_epoch_resumes_mid_epoch_exactly]
    for index, test in enumerate(tests):
        folder = tmp_path / str(index)
        folder.mkdir()
        test(folder)


def test_workers_agree_on_the_steps_of_a_chunk_when_their_shares_end_apart():
    """`chunks._agreed_steps` on 2 simulated workers (threads whose `any_worker` is an
    OR over both): each gets the smaller count, after one collective when both are full."""
    import threading

    from kdist.loop import chunks

    class Worker:  # any_worker: both threads meet, then see the OR of their flags.
        flags, barrier, calls = [False, False], threading.Barrier(2), [0, 0]

        def __init__(self, index):
            self.index = index

        def any_worker(self, flag):
            self.calls[self.index] += 1
            self.flags[self.index] = flag
            self.barrier.wait(timeout=10)
            both = any(self.flags)
            self.barrier.wait(timeout=10)
            return both

    for counts, agreed, calls in [((4, 4), 4, 1), ((4, 2), 2, 4), ((1, 3), 1, 3),
                                  ((0, 4), 0, 2)]:
        got, Worker.calls = [None, None], [0, 0]

        def run(index, counts=counts, got=got):
            got[index] = chunks._agreed_steps(Worker(index), counts[index], 4)

        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        assert got == [agreed, agreed] and Worker.calls == [calls, calls], counts


class Reshuffled(Batches):
    """Keras' pattern: rows reshuffled in `on_epoch_end`, by a seeded generator of its own."""

    def __init__(self, x, y, size):
        super().__init__(x, y, size)
        self.rng, self.rows = np.random.default_rng(3), np.arange(len(x))

    def __getitem__(self, index):
        rows = self.rows[index * self.size:(index + 1) * self.size]
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        super().on_epoch_end()
        self.rng.shuffle(self.rows)


def test_a_pydataset_that_reshuffles_in_on_epoch_end_resumes_exactly(tmp_path):
    """A resumed run calls the hooks of the epochs before it, once each, where the
    PyDataset has not seen them: a fresh one (a new process) reads what the
    uninterrupted run read, and the one that trained the first epochs is not
    moved again. Before, a fresh one read epoch 0's rows (weights 0.14 apart)."""
    def run(folder, epochs, data):
        config = training.TrainConfig(epochs=epochs, batch_size_per_replica=16, replicas=1,
                                      checkpoint_dir=str(tmp_path / folder), seed=SEED)
        result = training.train_and_evaluate(config, base.Inputs(data, None), make_mlp,
                                             log=lambda line: None)
        return result, [np.asarray(w) for w in result.model.get_weights()]

    straight, weights = run("straight", 3, Reshuffled(*TRAIN, 32))
    run("fresh", 2, Reshuffled(*TRAIN, 32))
    resumed, fresh = run("fresh", 3, Reshuffled(*TRAIN, 32))
    same = Reshuffled(*TRAIN, 32)
    run("same", 2, same)
    again, kept = run("same", 3, same)
    for result, got in ((resumed, fresh), (again, kept)):
        assert without_timing(result.epochs) == without_timing(straight.epochs)
        for a, b in zip(got, weights):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert same.epochs == 3


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is not None,
                    reason="the error of an install without TensorFlow")
def test_tfrecords_without_tensorflow_is_one_usage_error(tmp_path):
    """kdist[jax] or kdist[torch] alone: a 36-line traceback ending in
    `No module named 'tensorflow'` after the frameworks had loaded."""
    import kdist

    with pytest.raises(UsageError, match="kdist.TFRecords reads with tf.data, and TensorFlow "
                                         "is not installed: pip install tensorflow-cpu"):
        sources.prepare(base.Inputs(kdist.TFRecords(str(tmp_path)), None))
