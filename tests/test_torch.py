"""The torch engine: one process per replica (`kdist.loop.replicas`), the same math as one.

Every multi-replica case here runs real processes joined by torch.distributed
(gloo); each process feeds its shard of every global batch.
"""

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
from conftest import REPO
from helpers import children, prepare, two_processes
from test_fit_parity import assert_close, counted_data, counted_losses, initial_weights, on_keras
from test_training import checkpoint_arrays

import kdist
from kdist import checkpoints, engines, tree
from kdist.engines import contract
from kdist.errors import Interrupted, TrainingError, UsageError, WorkerLost
from kdist.loop import chunks, pickled, replicas
from kdist.runtime import memory
from kdist.workers import cluster
from kdist.workers.processes import free_ports

pytestmark = pytest.mark.skipif(keras.backend.backend() != "torch",
                                reason="the torch engine; other backends run in one process")

TRAIN = os.path.join(REPO, "scripts", "train.py")
GLOBAL_BATCH = 32


def one_step_and_evaluation(dataset, log, stop):
    """In each process: one SGD step on this process's shard of a global batch,
    then an evaluation of the whole test set; returns (weights before, after,
    the step's statistics, the test results)."""
    engine = engines.create_engine()
    keras.utils.set_random_seed(7)
    model, step = prepare(engine, GLOBAL_BATCH, learning_rate=0.5)
    before = [np.array(w) for w in model.get_weights()]
    rank, count = engine.shard
    batch = tree.take_rows(dataset.split("train"), slice(0, GLOBAL_BATCH))
    per_process = GLOBAL_BATCH // count
    shard = tree.take_rows(batch, slice(rank * per_process, (rank + 1) * per_process))
    stats = engine.train_chunk(engine.distribute(chunks.stack_chunk([shard])), 1)
    results = chunks.evaluate(engine, step, *dataset.split("test"), GLOBAL_BATCH)
    return (before, [np.array(w) for w in model.get_weights()],
            {k: float(np.asarray(v)[0]) for k, v in stats.items()}, results)


@pytest.fixture(scope="module")
def outcomes(small_dataset):
    """{process count: what process 0 returned}, for 1, 2 and 4 processes."""
    found = {1: one_step_and_evaluation(small_dataset, print, None)}
    for count in (2, 4):
        found[count] = replicas.run(count, one_step_and_evaluation,
                                    dict(dataset=small_dataset))
    return found


@pytest.mark.parametrize("count", [2, 4])
def test_n_processes_match_one_after_an_sgd_step(outcomes, count):
    before, single, single_stats, _ = outcomes[1]
    _, multi, multi_stats, _ = outcomes[count]
    assert max(np.abs(a - b).max() for a, b in zip(single, before)) > 1e-3  # Not empty.
    for one, many in zip(single, multi):
        np.testing.assert_allclose(many, one, atol=1e-5, rtol=0)
    assert multi_stats["count"] == single_stats["count"] == GLOBAL_BATCH
    assert np.isclose(multi_stats["loss_sum"], single_stats["loss_sum"], rtol=1e-5)


