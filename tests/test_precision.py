"""Mixed precision (`--precision`, `kdist.precision`): the dtype policy, loss
scaling under mixed_float16, skipped steps, checkpoints across precisions,
and N replicas against 1 within the precision's own rounding.

Tolerances come from the compute dtype's unit roundoff u (half the spacing
of numbers at 1): bfloat16 keeps 8 significant bits, u = 2^-8 (0.39%);
float16 keeps 11, u = 2^-11 (0.049%). The models are tiny and the steps few.
"""

import json
import warnings

import keras
import numpy as np
import pytest
from keras import ops
from test_training import checkpoint_arrays

import kdist
from kdist import checkpoints, config, engines, tree
from kdist.bench.measure import format_table
from kdist.cli import flags
from kdist.cli import train as train_cli
from kdist.errors import UsageError
from kdist.inputs import arrays
from kdist.loop import building, chunks, reporting, training
from kdist.models.cnn import create_model
from kdist.records import EpochRecord

BACKEND = keras.backend.backend()
UNIT_ROUNDOFF = {"mixed_bfloat16": 2.0 ** -8, "mixed_float16": 2.0 ** -11}
COMPUTE_DTYPE = {"float32": "float32", "mixed_bfloat16": "bfloat16",
                 "mixed_float16": "float16"}

rng = np.random.default_rng(0)
IMAGES = rng.normal(size=(32, 8, 8, 1)).astype(np.float32)
LABELS = rng.integers(0, 3, 32).astype(np.int32)
FEATURES = rng.normal(size=(64, 6)).astype(np.float32)
CLASSES = (FEATURES[:, :3].argmax(axis=1)).astype(np.int32)


@pytest.fixture(autouse=True)
def float32_policy_around_each_test():
    """Every test starts and ends under Keras' default policy."""
    keras.config.set_dtype_policy("float32")
    yield
    assert keras.config.dtype_policy().name == "float32", "a test left its policy set"


def compiled(layers, optimizer):
    """A model_fn: `layers()` in a Sequential, compiled with `optimizer()` as for fit."""

    def build():
        model = keras.Sequential(layers())
        model.compile(optimizer=optimizer(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    return build


def tiny_cnn():
    return [keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Flatten(), keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, dtype="float32")]


def tiny_mlp():
    return [keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, dtype="float32")]


def sgd(rate=0.5, **kwargs):
    return lambda: keras.optimizers.SGD(rate, **kwargs)


def scaled_sgd(initial_scale, rate=0.5, dynamic_growth_steps=2000):
    """SGD in a LossScaleOptimizer whose scale starts at `initial_scale`."""
    return lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(rate), initial_scale=initial_scale,
        dynamic_growth_steps=dynamic_growth_steps)


def train(model_fn, precision, replicas, batches, sample=(IMAGES[:2], LABELS[:2], None),
          chunk=4):
    """`batches` on `replicas` replicas (None: undistributed), `chunk` steps per
    compiled call, as the loop runs them (`kdist.loop.chunks.run_steps`).

    Returns (weights before, weights after, model, per-step statistics, totals)."""
    engine = engines.create_engine(replicas or 1, distributed=replicas is not None)
    keras.utils.set_random_seed(1)
    model, step = building.prepare_model(engine, len(tree.leaves(batches[0][0])[0]), sample,
                                         model_fn, precision=precision)
    before = [np.array(w) for w in model.get_weights()]
    engine.compile_steps(step)
    per_step = []
    totals, _ = chunks.run_steps(engine, engine.train_chunk, batches, chunks.zero_totals(step),
                                on_step=lambda done, stats, totals, end: per_step.append(stats),
                                steps_per_execution=min(chunk, len(batches)))
    engine.sync_to_model()
    stats = {key: np.array([s[key] for s in per_step]) for key in per_step[0]}
    return before, [np.array(w) for w in model.get_weights()], model, stats, totals


def number(value):
    return float(np.asarray(keras.ops.convert_to_numpy(value)))


# The policy.

