"""`kdist-bench`'s choices and defaults, written once; importing this loads no framework."""

WINDOWS = 4  # Steady epochs `kdist.bench.measure` times after the first.
# How kdist-bench feeds kdist (`--input`): the arrays, or the same arrays through a pipeline.
INPUTS = ("numpy", "tfdata", "pydataset", "grain")
# --model's choices, in `kdist.bench.measure.MODELS`' order (then dcgan, which
# `kdist.bench.gan` measures); the first is the default.
MODELS = ("cnn", "cnn-stock", "cnn-weights", "resnet20", "dcgan")
