"""Float64 numpy references of every kernel and rule, written independently of the library.

They work on (n, d) float64 matrices (a stacked tree flattened per node) and
loop in the most literal way the papers describe, favouring clarity over speed.
"""

from __future__ import annotations

import jax
import numpy as np


def flatten_stacked(stacked) -> np.ndarray:
    leaves = jax.tree_util.tree_leaves(stacked)
    n = leaves[0].shape[0]
    return np.concatenate([np.asarray(x, np.float64).reshape(n, -1) for x in leaves], axis=1)


def flatten_tree(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in jax.tree_util.tree_leaves(tree)])


def finite_rows(X):
    return np.isfinite(X).all(axis=1)


def mean(X, valid):
    return X[valid].mean(axis=0)


def median(X, valid):
    return np.median(X[valid], axis=0)


def trimmed_mean(X, f, valid):
    S = np.sort(X[valid], axis=0)
    m = S.shape[0]
    return S[f : m - f].mean(axis=0)


def interquartile_mean(X, valid):
    """Per column, the mean of the sorted valid values at ranks [m // 4, m - m // 4)."""
    m = int(valid.sum())
    return trimmed_mean(X, m // 4, valid)


def sq_dists(X):
    n = X.shape[0]
    D = np.zeros((n, n))
    with np.errstate(invalid="ignore"):  # a row with an Inf gives NaN distances; callers skip invalid rows
        for i in range(n):
            for j in range(n):
                D[i, j] = np.sum((X[i] - X[j]) ** 2)
    return D


def krum_scores(X, f, valid):
    """Sum of squared distances to the m - f - 2 nearest valid others (at least 1)."""
    idx = np.flatnonzero(valid)
    m = len(idx)
    k = max(m - f - 2, 1)
    D = sq_dists(X)
    scores = np.full(X.shape[0], np.inf)
    for i in idx:
        others = sorted(D[i, j] for j in idx if j != i)
        scores[i] = sum(others[:k])
    return scores


def krum(X, f, valid):
    i = int(np.argmin(krum_scores(X, f, valid)))
    return X[i], i


def multi_krum(X, f, k, valid):
    scores = krum_scores(X, f, valid)
    chosen = np.argsort(scores, kind="stable")[:k]
    return X[chosen].mean(axis=0), set(chosen.tolist())


def iterated_krum(X, f, theta, valid):
    remaining = valid.copy()
    chosen = []
    for _ in range(theta):
        i = int(np.argmin(krum_scores(X, f, remaining)))
        chosen.append(i)
        remaining[i] = False
    return chosen


def bulyan(X, f, valid):
    m = int(valid.sum())
    theta = m - 2 * f
    beta = theta - 2 * f
    chosen = iterated_krum(X, f, theta, valid)
    return closest_to_median_mean(X[chosen], beta), set(chosen)


def closest_to_median_mean(S, beta):
    """Per column, the mean of the beta values nearest the column's median.

    Values are ranked by (distance to the median, value): on an exact distance
    tie the smaller value is nearer, the library's documented tie rule.
    """
    out = np.empty(S.shape[1])
    for k in range(S.shape[1]):
        col = S[:, k]
        med = np.median(col)
        nearest = np.lexsort((col, np.abs(col - med)))[:beta]
        out[k] = col[nearest].mean()
    return out


def geometric_median(X, valid, alpha=None, iters=20000, eps=1e-12):
    P = X[valid]
    a = np.ones(len(P)) if alpha is None else np.asarray(alpha, np.float64)[valid]
    z = (a[:, None] * P).sum(0) / a.sum()
    for _ in range(iters):
        d = np.maximum(np.linalg.norm(P - z, axis=1), eps)
        w = a / d
        z_new = (w[:, None] * P).sum(0) / w.sum()
        if np.linalg.norm(z_new - z) <= 1e-13 * (1 + np.linalg.norm(z)):
            z = z_new
            break
        z = z_new
    return z


def geometric_median_objective(X, valid, z):
    return np.linalg.norm(X[valid] - z, axis=1).sum()


def centered_clipping(X, valid, v0, tau, iterations):
    P = X[valid]
    v = v0.copy()
    for _ in range(iterations):
        diffs = P - v
        norms = np.linalg.norm(diffs, axis=1)
        scale = np.minimum(1.0, tau / np.maximum(norms, 1e-300))
        v = v + (diffs * scale[:, None]).mean(0)
    return v


def nnm(X, f, valid):
    idx = np.flatnonzero(valid)
    m = len(idx)
    out = np.full_like(X, np.nan)
    for i in idx:
        d = [(np.sum((X[i] - X[j]) ** 2), 0 if j == i else 1, j) for j in idx]
        d.sort()
        nearest = [j for _, _, j in d[: m - f]]
        out[i] = X[nearest].mean(0)
    return out


def clip(X, c, C):
    D = X - c
    norms = np.linalg.norm(D, axis=1)
    scale = np.where(norms > C, C / np.maximum(norms, 1e-300), 1.0)
    return c + D * scale[:, None]


def medoid(X, valid):
    """The valid row with the smallest sum of Euclidean distances to the valid rows (lowest index on ties)."""
    idx = np.flatnonzero(valid)
    sums = [sum(np.linalg.norm(X[i] - X[j]) for j in idx) for i in idx]
    return int(idx[int(np.argmin(sums))])
