"""PEFT's ``add_weighted_adapter`` combinations, PEFT's formulas: ``linear``, ``cat``, ``ties``, ``dare_*``.

PEFT (``peft.tuners.lora.LoraModel.add_weighted_adapter``) combines adapters with weights used
as given (a weighted sum; negative weights allowed), folds each adapter's scaling ``s_i`` into
the factors, and gives the new adapter ``lora_alpha = r``, i.e. scale 1. The same here: every
method below returns ``scale = 1``. ``svd`` is :func:`consensus.lora.methods.svd` (the same
formula, the scale kept). In PEFT's torch layout ``lora_A`` is ``a^T`` and ``lora_B`` is
``b^T``; what PEFT does to ``lora_A`` is done here to ``a``.

* ``cat``: ``a = [w_1 s_1 a_1 ... w_n s_n a_n]``, ``b = [b_1; ...; b_n]``; exact, rank n r.
* ``linear``, ``ties``, ``dare_linear``, ``dare_ties``: *on the factors*, with
  ``c_i = w_i s_i`` split as ``sign(c_i) sqrt|c_i|`` on ``a`` and ``sqrt|c_i|`` on ``b``:
  ``a = combine_i(sign(c_i) sqrt|c_i| a_i)``, ``b = combine_i(sqrt|c_i| b_i)`` with the
  combination PEFT's ``merge_utils`` names (a weighted sum; TIES' magnitude trim, sign election
  and disjoint mean; DARE's random drop rescaled by 1/density). Approximate, rank r: PEFT's own
  docstring calls ``linear`` "a very rough approximation"; ``info["approximation_error"]`` says
  how rough (from the factors, :func:`consensus.lora.methods.approximation_error`).

DARE's drop here is drawn from a ``jax.random`` key, not torch's generator: equal to PEFT's in
distribution, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from consensus.lora._core import AdapterError, AdapterMerge, finish, host
from consensus.lora.methods import (
    AdapterMethod,
    Stacked,
    _info,
    _rank_of,
    approximation_error,
    stacked_factors,
)
from consensus.specs import ADAPTER_METHODS

SIGN_METHODS = ("total", "frequency")


def sqrt_split(w: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's per-node factor weights: ``sign(c) sqrt|c|`` for ``a`` and ``sqrt|c|`` for ``b``, c = w s."""
    c = w * s
    root = np.sqrt(np.abs(c))
    return np.where(c >= 0, 1.0, -1.0) * root, root


def magnitude_prune(x: np.ndarray, density: float) -> np.ndarray:
    """Keep the ``int(density * size)`` entries of largest magnitude of one node's factor (PEFT's ``prune``).

    ``density >= 1`` keeps everything, as PEFT does. Equal magnitudes are kept in index order
    (torch's ``topk`` leaves that order unspecified).
    """
    if density >= 1:
        return x
    k = int(density * x.size)
    flat = x.reshape(-1)
    keep = np.zeros(flat.shape, bool)
    keep[np.argsort(-np.abs(flat), kind="stable")[:k]] = True
    return np.where(keep, flat, 0.0).reshape(x.shape)


def random_prune(key: jax.Array, x: np.ndarray, density: float) -> np.ndarray:
    """DARE's drop: keep each entry with probability ``density``, rescaled by ``1 / density``.

    One draw for the whole stack of a factor (n, ...): each node's entries are independent draws,
    as PEFT's per-tensor ``torch.bernoulli``.
    """
    if density >= 1:
        return x
    keep = np.asarray(jax.random.bernoulli(key, density, x.shape))
    return np.where(keep, x / density, 0.0)


