# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Byzantine attacks and robust aggregation
#
# One federated round on digits: 15 nodes start from the same global model and train on their own
# data; `f = 3` of them are Byzantine and send whatever hurts most. The attacks of
# `strategies.attacks` are functions of the honest *updates* (omniscient attackers, the standard
# worst case). We compare the test accuracy of the merged model for every rule under every attack,
# and show the error a rule raises when it is asked to tolerate more Byzantine nodes than it can.

# %%
import os

import jax
import matplotlib.pyplot as plt
import numpy as np
import optax

import consensus
from strategies import DigitsTask, NodeTrainer, apply_attack

# META_CONSENSUS_SMALL=1 (set by the test suite) picks small settings so the notebook runs in seconds.
SMALL = os.environ.get("META_CONSENSUS_SMALL") == "1"

NUM_NODES = 15  # Bulyan needs n >= 4 f + 3
F = 3  # Byzantine nodes
STEPS = 150 if SMALL else 300
HIDDEN = (32,) if SMALL else (64,)

# %% [markdown]
# ## One honest round
#
# Every node trains from the global params on its own Dirichlet(1.0) shard. Nodes `0 .. f-1` will
# be replaced by the attackers.

# %%
task = DigitsTask(hidden=HIDDEN)
data = task.splits(NUM_NODES, seed=0, alpha=1.0)
global_params = task.init(jax.random.key(0))
trainer = NodeTrainer(task, optax.adam, {"learning_rate": 3e-3}, batch_size=32)
train_state = trainer.init(jax.random.key(1), global_params, NUM_NODES)
train_state, _ = trainer.fit(train_state, data.own(), STEPS)
honest_stack = train_state.params

byzantine = np.zeros(NUM_NODES, bool)
byzantine[:F] = True
test_accuracy = jax.jit(lambda p: task.metrics(p, data.test)["accuracy"])
print("honest nodes' test accuracy:", trainer.evaluate(honest_stack, data.test)["accuracy"].round(2))

# %% [markdown]
# ## The attacks
#
# * `sign_flip`: the Byzantine nodes send `-scale` times the honest mean update;
# * `gaussian`: independent `N(0, std^2)` updates;
# * `alie` ("A Little Is Enough"): `mean - z std` coordinate-wise, small shifts inside the honest
#   spread that median- and Krum-type rules accept;
# * `ipm` (inner-product manipulation): `-epsilon` times the honest mean.
#
# `apply_attack` replaces the Byzantine rows of the stacked tree by `params + attack(updates)`.

# %%
ATTACKS = {
    "none": None,
    "sign_flip": {"scale": 4.0},
    "gaussian": {"std": 1.0},
    "alie": {},
    "ipm": {"epsilon": 2.0},
}


def attack_once(name, key, kwargs):
    # One jitted program per attack (instead of many small eager ones); `byzantine` must stay
    # a concrete numpy mask, so it is closed over rather than passed in.
    def run(key, stacked, params):
        return apply_attack(name, key, stacked, byzantine, params, **kwargs)

    return jax.jit(run)(key, honest_stack, global_params)


attacked = {"none": honest_stack}
for i, (name, kwargs) in enumerate(ATTACKS.items()):
    if kwargs is not None:
        attacked[name] = attack_once(name, jax.random.key(100 + i), kwargs)


# %% [markdown]
# ## The rules
#
# Every rule takes the same stacked tree. Centered clipping needs a radius: we take the median
# norm of the received updates (robust to the `f` attackers). NNM (nearest-neighbour mixing)
# followed by Krum is composed with `consensus.chain`, which keeps the mixing lazy.


# %%
def rules_for(stacked):
    update_norms = np.sqrt(np.asarray(consensus.sq_norms(stacked, global_params)))
    radius = float(np.median(update_norms))
    return {
        "mean": consensus.mean(),
        "median": consensus.median(),
        "trimmed_mean": consensus.trimmed_mean(F),
        "krum": consensus.krum(F),
        "multi_krum": consensus.multi_krum(F),
        "bulyan": consensus.bulyan(F),
        "geometric_median": consensus.geometric_median(),
        "centered_clipping": consensus.centered_clipping(radius, iterations=3),
        "nnm+krum": consensus.chain(consensus.nnm(F), consensus.krum(F)),
    }


