"""Out-of-core merge benchmark: ``meta-consensus merge`` over large safetensors checkpoints vs the I/O floor.

Writes ``--models`` synthetic float32 checkpoints of ``--gb`` each (a transformer-like
layout: per layer four (H, H) attention matrices, (H, 4H) and (4H, H) MLP matrices and
four (H,) norm vectors, so many leaves of mixed sizes) plus a base checkpoint, then
runs, each in its own child process:

* the **I/O floor**: read every tensor of every input once with the safetensors numpy
  API (``safe_open(...).get_tensor``), nothing else (best of two such children);
* ``meta-consensus merge --method median`` over the inputs;
* ``meta-consensus merge --method task_arithmetic --base BASE`` (the floor of this one
  also reads the base).
* ``meta-consensus merge --method krum --num-byzantine 1`` (a vector rule: a Gram pass for
  the whole-model weights, then the weighted pass; no target, shown for its two reads).

Reported per run: wall seconds of the whole child process (start-up, jax import and
compilation included), the ratio to the floor measured in the same run, and the
child's peak RSS: ``VmHWM`` of ``/proc/self/status``, read by the child itself as it
exits (the high-water mark of its own address space since its exec, so this process's
memory does not count; ``ru_maxrss`` of ``wait4`` would not do: Linux folds the
parent's RSS at fork into the child's). A child that only imports jax and the package gives the
start-up cost and the RSS floor of a jax process. The inputs stay in the page cache
between runs (they were just written; the machine is not asked to drop caches), so
every run reads from memory: the floor is the cost of one pass over the bytes.

    python -m benchmarks merge_io [--quick] [--models 8] [--gb 1.0] [--workdir /tmp/merge_io]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RATIO_TARGET = 2.0
RSS_TARGET_GB = 2.0


def layout(total_bytes: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """Leaf name -> shape of a float32 model of about ``total_bytes`` (at least one layer)."""
    h = hidden
    per_layer = {
        "attn.q.kernel": (h, h),
        "attn.k.kernel": (h, h),
        "attn.v.kernel": (h, h),
        "attn.o.kernel": (h, h),
        "mlp.up.kernel": (h, 4 * h),
        "mlp.down.kernel": (4 * h, h),
        "norm_1.scale": (h,),
        "norm_1.bias": (h,),
        "norm_2.scale": (h,),
        "norm_2.bias": (h,),
    }
    layer_bytes = 4 * sum(int(_prod(s)) for s in per_layer.values())
    layers = max(1, round(total_bytes / layer_bytes))
    return {f"layers.{i}.{k}": s for i in range(layers) for k, s in per_layer.items()}


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def write_models(folder: Path, shapes: dict[str, tuple[int, ...]], count: int, seed: int = 0) -> list[str]:
    """``count`` node checkpoints and their base (last path), all written leaf by leaf (bounded memory).

    Leaf j of the base is normal noise from ``fold_in(key(seed), j)``; node i is the base
    plus 0.01 times a second noise leaf (``fold_in(key(seed + 1), j)``) rolled by i, so the
    nodes differ like fine-tunes of one base without drawing n fresh leaves.
    """
    import contextlib

    import jax
    import numpy as np

    from consensus.io import ShardedWriter, atomic_directory

    base_key, noise_key = jax.random.key(seed), jax.random.key(seed + 1)
    specs = {k: (s, np.dtype(np.float32)) for k, s in shapes.items()}
    normal = jax.jit(lambda k, shape: jax.random.normal(k, shape, jax.numpy.float32), static_argnums=1)
    targets = [folder / f"node_{i}" for i in range(count)] + [folder / "base"]
    with contextlib.ExitStack() as stack:
        writers = [ShardedWriter(stack.enter_context(atomic_directory(t)), specs) for t in targets]
        for j, (k, shape) in enumerate(shapes.items()):
            base = np.asarray(normal(jax.random.fold_in(base_key, j), shape))
            noise = np.asarray(normal(jax.random.fold_in(noise_key, j), shape)).ravel()
            for i in range(count):
                writers[i].write(k, base + 0.01 * np.roll(noise, i).reshape(shape))
            writers[-1].write(k, base)
        for w in writers:
            w.close()
    return [str(t) for t in targets]


# ----------------------------------------------------------------------------- children


def _floor_child(paths: list[str]) -> None:
    """Read every tensor of every checkpoint once (the safetensors numpy API) and report the seconds."""
    from safetensors import safe_open  # no jax: the floor is python and the reader alone

    start = time.perf_counter()
    total = 0
    for p in paths:
        for f in sorted(Path(p).glob("*.safetensors")):
            with safe_open(str(f), framework="np") as handle:
                for k in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    total += handle.get_tensor(k).nbytes
    print(json.dumps({"seconds": time.perf_counter() - start, "bytes": total, "vmhwm_kb": _vmhwm_kb()}))


def _vmhwm_kb() -> int:
    """This process's peak resident set size in KiB (Linux ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _cli_child(args: list[str]) -> int:
    """``meta-consensus ARGS`` in this process, then its peak RSS as the last output line."""
    from meta_consensus.cli import main as cli_main

    rc = cli_main(args)
    sys.stdout.flush()
    print(json.dumps({"rc": rc, "vmhwm_kb": _vmhwm_kb()}))
    return rc


