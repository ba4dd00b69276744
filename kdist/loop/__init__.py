"""The training loop, written once for every backend: epochs and checkpoints
(`training`), the compiled model and its step (`building`), chunks of steps
(`chunks`, fed by `prefetch`), what a run reports (`reporting`) and one process
per replica for the engines that need it (`replicas`)."""
