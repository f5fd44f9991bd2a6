"""Float64 numpy references of the server-guided and adaptive rules and of the adaptive attacks.

Written from the papers, independently of the library: (n, d) float64 matrices
(``numpy_reference.flatten_stacked``), literal loops, d-dimensional linear
algebra (covariances, SVDs) where the library works in n x n Gram space.
"""

from __future__ import annotations

import itertools

import numpy as np


def fltrust(X, c, g, valid):
    """Cao et al. 2021: params + sum_i ReLU(cos(d_i, g)) ||g|| / ||d_i|| d_i / sum_j ReLU(cos(d_j, g))."""
    total = np.zeros_like(c)
    trust_sum = 0.0
    for i in np.flatnonzero(valid):
        d = X[i] - c
        nd = np.linalg.norm(d)
        if nd == 0:
            continue
        ts = max(0.0, float(d @ g) / (nd * np.linalg.norm(g)))
        total += ts * np.linalg.norm(g) / nd * d
        trust_sum += ts
    return c + (total / trust_sum if trust_sum > 0 else 0.0)


def server_monna(X, c, g, f, valid):
    idx = np.flatnonzero(valid)
    dist = [np.sum((X[i] - c - g) ** 2) for i in idx]
    order = np.argsort(dist, kind="stable")[: len(idx) - f]
    return X[idx[order]].mean(axis=0)


def arc(X, c, f, valid):
    """Allouah et al. 2024: the floor(2 f (m - f) / m) largest deltas clipped to the next largest norm."""
    out = np.full_like(X, np.nan)
    idx = np.flatnonzero(valid)
    m = len(idx)
    k = int(np.floor(2 * f * (m - f) / m))
    norms = {i: np.linalg.norm(X[i] - c) for i in idx}
    threshold = sorted(norms.values(), reverse=True)[k]
    for i in idx:
        scale = min(1.0, threshold / norms[i]) if norms[i] > 0 else 1.0
        out[i] = c + scale * (X[i] - c)
    return out


def dnc(X, f, valid, coordinate_sets, filter_frac=1.0):
    """Shejwalkar and Houmansadr 2021, Algorithm 2, with the given coordinate subsets (one per iteration)."""
    idx = np.flatnonzero(valid)
    good = set(idx.tolist())
    removed = int(filter_frac * f)
    for coords in coordinate_sets:
        sub = X[idx][:, coords]
        centred = sub - sub.mean(axis=0)
        _, _, vt = np.linalg.svd(centred, full_matrices=False)
        scores = (centred @ vt[0]) ** 2
        order = np.argsort(-scores, kind="stable")
        good -= {int(idx[j]) for j in order[:removed]}
    keep = sorted(good)
    return X[keep].mean(axis=0), set(keep)


def signguard(X, c, valid, coords, lower=0.1, upper=3.0, quantile=0.5, steps=20):
    idx = np.flatnonzero(valid)
    norms = np.array([np.linalg.norm(X[i] - c) for i in range(len(X))])
    med = np.median(norms[idx])
    s1 = {int(i) for i in idx if med == 0 or lower <= norms[i] / med <= upper}
    sub = X[:, coords] - c[coords]
    feats = np.stack([(sub > 0).mean(1), (sub == 0).mean(1), (sub < 0).mean(1)], axis=1)
    F = feats[idx]
    m = len(idx)
    k = max(1, int(np.floor(quantile * m)))
    D = np.linalg.norm(F[:, None] - F[None], axis=-1)
    h = np.mean(np.sort(D, axis=1)[:, k - 1])
    modes = F.copy()
    for _ in range(steps):
        new = modes.copy()
        for j in range(m):
            near = np.linalg.norm(F - modes[j], axis=1) <= h
            if near.any():
                new[j] = F[near].mean(0)
        modes = new
    close = np.linalg.norm(modes[:, None] - modes[None], axis=-1) <= h / 2
    best = int(np.argmax(close.sum(1)))
    s2 = {int(idx[j]) for j in np.flatnonzero(close[best])}
    chosen = sorted(s1 & s2) or sorted(s1)
    total = np.zeros_like(c)
    for i in chosen:
        total += (X[i] - c) * min(1.0, med / norms[i]) if norms[i] > 0 else 0.0
    return c + total / len(chosen), set(chosen)