def counted_step_and_evaluation(start, batch, test, log, stop):
    """In each process: one SGD step of `counted_losses` from `start` on this
    process's shard of `batch`, then an evaluation of `test`."""
    engine = engines.create_engine()
    global_batch = len(batch[0])
    model, step = prepare(engine, global_batch, counted_losses, optimizer_fn=None,
                          learning_rate=None, sample=tree.take_rows(batch, slice(0, 2)))
    model.set_weights(start)
    rank, count = engine.shard
    share = tree.take_rows(batch, slice(rank * global_batch // count,
                                        (rank + 1) * global_batch // count))
    engine.train_chunk(engine.distribute(chunks.stack_chunk([share])), 1)
    engine.sync_to_model()
    return [np.array(w) for w in model.get_weights()], chunks.evaluate(
        engine, step, *test, global_batch)


def test_losses_divided_by_a_count_of_the_batch_use_the_global_batchs():
    """A masked loss, a sum and a mean over sample weights, on 2 processes whose
    shares hold other counts than the global batch: one step and an evaluation
    equal `fit` and `evaluate` on one process (test_fit_parity has the model)."""
    batch, test = counted_data(2 * GLOBAL_BATCH, seed=6), counted_data(1001, seed=7)
    start = initial_weights(counted_losses)
    weights, results = replicas.run(2, counted_step_and_evaluation,
                                    dict(start=start, batch=batch, test=test))
    reference = on_keras(counted_losses, start)
    reference.fit(batch[0], batch[1], sample_weight=batch[2], batch_size=2 * GLOBAL_BATCH,
                  epochs=1, shuffle=False, verbose=0)
    assert_close(weights, reference.get_weights(), 1e-6)
    expected = reference.evaluate(*test[:2], sample_weight=test[2], batch_size=2 * GLOBAL_BATCH,
                                  verbose=0, return_dict=True)
    assert set(results) == set(expected)
    for name, value in expected.items():
        assert results[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name


@pytest.mark.parametrize("count", [2, 4])
def test_evaluation_counts_each_of_1001_examples_once(outcomes, count):
    single, multi = outcomes[1][3], outcomes[count][3]
    assert single.keys() == multi.keys()
    for key in single:
        np.testing.assert_allclose(multi[key], single[key], rtol=1e-5, err_msg=key)
    assert 0 < single["accuracy"] < 1


def test_a_process_group_of_the_wrong_size_is_refused():
    with pytest.raises(UsageError, match="each replica is a process"):
        engines.create_engine(2)


def test_unpicklable_inputs_are_one_clear_error():
    with pytest.raises(UsageError, match="cannot be"):
        replicas.run(2, one_step_and_evaluation, dict(dataset=(x for x in [])))
    tf = pytest.importorskip("tensorflow")  # A tf.data pipeline: TensorFlow's message was all.
    pipeline = tf.data.Dataset.from_tensor_slices(np.zeros((4, 2), np.float32)).batch(2)
    with pytest.raises(UsageError, match=(
            r"^on this backend each replica is a process, .* the test data is a tf.data "
            r"pipeline, which cannot be; pass a function that makes it \(test=lambda: ")):
        replicas.run(2, one_step_and_evaluation, dict(dataset=kdist.Inputs(
            train=(np.zeros((4, 2)), np.zeros(4)), test=pipeline)))


def _adamw_without_bias_decay():
    optimizer = keras.optimizers.AdamW(0.01)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


@pytest.mark.parametrize("made, changed", [
    (lambda: keras.losses.Huber(delta=0.5), r"delta=0\.5 \(it arrives as 1\.0\)"),
    (lambda: keras.losses.CosineSimilarity(axis=0), r"axis=0 \(it arrives as -1\)"),
    (_adamw_without_bias_decay, "_exclude_from_weight_decay_pattern"),
])
def test_keras_objects_that_pickling_would_change_are_refused_before_any_process(made, changed):
    """Keras pickles a loss or optimizer through its config, which leaves these
    settings out: made outside model_fn, each replica would train with others."""
    outside = made()

    def model_fn():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        if isinstance(outside, keras.optimizers.Optimizer):
            model.compile(optimizer=outside, loss="mse")
        else:
            model.compile(optimizer="sgd", loss=outside)
        return model

    with pytest.raises(UsageError, match=f"made outside model_fn .*{changed}.*inside model_fn"):
        replicas.run(2, one_step_and_evaluation, dict(dataset=None, model_fn=model_fn))
    with pytest.raises(UsageError, match=changed):  # Compiled into a model made outside.
        replicas.run(2, one_step_and_evaluation, dict(dataset=None, model=model_fn()))
    made_inside = pickle.loads(pickled.dumps(lambda: made()))()
    assert vars(made_inside).keys() == vars(outside).keys()


def test_a_trained_model_made_outside_model_fn_is_refused_naming_it():
    """A model in hand from an earlier run, given to another: its built optimizer
    would reach the replica processes without its state."""
    trained = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="earlier")
    trained.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    trained.optimizer.build(trained.trainable_variables)
    with pytest.raises(UsageError, match=(
            "SGD compiled into model 'earlier' made outside model_fn would reach the replica "
            r"processes changed: .* leaves out its state \(it is built")):
        replicas.run(2, one_step_and_evaluation, dict(dataset=None, model=trained))


def test_a_callback_holding_an_open_file_is_refused_naming_it(tmp_path):
    # It was "...gets the data and functions pickled; ... pass arrays, a kdist.Dataset".
    class FileLog(keras.callbacks.Callback):
        def __init__(self, path):
            super().__init__()
            self.log_file = open(path, "w")  # noqa: SIM115 (what the test is about)

    callback = FileLog(tmp_path / "log.txt")
    with pytest.raises(UsageError, match=(
            "gets the callbacks pickled; callback FileLog's attribute log_file cannot be "
            r"\(PicklingError: Cannot pickle files .*\); create it in on_train_begin")):
        replicas.run(2, one_step_and_evaluation, dict(dataset=None, callbacks=[callback]))
    callback.log_file.close()


_MODULE = """def scale():
    return 2.0


def run(log, stop):
    return scale()
"""


def test_a_module_function_the_script_replaced_is_refused_not_trained_as_written(
        tmp_path, monkeypatch):
    # Each process imports the module again, as written: it returned 2.0, silently.
    (tmp_path / "scaling_module.py").write_text(_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "scaling_module", raising=False)
    import scaling_module  # noqa: PLC0415 - written by this test.

    assert replicas.run(2, scaling_module.run, {}) == 2.0  # As written: nothing to refuse.

    def half():
        return 0.5

    monkeypatch.setattr(scaling_module, "scale", half)
    with pytest.raises(UsageError, match=(
            r"^scaling_module.scale is test_torch.test_a_module_.*\.<locals>\.half in the calling "
            "script, but scaling_module as written holds scaling_module.scale: the script "
            "replaced it after importing scaling_module")):
        replicas.run(2, scaling_module.run, {})


def test_keras_objects_that_pickling_keeps_travel():
    objects = [keras.losses.Huber(), keras.optimizers.SGD(0.3, momentum=0.9, clipnorm=1.0),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=2),
               keras.metrics.SparseTopKCategoricalAccuracy(k=3)]
    arrived = pickle.loads(pickled.dumps(objects))
    assert [o.get_config() for o in arrived] == [o.get_config() for o in objects]


class HoldsALock(Exception):
    """An exception that does not pickle."""

    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


class NeedsTwo(Exception):
    """An exception whose constructor takes other arguments than its `args`."""

    def __init__(self, message, code=7):
        super().__init__(f"code {code}: {message}")
        self.code = code


def failing(log, stop, error):
    """Process 1 fails; process 0 would wait forever in a collective without it."""
    engine = engines.create_engine()
    if engine.shard[0] == 1:
        raise error("replica 1 broke")
    engine.any_worker(False)


@pytest.mark.parametrize("error, raised, match", [
    (RuntimeError, RuntimeError, "^replica 1 broke$"),  # As one process raises it.
    (NeedsTwo, NeedsTwo, "^code 7: replica 1 broke$"),
    (HoldsALock, TrainingError, "^HoldsALock: replica 1 broke$")])
def test_a_failing_process_stops_the_others_with_its_error(error, raised, match):
    # A replica's own ValueError (a callback's) reached the caller as a TrainingError.
    start = time.monotonic()
    with pytest.raises(raised, match=match) as caught:
        replicas.run(2, failing, {"error": error})
    assert time.monotonic() - start < replicas.GRACE_SECONDS + 60
    assert type(caught.value) is raised
    if raised is NeedsTwo:  # Its attributes too.
        assert vars(caught.value)["code"] == 7
    assert 'raise error("replica 1 broke")' in caught.value.replica_traceback


_SCRIPT = """from kdist import engines


def fails(log, stop):
    engine = engines.create_engine()
    if engine.shard[0] == 1:
        raise ValueError("replica 1 broke")
    engine.any_worker(False)
"""


def test_a_replicas_traceback_names_the_file_and_line_of_a_scripts_own_function(tmp_path):
    # cloudpickle sends a script's functions by value, and named their file <dynamic-code>.
    script = tmp_path / "my_train.py"
    script.write_text(_SCRIPT)
    namespace = {"__name__": "__main__"}  # As `python my_train.py` runs it.
    exec(compile(_SCRIPT, str(script), "exec"), namespace)
    with pytest.raises(ValueError, match="^replica 1 broke$") as caught:
        replicas.run(2, namespace["fails"], {})
    assert f'File "{script}", line 7, in fails' in caught.value.replica_traceback
    assert 'raise ValueError("replica 1 broke")' in caught.value.replica_traceback


def test_torchrun_variables_describe_the_process_group():
    spec = cluster.from_flags_and_env(environ=dict(
        RANK="1", WORLD_SIZE="2", MASTER_ADDR="10.0.0.5", MASTER_PORT="29500"),
        backend="torch")
    assert (spec.num_workers, spec.worker_index, spec.coordinator) == (2, 1, "10.0.0.5:29500")
    with pytest.raises(UsageError, match="MASTER_PORT"):
        cluster.from_flags_and_env(environ=dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="h"),
                                   backend="torch")


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def start_training(tmp_path, *flags):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, TRAIN, "--synthetic", "--replicas", "2", "--epochs", "3",
         "--steps-per-epoch", "400", "--checkpoint-dir", str(tmp_path / "ckpt"), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_for_training(process):
    """Returns the banner's lines and the replica processes once the chief replica
    has printed the banner's last line: both replicas have joined, and a stop
    signal from now on ends the first chunk of steps."""
    banner = []
    for line in process.stdout:
        banner.append(line)
        if line.startswith("Checkpoints: "):
            return "".join(banner), [p for p in children(process.pid, "replica_main") if alive(p)]
    process.kill()
    pytest.fail("training did not start: " + "".join(banner) + process.communicate()[0])


