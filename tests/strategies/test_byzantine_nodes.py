"""Byzantine nodes as strategies: label flipping in the shared step, model attacks on submissions."""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

from consensus import tree as ctree
from strategies import byzantine as byz_lib
from strategies.tasks.base import NodeData
from strategies.tasks.digits import DigitsTask
from strategies.trainer import NodeTrainer

TASK = DigitsTask(hidden=(16,))
N = 5
DATA = TASK.splits(N, seed=4, alpha=1.0)
INIT = TASK.init(jax.random.key(0))
TRAINER = NodeTrainer(TASK, optax.adam, {"learning_rate": 1e-2}, batch_size=16)
MASK = np.array([False, True, False, False, True])


def _node(stacked, i):
    return jax.tree.map(lambda x: np.asarray(x[i], np.float64), stacked)


def _max_diff(a, b):
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in pairs)


@functools.cache
def _clean():
    """Every node honest, 20 steps (shared by the tests below)."""
    state = TRAINER.init(jax.random.key(1), INIT, N)
    return state, TRAINER.fit(state, DATA.own(), 20)[0]


@pytest.mark.slow
def test_label_flipping_nodes_train_in_the_same_step():
    state = TRAINER.init(jax.random.key(1), INIT, N)
    byz = byz_lib.Byzantine(MASK, "label_flip")
    out, submitted, _ = byz_lib.byzantine_fit(TRAINER, state, DATA.own(), 20, byz, jax.random.key(9))
    assert _max_diff(submitted, out.params) == 0.0  # data poisoning only: submissions are the trained params
    # Reference 1: with nobody Byzantine, honest nodes get exactly the same params (nodes are independent).
    clean = _clean()[1]
    # Reference 2: every node honest, but the Byzantine nodes' shards relabelled y -> 9 - y by hand.
    own = DATA.own()
    y = np.asarray(own.pool["y"]).copy()
    y[MASK] = 9 - y[MASK]
    poisoned = NodeData({"x": own.pool["x"], "y": y}, own.index, own.count, shared=False)
    ref, _ = TRAINER.fit(state, poisoned, 20)
    for i in range(N):
        assert _max_diff(_node(out.params, i), _node(ref.params, i)) < 1e-6
        if not MASK[i]:
            assert _max_diff(_node(out.params, i), _node(clean.params, i)) < 1e-6
        else:
            assert _max_diff(_node(out.params, i), _node(clean.params, i)) > 1e-2


@pytest.mark.slow
def test_model_attacks_replace_byzantine_rows():
    trained = _clean()[1]
    anchor = INIT
    honest_rows = np.flatnonzero(~MASK)

    def deltas(stacked):
        return jax.tree.map(
            lambda x, a: np.asarray(x, np.float64) - np.asarray(a, np.float64)[None], stacked, anchor
        )

    d = deltas(trained.params)
    mean_honest = jax.tree.map(lambda x: x[honest_rows].mean(0), d)

    # Sign flip (scale 2): Byzantine rows = anchor - 2 * mean honest delta, float64 reference.
    byz = byz_lib.Byzantine(MASK, "sign_flip", kwargs={"scale": 2.0})
    sub = byz_lib.submit(byz, jax.random.key(0), trained.params, anchor)
    sd = deltas(sub)
    for i in range(N):
        if MASK[i]:
            expect = jax.tree.map(lambda m: -2.0 * m, mean_honest)
            assert _max_diff(jax.tree.map(lambda x, i=i: x[i], sd), expect) < 1e-6
        else:
            assert _max_diff(_node(sub, i), _node(trained.params, i)) == 0.0

    # NaN attack: the Byzantine nodes are exactly the non-finite ones.
    sub = byz_lib.submit(byz_lib.Byzantine(MASK, "nonfinite"), jax.random.key(0), trained.params, anchor)
    np.testing.assert_array_equal(np.asarray(ctree.finite_mask(sub)), ~MASK)

    # Gaussian: keyed, reproducible, different keys differ.
    g = byz_lib.Byzantine(MASK, "gaussian", kwargs={"std": 0.1})
    a1 = byz_lib.submit(g, jax.random.key(3), trained.params, anchor)
    a2 = byz_lib.submit(g, jax.random.key(3), trained.params, anchor)
    a3 = byz_lib.submit(g, jax.random.key(4), trained.params, anchor)
    assert _max_diff(a1, a2) == 0.0 and _max_diff(a1, a3) > 0.0


@pytest.mark.slow
def test_data_and_model_poisoning_together():
    state = TRAINER.init(jax.random.key(1), INIT, N)
    byz = dataclasses.replace(byz_lib.last_nodes(N, 2, "alie"), label_flip=True)
    np.testing.assert_array_equal(byz.mask, [False, False, False, True, True])
    np.testing.assert_array_equal(byz.flip_mask, byz.mask)
    out, sub, _ = byz_lib.byzantine_fit(TRAINER, state, DATA.own(), 4, byz, jax.random.key(0), anchor=INIT)
    # ALIE rows are identical for the two Byzantine nodes and differ from their trained params.
    assert _max_diff(_node(sub, 3), _node(sub, 4)) == 0.0
    assert _max_diff(_node(sub, 3), _node(out.params, 3)) > 0.0
    for i in range(3):
        assert _max_diff(_node(sub, i), _node(out.params, i)) == 0.0


def test_errors():
    with pytest.raises(TypeError, match="bool"):
        byz_lib.Byzantine(np.array([0, 1]), "sign_flip")
    with pytest.raises(ValueError, match="unknown attack"):
        byz_lib.Byzantine(MASK, "explode")
    with pytest.raises(ValueError, match="honest node"):
        byz_lib.Byzantine(np.ones(3, bool), "sign_flip")
    state = TRAINER.init(jax.random.key(1), INIT, N)
    with pytest.raises(ValueError, match="mask has shape"):
        byz_lib.byzantine_fit(TRAINER, state, DATA.own(), 2, byz_lib.honest(3), jax.random.key(0))
    with pytest.raises(TypeError, match="flip_labels"):
        byz_lib.byzantine_fit(
            TRAINER, state, DATA.own(), 2, byz_lib.honest(N), jax.random.key(0), flip_labels=MASK
        )
    with pytest.raises(ValueError, match="num_byzantine"):
        byz_lib.last_nodes(3, 4)
