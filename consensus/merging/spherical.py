"""mergekit's interpolations of one tensor (numpy): SLERP, NuSLERP, Multi-SLERP, NearSwap, Arcee Fusion.

The per-tensor formulas of mergekit 0.1.5 (github.com/arcee-ai/mergekit,
``mergekit/merge_methods/{slerp,nuslerp,multislerp,nearswap,arcee_fusion}.py``), in a compute
dtype (:mod:`consensus.merging._numeric`); norms and dot products are accumulated in float64.
The library's jax :func:`~consensus.merging.slerp` merges whole trees with one ``t``; these run
tensor by tensor, so ``t`` may follow a gradient over the layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from consensus.merging._numeric import norm, reduce_sum

DOT_THRESHOLD = 0.9995  # mergekit's slerp: above it, linear interpolation
QUANTILE_SAMPLE = 1_000_000  # arcee_fusion: larger tensors' quantiles come from this many draws


def slerp(t: float, v0: np.ndarray, v1: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Mergekit's ``slerp``: spherical interpolation of two whole tensors, ``t = 0`` giving ``v0``.

    ``dot = <v0/|v0|, v1/|v1|>`` (a norm below eps is not divided by); ``|dot| > 0.9995``:
    ``(1 - t) v0 + t v1``; else with ``theta = arccos(dot)``:
    ``(sin((1 - t) theta) v0 + sin(t theta) v1) / sin(theta)``.

    Args:
      t: The interpolation parameter.
      v0: The base model's tensor (``t = 0``).
      v1: The other model's tensor.
      eps: The norm below which a vector is not normalised.

    Returns:
      The interpolated tensor, in ``v0``'s dtype.
    """
    a = v0.reshape(-1).astype(np.float64)
    b = v1.reshape(-1).astype(np.float64)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    dot = float(np.dot(a / na if na > eps else a, b / nb if nb > eps else b))
    dt = v0.dtype.type
    if abs(dot) > DOT_THRESHOLD:
        return (dt(1 - t) * v0 + dt(t) * v1.astype(v0.dtype)).astype(v0.dtype)
    theta = np.arccos(dot)
    s0 = np.sin(theta - theta * t) / np.sin(theta)
    s1 = np.sin(theta * t) / np.sin(theta)
    return (dt(s0) * v0 + dt(s1) * v1.astype(v0.dtype)).astype(v0.dtype)


def nuslerp(
    t: float,
    v0: np.ndarray,
    v1: np.ndarray,
    *,
    row_wise: bool = False,
    flatten: bool = True,
    eps: float = 1e-8,
) -> np.ndarray:
    """Mergekit's ``nuslerp`` kernel: SLERP of whole tensors (``flatten``) or of rows / columns.

    Vectors are taken along the last axis (``row_wise``: the first), or the whole tensor with
    ``flatten``. ``u = v / max(|v|, 1e-7)``, ``cos = clip(<u0, u1>, -1, 1)``; where
    ``1 - cos^2 <= eps^2`` the result is ``(1 - t) v0 + t v1``, else
    ``(sin((1 - t) theta) v0 + sin(t theta) v1) / sin(theta)``, ``theta = arccos(cos)``.

    Args:
      t: The interpolation parameter (mergekit: ``w_1 / (w_0 + w_1)``).
      v0: The first tensor.
      v1: The second tensor.
      row_wise: Interpolate along the first axis instead of the last.
      flatten: Interpolate the whole tensors as single vectors (mergekit's default).
      eps: The colinearity tolerance.

    Returns:
      The interpolated tensor.
    """
    shape = v0.shape
    if flatten:
        a, b = v0.reshape(-1), v1.reshape(-1)
    elif row_wise:
        a, b = np.swapaxes(v0, 0, -1), np.swapaxes(v1, 0, -1)
    else:
        a, b = v0, v1
    dt = v0.dtype.type
    ua = a / np.maximum(norm(a, axis=-1, keepdims=True), dt(1e-7))
    ub = b / np.maximum(norm(b, axis=-1, keepdims=True), dt(1e-7))
    cos = np.clip((ua.astype(np.float64) * ub.astype(np.float64)).sum(-1, keepdims=True), -1, 1)
    colinear = (1 - cos**2) <= eps**2
    theta = np.arccos(np.where(colinear, 0.0, cos))
    sin = np.where(colinear, 1.0, np.sin(theta))
    c0 = np.where(colinear, 1 - t, np.sin((1 - t) * theta) / sin).astype(v0.dtype)
    c1 = np.where(colinear, t, np.sin(t * theta) / sin).astype(v0.dtype)
    out = c0 * a + c1 * b
    if row_wise and not flatten:
        out = np.swapaxes(out, 0, -1)
    return out.reshape(shape).astype(v0.dtype)


