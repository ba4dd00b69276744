"""Training speed of kdist's loop against Keras `fit`, same model, data and batch.

Both run in one process, back to back, under the same engine (strategy or
distribution), for 1 + `windows` epochs of `steps` global batches. The first
epoch (with compilation) is timed alone; the steady speed is the median
samples/s of the other epochs. Epochs are timed whole, from start to a
result on the host, so asynchronous dispatch cannot flatter either side.
Evaluation time is the second full pass over the test set (the first compiles).
With several precisions (`kdist.precision`) each is measured in turn, kdist
then fit, and gets one row of the table and one JSON line; peak memory is
the process's, so a later row's includes the earlier ones'.
"""

import json
import resource
import statistics
import time

import keras

from kdist import data, engines, inputs, training
from kdist.steps import evaluate_source, run_steps, zero_totals
from kdist.config import BENCH_WINDOWS, TrainConfig
from kdist.model import create_model
from kdist.precision import DEFAULT_PRECISION, check_precision, policy


def peak_rss_mb():
    """The process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summarize_epochs(seconds, samples_per_epoch):
    """First-epoch time and the median samples/s of the epochs after it."""
    return dict(first_epoch_seconds=seconds[0],
                samples_per_sec=statistics.median(samples_per_epoch / s for s in seconds[1:]))


def input_source(kind, arrays, global_batch, split):
    """The kdist source (`kdist.inputs`) of split `split`'s arrays (x, y,
    sample_weight) given as `kind` (one of `kdist.config.BENCH_INPUTS`), in batches of
    `global_batch`."""
    x, y, weights = arrays
    if kind == "numpy":
        return inputs.ArraySource(x, y, weights, f"the {split} data")
    if kind == "tfdata":
        import tensorflow as tf

        given = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0)
                 .batch(global_batch).prefetch(tf.data.AUTOTUNE))
    elif kind == "pydataset":
        given = _Rows(x, y, global_batch)
    else:
        import grain

        given = (grain.MapDataset.range(len(x)).shuffle(seed=0).batch(global_batch)
                 .map(lambda rows: (x[rows], y[rows])))
    return inputs.source_for(given, split)


class _Rows(keras.utils.PyDataset):
    """Batches of `size` rows of (x, y)."""

    def __init__(self, x, y, size):
        super().__init__()
        self.x, self.y, self.size = x, y, size

    def __len__(self):
        return -(-len(self.x) // self.size)

    def __getitem__(self, index):
        rows = slice(index * self.size, (index + 1) * self.size)
        return self.x[rows], self.y[rows]


def measure_kdist(engine, dataset, global_batch, steps, windows, steps_per_execution,
                  precision=DEFAULT_PRECISION, input_kind="numpy"):
    keras.utils.set_random_seed(0)
    train, test = (input_source(input_kind, dataset.split(split), global_batch,
                                split) for split in ("train", "test"))
    model, step = training.prepare_model(engine, global_batch,
                                         training.sample_rows(dataset),
                                         precision=precision)
    engine.compile_steps(step, model.optimizer)
    seconds = []
    for epoch in range(1 + windows):
        start = time.perf_counter()
        batches = train.train(global_batch, seed=0, epoch=epoch, limit=steps)
        run_steps(engine, engine.train_chunk, batches, zero_totals(step),  # Ends on the host.
                  steps_per_execution=steps_per_execution)
        seconds.append(time.perf_counter() - start)
    evaluate_seconds = _time_twice(lambda: evaluate_source(
        engine, step, test, global_batch, steps_per_execution))
    return dict(summarize_epochs(seconds, steps * global_batch),
                eval_seconds=evaluate_seconds, peak_rss_mb=peak_rss_mb())


class _EpochTimes(keras.callbacks.Callback):
    """Epoch wall times; `fit` turns the epoch's logs into floats before on_epoch_end."""

    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def measure_fit(engine, dataset, global_batch, steps, windows, precision=DEFAULT_PRECISION):
    keras.utils.set_random_seed(0)
    with engine.scope(), policy(precision):  # mixed_float16: compile adds loss scaling.
        model = create_model()
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    count = steps * global_batch
    times = _EpochTimes()
    blocking = engine.keras_fit_callbacks()  # Keeps fit on JAX CPU devices from deadlocking.
    model.fit(dataset.train_x[:count], dataset.train_y[:count],
              batch_size=global_batch, epochs=1 + windows, callbacks=[times] + blocking,
              verbose=0)
    evaluate_seconds = _time_twice(lambda: model.evaluate(
        dataset.test_x, dataset.test_y, batch_size=global_batch, verbose=0,
        callbacks=blocking))
    return dict(summarize_epochs(times.seconds, count),
                eval_seconds=evaluate_seconds, peak_rss_mb=peak_rss_mb())


