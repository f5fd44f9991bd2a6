"""One process of the multi-host node-training check (launched by test_multihost.py, not collected).

Usage::

    python tests/strategies/multihost_worker.py --out DIR --process-id I --num-processes P \
        --port PORT --local-devices D [--task digits|text] [--nodes N] [--steps S]

With ``--num-processes 1`` it runs the single-process reference (no
``jax.distributed``). Otherwise it joins a ``jax.distributed`` job on
127.0.0.1:PORT with CPU collectives over gloo, loads only the data of the
nodes it hosts (``splits(process_index=jax.process_index(), ...)``), trains
the stacked nodes on a global ("node", "data", "model") mesh, and writes:

* ``shard_<process>.npz`` (every process): the global node ids it hosts and
  the example ids of the rows it loaded;
* ``log.txt`` (process 0 only): one line per phase;
* ``params.npz`` (process 0 only): the final stacked params, gathered from
  every process, flattened to ``path -> array`` (np.savez, no pickle).

The test uses the digits task on a (node=8) mesh. The text task with tensor
parallelism across the two processes runs the same way (``--task text --nodes 4
--model 2``: 2 nodes x 2 model devices per process) and also reproduces the
single-process params exactly.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--local-devices", type=int, default=8)
    ap.add_argument("--task", choices=("digits", "text"), default="digits")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", type=int, default=1, help="tensor-parallel devices per node")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=60, help="seconds for jax.distributed to connect")
    return ap.parse_args()


def main() -> int:
    args = _parse()
    # Device count and platform must be fixed before jax is imported.
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.local_devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, repo)

    import jax

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=args.timeout,
        )
    import numpy as np
    import optax

    from consensus import mesh as mesh_lib
    from strategies.trainer import NodeTrainer

    pid, nproc = jax.process_index(), jax.process_count()
    lead = pid == 0
    log_lines: list[str] = []

    def log(msg: str) -> None:
        # Only process 0 logs (and writes the log file); the others stay silent.
        if lead:
            line = f"[process {pid}/{nproc}] {msg}"
            print(line, flush=True)
            log_lines.append(line)

    t0 = time.time()
    log(f"devices: {jax.device_count()} global, {jax.local_device_count()} local; task {args.task}")
    task = _make_task(args.task)
    data = task.splits(args.nodes, seed=args.seed, alpha=0.5, process_index=pid, process_count=nproc)
    np.savez(
        os.path.join(args.out, f"shard_{pid}.npz"),
        node_ids=np.asarray(data.node_ids, np.int64),
        example_ids=np.asarray(data.meta["example_ids"], np.int64),
        train_count=np.asarray(data.train_count, np.int64),
    )
    log(f"loaded nodes {data.node_ids.tolist()}")

    config = mesh_lib.MeshConfig(node=jax.device_count() // args.model, model=args.model)
    mesh = mesh_lib.make_mesh(config)
    trainer = NodeTrainer(
        task, optax.adam, {"learning_rate": 3e-3}, batch_size=16, mesh=mesh, rules=config.resolved_rules
    )
    state = trainer.init(jax.random.key(args.seed), task.init(jax.random.key(args.seed + 1)), args.nodes)
    state, fit_log = trainer.fit(state, data.own(), args.steps)
    losses = mesh_lib.to_host(fit_log.loss)
    log(f"trained {args.steps} steps; first loss {losses[0].mean():.4f}, last {losses[-1].mean():.4f}")

    # Gathering is collective: every process takes part, only process 0 writes.
    params = mesh_lib.to_host(state.params)
    if lead:
        flat, _ = jax.tree_util.tree_flatten_with_path(params)
        arrays = {jax.tree_util.keystr(path): np.asarray(x) for path, x in flat}
        np.savez(os.path.join(args.out, "params.npz"), **arrays)
        log(f"done in {time.time() - t0:.1f}s")
        with open(os.path.join(args.out, "log.txt"), "w") as fh:
            fh.write("\n".join(log_lines) + "\n")
    if nproc > 1:
        jax.distributed.shutdown()
    return 0


def _make_task(name: str):
    if name == "digits":
        from strategies.tasks.digits import DigitsTask

        return DigitsTask(hidden=(32,))
    from strategies.tasks.text import TextTask

    return TextTask(
        context=16,
        d_model=16,
        num_heads=2,
        num_layers=1,
        d_mlp=32,
        windows_per_node=32,
        general_windows=32,
        heldout_windows=16,
        test_windows=16,
    )


if __name__ == "__main__":
    sys.exit(main())