def multislerp(
    models: Sequence[np.ndarray],
    weights: Sequence[float],
    base: np.ndarray | None = None,
    normalize_weights: bool = True,
    eps: float = 1e-8,
) -> np.ndarray:
    """Mergekit's ``multislerp``: barycentric interpolation on the hypersphere of n tensors.

    With ``v_i = x_i - b`` (or ``x_i`` without a base) flattened, ``w`` normalised to sum 1:
    ``u_i = v_i / (|v_i| + eps)``, ``mu = sum_i w_i u_i / |.|``, tangent vectors
    ``t_i = u_i - <u_i, mu> mu``, ``T = sum_i w_i t_i``, ``|T| + eps = s``; the result is
    ``(cos(s) mu + sin(s) T / s) * sum_i w_i |v_i|`` (+ b). One model: itself. When
    ``|sum_i w_i u_i| < eps``: two models interpolate linearly, more are an error.

    Args:
      models: The models' tensors, the base left out.
      weights: One weight per model.
      base: The origin of the hypersphere, or None.
      normalize_weights: Normalise the weights to sum 1.
      eps: The numerical guard.

    Returns:
      The merged tensor.

    Raises:
      ValueError: If the weighted mean direction vanishes for three or more models.

    References:
      Goddard 2025, goddard.blog/posts/multislerp-wow-what-a-cool-idea.
    """
    if len(models) == 1:
        return models[0]
    dtype = models[0].dtype
    dt = dtype.type
    v = np.stack([x.astype(dtype) for x in models])
    if base is not None:
        v = v - base
    flat = v.reshape(len(models), -1)
    w = np.asarray([float(x) for x in weights], np.float64).astype(dtype)
    if normalize_weights:
        w = w / reduce_sum(w)
    norms = norm(flat, axis=-1, keepdims=True)
    unit = flat / (norms + dt(eps))
    mean = reduce_sum(unit * w[:, None], axis=0)
    mean_norm = norm(mean)
    if mean_norm < eps:
        if len(models) == 2:
            res = (v[0] * w[0] + v[1] * w[1]).reshape(v.shape[1:])
            return res if base is None else res + base
        raise ValueError(
            "multislerp: the weighted sum of the input tensors is zero (antipodal inputs with balancing "
            "weights); use different weights"
        )
    mean = mean / mean_norm
    dots = reduce_sum(unit * mean, axis=-1, keepdims=True)
    tangent = reduce_sum((unit - dots * mean) * w[:, None], axis=0)
    tnorm = norm(tangent) + dt(eps)
    result = mean * np.cos(tnorm) + tangent * (np.sin(tnorm) / tnorm)
    result = (result * reduce_sum(norms[:, 0] * w)).reshape(v.shape[1:])
    return (result if base is None else result + base).astype(dtype)


def nearswap(base: np.ndarray, model: np.ndarray, t: float) -> np.ndarray:
    """Mergekit's ``nearswap``: take the model's value where it is near the base's.

    ``w = clip(t / max(|b - x|, 1e-6), 0, 1)``, result ``w x + (1 - w) b``: entries closer than
    ``t`` to the base's become the model's, farther ones move towards it by ``t / |b - x|``.

    Args:
      base: The base tensor ``b``.
      model: The other model's tensor ``x``.
      t: The distance scale.

    Returns:
      The merged tensor.

    References:
      huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001 (mergekit's reference).
    """
    dt = base.dtype.type
    x = model.astype(base.dtype, copy=False)
    w = np.clip(dt(t) / np.maximum(np.abs(base - x), dt(1e-6)), 0, 1).astype(base.dtype)
    return w * x + (dt(1) - w) * base


def _softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, computed in float32 (float64 stays) and rounded once, as torch's is."""
    wide = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
    z = np.exp(wide - wide.max(axis=-1, keepdims=True))
    return (z / z.sum(axis=-1, keepdims=True)).astype(x.dtype)


def arcee_fusion(base: np.ndarray, model: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
    """Mergekit's ``arcee_fusion``: keep the model's changes whose importance is an upper outlier.

    Importance ``s = |x - b| * KL(p || q)`` with ``p = softmax(x) + 1e-8``, ``q = softmax(b) + 1e-8``
    over the last axis (the KL divergence summed there, per row); threshold
    ``median + 1.5 (Q3 - Q1)`` of ``s``, the quantiles read at sorted index
    ``floor(q (N - 1))`` (more than 10^6 entries: of 10^6 drawn with replacement, so in
    distribution only); the result is ``b + (x - b) [s >= threshold]``.

    Args:
      base: The base tensor ``b``.
      model: The other model's tensor ``x``.
      rng: The generator for the quantile sample of large tensors.

    Returns:
      The merged tensor.

    Raises:
      ValueError: If a tensor has more than 10^6 entries and no generator is given.
    """
    x = model.astype(base.dtype, copy=False)
    diff = np.abs(x - base)
    p = _softmax(x) + base.dtype.type(1e-8)
    q = _softmax(base) + base.dtype.type(1e-8)
    kl = reduce_sum(p * np.log(p / q), axis=-1, keepdims=True)
    importance = diff * kl
    flat = importance.reshape(-1)
    if flat.size > QUANTILE_SAMPLE:
        if rng is None:
            raise ValueError("arcee_fusion: a tensor over 10^6 entries needs a generator for its quantiles")
        flat = flat[rng.integers(0, flat.size, QUANTILE_SAMPLE)]
    at = [int(np.floor(q_ * (flat.size - 1))) for q_ in (0.25, 0.5, 0.75)]
    q1, median, q3 = np.partition(flat, at)[at]
    threshold = median + base.dtype.type(1.5) * (q3 - q1)
    return base + (x - base) * (importance >= threshold).astype(base.dtype)
