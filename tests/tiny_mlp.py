"""A two-layer ReLU MLP on D features with C classes, the tests' smallest nonlinear model.

Shared by the tangent-space tests: small enough to write its first-order expansion by hand in
float64, nonlinear enough that the expansion differs from the model away from its anchor.
"""

from __future__ import annotations

import jax

D, H, C = 6, 5, 3  # input features, hidden units, classes


def mlp_init(key: jax.Array) -> dict[str, jax.Array]:
    """Random weights (scaled so the ReLUs are neither all on nor all off)."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {
        "w1": jax.random.normal(k1, (D, H)) * 0.7,
        "b1": jax.random.normal(k2, (H,)) * 0.3,
        "w2": jax.random.normal(k3, (H, C)) * 0.7,
        "b2": jax.random.normal(k4, (C,)) * 0.3,
    }


def mlp_apply(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """The logits, (batch, C)."""
    return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
