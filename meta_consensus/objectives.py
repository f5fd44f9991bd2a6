"""Weight objectives: how the system weighs the nodes its vote accepted.

Each entry builds a :class:`~consensus.convex.merge.Weigher` (or None: keep the vote's
own output) from the ``[weights]`` section, the task and the coordinator's held-out
data, for :func:`consensus.convex.convex_merge` to run after the vote. The held-out
data is the coordinator's own, never node data.

Adding an objective is one function ``build(weights_cfg, task, heldout) -> Weigher``
declared with ``@OBJECTIVES.declare("name")`` (the docstring's first line is its
summary); ``traits={"classification": True}`` says it needs per-class logits, which
the pipeline checks against the task's ``kind``; ``traits={"reads_vote_output": True}`` says it
weighs the nodes towards the vote's output (``voted``), so a vote that keeps every node still
shapes the merge (the pipeline's report says when the weights replaced a vote's output).
``mixture_nll`` reads the probability of every held-out target; a task with a large output (the
causal LM's vocabulary) provides ``target_probs(params, batch)``, computed in chunks, and the
nodes are then evaluated one after the other. A user's module declares one the same
way and names itself as a plug-in (:mod:`consensus.plugins`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from consensus import tree
from consensus.convex.curvature import softmax_gauss_newton
from consensus.convex.merge import Weigher
from consensus.convex.mixture import mixture_nll_weights
from consensus.convex.problems import ProblemCache
from consensus.convex.qp import ConvexWeights
from consensus.convex.weights import anchor_weights, trust_region_quadratic_weights
from consensus.mesh import to_host
from consensus.specs import Registry, Spec
from strategies.tasks.base import Task

Builder = Callable[[Any, Task, Mapping[str, np.ndarray]], Weigher | None]

#: Weight objectives by name: ``spec.factory(weights_cfg, task, heldout) -> Weigher | None``.
OBJECTIVES: Registry[Spec] = Registry("weight objective")


def needs_classification(spec: Spec) -> bool:
    """Whether the objective reads per-class logits, so that it runs on classification tasks only.

    Args:
      spec: an entry of :data:`OBJECTIVES`.

    Returns:
      True when its ``classification`` trait is set.
    """
    return bool(spec.traits.get("classification", False))


# Both keep a uniform-mean vote a uniform mean, so DP-FedAvg's C / n sensitivity still holds.
@OBJECTIVES.declare("vote", traits={"keeps_uniform_mean": True})
def _vote(cfg, task, heldout) -> None:
    """The vote's own output is the consensus."""
    return None


def _options(cfg: Any, mask: np.ndarray, cache: ProblemCache) -> dict[str, Any]:
    """Solver options shared by the objectives; the cap is raised to 1 / accepted when below it."""
    k = int(mask.sum())
    cap = None if cfg.max_weight is None else max(cfg.max_weight, 1.0 / k)
    # No solver warm start: a resumed run must solve exactly as an uninterrupted one.
    return {
        "lambda_reg": cfg.lambda_reg,
        "max_weight": cap,
        "mask": mask,
        "cache": cache,
        "solver_options": {"warm_start": False},
    }


@OBJECTIVES.declare("uniform", traits={"keeps_uniform_mean": True})
def _uniform(cfg, task, heldout) -> Weigher:
    """Plain mean of the nodes the vote accepted."""

    def weigh(stacked, params, mask, **extra):
        k = int(mask.sum())
        return ConvexWeights(
            weights=mask / k, objective=0.0, status="uniform", solve_time=0.0, fallback=False,
            message="", accepted=mask.copy(), objective_name="uniform",
        )  # fmt: skip

    return weigh


@functools.lru_cache(maxsize=16)
def _metrics(task: Task):
    return jax.jit(task.metrics)


@OBJECTIVES.declare("quadratic", traits={"classification": True})
def _quadratic(cfg, task, heldout) -> Weigher:
    """Trust-region quadratic (Gauss-Newton) model of the held-out loss."""
    cache, metrics = ProblemCache(), _metrics(task)
    x, y = heldout["x"], heldout["y"]

    def logits_fn(p, xi):
        return task.apply(p, xi[None])[0]

    def weigh(stacked, params, mask, **extra):
        k = int(mask.sum())
        ref = tree.weighted_sum(stacked, jnp.asarray(mask / k, jnp.float32))
        model = softmax_gauss_newton(logits_fn, ref, x, y)
        return trust_region_quadratic_weights(
            stacked,
            ref,
            model.grad,
            model.curvature,
            lambda p: float(metrics(p, heldout)["loss"]),
            loss=float(model.loss),
            **_options(cfg, mask, cache),
        )

    return weigh


@functools.lru_cache(maxsize=16)
def _true_label_probs(task: Task):
    target_probs = getattr(task, "target_probs", None)
    if callable(target_probs):
        # A task with a large output (a language model's vocabulary times its tokens) gives the
        # probabilities itself, in chunks of rows, and the nodes go one after the other: the
        # logits of every node on the whole held-out set never exist at once.
        @jax.jit
        def chunked(stacked, batch):
            return jax.lax.map(lambda p: target_probs(p, batch), stacked)

        return chunked

    @jax.jit
    def probs(stacked, batch):
        def one(p):
            logits = task.apply(p, batch["x"]).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits, axis=-1)
            y = batch["y"][..., None].astype(jnp.int32)
            return jnp.exp(jnp.take_along_axis(logp, y, -1)[..., 0]).reshape(-1)

        return jax.vmap(one)(stacked)

    return probs


@OBJECTIVES.declare("mixture_nll")
def _mixture_nll(cfg, task, heldout) -> Weigher:
    """NLL of the mixture of the nodes' held-out predictions."""
    cache, probs_fn = ProblemCache(), _true_label_probs(task)

    def weigh(stacked, params, mask, **extra):
        probs = np.asarray(to_host(probs_fn(stacked, heldout)), np.float64)
        # Damped Newton on the cached QP: as fast as the exponential-cone form at this size, and
        # on near-degenerate probabilities it solved rounds where the conic form failed in Clarabel.
        return mixture_nll_weights(probs, method="newton", **_options(cfg, mask, cache))

    return weigh


@OBJECTIVES.declare("anchor", traits={"reads_vote_output": True})
def _anchor(cfg, task, heldout) -> Weigher:
    """The convex combination of accepted nodes closest to the vote's output."""
    cache = ProblemCache()

    def weigh(stacked, params, mask, *, voted=None, **extra):
        return anchor_weights(stacked, voted, **_options(cfg, mask, cache))

    return weigh
