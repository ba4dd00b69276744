"""The state of the callbacks that torch's replica processes ran, brought back
into the caller's own callbacks.

Each replica process runs pickled copies of the callbacks; at the end the
chief process's copies' state (`portable_states`) goes back through the
parent's pipe, and `take_states` puts it into the caller's objects: the
attributes that pickle (not the model, not an open file), and the lists,
dicts, sets, numbers and strings that the callbacks' functions reach, in
their closures or as the globals they name (a `LambdaCallback`'s `lambda
epoch, logs: losses.append(...)`, a method appending to a list of its
module's). A list, dict or set is updated in place, so whoever else holds
it sees what was recorded, as after `fit`.
"""

import pickle
import types
from collections.abc import Iterator, Sequence
from typing import Any

import keras

_PLAIN = (list, dict, set, int, float, str, bool, type(None))


class _Reached:
    """What a function reaches that comes back: its closure cells' values, by
    index, and the globals it names, by name (`_reached`)."""

    def __init__(self, cells: dict[int, Any], names: dict[str, Any]):
        self.cells, self.names = cells, names


def _pickles(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 (whatever pickling raises: the value stays)
        return False
    return True


def _plain(value: Any) -> bool:
    return isinstance(value, _PLAIN) and not isinstance(value, type) and _pickles(value)


def _reached(function: Any) -> _Reached | None:
    """The lists, dicts, sets, numbers and strings `function` reaches, where any."""
    cells = {}
    for index, cell in enumerate(getattr(function, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # An empty cell.
            continue
        if _plain(value):
            cells[index] = value
    scope = function.__globals__
    names = {name: scope[name] for name in function.__code__.co_names
             if name in scope and _plain(scope[name])}
    return _Reached(cells, names) if cells or names else None


def _functions(callback: keras.callbacks.Callback) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(where, function) of the functions a callback holds (a `LambdaCallback`'s)
    and of its class's own methods (not Keras')."""
    for key, value in vars(callback).items():
        if isinstance(value, types.FunctionType):
            yield ("attribute", key), value
    for cls in type(callback).__mro__:
        if cls is object or cls.__module__.startswith("keras."):
            continue
        for name, value in vars(cls).items():
            if isinstance(value, types.FunctionType):
                yield ("method", cls.__qualname__, name), value


def portable_states(callbacks: Sequence[keras.callbacks.Callback]) -> list[dict[str, Any]]:
    """Each callback's attributes that pickle, but its model (an open file does
    not), and what its functions reach (`_reached`), under the key `_Reached`."""
    states = []
    for callback in callbacks:
        state = {k: v for k, v in vars(callback).items() if k != "_model" and _pickles(v)}
        reached = {where: found for where, function in _functions(callback)
                   if (found := _reached(function)) is not None}
        if reached:
            state[_Reached.__name__] = reached
        states.append(state)
    return states


def _into(original: Any, returned: Any) -> Any:
    """`returned` (a replica process's copy) put into `original` where it is a
    list, dict or set of the same type (whoever else holds it sees the change);
    returns what to keep."""
    if type(original) is not type(returned) or not isinstance(original, (list, dict, set)):
        return returned
    if isinstance(original, list):
        original[:] = returned
    else:
        original.clear()
        original.update(returned)
    return original


def _take_reached(callback: keras.callbacks.Callback, reached: dict) -> None:
    if not reached:  # (Nothing came from replica processes: the other backends.)
        return
    functions = dict(_functions(callback))
    for where, found in reached.items():
        function = functions.get(where)
        if function is None:
            continue
        cells = function.__closure__ or ()
        for index, returned in found.cells.items():
            cells[index].cell_contents = _into(cells[index].cell_contents, returned)
        scope = function.__globals__
        for name, returned in found.names.items():
            if name in scope and scope[name] != returned:
                scope[name] = _into(scope[name], returned)


def take_states(callbacks: Sequence[keras.callbacks.Callback],
                states: list[dict[str, Any]] | None, model: keras.Model | None) -> None:
    """Gives `callbacks` the attributes of `states` (the chief replica process's
    copies') and `model`, the trained model, as `fit` leaves them with its model.
    A list, dict or set, an attribute's or one a function reaches, is updated
    in place, so the caller's own objects hold what was recorded. The model is
    set as an attribute: `fit` calls `set_model` once, before training, and a
    callback's own `set_model` may write (Keras' `TensorBoard` writes the
    model's summary there)."""
    for callback, state in zip(callbacks, states or [{}] * len(callbacks), strict=True):
        state = dict(state)
        reached = state.pop(_Reached.__name__, {})
        for key, value in state.items():
            vars(callback)[key] = _into(vars(callback).get(key), value)
        _take_reached(callback, reached)
        if model is not None:
            callback._model = model
