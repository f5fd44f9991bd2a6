"""The public pool and the nodes' own held-out splits, checked by row index.

Every built-in classification task reserves a stratified public split of its training rows; the
hierarchical levels "general" and "groups" draw from it only, so no node trains on another node's
rows unless ``general_pool = "union"`` is set. A soup node holds out rows of its own shard that no
level of its training draws.
"""

import numpy as np
import pytest

from meta_consensus import config
from meta_consensus.config import ConfigError
from meta_consensus.fleet import Fleet
from strategies.tasks import base
from strategies.tasks.custom import task_from_arrays

STRATEGIES = "nodes.strategies=['hierarchical', 'soup', 'convexity', 'local', 'hierarchical', 'soup']"
SMALL = ["task.options.hidden=[8]", "nodes.count=6", "byzantine.nodes=[]", "task.alpha=0.3", STRATEGIES]


def _fleet(*extra: str) -> Fleet:
    return Fleet(config.load(None, [*SMALL, *extra]))


def _levels(fleet: Fleet):
    """The NodeData of every level the fleet's nodes train on, with each node's used levels."""
    p = fleet._plan
    level, active = np.asarray(p.schedule.level), np.asarray(p.schedule.active)
    used = [set(level[i, active[i]].tolist()) for i in range(fleet.n)]
    return p.data, used


def test_no_node_trains_on_another_nodes_rows_by_row_index():
    fleet = _fleet()
    cfg = fleet.cfg
    # The reference shards: the task's split before any row is held out, read independently.
    fresh = fleet.task.splits(fleet.n, seed=cfg.task.data_seed, alpha=cfg.task.alpha)
    ids = fresh.meta["example_ids"]
    shards = [set(ids[i, : fresh.train_count[i]].tolist()) for i in range(fleet.n)]
    public = set(fresh.meta["public_ids"].tolist())
    assert public and all(not (s & public) for s in shards)
    assert all(not (shards[i] & shards[j]) for i in range(fleet.n) for j in range(i))
    # Soup nodes (1 and 5) hold out rows of their own shard; nobody else does.
    held = fleet.data.meta["own_heldout_ids"]
    held_rows = [set(held[i, : fleet.data.own_heldout_count[i]].tolist()) for i in range(fleet.n)]
    assert [len(h) > 0 for h in held_rows] == [False, True, False, False, False, True]
    data, used = _levels(fleet)
    assert [d.name for d in data] == ["general", "groups", "own"]
    assert used[0] == {0, 1, 2} and used[3] == {2}
    for j, d in enumerate(data):
        drawn = fleet.data.drawn_ids(d)
        for i in range(fleet.n):
            rows = set(drawn[i].tolist())
            assert rows, (j, i)
            others = set().union(*(shards[k] for k in range(fleet.n) if k != i))
            assert not rows & others, f"node {i} level {d.name} draws other nodes' rows"
            assert rows <= public | shards[i], (
                f"node {i} level {d.name} draws rows outside public and its shard"
            )
            assert not rows & held_rows[i], f"node {i} trains on its own held-out rows"
            if d.name in ("general", "groups"):
                assert rows <= public
            else:
                assert rows == shards[i] - held_rows[i]  # every other row of its shard
    # The node split itself does not change with the public pool's setting (only the general pool).
    union = _fleet("task.general_pool=union")
    np.testing.assert_array_equal(union.data.meta["example_ids"], fleet.data.meta["example_ids"])
    data, _ = _levels(union)
    general = set(union.data.drawn_ids(data[0])[0].tolist())
    # With the union pool the general level draws every node's shard: the check above would fail.
    assert general == public | set().union(*shards)


def test_public_fraction_and_an_empty_pool():
    fleet = _fleet("task.public_fraction=0.25", "nodes.strategies=local")
    pub = fleet.data.meta["public_ids"]
    train = len(pub) + int(fleet.data.train_count.sum())
    assert abs(len(pub) - 0.25 * train) <= 10  # per class round(0.25 * rows), 10 classes
    assert fleet._plan is None  # local nodes never draw the public pool
    with pytest.raises(ConfigError, match=r"\['hierarchical'\].*public pool.*empty"):
        _fleet(
            "task.public_fraction=0.0",
            "nodes.strategies=['hierarchical', 'local', 'local', 'local', 'local', 'local']",
        )
    with pytest.raises(ConfigError, match="task.public_fraction"):
        config.load(None, ["task.public_fraction=1.0"])
    with pytest.raises(ConfigError, match="task.general_pool"):
        config.load(None, ["task.general_pool=everything"])


