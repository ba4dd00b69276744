"""The workers of a SLURM job step, read from the variables `srun` sets.

Each task `srun` starts is one worker: `SLURM_PROCID` of
`SLURM_STEP_NUM_TASKS`. The step's nodes (`SLURM_STEP_NODELIST`, SLURM's
compressed host list) and its tasks per node (`SLURM_STEP_TASKS_PER_NODE`)
give every worker's address: task `SLURM_LOCALID` of a node listens on
`port + SLURM_LOCALID` there, with tasks laid out node by node (srun's default
block distribution). The port is `MASTER_PORT` where set, else one derived
from `SLURM_JOB_ID`, so that two jobs sharing a node differ. Only a job step
counts: the batch script itself (no `SLURM_STEP_NUM_TASKS`) is one process.
Imports no framework.
"""

import itertools
import re

from kdist.errors import UsageError

STEP_VARIABLE = "SLURM_STEP_NUM_TASKS"  # Set in the tasks of an `srun` step only.
PORT_BASE, PORT_SPAN = 15000, 10000  # The port derived from the job id.


def expand_hostlist(text):
    """SLURM's host list, expanded: "node[01-03,7],gpu1" -> node01 node02 node03 node7 gpu1.

    The same as `scontrol show hostnames`: ranges keep their zero padding, and a
    name may hold several bracket groups (every combination, in order).
    """
    hosts: list[str] = []
    for name in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text):
        parts = re.split(r"\[([^\]]*)\]", name)  # Text, group, text, group, ..., text.
        choices = [[part] if i % 2 == 0 else _expand_group(part, text)
                   for i, part in enumerate(parts)]
        hosts.extend("".join(combination) for combination in itertools.product(*choices))
    if not hosts:
        raise UsageError(f"SLURM_STEP_NODELIST={text!r} names no host")
    return hosts


def _expand_group(group, text):
    names: list[str] = []
    for item in group.split(","):
        low, _, high = item.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise UsageError(f"SLURM_STEP_NODELIST={text!r}: cannot read the range [{group}]")
        width = len(low)
        names.extend(str(n).zfill(width) for n in range(int(low), int(high or low) + 1))
    return names


def expand_tasks_per_node(text):
    """SLURM's tasks per node, expanded: "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            raise UsageError(f"SLURM_STEP_TASKS_PER_NODE={text!r} is not like '2(x3),1'")
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts


def port(environ):
    """The first task's port on each node: MASTER_PORT, else one from the job id."""
    if environ.get("MASTER_PORT"):
        return int(environ["MASTER_PORT"])
    job = environ.get("SLURM_JOB_ID", "0")
    return PORT_BASE + (int(job) if job.isdigit() else 0) % PORT_SPAN


def addresses(environ, num_tasks):
    """Every task's host:port in task order, or only the first's (the coordinator)
    where the tasks are not laid out node by node."""
    nodes = expand_hostlist(environ.get("SLURM_STEP_NODELIST")
                            or environ.get("SLURM_NODELIST", ""))
    base = port(environ)
    counts = expand_tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE")
                                   or str(num_tasks))
    if len(counts) != len(nodes) or sum(counts) != num_tasks:
        raise UsageError(f"SLURM: {num_tasks} tasks but SLURM_STEP_TASKS_PER_NODE="
                         f"{environ.get('SLURM_STEP_TASKS_PER_NODE')!r} on {len(nodes)} nodes")
    if environ.get("SLURM_DISTRIBUTION", "block").split(":")[0] not in ("block", ""):
        return [f"{nodes[0]}:{base}"]
    return [f"{node}:{base + local}" for node, count in zip(nodes, counts)
            for local in range(count)]
