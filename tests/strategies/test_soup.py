"""Tests for strategies.soup: uniform / weighted / greedy soups, in memory and from orbax checkpoints.

References are independent: float64 numpy means, a brute-force float64 replay of the greedy rule,
and a real case (softmax regression fine-tunes on sklearn digits).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.datasets import load_digits

from consensus import tree as ctree
from strategies import soup as sp

# ----------------------------------------------------------------------------- helpers


def _ingredient(rng: np.random.Generator, center: np.ndarray, scale: float) -> dict:
    v = center + rng.normal(size=center.shape) * scale
    # Leaves flatten in sorted-key order (b.c, then w), so _flat and _vec read v back in order.
    return {"w": jnp.asarray(v[4:].reshape(5, 3), jnp.float32), "b": {"c": jnp.asarray(v[:4], jnp.float32)}}


def _vec(p) -> jax.Array:
    return jnp.concatenate([p["b"]["c"], p["w"].ravel()])


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(tree)])


def _np_score(vec: np.ndarray, target: np.ndarray) -> float:
    return -float(np.sum((vec - target) ** 2))


def _replay_greedy(vecs: list[np.ndarray], scores: list[float], order: list[int], evaluate, higher: bool):
    """Brute-force greedy rule in float64: kept indices, trajectory, rejected candidates' scores."""
    better_eq = (lambda a, b: a >= b) if higher else (lambda a, b: a <= b)
    kept, traj, rejected = [order[0]], [scores[order[0]]], {}
    for i in order[1:]:
        cand = evaluate(np.mean([vecs[j] for j in [*kept, i]], axis=0))
        if better_eq(cand, traj[-1]):
            kept.append(i)
            traj.append(cand)
        else:
            rejected[i] = (cand, traj[-1])
            traj.append(traj[-1])
    return kept, traj, rejected


# ----------------------------------------------------------------------------- uniform / weighted


