"""The active engine meets the engine contract (`kdist.engines.contract`) in use.

Each engine class declares the contract's Protocol as its base, so mypy (`nox -s
lint`) checks every engine's method signatures against it, installed or not.
"""

import keras
import numpy as np
import pytest
from helpers import prepare

from kdist import engines
from kdist.engines import contract
from kdist.inputs import arrays
from kdist.loop import chunks, training

# In one process: 2 replicas where the engine runs them in-process (tests/test_torch.py
# runs torch's, one process each, through the same contract).
IN_PROCESS = [(1, False)] + ([] if keras.backend.backend() == "torch" else [(2, True)])


@pytest.mark.parametrize("replicas, distributed", IN_PROCESS)
def test_the_active_engine_meets_the_contract_when_used(small_dataset, replicas, distributed):
    engine = engines.create_engine(replicas, distributed=distributed)
    assert isinstance(engine, contract.Engine)
    assert engine.backend == keras.backend.backend() and isinstance(engine.version, str)
    assert engine.num_replicas == engine.num_local_replicas == replicas
    assert len(engine.devices) == replicas
    assert engine.shard == (0, 1) and engine.is_chief
    assert engine.any_worker(True) and not engine.any_worker(False)  # One worker.

    model, step = prepare(engine, 32, optimizer_fn=training.sgd, learning_rate=0.1)
    initial = [np.array(w) for w in model.get_weights()]
    batches = list(arrays.train_batches(*small_dataset.split("train"), 32, seed=0, epoch=0,
                                      steps=2))
    chunk = engine.distribute(chunks.stack_chunk(batches + batches[:1]))  # 3rd: padding.
    for run in (engine.train_chunk, engine.eval_chunk):
        stats = {k: np.asarray(v) for k, v in run(chunk, 2).items()}
        assert sorted(stats) == sorted(step.keys)
        assert all(len(v) >= 2 for v in stats.values())
        np.testing.assert_array_equal(stats["count"][:2], [32, 32])
    assert engine.compiled_train_programs() == 1
    engine.sync_to_model()  # The optimizer steps reach the Keras variables.
    assert any(np.abs(a - b).max() > 0 for a, b in zip(initial, model.get_weights()))


def test_every_contract_method_is_the_engines_own():
    """An engine that lacked a method would inherit the Protocol's empty body, which
    returns None; each must define every method itself."""
    engine_class = type(engines.create_engine(1, distributed=False))
    methods = [name for name, value in vars(contract.Engine).items()
               if callable(value) and not name.startswith("_")]
    assert methods and [name for name in methods if name not in vars(engine_class)] == []
