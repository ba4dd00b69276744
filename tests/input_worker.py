"""One worker of tests/test_input_workers.py: the toy MLP of tests/test_inputs.py trained
from a tf.data pipeline or a PyDataset with SGD, through the library API.

    python tests/input_worker.py KIND CHECKPOINT_DIR BATCH_PER_REPLICA [PEERS INDEX]

With PEERS (every worker's host:port) and INDEX it joins the other workers
first, before any TensorFlow op or JAX computation, with `kdist.connect`.
"""

import sys

import kdist
from kdist.inputs import base


def inputs_of(kind):
    """The training and test data of `kind`, made as every worker makes them."""
    import keras
    import test_inputs


    keras.utils.set_random_seed(1)  # A tf.data shuffle's seeds depend on the global seed.
    x, y = test_inputs.TRAIN
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


if __name__ == "__main__":
    main(*sys.argv[1:])
