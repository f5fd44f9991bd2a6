"""Merge methods on transformers-written checkpoints: time and peak RSS per method vs the read-once floor.

Builds a GPT-2 model from a config with random weights (``transformers``' ``GPT2LMHeadModel``;
nothing is downloaded): by default distilgpt2's shape (6 layers, 768 wide, 50257-token
vocabulary: 82M parameters, 328 MB in float32), ``--quick`` a tiny one (2 layers, 64 wide,
1000 tokens: about 0.7 MB). The base is that model; ``--models`` fine-tunes are the base plus
small random deltas (each tensor + N(0, (1e-3 * its std)^2)). Every folder is written with
``save_pretrained`` (safetensors, sharded at ``--shard-mb``). Then, each in its own child process
(``python -m benchmarks.speed.merge_io --child-cli``, which reports its own ``VmHWM``):

* the **read-once floor**: read every tensor of every input once with safetensors' numpy API,
  no jax (best of two), with and without the base;
* a child that only imports jax and the package (jax's start-up);
* ``meta-consensus merge --method M [--base BASE]`` for every method of ``--methods`` (the base
  given where the method needs one), each method's defaults (ties density 0.2, DARE's 0.5).

Reported per method: wall seconds of the whole child (start-up, compilation, reads and writes),
the ratio to the floor of the same inputs, the peak RSS, and the ratio of that RSS to the
median rule's (chunked, element-wise; the median over the methods run when it is not run).
Beside it, mergekit's behaviour for the same method as its README and code describe it
(mergekit is not run here). Shared machine: the numbers are
indicative (``load_average`` in the JSON).

    python -m benchmarks merge_methods_hf [--quick] [--models 5] [--methods linear,ties,...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_METHODS = (
    "linear",
    "task_arithmetic",
    "ties",
    "dare_linear",
    "dare_ties",
    "median",
    "model_stock",
)

# mergekit 0.1.5's methods that run tensor by tensor from ``--mergekit-config`` (no --method of their
# own), with the per-model and shared parameters each benchmark config gives them.
MERGEKIT_ONLY: dict[str, tuple[dict[str, Any], dict[str, Any], int | None]] = {
    "breadcrumbs": ({"weight": 0.5, "density": 0.5, "gamma": 0.01}, {}, None),
    "breadcrumbs_ties": ({"weight": 0.5, "density": 0.5, "gamma": 0.01}, {}, None),
    "della": ({"weight": 0.5, "density": 0.5, "epsilon": 0.1}, {}, None),
    "della_linear": ({"weight": 0.5, "density": 0.5, "epsilon": 0.1}, {}, None),
    "ties_per_model": ({"weight": 0.5, "density": [0.3, 0.7]}, {}, None),  # ties with a density gradient
    "sce": ({}, {"select_topk": 0.5}, None),
    "ram": ({}, {"epsilon": 1e-5}, None),
    "nuslerp": ({"weight": 0.5}, {}, 2),
    "multislerp": ({"weight": 0.5}, {}, None),
    "nearswap": ({}, {"t": 1e-4}, 1),
    "arcee_fusion": ({}, {}, 1),
    "slerp": ({}, {"t": [0.0, 0.5, 1.0]}, 1),  # a gradient: tensor by tensor, not the plan-based merge
    "ramplus_tl": ({}, {"epsilon": 1e-5}, None),
}

MERGEKIT_SOURCES = {
    "readme": "github:arcee-ai/mergekit README.md ('out-of-core approach', 'Lazy loading of tensors for "
    "low memory use', 'Merges can be run entirely on CPU')",
    "code": "github:arcee-ai/mergekit mergekit/merge_methods/generalized_task_arithmetic.py "
    "(per tensor: the n deltas are stacked with torch.stack, weighted, sign mask, sum)",
}

# What mergekit does for each method, from the sources above (not measured here).
MERGEKIT = {
    "linear": "linear: per tensor, the n tensors loaded lazily and combined on CPU",
    "task_arithmetic": "task_arithmetic: per tensor, n deltas stacked (torch.stack), weighted sum",
    "ties": "ties: per tensor, each delta trimmed to its top density by magnitude (whole tensor), "
    "n deltas stacked, sign election, disjoint mean: several n-stacks of the tensor",
    "dare_linear": "dare_linear: per tensor, random drop and rescale of each delta, n deltas stacked, sum",
    "dare_ties": "dare_ties: per tensor, random drop and rescale, then TIES' election over the n-stack",
    "median": "no median method",
    "model_stock": "model_stock: per tensor, cosines of the n deltas, then a base/average interpolation",
}


def _mergekit_yaml(name: str, inputs: list[str], base: str, per: dict, shared: dict) -> str:
    """A mergekit configuration merging ``inputs`` over ``base`` with ``name`` (JSON is YAML)."""
    method = "ties" if name == "ties_per_model" else name
    models = [{"model": m, **({"parameters": per} if per else {})} for m in inputs]
    doc = {"merge_method": method, "base_model": base, "models": models, "parameters": shared}
    if name == "nuslerp":
        doc.pop("base_model")
    return json.dumps(doc)


def model_config(quick: bool) -> dict[str, int]:
    """GPT-2 config: distilgpt2's shape (82M parameters), or a tiny one for ``--quick``."""
    if quick:
        return {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 128}
    return {"n_layer": 6, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}


