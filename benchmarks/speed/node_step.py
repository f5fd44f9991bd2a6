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
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

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

    def loss_fn(p, b):
        p = cast_floating(p, compute) if dtype == "bfloat16" else p
        if frozen is None:
            return task.loss(p, b).astype(jnp.float32)
        return task.loss(p, b, frozen=frozen).astype(jnp.float32)

    if mode == "lora_dp":
        mask = jnp.ones((batch,), bool)

        def grad_part(p, b):
            return dpsgd.private_gradient(
                lambda q, r, k: loss_fn(q, r),
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

        def grad_part(p, b):
            return jax.value_and_grad(loss_fn)(p, b)

    grad_jit = jax.jit(grad_part)
    batch_d = {"x": x, "y": y}
    fb_s = best_time(lambda: grad_jit(single, batch_d), repeats)
    _, grads = grad_jit(single, batch_d)
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


# ----------------------------------------------------------------------------- FSDP sweep


def fsdp_child(config: Mapping[str, Any], ks: list[int], batch: int, context: int) -> list[dict[str, Any]]:
    """In a process with 8 simulated devices: per-device bytes and collectives of the compiled step."""
    import jax
    import optax

    from consensus.mesh import MeshConfig
    from strategies.models import from_config
    from strategies.trainer import NodeTrainer, compiled_bytes

    lm = from_config(dict(config))
    task: Any = RandomLMTask(lm)
    data = random_tokens(lm.config.vocab_size, 2 * batch, context)
    rows = []
    for k in ks:
        trainer = NodeTrainer(
            task,
            optax.adam,
            {"learning_rate": 1e-4},
            batch_size=batch,
            mesh=MeshConfig(data=k, fsdp=True),
            donate=True,
        )
        state = trainer.init(jax.random.key(0), None, 1)
        devices = list(trainer._mesh.devices.flat) if trainer._mesh is not None else jax.devices()[:1]
        params_b = max(_device_bytes(state.params, devices))
        opt_b = max(_device_bytes(state.opt_state, devices))
        t0 = time.perf_counter()
        compiled = trainer.lower(state, data, 1).compile()
        del state
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        rows.append(
            {
                "k": k,
                "param_bytes": params_b,
                "opt_bytes": opt_b,
                "compiled_bytes": compiled_bytes(compiled),
                "temp_bytes": int(mem.temp_size_in_bytes) if mem is not None else 0,
                "collectives": collective_bytes(compiled.as_text() or ""),
                "compile_s": compile_s,
            }
        )
        print(f"fsdp k={k}: {rows[-1]}", file=sys.stderr, flush=True)
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


def run_fsdp(config: Mapping[str, Any], ks: list[int], batch: int, context: int) -> list[dict[str, Any]]:
    """:func:`fsdp_child` in a fresh process with 8 simulated CPU devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    code = (
        "import json, sys; from benchmarks.speed.node_step import fsdp_child; "
        "a = json.loads(sys.argv[1]); "
        "print(json.dumps(fsdp_child(a['config'], a['ks'], a['batch'], a['context'])))"
    )
    arg = json.dumps({"config": dict(config), "ks": ks, "batch": batch, "context": context})
    proc = subprocess.run(
        [sys.executable, "-c", code, arg], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise RuntimeError(f"FSDP sweep failed:\n{proc.stderr[-3000:]}")
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
        one = res["fsdp"][0]
        lines += [
            "",
            f"FSDP over k simulated CPU devices ({res['fsdp_shape']}), compiled not run, per device:",
            "",
            "| k | params + optimizer MB | x (1/k of k=1) | step peak MB | temporaries MB | "
            "all-gather MB | reduce-scatter MB | all-reduce MB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in res["fsdp"]:
            po = r["param_bytes"] + r["opt_bytes"]
            ideal = (one["param_bytes"] + one["opt_bytes"]) / r["k"]
            c = r["collectives"]
            lines.append(
                f"| {r['k']} | {_mb(po)} | {po / ideal:.3f} | {_mb(r['compiled_bytes'])} | "
                f"{_mb(r['temp_bytes'])} | {_mb(c.get('all-gather', 0))} | "
                f"{_mb(c.get('reduce-scatter', 0))} | {_mb(c.get('all-reduce', 0))} |"
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
            out.append(
                f"  The bottleneck is the forward + backward itself ({fb_mfu:.1%} of the peak alone): "
                "its matmuls are (B T x 576) by (576 x 1536) or narrower, whose throughput on this "
                "machine is below the square matmul's, plus the float32 softmax over 49,152 logits per "
                "token and the attention's element-wise work (memory-bound, no FLOPs counted)."
            )
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
            out.append(
                f"  Where missed ({r['model']}, {r['dtype']}, batch {r['batch']}): LoRA's forward + "
                f"backward {r['fwd_bwd_s'] * 1e3:,.0f} ms against full's {f['fwd_bwd_s'] * 1e3:,.0f} ms, "
                f"optimizer {r['optimizer_s'] * 1e3:,.1f} ms against {f['optimizer_s'] * 1e3:,.1f} ms: LoRA "
                "skips the frozen kernels' weight gradients (a third of the matmul FLOPs) but still runs the "
                "forward and the activation gradients through every layer, and merges W + s a b into each "
                "kernel every step, so its floor is about 2/3 of full's matmul time."
            )
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
        one = res["fsdp"][0]
        worst = max(
            (r["param_bytes"] + r["opt_bytes"]) / ((one["param_bytes"] + one["opt_bytes"]) / r["k"])
            for r in res["fsdp"]
        )
        out.append(
            f"- FSDP params + optimizer per device at most {worst:.3f}x of 1/k of one device's (target 1.2): "
            f"{'met' if worst <= 1.2 else 'missed'}."
        )
    if res.get("under_load"):
        out.append(f"- {res['under_load']}")
    return out


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
    fsdp = []
    fsdp_shape = ""
    if not args.quick:
        cfg = models["smollm2-135m"]
        fb, fc = (8, 128) if not args.tiny else (8, 16)
        fsdp = run_fsdp(cfg, [1, 2, 4, 8], fb, fc)
        fsdp_shape = f"SmolLM2-135M shape, batch {fb} x context {fc}, Adam, donated state"
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
