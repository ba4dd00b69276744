"""PyTorch engine: one process per replica, gradients summed with `torch.distributed`.

Keras has no distribution for the torch backend, so each replica is a
process (gloo on CPUs, NCCL on GPUs) that runs the step eagerly on its
shard of every global batch. `connect` joins a process group (torchrun,
`kdist-launch`, `--peers`); `kdist.loop.replicas` starts the processes of
`--replicas N` on one machine itself.
"""

import atexit
import contextlib
import datetime
import os

import keras
import torch
import torch.distributed as dist

from kdist import tree
from kdist.engines import contract
from kdist.engines.torch_step import Primitives, all_reduce_sum, seed_offsets
from kdist.errors import ReplicaPerProcess, UsageError
from kdist.tree import map_arrays as _map_arrays
from kdist.workers import processes

# The loop starts one process per replica for this engine (`kdist.loop.replicas`).
PROCESS_PER_REPLICA = True


def _device():
    """This process's device: the GPU of its local rank, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def connect(spec, replicas=None):
    """Joins the process group of `spec`; blocks until every process has joined.

    Worker 0's address is the rendezvous (a TCP store it serves). Each
    process is one replica, so `replicas` must be left out (or be 1). The
    group is left at the process's exit (`_leave_group`).

    Gloo's `init_process_group` can return in one process while another
    still completes its connections; a process that then failed at once (a
    checkpoint folder in use, say) would end the other's join in a C++ error
    printed beside kdist's one line. So `connect` returns only once every
    process has joined: a barrier, which every process enters after its own
    `init_process_group` has returned.
    """
    if replicas not in (None, 1):
        _refuse_replicas_per_worker(replicas)
    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _share_cores()
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{spec.coordinator}", rank=spec.worker_index,
        world_size=spec.num_workers, timeout=datetime.timedelta(seconds=spec.connect_timeout))
    atexit.register(_leave_group)
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)


def _leave_group():
    """Destroys the process group while the interpreter is whole.

    A gloo group left to the interpreter's teardown can end the process in
    `std::terminate` ("terminate called without an active exception", exit
    status 134) when the processes exit together. Destroying it is local to
    this process: no collective, so a process that exits alone does not wait.
    """
    if connected():
        dist.destroy_process_group()


def failed_collective(error):
    """Whether `error` is a collective of the process group that failed: torch's
    `DistError`, or the `RuntimeError` that gloo and NCCL raise for a peer that
    went away (its message names them)."""
    message = str(error)
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and ("gloo/" in message or "NCCL" in message))


def _share_cores():
    """Splits this machine's cores between the training processes on it.

    Each process would otherwise run one thread per core; with several
    processes per machine the threads then outnumber the cores and torch's
    OpenMP threads, which spin while they wait for each other, slow every
    step several times over. The count of processes comes from kdist's
    launchers (`KDIST_LOCAL_PROCESSES`) or torchrun (`LOCAL_WORLD_SIZE`:
    `kdist.workers.processes.cores_per_process`); an
    `OMP_NUM_THREADS` that is set (torchrun sets 1) is left as it is.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return
    torch.set_num_threads(processes.cores_per_process())


def _refuse_replicas_per_worker(replicas):
    raise UsageError(
        f"--replicas {replicas}: on torch each worker process is one replica; leave "
        "--replicas out when starting the workers yourself (a machine then holds "
        "as many replicas as the launcher starts processes there)")


