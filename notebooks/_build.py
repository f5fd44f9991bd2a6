"""Generate the notebooks of meta-consensus from the cell sources in this file.

The notebooks are generated, not edited by hand, so they stay consistent (the same size switch,
the same kernel metadata, no outputs). Rebuilding is idempotent: cell ids are derived from the
notebook name and the cell position, so the same sources give the same bytes.

Usage::

    python notebooks/_build.py            # (re)write every notebook
    python notebooks/_build.py --check    # exit 1 if a notebook differs from its sources
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import textwrap

import nbformat
from nbformat import v4

HERE = pathlib.Path(__file__).resolve().parent

Cell = tuple[str, str]

KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}

# Every notebook's first code cell reads this switch; the test suite sets it to run them all quickly.
SMALL_SWITCH = """\
# META_CONSENSUS_SMALL=1 (set by the test suite) picks small settings so the notebook runs in seconds.
SMALL = os.environ.get("META_CONSENSUS_SMALL") == "1"
"""


def md(text: str) -> Cell:
    return ("markdown", textwrap.dedent(text).strip("\n"))


def code(text: str) -> Cell:
    return ("code", textwrap.dedent(text).strip("\n"))


def setup(text: str, preamble: str = "") -> list[Cell]:
    """The first code cell(s): imports, the size switch, then the notebook's settings.

    ``text`` is the import block followed by the settings. A ``preamble`` (environment that must be
    set before jax is imported) goes with ``import os`` and the switch into a cell of its own, and
    the imports and settings follow in a second cell.
    """
    lines = textwrap.dedent(text).strip("\n").splitlines()
    last_import = max(i for i, line in enumerate(lines) if line.startswith(("import ", "from ")))
    imports = "\n".join(lines[: last_import + 1])
    settings = "\n".join(lines[last_import + 1 :]).strip("\n")
    if preamble:
        first = "import os\n\n" + textwrap.dedent(preamble).strip("\n") + "\n\n" + SMALL_SWITCH
        return [("code", first.rstrip("\n")), ("code", imports + "\n\n" + settings)]
    return [("code", "import os\n\n" + imports + "\n\n" + SMALL_SWITCH + "\n" + settings)]


# ============================================================================ 01 quickstart

QUICKSTART: list[Cell] = [
    md(
        """
        # Quickstart: merge 8 node models in a few lines

        Eight nodes train copies of one small MLP on their own, label-skewed shares of scikit-learn's
        digits. The coordinator receives eight parameter trees and merges them into one consensus tree.
        This notebook shows the coordinator API in miniature:

        * `consensus.stack` turns a list of parameter trees into one *stacked* tree (every leaf gets a
          leading node axis);
        * every rule is an optax-style pair `agg.init(params)` / `agg.update(stacked, state, params)`;
        * `consensus.get_info(state)` reports, for every rule, which nodes were valid, which were
          selected and each node's weight in the result;
        * repeating train-then-merge is federated averaging.
        """
    ),
    *setup(
        """
        import jax
        import jax.numpy as jnp
        import matplotlib.pyplot as plt
        import numpy as np
        import optax

        import consensus
        from strategies import DigitsTask, NodeTrainer

        NUM_NODES = 8
        LOCAL_STEPS = 50  # training steps of every node per round
        ROUNDS = 6 if SMALL else 10
        HIDDEN = (32,) if SMALL else (64,)
        """
    ),
    md(
        """
        ## Eight nodes, each on its own data

        `DigitsTask.splits` gives every node a Dirichlet(0.5) share of the training set, so each node
        sees mostly a few classes. `NodeTrainer` trains all eight copies in one jitted, vmapped step;
        here it only stands in for eight machines.
        """
    ),
    code(
        """
        task = DigitsTask(hidden=HIDDEN)
        data = task.splits(NUM_NODES, seed=0, alpha=0.5)
        print("training examples per node:", data.train_count.tolist())

        global_params = task.init(jax.random.key(0))  # the common starting point
        trainer = NodeTrainer(task, optax.adam, {"learning_rate": 3e-3}, batch_size=32)
        train_state = trainer.init(jax.random.key(1), global_params, NUM_NODES)
        train_state, fit_log = trainer.fit(train_state, data.own(), LOCAL_STEPS)
        node_acc = trainer.evaluate(train_state.params, data.test)["accuracy"]
        print("test accuracy of each node:", node_acc.round(3))
        """
    ),
    md(
        """
        ## Stack the trees

        In a deployment each node sends one ordinary parameter tree. `consensus.unstack` gives us
        those eight trees; `consensus.stack` checks that they have one structure and stacks them.
        """
    ),
    code(
        """
        nodes = consensus.unstack(train_state.params)  # a list of 8 trees, as 8 machines would send them
        stacked = consensus.stack(nodes)
        print(jax.tree.map(jnp.shape, stacked))
        """
    ),
    md(
        """
        ## Merge with three rules

        `mean` is FedAvg's average, `median` the coordinate-wise median and `krum` picks the one node
        whose `n - f - 2` nearest neighbours are closest to it, tolerating `f` Byzantine nodes. The
        rules centre distances on `params` (the current global tree), which keeps them accurate when
        nodes are close.
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## Repeat: federated averaging

        One merge of nodes that drifted towards their own classes is a rough model. Broadcasting the
        merge and training again, round after round, is FedAvg (with `mean`) or a robust variant (with
        `median`). For comparison the nodes also keep training alone on their own data for the same
        number of steps.
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## Checks

        Executing this notebook is a test: the weights are a distribution over the nodes, Krum's merge
        is exactly the one node it selected, and a few rounds of federated averaging give a model better
        than any node trained alone on its skewed share.
        """
    ),
    code(
        """
        for name, info in infos.items():
            assert np.isclose(float(np.sum(info.weights)), 1.0, atol=1e-5), name
        krum_info = infos["krum"]
        assert int(np.sum(krum_info.selected)) == 1
        chosen = int(np.argmax(krum_info.selected))
        for a, b in zip(jax.tree.leaves(merged["krum"]), jax.tree.leaves(nodes[chosen]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        assert round_acc["mean"][-1] > alone_acc.max(), (round_acc["mean"], alone_acc)
        print("all checks passed")
        """
    ),
]

# ============================================================================ 02 byzantine

BYZANTINE: list[Cell] = [
    md(
        """
        # Byzantine attacks and robust aggregation

        One federated round on digits: 15 nodes start from the same global model and train on their own
        data; `f = 3` of them are Byzantine and send whatever hurts most. The attacks of
        `strategies.attacks` are functions of the honest *updates* (omniscient attackers, the standard
        worst case). We compare the test accuracy of the merged model for every rule under every attack,
        and show the error a rule raises when it is asked to tolerate more Byzantine nodes than it can.
        """
    ),
    *setup(
        """
        import jax
        import matplotlib.pyplot as plt
        import numpy as np
        import optax

        import consensus
        from strategies import DigitsTask, NodeTrainer, apply_attack

        NUM_NODES = 15  # Bulyan needs n >= 4 f + 3
        F = 3  # Byzantine nodes
        STEPS = 150 if SMALL else 300
        HIDDEN = (32,) if SMALL else (64,)
        """
    ),
    md(
        """
        ## One honest round

        Every node trains from the global params on its own Dirichlet(1.0) shard. Nodes `0 .. f-1` will
        be replaced by the attackers.
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## The attacks

        * `sign_flip`: the Byzantine nodes send `-scale` times the honest mean update;
        * `gaussian`: independent `N(0, std^2)` updates;
        * `alie` ("A Little Is Enough"): `mean - z std` coordinate-wise, small shifts inside the honest
          spread that median- and Krum-type rules accept;
        * `ipm` (inner-product manipulation): `-epsilon` times the honest mean.

        `apply_attack` replaces the Byzantine rows of the stacked tree by `params + attack(updates)`.
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## The rules

        Every rule takes the same stacked tree. Centered clipping needs a radius: we take the median
        norm of the received updates (robust to the `f` attackers). NNM (nearest-neighbour mixing)
        followed by Krum is composed with `consensus.chain`, which keeps the mixing lazy.
        """
    ),
    code(
        """
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
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## Who was selected?

        `get_info` reports the same diagnostics for every rule. Under the sign-flip attack Multi-Krum's
        selection leaves the Byzantine nodes out and the geometric median gives them small weights.
        For NNM + Krum, Krum selects one *mixed* node and `process` pulls the weights back through the
        mixing, so they are each original node's share of the result.
        """
    ),
    code(
        """
        for rule in ["multi_krum", "geometric_median", "nnm+krum"]:
            info = infos[rule, "sign_flip"]
            print(f"{rule:17s} selected={np.asarray(info.selected).astype(int)}")
            print(f"{'':17s} weights ={np.asarray(info.weights).round(2)}")
        """
    ),
    md(
        """
        ## Preconditions are checked

        Each rule states how many Byzantine nodes it can tolerate (Krum: `n > 2f + 2`, Bulyan:
        `n >= 4f + 3`, trimmed mean: `n > 2f`). Asking for more raises a `ByzantineToleranceError`
        (a `ValueError`) that names the rule, `n`, `f` and what is needed.
        """
    ),
    code(
        """
        refused = []
        for agg in [consensus.bulyan(num_byzantine=4), consensus.krum(num_byzantine=7)]:
            try:
                agg.update(honest_stack, agg.init(global_params), global_params)
            except ValueError as err:
                refused.append(err)
                print(f"{type(err).__name__}: {err}")
        """
    ),
    md(
        """
        ## Checks

        Under the sign-flip attack the plain mean breaks while the robust rules keep a useful model;
        Multi-Krum selects no Byzantine node; both impossible requests were refused.
        """
    ),
    code(
        """
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
        """
    ),
]

# ============================================================================ 03 convex weights

CONVEX: list[Cell] = [
    md(
        """
        # Convex merge weights

        Averaging every node uniformly is a poor merge when nodes differ: some saw other classes, one may
        have bad data. `consensus.convex` picks merge weights `w` on the (capped) simplex by solving a
        small convex problem with cvxpy, from statistics the coordinator can afford (n x n Gram matrices,
        the nodes' predictions on a held-out set):

        * `mixture_nll_weights`: the held-out negative log-likelihood of the *mixture* of the nodes'
          predictions (stacking; convex in `w`);
        * `quadratic_weights` / `trust_region_quadratic_weights`: a quadratic model of the held-out loss
          of the *merged parameters* (gradient and Gauss-Newton curvature at the uniform merge);
        * `anchor_weights`: the merge closest to a robust anchor (here the coordinate-wise median).

        `max_weight` caps every node's weight, so no single node can take over the merge. The nodes
        here have Dirichlet(0.3) label skew, and node 7 trains on flipped labels in every round (a
        broken data pipeline).
        """
    ),
    *setup(
        """
        import jax
        import jax.numpy as jnp
        import matplotlib.pyplot as plt
        import numpy as np
        import optax

        import consensus
        from strategies import DigitsTask, NodeTrainer

        NUM_NODES = 8
        ALPHA = 0.3  # Dirichlet concentration: small = strong label skew
        CAP = 0.3  # max_weight: no node gets more than 30% of the merge
        ROUNDS = 4  # federated rounds; the last round's nodes are the ones we weigh
        STEPS = 50  # local steps per round
        HIDDEN = (32,) if SMALL else (64,)
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## Statistics on the held-out set

        After a few rounds of plain federated averaging, the nodes of the last round are fine-tunes of
        one shared, partly trained model: the regime where weighing them pays off. The held-out split
        selects the weights; the test split is only used for the final numbers.
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## Three convex objectives

        `softmax_gauss_newton` gives the held-out loss, its gradient and the diagonal Gauss-Newton
        curvature at a reference point (the uniform merge); it takes the logits of *one* example.
        The trust-region variant evaluates the true held-out loss of the proposed merge and falls back
        towards uniform when the quadratic model over-promises, so it is never worse than uniform on
        the held-out set.
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## Merged models and the stacked ensemble

        Each weight vector merges the parameters (one model). The mixture weights are, strictly, the
        best weights for an *ensemble* of the nodes' predictions, so that is reported too.
        """
    ),
    code(
        """
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
        print(f"\\nensemble of the nodes' predictions, held-out NLL: uniform weights {ens_uniform:.3f}")
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
        """
    ),
    md(
        """
        ## Infeasible caps are refused

        The weights sum to 1, so a cap below `1 / n` leaves no feasible point. The solver is never
        called: a `ValueError` says which cap would work.
        """
    ),
    code(
        """
        try:
            consensus.mixture_nll_weights(probs, max_weight=0.1)
            infeasible_error = None
        except ValueError as err:
            infeasible_error = err
            print(f"ValueError: {err}")
        """
    ),
    md(
        """
        ## Checks

        Guarantees, not luck: the trust-region merge is never worse than uniform on the held-out set,
        the mixture weights minimize the ensemble NLL over a set that contains the uniform weights, every
        weight vector respects the cap, and the flipped-label node is (almost) switched off.
        """
    ),
    code(
        """
        assert table["quadratic (trust region)"][0] <= table["uniform"][0] + 1e-6
        assert ens_mixture <= ens_uniform + 1e-9
        for name, res in results.items():
            assert not res.fallback, (name, res.message)
            assert abs(res.weights.sum() - 1.0) < 1e-6 and res.weights.max() <= CAP + 1e-6, name
        assert results["mixture NLL"].weights[bad_node] < 0.5 / NUM_NODES
        assert infeasible_error is not None and "1/8" in str(infeasible_error)
        print("all checks passed")
        """
    ),
]

# ============================================================================ 04 DP-FedAvg

DP_FEDAVG: list[Cell] = [
    md(
        """
        # DP-FedAvg and privacy accounting

        Differentially private federated averaging (McMahan et al. 2018): every round, each sampled node's
        update is clipped to L2 norm `C`, the clipped updates are summed over a *fixed* denominator `m`
        and Gaussian noise of std `z C / m` is added. `consensus.privacy` turns the noise multiplier `z`,
        the sampling rate `q` and the number of rounds into an `(epsilon, delta)` guarantee with two
        accountants (RDP and the tighter PLD), calibrates `z` for a target epsilon, and keeps a ledger
        that refuses a round that would exceed the budget. Adaptive clipping (Andrew et al. 2021) tunes
        `C` to a quantile of the update norms without spending extra privacy.
        """
    ),
    *setup(
        """
        import jax
        import matplotlib.pyplot as plt
        import numpy as np
        import optax

        import consensus
        from consensus import privacy
        from strategies import DigitsTask, NodeTrainer, Schedule

        DELTA = 1e-5
        MAX_ROUNDS = 500 if SMALL else 3000  # accounting curves
        POINTS = 6 if SMALL else 12
        PLD_GRID = 1e-3 if SMALL else 1e-4  # PLD discretization: smaller is tighter and slower
        """
    ),
    md(
        """
        ## Epsilon over rounds: RDP vs PLD

        Both accountants bound the same mechanism (the Poisson-subsampled Gaussian). RDP is a fast
        closed form; PLD composes the privacy loss distributions numerically and is tighter.
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## Calibrating the noise for a target epsilon

        `calibrate_noise` returns the smallest `z` (to a relative tolerance) whose epsilon after the
        given rounds is at most the target. The tighter PLD accountant needs less noise.
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## DP-FedAvg on digits

        64 nodes hold a few dozen digits each; the model is softmax regression (650 parameters). Every
        round each node is Poisson-sampled with probability `q = 0.5` (so `m = 32`):
        `round_participants` draws the sample from the aggregator's state, the sampled nodes train a
        few local SGD steps from the global params (a `Schedule` keeps the others idle), and
        `dp_fedavg` merges their clipped updates with noise, drawing the same sample. Before a round
        runs, the ledger `spend`s its privacy event; it raises `PrivacyBudgetExceeded` (and records
        nothing) when the round would go over budget.

        With so few nodes the guarantee is weak (epsilon in the tens would be needed for many rounds);
        real deployments have thousands of nodes per round, which divides the noise by `m`.
        """
    ),
    code(
        """
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
            \"\"\"Federated rounds until max_rounds or until the ledger refuses one; returns a trace.\"\"\"
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
        """
    ),
    md(
        """
        ## Adaptive clipping

        A fixed `C` is a guess. With `AdaptiveClipConfig(target_quantile=0.5)` each node also reports
        (privately) whether its update was clipped, and `C <- C exp(-lr (unclipped_fraction - 0.5))`
        moves `C` towards the median update norm. We start from a far too small `C` and let it adapt.
        The accountant still sees noise multiplier `z`: the count and the sum share the noise budget.
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## Checks

        PLD is never looser than RDP; the calibrated noise meets its target; the ledger stopped at the
        budget without exceeding it, and one more round would have; the private model learned; and
        adaptive clipping moved `C` towards the median update norm.
        """
    ),
    code(
        """
        assert np.all(eps_pld <= eps_rdp * (1 + 1e-6)) and np.all(np.diff(eps_rdp) > 0)
        assert all(eps_at[acc] <= TARGET_EPS * (1 + 1e-9) for acc in eps_at) and z_cal["pld"] < z_cal["rdp"]
        assert ledger.epsilon() <= BUDGET < ledger.epsilon_after(consensus.privacy_event(dp_state))
        assert ledger.rounds == len(dp_trace["accuracy"]) >= 2
        assert dp_trace["accuracy"][-1] > 0.5, dp_trace["accuracy"]  # chance is 0.1
        start_gap = abs(np.log(ada_trace["clip_norm"][0] / ada_trace["median_norm"][0]))
        end_gap = abs(np.log(ada_trace["clip_norm"][-1] / ada_trace["median_norm"][-1]))
        assert end_gap < 0.5 * start_gap, (start_gap, end_gap)
        print("all checks passed")
        """
    ),
]

# ============================================================================ 05 soups

SOUPS: list[Cell] = [
    md(
        """
        # Model soups

        A *soup* averages the weights of several fine-tunes of one model (Wortsman et al. 2022). Here a
        node fine-tunes one pre-trained digits MLP eight times with different learning rates (one
        `NodeTrainer` call: per-node hyperparameters are plain arrays) and merges the results:

        * the **uniform soup** averages all of them;
        * the **greedy soup** (`strategies.greedy_soup`) sorts them by held-out accuracy and adds each
          one only if the soup does not get worse, so it is never worse than the best ingredient;
        * `IncrementalSoup` takes ingredients one at a time as they arrive (from memory or orbax
          checkpoints), in `uniform`, `weighted` or `greedy` mode, holding one merged tree.
        """
    ),
    *setup(
        """
        import jax
        import matplotlib.pyplot as plt
        import numpy as np
        import optax

        import consensus
        from strategies import DigitsTask, IncrementalSoup, NodeTrainer, greedy_soup

        NUM_INGREDIENTS = 8
        STEPS = 150 if SMALL else 400
        HIDDEN = (32,) if SMALL else (64,)
        LEARNING_RATES = np.array([1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1], np.float32)
        """
    ),
    md(
        """
        ## Pre-train, then fine-tune with eight learning rates

        Every ingredient draws from the whole training pool (`data.everything()`). The same compiled
        step serves the pre-training and the fine-tunes: only the hyperparameter values change.
        """
    ),
    code(
        """
        task = DigitsTask(hidden=HIDDEN)
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
        """
    ),
    md(
        """
        ## Soups

        The soups score candidates with `evaluate(params)` on the held-out split (a dict of metrics;
        `metric="accuracy"` picks one and says that higher is better). The test split is only for the
        final comparison.
        """
    ),
    code(
        """
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
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## Checks

        The greedy soup is never worse than its best ingredient on the held-out split (by
        construction), the incremental uniform soup is exactly the mean of the ingredients (checked
        against a float64 numpy mean), and the diverged fine-tune is kept out of the greedy soup.
        """
    ),
    code(
        """
        assert greedy.score >= held_acc.max() - 1e-6
        per_leaf = zip(*map(jax.tree.leaves, ingredients), strict=True)  # the k values of each leaf
        for got, leaves in zip(jax.tree.leaves(uni_state.params), per_leaf, strict=True):
            want = np.mean([np.asarray(x, np.float64) for x in leaves], axis=0)
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-6)
        worst = int(np.argmin(held_acc))
        assert worst not in greedy.kept and worst not in inc_state.kept
        assert results["greedy soup"] >= results["uniform soup"]
        print("all checks passed")
        """
    ),
]

# ============================================================================ 06 meshes

MESHES: list[Cell] = [
    md(
        """
        # Meshes and multi-host

        The coordinator's stacked trees and the node trainer run on a device mesh with axes
        `("node", "data", "model")`: nodes are split over `"node"`, a node's batch over `"data"` and its
        model dimensions over `"model"` (tensor parallel), following the model's logical axis names.
        This notebook simulates 8 CPU devices, places a stacked tree on the mesh, checks that a sharded
        aggregation equals the unsharded one, trains nodes on the mesh, and explains how the same code
        runs across several hosts.
        """
    ),
    *setup(
        """
        import jax
        import matplotlib.pyplot as plt
        import numpy as np
        import optax

        import consensus
        from strategies import DigitsTask, NodeTrainer

        # The flag above only works before jax's first import; restart the kernel if this fails.
        assert jax.device_count() == 8, jax.devices()
        NUM_NODES = 8
        STEPS = 100 if SMALL else 300
        HIDDEN = (32,) if SMALL else (64,)
        """,
        preamble="""
        # Simulate 8 CPU devices. Must run before jax is imported (other XLA flags are kept).
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"
        """,
    ),
    md(
        """
        ## A mesh

        `MeshConfig(node=4, model=2)`: 4 groups of 2 devices; each group hosts 2 of the 8 nodes and
        splits every node's hidden layer in two.
        """
    ),
    code(
        """
        config = consensus.MeshConfig(node=4, model=2)
        mesh = consensus.make_mesh(config)
        print(mesh)
        print("logical axis rules:", config.resolved_rules)
        """
    ),
    md(
        """
        ## Placing a stacked tree on the "node" axis

        We train 8 nodes without a mesh (the reference), then place the stacked params with
        `consensus.stacked_sharding`: every leaf gets `P("node", *its own spec)` from the task's logical
        axis names (`"mlp"` -> `"model"`; `"embed"` and `"classes"` replicated).
        """
    ),
    code(
        """
        task = DigitsTask(hidden=HIDDEN)
        data = task.splits(NUM_NODES, seed=0, alpha=0.5)
        global_params = task.init(jax.random.key(0))
        trainer = NodeTrainer(task, optax.adam, {"learning_rate": 3e-3}, batch_size=32)
        ref_state = trainer.init(jax.random.key(1), global_params, NUM_NODES)
        ref_state, _ = trainer.fit(ref_state, data.own(), STEPS)
        host_stack = jax.device_get(ref_state.params)  # numpy arrays on the host

        logical = task.logical_axes()
        shardings = consensus.stacked_sharding(host_stack, logical, mesh, config)
        placed = jax.device_put(host_stack, shardings)
        # The global params: replicated over "node", split over "model" like one node's params.
        global_sharding = consensus.mesh.param_sharding(global_params, logical, mesh, config)
        global_placed = jax.device_put(global_params, global_sharding)
        for path, leaf in jax.tree_util.tree_leaves_with_path(placed):
            print(f"{jax.tree_util.keystr(path):24s} {str(leaf.shape):14s} {leaf.sharding.spec}")
        """
    ),
    code(
        """
        # Which device holds which (node, hidden unit) block of the first layer's kernel?
        kernel = placed["dense_0"]["kernel"]  # (node, 64 inputs, hidden)
        owner = np.zeros((kernel.shape[0], kernel.shape[2]), int)
        for shard in kernel.addressable_shards:
            nodes, _, units = shard.index
            owner[nodes, units] = shard.device.id
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.imshow(owner, cmap="tab10", vmin=0, vmax=9, aspect="auto", interpolation="nearest")
        for shard in kernel.addressable_shards:
            nodes, _, units = shard.index
            centre = ((units.start + units.stop - 1) / 2, (nodes.start + nodes.stop - 1) / 2)
            ax.text(*centre, f"device {shard.device.id}", ha="center", va="center", color="white")
        ax.set(
            xlabel="hidden unit (split over 'model')",
            ylabel="node (split over 'node')",
            title="device holding each block of dense_0/kernel",
        )
        plt.show()
        """
    ),
    md(
        """
        ## Aggregating a sharded stack

        A rule's `update` runs under `jax.jit` on the sharded stack as it is, and XLA's partitioner adds
        the communication: a coordinate-wise rule (median) needs all `n` values of a coordinate on one
        device, a Gram rule (Krum) only needs the `n x n` Gram matrix summed across devices. The result
        must equal the same rule on one device.
        """
    ),
    code(
        """
        def merged_by(agg):
            return jax.jit(lambda stacked, params: agg.update(stacked, agg.init(params), params)[0])


        one_device = jax.devices()[0]
        max_diff = {}
        for name, agg in {"median": consensus.median(), "krum": consensus.krum(num_byzantine=2)}.items():
            run = merged_by(agg)
            sharded = run(placed, global_placed)
            unsharded = run(jax.device_put(host_stack, one_device), jax.device_put(global_params, one_device))
            max_diff[name] = max(
                float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(unsharded), strict=True)
            )
            print(
                f"{name:6s} max |sharded - unsharded| = {max_diff[name]:.2e}; "
                f"output dense_0/kernel sharding {sharded['dense_0']['kernel'].sharding.spec}"
            )
        """
    ),
    md(
        """
        ## NodeTrainer on a mesh

        Give the trainer the `MeshConfig` and it places the stacked params, optimizer state, keys and
        per-node data on the mesh; XLA partitions the same program. With the same keys it reproduces the
        reference run up to float32 rounding.
        """
    ),
    code(
        """
        mesh_trainer = NodeTrainer(task, optax.adam, {"learning_rate": 3e-3}, batch_size=32, mesh=config)
        mesh_state = mesh_trainer.init(jax.random.key(1), global_params, NUM_NODES)
        mesh_state, _ = mesh_trainer.fit(mesh_state, data.own(), STEPS)
        train_diff = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(mesh_state.params), jax.tree.leaves(host_stack), strict=True)
        )
        print("trained params sharding:", jax.tree.map(lambda x: x.sharding.spec, mesh_state.params))
        print(f"max |mesh - reference| = {train_diff:.2e}")
        mesh_acc = mesh_trainer.evaluate(mesh_state.params, data.test)["accuracy"]
        print("test accuracy per node:", mesh_acc.round(3))
        """
    ),
    md(
        """
        ## Multi-host

        Across machines the code above stays the same; only the start-up and the data loading change.
        Every process runs the same script:

        ```python
        import jax
        jax.distributed.initialize(coordinator_address="host0:1234", num_processes=P, process_id=p)
        # on CPU clusters: jax.config.update("jax_cpu_collectives_implementation", "gloo") first

        config = consensus.MeshConfig(node=jax.device_count() // model, model=model)
        mesh = consensus.make_mesh(config)  # over every process's devices, process by process
        data = task.splits(num_nodes, seed=0, process_index=jax.process_index(),
                           process_count=jax.process_count())  # only this process's nodes
        trainer = NodeTrainer(task, optax.adam, {"learning_rate": 3e-3}, mesh=config)
        state = trainer.init(jax.random.key(0), params, num_nodes)  # num_nodes over all processes
        state, log = trainer.fit(state, data.own(), steps)
        ```

        * The mesh is built over `jax.devices()`, so the `"node"` axis is split into contiguous blocks,
          one per process; `task.splits(..., process_index=p, process_count=P)` returns exactly the
          shards of the nodes process `p` hosts (a contiguous block of node ids), never another
          process's examples.
        * `NodeTrainer` assembles global arrays from each process's block
          (`jax.make_array_from_process_local_data`); every process passes the *same* key and initial
          params.
        * Gathering (`consensus.mesh.to_host`) is collective: every process calls it; only process 0
          should log and write files. Orbax checkpoints are written collectively.

        `tests/strategies/test_multihost.py` launches two such processes on one machine (4 simulated
        CPU devices each, gloo collectives, `tests/strategies/multihost_worker.py`) and checks that
        their shards are disjoint and that the trained params equal a single-process run on 8 devices.
        A notebook is one process, so it does not launch them.
        """
    ),
    md(
        """
        ## Checks
        """
    ),
    code(
        """
        assert max(max_diff.values()) < 1e-5, max_diff
        assert train_diff < 1e-4, train_diff
        assert mesh_state.params["dense_0"]["kernel"].sharding.spec == shardings["dense_0"]["kernel"].spec
        assert len(np.unique(owner)) == 8  # every device holds a block
        print("all checks passed")
        """
    ),
]

NOTEBOOKS: dict[str, list[Cell]] = {
    "01_quickstart": QUICKSTART,
    "02_byzantine": BYZANTINE,
    "03_convex_weights": CONVEX,
    "04_dp_fedavg": DP_FEDAVG,
    "05_soups": SOUPS,
    "06_meshes": MESHES,
}


# ============================================================================ build


def build(stem: str, cells: list[Cell]) -> nbformat.NotebookNode:
    """A v4 notebook with deterministic cell ids, python3 kernel metadata and no outputs."""
    nb = v4.new_notebook()
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}}
    for i, (kind, source) in enumerate(cells):
        cell = v4.new_markdown_cell(source) if kind == "markdown" else v4.new_code_cell(source)
        cell.id = f"{stem.replace('_', '-')}-{i:02d}"  # new_*_cell draws random ids; fix them
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(stem: str) -> str:
    """The exact file contents of notebook ``stem``."""
    return nbformat.writes(build(stem, NOTEBOOKS[stem])) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if a notebook is stale")
    args = ap.parse_args(argv)
    stale = []
    for stem in NOTEBOOKS:
        path = HERE / f"{stem}.ipynb"
        text = render(stem)
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path.name)
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print("stale notebooks (run python notebooks/_build.py):", ", ".join(stale))
        return 1
    print(("stale: " if args.check else "written: ") + (", ".join(stale) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
