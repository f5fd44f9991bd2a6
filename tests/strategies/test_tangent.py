"""Tangent-space fine-tuning: the linearised model against independent references.

* an MLP's linearised logits equal a float64 numpy first-order expansion written by hand (the
  directional derivative through the ReLU), at the anchor they are the model's own, and they are
  affine in theta;
* a causal LM's linearised logits differ from the model's by O(eps^2) along a direction (halving
  eps quarters the gap), and the anchor passed as the trainer's ``frozen`` argument gives the same
  training as the task's own;
* two linearised fine-tunes of a causal LM on different domains have no loss barrier: the loss
  of their average is at most their average loss, at every point of the path (Jensen);
* tasks that cannot be linearised and bad anchors are refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_mlp import C, D, mlp_apply, mlp_init

from strategies.convexity import loss_barrier
from strategies.tangent import NotLinearizableError, TangentTask, linearize
from strategies.tasks.custom import task_from_arrays
from strategies.trainer import NodeTrainer


def _numpy_expansion(p0, p, x):
    """f(p0) + J f(p0) (p - p0) of the MLP, written out in float64."""
    p0 = {k: np.asarray(v, np.float64) for k, v in p0.items()}
    d = {k: np.asarray(p[k], np.float64) - p0[k] for k in p0}
    x = np.asarray(x, np.float64)
    z = x @ p0["w1"] + p0["b1"]
    h = np.maximum(z, 0.0)
    dh = (z > 0) * (x @ d["w1"] + d["b1"])
    return h @ p0["w2"] + p0["b2"] + dh @ p0["w2"] + h @ d["w2"] + d["b2"]


@pytest.fixture(scope="module")
def mlp_task():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(90, D)).astype(np.float32)
    y = rng.integers(0, C, size=90)
    return task_from_arrays((mlp_init, mlp_apply), x, y, name="mlp")


def _moved(p, scale, seed=1):
    leaves, treedef = jax.tree.flatten(p)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [v + scale * jax.random.normal(k, v.shape, v.dtype) for k, v in zip(keys, leaves, strict=True)]
    return jax.tree.unflatten(treedef, moved)


def test_linearised_logits_equal_a_float64_first_order_expansion(mlp_task):
    p0 = mlp_task.init(jax.random.key(3))
    tangent = linearize(mlp_task, p0)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(32, D)), jnp.float32)
    p = _moved(p0, 0.2)
    got = np.asarray(tangent.apply(p, x), np.float64)
    np.testing.assert_allclose(got, _numpy_expansion(p0, p, x), rtol=0, atol=2e-5)
    # at the anchor it is the model; along any direction it is affine
    np.testing.assert_allclose(np.asarray(tangent.apply(p0, x)), np.asarray(mlp_task.apply(p0, x)), atol=1e-6)
    p2 = jax.tree.map(lambda a, b: a + 2.0 * (b - a), p0, p)
    twice = np.asarray(tangent.apply(p2, x), np.float64) - np.asarray(tangent.apply(p0, x), np.float64)
    once = got - np.asarray(tangent.apply(p0, x), np.float64)
    np.testing.assert_allclose(twice, 2.0 * once, rtol=0, atol=2e-5)
    # the nonlinear model is not the expansion here (the check above can fail)
    assert np.abs(np.asarray(mlp_task.apply(p, x), np.float64) - got).max() > 1e-2


def test_loss_and_metrics_are_the_base_tasks_on_the_linearised_logits(mlp_task):
    p0 = mlp_task.init(jax.random.key(3))
    tangent = linearize(mlp_task, p0)
    p = _moved(p0, 0.3)
    data = mlp_task.splits(2, seed=0)
    batch = {"x": jnp.asarray(data.test["x"]), "y": jnp.asarray(data.test["y"])}
    logits = _numpy_expansion(p0, p, batch["x"])
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))
        - logits.max(1, keepdims=True)
    )
    y = np.asarray(batch["y"])
    want_loss = -logp[np.arange(len(y)), y].mean()
    m = tangent.metrics(p, batch)
    assert float(tangent.loss(p, batch)) == pytest.approx(want_loss, rel=1e-5)
    assert float(m["loss"]) == pytest.approx(want_loss, rel=1e-5)
    assert float(m["accuracy"]) == pytest.approx(float((logits.argmax(1) == y).mean()), abs=1e-7)
    assert tangent.name == "tangent(mlp)" and tangent.kind == "classification"
    assert tangent.splits(2, seed=0).train["x"].shape == data.train["x"].shape  # the base's data
    np.testing.assert_array_equal(np.asarray(tangent.init(jax.random.key(9))["w1"]), np.asarray(p0["w1"]))


def test_linearize_refuses_what_it_cannot_linearise(mlp_task):
    p0 = mlp_task.init(jax.random.key(0))

    class Opaque:
        name = "opaque"

    with pytest.raises(NotLinearizableError, match="linearizable"):
        linearize(Opaque(), p0)
    with pytest.raises(ValueError, match="tree structure"):
        linearize(mlp_task, {"w1": p0["w1"]})
    with pytest.raises(ValueError, match="shape"):
        linearize(mlp_task, {**p0, "b2": jnp.zeros((C + 1,))})
    with pytest.raises(ValueError, match="floating-point"):
        linearize(mlp_task, {**p0, "b2": jnp.zeros((C,), jnp.int32)})


# ----------------------------------------------------------------------------- a causal LM


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from causal_lm_helpers import corpus, model_folder, task_options

    from strategies.registry import build_task

    folder = model_folder(tmp_path_factory.mktemp("tiny_llama"))
    text = corpus(tmp_path_factory.mktemp("corpus"))
    task = build_task("causal_lm", task_options(folder, text, windows_per_node=24))
    return task, task.init(jax.random.key(0))


@pytest.mark.slow
def test_a_causal_lms_linearisation_is_first_order(lm):
    task, p0 = lm
    tangent = linearize(task, p0)
    x = jnp.asarray(task.splits(2, seed=0).test["x"][:4])
    direction = _moved(jax.tree.map(jnp.zeros_like, p0), 1.0, seed=5)
    norm = float(jnp.sqrt(sum(jnp.sum(v**2) for v in jax.tree.leaves(direction))))
    gaps = []
    for eps in (0.2, 0.1):
        p = jax.tree.map(lambda a, d, e=eps: a + e * d / norm, p0, direction)
        gaps.append(float(jnp.abs(tangent.apply(p, x) - task.apply(p, x)).max()))
    # f - f_lin is the second-order remainder: halving the step quarters it
    assert gaps[1] > 1e-4 and 3.0 < gaps[0] / gaps[1] < 5.0
    # at the anchor: the model (the jvp's primal is compiled apart, so equal up to rounding)
    np.testing.assert_allclose(np.asarray(tangent.apply(p0, x)), np.asarray(task.apply(p0, x)), atol=1e-6)


def _fine_tune(task, p0, data, frozen=None, steps=30):
    trainer = NodeTrainer(task, optax.adam, {"learning_rate": 3e-3}, batch_size=4)
    state = trainer.init(jax.random.key(1), p0, 2)
    state, _ = trainer.fit(state, data.own(), steps, **({} if frozen is None else {"frozen": frozen}))
    return [jax.tree.map(lambda v, i=i: v[i], state.params) for i in range(2)]


@pytest.mark.slow
def test_linearised_fine_tunes_of_a_causal_lm_have_no_loss_barrier(lm):
    task, p0 = lm
    data = task.splits(2, seed=0)  # node 0 on code, node 1 on prose
    tangent = linearize(task, p0)
    a, b = _fine_tune(tangent, p0, data)
    # the anchor as the trainer's frozen argument: the same training, up to rounding
    a2, _ = _fine_tune(TangentTask(task, jax.tree.map(jnp.zeros_like, p0)), p0, data, frozen=p0)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(a2), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-5)
    batch = {"x": jnp.asarray(data.test["x"]), "y": jnp.asarray(data.test["y"])}

    def distance(t):
        pairs = zip(jax.tree.leaves(t), jax.tree.leaves(p0), strict=True)
        return float(jnp.sqrt(sum(jnp.sum((u - v) ** 2) for u, v in pairs)))

    moved = [distance(a), distance(b)]
    assert min(moved) > 0.1  # real fine-tunes, not the anchor
    report = loss_barrier(tangent.loss, a, b, batch, num_points=9)
    # convex in theta: every interior point is at most the chord (float32 slack)
    assert float(jnp.max(report.gaps)) <= 1e-5
    mean = jax.tree.map(lambda u, v: (u + v) / 2, a, b)
    ends = (float(tangent.loss(a, batch)) + float(tangent.loss(b, batch))) / 2
    assert float(tangent.loss(mean, batch)) <= ends
