# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Convex merge weights
#
# Averaging every node uniformly is a poor merge when nodes differ: some saw other classes, one may
# have bad data. `consensus.convex` picks merge weights `w` on the (capped) simplex by solving a
# small convex problem with cvxpy, from statistics the coordinator can afford (n x n Gram matrices,
# the nodes' predictions on a held-out set):
#
# * `mixture_nll_weights`: the held-out negative log-likelihood of the *mixture* of the nodes'
#   predictions (stacking; convex in `w`);
# * `quadratic_weights` / `trust_region_quadratic_weights`: a quadratic model of the held-out loss
#   of the *merged parameters* (gradient and Gauss-Newton curvature at the uniform merge);
# * `anchor_weights`: the merge closest to a robust anchor (here the coordinate-wise median).
#
# `max_weight` caps every node's weight, so no single node can take over the merge. The nodes
# here have Dirichlet(0.3) label skew, and node 7 trains on flipped labels in every round (a
# broken data pipeline).

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
ALPHA = 0.3  # Dirichlet concentration: small = strong label skew
CAP = 0.3  # max_weight: no node gets more than 30% of the merge
ROUNDS = 4  # federated rounds; the last round's nodes are the ones we weigh
STEPS = 50  # local steps per round
HIDDEN = (32,) if SMALL else (64,)

# %%
task = DigitsTask(hidden=HIDDEN)
data = task.splits(NUM_NODES, seed=1, alpha=ALPHA)
bad_node = NUM_NODES - 1
flipped = np.arange(NUM_NODES) == bad_node

trainer = NodeTrainer(task, optax.adam, {"learning_rate": 3e-3}, batch_size=32)
fedavg = consensus.mean()
global_params = task.init(jax.random.key(0))
for r in range(ROUNDS):
    local = trainer.init(jax.random.fold_in(jax.random.key(1), r), global_params, NUM_NODES)
    local, _ = trainer.fit(local, data.own(), STEPS, flip_labels=flipped)
    stacked = local.params  # this round's nodes
    if r < ROUNDS - 1:  # plain FedAvg until the last round
        global_params, _ = fedavg.update(stacked, fedavg.init(global_params), global_params)

print("test accuracy per node:", trainer.evaluate(stacked, data.test)["accuracy"].round(2))

# %% [markdown]
# ## Statistics on the held-out set
#
# After a few rounds of plain federated averaging, the nodes of the last round are fine-tunes of
# one shared, partly trained model: the regime where weighing them pays off. The held-out split
# selects the weights; the test split is only used for the final numbers.

# %%
x_held, y_held = jnp.asarray(data.heldout["x"]), jnp.asarray(data.heldout["y"])
metrics = jax.jit(task.metrics)


def merge(weights):
    return consensus.weighted_sum(stacked, jnp.asarray(weights, jnp.float32))


def true_label_probs(params):
    probs = jax.nn.softmax(task.apply(params, x_held))
    return jnp.take_along_axis(probs, y_held[:, None], axis=1)[:, 0]


# (n, m): node i's probability of the true label of held-out example j
probs = np.asarray(jax.jit(jax.vmap(true_label_probs))(stacked), np.float64)
uniform = np.full(NUM_NODES, 1.0 / NUM_NODES)
uniform_merge = merge(uniform)


# %% [markdown]
# ## Three convex objectives
#
# `softmax_gauss_newton` gives the held-out loss, its gradient and the diagonal Gauss-Newton
# curvature at a reference point (the uniform merge); it takes the logits of *one* example.
# The trust-region variant evaluates the true held-out loss of the proposed merge and falls back
# towards uniform when the quadratic model over-promises, so it is never worse than uniform on
# the held-out set.


# %%
def logits_fn(params, x):  # one example -> (10,) logits
    return task.apply(params, x[None])[0]


def held_out_loss(params):
    return float(metrics(params, data.heldout)["loss"])


model = consensus.softmax_gauss_newton(logits_fn, uniform_merge, x_held, y_held)
median_merge, _ = consensus.median().update(stacked, consensus.median().init(None))

