"""mergekit's task-vector merges on one tensor (numpy): generalized task arithmetic, SCE, RAM, linear.

These are the per-tensor formulas of mergekit 0.1.5 (github.com/arcee-ai/mergekit,
``mergekit/merge_methods/``), written over a base ``b`` and the models ``x_i`` of one tensor in
a compute dtype (:mod:`consensus.merging._numeric`). The library's own rules
(:func:`~consensus.merging.ties`, :func:`~consensus.merging.dare_ties`, ...) are jax aggregators
over whole trees with one density for every node; these take a parameter per model, which
mergekit's configurations give.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from consensus.merging._numeric import as_weights, reduce_sum
from consensus.merging.sparsify import sparsify

# mergekit's generalized task arithmetic family: name -> (sparsification, sign consensus,
# default normalize, default rescale); mergekit/merge_methods/registry.py.
GTA_METHODS: dict[str, tuple[str | None, str | None, bool, bool]] = {
    "task_arithmetic": (None, None, False, False),
    "ties": ("magnitude", "sum", True, False),
    "dare_ties": ("random", "sum", False, True),
    "dare_linear": ("random", None, False, True),
    "breadcrumbs": ("magnitude_outliers", None, False, False),
    "breadcrumbs_ties": ("magnitude_outliers", "sum", False, False),
    "della": ("della_magprune", "sum", True, True),
    "della_linear": ("della_magprune", None, False, True),
}


def sign_mask(deltas: np.ndarray, method: str = "sum") -> np.ndarray:
    """Mergekit's ``get_mask``: which (weighted) task-vector entries agree with the elected sign.

    ``"sum"``: the elected sign is ``+1`` where ``sum_i d_i >= 0``, else ``-1``; ``"count"``: where
    ``sum_i sign(d_i) >= 0``. An entry is kept when ``sign(d_i)`` equals it (a zero never is).

    Args:
      deltas: (n, ...) the weighted task vectors.
      method: ``"sum"`` or ``"count"``.

    Returns:
      (n, ...) bool mask.

    Raises:
      ValueError: If the method is neither.
    """
    sign = np.sign(deltas)
    if method == "sum":
        total = reduce_sum(deltas, axis=0)
    elif method == "count":
        total = reduce_sum(sign, axis=0)
    else:
        raise ValueError(f"sign_mask: method must be 'sum' or 'count', got {method!r}")
    return sign == np.where(total >= 0, 1, -1).astype(deltas.dtype)


def generalized_task_arithmetic(
    base: np.ndarray,
    models: Sequence[np.ndarray],
    weights: Sequence[float],
    *,
    sparsification: str | None = None,
    consensus: str | None = None,
    densities: Sequence[float] | None = None,
    normalize: bool = False,
    scale: float = 1.0,
    rescale: bool = False,
    gammas: Sequence[float] | None = None,
    epsilons: Sequence[float] | None = None,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Generalized task arithmetic as mergekit runs it on one tensor (TIES, DARE, breadcrumbs, DELLA, ...).

    With ``d_i = sparsify(x_i - b; density_i, ...)`` and ``D_i = w_i d_i``:

    * sign consensus (``consensus="sum"``): ``m_i = [sign(D_i) == sign*]`` with
      ``sign* = +1 where sum_i D_i >= 0``; ``mixed = sum_i m_i D_i``, ``div = sum_i m_i w_i``
      (0 -> 1);
    * else ``mixed = sum_i D_i``, ``div = sum_i w_i`` (``|div| < 1e-8`` -> 1);

    then ``mixed /= div`` with ``normalize``, ``mixed *= lambda`` and the result is ``b + mixed``.
    Every parameter is per model, as in mergekit's configurations.

    Args:
      base: The base tensor ``b`` (compute dtype).
      models: The models' tensors ``x_i``, the base left out.
      weights: One weight per model.
      sparsification: None, ``"magnitude"`` (TIES), ``"random"`` (DARE), ``"magnitude_outliers"``
        (breadcrumbs) or ``"della_magprune"`` (DELLA), see :mod:`consensus.merging.sparsify`.
      consensus: None or ``"sum"`` / ``"count"`` (the sign election).
      densities: One density per model (None: 1, nothing dropped).
      normalize: Divide by the (kept) weights' sum.
      scale: mergekit's ``lambda``.
      rescale: Sparsified task vectors keep their L1 norm.
      gammas: Breadcrumbs' outlier fraction per model (default 0.01).
      epsilons: DELLA's spread per model (default 0.15).
      rng: The generator of the random sparsifications.

    Returns:
      The merged tensor, in ``base``'s dtype.

    References:
      Ilharco et al. 2023, ICLR, "Editing Models with Task Arithmetic"; Yadav et al. 2023, NeurIPS,
      "TIES-Merging"; Yu et al. 2024, ICML, "Language Models are Super Mario"; Davari and
      Belilovsky 2024, ECCV, "Model Breadcrumbs"; Deep et al. 2024, arXiv:2406.11617, "DELLA-Merging".
    """
    n = len(models)
    if n == 0:
        return base
    dens = [1.0] * n if densities is None else list(densities)
    deltas = np.empty((n, *base.shape), base.dtype)
    for i, x in enumerate(models):
        d = x.astype(base.dtype, copy=False) - base
        if sparsification is not None:
            d = sparsify(
                d,
                sparsification,
                float(dens[i]),
                rescale=rescale,
                gamma=0.01 if gammas is None else float(gammas[i]),
                epsilon=0.15 if epsilons is None else float(epsilons[i]),
                rng=rng,
            )
        deltas[i] = d
        del d
    return mix(base, deltas, weights, consensus=consensus, normalize=normalize, scale=scale)


