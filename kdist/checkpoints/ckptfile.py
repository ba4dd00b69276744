"""One checkpoint file: a Keras `.weights.h5` file with kdist's state, checked on read.

The file is what `model.save_weights` writes for a compiled model, with
kdist's state as a JSON attribute `kdist` on the root. Format 2 adds
`checksum` to that state: SHA-256 over every dataset (name, dtype, shape and
bytes, in name order). A file is trusted only if its checksum matches and
every floating-point value in it is finite. Format 1 files (no checksum) are
still read; for them only the finiteness is checked.

The file also holds what `save_weights` leaves out or changes: the seed
generators' state and the unmerged variables of layers with LoRA enabled
(`kdist.checkpoints.unsaved`). A root attribute `kdist_optimized` names the
weights each optimizer updates (their indices in `model.weights`), and
`kdist_optimizer_classes` each optimizer's class, so a resume whose model
trains other weights, or with another kind of optimizer, is refused, not
given their state.

Keras writes the file into memory (`Buffer`), and kdist copies the bytes to
disk with plain file I/O: a full disk then raises `OSError` in Python instead
of failing inside HDF5, whose half-written, still-open file crashed the
process when it was finally closed. Reading works the same way round: the
bytes are read once, verified, and loaded from memory, so what is loaded is
what was verified.
"""

import hashlib
import io
import json

import h5py
import numpy as np

from kdist.checkpoints import unsaved
from kdist.errors import InvalidCheckpoint, NonFiniteWeights

FORMAT = "kdist-checkpoint-2"
READABLE = ("kdist-checkpoint-1", FORMAT)
# The types of the records kdist reads back, checked where present: format 1 has the
# first four alone, and older format-2 files lack some of the rest.
FIELDS: dict[str, type | tuple[type, ...]] = {
    "step": int, "epoch": int, "step_in_epoch": int, "signature": list,
    "totals": (dict, type(None)), "history": list, "stopped": bool, "backend": str,
    "replicas": int, "global_batch_size": int, "seed": int, "workers": int,
    "train_examples": (int, type(None)), "steps_per_epoch": (int, type(None)),
    "learning_rate": (float, int, type(None)), "compiled_rates": list}
OPTIMIZED = "kdist_optimized"  # Which weights each optimizer updates (`_optimized`).
CLASSES = "kdist_optimizer_classes"  # Each optimizer's class (`_classes`).


class Buffer(io.BytesIO):
    """An in-memory file that Keras accepts where it wants a `.weights.h5` path."""

    def __str__(self):
        return "checkpoint.weights.h5"


def snapshot(model):
    """The checkpoint file of `model` as it is now, in memory, without kdist's
    state: Keras' `save_weights` output plus what it leaves out
    (`kdist.checkpoints.unsaved`). The model may change afterwards; the
    snapshot does not."""
    buffer = Buffer()
    model.save_weights(buffer)
    with h5py.File(buffer, "a") as f:
        f.attrs[OPTIMIZED] = json.dumps(_optimized(model))
        f.attrs[CLASSES] = json.dumps(_classes(model))
        unsaved.write(model, f)
    return buffer


def _optimized(model):
    """{attribute: the indices in `model.weights` of the weights it updates} of each
    built optimizer the model holds as an attribute: its state variables are
    those weights' slots, in that order."""
    index = {id(w): i for i, w in enumerate(model.weights)}
    return {name: [index.get(id(v), -1) for v in optimizer._trainable_variables]
            for name, optimizer in _held_optimizers(model) if optimizer.built}


def _classes(model):
    """{attribute: class name} of each built optimizer the model holds, the class
    a `LossScaleOptimizer` wraps for it (its state is that class's, and a resume
    may add or drop the wrapper with the precision)."""
    return {name: type(getattr(optimizer, "inner_optimizer", optimizer)).__name__
            for name, optimizer in _held_optimizers(model) if optimizer.built}


def _held_optimizers(model):
    """(attribute, optimizer) of each optimizer the model holds as an attribute,
    as Keras writes its state: under the first of its names in the order Keras'
    saving walks them (sorted, private names last: `d_optimizer` before an
    alias `_dopt`), once each."""
    import keras  # Here: reading metadata needs no framework.

    seen: set = set()
    for name, value in sorted(vars(model).items(),
                              key=lambda item: ("~" + item[0]) if item[0].startswith("_")
                              else item[0]):
        if isinstance(value, keras.optimizers.Optimizer) and id(value) not in seen:
            seen.add(id(value))
            yield name, value


