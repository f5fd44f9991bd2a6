"""Incremental model soups: a node's candidate for the round as a weighted merge of its checkpoints.

Ingredients (parameter trees of one model: checkpoints of one run, fine-tunes
from one init with different hyperparameters or data) arrive one at a time,
in memory or as orbax checkpoints on disk, and the soup keeps one merged tree:

* ``uniform``: the running mean. Memory is O(1) in the number of ingredients:
  the soup holds the current mean and a count, never the ingredients.
* ``weighted``: the running weighted mean, with weights given per ingredient
  or derived from held-out scores (a softmax with a temperature).
* ``greedy`` (Wortsman et al. 2022): an ingredient is kept only if the held-out
  metric of the soup with it is not worse than without it. In *batch* mode
  (:func:`greedy_soup`, all ingredients known) they are first sorted by their
  own held-out score, best first, so the soup starts from the best ingredient
  and can only improve on it. In *incremental* mode (:class:`IncrementalSoup`
  with ``mode="greedy"``) each arriving ingredient is tried against the current
  soup.

The metric is a parameter: an ``evaluate(params)`` callable returning a number
or a dict of metrics (a task's ``metrics`` on held-out data), a metric name
(``accuracy``: higher is better; ``loss``, ``perplexity``, ``error``: lower is
better) and/or an explicit ``higher_is_better`` flag. A greedy soup also takes
a tuple of names, compared in order (``("accuracy", "loss")``: accuracy, and
the loss breaks its ties, which on a small held-out split are the rule, not
the exception). Evaluation runs on the
host between jitted calls; the merging itself is jitted leaf by leaf.

State is immutable (:class:`SoupState`); ``soup.add(state, ingredient)`` returns a
new state whose ``params`` is the node's candidate, with every decision recorded
in ``events`` (kept / rejected ingredients and the metric trajectory).

References:
  Wortsman et al. 2022, "Model soups: averaging weights of multiple fine-tuned models
  improves accuracy without increasing inference time", ICML (greedy soup: Recipe 1).
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from consensus import tree as ctree

PyTree = Any
Ingredient = PyTree | str | os.PathLike
Evaluate = Callable[[PyTree], Any]
# A metric name, or names compared in order (greedy soups); a score is one float or one per name.
Metric = str | tuple[str, ...] | None
Score = float | tuple[float, ...]

# Metric name -> higher is better. Anything else needs an explicit flag.
METRIC_DIRECTIONS: dict[str, bool] = {
    "accuracy": True,
    "acc": True,
    "top1": True,
    "f1": True,
    "loss": False,
    "nll": False,
    "cross_entropy": False,
    "perplexity": False,
    "ppl": False,
    "error": False,
}


# ----------------------------------------------------------------------------- orbax ingredients


def save_ingredient(path: str | os.PathLike, params: PyTree, *, force: bool = False) -> pathlib.Path:
    """Save one ingredient as an orbax checkpoint directory (no pickle).

    Args:
      path: the checkpoint directory to create (made absolute, as orbax needs).
      params: the params tree.
      force: overwrite an existing checkpoint at ``path``.

    Returns:
      The absolute path written. In a multi-process run every process must call
      this (orbax writes collectively).

    Raises:
      FileExistsError: when ``path`` exists and ``force`` is False.

    Example (writes a checkpoint directory)::

        save_ingredient(tmp / "step_100", params)
    """
    import orbax.checkpoint as ocp

    path = pathlib.Path(path).absolute()
    if path.exists() and not force:
        raise FileExistsError(f"save_ingredient: {path} exists; pass force=True to overwrite it")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, params, force=force)
        ckptr.wait_until_finished()
    return path


def _abstract(template: PyTree) -> PyTree:
    def leaf(x: Any) -> jax.ShapeDtypeStruct:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        sharding = x.sharding if isinstance(x, jax.Array) else None
        return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=sharding)

    return jax.tree.map(leaf, template)


def load_ingredient(path: str | os.PathLike, template: PyTree) -> PyTree:
    """Restore an ingredient saved by :func:`save_ingredient` against an abstract target.

    Args:
      path: the checkpoint directory.
      template: a tree with the expected structure, shapes and dtypes (arrays or
        ``jax.ShapeDtypeStruct``; arrays' shardings are kept, so a sharded
        template restores sharded arrays without gathering them).

    Returns:
      The restored tree, with the template's structure.

    Raises:
      FileNotFoundError: when there is no checkpoint at ``path``.
      ValueError: when it cannot be restored against the template (naming the file and cause).
    """
    import orbax.checkpoint as ocp

    path = pathlib.Path(path).absolute()
    if not path.exists():
        raise FileNotFoundError(f"load_ingredient: no checkpoint at {path}")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(path, _abstract(template))
    except Exception as e:  # orbax raises several types; name the file and the cause in one error.
        raise ValueError(f"load_ingredient: could not restore {path} against the template: {e}") from e


def _is_path(x: Any) -> bool:
    return isinstance(x, str | os.PathLike)


def _resolve(ingredient: Ingredient, template: PyTree | None, fn: str) -> PyTree:
    if not _is_path(ingredient):
        return ingredient
    if template is None:
        raise ValueError(
            f"{fn}: ingredient {os.fspath(ingredient)!r} is a checkpoint path; pass template=... "
            "(a params tree or abstract tree) to restore it against"
        )
    return load_ingredient(ingredient, template)


# ----------------------------------------------------------------------------- metric


def metric_direction(metric: Metric, higher_is_better: Any) -> Any:
    """Resolve whether a larger metric value is better, from a flag or a known metric name.

    For a tuple of names, a tuple of directions (``higher_is_better`` then a tuple of flags
    or None).

    Args:
      metric: a metric name (``METRIC_DIRECTIONS`` knows the usual ones), a tuple of names, or
        None.
      higher_is_better: the direction (a bool, a tuple of flags or None for a tuple), or None
        to take it from the name.

    Returns:
      True when larger is better (a tuple of them for a tuple of names).

    Raises:
      ValueError: for an unknown name without a flag, no name and no flag, or a tuple of names
        that is empty or has a different number of flags.
    """
    if isinstance(metric, tuple):
        flags = (None,) * len(metric) if higher_is_better is None else tuple(higher_is_better)
        if not metric or len(flags) != len(metric):
            raise ValueError(f"metric {metric!r}: need names and as many higher_is_better flags")
        return tuple(metric_direction(m, h) for m, h in zip(metric, flags, strict=True))
    if higher_is_better is not None:
        return bool(higher_is_better)
    if metric is None:
        raise ValueError(
            f"pass higher_is_better=True/False or a known metric name ({sorted(METRIC_DIRECTIONS)})"
        )
    key = metric.lower()
    if key not in METRIC_DIRECTIONS:
        raise ValueError(
            f"unknown metric {metric!r}: pass higher_is_better=True/False, "
            f"or one of {sorted(METRIC_DIRECTIONS)}"
        )
    return METRIC_DIRECTIONS[key]


def _score(evaluate: Evaluate, params: PyTree, metric: Metric) -> Any:
    return _read_score(evaluate(params), metric)


def _read_score(out: Any, metric: Metric) -> Any:
    """A score from what ``evaluate`` returns (or a given score): a float, or a tuple per name."""
    if isinstance(metric, tuple):
        if isinstance(out, tuple) and len(out) == len(metric):
            return tuple(float(v) for v in out)
        if not isinstance(out, Mapping) or any(m not in out for m in metric):
            got = sorted(out) if isinstance(out, Mapping) else type(out).__name__
            raise ValueError(f"metric {metric!r} needs evaluate to return a dict of them, got {got}")
        return tuple(float(np.asarray(out[m])) for m in metric)
    if isinstance(out, Mapping):
        if metric is None or metric not in out:
            raise ValueError(f"evaluate returned metrics {sorted(out)}; pass metric=<one of them>")
        out = out[metric]
    try:
        return float(np.asarray(out))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"evaluate must return a scalar or a dict of scalars, got {type(out).__name__}"
        ) from e


def _goodness(score: Any, higher: Any) -> Any:
    # NaN scores rank below everything, so a diverged candidate is never kept.
    if isinstance(score, tuple):
        return tuple(_goodness(s, h) for s, h in zip(score, higher, strict=True))
    if math.isnan(score):
        return -math.inf
    return score if higher else -score


# ----------------------------------------------------------------------------- merging


@jax.jit
def _mix(soup: PyTree, x: PyTree, r: jax.Array) -> PyTree:
    """``soup + r (x - soup)`` leaf by leaf: the running (weighted) mean update, in float32 or float64."""

    def leaf(s: jax.Array, v: jax.Array) -> jax.Array:
        cd = jnp.float64 if s.dtype == jnp.float64 else jnp.float32
        s_ = s.astype(cd)
        return (s_ + r.astype(cd) * (v.astype(cd) - s_)).astype(s.dtype)

    return jax.tree.map(leaf, soup, x)


def _is_finite(params: PyTree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(params))


def _check_floating(params: PyTree, fn: str) -> None:
    for path, x in zip(ctree.leaf_paths(params), jax.tree_util.tree_leaves(params), strict=True):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise TypeError(
                f"{fn}: leaf {path} has dtype {jnp.result_type(x)}; soups average floating leaves only"
            )


def uniform_soup(ingredients: Sequence[PyTree]) -> PyTree:
    """Uniform soup of in-memory ingredients: ``mean_i x_i`` (one stacked weighted-sum pass).

    Args:
      ingredients: k params trees of one structure.

    Returns:
      The mean tree, in the ingredients' dtypes.

    Raises:
      ValueError: for no ingredient.
      TypeError: for a leaf that is not floating-point.
    """
    if len(ingredients) == 0:
        raise ValueError("uniform_soup: no ingredients")
    k = len(ingredients)
    return weighted_soup(ingredients, np.full((k,), 1.0 / k))


def weighted_soup(ingredients: Sequence[PyTree], weights: Sequence[float] | np.ndarray) -> PyTree:
    """Weighted soup of in-memory ingredients: ``sum_i w_i x_i / sum_i w_i``.

    Args:
      ingredients: k params trees of one structure.
      weights: k weights >= 0 with a positive sum (normalized here).

    Returns:
      The weighted mean tree, in the ingredients' dtypes.

    Raises:
      ValueError: for no ingredient, or weights of the wrong length, negative, non-finite or
        all zero.
      TypeError: for a leaf that is not floating-point.
    """
    w = np.asarray(weights, np.float64)
    if w.shape != (len(ingredients),):
        raise ValueError(f"weighted_soup: {len(ingredients)} ingredients but weights of shape {w.shape}")
    if len(ingredients) == 0:
        raise ValueError("weighted_soup: no ingredients")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weighted_soup: weights must be finite, >= 0 and not all 0, got {w.tolist()}")
    _check_floating(ingredients[0], "weighted_soup")
    stacked = ctree.stack(ingredients)
    return ctree.weighted_sum(stacked, jnp.asarray(w / w.sum(), jnp.float32))


def score_weights(scores: Sequence[float], *, higher_is_better: bool, temperature: float = 1.0) -> np.ndarray:
    """Softmax weights from held-out scores: ``w_i ∝ exp(±score_i / temperature)`` (float64).

    A NaN score gets weight 0.

    Args:
      scores: the ingredients' held-out scores.
      higher_is_better: the sign: + when a larger score is better.
      temperature: the softmax temperature (> 0).

    Returns:
      Weights summing to 1.

    Raises:
      ValueError: for ``temperature <= 0``.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    s = np.asarray(scores, np.float64) * (1.0 if higher_is_better else -1.0) / temperature
    s = np.where(np.isnan(s), -np.inf, s)
    e = np.exp(s - np.max(s))
    return e / e.sum()


