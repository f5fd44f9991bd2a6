"""Example-level DP-SGD (strategies.dpsgd) against float64 references, and its trainer path.

* the clipped, summed, noised and averaged gradient equals a loop over examples of the closed-form
  softmax-regression gradient in float64, with the noise fixed by its key;
* the noise's standard deviation is z C / B (a statistical check over many coordinates);
* Poisson masks include every valid row with probability q and never a padding row;
* an overflow keeps the first ``pad`` selected rows, and the pad meets its probability bound
  (scipy's binomial tail);
* the trainer's DP step with no noise, no clipping and q = 1 is a full-batch gradient step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

from strategies import dpsgd
from strategies.tasks.base import NodeData
from strategies.trainer import NodeTrainer

D, C = 5, 3


def _softmax_loss(params, batch, key=None):
    del key
    logits = batch["x"] @ params["w"] + params["b"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def _reference_grads(params, x, y):
    """Per-example gradients of softmax regression, closed form, float64."""
    w, b = np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64)
    out = []
    for xi, yi in zip(np.asarray(x, np.float64), np.asarray(y), strict=True):
        z = xi @ w + b
        p = np.exp(z - z.max())
        p /= p.sum()
        p[yi] -= 1.0
        out.append({"w": np.outer(xi, p), "b": p})
    return out


def _problem(rows=12, seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w": jnp.asarray(rng.normal(size=(D, C)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=C), jnp.float32),
    }
    batch = {
        "x": jnp.asarray(rng.normal(size=(rows, D)) * 2, jnp.float32),
        "y": jnp.asarray(rng.integers(0, C, rows)),
    }
    mask = jnp.asarray(rng.random(rows) < 0.7)
    return params, batch, mask


@pytest.mark.parametrize("microbatch", [pytest.param(0, marks=pytest.mark.slow), 4])
def test_private_gradient_equals_a_float64_loop_with_the_noise_of_its_key(microbatch):
    params, batch, mask = _problem()
    clip, z, expected = 0.8, 1.3, 7.5
    key, noise_key = jax.random.key(1), jax.random.key(2)
    loss, grads = dpsgd.private_gradient(
        _softmax_loss, params, batch, mask, key, noise_key, clip, z, expected, microbatch
    )
    ref = {"w": np.zeros((D, C)), "b": np.zeros(C)}
    norms = []
    for g, m in zip(_reference_grads(params, batch["x"], batch["y"]), np.asarray(mask), strict=True):
        norm = np.sqrt(np.sum(g["w"] ** 2) + np.sum(g["b"] ** 2))
        norms.append(norm)
        if m:
            for k in ref:
                ref[k] += g[k] * min(1.0, clip / norm)
    assert max(norms) > clip > min(norms)  # both clipped and unclipped examples occur
    # The documented key scheme: leaf j (tree-leaves order: b, w) draws normal(split(key, 2)[j]).
    kb, kw = jax.random.split(noise_key, 2)
    noise = {
        "b": np.asarray(jax.random.normal(kb, (C,)), np.float64) * z * clip,
        "w": np.asarray(jax.random.normal(kw, (D, C)), np.float64) * z * clip,
    }
    for k in ref:
        np.testing.assert_allclose(np.asarray(grads[k]), (ref[k] + noise[k]) / expected, rtol=1e-5, atol=1e-6)
    # The loss is the mean over the selected rows.
    x, y = np.asarray(batch["x"], np.float64), np.asarray(batch["y"])
    z_ = x @ np.asarray(params["w"], np.float64) + np.asarray(params["b"], np.float64)
    lp = z_ - z_.max(1, keepdims=True) - np.log(np.exp(z_ - z_.max(1, keepdims=True)).sum(1, keepdims=True))
    m = np.asarray(mask)
    assert float(loss) == pytest.approx(-lp[np.arange(len(y)), y][m].mean(), rel=1e-5)


@pytest.mark.slow
def test_noise_std_is_z_c_over_expected_batch():
    params = {"w": jnp.zeros((200, 60), jnp.float32)}
    batch = {"x": jnp.zeros((4, 200), jnp.float32)}
    mask = jnp.zeros((4,), bool)  # no example: the gradient is pure noise

    def loss(p, b, key=None):
        return jnp.sum(b["x"] @ p["w"])

    z, clip, expected = 1.7, 0.6, 3.0
    _, g = dpsgd.private_gradient(
        loss, params, batch, mask, jax.random.key(0), jax.random.key(5), clip, z, expected
    )
    v = np.asarray(g["w"], np.float64).ravel()
    sd = z * clip / expected
    # 12000 coordinates: the sample std is within 3% of sd with overwhelming probability (SE ~ 0.65%).
    assert np.std(v) == pytest.approx(sd, rel=0.03)
    assert abs(np.mean(v)) < 5 * sd / np.sqrt(v.size)
    assert stats.kstest(v / sd, "norm").pvalue > 1e-4


@pytest.mark.slow
def test_poisson_rows_include_each_valid_row_at_rate_q():
    rows, count, q, pad, draws = 50, 40, 0.3, 50, 4000
    index = jnp.asarray(np.arange(rows)[::-1].copy(), jnp.int32)  # candidate j is pool row 49 - j
    keys = jax.random.split(jax.random.key(3), draws)
    got, mask, selected = jax.vmap(
        lambda k: dpsgd.poisson_rows(k, index, jnp.int32(count), jnp.float32(q), pad, rows)
    )(keys)
    got, mask, selected = np.asarray(got), np.asarray(mask), np.asarray(selected)
    hits = np.zeros(rows)
    for r, m in zip(got, mask, strict=True):
        np.add.at(hits, r[m], 1)
    freq = hits / draws
    valid = np.arange(rows)[::-1] < count  # pool row r is candidate 49 - r
    sd = np.sqrt(q * (1 - q) / draws)
    assert np.all(np.abs(freq[valid] - q) < 5 * sd)
    assert np.all(hits[~valid] == 0)
    assert np.array_equal(mask.sum(1), selected)  # no overflow at pad = rows
    # The batch size is Binomial(count, q).
    assert selected.mean() == pytest.approx(count * q, abs=5 * np.sqrt(count * q * (1 - q) / draws))
    assert selected.var() == pytest.approx(count * q * (1 - q), rel=0.1)


def test_overflow_keeps_the_first_pad_selected_rows():
    rows, pad = 40, 5
    key = jax.random.key(11)
    got, mask, selected = dpsgd.poisson_rows(key, None, jnp.int32(rows), jnp.float32(0.5), pad, rows)
    u = np.asarray(jax.random.uniform(key, (rows,), jnp.float32))
    chosen = np.flatnonzero(u < np.float32(0.5))
    assert int(selected) == len(chosen) > pad
    assert np.asarray(mask).all()
    np.testing.assert_array_equal(np.asarray(got), chosen[:pad])


def test_padded_size_meets_its_overflow_bound_and_is_the_smallest():
    counts, rates, p = [300, 1200], [0.1, 0.03], 1e-12
    pad = dpsgd.padded_size(counts, rates, p)
    tails = [stats.binom.sf(pad, n + 1, q) for n, q in zip(counts, rates, strict=True)]
    assert max(tails) <= p
    assert max(stats.binom.sf(pad - 1, n + 1, q) for n, q in zip(counts, rates, strict=True)) > p
    assert dpsgd.padded_size(counts, rates, p, multiple=8) % 8 == 0


def test_effective_rate_is_the_float32_uniform_inclusion_probability():
    q32 = dpsgd.sampling_rates([290, 3, 1000], 32)
    assert q32.dtype == np.float32 and q32[1] == 1.0
    eff = dpsgd.effective_rate(q32)
    grid = 2.0**23
    # uniform float32 takes the values k / 2^23, k = 0 .. 2^23 - 1: count the k with k / 2^23 < q.
    for q, e in zip(q32, eff, strict=True):
        k = np.arange(int(np.ceil(float(q) * grid)) - 2, int(np.ceil(float(q) * grid)) + 2)
        below = k[(k / grid).astype(np.float32) < q]
        assert e == pytest.approx(min(1.0, (below.max() + 1) / grid), rel=0, abs=0)
    with pytest.raises(ValueError, match="at least one row"):
        dpsgd.sampling_rates([0, 5], 4)


@pytest.mark.slow
def test_trainer_dp_step_without_noise_or_clipping_is_a_full_batch_step():
    """q = 1 (batch_size >= rows), z = 0, C huge: one DP-SGD step is SGD on the mean gradient."""

    class Softmax:
        name = "softmax"

        def init(self, key):
            return {"w": jax.random.normal(key, (D, C)), "b": jnp.zeros((C,))}

        def loss(self, params, batch, key=None):
            logp = jax.nn.log_softmax(batch["x"] @ params["w"] + params["b"])
            nll = -jnp.take_along_axis(logp, batch["y"][:, None], axis=1)[:, 0]
            m = batch.get("mask")
            return jnp.mean(nll) if m is None else jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1)

        def metrics(self, params, batch):
            return {"loss": self.loss(params, batch)}

        def logical_axes(self, params):
            return jax.tree.map(lambda x: (None,) * x.ndim, params)

    rng = np.random.default_rng(0)
    n, m = 2, 9
    x = rng.normal(size=(n, m, D)).astype(np.float32)
    y = rng.integers(0, C, (n, m)).astype(np.int32)
    counts = np.array([9, 6], np.int32)
    data = NodeData(
        {"x": x, "y": y}, np.tile(np.arange(m, dtype=np.int32), (n, 1)), counts, False, "own", True
    )
    task = Softmax()
    lr = 0.5
    trainer = NodeTrainer(task, optax.sgd, {"learning_rate": lr}, batch_size=16)
    p0 = task.init(jax.random.key(0))
    state = trainer.init(jax.random.key(1), p0, n)
    dp = dpsgd.ExampleDP(1e6, 0.0, pad=m)
    new, log = trainer.fit(state, data, 1, dp=dp, record=True)
    for i in range(n):
        grads = _reference_grads(p0, x[i, : counts[i]], y[i, : counts[i]])
        for k in ("w", "b"):
            mean = np.mean([g[k] for g in grads], 0)
            np.testing.assert_allclose(
                np.asarray(new.params[k][i]), np.asarray(p0[k], np.float64) - lr * mean, rtol=1e-5, atol=1e-6
            )
        rows = np.asarray(log.rows)[0, i]
        assert sorted(rows[rows >= 0].tolist()) == list(range(counts[i]))  # q = 1: every valid row
    with pytest.raises(ValueError, match="clip_norm"):
        trainer.fit(state, data, 1, dp=dpsgd.ExampleDP(0.0, 1.0, pad=m))
    with pytest.raises(ValueError, match="multiple of dp.microbatch"):
        trainer.fit(state, data, 1, dp=dpsgd.ExampleDP(1.0, 1.0, pad=9, microbatch=4))


# --------------------------------------------------------------------------- fast path (ghost clipping)


def _mlp_reference_grads(params, x, y):
    """Per-example gradients of the digits MLP (one ReLU hidden layer), by hand in float64."""
    w0 = np.asarray(params["dense_0"]["kernel"], np.float64)
    b0 = np.asarray(params["dense_0"]["bias"], np.float64)
    w1 = np.asarray(params["dense_1"]["kernel"], np.float64)
    b1 = np.asarray(params["dense_1"]["bias"], np.float64)
    out = []
    for xi, yi in zip(np.asarray(x, np.float64), np.asarray(y), strict=True):
        pre = xi @ w0 + b0
        h = np.maximum(pre, 0.0)
        z = h @ w1 + b1
        p = np.exp(z - z.max())
        p /= p.sum()
        p[yi] -= 1.0  # dL/dz
        dh = (w1 @ p) * (pre > 0)
        out.append(
            {
                "dense_0": {"kernel": np.outer(xi, dh), "bias": dh},
                "dense_1": {"kernel": np.outer(h, p), "bias": p},
            }
        )
    return out


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(tree)])


@pytest.mark.slow
def test_ghost_clipping_equals_a_float64_per_example_loop_on_an_mlp_with_the_noise_of_its_key():
    from strategies.tasks.digits import DigitsTask

    task = DigitsTask(hidden=(7,))
    taps = task.dp_dense_taps()
    assert taps is not None and taps.widths == (7, 10)
    params = jax.tree.map(lambda p: p * 3.0, task.init(jax.random.key(3)))  # larger, more varied norms
    rng = np.random.default_rng(5)
    rows = 16
    x = rng.random((rows, 64)).astype(np.float32) * rng.choice([0.05, 2.0], (rows, 1)).astype(np.float32)
    y = rng.integers(0, 10, rows).astype(np.int32)
    mask = np.ones(rows, bool)
    mask[[1, 4, 9, 14]] = False  # unsampled (padding) rows weigh nothing
    batch = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
    ref_grads = _mlp_reference_grads(params, x, y)
    norms = np.array([np.linalg.norm(_flat(g)) for g in ref_grads])
    clip = float(np.median(norms[mask]))
    assert np.sum(mask & (norms > clip * 1.05)) >= 3 and np.sum(mask & (norms < clip * 0.95)) >= 3
    assert np.max(norms[~mask]) > clip  # a masked row would have been clipped, not dropped

    z, expected = 0.7, 9.0
    key, noise_key = jax.random.key(11), jax.random.key(12)
    loss, grads = dpsgd.private_gradient(
        task.loss, params, batch, jnp.asarray(mask), key, noise_key, clip, z, expected, taps=taps
    )
    ref = jax.tree.map(lambda p: np.zeros(p.shape), params)
    for g, m, norm in zip(ref_grads, mask, norms, strict=True):
        if m:
            scale = min(1.0, clip / norm)
            ref = jax.tree.map(lambda r, gi, s=scale: r + s * gi, ref, g)
    # The documented key scheme: leaf j (tree-leaves order) draws normal(split(noise_key, 4)[j]).
    leaves, treedef = jax.tree.flatten(params)
    noise_keys = jax.random.split(noise_key, len(leaves))
    noise = jax.tree.unflatten(
        treedef,
        [
            np.asarray(jax.random.normal(k, p.shape), np.float64) * z * clip
            for k, p in zip(noise_keys, leaves, strict=True)
        ],
    )
    for got, r, nz in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), jax.tree.leaves(noise), strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float64), (r + nz) / expected, rtol=2e-5, atol=2e-6)
    # The loss is the mean per-example cross entropy over the sampled rows.
    ref_loss = []
    for xi, yi in zip(x[mask].astype(np.float64), y[mask], strict=True):
        h = np.maximum(
            xi @ np.asarray(params["dense_0"]["kernel"]) + np.asarray(params["dense_0"]["bias"]), 0
        )
        zz = h @ np.asarray(params["dense_1"]["kernel"], np.float64) + np.asarray(params["dense_1"]["bias"])
        ref_loss.append(np.log(np.sum(np.exp(zz - zz.max()))) + zz.max() - zz[yi])
    assert float(loss) == pytest.approx(np.mean(ref_loss), rel=1e-5)

    # The generic path (vmap of per-example gradients) gives the same gradient with the same keys.
    loss_g, grads_g = dpsgd.private_gradient(
        task.loss, params, batch, jnp.asarray(mask), key, noise_key, clip, z, expected
    )
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_g), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    assert float(loss) == pytest.approx(float(loss_g), rel=1e-6)


def test_ghost_clipping_refuses_taps_that_miss_parameters():
    from strategies.tasks.digits import DigitsTask

    task = DigitsTask(hidden=(5,))
    params = {**task.init(jax.random.key(0)), "extra": jnp.zeros((3,), jnp.float32)}
    batch = {"x": jnp.zeros((4, 64), jnp.float32), "y": jnp.zeros((4,), jnp.int32)}
    taps = task.dp_dense_taps()
    no_extra = dpsgd.DenseTaps(
        taps.widths, lambda p, b, o: taps.loss({k: p[k] for k in p if k != "extra"}, b, o)
    )
    with pytest.raises(ValueError, match="every parameter"):
        dpsgd.ghost_clipped_sum(no_extra, params, batch, jnp.ones((4,), bool), 1.0)
    assert DigitsTask(dropout=0.1).dp_dense_taps() is None  # dropout: the generic path


@pytest.mark.slow
def test_trainer_fast_and_generic_dp_paths_train_the_same_nodes():
    """Several DP-SGD steps of 3 digits nodes: ghost clipping (default) vs ExampleDP(ghost=False)."""
    from strategies.tasks.digits import DigitsTask

    task = DigitsTask(hidden=(16,))
    own = task.splits(3, seed=0).own()
    trainer = NodeTrainer(task, optax.sgd, {"learning_rate": 0.1}, batch_size=16)
    state = trainer.init(jax.random.key(0), None, 3)
    clip = np.array([0.05, 0.5, 50.0], np.float32)  # mostly clipped .. never clipped
    fast, log_f = trainer.fit(state, own, 4, dp=dpsgd.ExampleDP(clip, 0.8, 48), record=True)
    slow, log_s = trainer.fit(state, own, 4, dp=dpsgd.ExampleDP(clip, 0.8, 48, ghost=False), record=True)
    np.testing.assert_array_equal(np.asarray(log_f.rows), np.asarray(log_s.rows))  # same Poisson draws
    for a, b in zip(jax.tree.leaves(fast.params), jax.tree.leaves(slow.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(log_f.loss), np.asarray(log_s.loss), rtol=1e-5)
    assert not np.allclose(
        np.asarray(fast.params["dense_0"]["kernel"]), np.asarray(state.params["dense_0"]["kernel"])
    )
