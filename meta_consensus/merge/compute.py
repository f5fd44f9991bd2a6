"""The merge's arithmetic on one piece: a whole leaf or a column chunk of n stacked inputs.

Here are the compute dtypes, the rules' updates compiled ahead of time, and the vector rules'
Gram and weighted-sum programs and whole-model weights.

jax and the library are imported in the functions that use them: building the CLI parser
(``meta-consensus --help``, ``run``, ``report``) must not pay for importing jax.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from meta_consensus.merge.errors import MergeError
from meta_consensus.merge.plan import RuleChoice
from meta_consensus.merge.report import leaf_report


def is_float(dtype: np.dtype) -> bool:
    """Whether tensors of ``dtype`` are merged (bfloat16 included); others are copied when equal.

    Args:
      dtype: A tensor's stored dtype.

    Returns:
      True for the floating dtypes, bfloat16 included (numpy does not count it as floating).
    """
    import ml_dtypes

    return bool(np.issubdtype(dtype, np.floating)) or np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16)


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype :func:`as_compute` merges a floating leaf of ``dtype`` in.

    Args:
      dtype: The leaf's stored floating dtype.

    Returns:
      float32 or float64 as they are (float64 is float32 without jax's x64 mode); float32 for
      the narrower floats.
    """
    import jax

    # float32 / float64 are kept (float64 becomes float32 without jax's x64 mode); the
    # narrower floats (bfloat16, float16) are merged in float32.
    keep = np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.float64))
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype if keep else np.float32))


def as_compute(x: np.ndarray) -> Any:
    """Floating leaves are merged in float32 (bfloat16 / float16 inputs too) and cast back on output.

    A float32 / float64 host array is handed to jax as it is: on the CPU backend an aligned
    buffer (:func:`~meta_consensus.merge.streaming.aligned_empty`) is aliased, not copied: a
    worker of :class:`~meta_consensus.merge.streaming.Pipeline` reuses its buffers for its next
    piece only once this one's output is on the host (and copied where it is a view of them).

    Args:
      x: A floating host array.

    Returns:
      The jax array, in :func:`compute_dtype`.
    """
    import jax
    import jax.numpy as jnp

    if np.dtype(x.dtype) in (np.dtype(np.float32), np.dtype(np.float64)):
        return jax.device_put(x)
    return jnp.asarray(x, compute_dtype(x.dtype))


def as_rows(stacked: np.ndarray, base: np.ndarray | None) -> tuple[Any, Any]:
    """A piece's stack as (n, s) rows and its base as (s,), in the compute dtype.

    Args:
      stacked: (n, ...) the inputs' piece.
      base: The base's piece, or None.

    Returns:
      (rows, base row), the base row None without a base.
    """
    x = as_compute(stacked).reshape(len(stacked), -1)
    return x, None if base is None else as_compute(base).reshape(-1)


# ----------------------------------------------------------------------------- vector rules


def _centre(x: Any, base: Any | None) -> Any:
    """The vector rules' centre of an (n, s) stack: the base, else the library's robust centre.

    That is ``robust_centre``: the coordinate-wise median, non-finite entries read as 0, by its
    sorting network or exact selection, which ``jnp.median``'s full sort is far slower than.
    """
    from consensus.aggregators._common import robust_centre

    return base if base is not None else robust_centre({"x": x})["x"]


