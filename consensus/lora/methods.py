"""The adapter consensus methods: FedIT, FFA-LoRA, FLoRA's stacking, truncated SVD, FedEx-LoRA.

Each method is declared in :data:`consensus.specs.ADAPTER_METHODS` (``kind="adapter"``) with the
options it takes (its factory's parameters) and, in ``traits``, whether it is exact, whether it
normalises the node weights and in which space it works. A declared factory returns an
:class:`AdapterMethod`; :func:`consensus.lora.merge_adapters` is the one entry point.

Notation: node i sends ``a_i`` (in, r), ``b_i`` (r, out) with scale ``s_i``, so its update
(its *product*) is ``P_i = s_i a_i b_i``; ``w`` are the node weights. A method is *exact* when
the merged adapter's update (plus ``base_delta``, where it has one) equals its target
combination of the products, ``sum_i w_i P_i``, up to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from consensus.lora._core import Adapter, AdapterError, AdapterMerge, finish, host
from consensus.specs import ADAPTER_METHODS

Stacked = Mapping[str, Mapping[str, Any]]
Combine = Callable[[Stacked, np.ndarray, np.ndarray, Any], AdapterMerge]
#: ``from_dense(m, rank, scale) -> (a, b, base_delta or None, info)`` for one target's dense update.
FromDense = Callable[
    [np.ndarray, int, float], tuple[np.ndarray, np.ndarray, np.ndarray | None, dict[str, Any]]
]
HostAdapter = dict[str, dict[str, np.ndarray]]


class AdapterMethod(NamedTuple):
    """A built adapter method.

    Attributes:
      name: The declared name.
      combine: ``combine(stacked, s, w, key) -> AdapterMerge`` with per-node scales ``s`` and
        node weights ``w`` ((n,) float64, already normalised when the method normalises).
      from_dense: For methods that can start from a dense merged update of one target (the output
        of a coordinate-wise robust rule on the products): ``from_dense(m, rank, scale)`` returns
        the target's factors (with ``scale``), its base delta (or None) and its diagnostics;
        None for the methods that need per-node weights.
      rank: The output rank the method was built with (``svd``), None for the input rank.
    """

    name: str
    combine: Combine
    from_dense: FromDense | None = None
    rank: int | None = None


def out_scale(s: np.ndarray) -> float:
    """The merged adapter's scale: the first node's (the shared scale when the nodes agree)."""
    return float(s[0])


def factor_mean(stacked: Stacked, s: np.ndarray, w: np.ndarray) -> HostAdapter:
    """``a = sum_i w_i a_i``, ``b = sum_i w_i (s_i / s_out) b_i`` in float64: FedIT's factor-wise mean.

    Folding ``s_i / s_out`` into ``b_i`` keeps each node's own update when the scales differ.
    """
    wb = w * s / out_scale(s)
    return {
        t: {"a": np.tensordot(w, host(f["a"]), axes=1), "b": np.tensordot(wb, host(f["b"]), axes=1)}
        for t, f in stacked.items()
    }


def concat_factors(f: Mapping[str, Any], coeffs: np.ndarray, on: str = "b") -> tuple[np.ndarray, np.ndarray]:
    """``[a_1 ... a_n]`` (in, n r), ``[c_1 b_1; ...; c_n b_n]`` (n r, out) in float64 (``on="a"``: c on a)."""
    a, b = host(f["a"]), host(f["b"])
    n, fan_in, r = a.shape
    c = coeffs.reshape(n, 1, 1)
    a, b = (c * a, b) if on == "a" else (a, c * b)
    return np.moveaxis(a, 0, 1).reshape(fan_in, n * r), b.reshape(n * r, -1)


def mean_product(f: Mapping[str, Any], s: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``sum_i w_i s_i a_i b_i`` of one target in float64, as one (in, n r) @ (n r, out) product."""
    a_cat, b_cat = concat_factors(f, w * s)
    return a_cat @ b_cat


def _info(name: str, exact: bool, w: np.ndarray, rank: int, **more: Any) -> dict[str, Any]:
    return {
        "method": name,
        "exactness": "exact" if exact else "approximate",
        "weights": [float(x) for x in w],
        "rank": int(rank),
        **more,
    }