def _time_twice(fn):
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(dataset, replicas=None, batch_size_per_replica=TrainConfig.batch_size_per_replica,
        steps=None, windows=BENCH_WINDOWS, steps_per_execution=TrainConfig.steps_per_execution,
        log=print, *, precisions=(DEFAULT_PRECISION,), input_kind="numpy"):
    """Measures kdist then fit at each of `precisions`; logs a table with one row
    per precision, then one JSON line each, and returns the summaries (a dict for
    one precision, a list of them for several)."""
    for precision in precisions:
        check_precision(precision)
    engine = engines.create_engine(replicas)
    global_batch = batch_size_per_replica * engine.num_replicas
    steps = data.steps_per_epoch(dataset.size("train"), global_batch, steps)
    log(f"{engine.backend} {engine.version}, {engine.num_replicas} replica(s), global batch "
        f"{global_batch}, {steps} steps per epoch, 1 + {windows} epochs each, kdist "
        f"--steps-per-execution {steps_per_execution}, "
        f"data {dataset.source}, kdist input {input_kind}")
    rows, summaries = [], []
    for precision in precisions:
        mine = measure_kdist(engine, dataset, global_batch, steps, windows, steps_per_execution,
                             precision, input_kind)
        theirs = measure_fit(engine, dataset, global_batch, steps, windows, precision)
        rows.append((precision, mine, theirs))
        summaries.append(dict(
            backend=engine.backend, replicas=engine.num_replicas, precision=precision,
            input=input_kind,
            steps_per_execution=steps_per_execution, global_batch=global_batch, steps=steps,
            kdist_samples_per_sec=round(mine["samples_per_sec"]),
            fit_samples_per_sec=round(theirs["samples_per_sec"]),
            ratio=round(mine["samples_per_sec"] / theirs["samples_per_sec"], 3),
            first_epoch_seconds=round(mine["first_epoch_seconds"], 2),
            fit_first_epoch_seconds=round(theirs["first_epoch_seconds"], 2),
            eval_seconds=round(mine["eval_seconds"], 2),
            fit_eval_seconds=round(theirs["eval_seconds"], 2),
            peak_rss_mb=round(mine["peak_rss_mb"])))
    log(format_table(rows))
    for summary in summaries:
        log(json.dumps(summary))
    return summaries[0] if len(summaries) == 1 else summaries


# The table's columns: (heading, kdist's or fit's measurement, key, format).
_COLUMNS = (("kdist samples/s", "kdist", "samples_per_sec", "{:,.0f}"),
            ("fit samples/s", "fit", "samples_per_sec", "{:,.0f}"),
            ("kdist/fit", None, "samples_per_sec", "{:.2f}x"),
            ("first epoch s", "kdist", "first_epoch_seconds", "{:.2f}"),
            ("fit first epoch s", "fit", "first_epoch_seconds", "{:.2f}"),
            ("eval s", "kdist", "eval_seconds", "{:.2f}"),
            ("fit eval s", "fit", "eval_seconds", "{:.2f}"),
            ("peak RSS MB", "kdist", "peak_rss_mb", "{:,.0f}"))


def format_table(rows):
    """One line per (precision, kdist's measurements, fit's): train samples/s
    (median of the steady epochs) of both and their ratio, the first epoch
    (with compiling), a full test-set evaluation, and the peak memory."""
    width = max(len("precision"), *(len(row[0]) for row in rows)) + 2
    lines = [f"{'precision':{width}}" + "".join(f"{c[0]:>{len(c[0]) + 2}}" for c in _COLUMNS)]
    for precision, mine, theirs in rows:
        cells = []
        for heading, who, key, fmt in _COLUMNS:
            if who is None:
                value = mine[key] / theirs[key] if theirs[key] else float("nan")
            else:
                value = (mine if who == "kdist" else theirs)[key]
            cells.append(f"{fmt.format(value):>{len(heading) + 2}}")
        lines.append(f"{precision:{width}}" + "".join(cells))
    return "\n".join(lines)