def write_models(folder: Path, config: dict[str, int], count: int, shard_mb: int, seed: int = 0) -> dict:
    """The base and ``count`` fine-tunes as transformers folders; (base, inputs, parameters, bytes)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**config))
    model.eval()
    shard = f"{shard_mb}MB"
    base = folder / "base"
    model.save_pretrained(base, max_shard_size=shard, safe_serialization=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    inputs = []
    for i in range(count):
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(state[name] + torch.randn_like(p) * (1e-3 * float(state[name].std()) + 1e-6))
        path = folder / f"finetune_{i}"
        model.save_pretrained(path, max_shard_size=shard, safe_serialization=True)
        inputs.append(str(path))
    nbytes = sum(f.stat().st_size for f in Path(inputs[0]).glob("*.safetensors"))
    return {"base": str(base), "inputs": inputs, "parameters": params, "model_bytes": nbytes}


def _merge_io(*args: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.speed.merge_io", *args]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.harness import parse, parser, save
    from benchmarks.speed.merge_io import run_child

    p: argparse.ArgumentParser = parser(__doc__, "a tiny GPT-2 (about 0.7 MB), 5 fine-tunes")
    p.add_argument("--models", type=int, default=5)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated merge methods")
    p.add_argument(
        "--mergekit-methods",
        default=",".join(MERGEKIT_ONLY),
        help="comma-separated mergekit methods run from a --mergekit-config (tensor by tensor); '' for none",
    )
    p.add_argument(
        "--shard-mb", type=int, default=None, help="save_pretrained shard size (default 100; quick 1)"
    )
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "merge_methods_hf")
    p.add_argument("--keep", action="store_true", help="keep the generated checkpoints and merges")
    args = parse(p, argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    config = model_config(args.quick)
    shard_mb = args.shard_mb if args.shard_mb is not None else (1 if args.quick else 100)
    args.workdir.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=args.workdir))
    from consensus.registry import RULES

    try:
        t0 = time.perf_counter()
        models = write_models(folder, config, args.models, shard_mb)
        write_s = time.perf_counter() - t0
        inputs, base = models["inputs"], models["base"]
        print(
            f"wrote {args.models} + 1 GPT-2 models of {models['parameters'] / 1e6:.1f}M parameters "
            f"({models['model_bytes'] / 1e6:.1f} MB) in {write_s:.0f} s",
            flush=True,
        )
        start = run_child(_merge_io("--child-import"))
        start["seconds"] = json.loads(start["last_line"])["seconds"]
        floors = {
            False: min(
                (run_child(_merge_io("--child-floor", *inputs)) for _ in range(2)), key=lambda r: r["wall_s"]
            ),
            True: min(
                (run_child(_merge_io("--child-floor", *inputs, base)) for _ in range(2)),
                key=lambda r: r["wall_s"],
            ),
        }
        runs: dict[str, dict[str, Any]] = {}
        for method in methods:
            with_base = RULES[method].needs_base
            cmd = [
                *_merge_io("--child-cli", "merge", "--quiet", "--method", method),
                *(("--base", base) if with_base else ()),
                *("--out", str(folder / f"out_{method}"), *inputs),
            ]
            try:
                r = run_child(cmd)
                r["ok"] = True
            except RuntimeError as e:  # a crash is a result: recorded, and the run goes on
                r = {"ok": False, "error": str(e)[-500:], "wall_s": float("nan"), "peak_rss_gb": float("nan")}
            r["base"] = with_base
            runs[method] = r
            shutil.rmtree(folder / f"out_{method}", ignore_errors=True)
            print(
                f"{method}: {r['wall_s']:.1f} s, {r['peak_rss_gb']:.3f} GB" + ("" if r["ok"] else " FAILED"),
                flush=True,
            )
        for name in [m for m in args.mergekit_methods.split(",") if m]:
            per, shared, count = MERGEKIT_ONLY[name]
            cfg = folder / f"{name}.yml"
            cfg.write_text(_mergekit_yaml(name, inputs[: count or len(inputs)], base, per, shared))
            cmd = [
                *_merge_io("--child-cli", "merge", "--quiet", "--mergekit-config", str(cfg)),
                *("--out", str(folder / f"out_{name}"), "--seed", "1"),
            ]
            try:
                r = run_child(cmd)
                r["ok"] = True
            except RuntimeError as e:
                r = {"ok": False, "error": str(e)[-500:], "wall_s": float("nan"), "peak_rss_gb": float("nan")}
            r["base"] = True
            runs[f"mergekit:{name}"] = r
            shutil.rmtree(folder / f"out_{name}", ignore_errors=True)
            print(
                f"mergekit:{name}: {r['wall_s']:.1f} s, {r['peak_rss_gb']:.3f} GB"
                + ("" if r["ok"] else " FAILED"),
                flush=True,
            )
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    ok_rss = [r["peak_rss_gb"] for r in runs.values() if r["ok"]]
    median_rss = statistics.median(ok_rss) if ok_rss else float("nan")
    # The issue's bound: TIES' peak RSS within 1.5x that of the median rule (element-wise, chunked);
    # without a median run, the median over the methods run.
    if runs.get("median", {}).get("ok"):
        ref_name, ref_rss = "median rule", runs["median"]["peak_rss_gb"]
    else:
        ref_name, ref_rss = "median of the methods' RSS", median_rss
    results = {}
    for method, r in runs.items():
        floor = floors[r["base"]]
        results[method] = {
            "ok": r["ok"],
            "base": r["base"],
            "wall_s": r["wall_s"],
            "ratio_to_floor": r["wall_s"] / floor["wall_s"],
            "wall_s_without_jax_startup": max(r["wall_s"] - start["seconds"], 0.0),
            "peak_rss_gb": r["peak_rss_gb"],
            "rss_ratio_to_reference": r["peak_rss_gb"] / ref_rss,
            "mergekit": MERGEKIT.get(
                method,
                "mergekit 0.1.5 method, run from --mergekit-config"
                if method.startswith("mergekit:")
                else "not listed",
            ),
            **({} if r["ok"] else {"error": r["error"]}),
        }
    floor_rows = {
        "inputs": {"wall_s": floors[False]["wall_s"], "peak_rss_gb": floors[False]["peak_rss_gb"]},
        "inputs + base": {"wall_s": floors[True]["wall_s"], "peak_rss_gb": floors[True]["peak_rss_gb"]},
    }
    settings = {
        "model": "transformers GPT2LMHeadModel from a config, random weights",
        "config": config,
        "parameters": models["parameters"],
        "model_mb": models["model_bytes"] / 1e6,
        "fine_tunes": args.models,
        "deltas": "each tensor + N(0, (1e-3 std)^2)",
        "shard_mb": shard_mb,
        "dtype": "float32",
        "methods": methods,
        "method_params": "each method's defaults (ties density 0.2, dare_* density 0.5), --seed 0",
        "write_seconds": write_s,
        "jax_import_seconds": start["seconds"],
        "jax_import_peak_rss_gb": start["peak_rss_gb"],
        "page_cache": "warm (inputs just written)",
        "indicative": "shared machine (2 cores shared with other work): timings are indicative",
    }
    payload = {
        "results": results,
        "floor": floor_rows,
        "median_rss_of_methods_gb": median_rss,
        "rss_reference": {"name": ref_name, "peak_rss_gb": ref_rss},
        "mergekit_sources": MERGEKIT_SOURCES,
    }
    md = markdown({**payload, "settings": settings})
    save("merge_methods_hf", args.quick, payload, md, settings=settings)
    print(md)
    return payload


def markdown(res: Mapping[str, Any]) -> str:
    """The page of one result file: each method's time and peak RSS against the read-once floor.

    Args:
        res: the result file as written (``results``: method -> its numbers; ``floor``,
            ``rss_reference``, ``mergekit_sources``; ``settings`` with jax's start-up).

    Returns:
        The markdown: a title, the table, jax's start-up, the extremes and the mergekit sources.
    """
    st, results, sources = res["settings"], res["results"], res["mergekit_sources"]
    ref_name = res["rss_reference"]["name"]
    lines = [
        "# Merge methods on transformers checkpoints vs the read-once floor",
        "",
        f"{st['fine_tunes']} fine-tunes of a GPT-2 of {st['parameters'] / 1e6:.1f}M parameters "
        f"({st['model_mb']:.1f} MB in {st['dtype']}, written by `save_pretrained` in {st['shard_mb']} MB "
        "shards), merged by `meta-consensus merge` in a child process; wall time of the whole child "
        "(start-up, compilation, reads and writes) over the floor of the same inputs (a child that reads "
        "every tensor once, the base included where the method needs it). Peak RSS: the child's own VmHWM.",
        "",
        f"| method | base | wall s | x floor | s without jax start-up | peak RSS GB | RSS / {ref_name} "
        "| mergekit (documented, not run) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, f in res["floor"].items():
        lines.append(
            f"| read-once floor ({name}) | | {f['wall_s']:.2f} | 1.00 | | {f['peak_rss_gb']:.3f} | | |"
        )
    for method, r in results.items():
        status = "" if r["ok"] else " (FAILED)"
        lines.append(
            f"| {method}{status} | {'yes' if r['base'] else 'no'} | {r['wall_s']:.2f} "
            f"| {r['ratio_to_floor']:.2f} "
            f"| {r['wall_s_without_jax_startup']:.2f} | {r['peak_rss_gb']:.3f} "
            f"| {r['rss_ratio_to_reference']:.2f} | {r['mergekit']} |"
        )
    lines += [
        "",
        f"jax start-up (a child that only imports jax and the package): {st['jax_import_seconds']:.1f} s, "
        f"{st['jax_import_peak_rss_gb']:.3f} GB RSS, included in every merge row. The floor children read "
        "with safetensors' numpy API and import no jax.",
    ]
    ok = {m: r for m, r in results.items() if r["ok"]}
    if ok:
        fast = min(ok, key=lambda m: ok[m]["ratio_to_floor"])
        slow = max(ok, key=lambda m: ok[m]["ratio_to_floor"])
        big = max(ok, key=lambda m: ok[m]["peak_rss_gb"])
        lines += [
            "",
            f"Fastest against its floor: {fast} ({ok[fast]['ratio_to_floor']:.2f}x); slowest: {slow} "
            f"({ok[slow]['ratio_to_floor']:.2f}x). Largest peak RSS: {big} ({ok[big]['peak_rss_gb']:.3f} GB, "
            f"RSS / {ref_name} = {ok[big]['rss_ratio_to_reference']:.2f}).",
        ]
    failed = [m for m, r in results.items() if not r["ok"]]
    if failed:
        lines += ["", "Failed: " + "; ".join(f"{m}: {results[m].get('error', '')}" for m in failed)]
    lines += ["", f"mergekit column: from {sources['readme']} and {sources['code']}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