def approximation_error(
    stacked: Stacked, s: np.ndarray, w: np.ndarray, merged: Mapping[str, Mapping[str, Any]], scale: float
) -> dict[str, Any]:
    """How far an approximate method's update is from the weighted sum of the products, from the factors.

    ``||sum_i w_i s_i a_i b_i - scale a b||_F^2`` per target is ``c^T G c`` for the Gram matrix G of
    the n + 1 products (the nodes' and the merged one, :func:`consensus.lora.gram.target_gram`) and
    ``c = (w, -1)``: O((n + 1)^2 r^2 (in + out)), no (in, out) product formed. Returned as
    ``approximation_error`` (per target), ``approximation_error_total`` and
    ``relative_approximation_error`` (divided by ``sum over targets of ||sum_i w_i s_i a_i b_i||^2``).
    """
    from consensus.lora.gram import target_gram

    errors, norm = {}, 0.0
    c = np.append(w, -1.0)
    for t, f in stacked.items():
        a = np.concatenate([host(f["a"]), host(merged[t]["a"])[None]])
        b = np.concatenate([host(f["b"]), host(merged[t]["b"])[None]])
        g = target_gram(a, b, np.append(s, scale))
        errors[t] = float(max(c @ g @ c, 0.0))
        norm += float(w @ g[:-1, :-1] @ w)
    total = sum(errors.values())
    return {
        "approximation_error": errors,
        "approximation_error_total": total,
        "relative_approximation_error": total / norm if norm > 0 else 0.0,
    }


def _rank_of(adapter: Mapping[str, Mapping[str, Any]]) -> int:
    return int(next(iter(adapter.values()))["a"].shape[1])


# ----------------------------------------------------------------------------- FedIT


@ADAPTER_METHODS.declare(
    kind="adapter", traits={"exact": False, "normalize": True, "space": "factors", "dense": False}
)
def fedit() -> AdapterMethod:
    """FedIT: the factor-wise weighted mean, ``a = sum_i w_i a_i``, ``b = sum_i w_i b_i``.

    Approximate: the merged update ``s a b`` is the product of the means, not the mean of the
    products ``sum_i w_i s_i a_i b_i``; the cross terms ``w_i w_j a_i b_j`` (i != j) make the
    difference, which vanishes only when the nodes' factors agree. ``info`` reports it
    (``approximation_error``, squared Frobenius per target, and relative, computed from the
    factors by :func:`approximation_error`). The rank stays r. Weights are
    normalised to sum 1 (default uniform: FedAvg over factors). Nodes with different scales have
    ``s_i / s_0`` folded into their ``b`` first; the result has the first node's scale.

    References:
      Zhang et al., "Towards Building the Federated GPT: Federated Instruction Tuning",
      ICASSP 2024 (arXiv:2305.05644).
    """

    def combine(stacked: Stacked, s: np.ndarray, w: np.ndarray, key: Any = None) -> AdapterMerge:
        mean = factor_mean(stacked, s, w)
        adapter, _ = finish(mean, stacked)
        error = approximation_error(stacked, s, w, mean, out_scale(s))
        return AdapterMerge(adapter, out_scale(s), None, _info("fedit", False, w, _rank_of(adapter), **error))

    return AdapterMethod("fedit", combine)


# ----------------------------------------------------------------------------- FFA-LoRA


def shared_a(stacked: Stacked) -> None:
    """Refuse a stack whose nodes' ``a`` differ (FFA-LoRA freezes one ``a`` shared by every node)."""
    for t, f in stacked.items():
        a = np.asarray(f["a"])
        diff = np.max(np.abs(a - a[:1]), axis=tuple(range(1, a.ndim)))
        if np.any(diff > 0):
            i = int(np.flatnonzero(diff > 0)[0])
            raise AdapterError(
                f"ffa: the nodes' a differ at target {t!r} (node {i} differs from node 0 by up to "
                f"{float(diff[i]):.3g}); FFA-LoRA needs one frozen a shared by every node"
            )


@ADAPTER_METHODS.declare(
    kind="adapter", traits={"exact": True, "normalize": True, "space": "factors", "dense": False}
)
def ffa() -> AdapterMethod:
    """FFA-LoRA: ``a`` is frozen and shared, so the weighted mean of ``b`` is exact.

    Every node trains only ``b`` from one shared, frozen ``a``; then ``s a (sum_i w_i b_i)`` equals
    ``sum_i w_i s a b_i`` exactly. The rank stays r, weights are normalised to sum 1, and a stack
    whose ``a`` differ between nodes (bit for bit) is refused, naming the target and node.
    Different scales are folded into ``b`` as in :func:`fedit`.

    References:
      Sun, Qin, Li, Ding, "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024.
    """

    def combine(stacked: Stacked, s: np.ndarray, w: np.ndarray, key: Any = None) -> AdapterMerge:
        shared_a(stacked)
        wb = w * s / out_scale(s)
        mean = {
            t: {"a": host(f["a"][0]), "b": np.tensordot(wb, host(f["b"]), axes=1)} for t, f in stacked.items()
        }
        adapter, _ = finish(mean, stacked)
        return AdapterMerge(adapter, out_scale(s), None, _info("ffa", True, w, _rank_of(adapter)))

    return AdapterMethod("ffa", combine)


# ----------------------------------------------------------------------------- FLoRA stacking


