"""Hierarchical training: levels run in order, on the right data, per-node schedules."""

import jax
import numpy as np
import optax
import pytest

from strategies import hierarchical as hier
from strategies.tasks.digits import DigitsTask
from strategies.trainer import NodeTrainer, Schedule

TASK = DigitsTask(hidden=(16,))
N = 4
DATA = TASK.splits(N, seed=2, alpha=0.3)
INIT = TASK.init(jax.random.key(0))
B = 8
TRAINER = NodeTrainer(TASK, optax.sgd, {"learning_rate": 0.05}, batch_size=B)
LEVELS = hier.default_levels(steps=(4, 4, 4), learning_rates=(0.1, 0.05, 0.02))


def _max_diff(a, b):
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)


def test_plan_tables():
    p = hier.plan(LEVELS, DATA)
    assert p.steps == 12 and p.labels == ("general", "groups", "own")
    expect = np.array([0] * 4 + [1] * 4 + [2] * 4)
    for i in range(N):
        np.testing.assert_array_equal(p.schedule.level[i], expect)
    assert p.schedule.active.all()
    np.testing.assert_allclose(p.hyperparams["learning_rate"], np.tile([0.1, 0.05, 0.02], (N, 1)))
    # Per-node steps: node 1 skips the groups level, node 2 has a short own level; they idle at the end.
    levels = (
        hier.Level("general", [5, 5, 2, 5], 0.1),
        hier.Level("groups", [4, 0, 4, 4], 0.05),
        hier.Level("own", [3, 3, 1, 3], [0.02, 0.02, 0.03, 0.02]),
    )
    p = hier.plan(levels, DATA)
    assert p.steps == 12
    np.testing.assert_array_equal(p.schedule.active.sum(1), [12, 8, 7, 12])
    np.testing.assert_array_equal(p.schedule.level[1, :8], [0] * 5 + [2] * 3)
    np.testing.assert_array_equal(p.schedule.level[2, :7], [0, 0, 1, 1, 1, 1, 2])
    assert p.hyperparams["learning_rate"][2, 2] == pytest.approx(0.03)
    with pytest.raises(ValueError, match="unknown data selector"):
        hier.Level("everything", 3, 0.1)
    with pytest.raises(ValueError, match="one per node"):
        hier.plan((hier.Level("own", [1, 2], 0.1),), DATA)
    with pytest.raises(ValueError, match="bad"):
        hier.plan(LEVELS, DATA, node_orders=[[(3, 1)]] * N)


@pytest.mark.slow
def test_levels_run_in_order_on_the_right_data():
    state = TRAINER.init(jax.random.key(1), INIT, N)
    orders = [
        [(0, 5), (1, 4), (2, 3)],  # the default recipe
        [(2, 6), (0, 6)],  # own shard first, then general
        [(1, 12)],  # only its classes
        [(0, 3), (2, 3), (0, 3), (2, 3)],  # alternating
    ]
    out, log, p = hier.fit_hierarchical(TRAINER, state, DATA, LEVELS, node_orders=orders, record=True)
    level, rows = np.asarray(log.level), np.asarray(log.rows)
    for i, order in enumerate(orders):
        expect = np.concatenate([np.full(s, j) for j, s in order])
        np.testing.assert_array_equal(level[: len(expect), i], expect)
    np.testing.assert_array_equal(np.asarray(out.step), [12, 12, 12, 12])
    general_labels = DATA.general_groups
    saw_other_classes = False
    for i in range(N):
        for t in range(int(p.schedule.active[i].sum())):
            r = rows[t, i]
            if level[t, i] == 0:  # general: rows of the shared pool, any class
                assert r.max() < len(general_labels)
                saw_other_classes |= not DATA.node_groups[i][general_labels[r]].all()
            elif level[t, i] == 1:  # the node's own classes, from the general pool
                assert DATA.node_groups[i][general_labels[r]].all()
            else:  # its own shard
                assert r.max() < DATA.train_count[i]
    assert saw_other_classes


@pytest.mark.slow
def test_hierarchical_equals_sequential_fits_level_by_level():
    """One multi-level call == one call per level, each pinned to its level, carrying the state over."""
    state = TRAINER.init(jax.random.key(1), INIT, N)
    out, log, p = hier.fit_hierarchical(TRAINER, state, DATA, LEVELS, record=True)
    s = state
    for j, lv in enumerate(LEVELS):
        steps = int(lv.steps)
        pinned = Schedule(np.full((N, steps), j, np.int32), np.ones((N, steps), bool))
        s, seg = TRAINER.fit(s, p.data, steps, schedule=pinned, hyperparams=p.hyperparams, record=True)
        np.testing.assert_array_equal(np.asarray(seg.rows), np.asarray(log.rows)[4 * j : 4 * (j + 1)])
    assert _max_diff(out.params, s.params) < 1e-6
    np.testing.assert_array_equal(jax.random.key_data(out.key), jax.random.key_data(s.key))
    np.testing.assert_array_equal(np.asarray(out.step), np.asarray(s.step))
    # The learning rate changes with the level: an SGD step at level j moves params by lr_j * grad.
    assert p.hyperparams["learning_rate"][0].tolist() == pytest.approx([0.1, 0.05, 0.02])


@pytest.mark.slow
def test_specialised_levels_specialize():
    """After general -> groups -> own, nodes are better on their own classes than on the others."""
    trainer = NodeTrainer(TASK, optax.adam, {"learning_rate": 1e-2}, batch_size=32)
    levels = hier.default_levels(steps=(60, 60, 30), learning_rates=(1e-2, 1e-2, 3e-3))
    state = trainer.init(jax.random.key(3), INIT, N)
    out, log, _ = hier.fit_hierarchical(trainer, state, DATA, levels)
    y = DATA.test["y"]
    for i in range(N):
        params = jax.tree.map(lambda x, i=i: x[i], out.params)
        pred = np.asarray(TASK.apply(params, DATA.test["x"])).argmax(-1)
        own = DATA.node_groups[i][y]
        acc_own, acc_other = (pred[own] == y[own]).mean(), (pred[~own] == y[~own]).mean()
        assert acc_own > 0.8 and acc_own > acc_other
