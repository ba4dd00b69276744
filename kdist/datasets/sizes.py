"""The data sets' sizes, importable before NumPy or a framework loads (the
commands' flag defaults use them)."""

FASHION_MNIST_TRAIN, FASHION_MNIST_TEST = 60_000, 10_000
# The benchmark's 32x32x3 set: 10,000 float32 images are 123 MB.
CIFAR_SHAPED_TRAIN, CIFAR_SHAPED_TEST = 10_000, 2_000