@pytest.mark.slow
def test_uniform_soup_is_the_float64_mean_with_constant_memory():
    rng = np.random.default_rng(0)
    center = rng.normal(size=19)
    ings = [_ingredient(rng, center, 0.1) for _ in range(7)]
    soup = sp.IncrementalSoup("uniform")
    state = soup.init()
    states = []
    for x in ings:
        state = soup.add(state, x)
        states.append(state)
        # O(1) memory: the state holds one tree of arrays, never the ingredients.
        assert sum(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(state)) == 2
    ref = np.mean([_flat(x) for x in ings], axis=0)
    np.testing.assert_allclose(_flat(state.params), ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(_flat(sp.uniform_soup(ings)), ref, rtol=1e-6, atol=1e-7)
    # Every intermediate state is the mean of the prefix, and states are not mutated by later adds.
    for k, st in enumerate(states, start=1):
        np.testing.assert_allclose(_flat(st.params), np.mean([_flat(x) for x in ings[:k]], axis=0), rtol=1e-6)
        assert st.count == k and st.kept == tuple(range(k)) and st.rejected == ()
    assert jax.tree.map(lambda x: x.dtype, state.params) == jax.tree.map(lambda x: x.dtype, ings[0])


def test_weighted_soup_with_given_and_score_weights():
    rng = np.random.default_rng(1)
    center = rng.normal(size=19)
    ings = [_ingredient(rng, center, 0.3) for _ in range(5)]
    vecs = [_flat(x) for x in ings]
    w = [0.5, 2.0, 0.0, 1.5, 3.0]
    soup = sp.IncrementalSoup("weighted")
    state = soup.init()
    for x, wi in zip(ings, w, strict=True):
        state = soup.add(state, x, weight=wi)
    ref = np.average(vecs, axis=0, weights=w)
    np.testing.assert_allclose(_flat(state.params), ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(_flat(sp.weighted_soup(ings, w)), ref, rtol=1e-6, atol=1e-7)
    assert state.rejected == (2,) and state.events[2].reason == "zero weight"
    np.testing.assert_allclose([e.weight for e in state.events], [0.5, 2.0, 0.0, 1.5, 3.0], rtol=1e-12)

    # Score-based: softmax of -loss / T, with huge scores that would overflow a naive exp.
    for offset in (0.0, 1e4):
        losses = [0.3 + offset, 0.1 + offset, 0.7 + offset, 0.2 + offset, 0.4 + offset]
        soup = sp.IncrementalSoup("weighted", weight_by="score", metric="loss", temperature=0.25)
        state = soup.init()
        for x, s in zip(ings, losses, strict=True):
            state = soup.add(state, x, score=s)
        z = -(np.array(losses) - offset) / 0.25
        ref_w = np.exp(z) / np.exp(z).sum()
        np.testing.assert_allclose(
            _flat(state.params), np.sum(ref_w[:, None] * np.array(vecs), axis=0), rtol=1e-5
        )
        np.testing.assert_allclose(sp.score_weights(losses, higher_is_better=False, temperature=0.25), ref_w)

    # With evaluate, scores come from it and the trajectory records the soup's score after every add.
    target = center + 0.05
    evaluate = jax.jit(lambda p: -jnp.sum((_vec(p) - target) ** 2))
    soup = sp.IncrementalSoup("weighted", weight_by="score", evaluate=evaluate, higher_is_better=True)
    state = soup.init()
    for x in ings:
        state = soup.add(state, x)
    scores = np.array([_np_score(v, target) for v in vecs])
    ref_w = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
    np.testing.assert_allclose(
        _flat(state.params), np.sum(ref_w[:, None] * np.array(vecs), axis=0), rtol=1e-5
    )
    np.testing.assert_allclose(state.trajectory[-1], _np_score(_flat(state.params), target), rtol=1e-5)


# ----------------------------------------------------------------------------- greedy


def _greedy_fixture(seed: int):
    rng = np.random.default_rng(seed)
    target = rng.normal(size=19)
    # Good ingredients near the target, mediocre ones, and outliers that must be rejected.
    scales = [0.2, 0.3, 0.25, 0.6, 0.9, 3.0, 4.0, 0.35]
    ings = [_ingredient(rng, target + 0.1, s) for s in scales]
    tj = jnp.asarray(target, jnp.float32)

    @jax.jit
    def metrics(p):
        flat = _vec(p)
        return {"loss": jnp.sum((flat - tj) ** 2), "neg": -jnp.sum((flat - tj) ** 2)}

    return ings, target, metrics


@pytest.mark.parametrize("metric", ["loss", "neg"])
def test_greedy_soup_matches_brute_force_and_never_adds_a_hurting_ingredient(metric):
    ings, target, metrics = _greedy_fixture(2)
    higher = metric == "neg"
    kw = {"metric": metric} if metric == "loss" else {"metric": metric, "higher_is_better": True}
    state = sp.greedy_soup(ings, metrics, **kw)

    vecs = [_flat(x) for x in ings]
    sign = 1.0 if higher else -1.0

    def np_eval(v):
        return _np_score(v, target) if higher else -_np_score(v, target)

    scores = [np_eval(v) for v in vecs]
    order = sorted(range(len(ings)), key=lambda i: -sign * scores[i])
    kept, traj, rejected = _replay_greedy(vecs, scores, order, np_eval, higher)
    assert sorted(state.kept) == sorted(kept)
    assert len(kept) >= 2 and len(rejected) >= 2  # the fixture exercises both decisions
    assert [e.index for e in state.events] == order
    np.testing.assert_allclose(state.trajectory, traj, rtol=1e-4)
    np.testing.assert_allclose(
        _flat(state.params), np.mean([vecs[i] for i in kept], axis=0), rtol=1e-5, atol=1e-6
    )
    # Monotone trajectory, never worse than the best single ingredient.
    t = sign * np.array(state.trajectory)
    assert np.all(np.diff(t) >= 0)
    assert sign * state.score >= max(sign * s for s in scores) - 1e-6
    # Every rejected ingredient would have made the soup strictly worse (recomputed in float64).
    for i in state.rejected:
        cand, before = rejected[i]
        assert sign * cand < sign * before
        ev = state.events[[e.index for e in state.events].index(i)]
        assert ev.reason == "worse" and sign * ev.candidate_score < sign * ev.soup_score


def test_incremental_greedy_plain_and_with_restart():
    ings, target, metrics = _greedy_fixture(3)
    vecs = [_flat(x) for x in ings]
    # Arrival order puts an outlier first and the good ingredients late.
    arrival = [5, 4, 0, 3, 1, 6, 2, 7]

    def np_loss(v):
        return -_np_score(v, target)

    plain = sp.IncrementalSoup("greedy", evaluate=metrics, metric="loss", restart=False)
    state = plain.init()
    for i in arrival:
        state = plain.add(state, ings[i], name=f"ing{i}")
    kept, traj, _ = _replay_greedy(vecs, [np_loss(v) for v in vecs], arrival, np_loss, higher=False)
    assert [arrival[k] for k in state.kept] == kept
    np.testing.assert_allclose(state.trajectory, traj, rtol=1e-4)
    assert np.all(np.diff(state.trajectory) <= 0)
    assert [e.name for e in state.events] == [f"ing{i}" for i in arrival]

    restart = sp.IncrementalSoup("greedy", evaluate=metrics, metric="loss", restart=True)
    state = restart.init()
    best_seen = math.inf
    for k, i in enumerate(arrival):
        state = restart.add(state, ings[i])
        best_seen = min(best_seen, np_loss(vecs[i]))
        # The soup is never worse than any ingredient seen so far, and its params are the mean of `kept`.
        assert state.score <= best_seen * (1 + 1e-5)
        np.testing.assert_allclose(
            _flat(state.params), np.mean([vecs[arrival[j]] for j in state.kept], axis=0), rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(state.score, np_loss(_flat(state.params)), rtol=1e-4)
        assert k == 0 or state.score <= state.events[-2].soup_score
    assert any(e.reason == "restart" for e in state.events)
    assert state.score < traj[-1]  # restarting beats the plain rule that got stuck with the outlier


def test_greedy_keeps_ties_and_rejects_non_finite():
    ings, _, metrics = _greedy_fixture(4)
    soup = sp.IncrementalSoup("greedy", evaluate=metrics, metric="loss", restart=False)
    state = soup.add(soup.init(), ings[0])
    state = soup.add(state, ings[0])  # same params: same metric, kept (Wortsman's >=)
    assert state.kept == (0, 1) and state.events[1].reason == "not worse"
    bad = jax.tree.map(lambda x: x.at[0].set(jnp.nan), ings[1])
    for mode in ("greedy", "uniform"):
        s = sp.IncrementalSoup(mode, evaluate=metrics, metric="loss")
        st = s.add(s.add(s.init(), ings[0]), bad)
        assert st.rejected == (1,) and st.events[1].reason == "non-finite"
        np.testing.assert_array_equal(_flat(st.params), _flat(ings[0]))


# ----------------------------------------------------------------------------- orbax


@pytest.mark.slow
def test_orbax_ingredients_give_the_same_soups(tmp_path):
    ings, _, metrics = _greedy_fixture(5)
    paths = [sp.save_ingredient(tmp_path / f"ing{i}", x) for i, x in enumerate(ings)]
    loaded = sp.load_ingredient(paths[3], ings[0])
    np.testing.assert_array_equal(_flat(loaded), _flat(ings[3]))

    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), ings[0])
    for mode in ("uniform", "greedy"):
        soup = sp.IncrementalSoup(mode, evaluate=metrics, metric="loss", template=template)
        mem, disk = soup.init(), soup.init()
        for x, p in zip(ings, paths, strict=True):
            mem, disk = soup.add(mem, x), soup.add(disk, str(p))
        np.testing.assert_array_equal(_flat(disk.params), _flat(mem.params))
        assert disk.kept == mem.kept and disk.events[0].name == str(paths[0])
    from_disk = sp.greedy_soup([str(p) for p in paths], metrics, metric="loss", template=ings[0])
    in_mem = sp.greedy_soup(ings, metrics, metric="loss")
    assert from_disk.kept == in_mem.kept
    np.testing.assert_array_equal(_flat(from_disk.params), _flat(in_mem.params))

    with pytest.raises(ValueError, match="template"):
        sp.IncrementalSoup("uniform").add(sp.IncrementalSoup("uniform").init(), str(paths[0]))
    with pytest.raises(FileNotFoundError):
        sp.load_ingredient(tmp_path / "missing", ings[0])
    with pytest.raises(FileExistsError):
        sp.save_ingredient(paths[0], ings[0])
    with pytest.raises(ValueError, match="could not restore"):
        sp.load_ingredient(paths[0], {"other": jnp.zeros((2,), jnp.float32)})


# ----------------------------------------------------------------------------- a real case


@functools.cache
def _digits_splits():
    X, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(0).permutation(len(y))
    X, y = (X[perm] / 16.0).astype(np.float32), y[perm].astype(np.int32)
    return (X[:1000], y[:1000]), (X[1000:1400], y[1000:1400])


def _logits(p, x):
    return x @ p["w"] + p["b"]


@pytest.mark.slow
def test_greedy_soup_of_digits_finetunes_beats_every_ingredient_on_the_selection_set():
    (Xtr, ytr), (Xsel, ysel) = _digits_splits()
    rng = np.random.default_rng(6)
    init = {
        "w": jnp.asarray(rng.normal(size=(64, 10)) * 0.01, jnp.float32),
        "b": jnp.zeros((10,), jnp.float32),
    }
    X, Y = jnp.asarray(Xtr), jnp.asarray(ytr)

    def train(p0, lr, weights, steps):
        def loss(p):
            logp = jax.nn.log_softmax(_logits(p, X))
            nll = -jnp.take_along_axis(logp, Y[:, None], axis=1)[:, 0]
            return jnp.sum(weights * nll) / jnp.sum(weights)

        def step(p, _):
            return jax.tree.map(lambda a, g: a - lr * g, p, jax.grad(loss)(p)), None

        return jax.lax.scan(step, p0, None, length=steps)[0]

    # One pre-trained model, then seven fine-tunes of it: different learning rates and class-skewed data.
    lrs = jnp.asarray([0.3, 0.5, 1.0, 1.0, 2.0, 3.0, 8.0], jnp.float32)
    favoured = rng.choice(10, size=(7, 3))
    sw = np.where((ytr[None, None, :] == favoured[:, :, None]).any(axis=1), 1.0, 0.1).astype(np.float32)

    @jax.jit
    def pretrain_and_finetune(lrs, sw):
        base = train(init, jnp.float32(1.0), jnp.ones(ytr.shape, jnp.float32), 60)
        return jax.vmap(lambda lr, w: train(base, lr, w, 30))(lrs, sw)

    stacked = pretrain_and_finetune(lrs, jnp.asarray(sw))
    ings = ctree.unstack(stacked)
    xs, ys = jnp.asarray(Xsel), jnp.asarray(ysel)

    @jax.jit
    def metrics(p):
        logits = _logits(p, xs)
        nll = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ys[:, None], axis=1))
        return {"accuracy": jnp.mean((jnp.argmax(logits, axis=1) == ys).astype(jnp.float32)), "loss": nll}

    for metric in ("accuracy", "loss"):
        state = sp.greedy_soup(ings, metrics, metric=metric)
        sign = 1.0 if metric == "accuracy" else -1.0
        singles = [float(metrics(x)[metric]) for x in ings]
        assert sign * state.score >= max(sign * s for s in singles)
        assert np.all(np.diff(sign * np.array(state.trajectory)) >= 0)
        # Brute force: the soup is the mean of the kept ingredients, and each rejected one would have hurt.
        kept_so_far: list[int] = []
        for e in state.events:
            if e.accepted:
                kept_so_far.append(e.index)
                continue
            cand = np.mean([_flat(ings[j]) for j in [*kept_so_far, e.index]], axis=0)
            # Leaf order in _flat is sorted keys: b then w.
            cand_tree = {
                "b": jnp.asarray(cand[:10], jnp.float32),
                "w": jnp.asarray(cand[10:].reshape(64, 10)),
            }
            assert sign * float(metrics(cand_tree)[metric]) < sign * e.soup_score
        np.testing.assert_allclose(
            _flat(state.params), np.mean([_flat(ings[j]) for j in state.kept], axis=0), rtol=1e-5, atol=1e-6
        )
        # The fixture exercises both decisions, and averaging fine-tunes of one model helps here.
        assert len(state.kept) >= 2 and len(state.rejected) >= 1
        assert sign * state.score > max(sign * s for s in singles)


