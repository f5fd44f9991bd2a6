# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Quickstart: merge 8 node models in a few lines
#
# Eight nodes train copies of one small MLP on their own, label-skewed shares of scikit-learn's
# digits. The coordinator receives eight parameter trees and merges them into one consensus tree.
# This notebook shows the coordinator API in miniature:
#
# * `consensus.stack` turns a list of parameter trees into one *stacked* tree (every leaf gets a
#   leading node axis);
# * every rule is an optax-style pair `agg.init(params)` / `agg.update(stacked, state, params)`;
# * `consensus.get_info(state)` reports, for every rule, which nodes were valid, which were
#   selected and each node's weight in the result;
# * repeating train-then-merge is federated averaging.

# %%
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

import consensus
from strategies import DigitsTask, NodeTrainer

# META_CONSENSUS_SMALL=1 (set by the test suite) picks small settings so the notebook runs in seconds.
SMALL = os.environ.get("META_CONSENSUS_SMALL") == "1"

NUM_NODES = 8
LOCAL_STEPS = 50  # training steps of every node per round
ROUNDS = 6 if SMALL else 10
HIDDEN = (32,) if SMALL else (64,)

# %% [markdown]
# ## Eight nodes, each on its own data
#
# `DigitsTask.splits` gives every node a Dirichlet(0.5) share of the training set, so each node
# sees mostly a few classes. `NodeTrainer` trains all eight copies in one jitted, vmapped step;
# here it only stands in for eight machines.

# %%
task = DigitsTask(hidden=HIDDEN)
data = task.splits(NUM_NODES, seed=0, alpha=0.5)
print("training examples per node:", data.train_count.tolist())

global_params = task.init(jax.random.key(0))  # the common starting point
trainer = NodeTrainer(task, optax.adam, {"learning_rate": 3e-3}, batch_size=32)
train_state = trainer.init(jax.random.key(1), global_params, NUM_NODES)
train_state, fit_log = trainer.fit(train_state, data.own(), LOCAL_STEPS)
node_acc = trainer.evaluate(train_state.params, data.test)["accuracy"]
print("test accuracy of each node:", node_acc.round(3))

# %% [markdown]
# ## Stack the trees
#
# In a deployment each node sends one ordinary parameter tree. `consensus.unstack` gives us
# those eight trees; `consensus.stack` checks that they have one structure and stacks them.

# %%
nodes = consensus.unstack(train_state.params)  # a list of 8 trees, as 8 machines would send them
stacked = consensus.stack(nodes)
print(jax.tree.map(jnp.shape, stacked))

# %% [markdown]
# ## Merge with three rules
#
# `mean` is FedAvg's average, `median` the coordinate-wise median and `krum` picks the one node
# whose `n - f - 2` nearest neighbours are closest to it, tolerating `f` Byzantine nodes. The
# rules centre distances on `params` (the current global tree), which keeps them accurate when
# nodes are close.

# %%
rules = {
    "mean": consensus.mean(),
    "median": consensus.median(),
    "krum": consensus.krum(num_byzantine=2),
}
merged, infos = {}, {}
for name, agg in rules.items():
    agg_state = agg.init(global_params)
    merged[name], agg_state = agg.update(stacked, agg_state, global_params)
    infos[name] = consensus.get_info(agg_state)
    info = infos[name]
    print(
        f"{name:7s} selected={np.asarray(info.selected).astype(int)} "
        f"weights={np.asarray(info.weights).round(3)} linear={info.linear}"
    )

test_metrics = jax.jit(task.metrics)
merged_acc = {name: float(test_metrics(p, data.test)["accuracy"]) for name, p in merged.items()}
for name, acc in merged_acc.items():
    print(f"{name:7s} merged test accuracy {acc:.3f}")
print(f"nodes   mean test accuracy {node_acc.mean():.3f} (best {node_acc.max():.3f})")


# %% [markdown]
# ## Repeat: federated averaging
#
# One merge of nodes that drifted towards their own classes is a rough model. Broadcasting the
# merge and training again, round after round, is FedAvg (with `mean`) or a robust variant (with
# `median`). For comparison the nodes also keep training alone on their own data for the same
# number of steps.


# %%
def federated(agg, rounds):
    params, agg_state = global_params, agg.init(global_params)
    accuracy = []
    for r in range(rounds):
        local = trainer.init(jax.random.fold_in(jax.random.key(1), r), params, NUM_NODES)
        local, _ = trainer.fit(local, data.own(), LOCAL_STEPS)
        params, agg_state = agg.update(local.params, agg_state, params)
        accuracy.append(float(test_metrics(params, data.test)["accuracy"]))
    return np.asarray(accuracy)


round_acc = {name: federated(rules[name], ROUNDS) for name in ["mean", "median"]}
alone = train_state
for _ in range(ROUNDS - 1):
    alone, _ = trainer.fit(alone, data.own(), LOCAL_STEPS)
alone_acc = trainer.evaluate(alone.params, data.test)["accuracy"]
for name, acc in round_acc.items():
    print(f"{name:7s} accuracy per round: {acc.round(3)}")
print(f"nodes alone after {ROUNDS * LOCAL_STEPS} steps: {alone_acc.round(3)}")

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.5))
ax0.bar(np.arange(NUM_NODES), node_acc, color="lightgray", label="single node")
for (name, acc), color in zip(merged_acc.items(), ["C0", "C1", "C2"], strict=True):
    ax0.axhline(acc, color=color, label=f"{name} merge")
ax0.set(xlabel="node", ylabel="test accuracy", title="one round: nodes vs merges", ylim=(0, 1))
ax0.legend(loc="lower right")
for name, acc in round_acc.items():
    ax1.plot(np.arange(1, ROUNDS + 1), acc, "o-", label=f"federated, {name}")
ax1.axhline(alone_acc.max(), color="gray", linestyle="--", label="best node alone")
ax1.set(xlabel="round", ylabel="test accuracy", title="train, merge, repeat", ylim=(0, 1))
ax1.legend(loc="lower right")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Checks
#
# Executing this notebook is a test: the weights are a distribution over the nodes, Krum's merge
# is exactly the one node it selected, and a few rounds of federated averaging give a model better
# than any node trained alone on its skewed share.

# %%
for name, info in infos.items():
    assert np.isclose(float(np.sum(info.weights)), 1.0, atol=1e-5), name
krum_info = infos["krum"]
assert int(np.sum(krum_info.selected)) == 1
chosen = int(np.argmax(krum_info.selected))
for a, b in zip(jax.tree.leaves(merged["krum"]), jax.tree.leaves(nodes[chosen]), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
assert round_acc["mean"][-1] > alone_acc.max(), (round_acc["mean"], alone_acc)
print("all checks passed")
