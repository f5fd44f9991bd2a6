"""A pretrained 135M model in the node trainer, sharded FSDP over k devices: memory per device and losses.

Run ``python -m benchmarks node_fsdp [--quick]`` (it fetches SmolLM2-135M into the cache first,
``meta-consensus models fetch smollm2``). Writes benchmarks/results/node_fsdp.json and .md
(``node_fsdp_quick.*`` with --quick: k = 1 and 8 only, 2 steps).

One node of the ``causal_lm`` task on SmolLM2-135M (dequantised Q4_1 weights, 134.5M
parameters) in :class:`strategies.trainer.NodeTrainer` with Adam, on a ("node", "data",
"model") mesh of 1 x k x 1 simulated CPU devices (``--xla_force_host_platform_device_count=8``,
set before jax starts) with the FSDP rules of :mod:`consensus.mesh`: every dimension named
"embed" is split over "data" (all of the model's kernels and embeddings; the norms' scales
are replicated), and the batch too.

Reported per k:

* the bytes of the params and of the optimizer state that each device holds, summed from the
  arrays' own shards on that device (``addressable_shards``), the largest over the k devices;
* their ratio to ``1/k`` of the single device's bytes (the target: at most 1.2);
* the losses of the first steps against the unsharded run's (same data, same keys): XLA
  partitions the same program, so they agree up to float32 rounding of reordered sums;
* the peak resident memory of the whole process (``ru_maxrss``: every simulated device lives in it);
* the seconds of a step after the compiled first call (simulated devices share the machine's
  cores, so this is not a speed-up measurement, only the cost of running sharded here).
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Mapping
from typing import Any

# The simulated devices: XLA reads the flag when jax creates its CPU backend (at the first
# jax.devices() or computation, not at import), so setting it when this module is imported works.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

NAME = "node_fsdp"
RATIO_TARGET = 1.2
LOSS_TOLERANCE = 1e-4  # absolute, on losses of about 1-3 nats


def device_bytes(tree: Any, devices: list[Any]) -> list[int]:
    """Bytes of ``tree``'s arrays held by each of ``devices`` (their addressable shards)."""
    import jax

    held = {d: 0 for d in devices}
    for leaf in jax.tree.leaves(tree):
        if not hasattr(leaf, "addressable_shards"):
            continue
        for shard in leaf.addressable_shards:
            if shard.device in held:
                held[shard.device] += int(shard.data.nbytes)
    return [held[d] for d in devices]


def run_k(task: Any, data: Any, params: Any, k: int, steps: int, batch: int) -> dict[str, Any]:
    """One node trained ``steps`` steps on a 1 x k x 1 FSDP mesh: bytes per device, losses, step time."""
    import jax
    import numpy as np
    import optax

    from consensus.mesh import MeshConfig
    from strategies.trainer import NodeTrainer

    trainer = NodeTrainer(
        task, optax.adam, {"learning_rate": 1e-4}, batch_size=batch, mesh=MeshConfig(data=k, fsdp=True)
    )
    mesh = trainer.mesh
    assert mesh is not None and not isinstance(mesh, MeshConfig)
    devices = list(mesh.devices.flat)
    state = trainer.init(jax.random.key(0), params, 1)
    param_bytes = device_bytes(state.params, devices)
    opt_bytes = device_bytes(state.opt_state, devices)
    pool = trainer.place(data.own())
    t0 = time.perf_counter()
    state, log = trainer.fit(state, pool, 1)
    jax.block_until_ready(log.loss)
    first = time.perf_counter() - t0
    losses = [float(np.asarray(log.loss)[0, 0])]
    t0 = time.perf_counter()
    state, log = trainer.fit(state, pool, steps - 1)
    jax.block_until_ready(log.loss)
    per_step = (time.perf_counter() - t0) / max(steps - 1, 1)
    losses += [float(x) for x in np.asarray(log.loss)[:, 0]]
    total = [p + o for p, o in zip(param_bytes, opt_bytes, strict=True)]
    worst = int(np.argmax(total))
    return {
        "k": k,
        "param_bytes": param_bytes[worst],
        "opt_bytes": opt_bytes[worst],
        "total_bytes": total[worst],
        "losses": losses,
        "first_call_s": first,
        "step_s": per_step,
    }