def served_address(spec):
    """Worker 0 serves the TCP store on the first address; under torchrun its agent
    serves it, and worker 0 connects to it like the others."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    return spec.addresses[0] if spec.is_chief else None


def connected():
    """Whether this process is one replica of a process group."""
    return dist.is_available() and dist.is_initialized()


def is_chief():
    """Whether this process is rank 0 of the process group (worker 0's first replica)."""
    return dist.get_rank() == 0


class Engine(contract.Engine):
    """Runs kdist's steps eagerly, one replica per process.

    Args:
        replicas: None, the process group's size (a group is needed for
            more than 1: `kdist.loop.replicas` starts one), or 1 (this process's).
        distributed: False runs alone even inside a group, as for
            evaluating a restored model.
    """

    backend = "torch"
    version = torch.__version__

    def __init__(self, replicas=None, distributed=True):
        grouped = distributed and connected()
        world = dist.get_world_size() if grouped else 1
        if grouped and world > 1 and replicas not in (None, 1) and os.environ.get(
                processes.REPLICA_PROCESSES_VARIABLE) != "1":  # Workers a launcher started.
            _refuse_replicas_per_worker(replicas)
        # With a group, `replicas` may also count this worker's own: one.
        if replicas not in (None, world) and not (grouped and replicas == 1):
            raise ReplicaPerProcess(
                f"--replicas {replicas} but this torch process group has {world} process(es); "
                "on torch each replica is a process: kdist-train and train_and_evaluate start "
                "them for one machine, torchrun or kdist-launch for several")
        self._group = grouped and world > 1
        rank = dist.get_rank() if grouped else 0
        self.num_replicas, self.num_local_replicas = world, 1
        self.batch_shares = world  # Each process runs its own step.
        self.shard, self.is_chief = (rank, world), rank == 0
        self.device = _device()
        self.devices = [str(self.device)]

    def scope(self):
        """Variables live on Keras' torch device; no scope is needed."""
        return contextlib.nullcontext()

    def outside_scope(self, variables):
        """Any variable serves: each process holds its own."""
        return []

    def primitives(self):
        """The step primitives of this engine (`kdist.step.context.Primitives`)."""
        return Primitives(self)

    def compile_steps(self, program):
        """Prepares the eager train and eval steps of `program` (a built
        `kdist.step.program.Program`).

        Every process starts from process 0's variables (broadcast). Each
        replica runs the step on its slice of the batch; `kdist.value_and_grad`
        averages the gradients over processes (one all-reduce per call) and
        the optimizers apply them in place, alike on every process. What the
        step assigns otherwise is kept: floats (BatchNormalization's moving
        statistics) averaged over processes, the rest as assigned. A
        `LossScaleOptimizer` skips a non-finite step everywhere; process 0
        alone reports that (`skipped`), so it is counted once.
        """
        self.program = program
        self._seed_offsets = seed_offsets(program.variables, self.shard[0])
        if self._group:
            with torch.no_grad():
                for variable in program.variables:
                    dist.broadcast(variable.value.data, src=0)
            # Unseeded dropout draws from torch's own generator: one stream per
            # replica, process 0's the one a single process draws.
            torch.manual_seed(torch.initial_seed() + self.shard[0] * contract.SEED_STRIDE)

    def distribute(self, stacked):
        """This process's part of a stacked chunk, as tensors on its device."""
        return _map_arrays(lambda a: keras.ops.convert_to_tensor(a), stacked)

    def train_chunk(self, chunk, num_steps):
        """The chunk's first `num_steps` optimizer steps; returns each step's
        statistics summed over the processes."""
        per_step = [self._train_step(_map_arrays(lambda a: a[k], chunk))  # noqa: B023
                    for k in range(num_steps)]
        return self._summed(per_step)

    def _train_step(self, batch):
        # Only what `kdist.value_and_grad` differentiates records a graph (its
        # Primitives enable it), as a tape does on TensorFlow: a tensor computed
        # before it carries no gradient to the variables.
        offsets = self._seed_offsets
        with torch.no_grad():
            stats, scope = self.program.run(Primitives(self), True, batch,
                                            [(v, v.value + shift) for v, shift in offsets])
        with torch.no_grad():
            changed = scope.changed()
            for variable, shift in offsets:  # Kept unshifted: alike in every process.
                if id(variable) in changed:
                    changed[id(variable)] = changed[id(variable)] - shift
            self._keep_updates(changed)
        stats = {k: v.detach() for k, v in stats.items()}
        if not self.is_chief:
            stats["skipped"] = torch.zeros_like(stats["skipped"])
        return stats

    def _keep_updates(self, changed):
        """Writes what a train step assigned outside its optimizers, equal in every
        process, in one all-reduce: a variable declared with aggregation "sum" moves
        by the sum of the processes' changes, "only_first_replica" by process 0's;
        other floats (moving statistics) move to the mean of the new values; the
        rest (seed states, the same in every process) as assigned."""
        updated = [(v, changed[id(v)]) for v in self.program.variables if id(v) in changed]
        kinds = [v.aggregation if v.aggregation in ("sum", "only_first_replica")
                 else "mean" if keras.backend.is_float_dtype(v.dtype) else None for v, _ in updated]
        first = self.shard[0] == 0
        parts = [new / self.num_replicas if kind == "mean" else
                 (new - v.value) * (1 if kind == "sum" or first else 0)
                 for (v, new), kind in zip(updated, kinds) if kind]
        reduced = iter(self._all_reduce_sum(parts))
        for (variable, new), kind in zip(updated, kinds):
            if kind is None:
                variable.assign(new)
            else:
                value = next(reduced)
                variable.assign(value if kind == "mean" else variable.value + value)

    def eval_chunk(self, chunk, num_steps):
        """The chunk's first `num_steps` eval steps; returns each step's summed statistics."""
        return self._summed([self._eval_step(_map_arrays(lambda a: a[k], chunk))  # noqa: B023
                             for k in range(num_steps)])

    def _eval_step(self, batch, whole=False):
        with torch.no_grad():
            stats, _ = self.program.run(Primitives(self, whole), False, batch)
        return {k: v.detach() for k, v in stats.items()}

    def eval_whole(self, batch):
        """Evaluates one batch of any size, whole, in every process alike: each
        returns the same statistics, so they are counted once."""
        stats = self._eval_step(self.distribute(batch), whole=True)
        return {k: v.cpu().numpy() for k, v in stats.items()}

    def _summed(self, per_step):
        """{key: (steps, ...) array} of per-step statistics, summed over processes
        in one all-reduce."""
        keys = list(per_step[0]) if per_step else list(self.program.keys)
        stacked = [torch.stack([torch.as_tensor(s[k], dtype=torch.float32) for s in per_step])
                   if per_step else torch.zeros((0,)) for k in keys]
        stacked = self._all_reduce_sum(stacked)
        return {k: v.cpu().numpy() for k, v in zip(keys, stacked)}

    def _all_reduce_sum(self, tensors):
        """`tensors` summed over the processes (`torch_step.all_reduce_sum`)."""
        return all_reduce_sum(tensors) if self._group else list(tensors)

    def compiled_train_programs(self):
        """Steps run eagerly: the one train step function serves every chunk."""
        return 1

    def any_worker(self, flag):
        """Whether `flag` is true on any process: an all-reduce every process
        calls at the same point. With one process, no communication."""
        if not self._group:
            return bool(flag)
        value = torch.tensor([float(bool(flag))], device=self._collective_device())
        dist.all_reduce(value)
        return bool(value.item() > 0)

    def replica_checksums(self):
        """This process's replica."""
        return [[tree.checksum([keras.ops.convert_to_numpy(v.value)])
                 for v in self.program.variables]]

    def workers_values(self, values):
        """Every process's `values`: a sum of each one's row, in one all-reduce."""
        rank, world = self.shard
        if not self._group:
            return [list(values)]
        rows = torch.zeros((world, len(values)), dtype=torch.float64)
        rows[rank] = torch.tensor(values, dtype=torch.float64)
        rows = rows.to(self._collective_device())
        dist.all_reduce(rows)
        return rows.cpu().round().long().tolist()

    def _collective_device(self):
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def keras_fit_callbacks(self):
        """Keras' fit needs nothing extra on torch."""
        return []

    def sync_to_model(self):
        """Variables are updated in place on torch: nothing to write back."""

    def sync_from_model(self):
        """The steps read the variables themselves: nothing to take back."""