# ----------------------------------------------------------------------------- incremental soup


class SoupEvent(NamedTuple):
    """One ingredient's arrival and what the soup did with it.

    Attributes:
      index: arrival index of the ingredient (0-based; for :func:`greedy_soup`, its
        index in the input list).
      name: the ingredient's name (its path for checkpoints, else ``str(index)``).
      accepted: whether it is in the soup after this event.
      reason: ``first``, ``added``, ``not worse``, ``worse``, ``restart``,
        ``non-finite`` or ``zero weight``.
      log_weight: log of the (unnormalized) weight it entered with: 0 for uniform
        and greedy, ``log w`` or ``±score / temperature`` for weighted, -inf if
        rejected. Kept in log space so score-based weights never overflow.
      ingredient_score: its own held-out score, when computed or given.
      candidate_score: the held-out score of the soup with it (greedy), when computed.
      soup_score: the soup's score after this event (None without ``evaluate``).
    """

    index: int  # type: ignore[assignment]  # a NamedTuple field named like tuple.index
    name: str
    accepted: bool
    reason: str
    log_weight: float
    ingredient_score: Score | None
    candidate_score: Score | None
    soup_score: Score | None

    @property
    def weight(self) -> float:
        """The unnormalized weight, ``exp(log_weight)`` (may overflow to inf for extreme scores)."""
        try:
            return math.exp(self.log_weight)
        except OverflowError:
            return math.inf


