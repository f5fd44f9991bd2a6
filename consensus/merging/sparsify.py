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

import numpy as np

from consensus.merging._numeric import reduce_sum

RESCALE_EPS = 1e-7  # mergekit's rescaled_masked_tensor: no rescale when a norm is below it


def rank_window(a: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Which entries of a flat array have ascending (stable) rank in ``[lo, hi)``.

    The entries of rank ``lo`` and ``hi - 1`` are found by one ``np.partition``; entries equal
    to those boundary values are ranked by position (a stable sort's order).

    Args:
      a: A 1-D float array.
      lo: The first rank kept.
      hi: One past the last rank kept.

    Returns:
      A bool array like ``a`` with ``max(0, min(hi, a.size) - max(lo, 0))`` entries True.
    """
    n = a.size
    lo, hi = max(lo, 0), min(hi, n)
    keep = np.zeros(n, bool)
    if hi <= lo:
        return keep
    part = np.partition(a, [lo, hi - 1])
    v_lo, v_hi = part[lo], part[hi - 1]
    del part
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
    if density >= 1:
        return delta
    if density <= 0 or delta.size == 0:
        return np.zeros_like(delta)
    k = max(1, int(density * delta.size))
    a = np.abs(delta).reshape(-1).astype(np.float32)
    return _apply(delta, rank_window(-a, 0, k), rescale)


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
    if density >= 1:
        return delta
    n = delta.size
    target, top = int(density * n), int(gamma * n)
    bottom = max(0, n - target - top)
    a = np.abs(delta).reshape(-1).astype(np.float32)
    return _apply(delta, rank_window(a, bottom, bottom + target), rescale)


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
    mask = rng.random(delta.shape, dtype=np.float32) < np.float32(density)
    return _apply(work, mask, rescale).astype(delta.dtype)


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
    if density + epsilon >= 1 or density - epsilon <= 0:
        raise ValueError(
            f"della: epsilon {epsilon} with density {density}: density +/- epsilon must be inside (0, 1)"
        )
    work = delta.astype(np.float32) if delta.dtype == np.float16 else delta
    mat = work.reshape(1, -1) if work.ndim < 2 else work.reshape(work.shape[0], -1)
    m = mat.shape[1]
    mask = np.empty(mat.shape, bool)
    for start in range(0, mat.shape[0], rows):
        block = np.abs(mat[start : start + rows])
        rank = np.argsort(np.argsort(block, axis=1, kind="stable"), axis=1).astype(np.float32)
        # mergekit: (rank - min) / (max - min) with ranks 1..m, clamped to [0, 1]; a row of one
        # entry (0 / 0 there) gets the middle, probability density
        norm_rank = np.clip(rank / np.float32(m - 1), 0, 1) if m > 1 else np.full_like(rank, 0.5)
        probs = np.float32(density - epsilon) + norm_rank * np.float32(2 * epsilon)
        mask[start : start + rows] = rng.random(block.shape, dtype=np.float32) < probs
    return _apply(work, mask, rescale).astype(delta.dtype)


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
