"""Byzantine attacks: functions of the honest updates, keyed (ByzFL's vocabulary).

Every update attack has the signature ``attack(key, honest, num_byzantine, **kw)``:
``honest`` is a stacked tree of the h honest *updates* (deltas from the
current global params) and the result is a stacked tree of ``num_byzantine``
malicious updates. The attackers are omniscient (they see every honest
update), the standard worst case of the robust-aggregation literature.
:func:`apply_attack` swaps them into a stacked tree of node params.

Each attack is declared beside its function with ``@ATTACKS.declare(kind=...)``
(:mod:`consensus.specs`): ``kind="update"`` replaces the submitted update,
``kind="data"`` poisons the Byzantine nodes' training batches: the trainer calls
``attack(task, batch, **options)`` on every batch they draw, inside its jitted step
(label flipping; see :func:`data_attack`). Its keyword options are its parameters
after the ones the system passes itself (:data:`PASSED`); an update attack that takes
``num_nodes`` receives the node count. A user's module declares
its own attacks the same way and names itself as a plug-in (:mod:`consensus.plugins`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from consensus.specs import Registry, RegistryError, Spec
from kernels import rows as row_kernels

PyTree = Any
Attack = Callable[..., PyTree]

#: Every attack a config can name, update and data attacks alike.
ATTACKS: Registry[Spec] = Registry("attack")

#: Per kind, the parameters the caller fills in itself; the others are the attack's options.
PASSED = {"update": ("key", "honest", "num_byzantine", "num_nodes"), "data": ("task", "batch")}


def _honest_mean(honest: PyTree) -> PyTree:
    def leaf(x):
        h = x.shape[0]
        return row_kernels.weighted_sum(x, jnp.full((h,), 1.0 / h, jnp.float32))

    return jax.tree.map(leaf, honest)


def _honest_std(honest: PyTree, mean: PyTree) -> PyTree:
    """Coordinate-wise population std of the honest updates (two-pass, no cancellation)."""

    def leaf(x, mu):
        h = x.shape[0]
        sq = jnp.square(x.astype(jnp.float32) - mu[None])
        return jnp.sqrt(row_kernels.weighted_sum(sq, jnp.full((h,), 1.0 / h, jnp.float32)))

    return jax.tree.map(leaf, honest, mean)


def _repeat(tree: PyTree, f: int, like: PyTree) -> PyTree:
    return jax.tree.map(lambda t, x: jnp.broadcast_to(t, (f, *t.shape)).astype(x.dtype), tree, like)


@ATTACKS.declare(kind="update")
def sign_flip(key: jax.Array, honest: PyTree, num_byzantine: int, scale: float = 1.0) -> PyTree:
    """Every Byzantine node sends ``-scale`` times the honest mean update (Allen-Zhu et al. 2020).

    Args:
      key: jax.random key (unused: the attack is deterministic).
      honest: stacked tree of the h honest updates.
      num_byzantine: f, the number of malicious updates to return.
      scale: the factor of the reversed mean.

    Returns:
      Stacked tree of ``num_byzantine`` updates, shaped and typed like ``honest``'s rows.

    References:
      Allen-Zhu, Ebrahimian, Li and Alistarh, "Byzantine-Resilient Non-Convex Stochastic Gradient
      Descent", ICLR 2021 (arXiv 2020).
    """
    del key
    mean = _honest_mean(honest)
    return _repeat(jax.tree.map(lambda m: -scale * m, mean), num_byzantine, honest)


@ATTACKS.declare(kind="update")
def gaussian(key: jax.Array, honest: PyTree, num_byzantine: int, std: float = 1.0) -> PyTree:
    """Each Byzantine node sends an independent N(0, std^2) update, keyed per node and leaf.

    Args:
      key: jax.random key (the same key gives the same updates).
      honest: stacked tree of the h honest updates.
      num_byzantine: f, the number of malicious updates to return.
      std: the standard deviation of every coordinate.

    Returns:
      Stacked tree of ``num_byzantine`` updates, shaped and typed like ``honest``'s rows.
    """
    leaves, treedef = jax.tree_util.tree_flatten(honest)
    keys = jax.random.split(key, len(leaves))
    out = [
        (std * jax.random.normal(k, (num_byzantine, *x.shape[1:]), jnp.float32)).astype(x.dtype)
        for k, x in zip(keys, leaves, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def alie_z(num_nodes: int, num_byzantine: int) -> float:
    """z_max of "A Little Is Enough" (Baruch, Baruch and Goldberg 2019).

    s = floor(n/2 + 1) - f supporters are needed; z = Phi^{-1}((n - s) / n).

    Args:
      num_nodes: n, all nodes.
      num_byzantine: f, the Byzantine ones.

    Returns:
      z_max.

    References:
      Baruch, Baruch and Goldberg, "A Little Is Enough: Circumventing Defenses For Distributed
      Learning", NeurIPS 2019.
    """
    s = num_nodes // 2 + 1 - num_byzantine
    return float(stats.norm.ppf((num_nodes - s) / num_nodes))


@ATTACKS.declare(kind="update")
def alie(
    key: jax.Array, honest: PyTree, num_byzantine: int, z: float | None = None, num_nodes: int | None = None
) -> PyTree:
    """A Little Is Enough: every Byzantine node sends mu - z * sigma, coordinate-wise.

    mu and sigma are the honest mean and std; z defaults to :func:`alie_z` with
    n = h + f nodes. Small per-coordinate shifts that stay inside the honest
    spread, so median- and Krum-type rules accept them.

    Args:
      key: jax.random key (unused: the attack is deterministic).
      honest: stacked tree of the h honest updates.
      num_byzantine: f, the number of malicious updates to return.
      z: the shift in honest standard deviations (default: :func:`alie_z`).
      num_nodes: n, filled in by :func:`apply_attack` (default: h + f).

    Returns:
      Stacked tree of ``num_byzantine`` updates, shaped and typed like ``honest``'s rows.

    References:
      Baruch, Baruch and Goldberg, "A Little Is Enough", NeurIPS 2019.
    """
    del key
    h = jax.tree_util.tree_leaves(honest)[0].shape[0]
    if z is None:
        z = alie_z(num_nodes or h + num_byzantine, num_byzantine)
    mean = _honest_mean(honest)
    std = _honest_std(honest, mean)
    return _repeat(jax.tree.map(lambda m, s: m - z * s, mean, std), num_byzantine, honest)


@ATTACKS.declare(kind="update")
def ipm(key: jax.Array, honest: PyTree, num_byzantine: int, epsilon: float = 0.1) -> PyTree:
    """Inner-product manipulation (Xie, Koyejo and Gupta 2020): -epsilon times the honest mean.

    Args:
      key: jax.random key (unused: the attack is deterministic).
      honest: stacked tree of the h honest updates.
      num_byzantine: f, the number of malicious updates to return.
      epsilon: the factor of the reversed mean.

    Returns:
      Stacked tree of ``num_byzantine`` updates, shaped and typed like ``honest``'s rows.

    References:
      Xie, Koyejo and Gupta, "Fall of Empires: Breaking Byzantine-tolerant SGD by Inner Product
      Manipulation", UAI 2019 (PMLR 115, 2020).
    """
    del key
    mean = _honest_mean(honest)
    return _repeat(jax.tree.map(lambda m: -epsilon * m, mean), num_byzantine, honest)


@ATTACKS.declare(kind="update")
def nonfinite(key: jax.Array, honest: PyTree, num_byzantine: int, value: float = float("nan")) -> PyTree:
    """Byzantine (or crashed) nodes send NaN (or +-Inf with ``value``) everywhere.

    Args:
      key: jax.random key (unused: the attack is deterministic).
      honest: stacked tree of the h honest updates.
      num_byzantine: f, the number of malicious updates to return.
      value: the value of every coordinate.

    Returns:
      Stacked tree of ``num_byzantine`` updates, shaped and typed like ``honest``'s rows.
    """
    del key
    return jax.tree.map(lambda x: jnp.full((num_byzantine, *x.shape[1:]), value, x.dtype), honest)


@ATTACKS.declare(kind="update")
def mimic(key: jax.Array, honest: PyTree, num_byzantine: int, target: int = 0) -> PyTree:
    """Every Byzantine node copies honest node ``target`` (Karimireddy, He and Jaggi 2022).

    Over-represents one honest node: harmless for i.i.d. data, a bias under heterogeneity.

    Args:
      key: jax.random key (unused: the attack is deterministic).
      honest: stacked tree of the h honest updates.
      num_byzantine: f, the number of malicious updates to return.
      target: the index of the honest node copied, among the honest ones.

    Returns:
      Stacked tree of ``num_byzantine`` updates, shaped and typed like ``honest``'s rows.

    References:
      Karimireddy, He and Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets via
      Bucketing", ICLR 2022.
    """
    del key
    return jax.tree.map(lambda x: jnp.broadcast_to(x[target], (num_byzantine, *x.shape[1:])), honest)


def _flat(honest: PyTree) -> jax.Array:
    """(h, D) float32: the honest updates, every leaf flattened and concatenated (node side, small)."""
    leaves = jax.tree_util.tree_leaves(honest)
    h = leaves[0].shape[0]
    return jnp.concatenate([x.reshape(h, -1).astype(jnp.float32) for x in leaves], axis=1)


def _unflat(vec: jax.Array, num_byzantine: int, like: PyTree) -> PyTree:
    leaves, treedef = jax.tree_util.tree_flatten(like)
    out, start = [], 0
    for x in leaves:
        size = int(np.prod(x.shape[1:]))
        piece = vec[start : start + size].reshape(x.shape[1:])
        out.append(jnp.broadcast_to(piece, (num_byzantine, *x.shape[1:])).astype(x.dtype))
        start += size
    return jax.tree_util.tree_unflatten(treedef, out)


PERTURBATIONS = ("std", "unit", "sign")


def _perturbation(H: jax.Array, mu: jax.Array, kind: str) -> jax.Array:
    if kind == "std":  # inverse standard deviation
        return -jnp.sqrt(jnp.mean(jnp.square(H - mu[None]), axis=0))
    if kind == "unit":  # inverse unit vector of the mean
        return -mu / jnp.maximum(jnp.linalg.norm(mu), 1e-30)
    if kind == "sign":  # inverse sign of the mean
        return -jnp.sign(mu)
    raise ValueError(f"unknown perturbation {kind!r}; valid choices: {list(PERTURBATIONS)}")


def _largest_gamma(ok: Callable[[jax.Array], jax.Array], gamma_max: float, steps: int) -> jax.Array:
    """The largest gamma in [0, gamma_max] with ok(gamma), by bisection (ok holds on an interval)."""

    def body(_, carry):
        lo, hi = carry
        mid = 0.5 * (lo + hi)
        good = ok(mid)
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

    lo, _ = jax.lax.fori_loop(0, steps, body, (jnp.float32(0.0), jnp.float32(gamma_max)))
    return jnp.where(ok(jnp.float32(gamma_max)), jnp.float32(gamma_max), lo)


def _min_max_sum(honest, num_byzantine, gamma_max, perturbation, steps, use_sum):
    H = _flat(honest)
    mu = jnp.mean(H, axis=0)
    p = _perturbation(H, mu, perturbation)
    G = jnp.dot(H, H.T, precision=jax.lax.Precision.HIGHEST)
    sq = jnp.diagonal(G)
    pair = jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * G, 0.0)
    # ||mu + g p - h_i||^2 = ||mu - h_i||^2 + 2 g <mu - h_i, p> + g^2 ||p||^2, from small statistics.
    base = jnp.sum(jnp.square(H - mu[None]), axis=1)
    lin = 2.0 * ((H - mu[None]) @ -p)
    pp = jnp.sum(jnp.square(p))
    if use_sum:
        bound = jnp.max(jnp.sum(pair, axis=1))

        def ok(g):
            return jnp.sum(base + g * lin + g * g * pp) <= bound
    else:
        bound = jnp.max(jnp.sqrt(pair))

        def ok(g):
            return jnp.sqrt(jnp.max(jnp.maximum(base + g * lin + g * g * pp, 0.0))) <= bound

    gamma = _largest_gamma(ok, gamma_max, steps)
    return _unflat(mu + gamma * p, num_byzantine, honest)


@ATTACKS.declare(kind="update")
def min_max(
    key: jax.Array,
    honest: PyTree,
    num_byzantine: int,
    gamma_max: float = 50.0,
    perturbation: str = "std",
    steps: int = 40,
) -> PyTree:
    """Min-max (Shejwalkar and Houmansadr 2021, NDSS, "Manipulating the Byzantine").

    Every Byzantine node sends mu + gamma p, with mu the honest mean update, p
    the perturbation (``"std"``: -sigma coordinate-wise, the paper's strongest
    in most settings; ``"unit"``: -mu / ||mu||; ``"sign"``: -sign(mu)) and gamma
    the largest value in [0, gamma_max] whose update is no farther from any
    honest update than the honest updates are from each other:
    max_i ||m - h_i|| <= max_{i,j} ||h_i - h_j||. gamma by bisection
    (``steps`` halvings, the paper's Algorithm 1).

    Args:
      key: jax.random key (unused: the attack is deterministic).
      honest: stacked tree of the h honest updates.
      num_byzantine: f, the number of malicious updates to return.
      gamma_max: the largest gamma tried.
      perturbation: ``"std"``, ``"unit"`` or ``"sign"``.
      steps: the bisection steps.

    Returns:
      Stacked tree of ``num_byzantine`` updates, shaped and typed like ``honest``'s rows.

    Raises:
      ValueError: for an unknown ``perturbation``.

    References:
      Shejwalkar and Houmansadr, "Manipulating the Byzantine: Optimizing Model Poisoning Attacks
      and Defenses for Federated Learning", NDSS 2021.
    """
    del key
    return _min_max_sum(honest, num_byzantine, gamma_max, perturbation, steps, use_sum=False)


@ATTACKS.declare(kind="update")
def min_sum(
    key: jax.Array,
    honest: PyTree,
    num_byzantine: int,
    gamma_max: float = 50.0,
    perturbation: str = "std",
    steps: int = 40,
) -> PyTree:
    """Min-sum (Shejwalkar and Houmansadr 2021): as :func:`min_max`, with a constraint on sums.

    The constraint is on sums of squared distances:
    sum_i ||m - h_i||^2 <= max_j sum_i ||h_j - h_i||^2.

    Args:
      key: jax.random key (unused: the attack is deterministic).
      honest: stacked tree of the h honest updates.
      num_byzantine: f, the number of malicious updates to return.
      gamma_max: the largest gamma tried.
      perturbation: ``"std"``, ``"unit"`` or ``"sign"``.
      steps: the bisection steps.

    Returns:
      Stacked tree of ``num_byzantine`` updates, shaped and typed like ``honest``'s rows.

    Raises:
      ValueError: for an unknown ``perturbation``.

    References:
      Shejwalkar and Houmansadr, "Manipulating the Byzantine", NDSS 2021.
    """
    del key
    return _min_max_sum(honest, num_byzantine, gamma_max, perturbation, steps, use_sum=True)


@ATTACKS.declare(kind="update")
def fltrust_aware(key: jax.Array, honest: PyTree, num_byzantine: int, cosine: float = 0.1) -> PyTree:
    """An attack adapted to FLTrust: keep a positive trust score, spend the rest on harm.

    FLTrust weighs each update by ReLU(cos) to the server's update and rescales
    it to the server's norm. The attacker does not see the server's update and
    takes the honest mean mu as its proxy: every Byzantine node sends
    ||mu|| (cosine * mu_hat + sqrt(1 - cosine^2) * p_hat), where p_hat is the
    unit inverse-std direction (-sigma) made orthogonal to mu. Its cosine to mu
    is exactly ``cosine`` > 0 (so FLTrust trusts it) and its norm the honest
    mean's (the trusted norm, as far as the attacker can tell).

    Args:
      key: jax.random key (unused: the attack is deterministic).
      honest: stacked tree of the h honest updates.
      num_byzantine: f, the number of malicious updates to return.
      cosine: the cosine to the honest mean, in (0, 1].

    Returns:
      Stacked tree of ``num_byzantine`` updates, shaped and typed like ``honest``'s rows.

    Raises:
      ValueError: for ``cosine`` outside (0, 1].
    """
    del key
    if not 0.0 < cosine <= 1.0:
        raise ValueError(f"fltrust_aware: cosine must be in (0, 1], got {cosine}")
    H = _flat(honest)
    mu = jnp.mean(H, axis=0)
    norm = jnp.linalg.norm(mu)
    mu_hat = mu / jnp.maximum(norm, 1e-30)
    p = -jnp.sqrt(jnp.mean(jnp.square(H - mu[None]), axis=0))
    p = p - jnp.dot(p, mu_hat) * mu_hat
    p_hat = p / jnp.maximum(jnp.linalg.norm(p), 1e-30)
    bad = norm * (cosine * mu_hat + float(np.sqrt(1.0 - cosine**2)) * p_hat)
    return _unflat(bad, num_byzantine, honest)


@ATTACKS.declare(kind="data")
def label_flip(task: Any, batch: PyTree) -> PyTree:
    """Byzantine nodes train on flipped labels (a data attack).

    The trainer calls it on the Byzantine nodes' batches (see :mod:`strategies.byzantine`);
    it never replaces a submitted update. A plug-in's data attack has this signature, with
    its options as keyword parameters after ``batch``; it must be jittable and return a
    batch of the same structure, shapes and dtypes.

    Args:
      task: the task (its ``flip_labels``).
      batch: a training batch.

    Returns:
      The batch with flipped labels.
    """
    return task.flip_labels(batch)


@dataclasses.dataclass(frozen=True)
class DataAttack:
    """A data attack bound to its options: ``attack(task, batch)`` is ``fn(task, batch, **options)``.

    The trainer takes it as a static argument of its jitted step: two bindings of one function
    with equal options are equal and hash alike, so each configuration compiles once.

    Attributes:
      name: the attack's registered name.
      fn: its function, ``fn(task, batch, **options)``.
      options: the options as sorted ``(name, value)`` pairs (lists as tuples, so they hash).
    """

    name: str
    fn: Callable[..., PyTree]
    options: tuple[tuple[str, Any], ...] = ()

    def __call__(self, task: Any, batch: PyTree) -> PyTree:
        """Poison one batch: ``fn(task, batch, **options)``.

        Args:
          task: the task.
          batch: a training batch of the poisoned nodes.

        Returns:
          A batch of the same structure, shapes and dtypes.
        """
        return self.fn(task, batch, **dict(self.options))


def _frozen(value: Any) -> Any:
    """Lists (TOML arrays) as tuples, so that a data attack's options hash."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list | tuple) else value


def data_attack(name: str, options: Mapping[str, Any] | None = None) -> DataAttack:
    """The data attack ``name`` bound to ``options`` (checked against its declared options).

    Args:
      name: a data attack's name in :data:`ATTACKS`.
      options: its keyword options (default: none).

    Returns:
      The bound attack.

    Raises:
      RegistryError: for unknown names and options.
      ValueError: for an update attack or for options that do not hash (numbers, strings,
        booleans and lists of them do).
    """
    spec = ATTACKS[name]
    if spec.kind != "data":
        raise ValueError(f"attack {name!r} is an {spec.kind} attack, not a data attack")
    options = dict(options or {})
    check_options(name, options)
    items = tuple(sorted((k, _frozen(v)) for k, v in options.items()))
    try:
        hash(items)
    except TypeError:
        raise ValueError(
            f"the options of the data attack {name!r} must be numbers, strings, booleans or lists "
            f"of them, got {options}"
        ) from None
    return DataAttack(name, spec.factory, items)


def attack_options(spec: Spec) -> list[str]:
    """An attack's keyword options: its parameters less those the caller passes (:data:`PASSED`).

    Args:
      spec: an entry of :data:`ATTACKS`.

    Returns:
      The option names, in signature order.
    """
    passed = PASSED.get(spec.kind, ())
    return [k for k in spec.params if k not in passed]


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """Check that the attack ``name`` takes every one of ``options``.

    Args:
      name: an attack's name in :data:`ATTACKS`.
      options: keyword options.

    Raises:
      RegistryError: naming the options that ``name`` does not take, and the valid ones (also
        for an unknown name).
    """
    spec = ATTACKS[name]
    unknown = sorted(set(options) - set(attack_options(spec)))
    if unknown and not spec.takes_any_option:
        raise RegistryError(
            f"{unknown} are not options of the {name!r} attack; valid options: {attack_options(spec)}"
        )


def get_attack(name: str) -> Attack:
    """The function of the update attack ``name``.

    Args:
      name: an update attack's name in :data:`ATTACKS`.

    Returns:
      The attack function.

    Raises:
      RegistryError: for an unknown name.
      ValueError: for a data attack.
    """
    spec = ATTACKS[name]
    if spec.kind != "update":
        raise ValueError(
            f"attack {name!r} is a {spec.kind} attack: it poisons training, not the submitted update"
        )
    return spec.factory


def _takes_num_nodes(attack: str | Attack, fn: Attack) -> bool:
    params = ATTACKS[attack].params if isinstance(attack, str) else inspect.signature(fn).parameters
    return "num_nodes" in params


def apply_attack(
    attack: str | Attack,
    key: jax.Array,
    stacked: PyTree,
    byzantine_mask: np.ndarray,
    params: PyTree | None = None,
    **kwargs: Any,
) -> PyTree:
    """Replace the Byzantine rows of a stacked tree of node params by attack outputs.

    Args:
      attack: a name from :data:`ATTACKS` or an attack function.
      key: jax.random key (the same key gives the same attack).
      stacked: stacked node params, n rows.
      byzantine_mask: concrete (n,) bool: which nodes are Byzantine.
      params: current global params; attacks act on updates x_i - params
        (on the raw rows when None).
      **kwargs: forwarded to the attack (``num_nodes`` is filled in for attacks that take it).

    Returns:
      stacked tree with the Byzantine rows replaced by ``params + attack(...)``.

    Raises:
      ValueError: when every node is Byzantine (attacks are functions of honest updates), or
        for a data attack's name.
    """
    fn = get_attack(attack) if isinstance(attack, str) else attack
    mask = np.asarray(byzantine_mask, bool)
    n = mask.shape[0]
    byz = np.flatnonzero(mask)
    hon = np.flatnonzero(~mask)
    if len(byz) == 0:
        return stacked
    if len(hon) == 0:
        raise ValueError("apply_attack: every node is Byzantine; attacks need at least one honest node")
    if _takes_num_nodes(attack, fn):
        kwargs.setdefault("num_nodes", n)
    ref = params

    def deltas(x, p):
        return x[hon] if p is None else x[hon] - p[None]

    honest = (
        jax.tree.map(deltas, stacked, ref) if ref is not None else jax.tree.map(lambda x: x[hon], stacked)
    )
    bad = fn(key, honest, len(byz), **kwargs)

    def put(x, b, p):
        rows = b if p is None else (b.astype(jnp.float32) + p[None].astype(jnp.float32)).astype(x.dtype)
        return jnp.asarray(x).at[byz].set(rows.astype(x.dtype))

    if ref is None:
        return jax.tree.map(lambda x, b: put(x, b, None), stacked, bad)
    return jax.tree.map(put, stacked, bad, ref)