def test_public_split_is_stratified_and_disjoint():
    rng = np.random.default_rng(0)
    groups = rng.integers(0, 4, 500)
    rows = np.sort(rng.choice(500, 300, replace=False))
    pub, priv = base.public_split(groups, rows, 0.2, seed=3)
    np.testing.assert_array_equal(np.sort(np.concatenate([pub, priv])), rows)
    assert np.intersect1d(pub, priv).size == 0
    for c in range(4):
        assert np.sum(groups[pub] == c) == round(0.2 * np.sum(groups[rows] == c))
    again, _ = base.public_split(groups, rows, 0.2, seed=3)
    np.testing.assert_array_equal(pub, again)
    none, everything = base.public_split(groups, rows, 0.0, seed=3)
    assert none.size == 0 and np.array_equal(everything, rows)


def test_hold_out_own_moves_rows_out_of_training():
    data = _fleet("nodes.strategies=local").data
    out = data.hold_out_own([0.0, 0.2, 0.5, 0.0, 0.9, 0.1], seed=4)
    ids, held = data.meta["example_ids"], out.meta["own_heldout_ids"]
    for i in range(data.num_local):
        c = int(data.train_count[i])
        before = set(ids[i, :c].tolist())
        kept = set(out.meta["example_ids"][i, : out.train_count[i]].tolist())
        h = set(held[i, : out.own_heldout_count[i]].tolist())
        assert kept | h == before and not kept & h
        f = [0.0, 0.2, 0.5, 0.0, 0.9, 0.1][i]
        assert len(h) == (0 if f == 0 else min(c - 1, max(1, round(f * c))))
        # The arrays follow the ids: the held-out rows are the shard's own pixels and labels.
        rows = {int(e): k for k, e in enumerate(ids[i, :c])}
        batch = out.own_heldout_batch(i)
        if h:
            for k, e in enumerate(held[i, : out.own_heldout_count[i]]):
                np.testing.assert_array_equal(batch["x"][k], data.train["x"][i, rows[int(e)]])
        else:
            assert batch is None
        np.testing.assert_array_equal(
            out.train["y"][i, : out.train_count[i]],
            [data.train["y"][i, rows[int(e)]] for e in out.meta["example_ids"][i, : out.train_count[i]]],
        )
    with pytest.raises(ValueError, match="fractions"):
        data.hold_out_own(1.0, seed=0)


def test_task_from_arrays_takes_public_data():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(300, 5)).astype(np.float32), rng.integers(0, 3, 300)
    px, py = rng.normal(size=(40, 5)).astype(np.float32), rng.integers(0, 3, 40)
    model = (lambda key: {"w": np.zeros((5, 3), np.float32)}, lambda p, v: v @ p["w"])
    task = task_from_arrays(model, x, y, public=(px, py))
    d = task.splits(3, seed=0, alpha=1.0)
    np.testing.assert_array_equal(d.general["x"], px)
    np.testing.assert_array_equal(d.general["y"], py)
    shard_ids = d.meta["example_ids"][d.meta["example_ids"] >= 0]
    assert np.intersect1d(shard_ids, d.meta["general_ids"]).size == 0
    # A share of the training split instead; 0 gives no public pool.
    d2 = task_from_arrays(model, x, y, public=0.2).splits(3, seed=0, alpha=1.0)
    assert abs(len(d2.general_groups) - 0.2 * 210) <= 3
    d3 = task_from_arrays(model, x, y, public=0.0).splits(3, seed=0, alpha=1.0)
    assert len(d3.general_groups) == 0 and int(d3.train_count.sum()) == 210
    union = task_from_arrays(model, x, y, general_pool="union").splits(3, seed=0, alpha=1.0)
    assert len(union.general_groups) == 210 and union.general_pool == "union"
    with pytest.raises(Exception, match="public"):
        task_from_arrays(model, x, y, public=1.5)


def test_with_public_pool_refuses_a_task_that_sets_its_own():
    class OwnPool:
        name = "own"

    with pytest.raises(ValueError, match="public_fraction"):
        base.with_public_pool(OwnPool(), 0.2)
    assert base.with_public_pool(OwnPool()) is not None  # nothing asked, nothing changed