def test_precision_holds_while_the_model_is_built_and_the_callers_policy_comes_back():
    def uncompiled():
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                 keras.layers.Dense(3, dtype="float32")])

    engine = engines.create_engine(1, distributed=False)
    keras.config.set_dtype_policy("mixed_bfloat16")  # The caller's own choice.
    try:
        model, optimizer = building.build(engine, uncompiled, training.sgd, 0.1,
                                          precision="mixed_float16")
        assert keras.config.dtype_policy().name == "mixed_bfloat16"
        assert [layer.dtype_policy.name for layer in model.layers] == [
            "mixed_float16", "float32"]  # The user's float32 layer keeps its dtype.
        assert all(v.dtype == "float32" for v in model.weights + optimizer.variables
                   if "iteration" not in v.path and "step_counter" not in v.path)
        # Keras' compile adds dynamic loss scaling to a mixed_float16 model.
        assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

        kept, _ = building.build(engine, uncompiled, training.sgd, 0.1, precision=None)
        assert kept.layers[0].dtype_policy.name == "mixed_bfloat16"

        def failing():
            assert keras.config.dtype_policy().name == "float32"
            raise RuntimeError("model_fn failed")

        with pytest.raises(RuntimeError, match="model_fn failed"):
            building.build(engine, failing, precision="float32")
        assert keras.config.dtype_policy().name == "mixed_bfloat16"
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("precision", ["mixed_bfloat16", "mixed_float16"])
def test_the_cnn_computes_in_the_policy_with_float32_variables_and_logits(precision):
    engine = engines.create_engine(1, distributed=False)
    model, _ = building.build(engine, create_model, train=False, precision=precision)
    # The symbolic outputs carry the dtypes the layers compute in.
    assert [layer.output.dtype for layer in model.layers] == \
        [COMPUTE_DTYPE[precision]] * (len(model.layers) - 1) + ["float32"]
    assert {v.dtype for v in model.weights} == {"float32"}
    # Keras' own default for a last layer without dtype: logits in the compute dtype.
    with _policy(precision):
        plain = keras.layers.Dense(3)
    assert plain(keras.KerasTensor((2, 4))).dtype == COMPUTE_DTYPE[precision]