def _import_child() -> None:
    start = time.perf_counter()
    import jax

    import consensus  # noqa: F401
    from meta_consensus import merge  # noqa: F401

    jax.numpy.zeros(1).block_until_ready()
    print(json.dumps({"seconds": time.perf_counter() - start, "vmhwm_kb": _vmhwm_kb()}))


def run_child(argv: list[str]) -> dict[str, Any]:
    """Run ``argv`` as a child process: its wall seconds, its own peak RSS and its last output line."""
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "TQDM_DISABLE": "1"}
        )
        proc.wait()
        wall = time.perf_counter() - start
        out.seek(0)
        text = out.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:4]}... exited {proc.returncode}:\n{text[-2000:]}")
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return {"wall_s": wall, "peak_rss_gb": json.loads(last)["vmhwm_kb"] * 1024 / 1e9, "last_line": last}


def _me(*args: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.speed.merge_io", *args]


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--child-floor"]:
        _floor_child(argv[1:])
        return {}
    if argv[:1] == ["--child-import"]:
        _import_child()
        return {}
    if argv[:1] == ["--child-cli"]:
        sys.exit(_cli_child(argv[1:]))
    from benchmarks.harness import parse, parser, save  # imports jax: not in the floor child

    p: argparse.ArgumentParser = parser(__doc__, "8 models of 32 MB")
    p.add_argument("--models", type=int, default=8)
    p.add_argument(
        "--gb", type=float, default=None, help="size of each model in GB (default 1.0; quick 0.032)"
    )
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "merge_io")
    p.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    args = parse(p, argv)
    gb = args.gb if args.gb is not None else (0.032 if args.quick else 1.0)
    hidden = 256 if args.quick else 1024
    shapes = layout(int(gb * 1e9), hidden)
    model_bytes = 4 * sum(_prod(s) for s in shapes.values())
    need = (args.models + 4) * model_bytes  # inputs, base, three outputs
    args.workdir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.workdir).free
    if need > 0.8 * free:
        raise SystemExit(f"merge_io: needs {need / 1e9:.1f} GB in {args.workdir}, {free / 1e9:.1f} GB free")
    folder = Path(tempfile.mkdtemp(dir=args.workdir))
    try:
        t0 = time.perf_counter()
        paths = write_models(folder, shapes, args.models)
        write_s = time.perf_counter() - t0
        inputs, base = paths[:-1], paths[-1]
        print(
            f"wrote {args.models} + 1 models of {model_bytes / 1e9:.3f} GB ({len(shapes)} leaves) "
            f"in {write_s:.0f} s"
        )
        start = run_child(_me("--child-import"))
        start["seconds"] = json.loads(start["last_line"])["seconds"]
        # The floor is the best of two passes (it varies most on a shared machine); the lower the floor,
        # the harder the ratio target.
        floor = min((run_child(_me("--child-floor", *inputs)) for _ in range(2)), key=lambda r: r["wall_s"])
        floor_base = min(
            (run_child(_me("--child-floor", *inputs, base)) for _ in range(2)), key=lambda r: r["wall_s"]
        )
        merge = _me("--child-cli", "merge", "--quiet")  # meta-consensus merge, reporting its VmHWM
        median = run_child([*merge, "--method", "median", "--out", str(folder / "out_median"), *inputs])
        arith = run_child(
            [
                *merge,
                *("--method", "task_arithmetic", "--set", "method.scale=0.3", "--base", base),
                *("--out", str(folder / "out_task_arithmetic"), *inputs),
            ]
        )
        # A vector rule: a Gram pass for the whole-model weights, then the weighted pass (no target).
        krum = run_child(
            [*merge, "--method", "krum", "--num-byzantine", "1", "--out", str(folder / "out_krum"), *inputs]
        )
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    rows = [
        ("I/O floor (inputs)", floor, floor),
        ("I/O floor (inputs + base)", floor_base, floor_base),
        ("merge median", median, floor),
        ("merge task_arithmetic (+ base)", arith, floor_base),
        ("merge krum, f = 1 (two passes; no target)", krum, floor),
    ]
    results = {
        name: {
            "wall_s": r["wall_s"],
            "ratio_to_floor": r["wall_s"] / ref["wall_s"],
            # The merge child pays jax's start-up, which the floor (no jax) does not.
            "ratio_without_jax_startup": max(r["wall_s"] - (start["seconds"] if r is not ref else 0.0), 0.0)
            / ref["wall_s"],
            "peak_rss_gb": r["peak_rss_gb"],
        }
        for name, r, ref in rows
    }
    settings = {
        "models": args.models,
        "model_gb": model_bytes / 1e9,
        "leaves_per_model": len(shapes),
        "hidden": hidden,
        "dtype": "float32",
        "input_gb_total": args.models * model_bytes / 1e9,
        "write_seconds": write_s,
        "jax_import_seconds": start["seconds"],
        "jax_import_peak_rss_gb": start["peak_rss_gb"],
        "page_cache": "warm (inputs just written; caches not dropped)",
        "targets": {"ratio_to_floor": RATIO_TARGET, "peak_rss_gb": RSS_TARGET_GB},
    }
    res = {"results": results}
    md = markdown({**res, "settings": settings})
    save("merge_io", args.quick, res, md, settings=settings)
    print(md)
    return res