@functools.cache
def vector_programs() -> tuple[Any, Any]:
    """The vector rules' two per-piece programs, jitted once (jax is imported only when a merge runs).

    * stats(x, base): (which rows are finite, the (n, n) Gram matrix of the rows around the
      centre) of an (n, s) stack. A row holding NaN or Inf (or values whose squares overflow
      float32, as the library's ``gram_stats`` counts them) has a non-finite diagonal entry and
      only spoils its own row and column of G, which the caller masks out; reading finiteness
      off the diagonal saves a reduction over the stack.
    * combine(x, base, w): ``c + sum_i w_i (x_i - c)`` as ``sum_i w_i x_i + (1 - sum_i w_i) c``
      in the library's one-pass weighted sum (``tensordot`` over the node axis is several times
      slower); 0-weight rows (NaN ones included) contribute nothing.

    Returns:
      The jitted (stats, combine).
    """
    import jax
    import jax.numpy as jnp

    from kernels import gram as gram_kernels
    from kernels import rows as row_kernels

    def stats(x: Any, base: Any | None) -> tuple[Any, Any]:
        g = gram_kernels.gram(x, _centre(x, base))
        return jnp.isfinite(jnp.diagonal(g)), g

    def combine(x: Any, base: Any | None, w: Any) -> Any:
        return row_kernels.weighted_sum(x, w, _centre(x, base), 1.0 - jnp.sum(w))

    return jax.jit(stats), jax.jit(combine)


