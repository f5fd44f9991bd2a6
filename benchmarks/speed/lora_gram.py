"""Speed of the LoRA products' Gram matrix from the factors against the dense products.

Run ``python -m benchmarks lora_gram [--quick]``. Writes benchmarks/results/lora_gram.json and
lora_gram.md (``lora_gram_quick.*`` with --quick: 2 targets of 1024 x 1024 instead of 8 of
4096 x 4096).

The robust rules on LoRA adapters (:mod:`consensus.lora.robust`) need the n x n Gram matrix of the
nodes' updates ``P_i = s a_i b_i`` summed over the adapted kernels. :func:`consensus.lora.product_gram`
forms it from the factors, ``<P_i, P_j> = s^2 sum((a_i^T a_j) * (b_i b_j^T))``, in
O(n^2 r^2 (in + out)) per kernel; the baseline forms every dense product (in, out) and their Gram
matrix, O(n in out (r + n)). Both in float64 numpy on the host, on one BLAS thread (threadpoolctl:
a shared 2-core machine makes multi-threaded small products erratic), best of 7 and of 3, in the
same run: the ratio (dense / factors) is the result; absolute times vary with the machine. The
two matrices must agree (relative difference reported).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from benchmarks.harness import best_time, header, markdown_table, parse, parser, save
from consensus.lora import product_gram

NAME = "lora_gram"


def dense_gram(stacked: dict[str, dict[str, np.ndarray]], scale: float) -> np.ndarray:
    """The baseline: every node's dense product per target, then their Gram matrix."""
    total = 0.0
    for f in stacked.values():
        a, b = np.asarray(f["a"], np.float64), np.asarray(f["b"], np.float64)
        p = (scale * np.matmul(a, b)).reshape(a.shape[0], -1)
        total = total + p @ p.T
    return np.asarray(total)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(parser(__doc__, "2 targets of 1024 x 1024 instead of 8 of 4096 x 4096"), argv)
    targets, dim = (2, 1024) if args.quick else (8, 4096)
    cases = [(8, 8), (8, 16), (16, 16)]
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    rows = []
    for n, r in cases:
        stacked = {
            f"layers/{t}/kernel": {
                "a": rng.standard_normal((n, dim, r), dtype=np.float32),
                "b": rng.standard_normal((n, r, dim), dtype=np.float32),
            }
            for t in range(targets)
        }
        with threadpool_limits(1):
            factors = best_time(functools.partial(product_gram, stacked, 0.5), 7, warmup=2)
            dense = best_time(functools.partial(dense_gram, stacked, 0.5), 3)
        g_f, g_d = product_gram(stacked, 0.5), dense_gram(stacked, 0.5)
        diff = float(np.abs(g_f - g_d).max() / np.abs(g_d).max())
        rows.append(
            {
                "n": n,
                "r": r,
                "factors_s": factors,
                "dense_s": dense,
                "ratio": dense / factors,
                "rel_diff": diff,
            }
        )
        print(
            f"n={n} r={r}: factors {factors * 1e3:.1f} ms, dense {dense * 1e3:.1f} ms, "
            f"{dense / factors:.0f}x",
            flush=True,
        )
    settings = {
        "targets": targets,
        "in = out": dim,
        "dtype": "float32 factors, float64 Gram",
        "quick": args.quick,
    }
    lines = header("LoRA product Gram: from the factors vs dense products", NAME, args.quick, settings)
    lines += [
        "One BLAS thread; best of 7 (factors) and 3 (dense) in one run; ratio = dense / factors "
        "(higher: the factors' Gram is faster).",
        "",
        markdown_table(
            ["n", "r", "factors (ms)", "dense (ms)", "dense / factors", "max rel. difference"],
            [
                [
                    x["n"],
                    x["r"],
                    f"{x['factors_s'] * 1e3:.1f}",
                    f"{x['dense_s'] * 1e3:.1f}",
                    f"{x['ratio']:.0f}x",
                    f"{x['rel_diff']:.1e}",
                ]
                for x in rows
            ],
        ),
    ]
    md = "\n".join(lines) + "\n"
    res = {"rows": rows, "total_s": time.perf_counter() - t0}
    save(NAME, args.quick, res, md, settings=settings)
    print(md)
    return res
