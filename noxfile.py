"""Test sessions: `nox -s tests` runs the suite once per backend, each in its own venv.

Select one with `nox -s "tests(backend='jax')"`; reuse venvs with `nox -R`.
The `both` session has TensorFlow and JAX installed and runs the tests that
cross backends (a checkpoint written on one, restored on the other).
"""

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
