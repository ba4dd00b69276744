"""The tutorial job as PyTorch users write it: torch.nn, DistributedDataParallel, no Keras.

The reference `kdist-bench` compares kdist's torch engine with: the same CNN
(Conv2d 32 3x3 - max pool - Conv2d 64 3x3 - max pool - Linear 64 - Linear 10),
Adam 1e-3, cross-entropy, the same global batch, one process per replica
(gloo on CPUs; on GPUs NCCL, the GPU of its rank, each batch copied from
pinned host memory as a DataLoader with pin_memory does), each reading its
shard of every global batch. It trains
1 + --windows epochs of --steps steps on synthetic Fashion-MNIST-shaped data
and prints the median samples/s of the epochs after the first, as
`kdist-bench` does, plus one JSON line.

    python scripts/ddp_baseline.py --replicas 2 --steps 300 --windows 3
"""

import json
import os
import socket
import time

import numpy as np
import peer_loop  # scripts/peer_loop.py, beside this file
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def cnn():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 5 * 5, 64), nn.ReLU(), nn.Linear(64, 10))


def worker(rank, world, port, args, results):
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = cnn().to(device)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    rng = np.random.default_rng(0)
    global_batch = args.batch_size_per_replica * world
    images = torch.from_numpy(
        rng.uniform(0, 1, (args.steps * global_batch, 1, 28, 28)).astype(np.float32))
    labels = torch.from_numpy(rng.integers(0, 10, args.steps * global_batch))
    if on_gpu:
        images, labels = images.pin_memory(), labels.pin_memory()
    seconds = []
    for _ in range(1 + args.windows):
        start = time.perf_counter()
        for step in range(args.steps):
            first = step * global_batch + rank * args.batch_size_per_replica
            x = images[first:first + args.batch_size_per_replica].to(device, non_blocking=True)
            y = labels[first:first + args.batch_size_per_replica].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()  # DDP averages the gradients over processes.
            optimizer.step()
        if on_gpu:
            torch.cuda.synchronize(device)
        if world > 1:
            dist.barrier()
        seconds.append(time.perf_counter() - start)
    if rank == 0:
        results.put(peer_loop.summary(seconds, args.steps, global_batch,
                                      baseline="torch DDP", torch=torch.__version__,
                                      replicas=world, device=device.type))
    dist.destroy_process_group()


def main():
    args = peer_loop.parse_args(__doc__, steps=300, windows=3)
    port = free_port()
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(args.replicas, port, args, results), nprocs=args.replicas)
    print(json.dumps(results.get()))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
