"""Training speed of kdist's loop against Keras `fit`, same model, data and batch.

Both run in one process under the same engine (strategy or distribution),
taking turns epoch by epoch, for 1 + `windows` epochs of `steps` global
batches each. The first epoch (with compilation) is timed alone; the steady
speed is the median samples/s of the other epochs, and kdist/fit is the
median of the steady rounds' paired ratios (fit's epoch time / kdist's in
the same round), with their spread: a drift of the machine's speed falls on
both sides of each ratio. The JSON line records the load average before the
run. Epochs are timed whole, from start to a result on the host, so
asynchronous dispatch cannot flatter either side.
Evaluation time is the second full pass over the test set (the first compiles).
With several precisions (`kdist.precision`) each is measured in turn and
gets one row of the table and one JSON line; peak memory is
the process's, so a later row's includes the earlier ones'. With several
input kinds (`kdist.bench.input_kinds`: the same arrays given directly, or through
tf.data, a PyDataset or Grain) one kdist model takes them in turn, epoch by
epoch, one row each, with `fit` (which always takes the arrays) once per
round: the kinds compare in one process, under the same conditions.

`model` picks the network (`MODELS`): the tutorial CNN (also as "cnn-stock",
with Keras' stock layers in place of `kdist.models.cnn`'s formulations), or ResNet-20
(`kdist.models.resnet`) on its own synthetic 32x32x3 data. The header and every JSON
line also describe the CPU (`kdist.bench.cpuinfo`: model, speed flags, visible cores,
measured matmul GFLOP/s). Under several workers
(`kdist.engines.connect` first, as `kdist.cli` does) each worker trains its
slice of every global batch, `fit` is not measured, and only the chief logs;
`kdist.bench.workers` uses this to measure the cost of communication.
"""

import functools
import json
import os
import resource
import statistics
import time

import keras

from kdist import engines
from kdist.bench import choices, cpuinfo, weights_only
from kdist.bench.input_kinds import input_source
from kdist.config import DEFAULT_LEARNING_RATE, TrainConfig, adam
from kdist.errors import UsageError
from kdist.inputs import base
from kdist.loop import building
from kdist.loop import replicas as replica_processes
from kdist.loop.chunks import evaluate_source, run_steps, zero_totals
from kdist.models import resnet
from kdist.models.cnn import create_model
from kdist.precision import DEFAULT_PRECISION, check_precision, policy

# --model's choices (`kdist.choices.MODELS`): name -> the function building it.
# cnn-stock is the CNN with Keras' own layers, to weigh `kdist.models.cnn`'s formulations;
# cnn-weights its weights with next to no arithmetic (`kdist.bench.weights_only`).
MODELS = {"cnn": create_model, "cnn-stock": functools.partial(create_model, fast_layers=False),
          "cnn-weights": weights_only.create_weights_only, "resnet20": resnet.create_resnet20}


def peak_rss_mb():
    """The process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summarize_epochs(seconds, samples_per_epoch):
    """First-epoch time, the median samples/s of the epochs after it, and every
    epoch's time (their spread shows how steady the machine was)."""
    return dict(first_epoch_seconds=seconds[0], epoch_seconds=list(seconds),
                samples_per_sec=statistics.median(samples_per_epoch / s for s in seconds[1:]))


def measure_kdist(engine, dataset, global_batch, steps, windows, steps_per_execution,
                  precision=DEFAULT_PRECISION, input_kinds=("numpy",), *,
                  model_fn=create_model, fit=None):
    """{input kind: kdist's figures fed by it}. One model, compiled once; the
    kinds take turns epoch by epoch (1 + `windows` epochs each), and so does
    `fit` (a `FitEpochs`, or None), so a change of the machine's speed during
    the run falls on every side alike: each kind's `fit_ratio` is the median,
    over the steady rounds, of fit's epoch time / the kind's, with
    `fit_ratio_spread` (the lowest and highest round). The compilation falls
    in the first epochs."""
    keras.utils.set_random_seed(0)
    sources = {kind: [input_source(kind, dataset.split(split), global_batch, split)
                      for split in ("train", "test")] for kind in input_kinds}
    model, step = building.prepare_model(engine, global_batch,
                                         building.sample_rows(dataset), model_fn,
                                         precision=precision)
    engine.compile_steps(step)
    seconds: dict[str, list[float]] = {kind: [] for kind in input_kinds}
    for epoch in range(1 + windows):
        for kind, (train, _) in sources.items():
            start = time.perf_counter()
            batches = train.train(global_batch, seed=0, epoch=epoch, limit=steps,
                                  shard=engine.shard)
            run_steps(engine, engine.train_chunk, batches, zero_totals(step),  # Ends on the host.
                      steps_per_execution=steps_per_execution)
            seconds[kind].append(time.perf_counter() - start)
        if fit is not None:
            fit.epoch()
    figures = {}
    ratios = paired_ratios(seconds)
    for kind, (_, test) in sources.items():
        evaluate_seconds = _time_twice(lambda: evaluate_source(
            engine, step, test, global_batch, steps_per_execution))  # noqa: B023
        figures[kind] = dict(summarize_epochs(seconds[kind], steps * global_batch),
                             eval_seconds=evaluate_seconds, peak_rss_mb=peak_rss_mb(),
                             input_ratio=ratios[kind])
        if fit is not None:
            rounds = [f / k for f, k in zip(fit.seconds[1:], seconds[kind][1:])]
            figures[kind].update(fit_ratio=statistics.median(rounds),
                                 fit_ratio_spread=[min(rounds), max(rounds)])
    return figures


