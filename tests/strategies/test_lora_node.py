"""LoRA on the node side (strategies.lora) against float64 references.

* targets: regular expressions over '/'-joined paths select kernels; one that matches nothing,
  a bad expression and a rank that is not low are refused, naming the problem;
* a fresh adapter is PEFT's (a in +-1/sqrt(in), b = 0: the model is the base, bit for bit);
* the merged model is W + (alpha / r) a @ b (n-D kernels viewed as (in, prod(rest)));
* the gradient the node trainer takes is the chain rule of the base's: dL/da = s G b^T,
  dL/db = s a^T G with G = dL/dW of softmax regression in closed form; under FFA-LoRA only b
  is trained, ``a`` stays the shared frozen one and the optimizer holds no state for it;
* example-level DP-SGD clips and noises the adapter gradients only;
* a round's merge: FLoRA's stack and FedEx-LoRA's residual are exact against the mean of the
  nodes' products, and the bytes on the wire are the adapter's (plus the base delta).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from strategies import dpsgd
from strategies.lora import (
    LoraError,
    LoraSettings,
    LoraTask,
    check_rank,
    init_adapter,
    merge_adapter,
    merge_round,
    select_targets,
    tree_bytes,
)
from strategies.tasks.base import NodeData
from strategies.trainer import NodeTrainer

D, C = 6, 5


class _Softmax:
    """Softmax regression with a 3-D kernel beside it (to check the (in, prod(rest)) view)."""

    name = "softmax"
    kind = "classification"

    def init(self, key):
        k1, k2 = jax.random.split(key)
        return {
            "dense": {"w": jax.random.normal(k1, (D, C)), "c": jnp.zeros((C,))},
            "cube": {"k": jax.random.normal(k2, (D, 2, 3))},
        }

    def apply(self, params, x, *, train=False, key=None):
        h = jnp.einsum("bd,dij->bij", x, params["cube"]["k"]).sum((1, 2))[:, None] * 0.0
        return x @ params["dense"]["w"] + params["dense"]["c"] + h

    def loss(self, params, batch, key=None):
        logp = jax.nn.log_softmax(self.apply(params, batch["x"]))
        nll = -jnp.take_along_axis(logp, batch["y"][:, None], axis=1)[:, 0]
        mask = batch.get("mask")
        if mask is None:
            return jnp.mean(nll)
        m = mask.astype(jnp.float32)
        return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)

    def metrics(self, params, batch):
        return {"loss": self.loss(params, batch)}

    def logical_axes(self, params):
        return jax.tree.map(lambda x: (None,) * x.ndim, params)

    def flip_labels(self, batch):
        return batch


def _batch(rows=16, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "x": jnp.asarray(rng.normal(size=(rows, D)), jnp.float32),
        "y": jnp.asarray(rng.integers(0, C, rows), jnp.int32),
    }


def _lora(freeze_a=False, rank=2, alpha=3.0, targets=(r"dense/w$",)):
    task = _Softmax()
    base = task.init(jax.random.key(0))
    settings = LoraSettings(rank=rank, alpha=alpha, targets=targets, freeze_a=freeze_a)
    return task, base, LoraTask(task, settings, base, jax.random.key(1))


def test_targets_are_kernels_whose_path_matches_and_mistakes_are_named():
    base = _Softmax().init(jax.random.key(0))
    assert select_targets(base, [r"dense/w$"]) == {"dense/w": (D, C)}
    assert set(select_targets(base, [r"w$", r"^cube/"])) == {"dense/w", "cube/k"}
    with pytest.raises(LoraError, match=r"'attn/query' matches no kernel.*dense/w"):
        select_targets(base, [r"dense/w$", "attn/query"])
    with pytest.raises(LoraError, match="matches no kernel"):
        select_targets(base, [r"dense/c$"])  # a bias (1-D) is no target
    with pytest.raises(LoraError, match="not a regular expression"):
        select_targets(base, ["(unclosed"])
    with pytest.raises(LoraError, match=r"rank 5 is not below min\(in, out\) = 5"):
        check_rank(5, {"dense/w": (D, C)})
    with pytest.raises(LoraError, match="rank must be an integer >= 1"):
        check_rank(0, {"dense/w": (D, C)})
    with pytest.raises(LoraError, match="alpha"):
        LoraTask(_Softmax(), LoraSettings(alpha=-1.0, targets=(r"w$",)), base, jax.random.key(0))


def test_fresh_adapter_is_pefts_and_leaves_the_model_unchanged():
    targets = {"dense/w": (D, C), "cube/k": (D, 2, 3)}
    ad = init_adapter(jax.random.key(3), targets, 2)
    assert ad["cube/k"]["a"].shape == (D, 2) and ad["cube/k"]["b"].shape == (2, 6)
    for v in ad.values():
        assert float(jnp.max(jnp.abs(v["a"]))) <= 1.0 / math.sqrt(D)
        assert float(jnp.std(v["a"])) > 0.1 / math.sqrt(D)
        assert not np.any(np.asarray(v["b"]))
    again = init_adapter(jax.random.key(3), targets, 2)
    assert all(np.array_equal(ad[p]["a"], again[p]["a"]) for p in targets)  # FFA's shared a
    base = _Softmax().init(jax.random.key(0))
    merged = merge_adapter(base, ad, 1.5)
    for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(base), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_merged_model_is_w_plus_scaled_product_in_float64():
    base = _Softmax().init(jax.random.key(0))
    rng = np.random.default_rng(1)
    ad = {
        "dense/w": {"a": rng.normal(size=(D, 2)), "b": rng.normal(size=(2, C))},
        "cube/k": {"a": rng.normal(size=(D, 2)), "b": rng.normal(size=(2, 6))},
    }
    ad = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), ad)
    merged = merge_adapter(base, ad, 0.75)
    f64 = jax.tree.map(lambda x: np.asarray(x, np.float64), ad)
    want_w = np.asarray(base["dense"]["w"], np.float64) + 0.75 * f64["dense/w"]["a"] @ f64["dense/w"]["b"]
    want_k = np.asarray(base["cube"]["k"], np.float64) + 0.75 * (
        f64["cube/k"]["a"] @ f64["cube/k"]["b"]
    ).reshape(D, 2, 3)
    np.testing.assert_allclose(merged["dense"]["w"], want_w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(merged["cube"]["k"], want_k, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(merged["dense"]["c"], base["dense"]["c"])


def _softmax_grad_w(w, c, x, y):
    """dL/dW of mean softmax cross entropy, closed form, float64."""
    z = x @ w + c
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return x.T @ p / len(y)


@pytest.mark.parametrize("freeze_a", [False, True])
def test_trainer_takes_the_chain_rule_gradient_on_the_adapter_only(freeze_a):
    task, base, lt = _lora(freeze_a=freeze_a)
    frozen = lt.initial_frozen(base, jax.random.key(5))
    rng = np.random.default_rng(2)
    full = {"dense/w": {"a": rng.normal(size=(D, 2)) * 0.3, "b": rng.normal(size=(2, C)) * 0.3}}
    if freeze_a:
        full["dense/w"]["a"] = np.asarray(frozen["a"]["dense/w"]["a"], np.float64)
    params = lt.trainable(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), full))
    assert set(params["dense/w"]) == ({"b"} if freeze_a else {"a", "b"})
    batch = _batch(rows=12)
    # One SGD step of learning rate 1 on a full batch (the trainer draws rows with replacement,
    # so the pool is one row repeated per node: every draw is the same row).
    x, y = np.asarray(batch["x"], np.float64), np.asarray(batch["y"])
    a, b = full["dense/w"]["a"], full["dense/w"]["b"]
    s = lt.scale
    w = np.asarray(base["dense"]["w"], np.float64) + s * a @ b
    g_w = _softmax_grad_w(w, np.asarray(base["dense"]["c"], np.float64), x[:1], y[:1])
    trainer = NodeTrainer(lt, optax.sgd, {"learning_rate": 1.0}, batch_size=4)
    state = trainer.init(jax.random.key(0), params, 1)
    pool = {"x": batch["x"][:1], "y": batch["y"][:1]}
    data = NodeData(pool, np.zeros((1, 1), np.int32), np.ones((1,), np.int32), shared=True)
    state, _ = trainer.fit(state, data, 1, frozen=frozen)
    got = jax.tree.map(lambda v: np.asarray(v[0], np.float64), state.params)
    np.testing.assert_allclose(got["dense/w"]["b"], b - s * a.T @ g_w, rtol=1e-4, atol=1e-5)
    if not freeze_a:
        np.testing.assert_allclose(got["dense/w"]["a"], a - s * g_w @ b.T, rtol=1e-4, atol=1e-5)
    # The optimizer's state is the adapter's (Adam: two moments of each trained leaf), never the base's.
    adam = NodeTrainer(lt, optax.adam, {"learning_rate": 1e-3}, batch_size=4)
    st = adam.init(jax.random.key(0), params, 1)
    moments = sum(x.size for x in jax.tree.leaves(st.opt_state) if x.ndim > 1)
    assert moments == 2 * sum(x.size for x in jax.tree.leaves(params))


@pytest.mark.slow
def test_example_level_dp_clips_and_noises_the_adapter_gradients():
    task, base, lt = _lora()
    frozen = lt.initial_frozen(base)
    params = lt.trainable(lt.fresh_adapter(jax.random.key(2)))
    params = jax.tree.map(lambda x: x + 0.1, params)  # b != 0: both factors have gradients
    batch = _batch(rows=8, seed=3)
    mask = jnp.asarray([True] * 6 + [False] * 2)

    def loss_fn(p, bt, key):
        return lt.loss(p, bt, key, frozen=frozen)

    clip = 0.05
    clipped = jax.jit(
        lambda p, b, m: dpsgd.clipped_sum(loss_fn, p, b, m, jax.random.key(0), jnp.float32(clip))
    )
    total, _ = clipped(params, batch, mask)
    grad = jax.jit(jax.grad(loss_fn))
    want = None
    for i in range(6):  # float64 reference: each example's adapter gradient, clipped, summed
        g = grad(params, {k: v[i : i + 1] for k, v in batch.items()}, None)
        flat = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(g)])
        flat *= min(1.0, clip / np.linalg.norm(flat))
        want = flat if want is None else want + flat
    got = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(total)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
    noisy = jax.eval_shape(
        lambda: dpsgd.private_gradient(
            loss_fn, params, batch, mask, jax.random.key(0), jax.random.key(1), jnp.float32(clip), 2.0, 4.0
        )[1]
    )
    assert jax.tree.structure(noisy) == jax.tree.structure(params)  # noise on the adapter alone


def _stacked(lt, n=4, seed=0):
    rng = np.random.default_rng(seed)
    shapes = lt.targets
    out = {}
    for p, shape in shapes.items():
        out[p] = {
            "a": jnp.asarray(rng.normal(size=(n, shape[0], 2)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(n, 2, math.prod(shape[1:]))), jnp.float32),
        }
    return out


@pytest.mark.parametrize("method", ["stack", "exact_residual"])
def test_exact_methods_move_the_model_by_the_mean_of_the_nodes_products(method):
    task, base, lt = _lora(targets=(r"dense/w$", r"cube/k$"))
    frozen = lt.initial_frozen(base)
    stacked = _stacked(lt)
    out = merge_round(lt, frozen, stacked, method=method, key=jax.random.key(0), measure=True)
    assert out.info["exactness"] == "exact" and out.info["deviation"] < 1e-5
    before = merge_adapter(base, lt.full_adapter({}, frozen), lt.scale)
    after = merge_adapter(out.frozen["base"], lt.full_adapter(out.params, out.frozen), lt.scale)
    for path, (outer, inner) in {"dense/w": ("dense", "w"), "cube/k": ("cube", "k")}.items():
        a = np.asarray(stacked[path]["a"], np.float64)
        b = np.asarray(stacked[path]["b"], np.float64)
        mean = lt.scale * np.einsum("nir,nro->io", a, b) / a.shape[0]
        moved = np.asarray(after[outer][inner], np.float64) - np.asarray(before[outer][inner], np.float64)
        np.testing.assert_allclose(moved.reshape(mean.shape), mean, rtol=1e-4, atol=1e-4)
    adapter_bytes = tree_bytes(jax.tree.map(lambda x: x[0], stacked))
    delta_bytes = sum(4 * math.prod(matrix) for matrix in [(D, C), (D, 6)])
    assert out.info["bytes_up"] == adapter_bytes
    assert out.info["bytes_down"] == adapter_bytes + delta_bytes
    if method == "stack":  # folded into the base; the nodes restart from b = 0
        assert not any(np.any(np.asarray(v["b"])) for v in out.params.values())


def test_ffa_merges_b_exactly_and_keeps_the_shared_a():
    task, base, lt = _lora(freeze_a=True)
    frozen = lt.initial_frozen(base, jax.random.key(4))
    rng = np.random.default_rng(0)
    stacked = {"dense/w": {"b": jnp.asarray(rng.normal(size=(3, 2, C)), jnp.float32)}}
    out = merge_round(lt, frozen, stacked, method="ffa", measure=True)
    np.testing.assert_allclose(
        out.params["dense/w"]["b"], np.mean(np.asarray(stacked["dense/w"]["b"]), 0), rtol=1e-6
    )
    assert out.info["deviation"] < 1e-5 and out.base_delta is None
    assert out.info["bytes_up"] == out.info["bytes_down"] == 4 * 2 * C  # b alone travels
    with pytest.raises(LoraError, match="changed the frozen a"):
        merge_round(lt, frozen, stacked, method="svd")