def gram_of(stacked: np.ndarray, base: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """A piece's finite rows and Gram matrix around the centre, for a vector rule's first pass.

    Args:
      stacked: (n, ...) the inputs' piece (a chunk's zero padding adds nothing).
      base: The base's piece, or None (the centre is then the inputs' robust centre).

    Returns:
      ((n,) bool, True for the rows without NaN or Inf; (n, n) float64 Gram matrix), which the
      caller sums over the pieces.
    """
    finite, gram = vector_programs()[0](*as_rows(stacked, base))
    return np.asarray(finite), np.asarray(gram, np.float64)


def vector_weights(
    choice: RuleChoice, gram: np.ndarray, valid: np.ndarray, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Run a vector rule on an n x n embedding of the inputs: its whole-model weights and selection.

    The rows of ``U sqrt(Lambda)`` (``gram = U Lambda U^T``) have the inputs' inner products
    around the centre, hence their distances: a rule that reads the nodes only through those
    (Krum, the geometric median, ...) gives on the n x n embedding the weights it gives on the
    whole models, without holding them.

    Args:
      choice: The vector rule.
      gram: (n, n) the Gram matrix of the inputs around the centre, summed over the rule's leaves.
      valid: (n,) bool, False for the inputs with NaN or Inf (their rows and columns are zeroed
        and the rule's mask leaves them out).
      seed: A randomized rule gets ``key(seed)``.

    Returns:
      ((n,) float64 weights, (n,) bool selection).

    Raises:
      MergeError: If the rule's output is not a weighted combination of the inputs.
    """
    import jax
    import jax.numpy as jnp

    from consensus.base import get_info

    n = len(gram)
    g = np.where(valid[:, None] & valid[None, :], gram, 0.0)
    lam, u = np.linalg.eigh(g)
    embedding = (u * np.sqrt(np.clip(lam, 0.0, None))).astype(np.float32)
    rule = choice.build()
    stacked, centre = {"e": jnp.asarray(embedding)}, {"e": jnp.zeros((n,), jnp.float32)}
    extra = {"key": jax.random.key(seed)} if choice.spec.randomized else {}
    _, state = rule.update(stacked, rule.init(centre), centre, mask=jnp.asarray(valid), **extra)
    info = get_info(state)
    if not info.linear:
        raise MergeError(
            f"{choice.label()}: its output is not a weighted combination of the inputs, so it cannot be "
            "merged leaf by leaf from whole-model weights; use a coordinate-wise rule or a linear vector rule"
        )
    return np.asarray(info.weights, np.float64), np.asarray(info.selected)


# ----------------------------------------------------------------------------- other rules


def trim_density(choice: RuleChoice) -> float | None:
    """The density of a rule that trims each node's task vector per leaf by magnitude, else None.

    The spec's ``traits["trim_density"]`` names the parameter (TIES' ``density``).

    Args:
      choice: The rule.

    Returns:
      The kept fraction, given or the spec's default; None for a rule that does not trim.
    """
    name = choice.spec.traits.get("trim_density")
    if name is None:
        return None
    return float({**choice.spec.defaults, **choice.params}[name])


def jitted_update(choice: RuleChoice, has_base: bool, trimmed: bool = False) -> Any:
    """The rule's update on one stacked leaf ``{"x": x}``, jitted.

    XLA fuses the rule's passes over the leaf, where eager dispatch would run them one by one.

    Args:
      choice: The rule.
      has_base: Whether the update gets the base as ``params`` (the rules over task vectors need it).
      trimmed: The update takes the per-node trim thresholds found over the whole leaf
        (:mod:`meta_consensus.merge.trim`).

    Returns:
      ``update(x, params, key, thresholds=None) -> (merged, state)``, jitted.
    """
    import jax

    keyed = choice.spec.randomized
    rule = choice.build()

    def update(x: Any, params: Any, key: Any, thresholds: Any = None) -> Any:
        extra = {"key": key} if keyed else {}
        if trimmed:
            extra["thresholds"] = {"x": thresholds}
        init = params if has_base else {"x": x[0]}
        return rule.update({"x": x}, rule.init(init), params if has_base else None, **extra)

    return jax.jit(update)


def _slot(
    choice: RuleChoice, shape: Sequence[int], dtype: Any, has_base: bool, trimmed: bool = False
) -> tuple:
    """A compiled update's identity: (rule, shape, compute dtype, base given, thresholds given)."""
    return (choice.key, tuple(shape), np.dtype(dtype).name, has_base, trimmed)


def _compile(fn: Any, *args: Any) -> Any:
    """The jitted ``fn`` lowered for the abstract ``args`` and compiled (on the compile thread)."""
    return fn.lower(*args).compile()


class Compiled:
    """The plan's leaf updates, compiled ahead of time in a background thread.

    One update is compiled per distinct (rule, piece shape, compute dtype, base given,
    thresholds given). Compiling is a fixed cost per shape that would otherwise sit on the
    merge's critical path at the first leaf of every shape; compiled here in the order the
    leaves come, each one is ready by the time its first leaf is read, and XLA's compiler
    releases the GIL.

    Args:
      jobs: (rule, stacked shape, compute dtype, base given[, thresholds given]) per piece, in
        the order the pieces come; repeats are compiled once.
    """

    def __init__(self, jobs: Sequence[tuple]):
        from concurrent.futures import ThreadPoolExecutor

        import jax

        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="merge-compile")
        self.futures: dict[tuple, Any] = {}
        fns: dict[tuple[str, bool, bool], Any] = {}
        key_spec = jax.eval_shape(lambda: jax.random.key(0))
        for choice, shape, dtype, has_base, *rest in jobs:
            trimmed = bool(rest and rest[0])
            slot = _slot(choice, shape, dtype, has_base, trimmed)
            if slot in self.futures:
                continue
            if (choice.key, has_base, trimmed) not in fns:
                fns[choice.key, has_base, trimmed] = jitted_update(choice, has_base, trimmed)
            fn = fns[choice.key, has_base, trimmed]
            x = jax.ShapeDtypeStruct(shape, dtype)
            params = {"x": jax.ShapeDtypeStruct(shape[1:], dtype)} if has_base else None
            key = key_spec if choice.spec.randomized else None
            t = jax.ShapeDtypeStruct(shape[:1], np.float32) if trimmed else None
            self.futures[slot] = self.pool.submit(_compile, fn, x, params, key, t)

    def get(
        self, shape: tuple[int, ...], dtype: Any, has_base: bool, choice: RuleChoice, trimmed: bool = False
    ) -> Any:
        """The compiled update for a piece, once its compile is done.

        Args:
          shape: The stacked piece's shape.
          dtype: The compute dtype.
          has_base: Whether the update gets the base.
          choice: The rule.
          trimmed: Whether the update takes trim thresholds.

        Returns:
          The compiled update; None for a piece no job named (the caller then jits it).
        """
        future = self.futures.get(_slot(choice, shape, dtype, has_base, trimmed))
        return None if future is None else future.result()

    def close(self) -> None:
        """Stop the compile thread: compiles not yet started are cancelled, a running one is awaited."""
        self.pool.shutdown(wait=True, cancel_futures=True)


def apply_update(
    stacked: Any,
    base: Any | None,
    choice: RuleChoice,
    seed: int,
    index: int,
    compiled: Compiled | None,
    thresholds: np.ndarray | None = None,
) -> tuple[Any, Any]:
    """Run a rule's update on a float stack (a whole leaf, or a chunk of an element-wise rule).

    Args:
      stacked: (n, ...) the inputs' leaf or chunk.
      base: The base's leaf or chunk, or None.
      choice: The rule.
      seed: The plan's seed; a randomized rule's key is ``fold_in(key(seed), index)``.
      index: The leaf's position among the keys, so each leaf draws its own randomness.
      compiled: The plan's compiled updates, or None to jit one here.
      thresholds: A trimming rule's (n,) per-node thresholds, found over the whole leaf; None
        for the others (and for a whole leaf, where the rule finds them).

    Returns:
      (merged values in the compute dtype, the rule's :class:`~consensus.base.AggregationInfo`).
    """
    import jax

    from consensus.base import get_info

    x = as_compute(stacked)
    params = None if base is None else {"x": as_compute(base)}
    key = jax.random.fold_in(jax.random.key(seed), index) if choice.spec.randomized else None
    trimmed = thresholds is not None
    fn = compiled.get(x.shape, x.dtype, params is not None, choice, trimmed) if compiled is not None else None
    if fn is None:
        fn = jitted_update(choice, params is not None, trimmed)
    t = np.asarray(thresholds, np.float32) if trimmed else None
    merged, state = fn(x, params, key, t)
    return merged["x"], get_info(state)


def merge_leaf(
    stacked: np.ndarray,
    base_leaf: np.ndarray | None,
    key: str,
    choice: RuleChoice,
    vector: tuple[np.ndarray, np.ndarray] | None,
    seed: int,
    index: int,
    compiled: Compiled | None = None,
) -> tuple[Any, dict[str, Any]]:
    """A whole leaf (or a vector rule's chunk) merged: (values, its report entry).

    A non-float leaf is copied when every input holds the same value; a vector rule's leaf is
    its whole-model weights ``vector`` applied; any other rule runs its update here.

    Args:
      stacked: (n, ...) the inputs' leaf (or a vector rule's chunk).
      base_leaf: The base's leaf or chunk, or None.
      key: The leaf's key, for messages.
      choice: The leaf's rule.
      vector: A vector rule's (whole-model weights, selection) from its first pass; None for
        the other rules.
      seed: The plan's seed (see :func:`apply_update`).
      index: The leaf's position among the keys.
      compiled: The plan's compiled updates, or None.

    Returns:
      (merged values, the leaf's report entry).

    Raises:
      MergeError: If a non-float leaf differs between inputs.
    """
    import jax.numpy as jnp

    n = len(stacked)
    if not is_float(stacked.dtype):
        if not all(np.array_equal(stacked[0], stacked[i]) for i in range(1, n)):
            raise MergeError(
                f"{key!r} is a {stacked.dtype} tensor that differs between inputs; "
                "only float tensors are merged"
            )
        # A copy: the stack's buffer is reused for a later leaf while this one is being written.
        return stacked[0].copy(), {"method": "copy (non-float, equal in every input)"}
    if vector is not None:
        w, _ = vector
        merged = vector_programs()[1](*as_rows(stacked, base_leaf), jnp.asarray(w, jnp.float32))
        return merged, {"method": choice.method, "weights": "whole-model (see vector_rules)"}
    merged, info = apply_update(stacked, base_leaf, choice, seed, index, compiled)
    return merged, leaf_report(choice, info)
