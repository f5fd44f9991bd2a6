"""Bucketing: average random buckets of nodes, then merge the bucket means with a robust rule.

References:
  Karimireddy, He and Jaggi 2022, ICLR, "Byzantine-Robust Learning on Heterogeneous
  Datasets via Bucketing".
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from consensus.aggregators import view as views
from consensus.aggregators._common import (
    RuleState,
    check_count,
    check_f,
    check_stacked,
    gram_stats,
    init_rule_state,
    require_key,
    static_count,
    valid_nodes,
)
from consensus.base import AggregationInfo, Aggregator, get_info
from consensus.specs import RULES, Spec
from kernels import robust as robust_kernels

DEFAULT_BUCKET_SIZE = 2


def bucket_requirement(n: int, f: int, bucket_size: int) -> str | None:
    """Check that n nodes in buckets of ``bucket_size`` leave a majority of buckets free of Byzantine nodes.

    Args:
      n: The number of nodes.
      f: The number of Byzantine nodes.
      bucket_size: s, the nodes per bucket.

    Returns:
      None when ceil(n / s) > 2f, else the requirement in words (for the error message).
    """
    buckets = math.ceil(n / bucket_size)
    if buckets > 2 * f:
        return None
    return (
        f"ceil(n / s) = ceil({n} / {bucket_size}) = {buckets} buckets > 2f = {2 * f}: each of the f "
        "Byzantine nodes can spoil a different bucket, so too many buckets can be bad "
        "(use smaller buckets, or fewer f)"
    )


def bucketing_precondition(n: int, f: int) -> str | None:
    """Return the declared precondition: buckets of the default size, most free of Byzantine nodes.

    Args:
      n: The number of nodes.
      f: The number of Byzantine nodes.

    Returns:
      None when it holds, else the requirement in words.
    """
    return bucket_requirement(n, f, DEFAULT_BUCKET_SIZE)


def inner_rule(inner: str | Aggregator, f: int) -> tuple[Spec | None, Aggregator]:
    """Resolve bucketing's inner rule: its declaration and the rule itself.

    A name is looked up in :data:`consensus.specs.RULES` and built with bucketing's f (when
    the rule takes one); a built rule is used as it is, with its declaration. A declared inner
    rule must be a plain n -> 1 rule: bucketing consumes the key and hands the rule nothing else.

    Args:
      inner: A registered rule name or a built :class:`~consensus.base.Aggregator`.
      f: Bucketing's number of Byzantine nodes.

    Returns:
      ``(spec, aggregator)``; ``spec`` is None for a hand-built Aggregator.

    Raises:
      TypeError: If ``inner`` is neither a name nor an Aggregator.
      RegistryError: If the name is not registered.
      ValueError: If the declared rule is not a plain n -> 1 rule (a pre-aggregator, or one
        that needs extra inputs).
    """
    if isinstance(inner, str):
        spec: Spec | None = RULES[inner]
        agg = None
    elif isinstance(inner, Aggregator):
        spec, agg = inner.spec, inner
    else:
        raise TypeError(f"bucketing: inner must be a rule name or an Aggregator, got {type(inner).__name__}")
    if spec is not None and (spec.kind not in ("coordinatewise", "vector") or spec.needs):
        raise ValueError(f"bucketing: inner must be a plain n -> 1 rule, got {spec.name!r} ({spec.kind})")
    if agg is None:
        assert spec is not None
        agg = spec.build(f if spec.takes_f else None)
    return spec, agg


def bucket_matrix(key: jax.Array, valid: jax.Array, bucket_size: int) -> jax.Array:
    """Return the (B, n) averaging matrix: a keyed random permutation cut into B = ceil(n / s) buckets.

    Row b averages the valid nodes of bucket b (all zero when it has none).

    Args:
      key: A jax.random key for the permutation.
      valid: (n,) bool, the valid nodes.
      bucket_size: s, the nodes per bucket.

    Returns:
      (B, n) float32 matrix whose non-empty rows sum to 1.
    """
    n = valid.shape[0]
    buckets = math.ceil(n / bucket_size)
    position = jnp.argsort(jax.random.permutation(key, n))  # node j sits at position[j]
    member = (position[None, :] // bucket_size == jnp.arange(buckets)[:, None]) & valid[None, :]
    count = jnp.sum(member.astype(jnp.float32), axis=1, keepdims=True)
    return member.astype(jnp.float32) / jnp.maximum(count, 1.0)


@RULES.declare(
    kind="vector",
    takes_f=True,
    precondition=bucketing_precondition,
    formula="ceil(n / bucket_size) > 2f, and the inner rule's precondition on the buckets",
    sensitivity="the inner rule's (geometric median by default: 2C)",
    needs=("key",),
)
def bucketing(
    num_byzantine: int, bucket_size: int = DEFAULT_BUCKET_SIZE, inner: str | Aggregator = "geometric_median"
) -> Aggregator:
    """Bucketing (Karimireddy et al. 2022): average random buckets of s nodes, then a robust rule.

    A random permutation (from ``key=``, a jax.random key passed to
    ``update``) cuts the n nodes into B = ceil(n / s) buckets of s consecutive
    nodes; each bucket is replaced by the mean of its valid nodes, and the
    ``inner`` rule merges the B bucket means. ``inner`` is a registered rule
    name, built with bucketing's f, or a built Aggregator, used with its own f:
    ``bucketing(f, inner="krum")`` and ``bucketing(f, inner=krum(f))`` are the
    same rule. Either way the inner rule's declaration decides how it runs (in
    Gram space when it reads views) and its precondition is checked on the B
    buckets with bucketing's f (up to f buckets can be spoiled); a hand-built
    Aggregator (no declaration) runs on the written bucket means, unchecked. Averaging shrinks the honest
    buckets' heterogeneity by about 1/s, but each Byzantine node spoils its
    whole bucket: with f Byzantine nodes up to f buckets are bad, so the rule
    needs B > 2f (the paper's condition f s < n / 2, roughly) on top of the
    inner rule's own precondition on B nodes; it refuses other settings with
    a message saying so (ByzantineToleranceError). At f = 4 of 16 only s = 1
    (no bucketing) satisfies it.
    ``info.weights`` are the inner weights pulled back to the nodes.
    Cost: with a declared vector inner rule that reads views (geometric median,
    Krum, centered clipping, ...), the bucket means are never written: one Gram
    pass over the nodes (their validity from its diagonal) gives the buckets'
    Gram matrix ``A G A^T`` (A the (B, n) averaging matrix), the inner rule
    runs on that lazy view (``consensus.aggregators.view``), and its output
    is one weighted-sum pass with the node weights ``A^T w``; about 2 passes.
    Otherwise one finiteness pass, one pass writing the B bucket means, and
    the inner rule on B / n of the stack. An empty bucket (every member
    invalid) is dropped, not averaged to zero. DP sensitivity: the inner rule's.

    Args:
      num_byzantine: f, the number of Byzantine nodes (up to f buckets can be spoiled).
      bucket_size: s, the nodes per bucket (default 2).
      inner: The rule that merges the bucket means: a registered rule name (built with
        bucketing's f) or a built Aggregator (default ``"geometric_median"``).

    Returns:
      An :class:`~consensus.base.Aggregator` whose ``update`` needs ``key=``.

    Raises:
      ValueError: If ``num_byzantine`` or ``bucket_size`` is not a valid int, or ``inner`` is not
        a plain n -> 1 rule; from ``update``, when no ``key`` is given.
      TypeError: If ``inner`` is neither a name nor an Aggregator.
      ByzantineToleranceError: From ``update``, when ceil(n / s) > 2f or the inner rule's
        precondition on the B buckets fails.

    References:
      Karimireddy, He and Jaggi 2022, ICLR, "Byzantine-Robust Learning on Heterogeneous
      Datasets via Bucketing".
    """
    f = check_f("bucketing", num_byzantine)
    if not isinstance(bucket_size, int) or bucket_size < 1:
        raise ValueError(f"bucketing: bucket_size must be a positive int, got {bucket_size!r}")
    inner_spec, inner_agg = inner_rule(inner, f)

    # A declared vector rule that reads lazy views works in Gram space: the bucket means stay lazy.
    gram_space = inner_spec is not None and inner_spec.kind == "vector" and inner_spec.reads_views

    def precondition(n_now: int, f: int) -> str | None:
        """The declared one at this bucket size, then the inner rule's on the buckets."""
        need = bucket_requirement(n_now, f, bucket_size)
        if need is None and inner_spec is not None:
            need = inner_spec.requirement(math.ceil(n_now / bucket_size), f)
            need = None if need is None else f"the inner {inner_spec.name} on the buckets: {need}"
        return need

    def update(stacked, state, params=None, *, mask=None, key=None, **extra):
        del state
        key = require_key("bucketing", key)
        n = check_stacked(stacked, params)
        check_count("bucketing", precondition, f, n)
        if gram_space and not views.is_view(stacked):
            return gram_route(stacked, params, mask, key, extra)
        valid = valid_nodes(stacked, mask)
        check_count("bucketing", precondition, f, static_count(valid))
        mixing = bucket_matrix(key, valid, bucket_size)
        # An empty bucket's row comes out NaN (mix_rows), which the inner rule drops.
        means = jax.tree.map(lambda x: robust_kernels.mix_rows(x, mixing).astype(x.dtype), stacked)
        merged, inner_state = inner_agg.update(means, inner_agg.init(params), params, **extra)
        return merged, pulled_back(inner_state, mixing, valid)

    def gram_route(stacked, params, mask, key, extra):
        # The Gram matrix of the nodes, centred on params (or, without params, on their mean:
        # the bucket rows of A sum to 1, so their distances do not depend on that centre).
        stats = gram_stats(stacked, params, mask)
        check_count("bucketing", precondition, f, static_count(stats.valid))
        n = stats.valid.shape[0]
        mixing = bucket_matrix(key, stats.valid, bucket_size)
        # Padded to (n, n) with zero rows: the view's rows past B, and empty buckets, are invalid.
        square = jnp.zeros((n, n), jnp.float32).at[: mixing.shape[0]].set(mixing)
        filled = jnp.any(square > 0, axis=1)
        base = views.identity(stacked, params)
        if params is None:
            base = base._replace(floating=True)
        view = views.compose(base, square, diagonal=False, gram=square @ stats.gram @ square.T, valid=filled)
        merged, inner_state = inner_agg.update(view, inner_agg.init(params), params, **extra)
        return merged, pulled_back(inner_state, square, stats.valid)

    def pulled_back(inner_state, mixing, valid):
        info = get_info(inner_state)
        weights = mixing.T @ info.weights
        selected = valid & ((mixing.T @ info.selected.astype(jnp.float32)) > 0)
        return RuleState(AggregationInfo(valid, selected, weights, info.linear))

    return Aggregator(init_rule_state, update, "bucketing")