class SoupState(NamedTuple):
    """Immutable state of an incremental soup.

    Attributes:
      params: the soup (the node's candidate for the round), None before the first ingredient.
      count: number of ingredients in the soup.
      log_total_weight: log of the sum of the weights in the soup (-inf when empty).
      score: the soup's held-out score (None without ``evaluate``).
      events: one :class:`SoupEvent` per ingredient seen, in arrival order.
    """

    params: PyTree | None
    count: int  # type: ignore[assignment]  # a NamedTuple field named like tuple.count
    log_total_weight: float
    score: Score | None
    events: tuple[SoupEvent, ...]

    @property
    def kept(self) -> tuple[int, ...]:
        """Indices of the ingredients in the soup now (a greedy restart drops the earlier ones)."""
        out: list[int] = []
        for e in self.events:
            if e.reason == "restart":
                out = [e.index]
            elif e.accepted:
                out.append(e.index)
        return tuple(out)

    @property
    def rejected(self) -> tuple[int, ...]:
        """Indices of the ingredients turned away on arrival."""
        return tuple(e.index for e in self.events if not e.accepted)

    @property
    def trajectory(self) -> tuple[Score | None, ...]:
        """The soup's score after each event (monotone for a greedy soup)."""
        return tuple(e.soup_score for e in self.events)


