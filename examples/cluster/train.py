"""Your own training script, run alone or as one worker of many, unchanged.

    python examples/cluster/train.py --synthetic 1200 --epochs 2          # one process
    kdist-launch --workers 2 -- python examples/cluster/train.py --epochs 2
    sbatch examples/cluster/slurm.sbatch                                   # SLURM
    kubectl apply -f examples/cluster/job.yaml                             # Kubernetes
    KERAS_BACKEND=torch torchrun --nproc-per-node 2 examples/cluster/train.py

Each launcher tells the process which worker it is in its own variables
(SLURM's, torchrun's, TF_CONFIG, KERAS_DISTRIBUTION_*, or kdist-launch's and
the manifest's KDIST_PEERS / KDIST_WORKER_INDEX); `kdist.connect()` reads
them and joins the others. Only worker 0, the chief, prints and writes
checkpoints: give every worker the same --checkpoint-dir on a shared file
system, so that a resumed run finds the chief's checkpoints wherever it runs.
"""

import argparse
import sys

import kdist


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--synthetic", type=int, default=None, metavar="N",
                   help="N generated examples instead of Fashion-MNIST")
    p.add_argument("--data-dir", default=None, help="folder of the Fashion-MNIST files")
    p.add_argument("--batch-size-per-replica", type=int, default=64)
    p.add_argument("--steps-per-epoch", type=int, default=None)
    p.add_argument("--learning-rate", type=float, default=0.05)
    p.add_argument("--replicas", type=int, default=None,
                   help="devices of this process (one worker: e.g. 2 CPU replicas)")
    p.add_argument("--checkpoint-dir", default="./training_checkpoints")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    kdist.prepare_environment(replicas=args.replicas)  # Before Keras loads.
    try:
        return train(args)
    except kdist.Interrupted as stopped:  # A signal: every worker stopped after the same
        print(f"interrupted: {stopped}", file=sys.stderr)  # step; the chief saved it.
        return stopped.exit_status  # kdist-launch counts this as a stop, not a failure.
    except kdist.KdistError as error:  # A peer, the data, a checkpoint: one line.
        print(f"error: {error}", file=sys.stderr)
        return 1


def train(args):
    import keras  # Here: after prepare_environment.

    worker = kdist.connect()  # Joins the workers the environment names; alone, nothing.

    def model():  # Compiled as for fit; plain SGD.
        cnn = kdist.create_model()
        cnn.compile(optimizer=keras.optimizers.SGD(args.learning_rate),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"])
        return cnn

    data = (kdist.synthetic_fashion_mnist(args.synthetic, seed=0) if args.synthetic
            else kdist.load_fashion_mnist(args.data_dir))
    config = kdist.TrainConfig(
        epochs=args.epochs, batch_size_per_replica=args.batch_size_per_replica,
        steps_per_epoch=args.steps_per_epoch, replicas=args.replicas, checkpoint_every=1,
        checkpoint_dir=args.checkpoint_dir)
    result = kdist.train_and_evaluate(config, data, model_fn=model)
    if worker.is_chief:
        print(f"Worker 0 of {worker.num_workers}: test accuracy "
              f"{result.restored['test_accuracy']:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
