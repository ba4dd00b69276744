"""Keras callbacks in kdist's loop, called where and as `fit` calls them.

`Hooks` wraps the user's `keras.callbacks.Callback`s in Keras' own
`CallbackList` (which gives each one the model and the run's params) and
adds what data parallelism needs:

- the engine's state and the Keras variables agree around every call:
  the engine writes its state into the model before it (`sync_to_model`)
  and takes back what a callback assigned, a learning rate or weights,
  after it (`sync_from_model`), so a callback reads and sets the model as
  in `fit`. `on_train_batch_begin`/`end` come once per compiled chunk of
  steps, with the epoch's results so far;
- the model's metrics hold, during each call, the state `fit` leaves in
  them there (the epoch's steps so far; after an evaluation, the test
  data's), so `model.get_metrics_result()` reads as the logs do; `model.history`
  is a Keras `History` of the run's epochs, as `fit` sets it;
- `model.stop_training`, set by any worker's callback, is agreed on through
  the engine's collective (`any_worker`) after each chunk and each epoch,
  so every worker stops after the same step;
- on a worker other than the chief, the callbacks that write files
  (`CSVLogger`, `TensorBoard`, `ModelCheckpoint`) are left out: only the
  chief writes; `BackupAndRestore` is refused (`check_callbacks`);
- on a resume in the middle of an epoch, `on_epoch_begin` runs again with
  the learning rates kept as the checkpoint holds them;
- on torch, where each replica is a process that runs copies of the
  callbacks, the chief's copies' state comes back into the caller's
  callbacks at the end (`kdist.loop.callback_states`).
"""

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras

from kdist.engines.contract import Engine
from kdist.errors import UsageError
from kdist.loop.tensorboard import RunToTensorBoard

WRITES_FILES = (keras.callbacks.CSVLogger, keras.callbacks.TensorBoard,
                keras.callbacks.ModelCheckpoint, keras.callbacks.RemoteMonitor,
                RunToTensorBoard)


def check_callbacks(callbacks: Sequence[keras.callbacks.Callback] | None,
                    ) -> list[keras.callbacks.Callback]:
    """`callbacks` as a list (None: none, as `fit` takes it). Raises `UsageError`,
    before any work, for what is not a Keras callback, and for a callback kdist
    cannot run: `BackupAndRestore`, which at `on_train_begin` loads its own
    backup over the checkpoint kdist resumed from (a mid-epoch resume then lost
    the epoch's steps before it, silently)."""
    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.Callback):
        callbacks = [callbacks]
    others = [c for c in callbacks if not isinstance(c, keras.callbacks.Callback)]
    if others:
        raise UsageError(f"callbacks must be keras.callbacks.Callback objects; got "
                         f"{type(others[0]).__name__}: {others[0]!r:.80}")
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            raise UsageError(
                "keras.callbacks.BackupAndRestore loads its own backup over the checkpoint "
                "kdist resumes from; kdist checkpoints and resumes by itself "
                "(checkpoint_dir, checkpoint_every_steps): leave it out")
    return list(callbacks)


