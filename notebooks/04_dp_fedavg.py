# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # DP-FedAvg and privacy accounting
#
# Differentially private federated averaging (McMahan et al. 2018): every round, each sampled node's
# update is clipped to L2 norm `C`, the clipped updates are summed over a *fixed* denominator `m`
# and Gaussian noise of std `z C / m` is added. `consensus.privacy` turns the noise multiplier `z`,
# the sampling rate `q` and the number of rounds into an `(epsilon, delta)` guarantee with two
# accountants (RDP and the tighter PLD), calibrates `z` for a target epsilon, and keeps a ledger
# that refuses a round that would exceed the budget. Adaptive clipping (Andrew et al. 2021) tunes
# `C` to a quantile of the update norms without spending extra privacy.

# %%
import os

import jax
import matplotlib.pyplot as plt
import numpy as np
import optax

import consensus
from consensus import privacy
from strategies import DigitsTask, NodeTrainer, Schedule

# META_CONSENSUS_SMALL=1 (set by the test suite) picks small settings so the notebook runs in seconds.
SMALL = os.environ.get("META_CONSENSUS_SMALL") == "1"

DELTA = 1e-5
MAX_ROUNDS = 500 if SMALL else 3000  # accounting curves
POINTS = 6 if SMALL else 12
PLD_GRID = 1e-3 if SMALL else 1e-4  # PLD discretization: smaller is tighter and slower

# %% [markdown]
# ## Epsilon over rounds: RDP vs PLD
#
# Both accountants bound the same mechanism (the Poisson-subsampled Gaussian). RDP is a fast
# closed form; PLD composes the privacy loss distributions numerically and is tighter.

# %%
Q_ACC, Z_ACC = 0.01, 1.0
rounds = np.unique(np.geomspace(1, MAX_ROUNDS, POINTS).astype(int))
eps_rdp = np.array([privacy.rdp_epsilon(Z_ACC, Q_ACC, int(t), DELTA) for t in rounds])
eps_pld = np.array([privacy.pld_epsilon(Z_ACC, Q_ACC, int(t), DELTA, PLD_GRID) for t in rounds])
for t, a, b in zip(rounds, eps_rdp, eps_pld, strict=True):
    print(f"rounds {t:5d}: RDP eps {a:7.3f}   PLD eps {b:7.3f}")

fig, ax = plt.subplots(figsize=(6, 4))
ax.loglog(rounds, eps_rdp, "o-", label="RDP")
ax.loglog(rounds, eps_pld, "s-", label="PLD")
ax.set(xlabel="rounds", ylabel=f"epsilon at delta={DELTA:g}", title=f"q={Q_ACC}, z={Z_ACC}")
ax.legend()
plt.show()

# %% [markdown]
# ## Calibrating the noise for a target epsilon
#
# `calibrate_noise` returns the smallest `z` (to a relative tolerance) whose epsilon after the
# given rounds is at most the target. The tighter PLD accountant needs less noise.

# %%
TARGET_EPS, CAL_ROUNDS = 2.0, 1000
z_cal = {
    acc: consensus.calibrate_noise(TARGET_EPS, DELTA, Q_ACC, CAL_ROUNDS, acc, discretization=PLD_GRID)
    for acc in ("rdp", "pld")
}
eps_at = {
    "rdp": privacy.rdp_epsilon(z_cal["rdp"], Q_ACC, CAL_ROUNDS, DELTA),
    "pld": privacy.pld_epsilon(z_cal["pld"], Q_ACC, CAL_ROUNDS, DELTA, PLD_GRID),
}
for acc in z_cal:
    print(f"{acc}: z = {z_cal[acc]:.4f} gives epsilon {eps_at[acc]:.4f} after {CAL_ROUNDS} rounds")

# %% [markdown]
# ## DP-FedAvg on digits
#
# 64 nodes hold a few dozen digits each; the model is softmax regression (650 parameters). Every
# round each node is Poisson-sampled with probability `q = 0.5` (so `m = 32`):
# `round_participants` draws the sample from the aggregator's state, the sampled nodes train a
# few local SGD steps from the global params (a `Schedule` keeps the others idle), and
# `dp_fedavg` merges their clipped updates with noise, drawing the same sample. Before a round
# runs, the ledger `spend`s its privacy event; it raises `PrivacyBudgetExceeded` (and records
# nothing) when the round would go over budget.
#
# With so few nodes the guarantee is weak (epsilon in the tens would be needed for many rounds);
# real deployments have thousands of nodes per round, which divides the noise by `m`.

# %%
NUM_NODES, Q, Z, CLIP = 64, 0.5, 1.0, 0.5
LOCAL_STEPS = 20
BUDGET = 12.0  # rounds are cheap once compiled, so SMALL keeps the same federated settings

task = DigitsTask(hidden=())  # softmax regression
data = task.splits(NUM_NODES, seed=0, alpha=1.0)
own = data.own()
init_params = task.init(jax.random.key(0))
trainer = NodeTrainer(task, optax.sgd, {"learning_rate": 0.1}, batch_size=16)
test_accuracy = jax.jit(lambda p: task.metrics(p, data.test)["accuracy"])


