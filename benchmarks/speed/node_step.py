"""The node step against the hardware's limit: tokens/s, MFU, where a step's time goes, memory per device.

Run ``python -m benchmarks node_step [--quick]``. Writes benchmarks/results/node_step.json and .md
(``node_step_quick.*`` with ``--quick``: SmolLM2 only, float32, the smallest batches, no FSDP sweep).

One node of a causal LM in :class:`strategies.trainer.NodeTrainer` (Adam, donated state), random
weights and random tokens (speed does not depend on them), context 512:

* models: the SmolLM2-135M shape (Llama, 30 layers, width 576, tied 49152-token head) and the
  GPT-2-124M shape (12 layers, width 768); on an accelerator also a 1B Llama shape (Llama 3.2's
  widths, 16 layers, width 2048);
* modes: full fine-tuning, LoRA (rank 8 on q/k/v/o and the MLP projections, the base frozen) and
  LoRA + DP-SGD (the trainer's example-level path: per-example adapter gradients clipped, noised;
  the model has no dense-layer taps, so the generic per-example path);
* float32 and bfloat16 compute (float32 params and Adam state either way), with and without
  rematerialisation (each block recomputed in the backward pass, ``from_config(remat=True)``);
* a sweep of per-device batch sizes.

Reported per row: tokens/s; MFU = (6N + 12 L H Q T) x tokens/s / peak (N parameters, L layers,
H heads, Q head width, T context: PaLM's appendix, as MaxText and Levanter count; LoRA and DP
rows use the same model FLOPs, so their MFU compares with full fine-tuning's at equal work);
the step time split into forward + backward (the loss's ``value_and_grad`` alone, jitted), the
optimizer (Adam's update and apply alone) and the rest (sampling the batch, the scan, logging:
the trainer's step less the two); peak memory per device from the compiled step's
``memory_analysis()`` (arguments + outputs + temporaries - aliased) and the runtime's own
``memory_stats()`` peak where the backend keeps one (accelerators).

The **peak**: on a CPU, the best jitted square matmul of the models' widths (hidden and MLP)
measured in the same run, float32 and bfloat16 apart, so a row says how close the step comes to
what this machine does on its best dense kernel; on a GPU or TPU the device's dense datasheet
figure (:data:`DATASHEET`, bfloat16 not the sparsity figure), with the same-run matmul beside it.

**FSDP** (full run): the SmolLM2 step on a 1 x k x 1 mesh of k = 1, 2, 4, 8 simulated CPU devices
(a subprocess with ``--xla_force_host_platform_device_count=8``), compiled not run: params +
optimizer bytes per device, the step's peak bytes per device, and the bytes the compiled program
moves through collectives (all-gather, reduce-scatter, all-reduce) per step.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any, ClassVar

NAME = "node_step"
CONTEXT = 512
MFU_TARGET_CPU = 0.50  # the full fine-tuning step against the same-run matmul peak
LORA_TARGET = 0.75  # LoRA's step time / full fine-tuning's
# Dense (not sparsity) datasheet peaks, FLOP/s, per chip.
DATASHEET: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989e12, "float32": 494.7e12},
    "H100": {"bfloat16": 989e12, "float32": 494.7e12},
    "A100": {"bfloat16": 312e12, "float32": 156e12},
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12},
    "TPU v5 lite": {"bfloat16": 197e12, "float32": 197e12},
    "TPU v5p": {"bfloat16": 459e12, "float32": 459e12},
}

SMOLLM2 = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
GPT2 = {
    "model_type": "gpt2",
    "vocab_size": 50257,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_positions": 1024,
    "activation_function": "gelu_new",
    "tie_word_embeddings": True,
}
LLAMA_1B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
}
MODELS = {"smollm2-135m": SMOLLM2, "gpt2-124m": GPT2, "llama-1b": LLAMA_1B}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "c_attn", "c_fc")


def tiny(config: Mapping[str, Any]) -> dict[str, Any]:
    """A two-layer, narrow copy of a model config (the tests' and ``--tiny``'s shape)."""
    c = dict(config)
    if c["model_type"] == "gpt2":
        c.update(n_embd=64, n_layer=2, n_head=4, vocab_size=512)
    else:
        c.update(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=512,
        )
    return c


# ----------------------------------------------------------------------------- the task


@dataclasses.dataclass(frozen=True, eq=False)
class RandomLMTask:
    """Next-token cross entropy of a causal LM built from a config (weights drawn, not loaded).

    Compared by identity (one object per model), so each trainer compiles its own step once.

    Args:
      lm: the :class:`strategies.models.CausalLM`.
      name: a label.
    """

    lm: Any
    name: str = "random_lm"
    low_rank_kernels: ClassVar[bool] = True  # LoRA beside the frozen kernels, as CausalLMTask

    def init(self, key: Any) -> Any:
        return _str_keys(self.lm.init(key))

    def apply(self, params: Any, inputs: Any, *, train: bool = False, key: Any = None) -> Any:
        del train, key
        return self.lm.apply(params, inputs)

    def loss(self, params: Any, batch: Mapping[str, Any], key: Any = None) -> Any:
        import jax
        import jax.numpy as jnp

        logits = self.lm.apply(params, batch["x"])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, batch["y"][..., None].astype(jnp.int32), axis=-1)[..., 0]
        return jnp.mean(nll)

    def metrics(self, params: Any, batch: Mapping[str, Any]) -> dict[str, Any]:
        return {"loss": self.loss(params, batch)}

    def logical_axes(self, params: Any = None) -> Any:
        return _str_keys(self.lm.logical_axes())

    def flip_labels(self, batch: Mapping[str, Any]) -> Mapping[str, Any]:
        return batch


def _str_keys(tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


def random_tokens(vocab: int, rows: int, context: int, seed: int = 0) -> Any:
    """One node's pool of ``rows`` random windows (``x`` and ``y`` shifted by one)."""
    import numpy as np

    from strategies.tasks.base import NodeData

    rng = np.random.default_rng(seed)
    toks = rng.integers(0, vocab, (1, rows, context + 1), dtype=np.int32)
    pool = {"x": toks[:, :, :-1].copy(), "y": toks[:, :, 1:].copy()}
    return NodeData(
        pool, np.arange(rows, dtype=np.int32)[None], np.array([rows], np.int32), False, "own", True
    )


