"""Test sessions: `nox -s tests` runs the suite once per backend, each in its own venv.

Select one with `nox -s "tests(backend='jax')"`; reuse venvs with `nox -R`.
The `both` session has TensorFlow and JAX installed and runs the tests that
cross backends (a checkpoint written on one, restored on the other).
"""

import json
import os

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

EXTRAS = {"tensorflow": "tensorflow", "jax": "jax", "both": "all"}


@nox.session
@nox.parametrize("backend", list(EXTRAS))
def tests(session, backend):
    session.install("-e", f".[{EXTRAS[backend]},test]")
    if backend == "both":
        env = {"KERAS_BACKEND": "jax"}
        args = ["-m", "cross_backend"]
    else:
        env = {"KERAS_BACKEND": backend}
        args = ["-m", "not cross_backend"]
    session.run("pytest", *args, *session.posargs, env=env)


@nox.session
def smoke(session):
    """One real Fashion-MNIST epoch per backend on 2 replicas; needs the data set."""
    session.install("-e", ".[all]")
    for backend in ("tensorflow", "jax"):
        folder = session.create_tmp()
        metrics = f"{folder}/metrics-{backend}.jsonl"
        if os.path.exists(metrics):
            os.remove(metrics)
        session.run("python", "scripts/train.py", "--epochs", "1", "--replicas", "2",
                    "--no-resume", "--checkpoint-dir", f"{folder}/ckpt-{backend}",
                    "--metrics-file", metrics, env={"KERAS_BACKEND": backend})
        with open(metrics) as f:
            epoch, restored = [json.loads(line) for line in f.read().splitlines()[-2:]]
        if not epoch["test_accuracy"] > 80.0:
            session.error(f"{backend}: test accuracy {epoch['test_accuracy']:.2f}% <= 80%")
        if restored["test_accuracy"] != epoch["test_accuracy"]:
            session.error(f"{backend}: restored accuracy {restored['test_accuracy']} != "
                          f"{epoch['test_accuracy']}")
        session.log(f"{backend}: 1 epoch, test accuracy {epoch['test_accuracy']:.2f}%")