class Hooks:
    """The run's callbacks (none: every method does nothing and costs nothing)."""

    def __init__(self, callbacks: Sequence[keras.callbacks.Callback], model: keras.Model,
                 engine: Engine, epochs: int, steps: int | None,
                 metric_state: Callable[[Any], list[tuple[Any, Any]]],
                 history: dict[str, list[Any]]):
        """`metric_state(totals)` gives the metric variables' values after the steps
        that summed `totals` (None: their reset values); `history` holds the epochs
        trained before a resume."""
        kept = [c for c in callbacks if engine.is_chief or not isinstance(c, WRITES_FILES)]
        self.engine, self.model, self.metric_state = engine, model, metric_state
        # The same on every worker, which may hold no callbacks (the chief's alone, a
        # habit of Horovod's): `poll_stop` and, on JAX, `_call`'s assignments are collectives.
        self.active = engine.any_worker(bool(callbacks))
        self._logs = _EpochLogs()  # Last but Keras' History: it sees what the others added.
        self.callbacks = keras.callbacks.CallbackList(
            [*kept, self._logs], add_history=True, model=model, verbose=0, epochs=epochs,
            steps=steps)
        assert self.callbacks._history is not None  # add_history
        self.callbacks._history.history = {k: list(v) for k, v in history.items()}
        self.totals: Any = None  # What the metrics hold in a call (None: their reset state).
        self.stopped = False  # Whether a callback's stop has been agreed on.
        model.stop_training = False
        self._trainable = [id(v) for v in model.trainable_variables] if self.active else []

    def _call(self, method: str, *args: Any, keep: Sequence[Any] = ()) -> None:
        """Calls `method` of every callback on the model as it is; the variables in
        `keep` get back the values they had before."""
        if self.active:
            self.engine.sync_to_model()
            kept = [(v, keras.ops.convert_to_numpy(v.value)) for v in keep]
            metrics = self.metric_state(self.totals) if self.totals is not None else []
            for variable, value in metrics:
                variable.assign(value)
            with contextlib.nullcontext() if self.engine.is_chief else _keras_messages_muted():
                getattr(self.callbacks, method)(*args)
            for variable, value in kept + (self.metric_state(None) if metrics else []):
                variable.assign(value)  # The steps' metrics start from their reset state.
            self.engine.sync_from_model()
            self._check_trainable(method)

    def _check_trainable(self, method: str) -> None:
        """A `UsageError` where a callback changed which weights train: the steps
        train those that trained at the start (`fit` too on TensorFlow; on JAX it
        raises, on torch it trains the others)."""
        if [id(v) for v in self.model.trainable_variables] != self._trainable:
            raise UsageError(
                f"a callback's {method} changed which weights train (a layer's trainable "
                "setting); kdist's steps train the weights that trained at the start, on "
                "every backend: change it between runs, in a model_fn that starts from the "
                "last checkpoint's weights, in another checkpoint folder")

    def train_begin(self) -> None:
        self._call("on_train_begin")

    def train_end(self, logs: dict[str, Any]) -> None:
        self._call("on_train_end", dict(logs))

    def epoch_begin(self, epoch: int, keep: Sequence[Any] = ()) -> None:
        """`epoch` counted from 0, as Keras counts it. The variables in `keep` (the
        program's, on a resume in the middle of the epoch: its checkpoint holds
        what the callbacks set at its beginning, a rate, a weight, an optimizer's
        slots) keep their values."""
        self.totals = None  # `fit` resets the metrics before.
        self._call("on_epoch_begin", epoch, keep=keep)

    def epoch_end(self, epoch: int, logs: dict[str, Any]) -> dict[str, float | str | None]:
        """Returns what the callbacks added to `logs` ("learning_rate", say) or
        changed in them, as in `fit`, where later callbacks and the `History` see
        them: numbers and text (kdist records them in checkpoints and metrics
        files), and None for each key they removed (`History` then has none)."""
        if not self.active:  # No callback: nothing changed.
            return {}
        self._call("on_epoch_end", epoch, logs)
        after = self._logs.logs
        return {**{k: _recorded(k, v) for k, v in after.items()
                   if k not in logs or not _same(v, logs[k])},
                **{k: None for k in logs if k not in after}}

    def test_begin(self) -> None:
        self.totals = None
        self._call("on_test_begin")

    def test_end(self, logs: dict[str, float], totals: Any) -> None:
        """`totals`: the test step's summed statistics (`metric_state`)."""
        self.totals = totals
        self._call("on_test_end", dict(logs))

    def batch_begin(self, step: int) -> None:
        """Before a chunk whose first step is `step` of the epoch (from 0)."""
        self._call("on_train_batch_begin", step)

    def batch_end(self, step: int, logs: dict[str, float], totals: Any) -> None:
        """After a chunk whose last step is `step` of the epoch (from 0); `logs` are the
        epoch's results so far, as in `fit`, from `totals`, the statistics summed."""
        self.totals = totals
        self._call("on_train_batch_end", step, dict(logs))

    @contextlib.contextmanager
    def weights_in_model(self) -> Iterator[None]:
        """While in, the model holds the weights training goes on from: a
        `SwapEMAWeights(swap_on_epoch=True)` holds their moving averages there
        from an epoch's end to the next one's beginning (its `on_epoch_begin`
        swaps them back; a fresh one, after a resume, would not)."""
        swapped = [c for c in self.callbacks.callbacks if isinstance(
            c, keras.callbacks.SwapEMAWeights) and c._ema_weights_in_model]
        self._swap(swapped)
        try:
            yield
        finally:
            self._swap(swapped)

    def _swap(self, callbacks: Sequence[keras.callbacks.SwapEMAWeights]) -> None:
        if callbacks:
            self.engine.sync_to_model()
            for callback in callbacks:
                callback._swap_variables()
            self.engine.sync_from_model()

    def poll_stop(self) -> bool:
        """Whether any worker's callback has set `model.stop_training`; a collective
        on every worker (with callbacks; with none, no communication)."""
        if self.active and not self.stopped:
            self.stopped = self.engine.any_worker(bool(self.model.stop_training))
        return self.stopped


def _same(value: Any, logged: Any) -> bool:
    """Whether a callback left the logged value as it was (a NaN loss too)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return False
    return bool(number == logged or (math.isnan(number) and isinstance(logged, float)
                                     and math.isnan(logged)))


def _recorded(key: str, value: Any) -> float | str:
    """A value a callback put in the epoch's logs, as kdist records it: a number
    (a Python or NumPy one, a tensor of one value) or text."""
    if isinstance(value, str):
        return value
    try:
        return float(keras.ops.convert_to_numpy(value).item())
    except (TypeError, ValueError, AttributeError):
        pass
    shape = getattr(value, "shape", None)
    raise UsageError(
        f"a callback put {key!r} in the epoch's logs, a {type(value).__name__}"
        f"{'' if shape is None else f' of shape {tuple(shape)}'}; kdist records a number "
        "or text per epoch (in the history, the checkpoints and the metrics file)")


class _EpochLogs(keras.callbacks.Callback):
    """Keeps the logs of the last `on_epoch_end`, as the callbacks before it left them."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: dict[str, Any] = {}

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.logs = dict(logs or {})


@contextlib.contextmanager
def _keras_messages_muted() -> Iterator[None]:
    """Keras' callbacks' messages ("Epoch 3: early stopping") go to absl's log,
    not stdout: a process other than the chief prints none, as `fit` prints each once."""
    if not keras.config.is_interactive_logging_enabled():
        yield
        return
    keras.config.disable_interactive_logging()
    try:
        yield
    finally:
        keras.config.enable_interactive_logging()
