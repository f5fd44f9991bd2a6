"""mergekit's whole-tensor methods over tensors read in chunks: statistics first, then the merge.

SLERP, NuSLERP, Multi-SLERP, SCE, Arcee Fusion and RAM+ (``ramplus_tl``) need a statistic of the
whole tensor (a norm, a dot product, a variance rank, a quantile, a count) before any entry of
the result is known. Here each input is a :data:`Read` (entries ``[start, stop)`` of the flat
tensor, already in the compute dtype), read chunk by chunk in one pass per statistic, and the
result is written chunk by chunk into ``out``. Alive at a time: one chunk per input, the
per-vector statistics, and at most one tensor-sized float32 buffer (SCE's variances) besides
``out``, instead of the n whole tensors (and their float64 or stacked copies) of the formulas in
:mod:`~consensus.merging.spherical` and :mod:`~consensus.merging.generalized`.

Every element-wise step is the formula's own operation in the same dtype, so those bits are the
same; sums over the whole tensor (norms, dot products, SCE's mean squares) are accumulated in
float64 chunk by chunk, where the formula sums in one call, so a result can differ from the
whole-tensor formula by float32 rounding of those statistics (the tests bound it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from consensus.merging._numeric import reduce_sum

Read = Callable[[int, int], np.ndarray]
"""Entries ``[start, stop)`` of one input's flat tensor, in the compute dtype."""

CHUNK = 1 << 20  # entries per chunk (whole rows where the method works by rows)


