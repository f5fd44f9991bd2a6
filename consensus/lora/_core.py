"""Adapter trees: the merge result, input checks, node weights, dense updates and fresh adapters.

Layout (Flax): a target is a kernel W of shape (in, out); its LoRA adapter is ``a`` (in, r) and
``b`` (r, out), and the update to the kernel is ``delta = scale * a @ b`` with
``scale = alpha / r`` (rsLoRA: ``alpha / sqrt(r)``). PEFT's torch layout is the transpose
(``lora_A.weight = a.T``, ``lora_B.weight = b.T``). An adapter tree is
``{target_path: {"a": a, "b": b}}``; a stacked adapter tree has a leading node axis on every
factor: ``a`` (n, in, r), ``b`` (n, r, out).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Adapter = dict[str, dict[str, jax.Array]]
HIGHEST = jax.lax.Precision.HIGHEST


class AdapterError(ValueError):
    """Adapters that cannot be merged as asked: the message names the target, the node and the problem."""


@dataclasses.dataclass(frozen=True)
class AdapterMerge:
    """The result of :func:`consensus.lora.merge_adapters`.

    Attributes:
      adapter: The unstacked adapter tree for the next round, ``{target: {"a": (in, r_out),
        "b": (r_out, out)}}``; ``r_out`` may differ from the inputs' rank (``stack``: n * r,
        ``svd``: the requested rank).
      scale: The scale of ``adapter``: its update is ``scale * a @ b``.
      base_delta: ``{target: (in, out)}`` dense updates to add to the base kernels, or None
        when the method puts everything in the adapter.
      info: Diagnostics: ``method``, ``exactness`` (``"exact"`` when ``scale * a @ b`` plus
        ``base_delta`` equals the method's target combination of the node products,
        ``"approximate"`` otherwise), ``rank``, ``weights`` (the node weights used), and
        method-specific entries (``truncation_error`` for ``svd``, ``selected`` for robust rules).
    """

    adapter: Adapter
    scale: float
    base_delta: dict[str, jax.Array] | None
    info: dict[str, Any]

    def delta(self, target: str) -> jax.Array:
        """The merged update of one target: ``scale * a @ b`` plus its ``base_delta`` (if any)."""
        f = self.adapter[target]
        d = self.scale * jnp.matmul(f["a"], f["b"], precision=HIGHEST)
        if self.base_delta is not None and target in self.base_delta:
            d = d + self.base_delta[target]
        return d


def product(a: jax.Array, b: jax.Array, scale: float | jax.Array = 1.0) -> jax.Array:
    """``scale * a @ b`` at full float32 precision (batched over leading axes)."""
    return jnp.asarray(scale) * jnp.matmul(a, b, precision=HIGHEST)


def host(x: Any) -> np.ndarray:
    """A factor as a float64 numpy array: the methods compute on the host in float64.

    The factors are small (r columns) and a merge runs once per round between jitted phases, so
    float64 numpy costs no compilation per shape and keeps the references' accuracy.
    """
    return np.asarray(x, np.float64)


def finish(
    adapter: Mapping[str, Mapping[str, np.ndarray]],
    like: Mapping[str, Mapping[str, Any]],
    base_delta: Mapping[str, np.ndarray] | None = None,
) -> tuple[Adapter, dict[str, jax.Array] | None]:
    """Float64 host results as jax arrays in the dtype of the input factors (``like``)."""
    out = {
        t: {k: jnp.asarray(np.asarray(v).astype(np.dtype(like[t][k].dtype))) for k, v in f.items()}
        for t, f in adapter.items()
    }
    if base_delta is None:
        return out, None
    deltas = {
        t: jnp.asarray(np.asarray(d).astype(np.dtype(like[t]["b"].dtype))) for t, d in base_delta.items()
    }
    return out, deltas


def dense_delta(adapter: Mapping[str, Mapping[str, Any]], scale: float) -> dict[str, jax.Array]:
    """The dense update ``scale * a @ b`` of every target of an (unstacked) adapter tree.

    Args:
      adapter: ``{target: {"a": (in, r), "b": (r, out)}}``.
      scale: The adapter's scale.

    Returns:
      ``{target: (in, out)}``: what adding the adapter to the base kernels adds (FLoRA folds the
      stacked adapter into the base this way before re-initialising it).
    """
    return {t: product(f["a"], f["b"], scale) for t, f in adapter.items()}


def stack_adapters(trees: Sequence[Mapping[str, Mapping[str, Any]]]) -> Adapter:
    """Stack n adapter trees into one with a leading node axis, checking that they agree.

    Args:
      trees: One adapter tree per node.

    Returns:
      The stacked tree: ``a`` (n, in, r), ``b`` (n, r, out) per target.

    Raises:
      AdapterError: no trees, a target missing in one node (named with the node), or shapes that
        differ between nodes (a rank mismatch names both ranks).
    """
    if not trees:
        raise AdapterError("no adapters to stack")
    targets = list(trees[0])
    for i, t in enumerate(trees[1:], start=1):
        missing, extra = sorted(set(targets) - set(t)), sorted(set(t) - set(targets))
        if missing or extra:
            what = f"lacks target(s) {missing}" if missing else f"has target(s) {extra} that node 0 lacks"
            raise AdapterError(f"node {i} {what}; every node must adapt the same targets")
    out: Adapter = {}
    for target in targets:
        for i, t in enumerate(trees):
            _check_factor_pair(target, t[target], node=i)
        a0, b0 = np.shape(trees[0][target]["a"]), np.shape(trees[0][target]["b"])
        for i, t in enumerate(trees[1:], start=1):
            a, b = np.shape(t[target]["a"]), np.shape(t[target]["b"])
            if a[1] != a0[1]:
                raise AdapterError(
                    f"rank mismatch at target {target!r}: node 0 has r={a0[1]}, node {i} r={a[1]}"
                )
            if (a, b) != (a0, b0):
                raise AdapterError(
                    f"shape mismatch at target {target!r}: node 0 has a{a0} b{b0}, node {i} a{a} b{b}"
                )
        out[target] = {
            "a": jnp.stack([jnp.asarray(t[target]["a"]) for t in trees]),
            "b": jnp.stack([jnp.asarray(t[target]["b"]) for t in trees]),
        }
    return out


def _check_factor_pair(target: str, factors: Mapping[str, Any], node: int | None = None) -> None:
    where = f"target {target!r}" + ("" if node is None else f" of node {node}")
    if set(factors) != {"a", "b"}:
        raise AdapterError(f"{where} must hold exactly the factors 'a' and 'b', got {sorted(factors)}")
    a, b = np.shape(factors["a"]), np.shape(factors["b"])
    if len(a) != 2 or len(b) != 2:
        raise AdapterError(f"{where}: a must be (in, r) and b (r, out), got a{a} b{b}")
    if a[1] != b[0]:
        raise AdapterError(f"rank mismatch in {where}: a has r={a[1]} columns, b has r={b[0]} rows")


def check_stacked(stacked: Mapping[str, Mapping[str, Any]], *, finite: bool = True) -> tuple[int, int]:
    """Check a stacked adapter tree and return (n nodes, rank r).

    Args:
      stacked: ``{target: {"a": (n, in, r), "b": (n, r, out)}}``.
      finite: Also refuse NaN or Inf (named by target and node).

    Returns:
      The node count n and the rank r (the same for every target).

    Raises:
      AdapterError: an empty tree, factors of the wrong rank or node count, a rank that differs
        between targets or between a and b, or non-finite values.
    """
    if not stacked:
        raise AdapterError("the adapter tree has no targets")
    n = r = None
    for target, f in stacked.items():
        if not isinstance(f, Mapping) or set(f) != {"a", "b"}:
            got = sorted(f) if isinstance(f, Mapping) else type(f).__name__
            raise AdapterError(f"target {target!r} must hold exactly the factors 'a' and 'b', got {got}")
        a, b = np.shape(f["a"]), np.shape(f["b"])
        if len(a) != 3 or len(b) != 3:
            raise AdapterError(
                f"target {target!r}: a stacked adapter has a (n, in, r) and b (n, r, out), got a{a} b{b}"
            )
        if a[0] != b[0] or (n is not None and a[0] != n):
            raise AdapterError(
                f"target {target!r}: node counts differ (a has {a[0]}, b {b[0]}, expected {n or a[0]})"
            )
        if a[2] != b[1]:
            raise AdapterError(
                f"rank mismatch at target {target!r}: a has r={a[2]} columns, b has r={b[1]} rows"
            )
        if r is not None and a[2] != r:
            raise AdapterError(f"rank mismatch: target {target!r} has r={a[2]}, another target r={r}")
        n, r = a[0], a[2]
        if finite:
            for name in ("a", "b"):
                x = np.asarray(f[name])
                ok = np.isfinite(x).reshape(x.shape[0], -1).all(axis=1)
                if not ok.all():
                    nodes = [int(i) for i in np.flatnonzero(~ok)]
                    raise AdapterError(
                        f"non-finite values (NaN or Inf) in factor {name!r} of target {target!r}, "
                        f"node(s) {nodes}"
                    )
    assert n is not None and r is not None
    return int(n), int(r)


def node_scales(scale: float | Sequence[float] | jax.Array, n: int) -> np.ndarray:
    """Each node's scale as an (n,) float64 vector (a single float is shared by every node).

    Raises:
      AdapterError: a scale that is not finite and positive, or a vector of the wrong length.
    """
    s = np.asarray(scale, np.float64)
    if s.ndim == 0:
        s = np.full((n,), float(s))
    if s.shape != (n,):
        raise AdapterError(f"scale must be one float or one per node ({n}), got shape {s.shape}")
    if not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise AdapterError(f"scale must be finite and positive, got {s.tolist()}")
    return s


def node_weights(weights: Any, n: int, *, normalize: bool) -> np.ndarray:
    """Node weights as an (n,) float64 vector: uniform 1/n when None, else as given (normalised to sum 1).

    Raises:
      AdapterError: a wrong length, non-finite weights, negative weights or a zero sum when
        normalising.
    """
    if weights is None:
        return np.full((n,), 1.0 / n)
    w = np.asarray(weights, np.float64).reshape(-1)
    if w.shape != (n,):
        raise AdapterError(f"weights must have one entry per node ({n}), got {w.shape[0]}")
    if not np.all(np.isfinite(w)):
        raise AdapterError(f"weights must be finite, got {w.tolist()}")
    if normalize:
        if np.any(w < 0):
            raise AdapterError(f"weights of a weighted mean must be non-negative, got {w.tolist()}")
        total = w.sum()
        if total <= 0:
            raise AdapterError("weights sum to 0: no node to average")
        w = w / total
    return w


def fresh_adapter(
    key: jax.Array,
    shapes: Mapping[str, tuple[int, int]],
    rank: int,
    *,
    dtype: Any = jnp.float32,
) -> Adapter:
    """A new adapter, initialised as PEFT does by default: ``a`` Kaiming-uniform, ``b = 0``.

    PEFT's ``lora_A`` (r, in) uses ``nn.init.kaiming_uniform_(w, a=sqrt(5))``, i.e. uniform on
    ``[-1/sqrt(in), 1/sqrt(in)]``; here ``a`` (in, r) = that matrix transposed. With ``b = 0`` the
    fresh adapter adds nothing to the model, so a method that folds its merge into the base and
    re-initialises the adapter (FLoRA) keeps the model's function.

    Args:
      key: A ``jax.random`` key (one sub-key per target is folded in from the target's index).
      shapes: ``{target: (in, out)}`` kernel shapes.
      rank: The adapter rank r.
      dtype: The factors' dtype.

    Returns:
      ``{target: {"a": (in, r), "b": zeros (r, out)}}``.
    """
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"rank must be a positive int, got {rank!r}")
    out: Adapter = {}
    for i, (target, (fan_in, fan_out)) in enumerate(shapes.items()):
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(jax.random.fold_in(key, i), (fan_in, rank), dtype, -bound, bound)
        out[target] = {"a": a, "b": jnp.zeros((rank, fan_out), dtype)}
    return out