# ----------------------------------------------------------------------------- errors


def test_bad_inputs_get_clear_errors():
    ings, _, metrics = _greedy_fixture(7)
    with pytest.raises(ValueError, match="evaluate"):
        sp.IncrementalSoup("greedy")
    with pytest.raises(ValueError, match="unknown metric"):
        sp.IncrementalSoup("greedy", evaluate=metrics, metric="bleu")
    with pytest.raises(ValueError, match="mode"):
        sp.IncrementalSoup("median")
    with pytest.raises(ValueError, match="metric="):
        sp.greedy_soup(ings, metrics, higher_is_better=False)  # dict output, no metric name
    uni = sp.IncrementalSoup("uniform")
    with pytest.raises(ValueError, match="weight="):
        uni.add(uni.init(), ings[0], weight=2.0)
    wtd = sp.IncrementalSoup("weighted")
    with pytest.raises(ValueError, match="needs weight"):
        wtd.add(wtd.init(), ings[0])
    with pytest.raises(ValueError, match=">= 0"):
        wtd.add(wtd.init(), ings[0], weight=-1.0)
    with pytest.raises(ctree.TreeMismatchError, match="does not match"):
        uni.add(uni.add(uni.init(), ings[0]), {"w": ings[1]["w"]})
    with pytest.raises(TypeError, match="int32"):
        uni.add(uni.init(), {"k": jnp.zeros((2,), jnp.int32)})
    with pytest.raises(ValueError, match="weights"):
        sp.weighted_soup(ings[:2], [0.0, 0.0])
    with pytest.raises(ValueError, match="no ingredients"):
        sp.greedy_soup([], metrics, metric="loss")