@pytest.mark.parametrize("sig, every_process", [
    (signal.SIGTERM, False),  # kill PID
    (signal.SIGINT, False),  # Ctrl-C: the replica processes are in sessions of their own
    (signal.SIGTERM, True),  # a scheduler ending a job, or pkill: every process at once
])
def test_a_stop_signal_checkpoints_and_stops_every_process(tmp_path, sig, every_process):
    process = start_training(tmp_path)
    banner, replica_pids = wait_for_training(process)
    assert len(replica_pids) == 2, banner
    for pid in [process.pid] + (replica_pids if every_process else []):
        os.kill(pid, sig)
    output = banner + process.communicate(timeout=120)[0]
    assert process.returncode == 128 + sig, output
    assert output.count("Saved checkpoint") == 1 and sig.name in output, output
    saved = os.listdir(tmp_path / "ckpt")
    assert len(saved) == 1 and saved[0] in output, output
    assert not [p for p in replica_pids if alive(p)]


def test_a_killed_replica_process_ends_the_run_with_an_error(tmp_path):
    process = start_training(tmp_path)
    banner, replica_pids = wait_for_training(process)
    assert len(replica_pids) == 2, banner
    os.kill(replica_pids[-1], signal.SIGKILL)
    output = banner + process.communicate(timeout=120)[0]
    assert process.returncode not in (0, 128 + signal.SIGTERM), output
    assert "replica process" in output and "exited with status 137" in output, output
    assert not [p for p in replica_pids if alive(p)]


