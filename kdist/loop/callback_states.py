"""The state of the callbacks that torch's replica processes ran, brought back
into the caller's own callbacks.

Each replica process runs pickled copies of the callbacks; at the end the
chief process's copies' state (`portable_states`) goes back through the
parent's pipe, and `take_states` puts it into the caller's objects: the
attributes that pickle (not the model, not an open file), and the lists,
dicts, sets, numbers and strings that the callbacks' functions' closures
hold (a `LambdaCallback`'s `lambda epoch, logs: losses.append(...)`). A list,
dict or set is updated in place, so whoever else holds it sees what was
recorded, as after `fit`.
"""

import pickle
from collections.abc import Sequence
from typing import Any

import keras


class _Closure:
    """What a function's closure cells hold that comes back, by cell index
    (`_closure_values`)."""

    def __init__(self, values: dict[int, Any]):
        self.values = values


_PLAIN = (list, dict, set, int, float, str, bool, type(None))


def _pickles(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 (whatever pickling raises: the value stays)
        return False
    return True


def _closure_values(function: Any) -> _Closure | None:
    """The lists, dicts, sets, numbers and strings a function's closure holds
    (a `LambdaCallback`'s `lambda epoch, logs: losses.append(...)`), where any."""
    values = {}
    for index, cell in enumerate(getattr(function, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # An empty cell.
            continue
        if isinstance(value, _PLAIN) and _pickles(value):
            values[index] = value
    return _Closure(values) if values else None


def portable_states(callbacks: Sequence[keras.callbacks.Callback]) -> list[dict[str, Any]]:
    """Each callback's attributes that pickle, but its model (an open file does
    not), and what its functions' closures hold (`_closure_values`)."""
    states = []
    for callback in callbacks:
        state: dict[str, Any] = {}
        for key, value in vars(callback).items():
            if key == "_model":
                continue
            if _pickles(value):
                state[key] = value
            elif (closure := _closure_values(value)) is not None:
                state[key] = closure
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


def take_states(callbacks: Sequence[keras.callbacks.Callback],
                states: list[dict[str, Any]] | None, model: keras.Model | None) -> None:
    """Gives `callbacks` the attributes of `states` (the chief replica process's
    copies') and `model`, the trained model, as `fit` leaves them with its model.
    A list, dict or set, an attribute's or one a function's closure holds, is
    updated in place, so the caller's own objects hold what was recorded. The
    model is set as an attribute: `fit` calls `set_model` once, before
    training, and a callback's own `set_model` may write (Keras' `TensorBoard`
    writes the model's summary there)."""
    for callback, state in zip(callbacks, states or [{}] * len(callbacks), strict=True):
        for key, value in state.items():
            original = vars(callback).get(key)
            if isinstance(value, _Closure):
                cells = getattr(original, "__closure__", None) or ()
                for index, returned in value.values.items():
                    cells[index].cell_contents = _into(cells[index].cell_contents, returned)
            else:
                vars(callback)[key] = _into(original, value)
        if model is not None:
            callback._model = model