def markdown(res: Mapping[str, Any]) -> str:
    rows = res["rows"]
    one = next(r for r in rows if r["k"] == 1)
    lines = [
        f"{res['model']}: {res['params']:,} parameters, one node, Adam (params + 2 moments in float32), "
        f"batch {res['batch']} x context {res['context']}, {res['steps']} steps.",
        "",
        "| devices k | params / device (MB) | optimizer / device (MB) | total / device (MB) | "
        "total / (single / k) | max loss difference vs k = 1 | s / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ideal = one["total_bytes"] / r["k"]
        diff = max(abs(a - b) for a, b in zip(r["losses"], one["losses"], strict=True))
        lines.append(
            f"| {r['k']} | {r['param_bytes'] / 1e6:.1f} | {r['opt_bytes'] / 1e6:.1f} | "
            f"{r['total_bytes'] / 1e6:.1f} | {r['total_bytes'] / ideal:.3f} | {diff:.1e} | "
            f"{r['step_s']:.2f} |"
        )
    worst = max(r["total_bytes"] / (one["total_bytes"] / r["k"]) for r in rows)
    diff = max(
        abs(a - b) for r in rows for a, b in zip(r["losses"], one["losses"], strict=True) if r["k"] != 1
    )
    met = "met" if worst <= RATIO_TARGET and diff <= LOSS_TOLERANCE else "missed"
    lines += [
        "",
        f"Target (per-device params + optimizer at most {RATIO_TARGET}x of 1/k of one device's, losses "
        f"equal to the unsharded run's within {LOSS_TOLERANCE:g}): {met}; worst ratio {worst:.3f}, largest "
        f"loss difference {diff:.1e}. The remainder above 1/k is the replicated norm scales.",
        "",
        f"Peak resident memory of the process (all runs, every simulated device in it): "
        f"{res.get('peak_rss_gb', float('nan')):.1f} GB. Steps on simulated devices share the machine's "
        "cores: the step time says what sharding costs here, not a speed-up.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.harness import header, parse, parser, save

    p = parser(__doc__, "k = 1 and 8 only, 2 steps")
    p.add_argument("--batch", type=int, default=8, help="rows per step (a multiple of every k)")
    # Context 32: at 128 the 8-device run's activations (each simulated device's share of the
    # (batch, context, 49152) logits and their gradients, plus XLA's buffers per device) passed this
    # 24 GB machine's memory; the params and optimizer bytes measured here do not depend on it.
    p.add_argument("--context", type=int, default=32, help="tokens per row")
    args = parse(p, argv)
    import jax

    from strategies.models import hub
    from strategies.tasks.causal_lm import CausalLMTask

    if len(jax.devices()) < 8:
        raise SystemExit("node_fsdp needs 8 CPU devices: start it in a fresh process (it sets XLA_FLAGS)")
    hub.fetch("smollm2")
    ks = (1, 8) if args.quick else (1, 2, 4, 8)
    steps = 2 if args.quick else 3
    task = CausalLMTask(
        model="smollm2",
        context=args.context,
        windows_per_node=64,
        general_windows=8,
        heldout_windows=8,
        test_windows=8,
    )
    data = task.splits(1, seed=0)
    params = task.init(jax.random.key(0))
    t0 = time.perf_counter()
    rows = []
    for k in ks:
        row = run_k(task, data, params, k, steps, args.batch)
        rows.append(row)
        print(
            f"k={k}: params {row['param_bytes'] / 1e6:.1f} MB + optimizer {row['opt_bytes'] / 1e6:.1f} MB "
            f"per device, losses {row['losses']}, {row['step_s']:.2f} s/step",
            flush=True,
        )
    import numpy as np

    count = int(sum(np.size(x) for x in jax.tree.leaves(params)))
    settings = {
        "model": "SmolLM2-135M-Instruct (dequantised Q4_1)",
        "devices": "1 x k x 1 mesh of simulated CPU devices, FSDP rules",
        "batch": args.batch,
        "context": args.context,
        "steps": steps,
        "quick": args.quick,
    }
    res = {
        "model": "SmolLM2-135M-Instruct",
        "params": count,
        "batch": args.batch,
        "context": args.context,
        "steps": steps,
        "rows": rows,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "total_s": time.perf_counter() - t0,
    }
    md = "\n".join(header("Node trainer with FSDP: memory per device", NAME, args.quick, settings)) + "\n"
    md += markdown(res)
    save(NAME, args.quick, res, md, settings=settings)
    print(md)
    return res
