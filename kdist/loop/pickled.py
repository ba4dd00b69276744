"""What travels to the replica processes: cloudpickle's bytes, each Keras loss,
metric and optimizer in them checked to arrive as it left.

Keras pickles its objects through their config (`KerasSaveable.__reduce__`),
and some configs leave settings out (Keras 3.15): `Huber(delta=0.5)` arrives
as `Huber()`, `CosineSimilarity(axis=0)` with axis -1, an `AdamW` without the
variables its `exclude_from_weight_decay` named. Made inside `model_fn`, which
each replica process calls, such objects never travel; made outside it and
captured, each replica would train with settings other than the caller's,
silently. `dumps` refuses them, naming what would change.

The code of a function sent by value (one of a script's own) travels through
`marshal`, as Python's own `.pyc` files keep it: cloudpickle names its file
`<dynamic-code>`, and a traceback from a replica process would not name the
script's file and lines.
"""

import io
import marshal
import pickle
import re
import types

import cloudpickle
import keras

from kdist.errors import UsageError

_CHECKED = (keras.losses.Loss, keras.metrics.Metric, keras.optimizers.Optimizer)
_OPAQUE = object()  # An attribute whose value is not compared.


def dumps(value):
    """`cloudpickle.dumps(value)`; a Keras loss, metric or optimizer in `value`
    (or compiled into a model in it) that Keras' pickling would change is a
    UsageError."""
    buffer = io.BytesIO()
    _Pickler(buffer).dump(value)
    return buffer.getvalue()


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):  # (The replica processes run this Python.)
            return marshal.loads, (marshal.dumps(obj),)
        if isinstance(obj, _CHECKED):
            _refuse_changed(obj)
        elif isinstance(obj, keras.Model):
            compiled = [getattr(obj, "optimizer", None),
                        *keras.tree.flatten(getattr(obj, "loss", None))]
            for part in compiled:
                if isinstance(part, _CHECKED):
                    _refuse_changed(part, obj)
        return super().reducer_override(obj)


def _refuse_changed(obj, model=None):
    """Raises UsageError if `obj` (compiled into `model`, if given) would arrive
    with other settings than it has here."""
    arrived = vars(pickle.loads(pickle.dumps(obj)))  # Keras' own pickling.
    for name, value in vars(obj).items():
        sent = _plain(value)
        if sent is _OPAQUE or _plain(arrived.get(name, _OPAQUE)) == sent:
            continue
        was = _plain(arrived.get(name, _OPAQUE))
        change = (", ".join(f"{key}={sent[key]!r} (it arrives as {was.get(key)!r})"
                            for key in sent if was.get(key, _OPAQUE) != sent[key])
                  if isinstance(sent, dict) and isinstance(was, dict)
                  else "its state (it is built: trained or restored)" if name == "built"
                  else name)
        where = "" if model is None else f" compiled into model {model.name!r}"
        raise UsageError(
            f"{type(obj).__name__}{where} made outside model_fn would reach the replica "
            f"processes changed: Keras pickles it through its config, which leaves out "
            f"{change}; create it inside model_fn, which each replica process calls")


def _plain(value):
    """`value` if it holds only numbers, strings, booleans and None (in lists,
    tuples and dicts; a regular expression as its pattern), else _OPAQUE."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, re.Pattern):
        return value.pattern
    if isinstance(value, (list, tuple)):
        items = [_plain(item) for item in value]
        return _OPAQUE if any(item is _OPAQUE for item in items) else tuple(items)
    if isinstance(value, dict):
        entries = {key: _plain(item) for key, item in value.items()}
        return _OPAQUE if any(item is _OPAQUE for item in entries.values()) else entries
    return _OPAQUE
