"""DARE: drop task-vector entries at random and rescale the rest (Yu et al., ICML 2024)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from consensus.aggregators import view as views
from consensus.aggregators._common import allowed, check_stacked
from consensus.base import PreAggregator
from consensus.merging._common import check_density

PyTree = Any
RESCALES = (True, False, "l1")


class DareState(NamedTuple):
    """State of :func:`dare`: the factory's key (or None) and the number of rounds run."""

    key: jax.Array | None
    rounds: jax.Array


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 with full avalanche."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def keyed_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 pseudo-random bits of ``shape`` (node axis first), a pure function of ``key``.

    ``jax.random.bits`` (threefry) over a (16, 1e7) stack costs ~50 passes over
    memory on XLA:CPU. Here jax.random draws two 32-bit seeds per row from the
    key, and entry j of row i is ``fmix32(fmix32(j ^ s_i) + t_i)`` (a counter-based
    hash, as in counter-based dropout): a few integer ops per entry fused into
    the consumer. Statistically fine for dropout masks, not for cryptography.
    """
    n = shape[0]
    seeds = jax.random.bits(key, (n, 2), jnp.uint32)
    flat = (n, max(1, int(np_prod(shape[1:]))))
    j = jax.lax.broadcasted_iota(jnp.uint32, flat, 1)
    return _fmix32(_fmix32(j ^ seeds[:, 0:1]) + seeds[:, 1:2]).reshape(shape)


def np_prod(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


@functools.partial(jax.jit, static_argnames=("rescale",))
def _dare_leaf(x, base, key, density, valid, *, rescale):
    n = x.shape[0]
    shape = (n,) + (1,) * (x.ndim - 1)
    b = base.astype(jnp.float32)
    d = x.astype(jnp.float32) - b[None]
    # Bernoulli(density) from 32 random bits: keep when bits < density * 2^32 (exact to 2^-32).
    bits = keyed_bits(key, x.shape)
    cut = jnp.minimum(density * 4294967296.0, 4294967295.0).astype(jnp.uint32)
    keep = (bits < cut) | (density >= 1.0)
    # A dropped entry is d * 0: 0 for a finite d, NaN for a non-finite one, so a node holding
    # NaN/Inf still holds it after the drop (and every rule downstream excludes it) without a
    # separate finiteness pass over the stack.
    kept = jnp.where(keep, d, d * 0.0)
    if rescale == "l1":
        axes = tuple(range(1, x.ndim))
        before = jnp.sum(jnp.abs(d), axis=axes, keepdims=True)
        after = jnp.sum(jnp.abs(kept), axis=axes, keepdims=True)
        factor = jnp.where(after > 0, before / jnp.where(after > 0, after, 1.0), 1.0)
    elif rescale:
        factor = 1.0 / density
    else:
        factor = 1.0
    y = b[None] + kept * factor
    return jnp.where(valid.reshape(shape), y, jnp.nan).astype(x.dtype)


def dare(density: float, rescale: bool | str = True, *, key: jax.Array | None = None) -> PreAggregator:
    """DARE, Drop And REscale (Yu et al., "Language Models are Super Mario", ICML 2024).

    A keyed pre-aggregator (n -> n): with ``params`` = theta_0 the base and task
    vectors ``d_i = x_i - theta_0``, every entry of every d_i is kept
    independently with probability ``density`` (dropped with 1 - density) and

    * ``rescale=True`` (the paper): kept entries are divided by density, so
      ``E[y_i] = x_i``;
    * ``rescale="l1"`` (mergekit's ``rescale_norm: l1``): kept entries are
      scaled so each node's leaf keeps the L1 norm of its task vector;
    * ``rescale=False``: no rescaling.

    ``y_i = theta_0 + rescaled(mask_i * d_i)``. Compose with a merge:
    ``process(ties(0.5), pre=[dare(0.5)])`` is mergekit's ``dare_ties``,
    ``process(task_arithmetic(s), pre=[dare(p)])`` its ``dare_linear``.

    Randomness: the round's key is ``update(..., key=k)`` when given (the
    system passes the round's key), else the factory's ``key`` folded with the
    round counter kept in the state; without either the update raises. Leaf l
    uses ``fold_in(key, l)``; node i gets row i of that leaf's random bits, so
    the output is not invariant to permuting the nodes (each node's mask is a
    function of its position), only equal in distribution. Masked-out nodes
    come out as NaN ("no value"), like the other pre-aggregators; a node
    holding NaN/Inf comes out holding NaN/Inf (a dropped entry is ``d * 0``,
    NaN where d is not finite), so the rule downstream, which excludes every
    node with a non-finite entry, excludes it. One pass (random bits, drop
    and rescale fused, no separate finiteness pass) writing a new stack: the
    read and the write of the stack, ~2x one read; the bits are a keyed
    counter-based hash (:func:`keyed_bits`), not threefry, for speed.

    Precondition: density in (0, 1]. DP: DARE does not bound anything by
    itself; the rule after it decides.
    """
    rho = check_density("dare", density)
    if rescale not in RESCALES:
        raise ValueError(f"dare: rescale must be one of {RESCALES}, got {rescale!r}")
    own_key = None if key is None else jnp.asarray(key)

    def init(params):
        del params
        return DareState(own_key, jnp.zeros((), jnp.int32))

    def update(stacked, state, params=None, *, mask=None, lazy=False, key=None, **extra):
        del lazy, extra
        if params is None:
            raise ValueError("dare: needs the base model: update(stacked, state, params=base)")
        x = views.materialize(stacked) if views.is_view(stacked) else stacked
        n = check_stacked(x, params)
        if state is None:  # called without init (e.g. one-off): no own key, round 0
            state = init(params)
        if key is not None:
            round_key = key
        elif state.key is not None:
            round_key = jax.random.fold_in(state.key, state.rounds)
        else:
            raise ValueError("dare: needs a random key: dare(p, key=k) or update(..., key=round_key)")
        valid = allowed(mask, n)  # non-finite nodes stay non-finite (see _dare_leaf): one pass
        leaves, tdef = jax.tree_util.tree_flatten(x)
        bases = jax.tree_util.tree_leaves(params)
        out = [
            _dare_leaf(v, b, jax.random.fold_in(round_key, idx), jnp.float32(rho), valid, rescale=rescale)
            for idx, (v, b) in enumerate(zip(leaves, bases, strict=True))
        ]
        return jax.tree_util.tree_unflatten(tdef, out), DareState(state.key, state.rounds + 1)

    return PreAggregator(init, update, "dare")
