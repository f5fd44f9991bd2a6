"""Robust rules on LoRA adapters, in a stated space: the products (exact) or the factors (cheap).

**Products** (``space="products"``): the rule sees the nodes' updates ``P_i = s_i a_i b_i``.

* A *vector* rule (Krum, Multi-Krum, geometric median, centered clipping, ...) needs only
  distances: it runs on an n x n embedding ``E = U sqrt(L)`` of the products' Gram matrix
  ``G = U L U^T`` (:func:`consensus.lora.product_gram`, formed from the factors in
  O(n^2 r^2 (in + out)) per target), which has the products' inner products and distances, so
  it selects and weighs the nodes exactly as on the dense products. Its weights ``w``
  (``info.weights``; the rule must be linear, ``info.linear``) then go to the adapter method,
  which combines the nodes with them (``stack``/``cat``: exact, ``svd``: truncated,
  ``exact_residual``: exact with a residual, ``fedit``: approximate, ``ffa``: exact). No
  (in, out) update is formed by the rule.
* A *coordinate-wise* rule (median, trimmed mean, ...) or a merge method over task vectors sees
  the dense products target by target: one target's n products at a time (for an element-wise
  rule, ``CHUNK_BYTES`` of their columns at a time), never all targets' products at once. Its
  dense output M per target is then re-factorised by the method's dense path: ``svd`` (best
  rank-r' factorisation, truncation error reported) or ``exact_residual`` (M's rank-r
  factorisation plus the residual in ``base_delta``: exact). Methods that need node weights
  (``stack``, ``fedit``, ...) refuse a coordinate-wise rule.

**Factors** (``space="factors"``): the rule runs on the factor tree itself, ``{target: {"a",
"b"}}`` (with ``ffa``: on ``b`` alone, ``a`` being shared), as on any stacked tree; the result is
the adapter. Cheap (no product is formed), but the factorisation is not unique: ``(a R, R^-1 b)``
is the same update for any invertible R, so two nodes with one update can be far apart in factor
space and the rule's notion of an outlier is not the update's. Only ``fedit`` and ``ffa`` take
this space.

Nodes with a non-finite factor are left out (the rule's mask), and the rule's declared
precondition is checked on the valid count (``ByzantineToleranceError`` names the rule, n and f).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from consensus.base import Aggregator, PreAggregator, get_info
from consensus.lora._core import Adapter, AdapterError, AdapterMerge, finish, node_weights
from consensus.lora.gram import target_gram
from consensus.lora.methods import AdapterMethod, _svd_summary, shared_a
from consensus.specs import Spec

#: Bytes of one chunk of stacked products given to an element-wise rule at a time.
CHUNK_BYTES = 64 << 20
FACTOR_METHODS = ("fedit", "ffa")


def finite_nodes(stacked: Mapping[str, Mapping[str, Any]]) -> np.ndarray:
    """(n,) bool: the nodes whose factors are all finite."""
    ok = None
    for f in stacked.values():
        for x in f.values():
            arr = np.asarray(x)
            row = np.isfinite(arr).reshape(arr.shape[0], -1).all(axis=1)
            ok = row if ok is None else ok & row
    assert ok is not None
    return ok


def zero_invalid(stacked: Mapping[str, Mapping[str, Any]], valid: np.ndarray) -> dict[str, dict[str, Any]]:
    """The stack with each invalid node's update set to 0: ``b = 0``, ``a`` = the first valid node's.

    Their weight is 0, but ``0 * NaN`` is not 0; taking a valid ``a`` keeps a shared ``a`` shared
    (FFA-LoRA). With no valid node the stack is returned as it is (the rule refuses it).
    """
    if not valid.any():
        return {t: dict(f) for t, f in stacked.items()}
    first = int(np.flatnonzero(valid)[0])
    out: dict[str, dict[str, Any]] = {}
    for t, f in stacked.items():
        a, b = np.array(f["a"]), np.array(f["b"])
        a[~valid] = a[first]
        b[~valid] = 0
        out[t] = {"a": a, "b": b}
    return out


def _rule_kind(rule: Any) -> str:
    if isinstance(rule, PreAggregator):
        raise AdapterError(
            f"{rule.name} is a pre-aggregator (n -> n); a rule for adapters maps n nodes to one"
        )
    if not isinstance(rule, Aggregator):
        raise AdapterError(
            f"rule must be a consensus Aggregator (consensus.krum(1), ...), got {type(rule).__name__}"
        )
    spec: Spec | None = rule.spec
    return spec.kind if spec is not None else "coordinatewise"


def _extra(rule: Aggregator, key: Any, index: int) -> dict[str, Any]:
    spec = rule.spec
    if spec is None or not spec.randomized:
        return {}
    if key is None:
        raise AdapterError(f"{rule.name} is randomised: pass key=jax.random.key(seed)")
    return {"key": jax.random.fold_in(key, index)}


def embedding_weights(rule: Aggregator, gram: np.ndarray, valid: np.ndarray, key: Any = None) -> Any:
    """Run a vector rule on an n x n embedding with Gram matrix ``gram``; returns its AggregationInfo.

    ``E = U sqrt(max(L, 0))`` for ``G = U L U^T`` has ``E E^T = G``: the same distances and inner
    products as the vectors behind G, centred on 0 (the base, as the products are updates to it).
    """
    n = len(gram)
    g = np.where(valid[:, None] & valid[None, :], gram, 0.0)
    lam, u = np.linalg.eigh(g)
    embedding = jnp.asarray(u * np.sqrt(np.clip(lam, 0.0, None)), jnp.float32)
    centre = {"e": jnp.zeros((n,), jnp.float32)}
    _, state = rule.update(
        {"e": embedding}, rule.init(centre), centre, mask=jnp.asarray(valid), **_extra(rule, key, 0)
    )
    info = get_info(state)
    if not info.linear:
        raise AdapterError(
            f"{rule.name}: its output is not a weighted combination of the nodes, so it cannot run on the "
            "products' Gram matrix; use a linear vector rule (krum, multi_krum, geometric_median, ...) or a "
            "coordinate-wise one"
        )
    return info


def merge_robust(
    spec: Spec,
    built: AdapterMethod,
    stacked: Mapping[str, Mapping[str, Any]],
    s: np.ndarray,
    weights: Any,
    rule: Any,
    space: str,
    key: Any,
) -> AdapterMerge:
    """``merge_adapters`` with ``rule=``: see the module docstring."""
    kind = _rule_kind(rule)
    if weights is not None:
        raise AdapterError(f"weights and rule={rule.name} together: the rule sets the node weights")
    valid = finite_nodes(stacked)
    clean = zero_invalid(stacked, valid)
    base = {"rule": rule.name, "space": space, "valid": [int(i) for i in np.flatnonzero(valid)]}
    if space == "factors":
        return _on_factors(spec, clean, s, valid, rule, key, base)
    if kind == "vector":
        gram = sum((target_gram(f["a"], f["b"], s) for f in clean.values()), np.zeros((len(s), len(s))))
        info = embedding_weights(rule, gram, valid, key)
        w = np.asarray(info.weights, np.float64)
        merged = built.combine(clean, s, w, key)
        more = {"selected": [int(i) for i in np.flatnonzero(np.asarray(info.selected))]}
        return AdapterMerge(merged.adapter, merged.scale, merged.base_delta, {**merged.info, **base, **more})
    if kind == "pre":
        raise AdapterError(
            f"{rule.name} is a pre-aggregator (n -> n); a rule for adapters maps n nodes to one"
        )
    return _dense(spec, built, clean, s, valid, rule, key, base)


def _dense(
    spec: Spec,
    built: AdapterMethod,
    stacked: Mapping[str, Mapping[str, Any]],
    s: np.ndarray,
    valid: np.ndarray,
    rule: Aggregator,
    key: Any,
    base: dict[str, Any],
) -> AdapterMerge:
    """A coordinate-wise rule (or merge method) on the dense products, one target (or chunk) at a time."""
    if built.from_dense is None:
        dense = [k for k, sp in _dense_methods()]
        raise AdapterError(
            f"{spec.name} combines the nodes with weights, which the coordinate-wise rule {rule.name} "
            f"does not give; on the products use one of {dense}, or space='factors'"
        )
    rank = built.rank or int(next(iter(stacked.values()))["a"].shape[-1])
    scale = float(s[0])
    elementwise = rule.spec is not None and rule.spec.elementwise
    needs_base = rule.spec is not None and rule.spec.needs_base
    sj = jnp.asarray(s, jnp.float32)[:, None, None]
    mask = jnp.asarray(valid)
    out: dict[str, dict[str, np.ndarray]] = {}
    residual: dict[str, np.ndarray] = {}
    errors: dict[str, dict[str, float]] = {}
    selected = np.zeros(len(s), bool)
    for index, (t, f) in enumerate(stacked.items()):
        n, fan_in, _ = f["a"].shape
        fan_out = f["b"].shape[-1]
        width = fan_out
        if elementwise:
            width = max(1, min(fan_out, CHUNK_BYTES // max(1, 4 * n * fan_in)))
        pieces = []
        for c0 in range(0, fan_out, width):
            p = sj * jnp.matmul(f["a"], f["b"][:, :, c0 : c0 + width], precision=jax.lax.Precision.HIGHEST)
            zero = {"p": jnp.zeros(p.shape[1:], p.dtype)}
            merged, state = rule.update(
                {"p": p},
                rule.init(zero),
                zero if needs_base else None,
                mask=mask,
                **_extra(rule, key, index),
            )
            selected |= np.asarray(get_info(state).selected)
            pieces.append(merged["p"])
            del p
        m = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)
        a, b, delta, errors[t] = built.from_dense(np.asarray(m), rank, scale)
        out[t] = {"a": a, "b": b}
        if delta is not None:
            residual[t] = delta
    adapter, base_delta = finish(out, stacked, residual or None)
    info = {
        "method": spec.name,
        "exactness": "exact" if residual else "approximate",
        "weights": None,
        "rank": rank,
        **(_svd_summary(errors) if not residual else {}),
        **base,
        "selected": [int(i) for i in np.flatnonzero(selected)],
    }
    return AdapterMerge(adapter, scale, base_delta, info)


def _dense_methods() -> list[tuple[str, Spec]]:
    from consensus.specs import ADAPTER_METHODS

    return [(k, sp) for k, sp in ADAPTER_METHODS.items() if sp.traits.get("dense")]


def _on_factors(
    spec: Spec,
    stacked: Mapping[str, Mapping[str, Any]],
    s: np.ndarray,
    valid: np.ndarray,
    rule: Aggregator,
    key: Any,
    base: dict[str, Any],
) -> AdapterMerge:
    """The rule on the flattened factors (``fedit``: a and b; ``ffa``: b, a shared)."""
    if spec.name not in FACTOR_METHODS:
        raise AdapterError(
            f"space='factors' applies the rule to the factors themselves, which is {list(FACTOR_METHODS)}; "
            f"{spec.name} works on the products (space='products')"
        )
    scale = float(s[0])
    fold = jnp.asarray(s / scale, jnp.float32)[:, None, None]
    if spec.name == "ffa":
        shared_a(stacked)
        tree = {t: {"b": fold * f["b"]} for t, f in stacked.items()}
    else:
        tree = {t: {"a": f["a"], "b": fold * f["b"]} for t, f in stacked.items()}
    zero = jax.tree.map(lambda x: jnp.zeros(x.shape[1:], x.dtype), tree)
    needs_base = rule.spec is not None and rule.spec.needs_base
    merged, state = rule.update(
        tree, rule.init(zero), zero if needs_base else None, mask=jnp.asarray(valid), **_extra(rule, key, 0)
    )
    info = get_info(state)
    adapter: Adapter = {
        t: {
            "a": (stacked[t]["a"][0] if spec.name == "ffa" else merged[t]["a"]).astype(f["a"].dtype),
            "b": merged[t]["b"].astype(f["b"].dtype),
        }
        for t, f in stacked.items()
    }
    # FFA with a rule that is a weighted mean of the b's is exact on the products; anything else is not.
    exact = spec.name == "ffa" and bool(info.linear)
    w = node_weights(np.asarray(info.weights), len(s), normalize=False) if info.linear else None
    return AdapterMerge(
        adapter,
        scale,
        None,
        {
            "method": spec.name,
            "exactness": "exact" if exact else "approximate",
            "weights": None if w is None else [float(x) for x in w],
            "rank": int(next(iter(adapter.values()))["a"].shape[1]),
            **base,
            "selected": [int(i) for i in np.flatnonzero(np.asarray(info.selected))],
        },
    )