def run(agg, max_rounds, ledger):
    """Federated rounds until max_rounds or until the ledger refuses one; returns a trace."""
    params, agg_state = init_params, agg.init(init_params)
    trace = {"accuracy": [], "clip_norm": [], "median_norm": [], "epsilon": []}
    for r in range(max_rounds):
        try:
            trace["epsilon"].append(ledger.spend(consensus.privacy_event(agg_state)))
        except consensus.PrivacyBudgetExceeded as err:
            print(f"round {r}: {err}")
            break
        sampled = np.asarray(consensus.round_participants(agg_state, NUM_NODES))
        idle_others = Schedule(
            level=np.zeros((NUM_NODES, LOCAL_STEPS), np.int32),
            active=np.repeat(sampled[:, None], LOCAL_STEPS, axis=1),
        )
        local = trainer.init(jax.random.fold_in(jax.random.key(1), r), params, NUM_NODES)
        local, _ = trainer.fit(local, own, LOCAL_STEPS, schedule=idle_others)
        trace["clip_norm"].append(float(agg_state.clip_norm))
        params, agg_state = agg.update(local.params, agg_state, params)
        took_part = np.asarray(agg_state.info.valid)
        assert (took_part == sampled).all()  # update drew the same Poisson sample
        trace["median_norm"].append(float(np.median(np.asarray(agg_state.dp.norms)[took_part])))
        trace["accuracy"].append(float(test_accuracy(params)))
    return params, agg_state, {k: np.asarray(v) for k, v in trace.items()}


ledger = privacy.PrivacyLedger(DELTA, budget=BUDGET, accountant="rdp")
dp_agg = consensus.dp_fedavg(CLIP, Z, sampling_rate=Q, key=0)
dp_params, dp_state, dp_trace = run(dp_agg, max_rounds=100, ledger=ledger)
print(f"ran {ledger.rounds} rounds, epsilon spent {ledger.epsilon():.3f} <= budget {BUDGET}")
print("test accuracy per round:", dp_trace["accuracy"].round(3))

# %% [markdown]
# ## Adaptive clipping
#
# A fixed `C` is a guess. With `AdaptiveClipConfig(target_quantile=0.5)` each node also reports
# (privately) whether its update was clipped, and `C <- C exp(-lr (unclipped_fraction - 0.5))`
# moves `C` towards the median update norm. We start from a far too small `C` and let it adapt.
# The accountant still sees noise multiplier `z`: the count and the sum share the noise budget.

# %%
ADAPTIVE_ROUNDS = 15 if SMALL else 25
adaptive = consensus.AdaptiveClipConfig(target_quantile=0.5, learning_rate=0.5)
ada_agg = consensus.dp_fedavg(0.05, Z, sampling_rate=Q, adaptive=adaptive, key=1)
pld_ledger = privacy.PrivacyLedger(DELTA, accountant="pld", discretization=PLD_GRID)  # no budget
ada_params, ada_state, ada_trace = run(ada_agg, max_rounds=ADAPTIVE_ROUNDS, ledger=pld_ledger)
print(
    f"epsilon after {pld_ledger.rounds} rounds: PLD {pld_ledger.epsilon():.3f}, "
    f"RDP {privacy.rdp_epsilon(Z, Q, pld_ledger.rounds, DELTA):.3f}"
)

fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(15, 3.5))
ax0.plot(dp_trace["accuracy"], "o-", label=f"fixed C={CLIP}")
ax0.plot(ada_trace["accuracy"], "s-", label="adaptive C")
ax0.set(xlabel="round", ylabel="test accuracy", title="DP-FedAvg on digits")
ax0.legend()
ax1.plot(dp_trace["epsilon"], "o-", label="fixed C, RDP ledger")
ax1.plot(ada_trace["epsilon"], "s-", label="adaptive C, PLD ledger")
ax1.axhline(BUDGET, color="gray", linestyle="--", label="budget of the RDP ledger")
ax1.set(xlabel="round", ylabel=f"epsilon spent (delta={DELTA:g})", title="privacy ledgers")
ax1.legend()
ax2.semilogy(ada_trace["clip_norm"], "o-", label="clip norm C")
ax2.semilogy(ada_trace["median_norm"], "k--", label="median update norm")
ax2.set(xlabel="round", ylabel="L2 norm", title="adaptive clipping (target quantile 0.5)")
ax2.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Checks
#
# PLD is never looser than RDP; the calibrated noise meets its target; the ledger stopped at the
# budget without exceeding it, and one more round would have; the private model learned; and
# adaptive clipping moved `C` towards the median update norm.

# %%
assert np.all(eps_pld <= eps_rdp * (1 + 1e-6)) and np.all(np.diff(eps_rdp) > 0)
assert all(eps_at[acc] <= TARGET_EPS * (1 + 1e-9) for acc in eps_at) and z_cal["pld"] < z_cal["rdp"]
assert ledger.epsilon() <= BUDGET < ledger.epsilon_after(consensus.privacy_event(dp_state))
assert ledger.rounds == len(dp_trace["accuracy"]) >= 2
assert dp_trace["accuracy"][-1] > 0.5, dp_trace["accuracy"]  # chance is 0.1
start_gap = abs(np.log(ada_trace["clip_norm"][0] / ada_trace["median_norm"][0]))
end_gap = abs(np.log(ada_trace["clip_norm"][-1] / ada_trace["median_norm"][-1]))
assert end_gap < 0.5 * start_gap, (start_gap, end_gap)
print("all checks passed")