class _policy:
    """Keras' global policy `name` inside the block (for layers the test makes)."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        keras.config.set_dtype_policy(self.name)

    def __exit__(self, *exc):
        keras.config.set_dtype_policy("float32")


def test_precision_is_checked_as_a_setting_and_a_flag(tmp_path):
    with pytest.raises(UsageError, match="precision must be one of float32, mixed_bfloat16, "
                                         "mixed_float16, got 'float16'"):
        training.TrainConfig(precision="float16")
    args = train_cli.train_parser().parse_args(["--precision", "mixed_bfloat16"])
    assert flags.config_from_args(args).precision == "mixed_bfloat16"
    assert train_cli.train_parser().parse_args([]).precision is None  # Keras' global policy.
    with pytest.raises(SystemExit):
        train_cli.train_parser().parse_args(["--precision", "bfloat16"])
    bench_flag = flags.names(config.PRECISIONS)  # kdist-bench --precision
    assert bench_flag("float32,mixed_bfloat16,float32") == ("float32", "mixed_bfloat16")
    with pytest.raises(Exception, match="expected one or more of"):
        bench_flag("float32,fp8")


class Scale(keras.layers.Layer):
    """x times a weight, element by element: float64 through and through on every
    backend (Keras' torch matmul returns float32 for float64 operands)."""

    def build(self, shape):
        self.w = self.add_weight(shape=shape[1:], initializer="ones")

    def call(self, x):
        return x * self.w


def scaling_model():
    model = keras.Sequential([keras.Input((4,)), Scale()])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


@pytest.mark.skipif(BACKEND == "jax", reason="JAX computes in float64 only where "
                    "JAX_ENABLE_X64 was set before it started (its own rule)")
def test_the_callers_float64_policy_trains_two_replicas_as_one_to_float64s_precision(
        tmp_path):
    # No precision= given: the model is built under the caller's global policy, also
    # in torch's replica processes, and their gradients are summed in float64.
    x = np.random.default_rng(1).normal(size=(64, 4))
    y = 3 * x + np.random.default_rng(2).normal(size=(64, 4))
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        weights = [kdist.train_and_evaluate(
            kdist.TrainConfig(epochs=2, batch_size_per_replica=16 // replicas,
                              replicas=replicas, checkpoint_dir=str(tmp_path / str(replicas))),
            kdist.Inputs(train=(x, y), test=(x, y)), model_fn=scaling_model,
            log=lambda line: None).model.get_weights()[0] for replicas in (1, 2)]
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")
    assert [w.dtype for w in weights] == [np.float64, np.float64]
    assert np.abs(weights[0] - 1).min() > 0.1  # Trained.
    # Summed in float32, the two differ by 9e-9 on torch.
    np.testing.assert_allclose(weights[1], weights[0], rtol=0, atol=1e-13)


# N replicas against 1.

@pytest.fixture(scope="module")
def one_replica():
    """(weights before, after one SGD step, statistics) on one undistributed
    device, per precision, computed once."""
    cache = {}

    def get(precision):
        if precision not in cache:
            before, after, _, stats, _ = train(compiled(tiny_cnn, sgd()), precision, None,
                                            [(IMAGES, LABELS, None)])
            cache[precision] = before, after, stats
        return cache[precision]

    return get


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("precision", ["mixed_bfloat16", "mixed_float16"])
def test_n_replicas_match_one_within_the_precisions_rounding(one_replica, precision,
                                                             replicas):
    before, one, one_stats = one_replica(precision)
    _, many, _, stats, _ = train(compiled(tiny_cnn, sgd()), precision, replicas,
                              [(IMAGES, LABELS, None)])
    # Per variable, the N-replica update against the 1-replica one, relative to
    # the largest update of that variable. The forward pass of an example does
    # not depend on the split, so the losses agree to float32 rounding; the
    # gradients do not: each is a sum over up to 32 x 36 terms (the conv's
    # batch and positions), reduced in the compute dtype (XLA on CPU) by one
    # device or as N partial sums, each rounded. A tree sum of n terms rounds
    # each up to log2(n) ~ 10 times; 16 u leaves room over the worst measured
    # (about 10 u). A wrong share of the batch (a doubled or halved
    # gradient) is off by 100% of the update, over 16 times 16 u for bfloat16.
    tolerance = 16 * UNIT_ROUNDOFF[precision]
    worst = []
    for start, a, b in zip(before, one, many):
        update = np.abs(a - start).max()
        assert update > 1e-3  # The step moved this variable: the check is not empty.
        worst.append(np.abs((b - start) - (a - start)).max() / update)
    assert max(worst) <= tolerance, (
        f"{replicas} replicas differ from 1 by {max(worst):.3g} of an update "
        f"({max(worst) / UNIT_ROUNDOFF[precision]:.1f} u), per variable {np.round(worst, 5)}")
    print(f"\n{keras.backend.backend()} {precision} 1 vs {replicas}: max abs "
          f"{max(float(np.abs(a - b).max()) for a, b in zip(one, many)):.3g}, max relative "
          f"to the update {max(worst):.3g} ({max(worst) / UNIT_ROUNDOFF[precision]:.1f} u), "
          f"per variable {np.round(worst, 5)}")
    assert stats["count"][0] == one_stats["count"][0] == 32
    assert stats["loss_sum"][0] == pytest.approx(one_stats["loss_sum"][0], rel=1e-5)
    assert stats["skipped"][0] == one_stats["skipped"][0] == 0


@pytest.mark.parametrize("precision", ["mixed_bfloat16", "mixed_float16"])
def test_one_mixed_precision_step_equals_keras_fit(precision):
    model_fn = compiled(tiny_mlp, sgd())
    batch = (FEATURES[:16], CLASSES[:16], None)
    before, ours, model, _, _ = train(model_fn, precision, None, [batch], sample=batch)
    engines.create_engine(1, distributed=False)
    with _policy(precision):
        reference = model_fn()
    reference.set_weights(before)
    assert type(reference.optimizer) is type(model.optimizer)
    reference.fit(batch[0], batch[1], batch_size=16, epochs=1, shuffle=False, verbose=0)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(ours, reference.get_weights()))
    assert worst <= 1e-6, f"kdist differs from Keras fit by {worst}"


def test_a_fixed_loss_scale_factor_scales_the_loss_and_unscales_the_gradients():
    batch = [(FEATURES[:16], CLASSES[:16], None)]
    sample = batch[0]
    _, plain, *_ = train(compiled(tiny_mlp, sgd()), "float32", 2, batch, sample)
    _, scaled, *_ = train(compiled(tiny_mlp, sgd(loss_scale_factor=1024.0)), "float32", 2,
                            batch, sample)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(plain, scaled))
    assert worst <= 1e-6, f"a loss_scale_factor of 1024 changes the step by {worst}"


# Dynamic loss scaling and skipped steps.

