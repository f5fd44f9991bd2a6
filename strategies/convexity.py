"""Convexity strategies: proximal pull and hard L2-ball constraint towards an anchor.

A node that trains away from the last consensus (the *anchor*) can be kept near
it in two ways, both applied after the node optimizer's own step:

* **proximal**: the exact proximal step of ``lr * mu/2 ||theta - anchor||^2``
  (FedProx's term, applied as a prox rather than as a gradient);
* **projection**: Euclidean projection onto the ball
  ``{theta : ||theta - anchor||_2 <= r}`` over the whole tree. Every node then
  lies in the ball, and since a ball is convex, so does every convex
  combination of nodes, i.e. any consensus the coordinator forms from them.

The functions work on single trees, so they run per node under ``vmap`` (anchor,
``mu``, ``lr`` and ``r`` may all differ per node); :func:`convex_constrained`
packages them as an optax transformation. :func:`loss_barrier` and friends give
the convexity diagnostic: the loss barrier along straight lines between nodes
and between a node and the anchor.

References:
  Li et al. 2020, "Federated Optimization in Heterogeneous Networks" (FedProx).
  Parikh & Boyd 2014, "Proximal Algorithms", Foundations and Trends in Optimization.
  Frankle et al. 2020, "Linear Mode Connectivity and the Lottery Ticket Hypothesis", ICML.
  Entezari et al. 2022, "The Role of Permutation Invariance in Linear Mode Connectivity
  of Neural Networks", ICLR.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from consensus import tree as ctree

PyTree = Any
Array = jax.Array
Scalar = float | Array


# ----------------------------------------------------------------------------- helpers


def _compute_dtype(dtype: Any) -> Any:
    # bf16 / f16 leaves are updated in float32 and cast back once; float64 stays float64.
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _check_pair(params: PyTree, anchor: PyTree, fn: str) -> None:
    """Same structure and shapes, floating leaves (static checks, fine under jit)."""
    try:
        ctree.check_same_structure([params, anchor])
    except ctree.TreeMismatchError as e:
        # Node 1 in check_same_structure's message is the anchor.
        raise ctree.TreeMismatchError(f"{fn}: params and anchor differ: {e}") from None
    _check_float(params, fn)


def _check_float(params: PyTree, fn: str) -> None:
    for path, leaf in zip(ctree.leaf_paths(params), jax.tree_util.tree_leaves(params), strict=True):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise TypeError(
                f"{fn}: leaf {path} has dtype {jnp.result_type(leaf)}; only floating-point parameters "
                "can be moved towards an anchor (remove integer state such as counters or RNG keys)"
            )


def _check_scalar(name: str, value: Any, fn: str, *, allow_inf: bool = False) -> None:
    """Refuse negative (or NaN) hyperparameters when they are concrete; traced ones pass."""
    if value is None or isinstance(value, jax.core.Tracer):
        return
    try:
        # numpy, not jnp: under jit a jnp.asarray of a Python float is itself traced.
        arr = np.asarray(value)
    except jax.errors.ConcretizationTypeError:
        return
    if arr.ndim != 0:
        raise ValueError(f"{fn}: {name} must be a scalar per node, got shape {arr.shape} (vmap over nodes)")
    v = float(arr)
    if not (v >= 0.0) or (v == float("inf") and not allow_inf):
        raise ValueError(f"{fn}: {name} must be a finite number >= 0, got {v}")


def tree_distance(params: PyTree, anchor: PyTree) -> Array:
    """Global L2 distance ``||params - anchor||_2`` over all leaves (float32, or float64 for f64 trees).

    Args:
      params: a params tree.
      anchor: a tree of the same structure and shapes.

    Returns:
      A scalar array.
    """
    leaves_p = jax.tree_util.tree_leaves(params)
    leaves_a = jax.tree_util.tree_leaves(anchor)
    acc = jnp.float64 if any(_compute_dtype(x.dtype) == jnp.float64 for x in leaves_p) else jnp.float32
    total = jnp.zeros((), acc)
    for p, a in zip(leaves_p, leaves_a, strict=True):
        d = p.astype(acc) - a.astype(acc)
        total = total + jnp.sum(d * d)
    return jnp.sqrt(total)


# ----------------------------------------------------------------------------- prox and projection


def proximal_step(params: PyTree, anchor: PyTree, mu: Scalar, lr: Scalar) -> PyTree:
    """Exact proximal step of ``lr * mu/2 ||theta - anchor||^2``, leaf by leaf.

    Math:
      Given the point ``v`` reached by a gradient (or any optimizer) step::

          prox(v) = argmin_theta 1/(2 lr) ||theta - v||^2 + mu/2 ||theta - anchor||^2
                  = (v + lr mu anchor) / (1 + lr mu)
                  = v - c (v - anchor),   c = lr mu / (1 + lr mu) in [0, 1).

      Why a prox and not ``grad += mu (theta - anchor)``: the gradient form
      multiplies the distance to the anchor by ``1 - lr mu`` each step, which
      oscillates for ``lr mu > 1`` and diverges for ``lr mu > 2``; the prox
      multiplies it by ``1 / (1 + lr mu)``, a contraction for every
      ``lr mu >= 0``. Applied after an adaptive optimizer (Adam), it also keeps
      the pull exactly ``mu`` instead of letting the optimizer's preconditioner
      rescale it. The last form is used because it is exact for ``mu = 0`` and
      loses no precision when ``v`` is close to the anchor.

    Args:
      params: the tree ``v`` after the optimizer step.
      anchor: the anchor tree (last consensus), same structure and shapes.
      mu: proximal strength, a scalar >= 0 (per node under ``vmap``).
      lr: the step size of the optimizer step that produced ``v``, scalar >= 0.

    Returns:
      The proximal point, a tree with the dtypes of ``params``.

    Raises:
      consensus.tree.TreeMismatchError: when ``params`` and ``anchor`` differ in structure or shapes.
      TypeError: for a leaf that is not floating-point.
      ValueError: for a concrete ``mu`` or ``lr`` that is negative, NaN, infinite or not a scalar.

    Example:
      >>> theta = proximal_step({"w": jnp.ones(3)}, {"w": jnp.zeros(3)}, mu=1.0, lr=1.0)
      >>> theta["w"]  # (1 + lr mu a) / (1 + lr mu) with a = 0
      Array([0.5, 0.5, 0.5], dtype=float32)

    References:
      Parikh & Boyd 2014, "Proximal Algorithms", sec. 2 and 4.2.
      Li et al. 2020, "Federated Optimization in Heterogeneous Networks" (FedProx).
    """
    _check_pair(params, anchor, "proximal_step")
    _check_scalar("mu", mu, "proximal_step")
    _check_scalar("lr", lr, "proximal_step")
    lm = jnp.asarray(lr, jnp.float32) * jnp.asarray(mu, jnp.float32)
    c32 = lm / (1.0 + lm)

    def leaf(v: Array, a: Array) -> Array:
        cd = _compute_dtype(v.dtype)
        v_, a_ = v.astype(cd), a.astype(cd)
        return (v_ - c32.astype(cd) * (v_ - a_)).astype(v.dtype)

    return jax.tree.map(leaf, params, anchor)


def project_l2_ball(params: PyTree, anchor: PyTree, radius: Scalar) -> PyTree:
    """Euclidean projection onto ``{theta : ||theta - anchor||_2 <= radius}`` over the whole tree.

    Math:
      With ``d = params - anchor`` and the *global* norm ``||d||`` over all
      leaves (not per leaf: a per-leaf projection lands in a product of balls,
      which is a different and larger set),

      ``P(params) = params                            if ||d|| <= r``
      ``P(params) = anchor + (r / ||d||) d            otherwise.``

      Inside the ball the input is returned unchanged, bit for bit. Outside,
      the result lies on the sphere up to float rounding (relative ~1e-7 in
      float32). Because the ball is convex, any convex combination of
      projected nodes lies in it too.

    Args:
      params: a params tree.
      anchor: the ball's centre, same structure and shapes.
      radius: the radius ``r >= 0`` (``inf`` allowed: no constraint), scalar
        per node under ``vmap``.

    Returns:
      The projected tree, with the dtypes of ``params``.

    Raises:
      consensus.tree.TreeMismatchError: when ``params`` and ``anchor`` differ in structure or shapes.
      TypeError: for a leaf that is not floating-point.
      ValueError: for a concrete ``radius`` that is negative, NaN or not a scalar.

    Example:
      >>> p = project_l2_ball({"w": jnp.array([3.0, 4.0])}, {"w": jnp.zeros(2)}, 1.0)
      >>> p["w"]  # (3, 4) / 5
      Array([0.6, 0.8], dtype=float32)

    References:
      Parikh & Boyd 2014, "Proximal Algorithms", sec. 6.5.1 (projection onto a Euclidean ball).
    """
    _check_pair(params, anchor, "project_l2_ball")
    _check_scalar("radius", radius, "project_l2_ball", allow_inf=True)
    dist = tree_distance(params, anchor)
    r = jnp.asarray(radius, dist.dtype)
    outside = dist > r
    # Guard the division for points at the anchor (never "outside" for r >= 0).
    scale = jnp.where(outside, r / jnp.where(outside, dist, 1.0), 1.0)

    def leaf(v: Array, a: Array) -> Array:
        cd = _compute_dtype(v.dtype)
        a_ = a.astype(cd)
        projected = (a_ + scale.astype(cd) * (v.astype(cd) - a_)).astype(v.dtype)
        return jnp.where(outside, projected, v)

    return jax.tree.map(leaf, params, anchor)


# ----------------------------------------------------------------------------- optax wrapper


class ConvexConstrainedState(NamedTuple):
    """State of :func:`convex_constrained`: the inner optimizer's state and a step count (for schedules)."""

    inner_state: optax.OptState
    count: Array  # type: ignore[assignment]  # a NamedTuple field named like tuple.count