def disjoint_ties(pruned: np.ndarray, c: np.ndarray, sign_method: str) -> np.ndarray:
    """PEFT's ``ties`` after the pruning: sign election, then the disjoint mean.

    The sign of each entry is elected on the unweighted pruned stack (``total``: the sign of the
    sum, ``frequency``: of the count of signs); the result is the sum of the weighted entries that
    agree with it over their count (at least 1).
    """
    sign = np.sign(pruned)
    magnitude = pruned.sum(0) if sign_method == "total" else sign.sum(0)
    majority = np.where(magnitude >= 0, 1.0, -1.0)
    agree = sign == majority
    weighted = c.reshape((-1,) + (1,) * (pruned.ndim - 1)) * pruned
    return np.where(agree, weighted, 0.0).sum(0) / np.maximum(agree.sum(0), 1)


def check_density(method: str, density: float, *, positive: bool) -> float:
    """A density in [0, 1] ((0, 1] for DARE, which divides by it)."""
    try:
        d = float(density)
    except (TypeError, ValueError):
        raise AdapterError(f"{method}: density must be a number in [0, 1], got {density!r}") from None
    if not (0 < d <= 1 if positive else 0 <= d <= 1):
        raise AdapterError(f"{method}: density must be in {'(0, 1]' if positive else '[0, 1]'}, got {d}")
    return d


def check_sign_method(method: str, sign: str) -> str:
    """PEFT's ``majority_sign_method``: ``total`` or ``frequency``."""
    if sign not in SIGN_METHODS:
        raise AdapterError(
            f"{method}: majority_sign_method must be one of {list(SIGN_METHODS)}, got {sign!r}"
        )
    return sign


FactorCombine = Callable[[np.ndarray, np.ndarray, Any], np.ndarray]


def _factorwise(name: str, combine_factor: FactorCombine, randomized: bool = False) -> AdapterMethod:
    """A PEFT factor-space method: ``combine_factor(stack, c, key)`` applied to a and to b."""

    def combine(stacked: Stacked, s: np.ndarray, w: np.ndarray, key: Any = None) -> AdapterMerge:
        ca, cb = sqrt_split(w, s)
        out: dict[str, dict[str, np.ndarray]] = {}
        for i, (t, f) in enumerate(stacked.items()):
            keys = jax.random.split(jax.random.fold_in(key, i)) if randomized else (None, None)
            out[t] = {
                "a": combine_factor(host(f["a"]), ca, keys[0]),
                "b": combine_factor(host(f["b"]), cb, keys[1]),
            }
        adapter, _ = finish(out, stacked)
        error = approximation_error(stacked, s, w, out, 1.0)
        return AdapterMerge(adapter, 1.0, None, _info(name, False, w, _rank_of(adapter), **error))

    return AdapterMethod(name, combine)