def test_the_optimizer_a_loss_scale_optimizer_wraps_accumulates_the_summed_gradients():
    # The TensorFlow engine's adjustments (`kdist.engines.tf_optimizer`) must
    # reach the wrapped optimizer: its `apply` would sum the replicas'
    # gradients again, and its accumulation would run a tf.cond in a replica.
    model_fn = compiled(tiny_mlp, lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.5, gradient_accumulation_steps=2)))
    batches = [(FEATURES[:16], CLASSES[:16], None), (FEATURES[16:32], CLASSES[16:32], None)]
    before, one, *_ = train(model_fn, "mixed_float16", None, batches, sample=batches[0])
    _, two, model, stats, _ = train(model_fn, "mixed_float16", 2, batches, sample=batches[0])
    np.testing.assert_array_equal(stats["skipped"], [0.0, 0.0])
    assert number(model.optimizer.iterations) == 1  # Two batches, one update.
    moved = max(float(np.abs(a - b).max()) for a, b in zip(one, before))
    worst = max(float(np.abs(a - b).max()) for a, b in zip(one, two))
    assert moved > 1e-2 and worst <= 16 * UNIT_ROUNDOFF["mixed_float16"] * moved, (worst, moved)


def test_steps_whose_gradients_overflow_are_skipped_alike_on_one_and_two_replicas():
    # A loss scale of 2^40 makes every float16 gradient overflow (float16 tops
    # out near 2^16) whichever replica computes it: each step is skipped, the
    # weights stay exactly as they were and the scale halves. (Near the
    # overflow threshold, 1 and N replicas can decide a step differently:
    # each replica's float16 gradient sums cover 1/N of the batch.)
    model_fn = compiled(tiny_cnn, scaled_sgd(2.0 ** 40))
    batches = [(IMAGES, LABELS, None)] * 3
    for replicas in (None, 2):
        before, after, model, stats, totals = train(model_fn, "mixed_float16", replicas,
                                                    batches, chunk=2)  # 2 calls, one padded.
        np.testing.assert_array_equal(stats["skipped"], [1.0, 1.0, 1.0])
        assert totals["skipped"] == 3  # Counted once per step, not once per replica.
        assert np.isfinite(stats["loss_sum"]).all()  # Unscaled: the loss itself is fine.
        for a, b in zip(before, after):
            np.testing.assert_array_equal(a, b)
        assert number(model.optimizer.dynamic_scale) == 2.0 ** 37
        assert number(model.optimizer.iterations) == 0  # Skipped steps do not count.


class SqrtOfAbs(keras.layers.Layer):
    """sqrt(|x|): finite forward, a NaN gradient wherever x is exactly 0."""

    def call(self, x):
        return ops.sqrt(ops.abs(x))


def test_a_non_finite_gradient_on_one_replica_skips_the_step_on_every_replica():
    # The bias starts at zero, so an all-zero row gives a zero pre-activation,
    # a finite loss, and NaN gradients for the first layer. The zero row is in
    # the second half of the batch: replica 1 of 2 alone computes them.
    def layers():
        return [keras.Input((6,)), keras.layers.Dense(8), SqrtOfAbs(),
                keras.layers.Dense(3, dtype="float32")]

    model_fn = compiled(layers, scaled_sgd(2.0 ** 10))
    bad = FEATURES[:16].copy()
    bad[12] = 0.0
    batches = [(bad, CLASSES[:16], None), (FEATURES[16:32], CLASSES[16:32], None)]
    results = {}
    for replicas in (None, 2):
        before, after, model, stats, _ = train(model_fn, "mixed_float16", replicas, batches,
                                            sample=batches[1])
        np.testing.assert_array_equal(stats["skipped"], [1.0, 0.0])
        assert np.isfinite(stats["loss_sum"]).all()
        assert number(model.optimizer.dynamic_scale) == 2.0 ** 9
        assert number(model.optimizer.iterations) == 1
        if keras.backend.backend() == "tensorflow" and replicas:  # Every replica's copy.
            for variable in model.trainable_variables:
                copies = [np.asarray(c) for c in variable.value.values]
                assert all(np.array_equal(c, copies[0]) for c in copies)
        results[replicas] = before, after
    # One good step from the same start on 1 and 2 replicas.
    (before, one), (_, two) = results[None], results[2]
    assert max(float(np.abs(a - b).max()) for a, b in zip(one, before)) > 1e-3
    assert max(float(np.abs(a - b).max()) for a, b in zip(one, two)) <= 1e-3