def mix(
    base: np.ndarray,
    deltas: np.ndarray,
    weights: Sequence[float],
    *,
    consensus: str | None = None,
    normalize: bool = False,
    scale: float = 1.0,
) -> np.ndarray:
    """The second half of :func:`generalized_task_arithmetic`: weigh, elect, sum and add to the base.

    Element-wise over the model axis, so a chunk of the entries gives that chunk of the result.

    Args:
      base: The base (or a chunk of it).
      deltas: (n, ...) the sparsified task vectors (overwritten).
      weights: One weight per model.
      consensus: None, ``"sum"`` or ``"count"``.
      normalize: Divide by the (kept) weights' sum.
      scale: mergekit's ``lambda``.

    Returns:
      ``base + mixed``, in ``base``'s dtype.
    """
    w = as_weights(weights, base.dtype, base.ndim)
    deltas *= w
    if consensus is not None:
        mask = sign_mask(deltas, consensus).astype(base.dtype)
        deltas *= mask
        mixed = reduce_sum(deltas, axis=0)
        del deltas
        divisor = reduce_sum(w * mask, axis=0)
        divisor[divisor == 0] = 1
    else:
        mixed = reduce_sum(deltas, axis=0)
        del deltas
        divisor = reduce_sum(w, axis=0)
        divisor[np.abs(divisor) < 1e-8] = 1
    if normalize:
        mixed = mixed / divisor
    if scale != 1:
        mixed = mixed * np.asarray(scale, np.float64).astype(base.dtype)
    return (base + mixed).astype(base.dtype)


def masked_delta(
    x: np.ndarray, base: np.ndarray, mask: np.ndarray | None, factor: Any, work: Any
) -> np.ndarray:
    """One model's sparsified task vector from its mask (:func:`~consensus.merging.sparsify.sparsify_mask`).

    Element-wise: ``((x - b) in work dtype * mask) * factor``, back in ``base``'s dtype, the same
    operations as :func:`~consensus.merging.sparsify.sparsify` (so a chunk equals that chunk of it).

    Args:
      x: The model's tensor or chunk (flat).
      base: The base's (flat).
      mask: The chunk of the flat mask, or None (nothing dropped).
      factor: The L1 rescale factor, or None.
      work: The work dtype.

    Returns:
      The sparsified task vector chunk.
    """
    d = x.astype(base.dtype, copy=False) - base
    if mask is None:
        return d
    kept = d.astype(work, copy=False) * mask.astype(work)
    if factor is not None:
        kept = kept * factor
    return kept.astype(base.dtype, copy=False)


def linear(models: Sequence[np.ndarray], weights: Sequence[float], normalize: bool = True) -> np.ndarray:
    """Mergekit 0.1.5's ``linear``: ``sum_i w_i x_i`` (``/ sum_i w_i`` with ``normalize``), in float32.

    mergekit computes it in float32 whatever the inputs' dtype (float64 stays float64) and casts
    the result back, so this returns float32 (float64 inputs: float64).

    Args:
      models: The models' tensors.
      weights: One weight per model.
      normalize: Divide by the weights' sum.

    Returns:
      The weighted sum.

    References:
      Wortsman et al. 2022, ICML, "Model soups".
    """
    dtype = np.float64 if models[0].dtype == np.float64 else np.float32
    out = np.zeros(models[0].shape, dtype)
    for x, w in zip(models, weights, strict=True):
        # torch's addcmul_ rounds out + w x once (a fused multiply-add): the product of two float32
        # numbers is exact in float64, so the sum there rounded to float32 is that rounding
        out = (out.astype(np.float64) + x.astype(np.float64) * np.float64(dtype(w))).astype(dtype)
    if normalize:
        total = dtype(0)
        for w in weights:
            total = dtype(total + dtype(w))
        out /= total
    return out


