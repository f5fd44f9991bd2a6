"""Fashion-MNIST FedAvg benchmark: clean FedAvg over 16 nodes at Dirichlet alpha = 1 vs one central model.

Every round each node starts from the consensus, runs ``local_steps`` Adam steps
(batch 64, a fresh optimizer state per round) on its own Dirichlet(alpha) shard,
and the consensus becomes the mean of the nodes weighted by shard size
(McMahan et al. 2017). The central baseline trains the same MLP on the whole
training split for the same number of examples seen. Test accuracy on the
official 10,000 test images. Needs the IDX files (``make data``).

    python -m benchmarks fashion_mnist [--quick] [--model mlp|cnn]
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from benchmarks.harness import parse, parser, save
from strategies.registry import resolve_task


def _local_train(task: Any, opt: Any, steps: int, batch: int):
    @functools.partial(jax.jit, static_argnums=())
    def run(params, x, y, count, key):
        def step(carry, k):
            p, s = carry
            rows = jax.random.randint(k, (batch,), 0, count)
            g = jax.grad(task.loss)(p, {"x": x[rows], "y": y[rows]})
            u, s = opt.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        (p, _), _ = jax.lax.scan(step, (params, opt.init(params)), jax.random.split(key, steps))
        return p

    return jax.vmap(run, in_axes=(None, 0, 0, 0, 0))


def markdown(res: dict[str, Any]) -> str:
    """The results page of a run, rendered from its result dict (as saved in the JSON).

    Args:
        res: the dict :func:`main` returns and saves.

    Returns:
        The markdown: title, the setting in one line and the table of test accuracies.
    """
    s = res["settings"]
    return (
        "# Fashion-MNIST: FedAvg vs central\n\n"
        f"{s['nodes']} nodes, Dirichlet alpha = {s['alpha']}, {s['model']}, {s['rounds']} rounds x "
        f"{s['local_steps']} local Adam steps (batch {s['batch']}).\n\n| | test accuracy |\n|---|---|\n"
        f"| FedAvg (clean) | {res['fedavg_test_accuracy']:.4f} |\n"
        f"| central | {res['central_test_accuracy']:.4f} |\n"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, "4 rounds on a 10,000-image slice")
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--alpha", type=float, default=1.0)
    args = parse(p, argv)
    rounds, local_steps, batch = (4, 20, 64) if args.quick else (40, 100, 64)
    task = resolve_task("fashion_mnist", {"model": args.model, "limit": 10000 if args.quick else None})
    # Centralised training reads the general pool as the whole training split: no public pool apart.
    # (cast: resolve_task returns the Task protocol; every shipped task is a dataclass.)
    task = dataclasses.replace(cast(Any, task), public_fraction=0.0, general_pool="union")
    data = task.splits(args.nodes, seed=0, alpha=args.alpha)
    opt = optax.adam(1e-3)
    train = _local_train(task, opt, local_steps, batch)
    evaluate = jax.jit(task.metrics)
    test = {k: jnp.asarray(v) for k, v in data.test.items()}
    x, y = jnp.asarray(data.train["x"]), jnp.asarray(data.train["y"])
    count = jnp.asarray(data.train_count)
    share = jnp.asarray(data.train_count / data.train_count.sum(), jnp.float32)
    params = task.init(jax.random.key(0))
    key = jax.random.key(1)
    curve, t0 = [], time.perf_counter()
    for r in range(rounds):
        key, sub = jax.random.split(key)
        nodes = train(params, x, y, count, jax.random.split(sub, args.nodes))
        params = jax.tree.map(lambda s: jnp.tensordot(share, s, axes=1), nodes)  # FedAvg: size-weighted mean
        curve.append(float(evaluate(params, test)["accuracy"]))
        print(f"round {r + 1}/{rounds}: test accuracy {curve[-1]:.4f}", flush=True)
    fedavg_seconds = time.perf_counter() - t0
    # Central baseline: one model on the whole training split, as many steps as one node took in all rounds.
    central_train = _local_train(task, opt, rounds * local_steps, batch)
    gx, gy = jnp.asarray(data.general["x"])[None], jnp.asarray(data.general["y"])[None]
    central = central_train(
        task.init(jax.random.key(0)),
        gx,
        gy,
        jnp.asarray([len(data.general_groups)]),
        jax.random.split(jax.random.key(2), 1),
    )
    central_acc = float(evaluate(jax.tree.map(lambda a: a[0], central), test)["accuracy"])
    res = {
        "settings": {
            "model": args.model,
            "nodes": args.nodes,
            "alpha": args.alpha,
            "rounds": rounds,
            "local_steps": local_steps,
            "batch": batch,
            "optimizer": "adam 1e-3",
            "train_images": int(len(data.general_groups)),
            "test_images": int(len(data.test["y"])),
        },
        "fedavg_test_accuracy": curve[-1],
        "fedavg_curve": curve,
        "central_test_accuracy": central_acc,
        "fedavg_seconds": fedavg_seconds,
    }
    md = markdown(res)
    save("fashion_mnist", args.quick, res, md)
    print(md)
    return res


if __name__ == "__main__":
    main()
