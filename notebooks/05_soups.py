# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Model soups
#
# A *soup* averages the weights of several fine-tunes of one model (Wortsman et al. 2022). Here a
# node fine-tunes one pre-trained digits MLP eight times with different learning rates (one
# `NodeTrainer` call: per-node hyperparameters are plain arrays) and merges the results:
#
# * the **uniform soup** averages all of them;
# * the **greedy soup** (`strategies.greedy_soup`) sorts them by held-out accuracy and adds each
#   one only if the soup does not get worse, so it is never worse than the best ingredient;
# * `IncrementalSoup` takes ingredients one at a time as they arrive (from memory or orbax
#   checkpoints), in `uniform`, `weighted` or `greedy` mode, holding one merged tree.

# %%
import os

import jax
import matplotlib.pyplot as plt
import numpy as np
import optax

import consensus
from strategies import DigitsTask, IncrementalSoup, NodeTrainer, greedy_soup

# META_CONSENSUS_SMALL=1 (set by the test suite) picks small settings so the notebook runs in seconds.
SMALL = os.environ.get("META_CONSENSUS_SMALL") == "1"

NUM_INGREDIENTS = 8
STEPS = 150 if SMALL else 400
HIDDEN = (32,) if SMALL else (64,)
LEARNING_RATES = np.array([1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1], np.float32)

# %% [markdown]
# ## Pre-train, then fine-tune with eight learning rates
#
# Every ingredient draws from the whole training pool (`data.everything()`: with
# `general_pool="union"` and no public pool apart, the general pool is every training row). The
# same compiled step serves the pre-training and the fine-tunes: only the hyperparameter values
# change.

# %%
task = DigitsTask(hidden=HIDDEN, public_fraction=0.0, general_pool="union")
data = task.splits(NUM_INGREDIENTS, seed=0)
pool = data.everything()
trainer = NodeTrainer(task, optax.adamw, {"learning_rate": 1e-3, "weight_decay": 1e-4}, batch_size=32)

pre = trainer.init(jax.random.key(0), task.init(jax.random.key(1)), NUM_INGREDIENTS)
pre, _ = trainer.fit(pre, pool, STEPS)
# Every slot pre-trained (that reuses the one compiled step); keep the first as the common init.
pretrained = jax.tree.map(lambda x: x[0], pre.params)

fine = trainer.init(jax.random.key(2), pretrained, NUM_INGREDIENTS)
fine, _ = trainer.fit(fine, pool, STEPS, hyperparams={"learning_rate": LEARNING_RATES})
ingredients = consensus.unstack(fine.params)

held_acc = trainer.evaluate(fine.params, data.heldout)["accuracy"]
test_acc = trainer.evaluate(fine.params, data.test)["accuracy"]
for lr, h, t in zip(LEARNING_RATES, held_acc, test_acc, strict=True):
    print(f"lr={lr:7.0e}  held-out acc {h:.3f}  test acc {t:.3f}")

# %% [markdown]
# ## Soups
#
# The soups score candidates with `evaluate(params)` on the held-out split (a dict of metrics;
# `metric="accuracy"` picks one and says that higher is better). The test split is only for the
# final comparison.

# %%
metrics = jax.jit(task.metrics)


def evaluate(params):
    return metrics(params, data.heldout)


def test_accuracy(params):
    return float(metrics(params, data.test)["accuracy"])


names = [f"lr={lr:.0e}" for lr in LEARNING_RATES]
greedy = greedy_soup(ingredients, evaluate, metric="accuracy", scores=list(held_acc), names=names)

incremental_greedy = IncrementalSoup("greedy", evaluate=evaluate, metric="accuracy")
inc_state = incremental_greedy.init()
# uniform mode needs no evaluate; given one, it records the soup's score after every arrival
incremental_uniform = IncrementalSoup("uniform", evaluate=evaluate, metric="accuracy")
uni_state = incremental_uniform.init()
for name, params in zip(names, ingredients, strict=True):  # ingredients arriving one at a time
    inc_state = incremental_greedy.add(inc_state, params, name=name)
    uni_state = incremental_uniform.add(uni_state, params, name=name)

best = int(np.argmax(held_acc))
results = {
    f"best ingredient ({names[best]})": test_accuracy(ingredients[best]),
    "uniform soup": test_accuracy(uni_state.params),
    "greedy soup": test_accuracy(greedy.params),
    "incremental greedy": test_accuracy(inc_state.params),
}
for name, acc in results.items():
    print(f"{name:28s} test accuracy {acc:.3f}")
print("greedy soup kept:", [names[i] for i in greedy.kept])
print("incremental greedy kept:", [names[i] for i in inc_state.kept])
for event in inc_state.events:
    print(f"  {event.name:8s} {event.reason:10s} soup held-out acc {event.soup_score:.3f}")

# %%
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.5))
ax0.semilogx(LEARNING_RATES, test_acc, "o-", color="gray", label="ingredient")
for (name, acc), color in zip(list(results.items())[1:], ["C0", "C1", "C2"], strict=True):
    ax0.axhline(acc, color=color, label=name)
ax0.set(xlabel="fine-tuning learning rate", ylabel="test accuracy", title="ingredients vs soups")
ax0.legend(fontsize=8)
ax1.plot(inc_state.trajectory, "o-", label="incremental greedy")
ax1.plot(uni_state.trajectory, "s-", label="incremental uniform")
ax1.set_xticks(range(NUM_INGREDIENTS), names, rotation=45)
ax1.set(ylabel="held-out accuracy of the soup", title="soup after each arrival")
ax1.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Checks
#
# The greedy soup is never worse than its best ingredient on the held-out split (by
# construction), the incremental uniform soup is exactly the mean of the ingredients (checked
# against a float64 numpy mean), and the diverged fine-tune is kept out of the greedy soup.

# %%
assert greedy.score >= held_acc.max() - 1e-6
per_leaf = zip(*map(jax.tree.leaves, ingredients), strict=True)  # the k values of each leaf
for got, leaves in zip(jax.tree.leaves(uni_state.params), per_leaf, strict=True):
    want = np.mean([np.asarray(x, np.float64) for x in leaves], axis=0)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-6)
worst = int(np.argmin(held_acc))
assert worst not in greedy.kept and worst not in inc_state.kept
assert results["greedy soup"] >= results["uniform soup"]
print("all checks passed")
