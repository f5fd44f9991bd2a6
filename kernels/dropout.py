"""DARE's keyed drop of task-vector entries: the random bits, the dropped rows, and a fused sum.

The drop keeps entry j of node i's task vector ``d_i = x_i - base`` when its 32 keyed bits are
below ``density * 2^32``. The bits are a pure function of (key, i, j), so any consumer can
recompute the mask where it reads the entry: :func:`dropped_rows` writes the dropped stack
(what a rule that needs rows reads), :func:`dropped_delta_sum` sums the dropped task vectors
without writing them (task arithmetic after DARE: one read of the stack instead of a read, a
write and a read again; a fresh (n, d) output alone costs about 2x one read on XLA:CPU).
Both use the same :func:`keep_mask`, so they drop the same entries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.compile_options import kernel_jit
from kernels.rows import tree_sum


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 with full avalanche."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def row_seeds(key: jax.Array, n: int) -> jax.Array:
    """The two seeds of every row, drawn from ``key`` by jax.random.

    Args:
      key: a JAX PRNG key.
      n: the number of rows.

    Returns:
      (n, 2) uint32 seeds.
    """
    return jax.random.bits(key, (n, 2), jnp.uint32)


def hashed_bits(seeds: jax.Array, j: jax.Array) -> jax.Array:
    """uint32 bits ``fmix32(fmix32(j ^ s) + t)`` of uint32 flat indices ``j``, ``(s, t) = seeds[..., :2]``.

    ``seeds`` broadcasts against ``j``: one row's (2,) seeds with that row's indices, or the
    (n, 1, 2) seeds of every row with (n, m) indices.

    Args:
      seeds: uint32 seeds, ``(..., 2)``.
      j: uint32 flat indices, broadcasting against ``seeds[..., 0]``.

    Returns:
      uint32 bits of the broadcast shape.
    """
    return _fmix32(_fmix32(j ^ seeds[..., 0]) + seeds[..., 1])


def keyed_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 pseudo-random bits of ``shape`` (node axis first), a pure function of ``key``.

    ``jax.random.bits`` (threefry) over a (16, 1e7) stack costs ~50 passes over
    memory on XLA:CPU. Here jax.random draws two 32-bit seeds per row from the
    key, and entry j of row i is ``fmix32(fmix32(j ^ s_i) + t_i)`` (a counter-based
    hash, as in counter-based dropout): a few integer ops per entry fused into
    the consumer. Statistically fine for dropout masks, not for cryptography.

    Args:
      key: a JAX PRNG key.
      shape: the shape of the bits, node axis first.

    Returns:
      uint32 bits of ``shape``.
    """
    n = shape[0]
    seeds = row_seeds(key, n)
    flat = (n, max(1, _numel(shape[1:])))
    j = jax.lax.broadcasted_iota(jnp.uint32, flat, 1)
    return hashed_bits(seeds[:, None, :], j).reshape(shape)


def keep_threshold(density: jax.Array) -> jax.Array:
    """The uint32 cut: keep an entry when its bits are below it (Bernoulli(density), exact to 2^-32).

    Args:
      density: the fraction of entries kept, in [0, 1].

    Returns:
      uint32 scalar ``min(density * 2^32, 2^32 - 1)``.
    """
    return jnp.minimum(density * 4294967296.0, 4294967295.0).astype(jnp.uint32)


def _kept(bits: jax.Array, density: jax.Array) -> jax.Array:
    return (bits < keep_threshold(density)) | (density >= 1.0)


def keep_mask(key: jax.Array, shape: tuple[int, ...], density: jax.Array) -> jax.Array:
    """The entries DARE keeps (every entry at density 1).

    Args:
      key: a JAX PRNG key (the same key gives the same mask).
      shape: the stack's shape, node axis first.
      density: the fraction of entries kept, in [0, 1].

    Returns:
      bool array of ``shape``.
    """
    return _kept(keyed_bits(key, shape), density)


def _drop(d: jax.Array, keep: jax.Array) -> jax.Array:
    # A dropped entry is d * 0: 0 for a finite d, NaN for a non-finite one, so a node holding
    # NaN/Inf still holds it after the drop (and every rule downstream excludes it) without a
    # separate finiteness pass over the stack.
    return jnp.where(keep, d, d * 0.0)


@kernel_jit
def dropped_rows(
    x: jax.Array, base: jax.Array, key: jax.Array, density: jax.Array, factor: jax.Array, valid: jax.Array
) -> jax.Array:
    """``base + factor * keep_i * (x_i - base)`` for every row (invalid rows NaN): one pass, a new stack.

    Args:
      x: (n, ...) stack of node parameters.
      base: (...) the base model.
      key: a JAX PRNG key (the mask of :func:`keep_mask`).
      density: the fraction of entries kept, in [0, 1].
      factor: the rescaling of the kept entries (1 / density for DARE).
      valid: (n,) bool; invalid rows come out NaN.

    Returns:
      (n, ...) array in x's dtype.
    """
    n = x.shape[0]
    b = base.astype(jnp.float32)
    kept = _drop(x.astype(jnp.float32) - b[None], keep_mask(key, x.shape, density))
    y = b[None] + kept * factor
    return jnp.where(valid.reshape((n,) + (1,) * (x.ndim - 1)), y, jnp.nan).astype(x.dtype)


@kernel_jit
def dropped_delta_sum(
    x: jax.Array, base: jax.Array, coeffs: jax.Array, key: jax.Array, density: jax.Array, factor: jax.Array
) -> jax.Array:
    """``base + sum_i c_i * factor * keep_i * (x_i - base)`` in one fused pass, no stack written.

    Rows with c_i = 0 never enter (NaN-safe), as in ``arithmetic.delta_sum``; the kept
    entries are those of :func:`dropped_rows` with the same key (same bits, same cut).

    Args:
      x: (n, ...) stack of node parameters.
      base: (...) the base model.
      coeffs: (n,) coefficients c_i (0 leaves a row out).
      key: a JAX PRNG key (the mask of :func:`keep_mask`).
      density: the fraction of entries kept, in [0, 1].
      factor: the rescaling of the kept entries (1 / density for DARE).

    Returns:
      (...) array in x's dtype.
    """
    n = x.shape[0]
    b = base.astype(jnp.float32)
    seeds = row_seeds(key, n)
    j = jax.lax.broadcasted_iota(jnp.uint32, (max(1, _numel(x.shape[1:])),), 0).reshape(x.shape[1:])
    terms = []
    for i in range(n):
        d = _drop(x[i].astype(jnp.float32) - b, _kept(hashed_bits(seeds[i], j), density))
        terms.append(jnp.where(coeffs[i] != 0, (coeffs[i] * factor) * d, 0.0))
    return (b + tree_sum(terms)).astype(x.dtype)