def markdown(res: Mapping[str, Any]) -> str:
    """The page of one result file: each run's wall time and peak RSS against the I/O floor.

    Args:
        res: the result file as written (``results``: run name -> its numbers; ``settings`` with
            jax's start-up and the targets).

    Returns:
        The markdown: a title, the table, jax's start-up and the runs above their targets.
    """
    st = res["settings"]
    lines = [
        "# Out-of-core merge vs the I/O floor",
        "",
        f"{st['models']} checkpoints of {st['model_gb']:.2f} GB ({st['dtype']}, "
        f"{st['leaves_per_model']} leaves each), merged by `meta-consensus merge` in a child process; "
        "wall time of the whole child "
        "(start-up, jax import and compilation included) over the floor of the same files (the base "
        "included where the merge reads it): a child that reads every tensor "
        "once with safetensors' numpy API and imports no jax (best of two). Peak RSS: the child's own "
        f"VmHWM. Page cache: {st['page_cache']}.",
        "",
        "| run | wall s | x floor | x floor, jax start-up excluded | peak RSS GB |",
        "|---|---|---|---|---|",
    ]
    for name, r in res["results"].items():
        lines.append(
            f"| {name} | {r['wall_s']:.1f} | {r['ratio_to_floor']:.2f} | "
            f"{r['ratio_without_jax_startup']:.2f} | {r['peak_rss_gb']:.2f} |"
        )
    lines += [
        "",
        f"A child that only imports jax and the package: {st['jax_import_seconds']:.1f} s, "
        f"{st['jax_import_peak_rss_gb']:.2f} GB RSS (included in the merge rows' wall and RSS).",
    ]
    targets = st.get("targets")
    if targets:
        judged = {k: r for k, r in res["results"].items() if k.startswith("merge") and "no target" not in k}
        slow = [
            f"{k} ({r['ratio_to_floor']:.2f}x; {r['ratio_without_jax_startup']:.2f}x without jax's start-up)"
            for k, r in judged.items()
            if r["ratio_to_floor"] > targets["ratio_to_floor"]
        ]
        big = [
            f"{k} ({r['peak_rss_gb']:.2f} GB)"
            for k, r in judged.items()
            if r["peak_rss_gb"] > targets["peak_rss_gb"]
        ]
        lines += [
            "",
            f"Targets for the merges that have one: at most {targets['ratio_to_floor']:g}x the floor "
            f"and {targets['peak_rss_gb']:g} GB peak RSS. "
            + (
                f"Above the time target: {'; '.join(slow)}. "
                if slow
                else f"All {len(judged)} merges are within the time target. "
            )
            + (
                f"Above the RSS target: {'; '.join(big)}."
                if big
                else f"All {len(judged)} merges are within the RSS target."
            ),
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
