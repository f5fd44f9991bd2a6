"""Float64 numpy references of the LoRA adapter methods, written from the papers' formulas.

Adapters are dicts ``{target: {"a": (n, in, r), "b": (n, r, out)}}`` of float64 arrays; each
reference loops over nodes in the most literal way and forms dense products where the paper does.
"""

from __future__ import annotations

import numpy as np


def f64(stacked):
    return {t: {k: np.asarray(v, np.float64) for k, v in f.items()} for t, f in stacked.items()}


def products(f, s):
    """The nodes' dense updates P_i = s_i a_i b_i, (n, in, out)."""
    return np.stack([s[i] * f["a"][i] @ f["b"][i] for i in range(len(s))])


def weighted_product_sum(f, s, w):
    return sum(w[i] * s[i] * f["a"][i] @ f["b"][i] for i in range(len(w)))


def fedit(f, s, w):
    """FedIT: a = sum w_i a_i, b = sum w_i (s_i / s_0) b_i; update s_0 a b."""
    a = sum(w[i] * f["a"][i] for i in range(len(w)))
    b = sum(w[i] * s[i] / s[0] * f["b"][i] for i in range(len(w)))
    return s[0] * a @ b


def brute_gram(stacked, s):
    """G_ij = sum over targets of <P_i, P_j>_F from the dense products."""
    total = 0.0
    for f in f64(stacked).values():
        p = products(f, s).reshape(len(s), -1)
        total = total + p @ p.T
    return total


def truncated(m, rank):
    """Eckart-Young: the best rank-``rank`` approximation of m and the discarded sum of sigma^2."""
    u, sv, vt = np.linalg.svd(m, full_matrices=False)
    return (u[:, :rank] * sv[:rank]) @ vt[:rank], float(np.sum(sv[rank:] ** 2))