def finish(taken, metadata):
    """The bytes of checkpoint `taken` (a `snapshot`) with kdist's state
    `metadata` and the checksum; raises NonFiniteWeights."""
    with h5py.File(taken, "a") as f:
        digest, bad = _scan(f)
        if bad:
            raise NonFiniteWeights(bad)
        f.attrs["kdist"] = json.dumps(dict(metadata, format=FORMAT, checksum=digest))
    return taken.getvalue()


def encode(model, metadata):
    """The bytes of a checkpoint of `model` with `metadata`; raises NonFiniteWeights."""
    return finish(snapshot(model), metadata)


def read_metadata(source):
    """kdist's state in `source` (a path or a file object), unverified.

    Raises InvalidCheckpoint if it holds no kdist state of a known format, or a
    record of another type than `FIELDS` says (a file edited by hand), or
    the error h5py raises for a file it cannot open.
    """
    with h5py.File(source, "r") as f:
        if "kdist" not in f.attrs:
            raise InvalidCheckpoint("it has no kdist metadata")
        meta = _json_attribute(f, "kdist")
    if not isinstance(meta, dict) or meta.get("format") not in READABLE:
        raise InvalidCheckpoint(f"unknown checkpoint format "
                                f"{meta.get('format') if isinstance(meta, dict) else meta!r}")
    for key, kind in FIELDS.items():
        value = meta.get(key)
        wrong = not isinstance(value, kind) or (kind is int and isinstance(value, bool))
        if key in meta and wrong:
            raise InvalidCheckpoint(f"its metadata record {key!r} is {value!r}")
    return meta


def _json_attribute(f, name):
    """The value of open file `f`'s root attribute `name`, written as JSON;
    raises InvalidCheckpoint if it is not (a file edited by hand)."""
    try:
        return json.loads(f.attrs[name])
    except ValueError:
        raise InvalidCheckpoint(f"its record {name!r} is not JSON") from None


def verify(data):
    """kdist's state in checkpoint bytes `data`, after checking its values.

    Raises InvalidCheckpoint if the checksum does not match or a value is not
    finite.
    """
    buffer = Buffer(data)
    meta = read_metadata(buffer)
    with h5py.File(buffer, "r") as f:
        digest, bad = _scan(f)
    if "checksum" in meta and digest != meta["checksum"]:
        raise InvalidCheckpoint("its weights do not match its checksum (damaged file)")
    if bad:
        raise InvalidCheckpoint(str(NonFiniteWeights(bad)))
    return meta


def load(model, data, optimizers=True):
    """Loads verified checkpoint bytes `data` into `model` (and its optimizer), with
    what `save_weights` leaves out (`kdist.checkpoints.unsaved`).

    A checkpoint moves between precisions (`kdist.precision`): the
    variables are float32 under every policy, and the optimizer state is
    translated where mixed_float16's `LossScaleOptimizer` is on one side
    only (`_fit_optimizer_layout`). Raises InvalidCheckpoint, before
    loading anything, if `optimizers` (training goes on from the file) and
    the file holds another count of state variables than one of the model's
    built optimizers has (`_check_optimizer_state`); if Keras cannot load it
    (the model's layers are other ones, of the same weight shapes); after, if
    it holds another count of seed generators or LoRA variables than the model has.
    """
    data = _fit_optimizer_layout(data, getattr(model, "optimizer", None))
    with h5py.File(Buffer(data), "r") as f:
        if optimizers:
            _check_optimizer_state(f, model)
    try:
        model.load_weights(Buffer(data))
    except ValueError as e:  # Keras: the file's layers are not the model's (same shapes).
        said = " ".join([line for line in str(e).splitlines() if line.strip()][:2])
        raise InvalidCheckpoint(f"Keras cannot load it ({said})") from None
    with h5py.File(Buffer(data), "r") as f:
        unsaved.read(model, f)