RULES = list(rules_for(honest_stack))
accuracy = np.zeros((len(RULES), len(ATTACKS)))
infos = {}
for j, (attack, stacked) in enumerate(attacked.items()):
    for i, (rule, agg) in enumerate(rules_for(stacked).items()):
        merged, agg_state = agg.update(stacked, agg.init(global_params), global_params)
        accuracy[i, j] = float(test_accuracy(merged))
        infos[rule, attack] = consensus.get_info(agg_state)

print(f"{'rule':18s}" + "".join(f"{a:>11s}" for a in ATTACKS))
for i, rule in enumerate(RULES):
    print(f"{rule:18s}" + "".join(f"{v:11.3f}" for v in accuracy[i]))

# %%
fig, ax = plt.subplots(figsize=(8, 5.5))
im = ax.imshow(accuracy, cmap="viridis", vmin=0, vmax=1)
ax.set_xticks(range(len(ATTACKS)), list(ATTACKS), rotation=30)
ax.set_yticks(range(len(RULES)), RULES)
for i in range(len(RULES)):
    for j in range(len(ATTACKS)):
        color = "white" if accuracy[i, j] < 0.5 else "black"
        ax.text(j, i, f"{accuracy[i, j]:.2f}", ha="center", va="center", color=color)
ax.set_title(f"test accuracy of the merged model, n={NUM_NODES}, f={F}")
fig.colorbar(im, ax=ax)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Who was selected?
#
# `get_info` reports the same diagnostics for every rule. Under the sign-flip attack Multi-Krum's
# selection leaves the Byzantine nodes out and the geometric median gives them small weights.
# For NNM + Krum, Krum selects one *mixed* node and `process` pulls the weights back through the
# mixing, so they are each original node's share of the result.

# %%
for rule in ["multi_krum", "geometric_median", "nnm+krum"]:
    info = infos[rule, "sign_flip"]
    print(f"{rule:17s} selected={np.asarray(info.selected).astype(int)}")
    print(f"{'':17s} weights ={np.asarray(info.weights).round(2)}")

# %% [markdown]
# ## Preconditions are checked
#
# Each rule states how many Byzantine nodes it can tolerate (Krum: `n > 2f + 2`, Bulyan:
# `n >= 4f + 3`, trimmed mean: `n > 2f`). Asking for more raises a `ByzantineToleranceError`
# (a `ValueError`) that names the rule, `n`, `f` and what is needed.

# %%
refused = []
for agg in [consensus.bulyan(num_byzantine=4), consensus.krum(num_byzantine=7)]:
    try:
        agg.update(honest_stack, agg.init(global_params), global_params)
    except ValueError as err:
        refused.append(err)
        print(f"{type(err).__name__}: {err}")

# %% [markdown]
# ## Checks
#
# Under the sign-flip attack the plain mean breaks while the robust rules keep a useful model;
# Multi-Krum selects no Byzantine node; both impossible requests were refused.

# %%
col = list(ATTACKS).index("sign_flip")
acc = dict(zip(RULES, accuracy[:, col], strict=True))
clean_mean = accuracy[RULES.index("mean"), list(ATTACKS).index("none")]
robust = ["median", "trimmed_mean", "krum", "multi_krum", "bulyan", "geometric_median", "nnm+krum"]
for rule in robust:
    assert acc[rule] > acc["mean"] + 0.2, (rule, acc[rule], acc["mean"])
assert acc["mean"] < clean_mean - 0.2, (acc["mean"], clean_mean)
assert not np.asarray(infos["multi_krum", "sign_flip"].selected)[:F].any()
assert len(refused) == 2 and all(isinstance(e, consensus.ByzantineToleranceError) for e in refused)
print("all checks passed")
