"""One worker of tests/test_input_workers.py: the toy MLP of tests/test_inputs.py trained
from a tf.data pipeline, a PyDataset or a function told its shard, with SGD, through the
library API. A function also prints the examples it yielded.

    python tests/input_worker.py KIND CHECKPOINT_DIR BATCH_PER_REPLICA [PEERS INDEX]

With PEERS (every worker's host:port) and INDEX it joins the other workers
first, before any TensorFlow op or JAX computation, with `kdist.connect`.
"""

import sys

import kdist
from kdist.inputs import base

GLOBAL_BATCH = 16  # 8 per replica on 2 workers, 16 on one.
READ = [0]  # The examples this process's train function yielded.


def own_shares(x, y, short=0):
    """A train function told its shard: worker I of N yields its rows of every global
    batch of an epoch's order (worker 1 `short` global batches fewer), as one process
    reading everything would cut them."""
    import numpy as np

    def batches(epoch, shard):
        index, count = shard
        local = GLOBAL_BATCH // count
        order = np.random.default_rng([3, epoch]).permutation(len(x))
        full = len(order) // GLOBAL_BATCH - (short if index == 1 else 0)
        for start in range(0, full * GLOBAL_BATCH, GLOBAL_BATCH):
            rows = order[start + index * local:start + (index + 1) * local]
            READ[0] += len(rows)
            yield x[rows], y[rows]

    return batches


def inputs_of(kind):
    """The training and test data of `kind`, made as every worker makes them."""
    import keras
    import test_inputs


    keras.utils.set_random_seed(1)  # A tf.data shuffle's seeds depend on the global seed.
    x, y = test_inputs.TRAIN
    if kind in ("own shares", "uneven shares"):
        train = own_shares(x, y, short=2 if kind == "uneven shares" else 0)
        return base.Inputs(train, test_inputs.Batches(*test_inputs.TEST, 64))
    if kind == "tf.data":
        return base.Inputs(test_inputs.tf_data(x, y, 25, shuffle=7),
                             test_inputs.tf_data(*test_inputs.TEST, 100))
    return base.Inputs(test_inputs.Batches(x, y, 25), test_inputs.Batches(*test_inputs.TEST, 64))


def train(kind, folder, batch_size, replicas=None, log=print):
    import test_inputs

    from kdist.loop import training

    settings = training.TrainConfig(epochs=2, batch_size_per_replica=batch_size,
                                    replicas=replicas, checkpoint_dir=folder, seed=5,
                                    checkpoint_every=1, progress=False)
    return training.train_and_evaluate(settings, inputs_of(kind),
                                       model_fn=test_inputs.make_mlp, log=log)


def main(kind, folder, batch_size, peers=None, index=None):
    kdist.prepare_environment()
    kdist.connect(peers=peers, worker_index=None if index is None else int(index), timeout=60)
    train(kind, folder, int(batch_size), log=lambda line: print(line, flush=True))
    if kind.endswith("shares"):
        print(f"examples read: {READ[0]}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