def _check_optimizer_state(f, model):
    """Raises InvalidCheckpoint if open file `f` holds, for an optimizer the
    model holds as an attribute (`optimizer`, a GAN's `d_optimizer`: Keras
    writes its state under that name), another class (Adam's moments would
    become Adamax's, SGD's rate a Lion's), another count of state variables than
    that optimizer has once built (Adam 2 per weight and 2 of its own, SGD 2 of
    its own). Keras would skip that state with a warning and train on with a
    fresh optimizer. Nor may the optimizer have updated other weights of the
    model (a layer's `trainable` changed): Keras would load one weight's
    slots (momentum) into another's of the same shape, or fail on another
    shape. An optimizer not yet built (evaluation: it holds its step count
    and learning rate alone) is not checked."""
    written = _json_attribute(f, OPTIMIZED) if OPTIMIZED in f.attrs else {}
    classes = _json_attribute(f, CLASSES) if CLASSES in f.attrs else {}  # Older: none.
    built, kinds = _optimized(model), _classes(model)
    for name, value in _held_optimizers(model):
        if not value.built:
            continue
        if classes.get(name, kinds[name]) != kinds[name]:
            raise InvalidCheckpoint(
                f"its optimizer {name!r} was {classes[name]}, and this model's is "
                f"{kinds[name]}: the state of one is not the other's; to go on from its "
                "weights with a fresh optimizer, start in another checkpoint folder from a "
                "model_fn that loads them")
        has = len(value.variables)
        holds = len(f[f"{name}/vars"]) if f"{name}/vars" in f else 0
        if holds != has:
            why = ("none under that name: an attribute renamed?" if holds == 0 else
                   "a learning-rate schedule in place of a constant rate or the reverse, "
                   "use_ema turned on or off, another optimizer, or other weights")
            raise InvalidCheckpoint(
                f"it holds {holds} state variables of optimizer {name!r}, and this model's "
                f"{type(value).__name__} has {has} ({why})")
        if name in written and written[name] != built[name]:
            raise InvalidCheckpoint(
                f"its optimizer {name!r} updated other weights than this model's does (a "
                "layer's trainable setting changed?), so their state would land on other "
                "weights; to go on from its weights with a fresh optimizer, start in "
                "another checkpoint folder from a model_fn that loads them")


def _fit_optimizer_layout(data, optimizer):
    """`data` with its optimizer state in the layout `optimizer` reads.

    Keras writes a `LossScaleOptimizer` as `optimizer/vars` (its own
    variables: iterations, learning rate, step counter, loss scale; then
    the wrapped optimizer's) and `optimizer/inner_optimizer/vars` (the
    wrapped optimizer's); a plain optimizer as `optimizer/vars`. Keras
    itself skips, with a warning, optimizer state whose count differs, which
    would silently restart Adam's moments. Here instead:

    - written with a `LossScaleOptimizer`, read without one (mixed_float16
      to float32 or mixed_bfloat16): the wrapped optimizer's state is
      restored; the loss scale is dropped.
    - written without, read with one: the state goes to the wrapped
      optimizer; the loss scale and its step counter keep the values they
      have (a fresh run's: the initial scale).

    The same optimizer on both sides, or no optimizer (evaluation): `data`
    unchanged.
    """
    if optimizer is None:
        return data
    import keras  # Here: reading metadata needs no framework.

    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    with h5py.File(Buffer(data), "r") as f:
        if "optimizer/vars" not in f or ("optimizer/inner_optimizer/vars" in f) == scaled:
            return data
    buffer = Buffer(data)
    with h5py.File(buffer, "a") as f:
        group = f["optimizer"]
        if not scaled:  # The wrapped optimizer's state becomes the optimizer's.
            del group["vars"]
            group.move("inner_optimizer/vars", "vars")
            del group["inner_optimizer"]
        else:
            inner = [group["vars"][str(i)][()] for i in range(len(group["vars"]))]
            own = optimizer.variables[:len(optimizer.variables)
                                      - len(optimizer.inner_optimizer.variables)]
            group.require_group("inner_optimizer")
            group.move("vars", "inner_optimizer/vars")
            values = group.create_group("vars")
            for i, value in enumerate([np.array(keras.ops.convert_to_numpy(v)) for v in own]
                                      + inner):
                values[str(i)] = value
    return buffer.getvalue()


def _finite(value, declared):
    """Whether every number in dataset `value` is finite. Keras stores bfloat16 as
    2-byte opaque values with a `dtype` attribute "bfloat16": all 8 exponent bits
    set is an infinity or a NaN."""
    if declared == "bfloat16" and value.dtype.itemsize == 2:
        return not ((value.view(np.uint16) & 0x7F80) == 0x7F80).any()
    return value.dtype.kind not in "fc" or bool(np.isfinite(value).all())


def _scan(f):
    """(SHA-256 of every dataset, names of datasets with non-finite values)."""
    names = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    digest, bad = hashlib.sha256(), []
    for name in sorted(names):
        value = np.ascontiguousarray(f[name][()])
        digest.update(f"{name}|{value.dtype.str}|{value.shape}\n".encode())
        digest.update(value.tobytes())
        if not _finite(value, f[name].attrs.get("dtype")):
            bad.append(name)
    return "sha256:" + digest.hexdigest(), bad