def test_processes_ended_by_a_stop_signal_while_joining_are_an_interruption():
    # A stop signal ends a process that is joining the others at once (its default
    # action); one killed otherwise, or at another point, is a failure.
    def ended_by(signum):
        process = subprocess.Popen(["sleep", "60"])
        process.send_signal(signum)
        process.wait(timeout=30)
        return process

    with pytest.raises(Interrupted, match="^SIGTERM: stopped while the replica processes were "
                       "joining") as raised:
        replicas._outcome([ended_by(signal.SIGTERM), ended_by(signal.SIGTERM)], {})
    assert raised.value.exit_status == 128 + signal.SIGTERM
    with pytest.raises(TrainingError, match="replica process 0 exited with status 137"):
        replicas._outcome([ended_by(signal.SIGKILL), ended_by(signal.SIGTERM)], {})


def test_a_replicas_own_failure_is_raised_before_the_lost_collective_it_caused():
    # A step that raised in one process (a label out of range in its share) left the
    # other's all-reduce to fail: the run ended in that WorkerLost ("... resumes from
    # the newest checkpoint"), and the cause's traceback was never printed.
    done = [subprocess.Popen(["true"]) for _ in range(2)]
    for process in done:
        process.wait(timeout=30)
    lost = ("error", (WorkerLost, "lost the other workers mid-run (RuntimeError: Connection "
                      "closed by peer)", {}, None))
    failed = ("error", (TrainingError, "IndexError: Target 3 is out of bounds.", {},
                        "Traceback ...\nIndexError: Target 3 is out of bounds.\n"))
    for reported in ({0: lost, 1: failed}, {1: failed, 0: lost}):
        with pytest.raises(TrainingError, match="^IndexError: Target 3") as raised:
            replicas._outcome(done, reported)
        assert not isinstance(raised.value, WorkerLost)
    refused = ("error", (UsageError, "the train_step returns 'note', a str", {}, None))
    with pytest.raises(UsageError, match="returns 'note'"):  # kdist's own error stays first.
        replicas._outcome(done, {1: failed, 0: refused})


# Not --quiet: the chief has lines for the dead parent. A checkpoint every 100 steps marks
# a point in the middle of the epoch; SGD, so that a wrong resume shows in the weights.
PARENT_RUN = ["--synthetic", "--replicas", "2", "--epochs", "1", "--steps-per-epoch", "400",
              "--batch-size-per-replica", "16", "--checkpoint-every-steps", "100",
              "--optimizer", "sgd", "--learning-rate", "0.1"]


