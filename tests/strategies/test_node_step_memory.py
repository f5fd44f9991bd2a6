"""The node step's memory: batch size by compiled memory analysis, donated state, the config's "auto"."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from meta_consensus import config
from meta_consensus.config import ConfigError
from strategies.tasks.digits import DigitsTask
from strategies.trainer import NodeTrainer, auto_batch_size, compiled_bytes

TASK = DigitsTask(hidden=(16,))
DATA = TASK.splits(2, seed=0, alpha=0.5)
INIT = TASK.init(jax.random.key(0))
TRAINER = NodeTrainer(TASK, optax.adam, {"learning_rate": 1e-2}, batch_size=1)


def _bytes(batch: int, state) -> int:
    trainer = dataclasses.replace(TRAINER, batch_size=batch)
    return compiled_bytes(trainer.lower(state, DATA.own(), 1).compile())


def test_auto_batch_size_is_the_largest_power_of_two_that_fits():
    state = TRAINER.abstract_state(jax.random.key(1), INIT, 2)
    concrete = TRAINER.init(jax.random.key(1), INIT, 2)
    # The abstract state is the init's, leaf for leaf.
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(state)] == [
        (x.shape, x.dtype) for x in jax.tree.leaves(concrete)
    ]
    small, large = _bytes(32, state), _bytes(64, state)
    assert 0 < small < large  # the step's memory grows with the batch
    budget = (small + large) // 2
    assert auto_batch_size(TRAINER, state, DATA.own(), memory_bytes=budget, fraction=1.0) == 32
    assert auto_batch_size(TRAINER, state, DATA.own(), memory_bytes=large, fraction=1.0, max_batch=16) == 16
    with pytest.raises(ValueError, match="a batch of 1 needs"):
        auto_batch_size(TRAINER, state, DATA.own(), memory_bytes=1000)
    chosen = TRAINER.with_auto_batch(INIT, DATA.own(), 2, memory_bytes=budget, fraction=1.0)
    assert chosen.batch_size == 32 and chosen.task is TASK


def test_donated_fit_consumes_the_state_and_trains_the_same():
    plain = dataclasses.replace(TRAINER, batch_size=8)
    donating = dataclasses.replace(plain, donate=True)
    ref, ref_log = plain.fit(plain.init(jax.random.key(2), INIT, 2), DATA.own(), 3)
    state = donating.init(jax.random.key(2), INIT, 2)
    out, log = donating.fit(state, DATA.own(), 3)
    assert all(x.is_deleted() for x in jax.tree.leaves(state.params))
    np.testing.assert_array_equal(np.asarray(log.loss), np.asarray(ref_log.loss))
    for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(ref.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The donated step's memory analysis aliases the state's buffers onto the outputs.
    m = donating.lower(donating.abstract_state(jax.random.key(2), INIT, 2), DATA.own(), 1).compile()
    assert m.memory_analysis().alias_size_in_bytes > 0


def test_config_batch_size_auto_and_its_errors():
    cfg = config.load(None, ["nodes.batch_size='auto'"])
    assert cfg.nodes.batch_size == "auto"
    assert config.load(None, ["nodes.batch_size=16"]).nodes.batch_size == 16
    with pytest.raises(ConfigError, match="nodes.batch_size"):
        config.load(None, ["nodes.batch_size='big'"])
    with pytest.raises(ConfigError, match="nodes.batch_size"):
        config.load(None, ["nodes.batch_size=0"])
    with pytest.raises(ConfigError, match=r"nodes\.batch_size.*example"):
        config.load(
            None, ["nodes.batch_size='auto'", "dp.enabled=true", "dp.level='example'", "dp.epsilon=8.0"]
        )