def sce(base: np.ndarray, models: Sequence[np.ndarray], select_topk: float = 1.0) -> np.ndarray:
    """Mergekit's ``sce``: Select (by variance), Calculate (weights), Erase (minority signs).

    With task vectors ``d_i = x_i - b``: when ``select_topk < 1`` only the
    ``k = int(select_topk * #{var > 0})`` entries of largest variance across models
    (``var = mean_i (d_i - mean d)^2``) are kept in every ``d_i``; the sign mask ``m_i``
    (:func:`sign_mask`, "sum"); weights ``w_i = mean(d_i^2) / sum_j mean(d_j^2)`` (equal when
    that sum is below 1e-6); result ``b + sum_i w_i m_i d_i / max(sum_i w_i m_i, 1e-6)``.

    Args:
      base: The base tensor.
      models: The models' tensors, the base left out.
      select_topk: The fraction of entries kept by variance.

    Returns:
      The merged tensor.

    References:
      Wan et al. 2024, arXiv:2408.07990, "FuseChat: Knowledge Fusion of Chat Models".
    """
    if not models:
        return base
    tvs = np.stack([x.astype(base.dtype, copy=False) - base for x in models])
    if select_topk < 1:
        from consensus.merging.sparsify import rank_window

        if select_topk <= 0:
            tvs = tvs * 0
        else:
            mean = reduce_sum(tvs, axis=0) / np.asarray(len(models), base.dtype)
            var = reduce_sum(np.square(tvs - mean), axis=0) / np.asarray(len(models), base.dtype)
            k = int(np.count_nonzero(var) * select_topk)
            flat = np.abs(var).reshape(-1).astype(np.float32)
            keep = rank_window(-flat, 0, k) if k > 0 else np.zeros(flat.size, bool)
            tvs = tvs * keep.reshape(var.shape).astype(base.dtype)
    mask = sign_mask(tvs, "sum").astype(base.dtype)
    sq = reduce_sum(np.square(tvs).reshape(len(models), -1), axis=1) / np.asarray(
        tvs[0].size, np.float64
    ).astype(base.dtype)
    total = float(reduce_sum(sq))
    w = (
        np.full(len(models), 1.0 / len(models)).astype(base.dtype)
        if abs(total) < 1e-6
        else sq / base.dtype.type(total)
    )
    erased = w.reshape((-1,) + (1,) * base.ndim) * mask
    merged = reduce_sum(tvs * erased, axis=0)
    return (base + merged / np.maximum(reduce_sum(erased, axis=0), base.dtype.type(1e-6))).astype(base.dtype)


def ram(
    base: np.ndarray,
    models: Sequence[np.ndarray],
    epsilon: float = 1e-5,
    plus: bool = False,
    r: float = 0.1,
    alpha: float = 0.2,
    boost: np.ndarray | None = None,
) -> np.ndarray:
    """Mergekit's ``ram`` (and ``ramplus_tl`` with ``plus``): Reinforced Agent Merging.

    With ``d_i = x_i - b``, ``nz_i = |d_i| > epsilon`` and ``c = sum_i nz_i`` (per entry): an entry
    only one model changed is taken whole, one several changed is averaged over them:
    ``b + sum_i nz_i d_i ([c == 1] + [c > 1] / max(c, 1))``. ``ramplus_tl`` scales model i's
    unique entries by ``1 + r * clip(shared_i / max(unique_i, epsilon), 0, alpha)``, where
    ``shared_i`` / ``unique_i`` count its changed entries that others also / do not change.

    Args:
      base: The base tensor.
      models: The models' tensors, the base left out.
      epsilon: The magnitude above which an entry counts as changed.
      plus: ``ramplus_tl`` instead of ``ram``.
      r: ``ramplus_tl``'s boost.
      alpha: ``ramplus_tl``'s cap on the shared/unique ratio.
      boost: ``ramplus_tl``'s per-model factor counted over the whole tensor
        (:func:`~consensus.merging.streamed.ramplus_boost`), when ``base`` and ``models`` are a
        chunk of it; None: counted here.

    Returns:
      The merged tensor.

    References:
      mergekit's ``ram`` cites arXiv:2601.13572, "Reinforced Agent Merging".
    """
    if not models:
        return base
    tv = np.stack([x.astype(base.dtype, copy=False) - base for x in models]).reshape(len(models), -1)
    nz = np.abs(tv) > base.dtype.type(epsilon)
    counts = nz.sum(axis=0, keepdims=True)
    overlap, unique = counts > 1, counts == 1
    tvz = tv * nz.astype(base.dtype)
    shared_part = tvz * overlap.astype(base.dtype) / np.maximum(counts, 1).astype(base.dtype)
    unique_part = tvz * unique.astype(base.dtype)
    if plus and boost is not None:
        unique_part = unique_part * np.asarray(boost).astype(base.dtype)[:, None]
    elif plus:
        shared_n = (nz & overlap).sum(axis=1).astype(np.float32)
        unique_n = (nz & unique).sum(axis=1).astype(np.float32)
        rho = shared_n / np.maximum(unique_n, np.float32(epsilon))
        lam = (1 + r * np.clip(rho, 0, alpha)).astype(base.dtype)
        unique_part = unique_part * lam[:, None]
    merged = reduce_sum(unique_part + shared_part, axis=0)
    return (base + merged.reshape(base.shape)).astype(base.dtype)