@dataclass(frozen=True)
class IncrementalSoup:
    """A soup that takes ingredients one at a time (optax-style: config here, state in :class:`SoupState`).

    Math:
      - uniform: ``s_k = s_{k-1} + (x_k - s_{k-1}) / k`` (running mean).
      - weighted: ``s_k = s_{k-1} + (w_k / W_k)(x_k - s_{k-1})``, ``W_k = sum_{j<=k} w_j``,
        with ``w_k`` given, or ``w_k = exp(±score_k / temperature)`` (kept in log
        space, so any scores work).
      - greedy: candidate ``c = s + (x - s)/(m + 1)`` over the m kept ingredients;
        keep x iff ``metric(c)`` is not worse than ``metric(s)`` (ties keep, as in
        Wortsman et al.). With ``restart=True`` an ingredient that is better on its
        own than both the soup and the candidate replaces the soup, so the soup
        is never worse than any single ingredient seen so far; ``restart=False``
        is the plain greedy rule.

    Args:
      mode: ``"uniform"``, ``"weighted"`` or ``"greedy"``.
      evaluate: ``evaluate(params) -> scalar | dict`` on the held-out (selection)
        set. Required for greedy and for score-based weights; optional otherwise
        (then the trajectory is recorded).
      metric: the metric's name: selects the value when ``evaluate`` returns a
        dict, and gives its direction when ``higher_is_better`` is None.
      higher_is_better: the metric's direction, overriding the name.
      weight_by: for ``weighted``: ``"given"`` (``add(..., weight=w)``) or ``"score"``.
      temperature: softmax temperature for ``weight_by="score"`` (> 0).
      restart: for ``greedy`` incremental mode, see above.
      template: tree (or abstract tree) to restore checkpoint-path ingredients
        against; the current soup serves when it is None.

    Raises:
      ValueError: for an unknown ``mode`` or ``weight_by``, greedy without ``evaluate``, a
        tuple of metrics outside greedy, a metric without a known direction, or
        ``temperature <= 0``.

    Example:
      >>> def accuracy(p): return 1.0 - float(jnp.abs(p["w"] - 1.0).sum())  # a held-out score
      >>> checkpoints = [{"w": jnp.array([1.2])}, {"w": jnp.array([5.0])}, {"w": jnp.array([0.8])}]
      >>> soup = IncrementalSoup("greedy", evaluate=accuracy, metric="accuracy")
      >>> state = soup.init()
      >>> for ckpt in checkpoints:                    # trees or orbax checkpoint paths
      ...     state = soup.add(state, ckpt)
      >>> candidate, kept = state.params, state.kept
      >>> kept, candidate["w"]  # the second ingredient would make the soup worse
      ((0, 2), Array([1.], dtype=float32))

    References:
      Wortsman et al. 2022, "Model soups", ICML.
    """

    mode: Literal["uniform", "weighted", "greedy"] = "uniform"
    evaluate: Evaluate | None = None
    metric: Metric = None
    higher_is_better: Any = None
    weight_by: Literal["given", "score"] = "given"
    temperature: float = 1.0
    restart: bool = True
    template: PyTree | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("uniform", "weighted", "greedy"):
            raise ValueError(
                f"IncrementalSoup: mode must be 'uniform', 'weighted' or 'greedy', got {self.mode!r}"
            )
        if self.weight_by not in ("given", "score"):
            raise ValueError(f"IncrementalSoup: weight_by must be 'given' or 'score', got {self.weight_by!r}")
        # Greedy must score every candidate soup; score weights may instead come as add(..., score=...).
        if self.mode == "greedy" and self.evaluate is None:
            raise ValueError("IncrementalSoup: greedy mode needs evaluate=... (the held-out metric)")
        if isinstance(self.metric, tuple) and self.mode != "greedy":
            raise ValueError("IncrementalSoup: a tuple of metrics (compared in order) is for greedy soups")
        if self.evaluate is not None or self.mode == "greedy" or self.weight_by == "score":
            metric_direction(self.metric, self.higher_is_better)  # fail now, not at the first add
        if not self.temperature > 0:
            raise ValueError(f"IncrementalSoup: temperature must be > 0, got {self.temperature}")

    @property
    def _higher(self) -> Any:
        return metric_direction(self.metric, self.higher_is_better)

    def init(self) -> SoupState:
        """An empty soup.

        Returns:
          A :class:`SoupState` without ingredients.
        """
        return SoupState(params=None, count=0, log_total_weight=-math.inf, score=None, events=())

    def _eval(self, params: PyTree) -> float:
        assert self.evaluate is not None
        return _score(self.evaluate, params, self.metric)

    def add(
        self,
        state: SoupState,
        ingredient: Ingredient,
        *,
        weight: float | None = None,
        score: Any = None,
        name: str | None = None,
    ) -> SoupState:
        """Offer one ingredient to the soup; returns the new state.

        Args:
          state: the current :class:`SoupState`.
          ingredient: a params tree, or the path of an orbax checkpoint of one.
          weight: its weight (``weighted`` with ``weight_by="given"`` only), >= 0.
          score: its own held-out score if already known (saves one evaluation).
          name: a label for the report (default: the path, or the arrival index).

        Returns:
          The new :class:`SoupState`; ``state`` itself is unchanged. Non-finite
          ingredients are rejected (reason ``non-finite``), never merged.

        Raises:
          consensus.tree.TreeMismatchError: when the ingredient does not match the soup.
          TypeError: for a first ingredient with a leaf that is not floating-point.
          ValueError: for a ``weight`` outside ``weighted``/``"given"``, a missing or invalid
            weight there, a missing score with ``weight_by="score"`` and no ``evaluate``, or
            an ingredient path that cannot be restored.
        """
        index = len(state.events)
        label = name if name is not None else (os.fspath(ingredient) if _is_path(ingredient) else str(index))
        template = self.template if self.template is not None else state.params
        # jnp.asarray: numpy ingredients become immutable device arrays before the soup keeps them.
        x = jax.tree.map(jnp.asarray, _resolve(ingredient, template, "IncrementalSoup.add"))
        if state.params is None:
            _check_floating(x, "IncrementalSoup.add")
        else:
            try:
                ctree.check_same_structure([state.params, x])
            except ctree.TreeMismatchError as e:
                raise ctree.TreeMismatchError(
                    f"IncrementalSoup.add: ingredient {label!r} does not match the soup: {e}"
                ) from None
        if weight is not None and not (self.mode == "weighted" and self.weight_by == "given"):
            raise ValueError(
                "IncrementalSoup.add: weight= is only used by mode='weighted', weight_by='given'"
            )

        def event(
            accepted: bool,
            reason: str,
            log_w: float,
            ing: Score | None,
            cand: Score | None,
            soup: Score | None,
        ):
            return SoupEvent(index, label, accepted, reason, log_w, ing, cand, soup)

        if not _is_finite(x):
            rejected = event(False, "non-finite", -math.inf, score, None, state.score)
            return state._replace(events=(*state.events, rejected))
        if self.mode == "greedy":
            return self._add_greedy(state, x, score, event)
        return self._add_mean(state, x, weight, score, event)

    def _add_mean(
        self, state: SoupState, x: PyTree, weight: float | None, score: float | None, event
    ) -> SoupState:
        if self.mode == "uniform":
            log_w = 0.0
        elif self.weight_by == "given":
            if weight is None:
                raise ValueError("IncrementalSoup.add: mode='weighted', weight_by='given' needs weight=...")
            if not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"IncrementalSoup.add: weight must be finite and >= 0, got {weight}")
            log_w = math.log(weight) if weight > 0 else -math.inf
        else:
            if score is None:
                if self.evaluate is None:
                    raise ValueError("IncrementalSoup.add: weight_by='score' needs score=... or evaluate")
                score = self._eval(x)
            g = _goodness(score, self._higher)
            log_w = g / self.temperature
        if log_w == -math.inf:
            rejected = event(False, "zero weight", -math.inf, score, None, state.score)
            return state._replace(events=(*state.events, rejected))
        log_total = float(np.logaddexp(state.log_total_weight, log_w))
        # r = w_k / W_k, in log space so score-based weights never overflow.
        r = 1.0 if state.params is None else math.exp(log_w - log_total)
        params = x if state.params is None else _mix(state.params, x, jnp.asarray(r, jnp.float32))
        soup_score = self._eval(params) if self.evaluate is not None else None
        reason = "first" if state.params is None else "added"
        return SoupState(
            params=params,
            count=state.count + 1,
            log_total_weight=log_total,
            score=soup_score,
            events=(*state.events, event(True, reason, log_w, score, None, soup_score)),
        )

    def _add_greedy(self, state: SoupState, x: PyTree, score: Any, event) -> SoupState:
        higher = self._higher
        score = None if score is None else _read_score(score, self.metric)
        if state.params is None:
            s = self._eval(x) if score is None else score
            return SoupState(x, 1, 0.0, s, (*state.events, event(True, "first", 0.0, s, None, s)))
        assert state.score is not None
        cand = _mix(state.params, x, jnp.asarray(1.0 / (state.count + 1), jnp.float32))
        c = self._eval(cand)
        g_soup, g_cand = _goodness(state.score, higher), _goodness(c, higher)
        ing = score
        if self.restart and ing is None:
            ing = self._eval(x)
        g_ing = _goodness(ing, higher) if ing is not None else -math.inf
        if self.restart and g_ing > max(g_soup, g_cand):
            return SoupState(x, 1, 0.0, ing, (*state.events, event(True, "restart", 0.0, ing, c, ing)))
        if g_cand >= g_soup:
            return SoupState(
                cand,
                state.count + 1,
                math.log(state.count + 1),
                c,
                (*state.events, event(True, "not worse", 0.0, ing, c, c)),
            )
        return state._replace(events=(*state.events, event(False, "worse", -math.inf, ing, c, state.score)))