def stacked_factors(
    stacked: Stacked, coeffs: np.ndarray, *, on: str = "b", keep_zero: bool = False
) -> tuple[Adapter, list[int]]:
    """Concatenate the nodes' ranks: ``a = [a_1 ... a_n]``, ``b = [c_1 b_1; ...; c_n b_n]``.

    ``on="a"`` puts the coefficients on the ``a`` blocks instead (PEFT's ``cat``). Nodes whose
    coefficient is exactly 0 are left out unless ``keep_zero``. Returns the adapter and the kept
    nodes.
    """
    kept = [i for i in range(len(coeffs)) if keep_zero or coeffs[i] != 0]
    if not kept:
        raise AdapterError("every node has weight 0: nothing to stack")
    out: HostAdapter = {}
    for t, f in stacked.items():
        a, b = concat_factors(
            {"a": np.asarray(f["a"])[kept], "b": np.asarray(f["b"])[kept]}, coeffs[kept], on
        )
        out[t] = {"a": a, "b": b}
    return finish(out, stacked)[0], kept


@ADAPTER_METHODS.declare(
    kind="adapter", traits={"exact": True, "normalize": True, "space": "products", "dense": False}
)
def stack() -> AdapterMethod:
    """FLoRA: stack the nodes' adapters along the rank, exact, rank n * r.

    ``a = [a_1 ... a_n]`` (in, n r) and ``b = [w_1 b_1; ...; w_n b_n]`` (n r, out), so
    ``s a b = sum_i w_i s a_i b_i`` exactly: no cross terms. Weights are normalised to sum 1
    (FLoRA's data-size weights ``p_k``); nodes of weight 0 are left out (the rank is then
    ``r`` times the nodes kept, listed in ``info["nodes"]``). Nodes with different scales get
    ``s_i / s_0`` folded into their block of ``b``.

    In FLoRA's rounds the stacked adapter is not trained further: the coordinator adds its update
    to the base (:func:`consensus.lora.dense_delta`) and every node starts the next round from a
    freshly initialised rank-r adapter (:func:`consensus.lora.fresh_adapter`), so the rank does
    not grow from round to round.

    References:
      Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous
      Low-Rank Adaptations", NeurIPS 2024 (arXiv:2409.05976).
    """

    def combine(stacked: Stacked, s: np.ndarray, w: np.ndarray, key: Any = None) -> AdapterMerge:
        adapter, kept = stacked_factors(stacked, w * s / out_scale(s))
        return AdapterMerge(
            adapter, out_scale(s), None, _info("stack", True, w, _rank_of(adapter), nodes=kept)
        )

    return AdapterMethod("stack", combine)


# ----------------------------------------------------------------------------- truncated SVD