def flops_per_token(config: Any, num_params: int, context: int) -> float:
    """Training FLOPs per token: ``6 N + 12 L H Q T`` (weights' matmuls and attention's)."""
    return 6.0 * num_params + 12.0 * config.num_layers * config.num_heads * config.head_dim * context


# ----------------------------------------------------------------------------- the peak


def device_kind() -> tuple[str, str]:
    """(backend, device kind) of the first device."""
    import jax

    d = jax.devices()[0]
    return d.platform, str(getattr(d, "device_kind", d.platform))


def datasheet_peak(kind: str, dtype: str) -> float | None:
    """The dense datasheet FLOP/s of a device kind, or None when it is not in :data:`DATASHEET`."""
    for name, peaks in DATASHEET.items():
        if name.lower() in kind.lower():
            return peaks[dtype]
    return None


def matmul_peak(sizes: tuple[int, ...], dtype: str, repeats: int) -> dict[str, Any]:
    """Best FLOP/s of a jitted square matmul over ``sizes`` (eight chained products per call)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.harness import best_time

    best: dict[str, Any] = {"flops": 0.0, "size": 0}
    chain = 8
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype) / math.sqrt(n)

        @jax.jit
        def run(x, a=a):
            for _ in range(chain):
                x = x @ a
            return x

        t = best_time(functools.partial(run, a), repeats=repeats)
        flops = chain * 2.0 * n**3 / t
        if flops > best["flops"]:
            best = {"flops": flops, "size": n}
    return best


# ----------------------------------------------------------------------------- what bounds the step


def step_matmuls(config: Any, batch: int, context: int) -> list[tuple[str, int, int, int, int]]:
    """The training step's matmuls at the model's own shapes: (name, count, M, K, N) of M x K by K x N.

    Every weight matmul of the forward pass (M = batch x context tokens) comes with its two
    backward matmuls (dX = dY W^T: M x N by N x K; dW = X^T dY: K x M by M x N); attention's
    scores and weighted values (per batch row and head, T x Q by Q x T and T x T by T x Q) come
    with theirs. The count is per step (layers x heads x batch where it applies).
    """
    c = config
    m, t, d, q = batch * context, context, c.hidden_size, c.head_dim
    if c.family == "gpt2":
        weights = [("qkv", d, 3 * d), ("attn_out", d, d), ("mlp_in", d, c.intermediate_size),
                   ("mlp_out", c.intermediate_size, d)]  # fmt: skip
    else:
        kv = c.num_kv_heads * q
        weights = [("q", d, c.num_heads * q), ("k", d, kv), ("v", d, kv), ("attn_out", c.num_heads * q, d),
                   ("gate", d, c.intermediate_size), ("up", d, c.intermediate_size),
                   ("down", c.intermediate_size, d)]  # fmt: skip
    out = []
    for name, k, n in weights:
        out += [(f"{name} fwd", c.num_layers, m, k, n), (f"{name} dX", c.num_layers, m, n, k),
                (f"{name} dW", c.num_layers, k, m, n)]  # fmt: skip
    heads = c.num_layers * c.num_heads * batch
    # scores S = Q K^T (T x Q by Q x T); out = P V (T x T by T x Q); two backward matmuls each.
    out += [
        ("scores fwd", heads, t, q, t),
        ("scores dQ", heads, t, t, q),
        ("scores dK", heads, t, t, q),
        ("values fwd", heads, t, t, q),
        ("values dP", heads, t, q, t),
        ("values dV", heads, t, t, q),
    ]
    out += [("head fwd", 1, m, d, c.vocab_size), ("head dX", 1, m, c.vocab_size, d),
            ("head dW", 1, d, m, c.vocab_size)]  # fmt: skip
    return out


def matmul_bound(config: Any, batch: int, context: int, dtype: str, repeats: int) -> dict[str, Any]:
    """What the step's matmuls alone cost at their own shapes on this machine, and the softmax's cost.

    Each distinct (M, K, N) is timed as a jitted matmul (a batch of 8 for attention's small ones,
    so dispatch does not count) and multiplied by its count. Their sum is the time a step would
    take if it did nothing but its matmuls, each at the throughput this machine reaches on that
    shape: the bound on the step that the kernels' shapes set, below the square-matmul peak. The
    cross-entropy over the vocabulary (log-softmax forward and backward on the logits, no
    matmul) is timed alone: element-wise, memory-bound work the FLOP count leaves out.
    """
    import jax
    import jax.numpy as jnp

    from benchmarks.harness import best_time

    mats = step_matmuls(config, batch, context)
    timed: dict[tuple[int, int, int], float] = {}
    parts = []
    total_s = 0.0
    total_flops = 0.0
    for name, count, m, k, n in mats:
        if (m, k, n) not in timed:
            stack = 8 if m * k * n < 2**26 else 1
            a = jnp.ones((stack, m, k), dtype)
            b = jnp.ones((stack, k, n), dtype)
            f = jax.jit(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y))
            timed[(m, k, n)] = best_time(lambda f=f, a=a, b=b: f(a, b), repeats=repeats) / stack
        s = timed[(m, k, n)] * count
        flops = 2.0 * m * k * n * count
        parts.append({"name": name, "count": count, "m": m, "k": k, "n": n, "seconds": s, "flops": flops})
        total_s += s
        total_flops += flops
    logits = jnp.zeros((batch * context, config.vocab_size), jnp.float32)
    labels = jnp.zeros((batch * context,), jnp.int32)

    def xent(z):
        lse = jax.nn.logsumexp(z, axis=-1)
        return jnp.mean(lse - jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0])

    g = jax.jit(jax.value_and_grad(xent))
    xent_s = best_time(lambda: g(logits), repeats=repeats)
    return {
        "dtype": dtype,
        "batch": batch,
        "context": context,
        "matmul_s": total_s,
        "matmul_flops": total_flops,
        "xent_s": xent_s,
        "parts": parts,
    }


# ----------------------------------------------------------------------------- one row


def measure(
    model: str,
    config: Mapping[str, Any],
    *,
    mode: str,
    dtype: str,
    remat: bool,
    batch: int,
    context: int,
    steps: int,
    repeats: int,
) -> dict[str, Any]:
    """One row: the trainer's step, its forward+backward and optimizer parts, compiled memory."""
    import jax
    import jax.numpy as jnp
    import optax

    from benchmarks.harness import best_time
    from strategies import dpsgd
    from strategies.lora import LoraSettings, LoraTask
    from strategies.models import from_config
    from strategies.tasks.base import cast_floating
    from strategies.trainer import NodeTrainer, compiled_bytes

    lm = from_config(dict(config), remat=remat)
    base_task: Any = RandomLMTask(lm, name=model)
    params = base_task.init(jax.random.key(0))
    num_params = lm.num_params()
    data = random_tokens(lm.config.vocab_size, max(2 * batch, 8), context)
    compute = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    options: dict[str, Any] = {}
    if mode == "full":
        task: Any = base_task
        trained = params
    else:
        targets = tuple(t for t in LORA_TARGETS if t in _leaf_names(params))
        task = LoraTask(
            base_task, LoraSettings(rank=8, alpha=16.0, targets=targets), params, jax.random.key(1)
        )
        trained = task.init(jax.random.key(2))
        options["frozen"] = task.initial_frozen()
        if mode == "lora_dp":
            options["dp"] = dpsgd.ExampleDP(clip_norm=1.0, noise_multiplier=1.0, pad=batch, ghost=False)
    trainer = NodeTrainer(
        task, optax.adam, {"learning_rate": 1e-4}, batch_size=batch, compute_dtype=compute, donate=True
    )
    state = trainer.init(jax.random.key(3), trained, 1)
    # Compiled once through lower() (its memory analysis) and run as that executable: a fit call
    # would compile the same program again.
    args, static = trainer.fit_args(state, data, steps, **options)
    t0 = time.perf_counter()
    compiled = trainer._fit_jit.lower(*args, static=static).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    holder = {"state": args[0]}

    def step():
        holder["state"], log = compiled(holder["state"], *args[1:])
        return log.loss

    step_s = best_time(step, repeats) / steps

    # The parts, each jitted alone on one batch of the pool.
    x = jnp.asarray(data.pool["x"][0, :batch])
    y = jnp.asarray(data.pool["y"][0, :batch])
    single = jax.tree.map(lambda v: v[0], holder["state"].params)
    frozen = options.get("frozen")

    # The frozen base goes in as an argument: closed over, jit would bake 135M constants in.
    def loss_fn(p, b, fr):
        p = cast_floating(p, compute) if dtype == "bfloat16" else p
        if fr is None:
            return task.loss(p, b).astype(jnp.float32)
        return task.loss(p, b, frozen=fr).astype(jnp.float32)

    if mode == "lora_dp":
        mask = jnp.ones((batch,), bool)

        def grad_part(p, b, fr):
            return dpsgd.private_gradient(
                lambda q, r, k: loss_fn(q, r, fr),
                p,
                b,
                mask,
                jax.random.key(0),
                jax.random.key(1),
                jnp.float32(1.0),
                jnp.float32(1.0),
                jnp.float32(batch),
            )
    else:

        def grad_part(p, b, fr):
            return jax.value_and_grad(loss_fn)(p, b, fr)

    grad_jit = jax.jit(grad_part)
    batch_d = {"x": x, "y": y}
    fb_s = best_time(lambda: grad_jit(single, batch_d, frozen), repeats)
    _, grads = grad_jit(single, batch_d, frozen)
    tx = optax.adam(1e-4)
    with jax.numpy_dtype_promotion("standard"):
        opt0 = tx.init(single)

    def opt_part(g, o, p):
        with jax.numpy_dtype_promotion("standard"):
            upd, o = tx.update(g, o, p)
        return optax.apply_updates(p, upd), o

    opt_jit = jax.jit(opt_part)
    opt_s = best_time(lambda: opt_jit(grads, opt0, single), repeats)
    stats = jax.devices()[0].memory_stats() or {}
    tokens = batch * context
    return {
        "model": model,
        "mode": mode,
        "dtype": dtype,
        "remat": remat,
        "batch": batch,
        "context": context,
        "params": num_params,
        "trained_params": int(sum(v.size for v in jax.tree.leaves(trained))),
        "flops_per_token": flops_per_token(lm.config, num_params, context),
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "fwd_bwd_s": fb_s,
        "optimizer_s": opt_s,
        "rest_s": step_s - fb_s - opt_s,
        "compile_s": compile_s,
        "compiled_bytes": compiled_bytes(compiled),
        "temp_bytes": int(mem.temp_size_in_bytes) if mem is not None else 0,
        "argument_bytes": int(mem.argument_size_in_bytes) if mem is not None else 0,
        "runtime_peak_bytes": int(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else None,
    }


def _leaf_names(params: Any) -> set[str]:
    import jax

    names: set[str] = set()
    for path, _ in jax.tree_util.tree_leaves_with_path(params):
        names.update(str(getattr(k, "key", k)) for k in path)
    return names


# ----------------------------------------------------------------------------- the node's own mesh

# (layout, k): FSDP over k data-parallel devices (the batch split, weights' "embed" dimension sharded)
# or tensor parallel over k model devices ("mlp", "heads", "vocab" split where k divides them).
MESH_CONTEXT = 64  # batch 8 x 64 tokens: eight simulated devices' step temporaries fit in host memory at once
MESH_LAYOUTS: tuple[tuple[str, int], ...] = (
    ("fsdp", 1), ("fsdp", 2), ("fsdp", 4), ("fsdp", 8), ("tp", 2), ("tp", 4), ("tp", 8),
)  # fmt: skip


def replay_collectives(volumes: Mapping[str, int], devices: list[Any], repeats: int) -> float:
    """Seconds to run one step's collectives alone, each kind at the step's volume, on ``devices``.

    ``volumes`` are per-device output bytes by kind (:func:`collective_bytes` of the step's
    partitioned program). Each kind is replayed as one float32 collective of that size over the
    same devices (all-gather: a sharded array made whole on every device; all-reduce: a sum over
    a sharded leading axis, whole on every device; reduce-scatter: the same sum left sharded), so
    the step's collective time is estimated without a profiler.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from benchmarks.harness import best_time

    k = len(devices)
    if k == 1:
        return 0.0
    mesh = Mesh(np.array(devices), ("d",))
    split, whole = NamedSharding(mesh, PartitionSpec("d")), NamedSharding(mesh, PartitionSpec())
    total = 0.0
    for kind, nbytes in volumes.items():
        n = max(int(nbytes) // 4 // k * k, k)
        if kind == "all-gather":
            x = jax.device_put(jnp.zeros((n,), jnp.float32), split)
            f = jax.jit(lambda v: v * 1.0, out_shardings=whole)
        elif kind in ("all-reduce", "reduce-scatter"):
            m = n if kind == "all-reduce" else n * k  # reduce-scatter's output is one shard of the sum
            x = jax.device_put(jnp.zeros((k, m), jnp.float32), split)
            out = whole if kind == "all-reduce" else split
            f = jax.jit(lambda v: v.sum(axis=0), out_shardings=out)
        else:
            continue  # all-to-all, collective-permute: bytes reported, not replayed
        total += best_time(lambda f=f, x=x: f(x), repeats=repeats)
    return total


def mesh_child(
    config: Mapping[str, Any], layouts: list[list[Any]], batch: int, context: int
) -> list[dict[str, Any]]:
    """In a process with 8 simulated devices: per-device bytes, collectives and step time per layout."""
    import jax
    import optax

    from benchmarks.harness import best_time
    from consensus.mesh import MeshConfig
    from strategies.models import from_config
    from strategies.trainer import NodeTrainer, compiled_bytes

    lm = from_config(dict(config))
    task: Any = RandomLMTask(lm)
    data = random_tokens(lm.config.vocab_size, 2 * batch, context)
    rows = []
    for layout, k in layouts:
        mesh = MeshConfig(data=k, fsdp=True) if layout == "fsdp" else MeshConfig(model=k)
        trainer = NodeTrainer(
            task, optax.adam, {"learning_rate": 1e-4}, batch_size=batch, mesh=mesh, donate=True
        )
        state = trainer.init(jax.random.key(0), None, 1)
        devices = list(trainer._mesh.devices.flat) if trainer._mesh is not None else jax.devices()[:1]
        params_b = max(_device_bytes(state.params, devices))
        opt_b = max(_device_bytes(state.opt_state, devices))
        args, static = trainer.fit_args(state, data, 1)
        t0 = time.perf_counter()
        compiled = trainer._fit_jit.lower(*args, static=static).compile()
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        holder = {"state": args[0]}

        def step(compiled=compiled, args=args, holder=holder):
            holder["state"], log = compiled(holder["state"], *args[1:])
            return log.loss

        step_s = best_time(step, repeats=1)
        del holder, args, state
        gc.collect()
        volumes = collective_bytes(compiled.as_text() or "")
        rows.append(
            {
                "layout": layout,
                "k": k,
                "param_bytes": params_b,
                "opt_bytes": opt_b,
                "compiled_bytes": compiled_bytes(compiled),
                "temp_bytes": int(mem.temp_size_in_bytes) if mem is not None else 0,
                "collectives": volumes,
                "compile_s": compile_s,
                "step_s": step_s,
                "collective_s": replay_collectives(volumes, devices, repeats=2),
            }
        )
        print(f"{layout} k={k}: {rows[-1]}", file=sys.stderr, flush=True)
        del trainer, compiled, step
        jax.clear_caches()
        gc.collect()
    return rows


def _device_bytes(tree: Any, devices: list[Any]) -> list[int]:
    import jax

    held = {d: 0 for d in devices}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            if shard.device in held:
                held[shard.device] += int(shard.data.nbytes)
    return [held[d] for d in devices]


_COLLECTIVE = re.compile(
    r"=\s*(\(?[a-z0-9\[\],{}: ]+\)?)\s+(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}


def collective_bytes(hlo: str) -> dict[str, int]:
    """Output bytes of every collective in a compiled module's text, by kind (one pass over the HLO)."""
    out: dict[str, int] = {}
    for shape, kind in _COLLECTIVE.findall(hlo):
        total = 0
        for dt, dims in _ARRAY.findall(shape):
            n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
            total += n * _BYTES.get(dt, 4)
        out[kind] = out.get(kind, 0) + total
    return out


def run_mesh(
    config: Mapping[str, Any], layouts: tuple[tuple[str, int], ...], batch: int, context: int
) -> list[dict[str, Any]]:
    """:func:`mesh_child` in a fresh process with 8 simulated CPU devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    code = (
        "import json, sys; from benchmarks.speed.node_step import mesh_child; "
        "a = json.loads(sys.argv[1]); "
        "print(json.dumps(mesh_child(a['config'], a['layouts'], a['batch'], a['context'])))"
    )
    arg = json.dumps({"config": dict(config), "layouts": [list(x) for x in layouts], "batch": batch,
                      "context": context})  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", code, arg], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise RuntimeError(f"mesh sweep failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- page


def _mb(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**20:,.0f}"


def markdown(res: Mapping[str, Any]) -> str:
    peak = res["peak"]
    lines = [
        f"Backend: {res['backend']} ({res['device_kind']}). Peak the MFU is taken against: "
        + ", ".join(f"{dt} {p['flops'] / 1e9:,.1f} GFLOP/s ({p['source']})" for dt, p in peak.items())
        + ".",
        "",
        "MFU = (6N + 12 L H Q T) x tokens/s / peak; LoRA and DP-SGD rows count the same model FLOPs.",
        "Step time split: forward + backward (the loss's gradient alone), optimizer (Adam alone), "
        "rest (the trainer's step less the two: batch sampling, the scan, logging). Memory per device: "
        "the compiled step's memory analysis (arguments + outputs + temporaries - donated); the "
        "runtime's peak where the backend keeps one.",
        "",
        "| model | mode | dtype | remat | batch | tokens/s | MFU | step (ms) | fwd+bwd | optimizer | "
        "rest | compiled MB | runtime peak MB | compile (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        p = peak[r["dtype"]]["flops"]
        mfu = r["flops_per_token"] * r["tokens_per_s"] / p
        s = r["step_s"]
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['dtype']} | {'yes' if r['remat'] else 'no'} | {r['batch']} | "
            f"{r['tokens_per_s']:,.0f} | {mfu:.1%} | {s * 1e3:,.0f} | {r['fwd_bwd_s'] / s:.0%} | "
            f"{r['optimizer_s'] / s:.0%} | {r['rest_s'] / s:.0%} | {_mb(r['compiled_bytes'])} | "
            f"{_mb(r['runtime_peak_bytes'])} | {r['compile_s']:.0f} |"
        )
    lines += ["", *verdicts(res)]
    if res.get("fsdp"):
        one = next(r for r in res["fsdp"] if r["k"] == 1)
        lines += [
            "",
            f"The node's own mesh over k simulated CPU devices ({res['fsdp_shape']}): FSDP (data-parallel, "
            "weights' embed dimension sharded) and tensor parallel (MLP, heads and vocabulary split where k "
            "divides them), per device. Collectives: the partitioned step's output bytes by kind; their time "
            "is the step's collectives replayed alone at those volumes on the same devices, as a share of "
            "the step. Simulated devices share this machine's cores: the step time says what a layout costs "
            "here, not a speed-up.",
            "",
            "| layout | k | params + optimizer MB | x (1/k of k=1) | step peak MB | temporaries MB | "
            "all-gather MB | reduce-scatter MB | all-reduce MB | step (s) | collectives (s) | share |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in res["fsdp"]:
            po = r["param_bytes"] + r["opt_bytes"]
            ideal = (one["param_bytes"] + one["opt_bytes"]) / r["k"]
            c = r["collectives"]
            step_s, coll = r.get("step_s"), r.get("collective_s")
            timed = (
                f"{step_s:.2f} | {coll:.2f} | {coll / step_s:.0%}"
                if step_s and coll is not None
                else "- | - | -"
            )
            lines.append(
                f"| {r.get('layout', 'fsdp')} | {r['k']} | {_mb(po)} | {po / ideal:.3f} | "
                f"{_mb(r['compiled_bytes'])} | {_mb(r['temp_bytes'])} | {_mb(c.get('all-gather', 0))} | "
                f"{_mb(c.get('reduce-scatter', 0))} | {_mb(c.get('all-reduce', 0))} | {timed} |"
            )
    if res["backend"] == "cpu":
        lines += [
            "",
            "Pending (no accelerator in this run): the GPU/TPU rows (datasheet peak, e.g. H100/H200 "
            "989 TFLOP/s bf16 dense), the 1B Llama shape and its consensus round over 8 nodes. The same "
            "command runs them on a machine with one.",
        ]
    return "\n".join(lines) + "\n"


def verdicts(res: Mapping[str, Any]) -> list[str]:
    """The targets, met or missed, with the measured bottleneck where missed."""
    rows = res["rows"]
    out = []
    peak = res["peak"]
    full = [r for r in rows if r["mode"] == "full" and r["model"] == "smollm2-135m" and not r["remat"]]
    if full:
        best = max(full, key=lambda r: r["flops_per_token"] * r["tokens_per_s"] / peak[r["dtype"]]["flops"])
        mfu = best["flops_per_token"] * best["tokens_per_s"] / peak[best["dtype"]]["flops"]
        target = MFU_TARGET_CPU if res["backend"] == "cpu" else 0.35
        s = best["step_s"]
        verdict = "met" if mfu >= target else "missed"
        out.append(
            f"- SmolLM2-135M full fine-tuning, best row ({best['dtype']}, batch {best['batch']}): MFU "
            f"{mfu:.1%} against the target {target:.0%}: {verdict}. Its step: forward + backward "
            f"{best['fwd_bwd_s'] / s:.0%}, optimizer {best['optimizer_s'] / s:.0%}, "
            f"rest {best['rest_s'] / s:.0%}."
        )
        if verdict == "missed":
            fb_mfu = best["flops_per_token"] * best["batch"] * best["context"] / best["fwd_bwd_s"]
            fb_mfu /= peak[best["dtype"]]["flops"]
            out.append(f"  The bottleneck is the forward + backward itself ({fb_mfu:.1%} of the peak alone).")
            bound = _bound_of(res, best)
            if bound is not None:
                out += _bound_lines(bound, best, peak[best["dtype"]]["flops"])
    pairs = []
    for r in rows:
        if r["mode"] != "lora":
            continue
        match = [
            f
            for f in rows
            if f["mode"] == "full"
            and all(f[k] == r[k] for k in ("model", "dtype", "remat", "batch", "context"))
        ]
        if match:
            pairs.append((r, match[0]))
    if pairs:
        ratios = [r["step_s"] / f["step_s"] for r, f in pairs]
        worst = max(ratios)
        out.append(
            f"- LoRA step / full fine-tuning step: {min(ratios):.2f}-{worst:.2f}x over {len(pairs)} pairs "
            f"(target <= {LORA_TARGET}): {'met' if worst <= LORA_TARGET else 'missed'}."
        )
        if worst > LORA_TARGET:
            r, f = pairs[ratios.index(worst)]
            line = (
                f"  Where missed ({r['model']}, {r['dtype']}, batch {r['batch']}): LoRA's forward + "
                f"backward {r['fwd_bwd_s'] * 1e3:,.0f} ms against full's {f['fwd_bwd_s'] * 1e3:,.0f} ms, "
                f"optimizer {r['optimizer_s'] * 1e3:,.1f} ms against {f['optimizer_s'] * 1e3:,.1f} ms. "
                "LoRA runs beside the frozen kernels, so it skips exactly their weight gradients "
                "(dW = x^T dy) and keeps the forward, the activation gradients, attention and the "
                "element-wise work."
            )
            bound = _bound_of(res, r, same_batch=False)
            if bound is not None:
                dw = sum(p["seconds"] for p in bound["parts"] if p["name"].endswith(" dW")
                         and not p["name"].startswith(("scores", "values")))  # fmt: skip
                full_fb = next((x["fwd_bwd_s"] for x in rows if x["model"] == r["model"]
                                and x["dtype"] == r["dtype"] and x["mode"] == "full" and not x["remat"]
                                and x["batch"] == bound["batch"]), None)  # fmt: skip
                if full_fb:
                    floor = 1.0 - dw / full_fb
                    line += (
                        " Measured floor: those weight-gradient matmuls alone, timed at their shapes, are "
                        f"{dw / full_fb:.0%} of full fine-tuning's forward + backward "
                        f"(batch {bound['batch']}), "
                        f"so a step without them costs at least {floor:.2f}x of full's forward + backward."
                    )
            out.append(line)
    dp = [r for r in rows if r["mode"] == "lora_dp"]
    for r in dp:
        match = [
            f
            for f in rows
            if f["mode"] == "lora"
            and all(f[k] == r[k] for k in ("model", "dtype", "remat", "batch", "context"))
        ]
        if match:
            out.append(
                f"- LoRA + DP-SGD / LoRA ({r['model']}, {r['dtype']}, batch {r['batch']}): "
                f"{r['step_s'] / match[0]['step_s']:.2f}x."
            )
    if res.get("fsdp"):
        one = next(r for r in res["fsdp"] if r["k"] == 1)
        worst = max(
            (r["param_bytes"] + r["opt_bytes"]) / ((one["param_bytes"] + one["opt_bytes"]) / r["k"])
            for r in res["fsdp"]
            if r.get("layout", "fsdp") == "fsdp"
        )
        out.append(
            f"- FSDP params + optimizer per device at most {worst:.3f}x of 1/k of one device's (target 1.2): "
            f"{'met' if worst <= 1.2 else 'missed'}."
        )
        tp = [r for r in res["fsdp"] if r.get("layout") == "tp"]
        if tp:
            one_po = one["param_bytes"] + one["opt_bytes"]
            ratios = ", ".join(
                f"k = {r['k']} {(r['param_bytes'] + r['opt_bytes']) * r['k'] / one_po:.2f}x" for r in tp
            )
            out.append(
                f"- Tensor parallel params + optimizer per device against 1/k of one device's: {ratios} "
                "(the MLP, heads and vocabulary split where k divides them, the norm scales whole)."
            )
        timed = [r for r in res["fsdp"] if r.get("step_s") and r["k"] > 1]
        if timed:
            worst_share = max(timed, key=lambda r: r["collective_s"] / r["step_s"])
            out.append(
                f"- Collective time share of the step (replayed alone): at most "
                f"{worst_share['collective_s'] / worst_share['step_s']:.0%} ({worst_share['layout']}, "
                f"k = {worst_share['k']})."
            )
    if res.get("under_load"):
        out.append(f"- {res['under_load']}")
    return out


def _bound_of(
    res: Mapping[str, Any], row: Mapping[str, Any], same_batch: bool = True
) -> Mapping[str, Any] | None:
    """The matmul bound measured for a row's model and dtype (and batch, unless ``same_batch`` is False)."""
    for b in res.get("bounds", []):
        if (
            b["model"] == row["model"]
            and b["dtype"] == row["dtype"]
            and (b["batch"] == row["batch"] or not same_batch)
        ):
            return b
    return None


def _bound_lines(bound: Mapping[str, Any], row: Mapping[str, Any], peak: float) -> list[str]:
    """What the step's matmul shapes and its cross-entropy alone cost, against its forward + backward."""
    tokens = row["batch"] * row["context"]
    mm_s, fb = bound["matmul_s"], row["fwd_bwd_s"]
    ceiling = row["flops_per_token"] * tokens / mm_s / peak
    groups: dict[str, list[float]] = {}
    for p in bound["parts"]:
        g = groups.setdefault(p["name"].split()[0], [0.0, 0.0])
        g[0] += p["seconds"]
        g[1] += p["flops"]
    slow = sorted(groups.items(), key=lambda kv: kv[1][1] / kv[1][0])[:3]
    slow_text = ", ".join(f"{name} {fl / s / 1e9:,.0f} GFLOP/s ({s / mm_s:.0%} of the matmul time)"
                          for name, (s, fl) in slow)  # fmt: skip
    rest = fb - mm_s - bound["xent_s"]
    return [
        f"  What bounds it, measured in the same run: the step's matmuls alone, each timed at its own "
        f"shape ({len(bound['parts'])} kinds, forward and both backward products), take "
        f"{mm_s * 1e3:,.0f} ms for its {tokens:,} tokens, {bound['matmul_flops'] / mm_s / 1e9:,.0f} GFLOP/s "
        f"against the square matmul's {peak / 1e9:,.0f}: a step that did nothing else would reach "
        f"{ceiling:.1%} MFU. Of the forward + backward's {fb * 1e3:,.0f} ms they are {mm_s / fb:.0%}, "
        f"the cross-entropy over the vocabulary (log-softmax forward and backward, no FLOPs counted) "
        f"{bound['xent_s'] / fb:.0%}, and the rest {max(rest, 0.0) / fb:.0%} (norms, RoPE, attention's "
        "softmax and mask, activations: element-wise, memory-bound). The slowest shapes: "
        f"{slow_text}.",
    ]


# ----------------------------------------------------------------------------- main


def row_grid(models: list[str], *, quick: bool, accel: bool) -> dict[str, list[tuple[str, str, bool, int]]]:
    """Per model, the (mode, dtype, remat, batch) rows to measure.

    On a CPU a 135M step at context 512 takes seconds, so the sweep is kept to what fits the
    full run's 25 minutes: the batch sweep of full fine-tuning in float32, then one or two
    batches of each other setting. An accelerator sweeps larger batches.
    """
    out: dict[str, list[tuple[str, str, bool, int]]] = {}
    for m in models:
        if quick:
            rows = [("full", "float32", False, 1), ("lora", "float32", False, 1)]
        elif accel:
            rows = [("full", dt, False, b) for dt in ("float32", "bfloat16") for b in (8, 16, 32, 64)]
            rows += [("full", "bfloat16", True, 64), ("lora", "bfloat16", False, 64)]
            rows += [("lora", "float32", False, 64), ("lora_dp", "bfloat16", False, 256)]
            rows += [("lora", "bfloat16", False, 256)]
        elif m == "smollm2-135m":
            rows = [("full", "float32", False, b) for b in (1, 2, 4)]
            rows += [("full", "bfloat16", False, b) for b in (1, 2)]
            rows += [("full", "float32", True, 2)]
            rows += [("lora", "float32", False, b) for b in (1, 2)]
            rows += [("lora", "bfloat16", False, 2), ("lora_dp", "float32", False, 2)]
        else:
            rows = [("full", "float32", False, b) for b in (1, 2)]
            rows += [("full", "bfloat16", False, 2), ("lora", "float32", False, 2)]
        out[m] = rows
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.harness import header, parse, parser, save

    p = parser(
        __doc__, "SmolLM2 only, float32, full and LoRA at batch 1 and 2, no FSDP sweep (a few minutes)"
    )
    p.add_argument("--tiny", action="store_true", help="two-layer narrow models (tests)")
    p.add_argument("--context", type=int, default=CONTEXT, help="tokens per row")
    p.add_argument(
        "--note", default="", help="a note saved with the settings (e.g. that the machine was under load)"
    )
    args = parse(p, argv)
    import jax

    from strategies.models import from_config

    backend, kind = device_kind()
    accel = backend != "cpu"
    models = dict(MODELS)
    if not accel:
        models.pop("llama-1b")
    if args.quick:
        models = {"smollm2-135m": models["smollm2-135m"]}
    if args.tiny:
        models = {k: tiny(v) for k, v in models.items()}
    context = min(args.context, 32) if args.tiny else args.context
    # One step per call: a 135M step at context 512 is seconds on a CPU, far above dispatch.
    steps, repeats = (1, 1) if args.quick else (1, 2)
    shapes = [from_config(c).config for c in models.values()]
    widths = sorted({c.hidden_size for c in shapes}) + sorted({c.intermediate_size for c in shapes})
    peak: dict[str, Any] = {}
    for dt in ("float32", "bfloat16"):
        measured = matmul_peak(tuple(widths), dt, repeats=3)
        sheet = datasheet_peak(kind, dt) if accel else None
        peak[dt] = {
            "flops": sheet if sheet else measured["flops"],
            "source": "datasheet" if sheet else f"same-run square matmul n={measured['size']}",
            "matmul_flops": measured["flops"],
            "matmul_size": measured["size"],
        }
        print(f"peak {dt}: {peak[dt]}", flush=True)

    # The mesh sweep first, in its own process while this one holds little: its steps keep every
    # simulated device's temporaries in this machine's memory at once.
    fsdp = []
    fsdp_shape = ""
    if not args.quick:
        cfg = models["smollm2-135m"]
        fb, fc = (8, MESH_CONTEXT) if not args.tiny else (8, 16)
        fsdp = run_mesh(cfg, MESH_LAYOUTS, fb, fc)
        fsdp_shape = f"SmolLM2-135M shape, batch {fb} x context {fc}, Adam, donated state"
    grid = row_grid(list(models), quick=args.quick, accel=accel)
    t0 = time.perf_counter()
    rows = []
    for model, config in models.items():
        for mode, dt, remat, b in grid[model]:
            row = measure(
                model,
                config,
                mode=mode,
                dtype=dt,
                remat=remat,
                batch=b,
                context=context,
                steps=steps,
                repeats=repeats,
            )
            rows.append(row)
            print(
                f"{model} {mode} {dt} remat={remat} b={b}: {row['tokens_per_s']:,.0f} tok/s, step "
                f"{row['step_s'] * 1e3:.0f} ms (fb {row['fwd_bwd_s'] * 1e3:.0f}, "
                f"opt {row['optimizer_s'] * 1e3:.0f}), "
                f"{row['compiled_bytes'] / 2**20:.0f} MB, compile {row['compile_s']:.0f} s",
                flush=True,
            )
    # What bounds the best full fine-tuning row of each model and dtype: its matmuls at their shapes.
    bounds = []
    for model, config in models.items():
        shape = from_config(config).config
        for dt in ("float32", "bfloat16"):
            full = [r for r in rows if r["model"] == model and r["mode"] == "full" and r["dtype"] == dt
                    and not r["remat"]]  # fmt: skip
            if full:
                best = max(full, key=lambda r: r["tokens_per_s"])
                bound = matmul_bound(shape, best["batch"], context, dt, repeats=max(repeats, 2))
                bounds.append({"model": model, **bound})
                print(f"{model} {dt} b={best['batch']}: matmuls alone {bound['matmul_s'] * 1e3:.0f} ms, "
                      f"cross-entropy {bound['xent_s'] * 1e3:.0f} ms", flush=True)  # fmt: skip
    settings = {
        "models": sorted(models),
        "context": context,
        "steps_per_call": steps,
        "repeats": repeats,
        "quick": args.quick,
        "tiny": args.tiny,
        "note": args.note,
    }
    res = {
        "backend": backend,
        "device_kind": kind,
        "peak": peak,
        "rows": rows,
        "bounds": bounds,
        "fsdp": fsdp,
        "fsdp_shape": fsdp_shape,
        "under_load": args.note,
        "total_s": time.perf_counter() - t0,
        "devices": len(jax.devices()),
    }
    md = "\n".join(header("Node step: tokens/s, MFU and memory", NAME, args.quick, settings)) + "\n"
    md += markdown(res)
    save(NAME, args.quick, res, md, settings=settings)
    print(md)
    return res