# ----------------------------------------------------------------------------- the soup node strategy


def _softmax_metrics(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Float64 accuracy and cross entropy of a linear softmax classifier ``x @ w``."""
    z = x @ w
    z = z - z.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return {"accuracy": float(np.mean(z.argmax(1) == y)), "loss": float(-logp[np.arange(len(y)), y].mean())}


def _node_case(seed: int, bad: float):
    """Held-out data of a 3-class linear problem and 4 snapshots; the earlier ones ``bad`` off the truth."""
    rng = np.random.default_rng(seed)
    truth = rng.normal(size=(6, 3))
    x = rng.normal(size=(40, 6))
    y = (x @ truth + 0.5 * rng.normal(size=(40, 3))).argmax(1)
    snaps = [truth + bad * rng.normal(size=truth.shape) for _ in range(3)]
    snaps.append(truth + 0.3 * rng.normal(size=truth.shape))  # the latest: close to the truth
    return x, y, snaps


def _key(m: dict[str, float]) -> tuple[float, float]:
    return (m["accuracy"], -m["loss"])


@pytest.mark.parametrize("seed", range(6))
def test_soup_node_is_never_worse_on_its_heldout_split_than_its_latest_snapshot(seed):
    from strategies.node import Soup

    x, y, snaps = _node_case(seed, bad=3.0)
    trees = [{"w": jnp.asarray(s, jnp.float32)} for s in snaps]

    def evaluate(p):
        return _softmax_metrics(np.asarray(p["w"], np.float64), x, y)

    latest = evaluate(trees[-1])
    # The case is one where averaging every snapshot hurts: the earlier ones are bad.
    assert _key(evaluate(sp.uniform_soup(trees))) < _key(latest)
    soup = Soup().submit(trees[-1], trees, evaluate, scores=[evaluate(t) for t in trees])
    got = evaluate(soup)
    assert _key(got) >= _key(latest)
    # Reference: the greedy rule replayed in float64, from the latest, the others best first.
    metrics = [_softmax_metrics(s, x, y) for s in snaps]
    order = [3, *sorted(range(3), key=lambda i: _key(metrics[i]), reverse=True)]
    kept, best = [3], _key(metrics[3])
    for i in order[1:]:
        cand = _key(_softmax_metrics(np.mean([snaps[j] for j in [*kept, i]], 0), x, y))
        if cand >= best:
            kept, best = [*kept, i], cand
    np.testing.assert_allclose(np.asarray(soup["w"]), np.mean([snaps[j] for j in kept], 0), atol=1e-5)


def test_soup_node_keeps_snapshots_that_help_and_its_other_modes():
    from strategies.node import Soup

    # Snapshots scattered around the truth: their average is better than any one of them.
    rng = np.random.default_rng(7)
    truth = rng.normal(size=(6, 3))
    x = rng.normal(size=(400, 6))
    y = (x @ truth).argmax(1)
    snaps = [truth + 1.5 * rng.normal(size=truth.shape) for _ in range(4)]
    trees = [{"w": jnp.asarray(s, jnp.float32)} for s in snaps]

    def evaluate(p):
        return _softmax_metrics(np.asarray(p["w"], np.float64), x, y)

    soup = Soup().submit(trees[-1], trees, evaluate)
    assert _key(evaluate(soup)) > _key(evaluate(trees[-1]))
    assert not np.allclose(np.asarray(soup["w"]), snaps[-1])  # it kept more than the latest
    uniform = Soup(mode="uniform").submit(trees[-1], trees, evaluate)
    np.testing.assert_allclose(np.asarray(uniform["w"]), np.mean(snaps, 0), atol=1e-5)
    acc = np.array([evaluate(t)["accuracy"] for t in trees])
    w = np.exp((acc - acc.max()) / 0.05)
    weighted = Soup(mode="weighted").submit(trees[-1], trees, evaluate)
    np.testing.assert_allclose(
        np.asarray(weighted["w"]), np.tensordot(w / w.sum(), np.stack(snaps), 1), atol=1e-5
    )
    # A caller that scores trees by accuracy alone (one number each) gets the accuracy rule.
    by_acc = Soup().submit(trees[-1], trees, lambda p: evaluate(p)["accuracy"], scores=list(acc))
    assert evaluate(by_acc)["accuracy"] >= acc[-1]
    assert Soup().settings(8, 0.1).own_heldout == 0.1
    assert Soup(heldout="shared").settings(8, 0.1).own_heldout == 0.0
    with pytest.raises(ValueError, match="mode"):
        Soup(mode="best")
    with pytest.raises(ValueError, match="heldout"):
        Soup(heldout="public")


def test_greedy_soup_tuple_metric_breaks_accuracy_ties_by_the_loss():
    # Equal accuracy everywhere: a plain accuracy rule keeps everything (ties keep); (accuracy, loss)
    # keeps only what lowers the loss.
    def evaluate(p):
        v = float(p["w"][0])
        return {"accuracy": 1.0, "loss": (v - 1.0) ** 2}

    trees = [{"w": jnp.asarray([v], jnp.float32)} for v in (3.0, 0.8, 1.1)]
    plain = sp.greedy_soup(trees, evaluate, metric="accuracy", first=2)
    assert sorted(plain.kept) == [0, 1, 2]
    lex = sp.greedy_soup(trees, evaluate, metric=("accuracy", "loss"), first=2)
    # From 1.1: with 0.8 the mean 0.95 is closer to 1 (kept); with 3.0 too it is 1.63 (rejected).
    assert sorted(lex.kept) == [1, 2]
    np.testing.assert_allclose(np.asarray(lex.params["w"]), [0.95], atol=1e-6)
    with pytest.raises(ValueError, match="greedy"):
        sp.IncrementalSoup("uniform", metric=("accuracy", "loss"))
    with pytest.raises(ValueError, match="first"):
        sp.greedy_soup(trees, evaluate, metric="accuracy", first=3)


@pytest.mark.slow
def test_soup_nodes_in_a_round_are_never_worse_than_their_latest_snapshot():
    from meta_consensus import config
    from meta_consensus.fleet import Fleet

    cfg = config.load(
        None,
        [
            "task.options.hidden=[8]",
            "nodes.count=4",
            "nodes.strategies=soup",
            "vote.rule=median",
            "byzantine.nodes=[]",
            "nodes.local_steps=12",
            "nodes.options.soup.heldout_fraction=0.3",
        ],
    )
    fleet = Fleet(cfg)
    params = fleet.initial_params(jax.random.key(0))
    state = fleet.init(jax.random.key(1), params)
    for r in range(2):
        out = fleet.fit(state, params, jax.random.key(2 + r))
        state, params = out.state, jax.tree.map(lambda x: x.mean(0), out.submitted)
    assert len(fleet.soup_log) == 2
    for log in fleet.soup_log:
        assert sorted(log) == [0, 1, 2, 3]
        for v in log.values():
            assert v["split"] == "own"
            assert _key(v["soup"]) >= _key(v["latest"])
    # The latest snapshot's numbers are those of the node's trained params on its own split.
    batch = fleet.data.own_heldout_batch(0)
    last = jax.tree.map(lambda x: x[0], state.params)
    m = fleet._metrics(last, batch)
    assert float(m["accuracy"]) == pytest.approx(fleet.soup_log[-1][0]["latest"]["accuracy"])
