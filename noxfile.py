"""Test sessions: `nox -s tests` runs the suite once per backend, each in its own venv.

Select one with `nox -s "tests(backend='jax')"`; reuse venvs with `nox -R`.
The `both` session has TensorFlow, JAX and PyTorch installed and runs the
tests that cross backends (a checkpoint written on one, restored on another).
`nox -s lowest` runs a subset against the lowest versions pyproject.toml allows;
`nox -s extras` installs each backend's extra alone, as a user would, and trains;
`nox -s lint` runs ruff, mypy and the import-layer check.
"""

import json
import os
import re
import tomllib

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

EXTRAS = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch", "both": "all"}
ANY_BACKEND_SESSION = "tensorflow"  # Runs the tests marked any_backend too.
# PyTorch's CPU build, installed before the extras so that they need no other torch:
# pip takes it from this project's machines (a local file); elsewhere point pip at
# https://download.pytorch.org/whl/cpu, or PyPI's Linux wheel brings several GB of CUDA.
TORCH_CPU = "torch==2.13.0"
# filelock: JAX's compilation cache locks its folder with it (see jax_cache).
TEST_TOOLS = ["filelock"]
# Test files run two at a time (pytest-xdist, one file to a worker) in these sessions:
# most of TensorFlow's in-process tests, and JAX's compiling, keep one core busy, so on
# 2 cores these sessions take 0.70x and 0.63x the time. torch's tests use both cores
# already (0.99x). Measurements: docs/log/2026-12-02-suite-time.md.
TWO_AT_A_TIME = {"tensorflow", "jax"}


