"""Server-guided rules in the system: the root set, the coordinator's own update, FLTrust in a run."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from meta_consensus import config
from meta_consensus.coordinator import Coordinator
from meta_consensus.server import ServerReference, root_rows, round_needs, split_root
from tests.robust_reference import fltrust as fltrust_reference

TINY = [
    "rounds=2",
    "seed=5",
    "checkpoint_every=0",
    "baseline_fedavg=false",
    "task.options.hidden=[8]",
    "task.alpha=0.3",
    "nodes.count=4",
    "nodes.strategies=local",
    "nodes.local_steps=4",
    "nodes.learning_rate=0.01",
    "byzantine.nodes=[3]",
    "byzantine.attack=sign_flip",
    "byzantine.options={scale = 4.0}",
    "vote.rule=fltrust",
    "vote.root_size=40",
    "vote.server_step=0",  # off unless a test turns it on (the embedded default takes 0.25)
    "weights.objective=vote",
]


def tiny(tmp_path, *overrides: str) -> config.Config:
    return config.load(None, [*TINY, f"output_dir={tmp_path}", "name=fl", *overrides])


def _rows(d: dict[str, np.ndarray]) -> set[bytes]:
    return {np.asarray(x).tobytes() for x in d["x"]}


def test_root_split_is_a_seeded_partition_of_heldout():
    rng = np.random.default_rng(0)
    held = {"x": rng.normal(size=(50, 3)).astype(np.float32), "y": np.arange(50)}
    root, rest = split_root(held, 12, seed=1)
    assert len(root["y"]) == 12 and len(rest["y"]) == 38
    # Disjoint, together every row once, each keeping the held-out order; x and y stay paired.
    assert sorted([*root["y"], *rest["y"]]) == list(range(50))
    assert np.all(np.diff(root["y"]) > 0) and np.all(np.diff(rest["y"]) > 0)
    np.testing.assert_array_equal(root["x"], held["x"][root["y"]])
    again, _ = split_root(held, 12, seed=1)
    other, _ = split_root(held, 12, seed=2)
    np.testing.assert_array_equal(again["y"], root["y"])
    assert set(other["y"]) != set(root["y"])
    with pytest.raises(config.ConfigError, match="vote.root_size = 50"):
        split_root(held, 50, seed=1)


def test_root_size_as_a_share_of_heldout_rounds_to_rows_and_draws_the_same_rows():
    held = {"x": np.zeros((50, 2), np.float32), "y": np.arange(50)}
    # To the nearest row, halves up: 0.25 of 50 = 12.5 -> 13 (Python's round would give 12),
    # 0.24 of 50 = 12 exactly, 0.2599 of 50 = 12.995 -> 13, 0.2498 of 50 = 12.49 -> 12.
    assert [root_rows(s, 50) for s in (0.25, 0.24, 0.2599, 0.2498)] == [13, 12, 13, 12]
    assert root_rows(7, 50) == 7  # an integer is a row count
    share, _ = split_root(held, 0.25, seed=1)
    count, _ = split_root(held, 13, seed=1)
    np.testing.assert_array_equal(share["y"], count["y"])  # a share is the same draw as its row count
    too_many = r"vote.root_size = 0.999 \(a share of 50 held-out rows: 50 rows\)"
    with pytest.raises(config.ConfigError, match=too_many):
        split_root(held, 0.999, seed=1)
    with pytest.raises(config.ConfigError, match="vote.root_size = 0.005"):
        split_root(held, 0.005, seed=1)  # rounds to 0 rows


def test_config_accepts_server_rules_and_checks_their_options(tmp_path):
    cfg = tiny(tmp_path)
    assert round_needs(cfg) == {"server_update"}
    assert round_needs(tiny(tmp_path, "vote.rule=dnc", "vote.num_byzantine=1")) == {"key"}
    with pytest.raises(config.ConfigError, match="vote.root_size"):
        tiny(tmp_path, "vote.root_size=0")
    for bad in ("1.0", "1.5", "-0.2", "0.0"):  # a share must lie in (0, 1); 1.0 is not the integer 1
        with pytest.raises(config.ConfigError, match="vote.root_size"):
            tiny(tmp_path, f"vote.root_size={bad}")
    assert tiny(tmp_path, "vote.root_size=0.5").vote.root_size == 0.5
    assert tiny(tmp_path, "vote.root_size=30").vote.root_size == 30
    with pytest.raises(config.ConfigError, match="vote.server_steps"):
        tiny(tmp_path, "vote.server_steps=0")


@pytest.mark.slow  # a coordinator, two rounds and a refit: over a minute on the shared 2-core machine
def test_fltrust_run_root_set_disjoint_from_node_data_and_the_rule_applied(tmp_path):
    # The sign-flipping node sends -4 times the honest nodes' mean update, so its trust is
    # ReLU(-cos(honest mean, g)): zero exactly when the honest mean agrees with the server's
    # root-set update. At alpha = 0.3 that is luck: at this seed node 0's shard points away from
    # the server's (cos -0.28 in both rounds) and the mean's cosine in round 2 is -0.033 (0.062
    # with task.public_fraction = 0). At alpha = 1 it is 0.71 and 0.42.
    cfg = tiny(tmp_path, "task.alpha=1.0")
    co = Coordinator(cfg)
    data = co.fleet.data
    # The full held-out split of a coordinator whose rule needs no server update.
    full = co.fleet.task.splits(cfg.nodes.count, seed=cfg.task.data_seed, alpha=cfg.task.alpha).heldout
    root, rest = split_root(full, 40, cfg.seed)
    # The held-out split the gate, weights and evaluation see is the rest; the root set is the server's.
    np.testing.assert_array_equal(data.heldout["x"], rest["x"])
    np.testing.assert_array_equal(co.server.data.pool["x"], root["x"])
    node_rows = set()
    for i, c in enumerate(np.asarray(data.train_count)):
        node_rows |= _rows({"x": np.asarray(data.train["x"])[i, :c]})
    node_rows |= _rows(data.general)
    assert not _rows(root) & node_rows
    assert not _rows(root) & _rows(data.heldout)

    state = co.init()
    for _ in range(cfg.rounds):
        prev = state.consensus
        key = co.round_key(state, 0)
        new, info = co.round(state)
        assert info.ok, info.reason
        # Recompute the round's FLTrust from its parts: the nodes' candidates (the same fit keys
        # give the same fit) and the server's update, against the float64 reference.
        g = co.server.update(prev, key)
        out = co.fleet.fit(state.nodes, prev, jax.random.split(key)[0])
        flat = lambda t: np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in jax.tree.leaves(t)])  # noqa: E731
        X = np.stack([flat(jax.tree.map(lambda a, i=i: a[i], out.submitted)) for i in range(cfg.nodes.count)])
        want = fltrust_reference(X, flat(prev), flat(g), np.ones(cfg.nodes.count, bool))
        np.testing.assert_allclose(flat(new.consensus), want, rtol=1e-4, atol=1e-5)
        d = X - flat(prev)
        honest = d[:3].mean(axis=0)
        np.testing.assert_allclose(d[3], -4.0 * honest, rtol=1e-4, atol=1e-6)  # the attack
        cos = float(honest @ flat(g)) / (np.linalg.norm(honest) * np.linalg.norm(flat(g)))
        assert cos > 0.1, cos  # the premise: the honest nodes agree with the server on the whole
        # Hence the sign-flipping node's cosine is -cos < 0: FLTrust gives it no trust at all.
        assert info.weights[3] == 0.0 and max(info.weights[:3]) > 0
        state = new
    assert np.isfinite(info.consensus_accuracy)


@pytest.mark.slow  # builds a coordinator and compiles the server trainer (a minute when shared)
def test_server_update_is_the_trainers_on_the_root_set_only(tmp_path):
    cfg = tiny(tmp_path)
    co = Coordinator(cfg)
    params = co.init().consensus
    key = jax.random.key(9)
    g1 = co.server.update(params, key)
    np.testing.assert_array_equal(
        np.asarray(jax.tree.leaves(g1)[0]), np.asarray(jax.tree.leaves(co.server.update(params, key))[0])
    )
    # A root set of other rows gives another update (it is trained on those rows, not the nodes').
    other = ServerReference(co.fleet.task, {k: v[:40] for k, v in co.fleet.data.heldout.items()}, cfg)
    g2 = other.update(params, key)
    assert not np.allclose(np.asarray(jax.tree.leaves(g1)[0]), np.asarray(jax.tree.leaves(g2)[0]))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(g1))


def test_server_step_config_and_needs(tmp_path):
    median = ["vote.rule=median", "vote.num_byzantine=1"]
    assert round_needs(tiny(tmp_path, *median)) == frozenset()
    assert round_needs(tiny(tmp_path, *median, "vote.server_step=0.5")) == {"server_update"}
    for bad in ("-0.5", "nan", "inf", "true"):
        with pytest.raises(config.ConfigError, match="vote.server_step"):
            tiny(tmp_path, *median, f"vote.server_step={bad}")


@pytest.mark.slow  # a coordinator, two rounds and a refit of each
def test_server_step_adds_the_servers_update_to_the_votes_merge(tmp_path):
    """vote.server_step with a rule that needs no server: consensus = median(nodes) + step * g,
    g the coordinator's update on its root set from the round's starting consensus."""
    cfg = tiny(tmp_path, "vote.rule=median", "vote.num_byzantine=1", "vote.server_step=0.5")
    co = Coordinator(cfg)
    assert co.server is not None and co.server.root_size == 40
    state = co.init()
    flat = lambda t: np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in jax.tree.leaves(t)])  # noqa: E731
    for _ in range(cfg.rounds):
        prev = state.consensus
        key = co.round_key(state, 0)
        new, info = co.round(state)
        assert info.ok, info.reason
        g = flat(co.server.update(prev, key))
        out = co.fleet.fit(state.nodes, prev, jax.random.split(key)[0])
        X = np.stack([flat(jax.tree.map(lambda a, i=i: a[i], out.submitted)) for i in range(cfg.nodes.count)])
        assert np.linalg.norm(g) > 1e-3  # the step is not vacuous
        np.testing.assert_allclose(flat(new.consensus), np.median(X, axis=0) + 0.5 * g, rtol=1e-5, atol=1e-6)
        state = new
