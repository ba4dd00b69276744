"""Reading checkpoints: a file's kdist state, its verification, and loading it into
a model (`restore`); what a checkpoint must match (`model_signature`)."""

from kdist.checkpoints import ckptfile
from kdist.errors import CheckpointError, InvalidCheckpoint


class CheckpointWarning(UserWarning):
    """A checkpoint skipped, or a file kdist leaves alone; the message names it."""


def model_signature(model):
    """The shapes of the model's weights, in order: what a checkpoint must match.

    Shapes, not variable paths: paths carry auto-generated layer names that
    differ between two instances of the same model.
    """
    return [list(v.shape) for v in model.weights]


def _first_difference(signature, model):
    """Where checkpoint `signature` and `model`'s weights first differ, in words."""
    for i, (written, weight) in enumerate(zip(signature, model.weights)):
        if list(weight.shape) != written:
            return (f"its weight {i} has shape {tuple(written)}, this model's "
                    f"{weight.path!r} {tuple(weight.shape)}")
    return f"it holds {len(signature)} weights, this model has {len(model.weights)}"


def read_metadata(path):
    """kdist's state stored in checkpoint `path` (unverified); raises if it is not one."""
    return ckptfile.read_metadata(path)


def progress(meta):
    """Where in training checkpoint metadata `meta` stands: its sort key."""
    return meta.get("epoch", 0), meta.get("step_in_epoch") or 0, meta.get("step", 0)


def failure_reason(error):
    """`error` in one line: an invalid checkpoint's own message, else its type and message."""
    text = str(error) if isinstance(error, ckptfile.InvalidCheckpoint) \
        else f"{type(error).__name__}: {error}"
    return " ".join(text.split())


def read_verified(path):
    """(bytes, metadata) of checkpoint `path` after verification; raises CheckpointError."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        return data, ckptfile.verify(data)
    except Exception as e:  # h5py raises several types for bad files.
        raise CheckpointError(f"checkpoint {path}: {failure_reason(e)}") from None


def restore(model, path, hint=None, optimizers=True):
    """Loads checkpoint `path` into `model` (and its compiled optimizer), once verified.

    Returns its metadata. Raises `CheckpointError` if it fails verification
    or was written for another model: other weight shapes, other seed
    generators, or, with `optimizers` (training goes on from it), another
    optimizer's state; `hint`, what the caller's user can do then, ends that
    error's message.
    """
    data, metadata = read_verified(path)
    end = f"; {hint}" if hint else ""
    if metadata["signature"] != model_signature(model):
        raise CheckpointError(f"{path} was written for a different model: "
                              f"{_first_difference(metadata['signature'], model)}{end}")
    try:
        ckptfile.load(model, data, optimizers)
    except InvalidCheckpoint as e:  # Its optimizers or seed generators are not the model's.
        raise CheckpointError(f"{path} was written for a different model: {e}{end}") from None
    return metadata
