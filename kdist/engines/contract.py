"""The engine contract: what the loop needs from a backend, as code.

`kdist.loop.training` runs one loop for every backend; everything backend-specific
sits behind this interface, one module per backend (`kdist/engines/<name>.py`,
class `Engine`, and the step primitives of that backend). The division of work:

- The loop (`kdist.loop.training`) makes fixed-shape NumPy batches
  `(x, y, sample_weight, draws)` (x and y: arrays or tuples/dicts of them;
  sample_weight: an array or None; draws: the step's `kdist.random` numbers
  for the batch's rows, `kdist.step.draws`), groups K of them into a chunk,
  pads a short last chunk with copies of its last batch, and stacks every
  array to shape (K, batch, ...) (`kdist.loop.chunks`). It accounts
  statistics step by step, decides when to checkpoint and when to stop.
- The step is a `kdist.step.program.Program`: a model's own `train_step` and
  `test_step`, or kdist's step for a model compiled for `fit`
  (`kdist.step.compiled`), both Python functions written with `keras.ops`
  and the public primitives (`kdist.value_and_grad`, `kdist.random`). Its
  building run (`Program.build`) has run each step once, eagerly, before the
  engine compiles it.
- The engine places a stacked chunk on its replicas (`distribute`; on torch
  one replica per process, `kdist.loop.replicas`) and runs the chunk's first
  `num_steps` steps (`train_chunk`, `eval_chunk`: on TensorFlow one compiled
  call, on JAX one call per train step on a CPU, one call on a GPU or TPU;
  the rest is padding, so every call has one shape). Each step, in each
  replica's program (on JAX one program for the whole sharded batch), it
  calls `program.run(primitives, training, batch, mapping)`, which runs the
  step under a `kdist.step.context.StepContext` and its `StepScope`: the
  step's `kdist.value_and_grad` calls the engine's primitives
  (`primitives()`, a `kdist.step.context.Primitives`) to differentiate and
  to average the variables' gradients over every replica of every worker,
  and each optimizer's `apply` runs where that engine's optimizers update
  their variables (`Primitives.apply`). The engine then keeps what the
  step's scope assigned outside the optimizers (float variables such as
  moving statistics averaged over replicas, the rest as assigned) and
  returns each step's statistics summed over all replicas.

Statistics are the dict `Program.run` returns, keyed by `Program.keys`:
`count` (the examples the step saw), `skipped` (1.0 where a
`LossScaleOptimizer` skipped its update; the engine lets one replica report
it, so it counts once per step whatever the replica count), `<name>_sum`
for each scalar the step returns (its value times the examples), and
`metric_NNN` for each metric variable (the change the step made to it from
its reset value). Per key, an array whose first axis holds the `num_steps`
steps' values (any after them belong to padding and are ignored); the loop
adds them up and `Program.results` turns the totals into what it reports.

Each engine's `Engine` class declares this one as its base, so mypy (`nox -s
lint`) checks its methods' signatures against these. The loop passes every
argument by position: the parameters here are positional-only, and an engine
names its own. An engine defines every method itself (the ones here have no
body). A distributed chunk is the engine's own type (`Any` here): only the
engine that made it reads it.
"""

import contextlib
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import keras

    from kdist.step.context import Primitives
    from kdist.step.program import Program

Batch = tuple[Any, ...]
"""(x, y, sample_weight, draws) of NumPy arrays: x and y an array or a tuple, list or
dict of arrays, sample_weight an array or None, draws a tuple of arrays (those of
`kdist.random`, `kdist.step.draws`; a batch of three has none)."""
Statistics = dict[str, Any]
"""Per key of `Program.keys`, an array (the framework's or NumPy's)."""


SEED_STRIDE = 1_000_003
"""What replica r adds to each Keras seed generator's state for its train step
(r times this), so the replicas draw apart and replica 0 draws one device's
numbers (TensorFlow's and torch's engines)."""


