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


def flat_products(stacked, s):
    """(n, D): every node's dense updates over all targets, flattened (for the robust references)."""
    fs = f64(stacked)
    return np.concatenate([products(f, s).reshape(len(s), -1) for f in fs.values()], axis=1)


def split_flat(x, stacked):
    """Undo :func:`flat_products` for one row: {target: (in, out)}."""
    out, at = {}, 0
    for t, f in stacked.items():
        fan_in, fan_out = np.shape(f["a"])[1], np.shape(f["b"])[2]
        out[t] = x[at : at + fan_in * fan_out].reshape(fan_in, fan_out)
        at += fan_in * fan_out
    return out


def peft_split(w, s):
    c = w * s
    return np.sign(c + (c == 0)) * np.sqrt(np.abs(c)), np.sqrt(np.abs(c))


def peft_linear(f, s, w):
    """PEFT's linear: A = sum sign(c) sqrt|c| A_i, B = sum sqrt|c| B_i with c = w s; update A B (scale 1)."""
    ca, cb = peft_split(w, s)
    a = sum(ca[i] * f["a"][i] for i in range(len(w)))
    b = sum(cb[i] * f["b"][i] for i in range(len(w)))
    return a @ b


def peft_ties_factor(x, c, density, sign_method="total"):
    """PEFT's merge_utils.ties on one factor stack x (n, ...): top-k trim, sign election, disjoint mean."""
    pruned = []
    for xi in x:
        k = int(density * xi.size)
        flat = xi.reshape(-1)
        keep = np.zeros(flat.size, bool)
        keep[np.argsort(-np.abs(flat), kind="stable")[:k]] = True
        pruned.append(np.where(keep, flat, 0.0).reshape(xi.shape))
    p = np.stack(pruned)
    mag = p.sum(0) if sign_method == "total" else np.sign(p).sum(0)
    major = np.where(mag >= 0, 1.0, -1.0)
    agree = np.sign(p) == major
    weighted = c.reshape((-1,) + (1,) * (p.ndim - 1)) * p
    return (weighted * agree).sum(0) / np.maximum(agree.sum(0), 1)