def convex_constrained(
    inner: optax.GradientTransformation,
    *,
    mu: float = 0.0,
    radius: float | None = None,
    learning_rate: float | optax.Schedule | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wrap a node optimizer so each step ends with the prox towards, and/or projection around, an anchor.

    Math:
      With ``u`` the inner optimizer's update and ``v = params + u``, the
      returned update is ``P_r(prox_{lr mu}(v)) - params``, so that
      ``optax.apply_updates(params, update)`` is the proximal point (see
      :func:`proximal_step`) projected onto the ball of radius ``r`` around the
      anchor (see :func:`project_l2_ball`). With plain SGD this is exactly
      proximal gradient descent on ``loss + mu/2 ||theta - anchor||^2``,
      constrained to the ball. Either part is skipped when it is off
      (``mu == 0`` / ``radius is None``).

    Args:
      inner: the node optimizer (any optax transformation). Wrap the whole
        optimizer: this must be the outermost transform, and gradient
        accumulation goes outside it (``optax.MultiSteps(convex_constrained(...))``)
        so that the prox runs once per real step.
      mu: default proximal strength (>= 0); ``update(..., mu=...)`` overrides it
        per call, e.g. a per-node value under ``vmap``.
      radius: default ball radius (>= 0, ``inf`` = unconstrained) or None for no
        projection; ``update(..., radius=...)`` overrides it.
      learning_rate: the inner optimizer's step size, needed by the prox (a
        float or an optax schedule of the step count). When None, the value is
        looked up as ``learning_rate`` in the inner state (present when the
        inner optimizer is built with ``optax.inject_hyperparams``), and
        ``update(..., learning_rate=...)`` overrides both.

      Note: under ``jax_numpy_dtype_promotion="strict"`` (this repository's tests),
      optax 0.2.8's ``adam``/``adamw`` and ``MultiSteps`` do not trace (they mix
      int32 step counts with floats); ``sgd`` with or without momentum does.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose update is
      ``update(grads, state, params, *, anchor=None, mu=None, radius=None,
      learning_rate=None, **extra)``; ``anchor`` is required whenever the prox or
      the projection is on, ``params`` always then. Other extra args go to
      ``inner``. Works under ``jit`` and ``vmap``.

    Raises:
      ValueError: for a negative or NaN ``mu``, ``radius`` or ``learning_rate`` (an infinite one
        but ``radius``); and from
        ``update``, when the prox or the projection is on and ``params`` or ``anchor`` is
        missing, or the prox finds no learning rate (none given and none in the inner state).

    Example:
      >>> opt = convex_constrained(optax.sgd(0.5), mu=0.1, radius=1.0, learning_rate=0.5)
      >>> params = global_params = {"w": jnp.zeros(2)}
      >>> grads = {"w": jnp.array([-6.0, -8.0])}  # sgd alone would step to (3, 4)
      >>> state = opt.init(params)
      >>> updates, state = opt.update(grads, state, params, anchor=global_params)
      >>> params = optax.apply_updates(params, updates)  # inside the ball around global_params
      >>> params["w"]  # the prox shrinks (3, 4) by 1 / 1.05, the projection to norm 1
      Array([0.6, 0.8], dtype=float32)

    References:
      Li et al. 2020 (FedProx); Parikh & Boyd 2014, "Proximal Algorithms".
    """
    _check_scalar("mu", mu, "convex_constrained")
    _check_scalar("radius", radius, "convex_constrained", allow_inf=True)
    if learning_rate is not None and not callable(learning_rate):
        _check_scalar("learning_rate", learning_rate, "convex_constrained")
    # update_fn's keyword overrides shadow these names.
    mu_default, radius_default, lr_default = mu, radius, learning_rate
    inner_x = optax.with_extra_args_support(inner)

    def init_fn(params: PyTree) -> ConvexConstrainedState:
        return ConvexConstrainedState(inner_state=inner_x.init(params), count=jnp.zeros((), jnp.int32))

    def update_fn(
        updates: PyTree,
        state: ConvexConstrainedState,
        params: PyTree | None = None,
        *,
        anchor: PyTree | None = None,
        mu: Scalar | None = None,
        radius: Scalar | None = None,
        learning_rate: Scalar | None = None,
        **extra: Any,
    ) -> tuple[PyTree, ConvexConstrainedState]:
        u, inner_state = inner_x.update(updates, state.inner_state, params, **extra)
        new_state = ConvexConstrainedState(inner_state, optax.safe_int32_increment(state.count))
        mu_ = mu_default if mu is None else mu
        r_ = radius_default if radius is None else radius
        # Static decisions: a Python 0.0 / None switches a part off; any array keeps it on
        # (mu = 0 and r = inf are exact no-ops, so per-node "off" works under vmap).
        use_prox = not (isinstance(mu_, int | float) and mu_ == 0.0)
        use_ball = r_ is not None
        if not (use_prox or use_ball):
            return u, new_state
        if params is None:
            raise ValueError(
                "convex_constrained: update needs params (the prox/projection act on params + updates)"
            )
        if anchor is None:
            raise ValueError(
                "convex_constrained: update needs anchor=... (the last consensus params) "
                "when mu > 0 or a radius is set"
            )
        v = optax.apply_updates(params, u)
        if use_prox:
            lr = _resolve_lr(learning_rate, state.count, inner_state)
            v = proximal_step(v, anchor, mu_, lr)
        if use_ball:
            assert r_ is not None  # use_ball says so
            v = project_l2_ball(v, anchor, r_)

        def delta(new: Array, p: Array, upd: Array) -> Array:
            cd = _compute_dtype(p.dtype)
            return (new.astype(cd) - p.astype(cd)).astype(upd.dtype)

        return jax.tree.map(delta, v, params, u), new_state

    def _resolve_lr(override: Scalar | None, count: Array, inner_state: Any) -> Scalar:
        if override is not None:
            return override
        if lr_default is not None:
            # Schedules see the count before this step, as optax's own schedules do.
            return lr_default(count) if callable(lr_default) else lr_default
        found = optax.tree_utils.tree_get(inner_state, "learning_rate")
        if found is None:
            raise ValueError(
                "convex_constrained: the prox needs the inner optimizer's learning rate: pass "
                "learning_rate=... (here or to update), or build the inner optimizer with "
                "optax.inject_hyperparams so that its state carries it"
            )
        return found

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ----------------------------------------------------------------------------- loss barriers


class BarrierReport(NamedTuple):
    """Losses along straight lines between parameter trees.

    Attributes:
      alphas: (k,) float32 interpolation points in [0, 1], both ends included.
      losses: (..., k) ``L((1 - alpha) a + alpha b)``.
      gaps: (..., k) ``losses - ((1 - alpha) L(a) + alpha L(b))``: the loss above
        the chord; <= 0 everywhere when the loss is convex along the line.
      barrier: (...) ``max_alpha gaps`` (>= 0, since the ends have gap 0).
    """

    alphas: Array
    losses: Array
    gaps: Array
    barrier: Array


def _interpolate(a: PyTree, b: PyTree, alpha: Array) -> PyTree:
    def leaf(x: Array, y: Array) -> Array:
        cd = _compute_dtype(x.dtype)
        al = alpha.astype(cd)
        # (1 - alpha) x + alpha y is exactly x at alpha = 0 and exactly y at alpha = 1.
        return ((1.0 - al) * x.astype(cd) + al * y.astype(cd)).astype(x.dtype)

    return jax.tree.map(leaf, a, b)


def _path_losses(loss_fn: Callable, a: PyTree, b: PyTree, batch: Any, alphas: Array) -> Array:
    """(k,) losses along the line, all alphas in one vmapped call."""

    def one(alpha: Array) -> Array:
        return jnp.asarray(loss_fn(_interpolate(a, b, alpha), batch)).astype(jnp.float32)

    return jax.vmap(one)(alphas)


def _gaps(losses: Array, alphas: Array) -> tuple[Array, Array]:
    chord = (1.0 - alphas) * losses[..., :1] + alphas * losses[..., -1:]
    gaps = losses - chord
    return gaps, jnp.max(gaps, axis=-1)


def _check_num_points(num_points: int, fn: str) -> None:
    if not isinstance(num_points, int) or num_points < 2:
        raise ValueError(f"{fn}: num_points must be an int >= 2 (both ends are included), got {num_points!r}")


def _run(impl: Callable, loss_fn: Callable, *args: Any, num_points: int) -> BarrierReport:
    """Run a jitted barrier kernel; a hashable ``loss_fn`` is a static arg, so compiled code is reused."""
    try:
        hash(loss_fn)
    except TypeError:
        # e.g. a bound method of a dataclass holding arrays: compile for this call only.
        return jax.jit(functools.partial(impl, loss_fn), static_argnames=("num_points",))(
            *args, num_points=num_points
        )
    return _jitted(impl)(loss_fn, *args, num_points=num_points)


@functools.cache
def _jitted(impl: Callable) -> Callable:
    # One jit wrapper per kernel, so its compilation cache (keyed on loss_fn and num_points) persists.
    return jax.jit(impl, static_argnames=("loss_fn", "num_points"))


def _barrier_jit(loss_fn: Callable, a: PyTree, b: PyTree, batch: Any, num_points: int) -> BarrierReport:
    alphas = jnp.linspace(0.0, 1.0, num_points, dtype=jnp.float32)
    losses = _path_losses(loss_fn, a, b, batch, alphas)
    gaps, barrier = _gaps(losses, alphas)
    return BarrierReport(alphas, losses, gaps, barrier)


def loss_barrier(
    loss_fn: Callable[[PyTree, Any], Array],
    params_a: PyTree,
    params_b: PyTree,
    batch: Any,
    num_points: int = 11,
) -> BarrierReport:
    """Loss barrier on the straight line between two parameter trees (linear mode connectivity).

    Math:
      ``theta(alpha) = (1 - alpha) a + alpha b`` on ``num_points`` evenly spaced
      alphas in [0, 1], and

      ``barrier = max_alpha L(theta(alpha)) - ((1 - alpha) L(a) + alpha L(b))``,

      the height of the loss above the chord between the two ends. It is 0
      (the ends) for a loss that is convex along the line, and positive when
      the two points sit in different basins. All alphas are evaluated in one
      vmapped call (``num_points`` copies of the params live at once).

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, e.g. a task's held-out loss
        (or error, or any metric where lower is better). Must be hashable (a
        function, not a fresh lambda per call, to reuse the compiled code).
      params_a: the tree at ``alpha = 0``.
      params_b: the tree at ``alpha = 1``, same structure.
      batch: the data passed to ``loss_fn`` unchanged (held-out data).
      num_points: number of alphas, ends included (>= 2; odd puts one at 0.5).

    Returns:
      A :class:`BarrierReport` with ``losses`` and ``gaps`` of shape (k,) and a
      scalar ``barrier``.

    Raises:
      ValueError: for ``num_points`` that is not an int >= 2.
      consensus.tree.TreeMismatchError: when the two trees differ in structure or shapes.
      TypeError: for a leaf that is not floating-point.

    Example:
      >>> def task_loss(p, batch): return jnp.sum((p["w"] ** 2 - batch) ** 2)
      >>> a, b = {"w": jnp.array([-1.0])}, {"w": jnp.array([1.0])}  # two minima, loss 0
      >>> report = loss_barrier(task_loss, a, b, jnp.float32(1.0))
      >>> float(report.barrier)  # the midpoint w = 0 has loss 1, the chord is 0
      1.0

    References:
      Frankle et al. 2020, "Linear Mode Connectivity and the Lottery Ticket Hypothesis", ICML.
      Entezari et al. 2022, "The Role of Permutation Invariance in Linear Mode Connectivity", ICLR
      (this exact definition of the barrier).
    """
    _check_num_points(num_points, "loss_barrier")
    _check_pair(params_a, params_b, "loss_barrier")
    return _run(_barrier_jit, loss_fn, params_a, params_b, batch, num_points=num_points)


def _anchor_barriers_jit(loss_fn: Callable, stacked: PyTree, anchor: PyTree, batch: Any, num_points: int):
    alphas = jnp.linspace(0.0, 1.0, num_points, dtype=jnp.float32)
    # lax.map over nodes, vmap over alphas: num_points copies of the params at a time, not n * num_points.
    losses = jax.lax.map(lambda node: _path_losses(loss_fn, anchor, node, batch, alphas), stacked)
    gaps, barrier = _gaps(losses, alphas)
    return BarrierReport(alphas, losses, gaps, barrier)


def anchor_barriers(
    loss_fn: Callable[[PyTree, Any], Array],
    stacked: PyTree,
    anchor: PyTree,
    batch: Any,
    num_points: int = 11,
) -> BarrierReport:
    """Loss barrier between the anchor (``alpha = 0``) and each of n stacked nodes (``alpha = 1``).

    Math: ``barrier[i] = max_alpha L((1-alpha) anchor + alpha x_i) - ((1-alpha) L(anchor) + alpha L(x_i))``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (see :func:`loss_barrier`).
      stacked: n node trees stacked on a leading axis.
      anchor: one tree (the last consensus).
      batch: held-out data, passed unchanged.
      num_points: alphas per line, ends included.

    Returns:
      A :class:`BarrierReport` with ``losses``/``gaps`` of shape (n, k) and ``barrier`` of shape (n,).

    Raises:
      ValueError: for ``num_points`` that is not an int >= 2.
      consensus.tree.TreeMismatchError: when ``stacked`` is not ``anchor`` with a node axis added.
      TypeError: for a leaf that is not floating-point.

    References:
      As :func:`loss_barrier`.
    """
    _check_num_points(num_points, "anchor_barriers")
    ctree.check_stacked_against(stacked, anchor)
    _check_float(anchor, "anchor_barriers")
    return _run(_anchor_barriers_jit, loss_fn, stacked, anchor, batch, num_points=num_points)


def _pairwise_jit(loss_fn: Callable, stacked: PyTree, batch: Any, num_points: int):
    n = ctree.num_nodes(stacked)
    alphas = jnp.linspace(0.0, 1.0, num_points, dtype=jnp.float32)
    ii, jj = np.triu_indices(n, k=1)

    def pair(ij: tuple[Array, Array]) -> Array:
        i, j = ij
        a = jax.tree.map(lambda x: x[i], stacked)
        b = jax.tree.map(lambda x: x[j], stacked)
        return _path_losses(loss_fn, a, b, batch, alphas)

    node_losses = jax.lax.map(lambda x: jnp.asarray(loss_fn(x, batch)).astype(jnp.float32), stacked)
    losses = jnp.broadcast_to(node_losses[:, None, None], (n, n, num_points))
    if ii.size:
        pl = jax.lax.map(pair, (jnp.asarray(ii, jnp.int32), jnp.asarray(jj, jnp.int32)))  # (P, k), i -> j
        losses = losses.at[ii, jj].set(pl).at[jj, ii].set(pl[:, ::-1])
    gaps, barrier = _gaps(losses, alphas)
    # The reversed line j -> i is sampled at 1 - alphas, which equals alphas up to rounding.
    return BarrierReport(alphas, losses, gaps, barrier)


def pairwise_barriers(
    loss_fn: Callable[[PyTree, Any], Array],
    stacked: PyTree,
    batch: Any,
    num_points: int = 11,
) -> BarrierReport:
    """Loss-barrier matrix between every pair of n stacked nodes.

    Math: ``barrier[i, j]`` is :func:`loss_barrier` of ``x_i`` (``alpha = 0``) and
    ``x_j`` (``alpha = 1``); the matrix is symmetric with a zero diagonal. Each of
    the n(n-1)/2 lines is evaluated once (pairs in sequence, alphas vmapped).

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (see :func:`loss_barrier`).
      stacked: n node trees stacked on a leading axis.
      batch: held-out data, passed unchanged.
      num_points: alphas per line, ends included.

    Returns:
      A :class:`BarrierReport` with ``losses``/``gaps`` of shape (n, n, k)
      (row i, column j is the line from node i to node j; the diagonal holds
      node i's own loss) and ``barrier`` of shape (n, n).

    Raises:
      ValueError: for ``num_points`` that is not an int >= 2, or a tree without leaves.

    References:
      As :func:`loss_barrier`.
    """
    _check_num_points(num_points, "pairwise_barriers")
    ctree.num_nodes(stacked)
    return _run(_pairwise_jit, loss_fn, stacked, batch, num_points=num_points)