def test_skipped_steps_reach_the_epoch_lines_and_the_metrics_file_and_resume_exactly(
        tmp_path):
    # An initial scale of 2^24 overflows for the first steps; growth every 2
    # good steps makes it overflow again now and then, so both epochs skip
    # steps and the loss scale changes throughout.
    model_fn = compiled(tiny_mlp, lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=2.0 ** 24, dynamic_growth_steps=2))
    dataset = arrays.Dataset(FEATURES[:48], CLASSES[:48], FEATURES[48:], CLASSES[48:], "toy")

    def run(name, epochs, lines=None):
        config = training.TrainConfig(
            epochs=epochs, batch_size_per_replica=4, replicas=2, steps_per_epoch=6,
            steps_per_execution=4, checkpoint_every=1, checkpoint_dir=str(tmp_path / name),
            metrics_file=str(tmp_path / f"{name}.jsonl"), precision="mixed_float16", seed=2)
        return training.train_and_evaluate(config, dataset, model_fn=model_fn,
                                           log=(lines if lines is not None else []).append)

    lines = []
    straight = run("straight", 2, lines)
    run("resumed", 1)
    resumed = run("resumed", 2)

    skipped = [record["skipped_steps"] for record in straight.epochs]
    assert all(count > 0 for count in skipped), skipped
    epochs = [line for line in lines if line.startswith("Epoch ")]
    assert [line.endswith(f"; {count} steps skipped)") or
            line.endswith(f"; {count} step skipped)") for line, count in
            zip(epochs, skipped)] == [True, True], epochs
    assert "\nPrecision: mixed_float16 (dynamic loss scaling)" in lines[0]  # The banner.
    records = [json.loads(line) for line in
               (tmp_path / "straight.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records[:2]] == skipped
    assert "skipped_steps" in (tmp_path / "straight.csv").read_text().splitlines()[0]

    timing = ("seconds", "samples_per_sec")
    assert [{k: v for k, v in r.items() if k not in timing} for r in resumed.epochs] == \
        [{k: v for k, v in r.items() if k not in timing} for r in straight.epochs]
    a, b = (checkpoint_arrays(checkpoints.latest_checkpoint(str(tmp_path / name)))
            for name in ("straight", "resumed"))
    assert a.keys() == b.keys()
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert worst <= 1e-6, f"the resumed run differs by {worst}"
    # The loss scale is an optimizer variable of the checkpoint: the
    # LossScaleOptimizer's own (iterations, learning rate, step counter,
    # scale), then the Adam it wraps.
    scale = float(a["optimizer/vars/3"])
    assert scale not in (2.0 ** 24, 0.0) and np.log2(scale) == round(np.log2(scale))
    assert "optimizer/inner_optimizer/vars/0" in a


# Checkpoints between precisions.

@pytest.fixture(scope="module")
def checkpoint_of(tmp_path_factory):
    """Per precision, (path, weights, the weight-updating optimizer's variables)
    of a tiny MLP after one Adam step under that precision, made once."""
    folder = tmp_path_factory.mktemp("precisions")
    cache = {}

    def get(precision):
        if precision not in cache:
            batch = (FEATURES[:16], CLASSES[:16], None)
            _, weights, model, *_ = train(compiled(tiny_mlp, lambda: keras.optimizers.Adam(
                0.01)), precision, None, [batch], sample=batch)
            manager = checkpoints.CheckpointManager(str(folder / precision))
            manager.prepare()
            path = manager.save(model, 1, dict(epoch=1, history=[], backend="x", replicas=1,
                                               seed=0))
            cache[precision] = path, weights, optimizer_values(model.optimizer)
        return cache[precision]

    return get


def optimizer_values(optimizer):
    """The variables of the optimizer that updates the weights, as arrays."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return [np.array(keras.ops.convert_to_numpy(v)) for v in inner.variables]


@pytest.mark.parametrize("written, read", [
    ("mixed_bfloat16", "float32"), ("float32", "mixed_bfloat16"),
    ("mixed_float16", "float32"), ("float32", "mixed_float16"),
    ("mixed_float16", "mixed_bfloat16")])
def test_a_checkpoint_restores_into_another_precision_with_its_optimizer_state(
        checkpoint_of, written, read):
    path, weights, state = checkpoint_of(written)
    engine = engines.create_engine(1, distributed=False)
    model, optimizer = building.build(engine, compiled(tiny_mlp, lambda: keras.optimizers.Adam(
        0.01)), sample=(FEATURES[:2], CLASSES[:2], None), precision=read)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoints.restore(model, path)
    # Keras warns, and restores nothing, where the optimizer states' sizes differ.
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
    for got, want in zip(model.get_weights(), weights):  # float32 on both sides.
        np.testing.assert_array_equal(got, want)
    restored = optimizer_values(optimizer)
    assert len(restored) == len(state) and number(optimizer.iterations) == 1
    for got, want in zip(restored, state):  # Adam's moments and count, as written.
        np.testing.assert_array_equal(got, want)
    if read == "mixed_float16":  # Written without a loss scale: it starts afresh.
        assert number(optimizer.dynamic_scale) == optimizer.initial_scale
        assert number(optimizer.step_counter) == 0
    assert keras.config.dtype_policy().name == "float32"


# Reporting.

def test_epoch_lines_and_records_count_skipped_steps():
    record = EpochRecord(1, {"loss": 0.5}, {"loss": 0.625}, 2.0, 512.0, skipped_steps=1)
    assert reporting.format_epoch(record, 3).endswith("(2.0 s, 512 samples/s; 1 step skipped)")
    none = EpochRecord(1, {"loss": 0.5}, {"loss": 0.625}, 2.0, 512.0)
    assert reporting.format_epoch(none, 3).endswith("(2.0 s, 512 samples/s)")
    assert reporting.format_epoch(none, 3, show_skipped=True).endswith("; 0 steps skipped)")
    assert EpochRecord.from_dict(record.as_dict()) == record
    older = {k: v for k, v in record.as_dict().items() if k != "skipped_steps"}
    assert EpochRecord.from_dict(older).skipped_steps == 0  # Written before kdist counted.


def test_the_benchmark_table_has_one_row_per_precision():
    def measured(speed, **paired):  # kdist's carries the paired kdist/fit ratio.
        return dict(samples_per_sec=speed, first_epoch_seconds=2.0, eval_seconds=0.5,
                    peak_rss_mb=900.0, **paired)

    lines = format_table([("float32", measured(1000.0, fit_ratio=2.0), measured(500.0)),
                          ("mixed_bfloat16", measured(1500.0, fit_ratio=1.5),
                           measured(1000.0))]).splitlines()
    assert lines[0].split()[:4] == ["precision", "kdist", "samples/s", "fit"]
    assert lines[1].split()[:4] == ["float32", "1,000", "500", "2.00x"]
    assert lines[2].split()[:4] == ["mixed_bfloat16", "1,500", "1,000", "1.50x"]


def test_a_loss_that_overflows_in_float16_skips_its_step_as_fit_does(tmp_path):
    """A row too large for float16 makes step 3's loss infinite: `fit`'s
    LossScaleOptimizer skips the step and trains on (the epoch's loss not
    finite); kdist stopped the run ("non-finite loss ... try a lower learning
    rate")."""
    x, y = FEATURES[:48].copy(), CLASSES[:48]
    order = arrays.epoch_order(len(x), 0, 0)
    x[order[2 * 8 + 3]] = 1e5  # Step 3 of 6.
    model_fn = compiled(tiny_mlp, scaled_sgd(2.0 ** 8))
    config = training.TrainConfig(epochs=1, batch_size_per_replica=8, replicas=1, seed=0,
                                  checkpoint_dir=str(tmp_path), precision="mixed_float16")
    result = training.train_and_evaluate(config, arrays.Dataset(x, y, x[:8], y[:8], "toy"),
                                         model_fn=model_fn, log=lambda line: None,
                                         callbacks=[keras.callbacks.Callback()])
    assert "loss" not in result.epochs[0]  # The NaN loss is no callback's change.
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)  # As kdist builds its model: the same weights.
    reference = model_fn()
    history = reference.fit(x[order], y[order], batch_size=8, shuffle=False, verbose=0)
    keras.config.set_dtype_policy("float32")
    assert result.epochs[0]["skipped_steps"] == 1
    assert not np.isfinite(result.history["loss"][0]) and not np.isfinite(
        history.history["loss"][0])
    for ours, theirs in zip(result.model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
