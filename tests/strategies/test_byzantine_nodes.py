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


@pytest.mark.slow
def test_label_flip_through_the_configuration_is_the_task_flip_bit_for_bit():
    # The declared label_flip, bound as the Byzantine configuration's data attack, trains exactly
    # as the trainer's own flip_labels mask (the task's flip_labels) does.
    state = TRAINER.init(jax.random.key(1), INIT, N)
    byz = byz_lib.Byzantine(MASK, "label_flip")
    assert byz.data_attack is not None and byz.data_attack.name == "label_flip"
    out, _, _ = byz_lib.byzantine_fit(TRAINER, state, DATA.own(), 3, byz, jax.random.key(9))
    ref, _ = TRAINER.fit(state, DATA.own(), 3, flip_labels=MASK)
    assert _max_diff(out.params, ref.params) == 0.0


def zero_labels(task, batch, value: int = 0):
    """Every label set to ``value`` (a plug-in's data attack)."""
    del task
    return {**batch, "y": jax.numpy.full_like(batch["y"], value)}


@pytest.mark.slow
def test_a_declared_data_attack_is_what_the_byzantine_nodes_train_on():
    from consensus.specs import RegistryError
    from strategies.attacks import ATTACKS

    ATTACKS.declare("zero_labels_test", kind="data")(zero_labels)
    try:
        state = TRAINER.init(jax.random.key(1), INIT, N)
        byz = byz_lib.Byzantine(MASK, "zero_labels_test", kwargs={"value": 3})
        assert not byz.is_model_attack
        np.testing.assert_array_equal(byz.poisoned, MASK)
        out, submitted, _ = byz_lib.byzantine_fit(TRAINER, state, DATA.own(), 4, byz, jax.random.key(9))
        assert _max_diff(submitted, out.params) == 0.0  # a data attack never replaces the submission
        # Reference: every node honest, the Byzantine nodes' shards relabelled to 3 by hand.
        own = DATA.own()
        y = np.asarray(own.pool["y"]).copy()
        y[MASK] = 3
        ref, _ = TRAINER.fit(
            state, NodeData({"x": own.pool["x"], "y": y}, own.index, own.count, shared=False), 4
        )
        flipped, _ = TRAINER.fit(state, DATA.own(), 4, flip_labels=MASK)
        for i in range(N):
            assert _max_diff(_node(out.params, i), _node(ref.params, i)) < 1e-6
            if MASK[i]:  # not label flipping in disguise
                assert _max_diff(_node(out.params, i), _node(flipped.params, i)) > 1e-3
        # Bound once per configuration: an equal configuration reuses the compiled step.
        again = byz_lib.Byzantine(MASK, "zero_labels_test", kwargs={"value": 3})
        assert again.data_attack == byz.data_attack and hash(again.data_attack) == hash(byz.data_attack)
        compiled = TRAINER._fit_jit._cache_size()
        byz_lib.byzantine_fit(TRAINER, out, DATA.own(), 4, again, jax.random.key(9))
        assert TRAINER._fit_jit._cache_size() == compiled
        # Options are the declared ones, and must hash (lists become tuples).
        with pytest.raises(RegistryError, match=r"\['scale'\] are not options of the 'zero_labels_test'"):
            byz_lib.Byzantine(MASK, "zero_labels_test", kwargs={"scale": 1.0})
        with pytest.raises(ValueError, match="must be numbers, strings"):
            byz_lib.Byzantine(MASK, "zero_labels_test", kwargs={"value": {"a": 1}})
        assert byz_lib.Byzantine(MASK, "zero_labels_test", kwargs={"value": [1]}).data_attack.options == (
            ("value", (1,)),
        )
    finally:
        ATTACKS.unregister("zero_labels_test")


def test_a_data_attack_that_changes_the_batch_form_is_one_line():
    from strategies.attacks import DataAttack

    state = TRAINER.init(jax.random.key(1), INIT, N)
    bad = DataAttack("drop_y", lambda task, batch: {"x": batch["x"]})
    with pytest.raises(ValueError, match="data attack 'drop_y' must return a batch of the same keys") as e:
        TRAINER.fit(state, DATA.own(), 1, poisoned=MASK, data_attack=bad)
    assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match="not both"):
        TRAINER.fit(state, DATA.own(), 1, flip_labels=MASK, poisoned=MASK, data_attack=bad)


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
