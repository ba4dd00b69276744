"""Generated 32x32x3 images of 10 classes, the data of `kdist-bench --model resnet20`."""

import dataclasses

from kdist.datasets import synthetic
from kdist.datasets.sizes import CIFAR_SHAPED_TEST, CIFAR_SHAPED_TRAIN

IMAGE_SHAPE = (32, 32, 3)


def synthetic_cifar(num_train=CIFAR_SHAPED_TRAIN, num_test=CIFAR_SHAPED_TEST, seed=0):
    """Generated 32x32x3 images of 10 classes (`kdist.synthetic.synthetic_images`)."""
    dataset = synthetic.synthetic_images(num_train, num_test, seed, IMAGE_SHAPE)
    return dataclasses.replace(dataset, source=f"synthetic 32x32x3, seed {seed}")
