"""Tangent nodes in the trainer: the convexity strategy's ``mode = "tangent"``.

* a fleet whose nodes all train the expansion at the anchor trains exactly what the trainer
  trains on the linearised task itself (:class:`strategies.tangent.TangentTask` with the anchor
  as ``frozen``); in a mixed fleet each node trains its own model: the tangent ones the
  expansion, the others the task, bit for bit as the two single-mode fleets;
* on a convex loss (cross entropy of an affine model) the round's average of tangent nodes has
  a loss no larger than their average loss, measured on the expansion;
* the strategy's options resolve as documented, and the trainer refuses what it cannot run
  (LoRA, example-level DP, a task that cannot be linearised). The system's side is in
  tests/system/test_tangent_nodes_run.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_mlp import C, D, mlp_apply, mlp_init

from strategies import dpsgd
from strategies.node import build_strategy
from strategies.tangent import NotLinearizableError, TangentTask
from strategies.tasks.custom import task_from_arrays
from strategies.trainer import NodeTrainer, Proximal

N, STEPS = 3, 6


@pytest.fixture(scope="module")
def setting():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, D)).astype(np.float32)
    y = rng.integers(0, C, size=120)
    task = task_from_arrays((mlp_init, mlp_apply), x, y, name="mlp")
    data = task.splits(N, seed=0)
    anchor = task.init(jax.random.key(0))
    return task, data, anchor


def _fit(task, data, anchor, **options):
    import optax

    trainer = NodeTrainer(task, optax.adam, {"learning_rate": 0.05}, batch_size=8)
    state = trainer.init(jax.random.key(3), anchor, N)
    return trainer.fit(state, data.own(), STEPS, **options)[0].params


def _node(tree, i):
    return jax.tree.map(lambda v: np.asarray(v[i]), tree)


def _prox(anchor, tangent):
    return Proximal(anchor, np.zeros(N, np.float32), np.full(N, np.inf, np.float32), np.asarray(tangent))


def test_tangent_nodes_train_the_linearised_task_and_a_mixed_fleet_trains_each_its_own(setting):
    task, data, anchor = setting
    reference_tangent = _fit(TangentTask(task, anchor), data, anchor, frozen=anchor)
    reference_plain = _fit(task, data, anchor)
    all_tangent = _fit(task, data, anchor, proximal=_prox(anchor, [True] * N))
    mixed = _fit(task, data, anchor, proximal=_prox(anchor, [True, False, True]))
    for a, b in zip(jax.tree.leaves(all_tangent), jax.tree.leaves(reference_tangent), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    for i, ref in ((0, reference_tangent), (1, reference_plain), (2, reference_tangent)):
        for a, b in zip(jax.tree.leaves(_node(mixed, i)), jax.tree.leaves(_node(ref, i)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # The expansion is not the model: tangent and plain training part ways.
    assert not np.allclose(_node(reference_tangent, 0)["w1"], _node(reference_plain, 0)["w1"])


def test_the_average_of_tangent_nodes_is_no_worse_than_their_average_loss(setting):
    task, data, anchor = setting
    nodes = _fit(task, data, anchor, proximal=_prox(anchor, [True] * N))
    lin = TangentTask(task, anchor)
    rows = {k: np.asarray(v) for k, v in data.heldout.items()}
    losses = [float(lin.loss(_node(nodes, i), rows)) for i in range(N)]
    mean = jax.tree.map(lambda v: jnp.mean(v, axis=0), nodes)
    assert float(lin.loss(mean, rows)) <= np.mean(losses) + 1e-6
    # ... which the model itself need not satisfy: the expansion is what makes it convex.
    assert max(losses) > min(losses)  # the nodes moved apart (a trivial average proves nothing)


def test_the_convexity_strategys_modes():
    proximal = build_strategy("convexity", {}).settings(10, 0.1)
    assert (proximal.proximal_mu, proximal.tangent) == (0.5, False)
    tangent = build_strategy("convexity", {"mode": "tangent"}).settings(10, 0.1)
    assert (tangent.proximal_mu, tangent.proximal_radius, tangent.tangent) == (0.0, math.inf, True)
    both = build_strategy("convexity", {"mode": "tangent", "mu": 0.2}).settings(10, 0.1)
    assert (both.proximal_mu, both.tangent) == (0.2, True)
    with pytest.raises(ValueError, match="mode must be 'proximal' or 'tangent'"):
        build_strategy("convexity", {"mode": "linear"})


def test_the_trainer_refuses_tangent_nodes_it_cannot_run(setting):
    import optax

    task, data, anchor = setting
    trainer = NodeTrainer(task, optax.adam, {"learning_rate": 0.05}, batch_size=8)
    state = trainer.init(jax.random.key(3), anchor, N)
    prox = _prox(anchor, [True] * N)
    dp = dpsgd.ExampleDP(clip_norm=1.0, noise_multiplier=1.0, pad=8)
    with pytest.raises(ValueError, match="example-level DP-SGD"):
        trainer.fit(state, data.own(), 1, proximal=prox, dp=dp)
    with pytest.raises(ValueError, match="frozen base"):
        trainer.fit(state, data.own(), 1, proximal=prox, frozen=anchor)
    with pytest.raises(ValueError, match="expansion point must be one tree like a node's params"):
        trainer.fit(state, data.own(), 1, proximal=_prox({**anchor, "b2": jnp.zeros(C + 1)}, [True] * N))

    class Opaque:  # a task that does not say its loss reads the model through apply alone
        name, linearizable = "opaque", False

        def __getattr__(self, attr):
            return getattr(task, attr)

    opaque = NodeTrainer(Opaque(), optax.adam, {"learning_rate": 0.05}, batch_size=8)  # type: ignore[arg-type]
    with pytest.raises(NotLinearizableError, match="linearizable"):
        opaque.fit(opaque.init(jax.random.key(3), anchor, N), data.own(), 1, proximal=prox)
