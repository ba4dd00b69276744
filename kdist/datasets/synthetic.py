"""Generated image classification sets: random images whose labels a model can learn."""

import numpy as np

from kdist.inputs.arrays import Dataset

NUM_CLASSES = 10  # Of the generated sets, unless asked otherwise.


def synthetic_images(num_train: int, num_test: int, seed: int, image_shape: tuple[int, ...],
                     num_classes: int = NUM_CLASSES) -> Dataset:
    """Random images of `image_shape` in [0, 1] and integer labels below `num_classes`.

    Each class is a faint random template under heavy noise, so accuracy
    rises over epochs without reaching 100% at once.
    """
    rng = np.random.default_rng(seed)
    templates = rng.normal(0.0, 0.12, (num_classes,) + tuple(image_shape)).astype(np.float32)

    def make(n):
        labels = rng.integers(0, num_classes, n).astype(np.int32)
        noise = rng.normal(0.5, 0.5, (n,) + tuple(image_shape)).astype(np.float32)
        return np.clip(templates[labels] + noise, 0.0, 1.0), labels

    train_images, train_labels = make(num_train)
    test_images, test_labels = make(num_test)
    return Dataset(train_images, train_labels, test_images, test_labels,
                   source=f"synthetic, seed {seed}")