def _spans(size: int, chunk: int, row: int = 1) -> Iterator[tuple[int, int]]:
    """Flat ``[start, stop)`` spans of about ``chunk`` entries, each a whole number of ``row``-long rows."""
    step = max(1, chunk // max(row, 1)) * max(row, 1)
    for start in range(0, size, step):
        yield start, min(size, start + step)


def _dtype(read: Read) -> np.dtype:
    """The compute dtype of an input (its first entry's)."""
    return np.dtype(read(0, 1).dtype)


def _sumsq(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """``sum x^2`` accumulated in float64 (as :func:`~consensus.merging._numeric.norm` squares)."""
    return np.square(x.astype(np.float64, copy=False)).sum(axis=axis)


def slerp(
    t: float, v0: Read, v1: Read, size: int, out: np.ndarray, *, chunk: int = CHUNK, eps: float = 1e-8
) -> None:
    """:func:`consensus.merging.spherical.slerp` over chunks: one pass for the norms and the dot product.

    Args:
      t: The interpolation parameter (``t = 0`` gives ``v0``).
      v0: The base model's tensor.
      v1: The other model's tensor.
      size: The number of entries.
      out: The flat result (written, cast to its dtype).
      chunk: Entries per chunk.
      eps: The norm below which a vector is not normalised.
    """
    saa = sbb = sab = 0.0
    for s, e in _spans(size, chunk):
        a = v0(s, e).astype(np.float64)
        b = v1(s, e).astype(np.float64)
        saa += float(np.dot(a, a))
        sbb += float(np.dot(b, b))
        sab += float(np.dot(a, b))
    na, nb = np.sqrt(saa), np.sqrt(sbb)
    dot = sab / ((na if na > eps else 1.0) * (nb if nb > eps else 1.0))
    if abs(dot) > 0.9995:  # spherical.DOT_THRESHOLD
        c0, c1 = 1 - t, t
    else:
        theta = np.arccos(dot)
        c0, c1 = np.sin(theta - theta * t) / np.sin(theta), np.sin(theta * t) / np.sin(theta)
    for s, e in _spans(size, chunk):
        a = v0(s, e)
        dt = a.dtype.type
        out[s:e] = (dt(c0) * a + dt(c1) * v1(s, e).astype(a.dtype)).astype(a.dtype).astype(out.dtype)


def nuslerp(
    t: float,
    v0: Read,
    v1: Read,
    shape: Sequence[int],
    out: np.ndarray,
    *,
    base: Read | None = None,
    row_wise: bool = False,
    flatten: bool = True,
    eps: float = 1e-8,
    chunk: int = CHUNK,
) -> None:
    """:func:`consensus.merging.spherical.nuslerp` over chunks (with a base: of ``v_i - base``, plus it).

    Three passes: the vectors' norms, the dot products of the unit vectors, the interpolation.
    The vectors are the whole tensor (``flatten``), its rows (the last axis) or its columns
    (``row_wise``: the first axis); chunks hold whole rows of the ``(first axis, rest)`` view for
    columns, of the ``(rest, last axis)`` view for rows.

    Args:
      t: The interpolation parameter.
      v0: The first tensor.
      v1: The second tensor.
      shape: The tensor's shape.
      out: The flat result (written, cast to its dtype).
      base: Given, the vectors are ``v_i - base`` and the result is ``base + nuslerp``.
      row_wise: Interpolate along the first axis instead of the last.
      flatten: Interpolate the whole tensors as single vectors.
      eps: The colinearity tolerance.
      chunk: Entries per chunk.
    """
    size = int(np.prod(shape, dtype=np.int64))
    if flatten or len(shape) == 0:
        mode, rows, cols = "flat", 1, size
    elif row_wise:
        mode, rows, cols = "cols", int(shape[0]), size // max(int(shape[0]), 1)
    else:
        mode, rows, cols = "rows", size // max(int(shape[-1]), 1), int(shape[-1])
    spans = list(_spans(size, chunk, 1 if mode == "flat" else cols))
    acc_shape = (1, cols) if mode == "cols" else (rows, 1)

    def views(s: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, slice]:
        a, b = v0(s, e), v1(s, e)
        bb = None if base is None else base(s, e)
        if bb is not None:
            a, b = a - bb, b - bb
        k = (1, e - s) if mode == "flat" else (-1, cols)
        at = slice(s // cols, e // cols) if mode == "rows" else slice(0, 1)
        return a.reshape(k), b.reshape(k), bb, at

    axis = 0 if mode == "cols" else 1
    sa, sb = np.zeros(acc_shape), np.zeros(acc_shape)
    for s, e in spans:
        a, b, _, at = views(s, e)
        sa[at] += np.square(a, dtype=np.float64).sum(axis=axis, keepdims=True)
        sb[at] += np.square(b, dtype=np.float64).sum(axis=axis, keepdims=True)
    dtype = _dtype(v0)
    dt = dtype.type
    na = np.maximum(np.sqrt(sa).astype(dtype), dt(1e-7))
    nb = np.maximum(np.sqrt(sb).astype(dtype), dt(1e-7))
    cos = np.zeros(acc_shape)
    for s, e in spans:
        a, b, _, at = views(s, e)
        part = (a / na[at]).astype(np.float64) * (b / nb[at]).astype(np.float64)
        cos[at] += part.sum(axis=axis, keepdims=True)
    cos = np.clip(cos, -1, 1)
    colinear = (1 - cos**2) <= eps**2
    theta = np.arccos(np.where(colinear, 0.0, cos))
    sin = np.where(colinear, 1.0, np.sin(theta))
    c0 = np.where(colinear, 1 - t, np.sin((1 - t) * theta) / sin).astype(dtype)
    c1 = np.where(colinear, t, np.sin(t * theta) / sin).astype(dtype)
    for s, e in spans:
        a, b, bb, at = views(s, e)
        r = (c0[at] * a + c1[at] * b).astype(dtype).reshape(-1)
        out[s:e] = (r if bb is None else bb + r).astype(out.dtype)


def multislerp(
    models: Sequence[Read],
    weights: Sequence[float],
    size: int,
    out: np.ndarray,
    *,
    base: Read | None = None,
    normalize_weights: bool = True,
    eps: float = 1e-8,
    chunk: int = CHUNK,
) -> None:
    """:func:`consensus.merging.spherical.multislerp` over chunks.

    Passes: the task vectors' norms; the weighted mean direction's norm; the unit vectors' dot
    products with it; the tangent's norm; the result (each recomputes the chunk's unit vectors
    from the inputs rather than keeping a tensor-sized copy).

    Args:
      models: The models' tensors, the base left out.
      weights: One weight per model.
      size: The number of entries.
      out: The flat result (written, cast to its dtype).
      base: The origin of the hypersphere, or None.
      normalize_weights: Normalise the weights to sum 1.
      eps: The numerical guard.
      chunk: Entries per chunk.

    Raises:
      ValueError: If the weighted mean direction vanishes for three or more models.
    """
    n = len(models)
    spans = list(_spans(size, chunk))
    if n == 1:
        for s, e in spans:
            out[s:e] = models[0](s, e).astype(out.dtype)
        return
    dtype = _dtype(models[0])
    dt = dtype.type
    w = np.asarray([float(x) for x in weights], np.float64).astype(dtype)
    if normalize_weights:
        w = w / reduce_sum(w)

    def deltas(s: int, e: int) -> tuple[np.ndarray, np.ndarray | None]:
        v = np.stack([m(s, e).astype(dtype) for m in models])
        bb = None if base is None else base(s, e)
        return (v if bb is None else v - bb), bb

    sq = np.zeros(n)
    for s, e in spans:
        sq += _sumsq(deltas(s, e)[0], axis=1)
    norms = np.sqrt(sq).astype(dtype)[:, None]

    def units(s: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        v, bb = deltas(s, e)
        unit = v / (norms + dt(eps))
        return unit, reduce_sum(unit * w[:, None], axis=0), bb

    msq = 0.0
    for s, e in spans:
        msq += float(_sumsq(units(s, e)[1]))
    mean_norm = np.sqrt(np.float64(msq)).astype(dtype)
    if mean_norm < eps:
        if n != 2:
            raise ValueError(
                "multislerp: the weighted sum of the input tensors is zero (antipodal inputs with balancing "
                "weights); use different weights"
            )
        for s, e in spans:
            v, bb = deltas(s, e)
            r = v[0] * w[0] + v[1] * w[1]
            out[s:e] = (r if bb is None else r + bb).astype(out.dtype)
        return
    dots64 = np.zeros(n)
    for s, e in spans:
        unit, mean, _ = units(s, e)
        dots64 += (unit * (mean / mean_norm)).sum(axis=-1, dtype=np.float64)
    dots = dots64.astype(dtype)[:, None]

    def tangent(s: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        unit, mean, bb = units(s, e)
        mean = mean / mean_norm
        return mean, reduce_sum((unit - dots * mean) * w[:, None], axis=0), bb

    tsq = 0.0
    for s, e in spans:
        tsq += float(_sumsq(tangent(s, e)[1]))
    tnorm = np.sqrt(np.float64(tsq)).astype(dtype) + dt(eps)
    scale = reduce_sum(norms[:, 0] * w)
    for s, e in spans:
        mean, tan, bb = tangent(s, e)
        r = (mean * np.cos(tnorm) + tan * (np.sin(tnorm) / tnorm)) * scale
        out[s:e] = (r if bb is None else r + bb).astype(dtype).astype(out.dtype)


def sce(
    base: Read,
    models: Sequence[Read],
    size: int,
    out: np.ndarray,
    *,
    select_topk: float = 1.0,
    chunk: int = CHUNK,
) -> None:
    """:func:`consensus.merging.generalized.sce` over chunks.

    With ``0 < select_topk < 1`` a first pass writes the variances across models into one
    tensor-sized float32 array, whose top-k (:func:`~consensus.merging.sparsify.rank_window`,
    partitioning that array in place, then a pass that writes the variances back) becomes a mask
    packed 8 entries a byte; a next pass sums each model's mean square; the last merges chunk by
    chunk.

    Args:
      base: The base tensor.
      models: The models' tensors, the base left out.
      size: The number of entries.
      out: The flat result (written, cast to its dtype).
      select_topk: The fraction of entries kept by variance.
      chunk: Entries per chunk.
    """
    from consensus.merging.generalized import sign_mask

    n = len(models)
    spans = list(_spans(size, chunk))
    if n == 0:
        for s, e in spans:
            out[s:e] = base(s, e).astype(out.dtype)
        return
    dtype = _dtype(base)
    dt = dtype.type

    def tvs(s: int, e: int) -> tuple[np.ndarray, np.ndarray]:
        b = base(s, e)
        return np.stack([m(s, e).astype(dtype, copy=False) - b for m in models]), b

    packed: np.ndarray | None = None
    if 0 < select_topk < 1:
        from consensus.merging.sparsify import rank_window

        nonzero = [0]

        def variances(flat: np.ndarray) -> None:
            """Write ``-|var|`` (the formula's ``-flat``) into ``flat``, counting the nonzero ones."""
            nonzero[0] = 0
            for s, e in spans:
                tv, _ = tvs(s, e)
                mean = reduce_sum(tv, axis=0) / np.asarray(n, dtype)
                var = reduce_sum(np.square(tv - mean), axis=0) / np.asarray(n, dtype)
                nonzero[0] += int(np.count_nonzero(var))
                flat[s:e] = np.abs(var)
                np.negative(flat[s:e], out=flat[s:e])

        flat = np.empty(size, np.float32)
        variances(flat)
        k = int(nonzero[0] * select_topk)
        # partitioned in place and refilled by a pass over the inputs: no second tensor-sized copy
        keep = rank_window(flat, 0, k, refill=variances) if k > 0 else np.zeros(size, bool)
        del flat
        packed = np.packbits(keep)
        del keep

    def kept(s: int, e: int) -> tuple[np.ndarray, np.ndarray]:
        tv, b = tvs(s, e)
        if select_topk <= 0:
            return tv * 0, b
        if packed is not None:
            tv = tv * _unpack(packed, s, e).astype(dtype)
        return tv, b

    sq64 = np.zeros(n)
    for s, e in spans:
        sq64 += _sumsq(kept(s, e)[0], axis=1)
    sq = sq64.astype(dtype) / np.asarray(size, np.float64).astype(dtype)
    total = float(reduce_sum(sq))
    w = np.full(n, 1.0 / n).astype(dtype) if abs(total) < 1e-6 else sq / dt(total)
    for s, e in spans:
        tv, b = kept(s, e)
        erased = w[:, None] * sign_mask(tv, "sum").astype(dtype)
        merged = reduce_sum(tv * erased, axis=0)
        r = b + merged / np.maximum(reduce_sum(erased, axis=0), dt(1e-6))
        out[s:e] = r.astype(dtype).astype(out.dtype)


def _unpack(packed: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Entries ``[start, stop)`` of a ``np.packbits`` mask, as bools."""
    b0 = start // 8
    bits = np.unpackbits(packed[b0 : (stop + 7) // 8])
    return bits[start - 8 * b0 : stop - 8 * b0].astype(bool)


def arcee_fusion(
    base: Read,
    model: Read,
    shape: Sequence[int],
    out: np.ndarray,
    rng: np.random.Generator | None = None,
    *,
    chunk: int = CHUNK,
) -> None:
    """:func:`consensus.merging.spherical.arcee_fusion` over chunks of whole rows.

    The importance of an entry depends on its row only, so a first pass over row chunks gathers
    the entries the quantiles are read from (all of them, or the same 10^6 draws with
    replacement as the formula's, for the same generator); the second recomputes the importance
    chunk by chunk against the threshold.

    Args:
      base: The base tensor ``b``.
      model: The other model's tensor ``x``.
      shape: The tensor's shape (at least one axis).
      out: The flat result (written, cast to its dtype).
      rng: The generator for the quantile sample of large tensors.
      chunk: Entries per chunk (rounded to whole rows).

    Raises:
      ValueError: If a tensor has more than 10^6 entries and no generator is given.
    """
    from consensus.merging.spherical import QUANTILE_SAMPLE, _softmax

    size = int(np.prod(shape, dtype=np.int64))
    cols = int(shape[-1])
    spans = list(_spans(size, chunk, cols))

    def importance(s: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        b = base(s, e).reshape(-1, cols)
        x = model(s, e).astype(b.dtype, copy=False).reshape(-1, cols)
        p = _softmax(x) + b.dtype.type(1e-8)
        q = _softmax(b) + b.dtype.type(1e-8)
        kl = reduce_sum(p * np.log(p / q), axis=-1, keepdims=True)
        return np.abs(x - b) * kl, x, b

    dtype = _dtype(base)
    if size > QUANTILE_SAMPLE:
        if rng is None:
            raise ValueError("arcee_fusion: a tensor over 10^6 entries needs a generator for its quantiles")
        draws = rng.integers(0, size, QUANTILE_SAMPLE)
        order = np.argsort(draws, kind="stable")
        where = draws[order]
        sample = np.empty(QUANTILE_SAMPLE, dtype)
        for s, e in spans:
            lo, hi = np.searchsorted(where, [s, e])
            if hi > lo:
                sample[order[lo:hi]] = importance(s, e)[0].reshape(-1)[where[lo:hi] - s]
        del draws, order, where
    else:
        sample = np.empty(size, dtype)
        for s, e in spans:
            sample[s:e] = importance(s, e)[0].reshape(-1)
    at = [int(np.floor(q_ * (sample.size - 1))) for q_ in (0.25, 0.5, 0.75)]
    q1, median, q3 = np.partition(sample, at)[at]
    del sample
    threshold = median + dtype.type(1.5) * (q3 - q1)
    for s, e in spans:
        imp, x, b = importance(s, e)
        out[s:e] = (b + (x - b) * (imp >= threshold).astype(dtype)).reshape(-1).astype(out.dtype)


def ramplus_boost(
    base: Read,
    models: Sequence[Read],
    size: int,
    epsilon: float = 1e-5,
    r: float = 0.1,
    alpha: float = 0.2,
    *,
    chunk: int = CHUNK,
) -> np.ndarray:
    """``ramplus_tl``'s per-model boost of :func:`~consensus.merging.generalized.ram`, counted over chunks.

    ``1 + r * clip(shared_i / max(unique_i, epsilon), 0, alpha)`` with the counts of model i's
    changed entries that others also / do not change (integers, so exact); the merge itself is
    then element-wise (``generalized.ram(..., boost=...)`` chunk by chunk).

    Args:
      base: The base tensor.
      models: The models' tensors, the base left out.
      size: The number of entries.
      epsilon: The magnitude above which an entry counts as changed.
      r: The boost.
      alpha: The cap on the shared/unique ratio.
      chunk: Entries per chunk.

    Returns:
      (n,) the boost per model, float32.
    """
    n = len(models)
    shared, unique = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for s, e in _spans(size, chunk):
        b = base(s, e)
        eps = b.dtype.type(epsilon)
        nz = np.stack([np.abs(m(s, e).astype(b.dtype, copy=False) - b) > eps for m in models])
        counts = nz.sum(axis=0)
        shared += (nz & (counts > 1)).sum(axis=1)
        unique += (nz & (counts == 1)).sum(axis=1)
    rho = shared.astype(np.float32) / np.maximum(unique.astype(np.float32), np.float32(epsilon))
    return np.asarray(1 + r * np.clip(rho, 0, alpha), np.float32)