def paired_ratios(seconds):
    """{kind: its speed against the first kind's}, from {kind: epoch times} of
    kinds that took turns epoch by epoch: the median, over the steady rounds,
    of the first kind's time / this kind's in the same round. A drift of the
    machine's speed between rounds cancels in each round's ratio; it does not
    in a ratio of medians."""
    first = next(iter(seconds.values()))[1:]
    return {kind: statistics.median(a / b for a, b in zip(first, times[1:]))
            for kind, times in seconds.items()}


class EpochTimes(keras.callbacks.Callback):
    """Epoch wall times; `fit` turns the epoch's logs into floats before on_epoch_end."""

    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


class FitEpochs:
    """Keras `fit` of the same model, data and batch as kdist's, compiled with
    kdist's default optimizer and loss, one epoch per `epoch()` call."""

    def __init__(self, engine, dataset, global_batch, steps, precision=DEFAULT_PRECISION, *,
                 model_fn=create_model):
        keras.utils.set_random_seed(0)
        with engine.scope(), policy(precision):  # mixed_float16: compile adds loss scaling.
            self.model = model_fn()
            self.model.compile(
                optimizer=adam(DEFAULT_LEARNING_RATE),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
        self.dataset, self.global_batch = dataset, global_batch
        self.count = steps * global_batch
        self.blocking = engine.keras_fit_callbacks()  # Keeps fit on JAX CPUs from deadlocking.
        self.seconds: list[float] = []

    def epoch(self):
        """Trains one epoch with `fit`, adding its time to `seconds`."""
        times = EpochTimes()
        self.model.fit(self.dataset.train_x[:self.count], self.dataset.train_y[:self.count],
                       batch_size=self.global_batch, epochs=1, verbose=0,
                       callbacks=[times] + self.blocking)
        self.seconds += times.seconds

    def figures(self):
        """The epochs' figures and the evaluation's time."""
        evaluate_seconds = _time_twice(lambda: self.model.evaluate(
            self.dataset.test_x, self.dataset.test_y, batch_size=self.global_batch,
            verbose=0, callbacks=self.blocking))
        return dict(summarize_epochs(self.seconds, self.count),
                    eval_seconds=evaluate_seconds, peak_rss_mb=peak_rss_mb())


def _time_twice(fn):
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(dataset, replicas=None, batch_size_per_replica=TrainConfig.batch_size_per_replica,
        steps=None, windows=choices.WINDOWS, steps_per_execution=TrainConfig.steps_per_execution,
        log=print, *, precisions=(DEFAULT_PRECISION,), input_kinds=("numpy",), model="cnn",
        fit=True, measure_peak=True, stop=None):
    """Measures kdist fed by each of `input_kinds`, then fit, at each of
    `precisions`; logs a table with one row per (precision, input kind), then
    one JSON line each, and returns the summaries (a dict for one row, a list
    of them for several).

    `model` names the network (`MODELS`) that `dataset` suits. `fit` False
    measures kdist alone, as do several workers (their fit figures are None).
    `measure_peak` False leaves the CPU record's matmul GFLOP/s None. On
    torch, several replicas are several processes (`kdist.loop.replicas`), each
    measuring its share, as workers do; `stop` is their stop request, unused.
    """
    for precision in precisions:
        check_precision(precision)
    if model not in MODELS:
        raise UsageError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    processes = engines.replica_processes(replicas)
    if processes:
        arguments = dict(dataset=dataset, replicas=replicas,
                         batch_size_per_replica=batch_size_per_replica, steps=steps,
                         windows=windows, steps_per_execution=steps_per_execution,
                         precisions=precisions, input_kinds=input_kinds, model=model, fit=fit,
                         measure_peak=measure_peak)
        return replica_processes.run(processes, run, arguments, log=log)
    engine = engines.create_engine(replicas)
    workers = engine.shard[1]
    fit = fit and workers == 1
    if not engine.is_chief:
        log = _silent
    cpu = cpuinfo.describe(measure_peak)
    global_batch = batch_size_per_replica * engine.num_replicas
    steps = base.steps_per_epoch(dataset.size("train"), global_batch, steps)
    log(f"{engine.backend} {engine.version}, {engine.num_replicas} replica(s)"
        f"{f' on {workers} workers' if workers > 1 else ''}, model {model}, global batch "
        f"{global_batch}, {steps} steps per epoch, 1 + {windows} epochs each, kdist "
        f"--steps-per-execution {steps_per_execution}, "
        f"data {dataset.source}, kdist input {', '.join(input_kinds)}")
    log(cpuinfo.format_record(cpu))
    rows, summaries = [], []
    for precision in precisions:
        load = [round(v, 2) for v in os.getloadavg()]  # Other work on the machine, before.
        fit_epochs = (FitEpochs(engine, dataset, global_batch, steps, precision,
                                model_fn=MODELS[model]) if fit else None)
        measured = measure_kdist(engine, dataset, global_batch, steps, windows,
                                 steps_per_execution, precision, input_kinds,
                                 model_fn=MODELS[model], fit=fit_epochs)
        theirs = fit_epochs.figures() if fit_epochs is not None else None
        for kind, mine in measured.items():
            label = precision if len(input_kinds) == 1 else f"{precision} {kind}"
            rows.append((label, mine, theirs))
            summaries.append(dict(
                model=model, backend=engine.backend, workers=workers,
                replicas=engine.num_replicas, precision=precision, input=kind,
                steps_per_execution=steps_per_execution, global_batch=global_batch,
                steps=steps, load_average=load, **_figures(mine, theirs), **cpu))
    log(format_table(rows))
    if len(input_kinds) > 1:
        log(f"against {input_kinds[0]}, the median of each round's ratio: " + ", ".join(
            f"{row['precision']} {row['input']} {row['input_ratio']:.3f}"
            for row in summaries if row["input"] != input_kinds[0]))
    for summary in summaries:
        log(json.dumps(summary))
    return summaries[0] if len(summaries) == 1 else summaries


def _silent(line):
    """The log of a worker other than the chief."""


def _figures(mine, theirs):
    """The JSON line's measurements of kdist (`mine`) and fit (`theirs`, None
    where not measured: its figures are then None)."""
    def fit(key, digits):
        return None if theirs is None else round(theirs[key], digits)

    return dict(
        kdist_samples_per_sec=round(mine["samples_per_sec"]),
        fit_samples_per_sec=fit("samples_per_sec", None),
        ratio=None if theirs is None else round(mine["fit_ratio"], 3),
        ratio_spread=None if theirs is None else [round(r, 3)
                                                  for r in mine["fit_ratio_spread"]],
        first_epoch_seconds=round(mine["first_epoch_seconds"], 2),
        fit_first_epoch_seconds=fit("first_epoch_seconds", 2),
        eval_seconds=round(mine["eval_seconds"], 2),
        fit_eval_seconds=fit("eval_seconds", 2),
        peak_rss_mb=round(mine["peak_rss_mb"]),
        input_ratio=round(mine["input_ratio"], 3),
        epoch_seconds=[round(s, 3) for s in mine["epoch_seconds"]],
        fit_epoch_seconds=None if theirs is None else [round(s, 3)
                                                       for s in theirs["epoch_seconds"]])


# The table's columns: (heading, kdist's or fit's measurement, key, format).
_COLUMNS = (("kdist samples/s", "kdist", "samples_per_sec", "{:,.0f}"),
            ("fit samples/s", "fit", "samples_per_sec", "{:,.0f}"),
            ("kdist/fit", None, "fit_ratio", "{:.2f}x"),
            ("first epoch s", "kdist", "first_epoch_seconds", "{:.2f}"),
            ("fit first epoch s", "fit", "first_epoch_seconds", "{:.2f}"),
            ("eval s", "kdist", "eval_seconds", "{:.2f}"),
            ("fit eval s", "fit", "eval_seconds", "{:.2f}"),
            ("peak RSS MB", "kdist", "peak_rss_mb", "{:,.0f}"))


def format_table(rows):
    """One line per (row label: the precision, and the input kind where there
    are several; kdist's measurements, fit's): train samples/s
    (median of the steady epochs) of both and the paired ratio, the first epoch
    (with compiling), a full test-set evaluation, and the peak memory; "-"
    for fit's where it is None (not measured)."""
    width = max(len("precision"), *(len(row[0]) for row in rows)) + 2
    lines = [f"{'precision':{width}}" + "".join(f"{c[0]:>{len(c[0]) + 2}}" for c in _COLUMNS)]
    for precision, mine, theirs in rows:
        cells = []
        for heading, who, key, fmt in _COLUMNS:
            if who != "kdist" and theirs is None:  # fit not measured.
                text = "-"
            elif who is None:  # The paired ratio.
                text = fmt.format(mine[key])
            else:
                text = fmt.format((mine if who == "kdist" else theirs)[key])
            cells.append(f"{text:>{len(heading) + 2}}")
        lines.append(f"{precision:{width}}" + "".join(cells))
    return "\n".join(lines)