def run_to_the_end(folder):
    result = subprocess.run([sys.executable, TRAIN, *PARENT_RUN, "--checkpoint-dir", folder],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return checkpoint_arrays(os.path.join(folder, "ckpt-00000400.weights.h5"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_to_the_end(str(tmp_path_factory.mktemp("uninterrupted") / "ckpt"))


def kill_parent_when(process, when):
    """SIGKILLs the parent at `when`: as soon as both replicas exist, just after the
    first mid-epoch checkpoint (at the first chunk's end past step 100), or just after
    the epoch's line (its checkpoint comes next); returns the replica processes."""
    deadline = time.monotonic() + 120
    if when == "start-up":
        while len(children(process.pid, "replica_main")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        mark = "Saved checkpoint" if when == "mid-epoch" else "Epoch 1/1"
        seen = []
        for line in process.stdout:
            seen.append(line)
            if mark in line or time.monotonic() > deadline:
                break
        assert mark in seen[-1], "".join(seen)
    pids = children(process.pid, "replica_main")
    os.kill(process.pid, signal.SIGKILL)
    return pids


@pytest.mark.parametrize("when", ["start-up", "mid-epoch", "before-the-epoch-checkpoint"])
def test_a_killed_parent_leaves_replicas_that_checkpoint_exit_quietly_and_resume_exactly(
        tmp_path, uninterrupted, when):
    """The replicas (which still print to the same output) agree on a step, the chief
    writes a checkpoint there, and they exit without a traceback; running the
    command again ends with the uninterrupted run's weights."""
    folder = str(tmp_path / "ckpt")
    process = subprocess.Popen([sys.executable, TRAIN, *PARENT_RUN, "--checkpoint-dir", folder],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))
    replica_pids = kill_parent_when(process, when)
    output, _ = process.communicate(timeout=120)  # Until the replicas close it too.
    deadline = time.monotonic() + 60
    while [p for p in replica_pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(replica_pids) == 2 and not [p for p in replica_pids if alive(p)], output
    assert "Traceback" not in output and "Error" not in output, output
    latest = checkpoints.CheckpointManager(folder).latest()
    assert latest is not None, output
    if when == "before-the-epoch-checkpoint":  # The epoch's checkpoint was not lost.
        assert os.path.basename(latest[0]) == "ckpt-00000400.weights.h5", output
    else:  # They stopped within the epoch, at a step they agreed on, and saved it.
        assert latest[1]["epoch"] == 0 and latest[1]["step_in_epoch"] > 0, output
    resumed = run_to_the_end(folder)
    assert resumed.keys() == uninterrupted.keys()
    assert all(np.array_equal(resumed[k], uninterrupted[k]) for k in resumed), when


def contract_in_a_process(log, stop):
    """In each process: the engine's place in the group, and a stop only process 1 asks."""
    engine = engines.create_engine()
    assert isinstance(engine, contract.Engine)
    return (engine.num_replicas, engine.num_local_replicas, engine.shard, engine.is_chief,
            engine.any_worker(engine.shard[0] == 1), engine.any_worker(False))


def made_without_a_name(log, stop):
    return keras.metrics.AUC().name


def test_keras_names_what_a_process_makes_as_its_parent_would():
    # Keras names a metric made without a name by its process's counter (`auc`,
    # `auc_1`...): a second run's history said `auc` where its model in hand said `auc_1`.
    keras.metrics.AUC()
    assert replicas.run(2, made_without_a_name, {}) == keras.metrics.AUC().name != "auc"


def test_each_process_is_one_replica_and_any_worker_is_agreed():
    assert replicas.run(2, contract_in_a_process, {}) == (2, 1, (0, 2), True, True, False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("parent_keeps", [True, False])
def test_replica_processes_keep_freed_memory_as_their_parent(monkeypatch, parent_keeps):
    # Eager torch frees and allocates its activations every step; on glibc's
    # defaults a process can fault them in again each time (kdist.runtime.memory).
    monkeypatch.delenv("KDIST_KEEP_FREED_MEMORY", raising=False)
    monkeypatch.setattr(memory, "_kept", parent_keeps)

    def heap_settings(log, stop):  # Defined here, sent by value: no import of conftest.
        """In each process: whether it keeps freed memory (`kdist.runtime.memory`), and
        what a freed 48 MiB block left: bytes mapped for it, bytes the heap holds after."""
        import ctypes

        class MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in (
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                "keepcost".split())]

        mallinfo2 = ctypes.CDLL(None).mallinfo2
        mallinfo2.restype = MallInfo2
        mapped_before = mallinfo2().hblkhd
        block = np.ones((48 << 20) // 4, np.float32)
        mapped = mallinfo2().hblkhd - mapped_before
        del block
        return memory.keeping_freed_memory(), mapped, mallinfo2().arena

    keeps, mapped, held = replicas.run(2, heap_settings, {})
    assert keeps == parent_keeps
    if parent_keeps:  # (glibc's defaults may do the same or not, by the heap's history.)
        assert mapped == 0 and held >= 48 << 20  # From the heap, and kept there.


# Registered before kdist's, this exit hook runs after it (atexit runs last-in first-out).
LEAVES_AT_EXIT = """
import atexit, sys
import torch, torch.distributed as dist
from kdist.engines import torch as engine
from kdist.workers import cluster
atexit.register(lambda: print("group at exit:", dist.is_initialized()))
engine.connect(cluster.ClusterSpec(2, int(sys.argv[2]), (sys.argv[1],), 60.0))
dist.all_reduce(torch.ones(8))  # Its work object outlives the call in gloo's thread.
print("joined:", dist.is_initialized())
"""


def test_each_process_leaves_its_group_before_the_interpreter_is_torn_down():
    """A gloo group left to the teardown can abort the process (std::terminate, status
    134) as its worker thread frees the last collective's tensors without the GIL."""
    for output in two_processes(LEAVES_AT_EXIT, f"127.0.0.1:{free_ports(1)[0]}"):
        assert output.splitlines()[-2:] == ["joined: True", "group at exit: False"], output


def linear_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_a_checkpoint_skipped_on_resume_is_told_once(tmp_path, capfd):
    """Every replica process read the checkpoint folder and warned: the line came
    once per process, at times interleaved with itself."""
    from test_checkpoints import damage_weights

    import kdist

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    data = kdist.Dataset(x, x[:, :1], x, x[:, :1], "toy")
    folder = str(tmp_path / "ckpt")
    config = kdist.TrainConfig(epochs=2, batch_size_per_replica=8, replicas=2,
                               checkpoint_dir=folder, progress=False)
    kdist.train_and_evaluate(config, data, linear_model, log=lambda line: None)
    newest = os.path.join(folder, "ckpt-00000008.weights.h5")
    damage_weights(newest)
    capfd.readouterr()
    kdist.train_and_evaluate(dataclasses.replace(config, epochs=3), data, linear_model,
                             log=lambda line: None)
    warning = f"skipping checkpoint {newest}: its weights do not match its checksum"
    assert capfd.readouterr().err.count(warning) == 1


class RatePerProcess(keras.callbacks.Callback):
    """Sets a learning rate of its own in each replica process (a clock's or an
    unseeded draw's decision would do the same)."""

    def on_epoch_begin(self, epoch, logs=None):
        import torch.distributed

        self.model.optimizer.learning_rate = 0.1 * (1 + torch.distributed.get_rank())


def test_a_callback_setting_each_process_its_own_rate_is_named_as_the_cause(tmp_path):
    # The message blamed the step: "the step changes the averaged gradients with ...".
    import kdist

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    config = kdist.TrainConfig(epochs=2, batch_size_per_replica=8, replicas=2,
                               checkpoint_dir=str(tmp_path), progress=False)
    with pytest.raises(TrainingError, match=(
            r"differ after epoch 1 \(.*'.*learning_rate'.*\): a callback set the learning "
            "rate differently on the replicas")):
        kdist.train_and_evaluate(config, kdist.Dataset(x, x[:, :1], x, x[:, :1], "toy"),
                                 linear_model, log=lambda line: None,
                                 callbacks=[RatePerProcess()])
    assert os.listdir(tmp_path) == []


def chief_in_a_process(log, stop, folder):
    """In each process: `kdist.is_chief()`, written to a file named by the process."""
    import kdist

    with open(os.path.join(folder, f"{os.getpid()}"), "w") as f:
        f.write(str(kdist.is_chief()))


def test_one_replica_process_is_the_chief(tmp_path):
    """On torch each replica is a process, and `kdist.connect().is_chief` is true in
    all of worker 0's: a callback that writes had no way to tell."""
    import kdist

    assert kdist.is_chief()  # Alone.
    replicas.run(2, chief_in_a_process, dict(folder=str(tmp_path)))
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["False", "True"]