def lowrank_svd(a_cat: np.ndarray, b_cat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The thin SVD ``U diag(S) Vt`` of ``M = a_cat @ b_cat`` without forming M.

    With ``a_cat = Qa Ra`` and ``b_cat^T = Qb Rb`` (thin QR), ``M = Qa (Ra Rb^T) Qb^T`` and only
    the small core ``Ra Rb^T`` (at most k x k, k = a_cat's columns) is decomposed: O(k^2 (in + out))
    instead of O(in out min(in, out)). The singular values are M's own.
    """
    qa, ra = np.linalg.qr(a_cat)
    qb, rb = np.linalg.qr(b_cat.T)
    u, sv, vt = np.linalg.svd(ra @ rb.T, full_matrices=False)
    return qa @ u, sv, vt @ qb.T


def truncate(
    u: np.ndarray, sv: np.ndarray, vt: np.ndarray, rank: int, scale: float
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Keep the ``rank`` largest singular triplets: ``a = U_r`` (in, rank), ``b = S_r Vt_r / scale``.

    The singular values go to ``b`` as PEFT's ``svd`` puts them in ``lora_B``. A target with fewer
    than ``rank`` singular values is padded with zero columns / rows (its update is unchanged), so
    every target of the merged adapter has the same rank. Returns the factors and, by
    Eckart-Young, the squared Frobenius error ``sum of the discarded sigma^2`` with ``||M||_F^2``.
    """
    sv64 = host(sv)
    kept = min(rank, sv.shape[0])
    a = u[:, :kept]
    b = (sv[:kept, None] * vt[:kept]) / scale
    if kept < rank:
        a = np.pad(a, ((0, 0), (0, rank - kept)))
        b = np.pad(b, ((0, rank - kept), (0, 0)))
    return a, b, {"error": float(np.sum(sv64[kept:] ** 2)), "norm": float(np.sum(sv64**2))}


def _svd_summary(errors: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    err = sum(e["error"] for e in errors.values())
    norm = sum(e["norm"] for e in errors.values())
    return {
        "truncation_error": {t: e["error"] for t, e in errors.items()},
        "truncation_error_total": err,
        "relative_truncation_error": err / norm if norm > 0 else 0.0,
    }


def _dense_svd(m: np.ndarray, rank: int, scale: float) -> tuple[np.ndarray, np.ndarray, None, dict[str, Any]]:
    u, sv, vt = np.linalg.svd(host(m), full_matrices=False)
    a, b, err = truncate(u, sv, vt, rank, scale)
    return a, b, None, err


@ADAPTER_METHODS.declare(
    kind="adapter", traits={"exact": False, "normalize": False, "space": "products", "dense": True}
)
def svd(rank: int | None = None) -> AdapterMethod:
    """The weighted sum of the products, re-factorised to rank ``rank`` by truncated SVD (PEFT's ``svd``).

    ``M = sum_i w_i s_i a_i b_i`` per target, ``M = U S V^T``, then ``a = U_r`` and
    ``b = S_r V_r^T / s_out``: the best rank-r approximation of M in Frobenius norm
    (Eckart-Young), exact when ``rank >= rank(M)`` (at most n r). ``info["truncation_error"]``
    gives per target the squared error ``||M - s a b||_F^2 = sum of the discarded sigma_k^2``
    (``truncation_error_total`` and ``relative_truncation_error``, divided by ``||M||_F^2``,
    summed over targets). M is never formed: the SVD works on the QR factors of the stacked
    factors (:func:`lowrank_svd`). ``rank`` defaults to the input rank r (PEFT's ``svd_rank``
    default, the largest input rank). Weights are used as given, as PEFT's
    ``add_weighted_adapter(..., combination_type="svd")`` does (default 1/n each). Also runs on
    the dense output of a coordinate-wise robust rule on the products.

    References:
      Eckart and Young, "The approximation of one matrix by another of lower rank",
      Psychometrika 1936; PEFT's ``LoraModel.add_weighted_adapter`` (Hugging Face).
    """
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
        raise AdapterError(f"svd: rank must be a positive int, got {rank!r}")

    def combine(stacked: Stacked, s: np.ndarray, w: np.ndarray, key: Any = None) -> AdapterMerge:
        r_out = rank or int(next(iter(stacked.values()))["a"].shape[-1])
        scale = out_scale(s)
        out: HostAdapter = {}
        errors = {}
        for t, f in stacked.items():
            a, b, errors[t] = truncate(*lowrank_svd(*concat_factors(f, w * s)), r_out, scale)
            out[t] = {"a": a, "b": b}
        adapter, _ = finish(out, stacked)
        return AdapterMerge(adapter, scale, None, _info("svd", False, w, r_out, **_svd_summary(errors)))

    return AdapterMethod("svd", combine, _dense_svd, rank)


# ----------------------------------------------------------------------------- FedEx-LoRA


def _dense_residual(
    m: np.ndarray, rank: int, scale: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
    a, b, _, err = _dense_svd(m, rank, scale)
    return a, b, host(m) - scale * a @ b, err


@ADAPTER_METHODS.declare(
    kind="adapter", traits={"exact": True, "normalize": True, "space": "products", "dense": True}
)
def exact_residual() -> AdapterMethod:
    """FedEx-LoRA: the factor means as the adapter, and the residual folded into the base; exact.

    ``a = sum_i w_i a_i``, ``b = sum_i w_i b_i`` (FedIT's adapter, rank r), and
    ``base_delta = sum_i w_i s_i a_i b_i - s a b``, the error FedIT makes, as a dense (in, out)
    update added to the frozen base kernel. Then ``s a b + base_delta`` is the weighted mean of
    the products exactly. Weights are normalised to sum 1. The residual is dense: it costs one
    kernel-sized update per target on the wire. After a coordinate-wise robust rule on the
    products (a dense merged update M per target) the adapter is M's best rank-r factorisation
    and the residual ``M - s a b`` goes to the base, still exact.

    References:
      Singhal, Ponkshe, Vepakomma, "FedEx-LoRA: Exact Aggregation for Federated and Efficient
      Fine-Tuning of Foundation Models", 2024 (arXiv:2410.09432).
    """

    def combine(stacked: Stacked, s: np.ndarray, w: np.ndarray, key: Any = None) -> AdapterMerge:
        mean = factor_mean(stacked, s, w)
        scale = out_scale(s)
        residual = {
            t: mean_product(f, s, w) - scale * mean[t]["a"] @ mean[t]["b"] for t, f in stacked.items()
        }
        adapter, base_delta = finish(mean, stacked, residual)
        return AdapterMerge(adapter, scale, base_delta, _info("exact_residual", True, w, _rank_of(adapter)))

    return AdapterMethod("exact_residual", combine, _dense_residual)
