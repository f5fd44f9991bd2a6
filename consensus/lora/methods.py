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

import jax
import jax.numpy as jnp
import numpy as np

from consensus.lora._core import HIGHEST, Adapter, AdapterError, AdapterMerge
from consensus.specs import ADAPTER_METHODS

Stacked = Mapping[str, Mapping[str, jax.Array]]
Combine = Callable[[Stacked, np.ndarray, np.ndarray, Any], AdapterMerge]
FromDense = Callable[[Mapping[str, jax.Array], Stacked, np.ndarray, np.ndarray], AdapterMerge]


class AdapterMethod(NamedTuple):
    """A built adapter method.

    Attributes:
      name: The declared name.
      combine: ``combine(stacked, s, w, key) -> AdapterMerge`` with per-node scales ``s`` and
        node weights ``w`` ((n,) float64, already normalised when the method normalises).
      from_dense: For methods that can start from a dense merged update per target (the output of
        a coordinate-wise robust rule on the products): ``from_dense(dense, stacked, s, w)``;
        None for the methods that need per-node weights.
    """

    name: str
    combine: Combine
    from_dense: FromDense | None = None


def out_scale(s: np.ndarray) -> float:
    """The merged adapter's scale: the first node's (the shared scale when the nodes agree)."""
    return float(s[0])


def factor_mean(stacked: Stacked, s: np.ndarray, w: np.ndarray) -> Adapter:
    """``a = sum_i w_i a_i``, ``b = sum_i w_i (s_i / s_out) b_i``: FedIT's factor-wise weighted mean.

    Folding ``s_i / s_out`` into ``b_i`` keeps each node's own update when the scales differ.
    """
    wa = jnp.asarray(w, jnp.float32)
    wb = jnp.asarray(w * s / out_scale(s), jnp.float32)
    return {
        t: {
            "a": jnp.tensordot(wa, f["a"], axes=1, precision=HIGHEST).astype(f["a"].dtype),
            "b": jnp.tensordot(wb, f["b"], axes=1, precision=HIGHEST).astype(f["b"].dtype),
        }
        for t, f in stacked.items()
    }


def mean_product(f: Mapping[str, jax.Array], s: np.ndarray, w: np.ndarray) -> jax.Array:
    """``sum_i w_i s_i a_i b_i`` of one target, as one (in, n r) @ (n r, out) product."""
    n, fan_in, r = f["a"].shape
    a_cat = jnp.moveaxis(f["a"], 0, 1).reshape(fan_in, n * r)
    b_cat = (jnp.asarray(w * s, jnp.float32)[:, None, None] * f["b"]).reshape(n * r, -1)
    return jnp.matmul(a_cat, b_cat, precision=HIGHEST)


def _info(name: str, exact: bool, w: np.ndarray, rank: int, **more: Any) -> dict[str, Any]:
    return {
        "method": name,
        "exactness": "exact" if exact else "approximate",
        "weights": [float(x) for x in w],
        "rank": int(rank),
        **more,
    }


def _rank_of(adapter: Adapter) -> int:
    return int(next(iter(adapter.values()))["a"].shape[1])


# ----------------------------------------------------------------------------- FedIT


@ADAPTER_METHODS.declare(
    kind="adapter", traits={"exact": False, "normalize": True, "space": "factors", "dense": False}
)
def fedit() -> AdapterMethod:
    """FedIT: the factor-wise weighted mean, ``a = sum_i w_i a_i``, ``b = sum_i w_i b_i``.

    Approximate: the merged update ``s a b`` is the product of the means, not the mean of the
    products ``sum_i w_i s_i a_i b_i``; the cross terms ``w_i w_j a_i b_j`` (i != j) make the
    difference, which vanishes only when the nodes' factors agree. The rank stays r. Weights are
    normalised to sum 1 (default uniform: FedAvg over factors). Nodes with different scales have
    ``s_i / s_0`` folded into their ``b`` first; the result has the first node's scale.

    References:
      Zhang et al., "Towards Building the Federated GPT: Federated Instruction Tuning",
      ICASSP 2024 (arXiv:2305.05644).
    """

    def combine(stacked: Stacked, s: np.ndarray, w: np.ndarray, key: Any = None) -> AdapterMerge:
        adapter = factor_mean(stacked, s, w)
        return AdapterMerge(adapter, out_scale(s), None, _info("fedit", False, w, _rank_of(adapter)))

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
        wb = jnp.asarray(w * s / out_scale(s), jnp.float32)
        adapter = {
            t: {
                "a": f["a"][0],
                "b": jnp.tensordot(wb, f["b"], axes=1, precision=HIGHEST).astype(f["b"].dtype),
            }
            for t, f in stacked.items()
        }
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
    c = jnp.asarray(coeffs[kept], jnp.float32)
    out: Adapter = {}
    for t, f in stacked.items():
        a, b = f["a"][jnp.asarray(kept)], f["b"][jnp.asarray(kept)]
        if on == "a":
            a = (c[:, None, None] * a).astype(a.dtype)
        else:
            b = (c[:, None, None] * b).astype(b.dtype)
        m, fan_in, r = a.shape
        out[t] = {"a": jnp.moveaxis(a, 0, 1).reshape(fan_in, m * r), "b": b.reshape(m * r, b.shape[-1])}
    return out, kept


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