def jax_cache(session):
    """The environment of JAX's persistent compilation cache, in the session's tmp
    folder. The suite starts many short JAX processes (the commands, the workers)
    that compile the same steps; with the cache, a step that took 0.2 s or more to
    compile is compiled once per session. A size limit turns on the cache's file
    lock, so no process reads an entry another is writing (docs/performance.md)."""
    return {"JAX_COMPILATION_CACHE_DIR": os.path.join(session.create_tmp(), "jax-cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2",
            "JAX_COMPILATION_CACHE_MAX_SIZE": str(8 << 30)}


@nox.session
@nox.parametrize("backend", list(EXTRAS))
def tests(session, backend):
    if backend in ("torch", "both"):
        session.install(TORCH_CPU)
    parallel = backend in TWO_AT_A_TIME
    session.install("-e", f".[{EXTRAS[backend]},test]", *TEST_TOOLS,
                    *(["pytest-xdist"] if parallel else []))
    if backend == "both":
        env = {"KERAS_BACKEND": "jax"}
        args = ["-m", "cross_backend"]
    else:
        env = {"KERAS_BACKEND": backend}
        # Tests that depend on no backend (marked any_backend) run in one session only.
        once = backend == ANY_BACKEND_SESSION
        args = ["-m", "not cross_backend" if once else "not cross_backend and not any_backend"]
    if backend in ("jax", "both"):
        env.update(jax_cache(session))
    if parallel:
        args += ["-n", "2", "--dist", "loadfile"]
    session.run("pytest", "--durations=15", *args, *session.posargs, env=env)


# Lint and type-check kdist without any framework installed: mypy reads only
# kdist's code and the stubs of numpy and Keras' own annotations.
LINT_TOOLS = ["ruff>=0.15", "mypy>=1.18"]


@nox.session
def lint(session):
    """ruff (style, imports, bugs; on the tests, scripts and examples too), mypy (types)
    and the import layers, on kdist/."""
    session.install("-e", ".", *LINT_TOOLS)
    session.run("ruff", "check", "kdist", "tests", "scripts", "examples", "noxfile.py")
    session.run("mypy", "kdist")
    session.run("python", "scripts/import_graph.py")


@nox.session
@nox.parametrize("extra", ["tensorflow", "jax", "torch"])
def extras(session, extra):
    """One backend's extra alone, in a fresh venv, then what its user runs first."""
    if extra == "torch":
        session.install(TORCH_CPU)
    session.install(f".[{extra}]")  # Not editable: as a user installs it.
    env = {"KERAS_BACKEND": extra}
    folder = session.create_tmp()
    session.run("python", "-c", "import kdist; kdist.train_and_evaluate", env=env)
    session.run("kdist-train", "--synthetic", "1200", "--epochs", "1", "--no-resume",
                "--checkpoint-dir", os.path.join(folder, f"ckpt-{extra}"), env=env)
    # --tensorboard without its extra: one line that names it, before anything loads.
    out = session.run("kdist-train", "--tensorboard", os.path.join(folder, "tb"), env=env,
                      silent=True, success_codes=[2])
    if "pip install 'kdist[tensorboard]'" not in out:
        session.error(f"--tensorboard without the tensorboard package: {out!r}")


# The tests `lowest` runs by default: the loop, the replicas' equivalence, the commands.
LOWEST_TESTS = ["tests/test_distribution.py", "tests/test_training.py",
                "tests/test_entry_points.py"]
# Installed along a package's floor: jax needs the jaxlib of its own version.
COMPANIONS = {"jax": ["jaxlib"]}


def floors(extra):
    """`name==version; marker` constraints: the `>=` floor of every runtime dependency
    of kdist and of its `extra` in pyproject.toml."""
    with open("pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    constraints = []
    for requirement in project["dependencies"] + project["optional-dependencies"][extra]:
        spec, _, marker = requirement.partition(";")
        match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)\s*", spec)
        if match is None:
            raise ValueError(f"pyproject.toml: {requirement!r} has no plain >= floor")
        name, version = match.groups()
        for package in [name, *COMPANIONS.get(name, [])]:
            constraints.append(f"{package}=={version}" + (f";{marker}" if marker else ""))
    return constraints


@nox.session
@nox.parametrize("backend", ["tensorflow", "jax"])
def lowest(session, backend):
    """The floors of pyproject.toml, installed exactly; `nox -s lowest -- TESTS` picks tests."""
    constraints = os.path.join(session.create_tmp(), "lowest.txt")
    with open(constraints, "w") as f:
        f.write("\n".join(floors(backend)) + "\n")
    session.install("-c", constraints, "-e", f".[{backend},test]")
    session.run("python", "-m", "pip", "list")
    # No compilation cache here: jaxlib 0.4.36 crashed (SIGSEGV) running CPU programs
    # it had read back from the cache.
    session.run("pytest", "-m", "not cross_backend", *(session.posargs or LOWEST_TESTS),
                env={"KERAS_BACKEND": backend})


@nox.session
def smoke(session):
    """One real Fashion-MNIST epoch per backend on 2 replicas; needs the data set."""
    session.install(TORCH_CPU)
    session.install("-e", ".[all]")
    for backend in ("tensorflow", "jax", "torch"):
        folder = session.create_tmp()
        metrics = f"{folder}/metrics-{backend}.jsonl"
        if os.path.exists(metrics):
            os.remove(metrics)
        session.run("python", "scripts/train.py", "--epochs", "1", "--replicas", "2",
                    "--no-resume", "--checkpoint-dir", f"{folder}/ckpt-{backend}",
                    "--metrics-file", metrics, env={"KERAS_BACKEND": backend})
        with open(metrics) as f:
            epoch, restored = [json.loads(line) for line in f.read().splitlines()[-2:]]
        if not epoch["test_accuracy"] > 0.80:  # Keras' units: a fraction.
            session.error(f"{backend}: test accuracy {100 * epoch['test_accuracy']:.2f}% "
                          "<= 80%")
        if restored["test_accuracy"] != epoch["test_accuracy"]:
            session.error(f"{backend}: restored accuracy {restored['test_accuracy']} != "
                          f"{epoch['test_accuracy']}")
        session.log(f"{backend}: 1 epoch, test accuracy {100 * epoch['test_accuracy']:.2f}%")
