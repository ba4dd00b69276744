"""Test start-up: four CPU devices on TensorFlow and JAX, set before Keras loads.

nox sets KERAS_BACKEND per session. XLA_FLAGS must be set before JAX starts
and TF's CPU split must precede its first op, so both happen here, at import.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

# The tests, and the scripts and workers they start, import this checkout's
# kdist even where another one is installed.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _CHECKOUT)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_CHECKOUT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

from kdist.runtime import startup  # noqa: E402  (imports no framework)

NUM_DEVICES = 4
startup.prepare_environment()
startup.set_host_device_count(NUM_DEVICES)

import keras  # noqa: E402

if keras.backend.backend() == "tensorflow":

    startup.split_tensorflow_cpu(NUM_DEVICES)
elif keras.backend.backend() == "jax":  # JAX starts its backend, with NUM_DEVICES CPUs,
    import jax  # at its first device query: now, so no in-process command can change it.

    assert len(jax.devices()) == NUM_DEVICES
# torch: one process per replica (`kdist.loop.replicas`), no devices to set.

from kdist import errors
from kdist.datasets import fashion_mnist  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _environment_restored():
    """Every test starts from the session's environment variables. A command run
    in this process (`cli.main`) prepares it as for a run (`--replicas 64` sets
    XLA_FLAGS to 64 devices), which every later test's subprocesses would
    otherwise inherit."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def small_dataset():
    """Synthetic Fashion-MNIST-shaped data: 512 train, 1,001 test images."""
    return fashion_mnist.synthetic_fashion_mnist(num_train=512, num_test=1001, seed=3)


@pytest.fixture
def batch():
    """One global batch of 32 examples, (x, y, no sample weights)."""
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 1, (32, 28, 28, 1)).astype(np.float32)
    labels = rng.integers(0, 10, 32).astype(np.int32)
    return images, labels, None


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2.2 MB tmpfs: room for one checkpoint (1.5 MB) but not for a second."""
    folder = tmp_path / "tmpfs"
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2200k", "tmpfs", str(folder)],
                             capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """On torch, a test that asks one process for several replicas is skipped, on
    the engine's own refusal (`kdist.errors.ReplicaPerProcess`, whose message is
    the reason): torch has no in-process replicas, and
    tests/test_torch.py proves the same math with one process per replica."""
    _skip_in_process_replicas((yield))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """The same for a fixture that asks for several replicas."""
    _skip_in_process_replicas((yield))


def _skip_in_process_replicas(outcome):
    error = outcome.excinfo[1] if outcome.excinfo else None
    if isinstance(error, errors.ReplicaPerProcess):
        outcome.force_exception(pytest.skip.Exception(
            f"in-process replicas: {error} (tests/test_torch.py)", _use_item_location=True))