# ----------------------------------------------------------------------------- batch greedy soup


def greedy_soup(
    ingredients: Sequence[Ingredient],
    evaluate: Evaluate,
    *,
    metric: Metric = None,
    higher_is_better: Any = None,
    scores: Sequence[Any] | None = None,
    template: PyTree | None = None,
    names: Sequence[str] | None = None,
    first: int | None = None,
) -> SoupState:
    """Greedy soup with all ingredients known (Wortsman et al. 2022, Recipe 1).

    Math:
      Score every ingredient on the held-out set, sort best first (stable, so
      ties keep input order), start the soup with the best one, then add each
      next ingredient iff the uniform soup with it scores not worse than
      without it. The soup's score is therefore >= the best single ingredient's
      and never decreases. With ``first`` the soup starts from that ingredient
      instead (e.g. a run's latest checkpoint) and tries the others best first:
      its score is then >= that ingredient's.

    Args:
      ingredients: params trees or orbax checkpoint paths (paths are loaded
        once to score and once to try, so at most two trees live at a time).
      evaluate: ``evaluate(params) -> scalar | dict`` on the held-out set.
      metric: metric name (dict key and/or direction), see :func:`metric_direction`,
        or a tuple of names compared in order (later ones break ties).
      higher_is_better: the metric's direction, overriding the name.
      scores: the ingredients' own scores if already known (skips k evaluations):
        numbers, or what ``evaluate`` returns.
      template: tree to restore path ingredients against (default: the first
        in-memory ingredient, or required when all are paths).
      names: labels for the report.
      first: index of the ingredient the soup starts from (default: the best scored).

    Returns:
      A :class:`SoupState`: ``params`` is the soup, ``events`` are in the order
      the ingredients were tried, with ``index`` the position in ``ingredients``.

    Raises:
      ValueError: for no ingredient, ``scores`` or ``names`` of the wrong length, a ``first``
        that is not an ingredient index, or a metric without a known direction.

    References:
      Wortsman et al. 2022, "Model soups", ICML, Algorithm 1 (GreedySoup).
    """
    k = len(ingredients)
    if k == 0:
        raise ValueError("greedy_soup: no ingredients")
    if scores is not None and len(scores) != k:
        raise ValueError(f"greedy_soup: {k} ingredients but {len(scores)} scores")
    if names is not None and len(names) != k:
        raise ValueError(f"greedy_soup: {k} ingredients but {len(names)} names")
    higher = metric_direction(metric, higher_is_better)
    if template is None:
        template = next((x for x in ingredients if not _is_path(x)), None)
    if scores is None:
        scores = [_score(evaluate, _resolve(x, template, "greedy_soup"), metric) for x in ingredients]
    scores = [_read_score(s, metric) for s in scores]
    order = sorted(range(k), key=lambda i: _goodness(scores[i], higher), reverse=True)
    if first is not None:
        if not -k <= first < k:
            raise ValueError(f"greedy_soup: first={first} is not an ingredient index (k = {k})")
        first %= k
        order = [first, *(i for i in order if i != first)]
    soup = IncrementalSoup(
        "greedy", evaluate=evaluate, metric=metric, higher_is_better=higher, restart=False, template=template
    )
    state = soup.init()
    for i in order:
        if names is not None:
            label = names[i]
        else:
            label = os.fspath(ingredients[i]) if _is_path(ingredients[i]) else str(i)
        state = soup.add(state, ingredients[i], score=scores[i], name=label)
        last = state.events[-1]
        state = state._replace(events=(*state.events[:-1], last._replace(index=i)))
    return state
