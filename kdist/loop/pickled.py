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

A function or class of an importable module travels by its name: each
process imports the module again, as written. A script that replaced one of
the module's classes or functions after importing it (`mymodule.Sampling =
Mine`) would have the processes build and train with the module's own,
silently; `module_table` records what the caller's own modules hold, and
`check_modules`, in each process, refuses what differs.
"""

import io
import marshal
import os
import pickle
import re
import site
import sys
import sysconfig
import types

import cloudpickle
import keras

from kdist.errors import UsageError

_CHECKED = (keras.losses.Loss, keras.metrics.Metric, keras.optimizers.Optimizer)
_OPAQUE = object()  # An attribute whose value is not compared.


def dumps(value, modules=None):
    """`cloudpickle.dumps(value)`; a Keras loss, metric or optimizer in `value`
    (or compiled into a model in it) that Keras' pickling would change is a
    UsageError. `modules`, a set if given, gets the names of the modules whose
    functions, classes or selves travel by name."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.modules = set() if modules is None else modules
    pickler.dump(value)
    return buffer.getvalue()


def module_table(names):
    """{module: {name: "module.qualname"}} of the classes and functions that
    the caller's own modules among `names` hold (not a library's, kdist's or
    the script's `__main__`, which travels by value)."""
    return {name: _contents(sys.modules[name]) for name in sorted(names) if _own(name)}


def check_modules(table):
    """Raises UsageError where a module of `table` (`module_table`'s, from the
    caller) holds here, as imported, another class or function under a name."""
    for module, caller in table.items():
        here = _contents(sys.modules[module]) if module in sys.modules else {}
        for name, was in caller.items():
            if here.get(name, was) != was:
                raise UsageError(
                    f"{module}.{name} is {was} in the calling script, but {module} as "
                    f"written holds {here[name]}: the script replaced it after importing "
                    f"{module}, and each replica process imports {module} again and would "
                    f"train with {here[name]}; change {module} itself, or write a model_fn "
                    "in the script that uses yours")


def _own(name):
    """Whether module `name` is the caller's own: a file outside Python's and
    the installed libraries' folders, not kdist's, not `__main__`."""
    path = getattr(sys.modules.get(name), "__file__", None)
    if not path or name == "__main__" or name.partition(".")[0] == "kdist":
        return False
    libraries = [sysconfig.get_path(key) for key in ("stdlib", "platstdlib", "purelib",
                                                        "platlib")]
    libraries += [*site.getsitepackages(), site.getusersitepackages()]
    path = os.path.realpath(path)
    return not any(path.startswith(os.path.realpath(folder) + os.sep)
                   for folder in libraries if folder)


def _contents(module):
    return {name: f"{value.__module__}.{value.__qualname__}"
            for name, value in list(vars(module).items())
            if isinstance(value, (type, types.FunctionType)) and not name.startswith("__")}


class _Pickler(cloudpickle.Pickler):
    modules: set

    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):  # (The replica processes run this Python.)
            return marshal.loads, (marshal.dumps(obj),)
        if isinstance(obj, types.ModuleType):
            self.modules.add(obj.__name__)
        elif isinstance(obj, (type, types.FunctionType)):
            self.modules.add(getattr(obj, "__module__", None) or "__main__")
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
