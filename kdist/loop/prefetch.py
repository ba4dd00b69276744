"""Preparing the next chunk of batches while the current one computes.

`kdist.loop.chunks.run_steps` reads, checks, stacks and places (`engine.distribute`)
a chunk of K batches on a background thread, one chunk ahead of the
compiled call that runs the previous one: reading a pipeline (tf.data, a
PyDataset, a generator), stacking NumPy arrays and copying them to the
devices overlap the device's work. The thread that dispatches the calls
then holds Python's lock only briefly: with the placing on that thread, a
pipeline's Python work on this one delayed each dispatch (on TensorFlow, 4-13%
of the NumPy path's speed; docs/performance.md). The consumer sees the
items in order, and any error of the producer (a bad batch) at the item
where it happened.
"""

import queue
import threading
from typing import Any

_END = object()


class Prefetched:
    """Iterates `iterable` on a background thread, at most `depth` items ahead.

    The producer thread is the only one that touches `iterable`. `close()`
    (also after an error, or when the consumer stops early) lets the producer
    finish the item it is making, then ends it; items made but not taken
    are dropped.
    """

    def __init__(self, iterable, depth=1):
        self._items: queue.Queue[tuple[Any, BaseException | None]] = queue.Queue(depth)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(iterable,),
                                        name="kdist-prefetch", daemon=True)
        self._thread.start()

    def _produce(self, iterable):
        try:
            for item in iterable:
                if not self._put((item, None)):
                    return
            self._put((_END, None))
        except BaseException as error:  # noqa: BLE001 (raised again in the consumer)
            self._put((None, error))

    def _put(self, entry):
        """Queues `entry` unless the consumer closes first; returns whether it did."""
        while not self._closing.is_set():
            try:
                self._items.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        return self

    def __next__(self):
        item, error = self._items.get()
        if error is not None:
            self.close()
            raise error
        if item is _END:
            self.close()
            raise StopIteration
        return item

    def close(self):
        """Stops the producer after the item it is making; waits for it."""
        self._closing.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
