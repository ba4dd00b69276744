"""The training loop, written once for every backend: epochs and checkpoints
(`training`), the compiled model and its step (`building`), chunks of steps
(`chunks`, fed by `prefetch`) and what a run reports (`reporting`)."""
