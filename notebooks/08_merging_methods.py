# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Merging methods: task vectors, TIES's sign election, layer-wise weights
#
# Every method in `consensus.merging` is an aggregator whose `params` is the common *base*:
# node i's task vector is `x_i - base`. This notebook builds a few task vectors by hand,
# merges them with task arithmetic, TIES, DARE + TIES and Model Stock, draws TIES's sign
# election, and shows layer-wise convex weights (one simplex per leaf).

# %%
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import consensus
from consensus.convex.curvature import LossModel

SMALL = os.environ.get("META_CONSENSUS_SMALL") == "1"
D = 40 if SMALL else 200

rng = np.random.default_rng(0)
base = {"w": rng.standard_normal(D).astype(np.float32), "b": np.zeros(4, np.float32)}
# Four task vectors: sparse, partly overlapping, with conflicting signs on some coordinates.
deltas = []
for _ in range(4):
    d = np.zeros(D, np.float32)
    idx = rng.choice(D, D // 4, replace=False)
    d[idx] = rng.standard_normal(len(idx)).astype(np.float32)
    deltas.append({"w": d, "b": 0.1 * rng.standard_normal(4).astype(np.float32)})
stacked = consensus.stack([jax.tree.map(lambda p, d: p + d, base, d) for d in deltas])

# %% [markdown]
# ## Task arithmetic and TIES
# Task arithmetic adds `scale * sum_i (x_i - base)`. TIES keeps each node's largest-magnitude
# entries (`density`), elects a sign per coordinate and averages only the entries that agree.

# %%
ta, _ = consensus.task_arithmetic(0.5).update(stacked, None, base)
ties, _ = consensus.ties(0.5).update(stacked, None, base)
dare_ties = consensus.process(consensus.ties(0.5), pre=[consensus.dare(0.5)])
dt, _ = dare_ties.update(stacked, dare_ties.init(base), base, key=jax.random.key(0))
stock, stock_state = consensus.model_stock().update(stacked, None, base)
print("Model Stock's t per leaf:", jax.tree.map(float, stock_state.t))
for name, m in [("task arithmetic", ta), ("ties", ties), ("dare+ties", dt), ("model stock", stock)]:
    print(f"{name:16s} |merged - base| = {float(jnp.linalg.norm(m['w'] - base['w'])):.3f}")

# %% [markdown]
# ## TIES's sign election, drawn
# Rows: the trimmed task vectors; last row: the elected sign ("sum" election). Entries whose
# sign disagrees with the elected one are dropped.

# %%
D_ = np.stack([np.asarray(d["w"]) for d in deltas])
k = max(1, int(0.5 * D))
trimmed = np.stack([np.where(np.abs(r) >= np.sort(np.abs(r))[::-1][k - 1], r, 0.0) for r in D_])
elected = np.where(trimmed.sum(0) >= 0, 1.0, -1.0)
fig, ax = plt.subplots(figsize=(10, 2.6))
ax.imshow(np.vstack([np.sign(trimmed), elected[None]]), cmap="bwr", aspect="auto", vmin=-1, vmax=1)
ax.set_yticks(range(5), [f"node {i}" for i in range(4)] + ["elected"])
ax.set_xlabel("coordinate")
ax.set_title("TIES: trimmed signs per node and the elected sign")
plt.show()
kept = np.sign(trimmed) == elected
merged_by_hand = base["w"] + np.where(kept, trimmed, 0).sum(0) / np.maximum(kept.sum(0), 1)
print("TIES by hand == consensus.ties:", np.allclose(merged_by_hand, np.asarray(ties["w"]), atol=1e-5))

# %% [markdown]
# ## Layer-wise convex weights
# One simplex of node weights per leaf, from a quadratic model of a held-out loss (here a
# made-up gradient and curvature that favour node 0 on `w` and node 3 on `b`).

# %%
grad = {"w": -jnp.asarray(deltas[0]["w"]), "b": -jnp.asarray(deltas[3]["b"])}
curv = jax.tree.map(lambda p: jnp.ones_like(jnp.asarray(p)), base)
lw = consensus.layerwise_weights(lambda ref, **_: LossModel(jnp.float32(0.0), grad, curv))
merged, state = lw.update(stacked, lw.init(base), base)
for name, w in zip(state.result.groups, state.result.weights, strict=True):
    print(f"{name}: weights {np.round(w, 3)}")

# %%
# Checks: TIES matches the hand computation, every layer's weights are a simplex, and the
# made-up loss picks node 0 on `w` and nodes other than 0 on `b`.
assert np.allclose(merged_by_hand, np.asarray(ties["w"]), atol=1e-5)
assert np.allclose(state.result.weights.sum(1), 1.0) and state.result.weights.min() >= -1e-9
w_row = state.result.groups.index("['w']")
assert int(np.argmax(state.result.weights[w_row])) == 0
print("all checks passed")