def caf(X, f, valid):
    """ByzFL's CAF loop with the exact top eigenpair and max tau over nodes still weighted."""
    idx = np.flatnonzero(valid)
    Y = X[idx]
    m = len(idx)
    cw = np.ones(m)
    best, best_mu = np.inf, Y.mean(0)
    while cw.sum() > m - 2 * f:
        mu = (cw[:, None] * Y).sum(0) / cw.sum()
        diffs = Y - mu
        cov = (cw[:, None] * diffs).T @ diffs / cw.sum()
        vals, vecs = np.linalg.eigh(cov)
        lam, v = vals[-1], vecs[:, -1]
        if lam < best:
            best, best_mu = lam, mu
        tau = (diffs @ v) ** 2
        tau_max = tau[cw > 0].max()
        if tau_max <= 0:
            break
        cw = np.maximum(cw * (1 - tau / tau_max), 0.0)
    return best_mu


def smea(X, f, valid):
    idx = np.flatnonzero(valid)
    best, best_set = np.inf, None
    for drop in itertools.combinations(idx.tolist(), f):
        keep = [i for i in idx if i not in drop]
        S = X[keep]
        cov = np.cov(S.T, bias=True)
        lam = np.linalg.eigvalsh(np.atleast_2d(cov))[-1]
        if lam < best:
            best, best_set = lam, keep
    return X[best_set].mean(axis=0), set(best_set)


def meamed(X, f, valid):
    """Xie et al. 2018: per coordinate, the mean of the m - f values nearest the median."""
    V = X[valid]
    m = V.shape[0]
    out = np.empty(X.shape[1])
    for k in range(X.shape[1]):
        col = V[:, k]
        med = np.median(col)
        # The m - f values nearest the median, ties in distance broken towards the smaller value.
        order = np.lexsort((col, np.abs(col - med)))
        out[k] = col[order[: m - f]].mean()
    return out


def bucketing(X, valid, permutation, bucket_size, inner):
    """Karimireddy et al. 2022: buckets of consecutive nodes in ``permutation`` order, then ``inner``."""
    n = len(permutation)
    means = []
    for start in range(0, n, bucket_size):
        members = [j for j in permutation[start : start + bucket_size] if valid[j]]
        if members:
            means.append(X[members].mean(0))
    means = np.array(means)
    return inner(means, np.ones(len(means), bool))


# ----------------------------------------------------------------------------- attacks


def min_max(H, gamma_max=50.0, tol=1e-5, perturbation="std"):
    """Shejwalkar and Houmansadr 2021: mu + gamma p, largest gamma: max_i ||m - h_i|| <= max ||h_i - h_j||."""
    mu = H.mean(0)
    p = _perturbation(H, perturbation)
    bound = max(np.linalg.norm(a - b) for a in H for b in H)
    ok = lambda m: max(np.linalg.norm(m - h) for h in H) <= bound  # noqa: E731
    return mu + _largest_gamma(ok, mu, p, gamma_max, tol) * p


def min_sum(H, gamma_max=50.0, tol=1e-5, perturbation="std"):
    mu = H.mean(0)
    p = _perturbation(H, perturbation)
    bound = max(sum(np.linalg.norm(a - b) ** 2 for b in H) for a in H)
    ok = lambda m: sum(np.linalg.norm(m - h) ** 2 for h in H) <= bound  # noqa: E731
    return mu + _largest_gamma(ok, mu, p, gamma_max, tol) * p


def _perturbation(H, kind):
    mu = H.mean(0)
    if kind == "std":
        return -H.std(0)
    if kind == "unit":
        return -mu / np.linalg.norm(mu)
    return -np.sign(mu)


def _largest_gamma(ok, mu, p, gamma_max, tol):
    """Bisection as in the paper's Algorithm 1 (largest gamma in [0, gamma_max] with ok(mu + gamma p))."""
    if ok(mu + gamma_max * p):
        return gamma_max
    lo, hi = 0.0, gamma_max
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if ok(mu + mid * p):
            lo = mid
        else:
            hi = mid
    return lo
