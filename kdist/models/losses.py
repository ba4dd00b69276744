"""The default loss of the models kdist compiles itself (the CLI's, and an
uncompiled `model_fn`'s). How losses are scaled across replicas is
`kdist.step`'s business."""

import keras


def sparse_categorical_crossentropy(labels, logits):
    """Per-example cross-entropy from logits, shape (batch,)."""
    return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