@runtime_checkable
class Engine(Protocol):
    """One backend's way to run kdist's steps data-parallel.

    Created by `kdist.engines.create_engine(replicas, distributed)`, before
    any model exists: the model and optimizer are then built in `scope()`.
    """

    backend: str
    """The Keras backend's name: "tensorflow", "jax" or "torch"."""
    version: str
    """The framework's version, for the banner."""
    num_replicas: int
    """Replicas over all workers: the global batch is this times the per-replica batch."""
    num_local_replicas: int
    """This process's replicas: a batch it feeds must divide by this."""
    batch_shares: int
    """How many replicas each run the steps on an equal, disjoint share of every
    global batch: `num_replicas` where each runs a program of its own
    (TensorFlow, torch), 1 where one program sees the global batch (JAX)."""
    devices: list[str | None]
    """This process's devices, for the banner (None: the framework's default device)."""
    shard: tuple[int, int]
    """(worker index, worker count): the slice of every global batch this process feeds."""
    is_chief: bool
    """Whether this process reports and writes checkpoints (worker 0)."""

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        """The context in which the model, optimizer and variables must be created."""

    def outside_scope(self, variables: list[Any], /) -> list[Any]:
        """Those of `variables` that the steps cannot update because they were
        created outside `scope()` (before the engine existed); none where any
        variable serves."""

    def primitives(self) -> "Primitives":
        """What a step calls for the parts that differ per backend: gradients and
        their average over replicas (`kdist.step.context.Primitives`)."""

    def compile_steps(self, program: "Program", /) -> None:
        """Builds the train and eval chunk functions of `program`, a built
        `kdist.step.program.Program` (its train chunk only if `program.trains`).

        Each runs `program.run(self.primitives(), training, batch, mapping)`
        per step where the engine runs a replica's step, and keeps what the
        step's scope assigned: moving statistics averaged over replicas,
        everything else as assigned. Optimizers update the weights inside
        the step (`optimizer.apply`), with gradients `kdist.value_and_grad`
        has already averaged over replicas.
        """

    def distribute(self, stacked: Batch, /) -> Any:
        """Places a stacked chunk, a structure of NumPy arrays of shape (K, local
        batch, ...), on this process's replicas, split along the batch axis.

        Called on the loop's background thread (`kdist.loop.prefetch`), one chunk
        ahead, while a compiled call runs: it must not run a collective."""

    def train_chunk(self, chunk: Any, num_steps: int, /) -> Statistics:
        """Runs the first `num_steps` optimizer steps of a distributed chunk;
        returns each step's summed statistics. Returns only when every device
        is done."""

    def eval_chunk(self, chunk: Any, num_steps: int, /) -> Statistics:
        """Like `train_chunk`, in inference mode and without updating anything."""

    def eval_whole(self, batch: Batch, /) -> Statistics:
        """Evaluates one NumPy batch of any size (the examples after an evaluation
        set's last full global batch), whole, its statistics counted once
        whatever the replica and worker count; every worker passes the same
        batch. No padding, so every metric sees exactly the real examples."""

    def sync_to_model(self) -> None:
        """Writes the engine's state back into the Keras variables (before a save, and
        before a callback reads them)."""

    def sync_from_model(self) -> None:
        """Takes the Keras variables' values as the engine's state again, after a
        callback assigned some (a learning rate, weights)."""

    def any_worker(self, flag: bool, /) -> bool:
        """Whether `flag` is true on any worker: a collective every worker calls at
        the same point of the loop; no communication with one worker."""

    def replica_checksums(self) -> list[list[int]]:
        """For each replica this process holds, a checksum of each of the program's
        variables, in `program.variables`' order (`kdist.tree.checksum`): the
        replicas apply the same averaged gradients and keep the same
        assignments, so every replica's are the same unless a step made them
        differ."""

    def workers_values(self, values: list[int], /) -> list[list[int]]:
        """Every worker's `values` (integers in [0, 2**24): exact in float32), in
        worker order: one collective every worker calls at the same point; no
        communication with one worker."""

    def compiled_train_programs(self) -> int:
        """How many train programs have been compiled (traced, on TensorFlow):
        1 for a whole run, whatever its chunks' step counts."""

    def keras_fit_callbacks(self) -> "list[keras.callbacks.Callback]":
        """Callbacks that Keras' own `fit` needs on the same devices (benchmarks)."""