results = {
    "mixture NLL": consensus.mixture_nll_weights(probs, max_weight=CAP),
    "quadratic": consensus.quadratic_weights(
        stacked, uniform_merge, model.grad, model.curvature, loss=float(model.loss), max_weight=CAP
    ),
    "quadratic (trust region)": consensus.trust_region_quadratic_weights(
        stacked,
        uniform_merge,
        model.grad,
        model.curvature,
        held_out_loss,
        loss=float(model.loss),
        max_weight=CAP,
    ),
    "anchor (median)": consensus.anchor_weights(stacked, anchor=median_merge, max_weight=CAP),
}
for name, res in results.items():
    print(
        f"{name:25s} status={res.status:8s} fallback={res.fallback} "
        f"solve={1e3 * res.solve_time:5.1f} ms  w={res.weights.round(3)}"
    )

# %% [markdown]
# ## Merged models and the stacked ensemble
#
# Each weight vector merges the parameters (one model). The mixture weights are, strictly, the
# best weights for an *ensemble* of the nodes' predictions, so that is reported too.

# %%
weights = {"uniform": uniform, **{name: res.weights for name, res in results.items()}}
table = {}
for name, w in weights.items():
    merged = merge(w)
    held, test = metrics(merged, data.heldout), metrics(merged, data.test)
    table[name] = (float(held["loss"]), float(test["loss"]), float(test["accuracy"]))


def ensemble_nll(w):
    return float(-np.mean(np.log(np.maximum(w @ probs, 1e-12))))


print(f"{'merge weights':25s} {'held-out NLL':>12s} {'test NLL':>9s} {'test acc':>9s}")
for name, (h, t, a) in table.items():
    print(f"{name:25s} {h:12.3f} {t:9.3f} {a:9.3f}")
ens_uniform, ens_mixture = ensemble_nll(uniform), ensemble_nll(results["mixture NLL"].weights)
print(f"\nensemble of the nodes' predictions, held-out NLL: uniform weights {ens_uniform:.3f}")
print(f"{'':49s}mixture weights {ens_mixture:.3f}")

fig, ax = plt.subplots(figsize=(10, 3.5))
width = 0.8 / len(weights)
for k, (name, w) in enumerate(weights.items()):
    ax.bar(np.arange(NUM_NODES) + (k - len(weights) / 2 + 0.5) * width, w, width, label=name)
ax.axhline(CAP, color="gray", linestyle="--", label=f"cap {CAP}")
ax.set_xticks(range(NUM_NODES), [f"{i}*" if flipped[i] else str(i) for i in range(NUM_NODES)])
ax.set(xlabel="node (* flipped labels)", ylabel="merge weight", title="convex merge weights")
ax.legend(fontsize=8, ncol=2)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Infeasible caps are refused
#
# The weights sum to 1, so a cap below `1 / n` leaves no feasible point. The solver is never
# called: a `ValueError` says which cap would work.

# %%
try:
    consensus.mixture_nll_weights(probs, max_weight=0.1)
    infeasible_error = None
except ValueError as err:
    infeasible_error = err
    print(f"ValueError: {err}")

# %% [markdown]
# ## Checks
#
# Guarantees, not luck: the trust-region merge is never worse than uniform on the held-out set,
# the mixture weights minimize the ensemble NLL over a set that contains the uniform weights, every
# weight vector respects the cap, and the flipped-label node is (almost) switched off.

# %%
assert table["quadratic (trust region)"][0] <= table["uniform"][0] + 1e-6
assert ens_mixture <= ens_uniform + 1e-9
for name, res in results.items():
    assert not res.fallback, (name, res.message)
    assert abs(res.weights.sum() - 1.0) < 1e-6 and res.weights.max() <= CAP + 1e-6, name
assert results["mixture NLL"].weights[bad_node] < 0.5 / NUM_NODES
assert infeasible_error is not None and "1/8" in str(infeasible_error)
print("all checks passed")