def _weighted(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    return np.tensordot(c, x, axes=1)


@ADAPTER_METHODS.declare(
    kind="adapter", traits={"exact": False, "normalize": False, "space": "factors", "dense": False}
)
def linear() -> AdapterMethod:
    """PEFT's ``linear``: ``a = sum_i sign(c_i) sqrt|c_i| a_i``, ``b = sum_i sqrt|c_i| b_i``, c_i = w_i s_i.

    A weighted sum on the factors with the weight split between them; approximate (cross terms),
    rank r, scale 1; weights as given (default 1/n). Needs one rank for every node.

    References:
      PEFT's ``LoraModel.add_weighted_adapter(..., combination_type="linear")`` (Hugging Face).
    """
    return _factorwise("linear", lambda x, c, key: _weighted(x, c))


@ADAPTER_METHODS.declare(
    kind="adapter", traits={"exact": True, "normalize": False, "space": "products", "dense": False}
)
def cat() -> AdapterMethod:
    """PEFT's ``cat``: the ranks concatenated, ``w_i s_i`` on each ``a_i`` block; exact, rank n r, scale 1.

    ``a = [w_1 s_1 a_1 ... w_n s_n a_n]``, ``b = [b_1; ...; b_n]``, so ``a b = sum_i w_i s_i a_i b_i``.
    The same update as :func:`consensus.lora.methods.stack` (FLoRA) with the weights as given
    (default 1/n) instead of normalised, and every node kept (PEFT's rank is the sum of the ranks).

    References:
      PEFT's ``LoraModel.add_weighted_adapter(..., combination_type="cat")`` (Hugging Face).
    """

    def combine(stacked: Stacked, s: np.ndarray, w: np.ndarray, key: Any = None) -> AdapterMerge:
        adapter, kept = stacked_factors(stacked, w * s, on="a", keep_zero=True)
        return AdapterMerge(adapter, 1.0, None, _info("cat", True, w, _rank_of(adapter), nodes=kept))

    return AdapterMethod("cat", combine)


@ADAPTER_METHODS.declare(
    kind="adapter", traits={"exact": False, "normalize": False, "space": "factors", "dense": False}
)
def ties(density: float, majority_sign_method: str = "total") -> AdapterMethod:
    """PEFT's ``ties`` on the factors: per node-factor magnitude trim, sign election, disjoint mean.

    For each factor (a, then b) of each target: keep the ``int(density * size)`` largest
    magnitudes of each node's factor, elect the sign per entry from the unweighted trimmed stack
    (``total``: the sign of their sum; ``frequency``: of the count of signs), and take the sum of
    the weighted entries that agree with it divided by their count (at least 1), with PEFT's
    sqrt-split weights (see the module docstring). Approximate, rank r, scale 1.

    References:
      Yadav et al., "TIES-Merging: Resolving Interference When Merging Models", NeurIPS 2023;
      PEFT's ``add_weighted_adapter(..., combination_type="ties")`` (Hugging Face).
    """
    d = check_density("ties", density, positive=False)
    sign = check_sign_method("ties", majority_sign_method)

    def one(x: np.ndarray, c: np.ndarray, key: Any) -> np.ndarray:
        pruned = np.stack([magnitude_prune(x[i], d) for i in range(x.shape[0])])
        return disjoint_ties(pruned, c, sign)

    return _factorwise("ties", one)


@ADAPTER_METHODS.declare(
    kind="adapter",
    needs=("key",),
    traits={"exact": False, "normalize": False, "space": "factors", "dense": False},
)
def dare_linear(density: float) -> AdapterMethod:
    """PEFT's ``dare_linear`` on the factors: DARE's random drop, then PEFT's ``linear`` weighted sum.

    Each node's factor keeps each entry with probability ``density``, rescaled by ``1/density``.
    Approximate, rank r, scale 1.

    The drop is keyed (``jax.random``): equal to PEFT's in distribution, not bit for bit.

    References:
      Yu et al., "Language Models are Super Mario: Absorbing Abilities from Homologous Models as
      a Free Lunch", ICML 2024; PEFT's ``add_weighted_adapter(..., combination_type="dare_linear")``.
    """
    d = check_density("dare_linear", density, positive=True)

    def one(x: np.ndarray, c: np.ndarray, key: Any) -> np.ndarray:
        return _weighted(random_prune(key, x, d), c)

    return _factorwise("dare_linear", one, randomized=True)


@ADAPTER_METHODS.declare(
    kind="adapter",
    needs=("key",),
    traits={"exact": False, "normalize": False, "space": "factors", "dense": False},
)
def dare_ties(density: float, majority_sign_method: str = "total") -> AdapterMethod:
    """PEFT's ``dare_ties`` on the factors: DARE's random drop, then TIES' sign election and disjoint mean.

    Approximate, rank r, scale 1; the drop is keyed as in :func:`dare_linear`.

    References:
      Yu et al., ICML 2024 (DARE); Yadav et al., NeurIPS 2023 (TIES); PEFT's
      ``add_weighted_adapter(..., combination_type="dare_ties")``.
    """
    d = check_density("dare_ties", density, positive=True)
    sign = check_sign_method("dare_ties", majority_sign_method)

    def one(x: np.ndarray, c: np.ndarray, key: Any) -> np.ndarray:
        return disjoint_ties(random_prune(key, x, d), c, sign)

    return _factorwise("dare_ties", one, randomized=True)
