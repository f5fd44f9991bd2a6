"""mergekit's sparsifications of one task vector (TIES' magnitude, DARE's Bernoulli, breadcrumbs, DELLA).

Each takes one model's task vector ``d = x - base`` of one tensor (a numpy array in the compute
dtype) and returns it with entries zeroed, optionally rescaled to keep its L1 norm. The
formulas are those of mergekit 0.1.5's ``mergekit/sparsify.py`` (github.com/arcee-ai/mergekit);
where mergekit sorts (``argsort``), ties between equal magnitudes are broken here by position
in the flattened tensor (a stable sort), and the order statistics are found by
``np.partition`` (4 bytes per entry) instead of a full argsort (8).

The random ones take a ``numpy.random.Generator``: they agree with mergekit's ``torch.bernoulli``
in distribution (each entry kept independently with its probability), not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from consensus.merging._numeric import reduce_sum

RESCALE_EPS = 1e-7  # mergekit's rescaled_masked_tensor: no rescale when a norm is below it


def rank_window(
    a: np.ndarray, lo: int, hi: int, refill: Callable[[np.ndarray], None] | None = None
) -> np.ndarray:
    """Which entries of a flat array have ascending (stable) rank in ``[lo, hi)``.

    The entries of rank ``lo`` and ``hi - 1`` are found by one ``np.partition``; entries equal
    to those boundary values are ranked by position (a stable sort's order).

    Args:
      a: A 1-D float array.
      lo: The first rank kept.
      hi: One past the last rank kept.
      refill: Given, ``a`` is partitioned in place (no copy of it) and ``refill(a)`` then writes
        its values back (the caller recomputes them, e.g. ``|d|`` from ``d``).

    Returns:
      A bool array like ``a`` with ``max(0, min(hi, a.size) - max(lo, 0))`` entries True.
    """
    n = a.size
    lo, hi = max(lo, 0), min(hi, n)
    keep = np.zeros(n, bool)
    if hi <= lo:
        return keep
    if refill is None:
        part = np.partition(a, [lo, hi - 1])
        v_lo, v_hi = part[lo], part[hi - 1]
        del part
    else:
        a.partition([lo, hi - 1])
        v_lo, v_hi = a[lo], a[hi - 1]
        refill(a)
    keep = (a > v_lo) & (a < v_hi)
    for v in {float(v_lo), float(v_hi)}:
        at = np.flatnonzero(a == v)
        rank = int(np.count_nonzero(a < v)) + np.arange(at.size)
        keep[at[(rank >= lo) & (rank < hi)]] = True
    return keep


def rescale_l1(delta: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Mergekit's ``rescaled_masked_tensor(..., norm=l1)``: the kept entries scaled to the L1 norm of all.

    ``kept * (||delta||_1 / ||kept||_1)``, unless either norm is below 1e-7 (then ``kept``).

    Args:
      delta: The task vector before masking.
      kept: The masked task vector.

    Returns:
      The rescaled masked task vector, in ``kept``'s dtype.
    """
    before = float(reduce_sum(np.abs(delta)))
    after = float(reduce_sum(np.abs(kept)))
    if before < RESCALE_EPS or after < RESCALE_EPS:
        return kept
    dt = kept.dtype.type
    factor = dt(before) / dt(after)  # two scalars of the tensor's dtype, as mergekit's
    return kept * factor


def _apply(delta: np.ndarray, mask: np.ndarray, rescale: bool) -> np.ndarray:
    """``delta * mask``, L1-rescaled when ``rescale``."""
    kept = delta * mask.reshape(delta.shape).astype(delta.dtype)
    return rescale_l1(delta, kept) if rescale else kept


def magnitude(delta: np.ndarray, density: float, rescale: bool = False) -> np.ndarray:
    """TIES' trim: keep the ``k = max(1, int(density * N))`` entries of largest magnitude.

    mergekit 0.1.5 ``sparsify.magnitude``: ``density >= 1`` returns ``delta``; ``density <= 0``
    zeros; else the top-k of ``|delta|`` (compared in float32) are kept, the rest zeroed, and with
    ``rescale`` the result keeps ``||delta||_1`` (:func:`rescale_l1`).

    Args:
      delta: One model's task vector.
      density: The kept fraction.
      rescale: Keep the L1 norm (mergekit's ``rescale: true``).

    Returns:
      The sparsified task vector.
    """
    mask = magnitude_mask(delta, density)
    return delta if mask is None else _apply(delta, mask, rescale)


def magnitude_mask(delta: np.ndarray, density: float) -> np.ndarray | None:
    """The entries :func:`magnitude` keeps, flat (None: all).

    Args:
      delta: One model's task vector.
      density: The kept fraction.

    Returns:
      A flat bool mask, or None when ``density >= 1``.
    """
    if density >= 1:
        return None
    if density <= 0 or delta.size == 0:
        return np.zeros(delta.size, bool)
    k = max(1, int(density * delta.size))

    def fill(a: np.ndarray) -> None:  # -|d| in float32: descending magnitude is ascending rank
        np.abs(delta.reshape(-1), out=a, casting="unsafe")
        np.negative(a, out=a)

    a = np.empty(delta.size, np.float32)
    fill(a)
    return rank_window(a, 0, k, fill)


def magnitude_outliers(
    delta: np.ndarray, density: float, gamma: float = 0.01, rescale: bool = False
) -> np.ndarray:
    """Model Breadcrumbs: drop the ``gamma`` largest magnitudes, then the smallest, to keep ``density``.

    mergekit 0.1.5 ``sparsify.magnitude_outliers``: with ``N`` entries, ``target = int(density N)``,
    ``top = int(gamma N)``, ``bottom = max(0, N - target - top)``; the entries of ascending
    magnitude rank in ``[bottom, bottom + target)`` are kept (``density >= 1``: all).

    Args:
      delta: One model's task vector.
      density: The kept fraction.
      gamma: The fraction of largest magnitudes dropped as outliers.
      rescale: Keep the L1 norm.

    Returns:
      The sparsified task vector.

    References:
      Davari and Belilovsky 2024, ECCV, "Model Breadcrumbs: Scaling Multi-Task Model Merging with
      Sparse Masks".
    """
    mask = outliers_mask(delta, density, gamma)
    return delta if mask is None else _apply(delta, mask, rescale)


def outliers_mask(delta: np.ndarray, density: float, gamma: float) -> np.ndarray | None:
    """The entries :func:`magnitude_outliers` keeps, flat (None: all).

    Args:
      delta: One model's task vector.
      density: The kept fraction.
      gamma: The fraction of largest magnitudes dropped.

    Returns:
      A flat bool mask, or None when ``density >= 1``.
    """
    if density >= 1:
        return None
    n = delta.size
    target, top = int(density * n), int(gamma * n)
    bottom = max(0, n - target - top)

    def fill(a: np.ndarray) -> None:
        np.abs(delta.reshape(-1), out=a, casting="unsafe")

    a = np.empty(n, np.float32)
    fill(a)
    return rank_window(a, bottom, bottom + target, fill)


def bernoulli(
    delta: np.ndarray, density: float, rng: np.random.Generator, rescale: bool = True
) -> np.ndarray:
    """DARE's drop: keep each entry independently with probability ``density``.

    mergekit 0.1.5 ``sparsify.bernoulli``: ``density >= 1`` returns ``delta``; else
    ``delta * Bernoulli(density)`` (float32 on the CPU, as mergekit upcasts float16 there), L1
    rescaled with ``rescale`` (mergekit's DARE default; without it the kept entries are *not*
    divided by the density). Equal to mergekit in distribution only.

    Args:
      delta: One model's task vector.
      density: The keep probability.
      rng: The random generator.
      rescale: Keep the L1 norm.

    Returns:
      The sparsified task vector, in ``delta``'s dtype.
    """
    if density >= 1:
        return delta
    work = delta.astype(np.float32) if delta.dtype == np.float16 else delta
    return _apply(work, bernoulli_mask(delta, density, rng), rescale).astype(delta.dtype)


def bernoulli_mask(delta: np.ndarray, density: float, rng: np.random.Generator) -> np.ndarray:
    """The entries :func:`bernoulli` keeps (drawn from ``rng``), flat.

    Args:
      delta: One model's task vector (its size is used).
      density: The keep probability.
      rng: The random generator.

    Returns:
      A flat bool mask.
    """
    return rng.random(delta.size, dtype=np.float32) < np.float32(density)


def della_magprune(
    delta: np.ndarray,
    density: float,
    epsilon: float,
    rng: np.random.Generator,
    rescale: bool = True,
    rows: int = 4096,
) -> np.ndarray:
    """DELLA's MAGPRUNE: keep each entry with a probability that grows with its magnitude's rank in its row.

    mergekit 0.1.5 ``sparsify.della_magprune``: a 1-D tensor is one row; in each row of ``m``
    entries the ascending magnitude rank ``r`` (1..m) gives ``p = density - epsilon + 2 epsilon
    (r - 1) / (m - 1)`` and the entry is kept with probability p; then L1 rescale with
    ``rescale``. Needs ``0 < density - epsilon`` and ``density + epsilon < 1``. Rows are ranked
    ``rows`` at a time so the rank arrays stay small. Equal to mergekit in distribution only.

    Args:
      delta: One model's task vector.
      density: The mean keep probability.
      epsilon: Half the spread of the keep probabilities.
      rng: The random generator.
      rescale: Keep the L1 norm.
      rows: Rows ranked at a time.

    Returns:
      The sparsified task vector, in ``delta``'s dtype.

    Raises:
      ValueError: If ``density +/- epsilon`` is not inside (0, 1).

    References:
      Deep, Bhardwaj and Poria 2024, arXiv:2406.11617, "DELLA-Merging: Reducing Interference in
      Model Merging through Magnitude-Based Sampling".
    """
    if density >= 1:
        return delta
    if density <= 0:
        return np.zeros_like(delta)
    work = delta.astype(np.float32) if delta.dtype == np.float16 else delta
    return _apply(work, della_mask(delta, density, epsilon, rng, rows), rescale).astype(delta.dtype)


def della_mask(
    delta: np.ndarray, density: float, epsilon: float, rng: np.random.Generator, rows: int = 4096
) -> np.ndarray:
    """The entries :func:`della_magprune` keeps (drawn from ``rng``), flat.

    Args:
      delta: One model's task vector.
      density: The mean keep probability (in (0, 1)).
      epsilon: Half the spread of the keep probabilities.
      rng: The random generator.
      rows: Rows ranked at a time.

    Returns:
      A flat bool mask.

    Raises:
      ValueError: If ``density +/- epsilon`` is not inside (0, 1).
    """
    if density + epsilon >= 1 or density - epsilon <= 0:
        raise ValueError(
            f"della: epsilon {epsilon} with density {density}: density +/- epsilon must be inside (0, 1)"
        )
    mat = delta.reshape(1, -1) if delta.ndim < 2 else delta.reshape(delta.shape[0], -1)
    m = mat.shape[1]
    mask = np.empty(mat.shape, bool)
    for start in range(0, mat.shape[0], rows):
        block = np.abs(mat[start : start + rows]).astype(np.float32)
        rank = np.argsort(np.argsort(block, axis=1, kind="stable"), axis=1).astype(np.float32)
        # mergekit: (rank - min) / (max - min) with ranks 1..m, clamped to [0, 1]; a row of one
        # entry (0 / 0 there) gets the middle, probability density
        norm_rank = np.clip(rank / np.float32(m - 1), 0, 1) if m > 1 else np.full_like(rank, 0.5)
        probs = np.float32(density - epsilon) + norm_rank * np.float32(2 * epsilon)
        mask[start : start + rows] = rng.random(block.shape, dtype=np.float32) < probs
    return mask.reshape(-1)


def sparsify(
    delta: np.ndarray,
    method: str,
    density: float,
    *,
    rescale: bool,
    gamma: float = 0.01,
    epsilon: float = 0.15,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Dispatch to mergekit's sparsification ``method`` by its name.

    Args:
      delta: One model's task vector.
      method: ``"magnitude"``, ``"random"``, ``"magnitude_outliers"`` or ``"della_magprune"``.
      density: The kept fraction.
      rescale: Keep the L1 norm.
      gamma: Breadcrumbs' outlier fraction.
      epsilon: DELLA's spread.
      rng: The generator of the random ones.

    Returns:
      The sparsified task vector.

    Raises:
      ValueError: If the method is unknown, or a random one has no generator.
    """
    if method == "magnitude":
        return magnitude(delta, density, rescale)
    if method == "magnitude_outliers":
        return magnitude_outliers(delta, density, gamma, rescale)
    if method in ("random", "della_magprune"):
        if rng is None:
            raise ValueError(f"sparsify: {method} is random; pass a numpy Generator")
        if method == "random":
            return bernoulli(delta, density, rng, rescale)
        return della_magprune(delta, density, epsilon, rng, rescale)
    raise ValueError(f"sparsify: unknown method {method!r}")


def sparsify_mask(
    delta: np.ndarray,
    method: str,
    density: float,
    *,
    rescale: bool,
    gamma: float = 0.01,
    epsilon: float = 0.15,
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray | None, Any, Any]:
    """What :func:`sparsify` does to ``delta``, as (mask, factor, work dtype), for applying it in chunks.

    ``sparsify(delta) == ((delta.astype(work) * mask) * factor).astype(delta.dtype)`` element by
    element, so a caller may keep the mask (1 byte per entry) instead of the sparsified tensor and
    apply it to row chunks (the L1 rescale factor is a whole-tensor quantity, found here).

    Args:
      delta: One model's task vector.
      method: As for :func:`sparsify`.
      density: The kept fraction.
      rescale: Keep the L1 norm.
      gamma: Breadcrumbs' outlier fraction.
      epsilon: DELLA's spread.
      rng: The generator of the random ones.

    Returns:
      (flat bool mask, or None for "keep all, unscaled"; the factor as a scalar of the work
      dtype, or None for none; the work dtype).

    Raises:
      ValueError: As :func:`sparsify`.
    """
    random = method in ("random", "della_magprune")
    work = np.dtype(np.float32) if (random and delta.dtype == np.float16) else delta.dtype
    if density >= 1:
        return None, None, work
    if method == "magnitude":
        mask = magnitude_mask(delta, density)
    elif method == "magnitude_outliers":
        mask = outliers_mask(delta, density, gamma)
    elif random:
        if rng is None:
            raise ValueError(f"sparsify: {method} is random; pass a numpy Generator")
        if method == "random":
            mask = bernoulli_mask(delta, density, rng)
        elif density <= 0:
            mask = np.zeros(delta.size, bool)
        else:
            mask = della_mask(delta, density, epsilon, rng)
    else:
        raise ValueError(f"sparsify: unknown method {method!r}")
    assert mask is not None
    if not rescale:
        return mask, None, work
    d = delta.reshape(-1).astype(work, copy=False)
    before = float(reduce_sum(np.abs(d)))
    after = float(reduce_sum(np.abs(np.where(mask, d, work.type(0)))))
    if before < RESCALE_EPS or after < RESCALE_EPS:
        return mask, None, work
    return mask, work.type(before) / work.type(after), work
