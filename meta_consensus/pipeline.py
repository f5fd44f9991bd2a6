"""The coordinator's merge: Byzantine vote -> convex weights -> (optional) DP step, as one Aggregator.

The merge of a round is built from the config as one
:class:`~consensus.base.Aggregator` (``update(stacked, state, params, *, mask,
batch) -> (consensus, state)``):

1. **vote**: any rule of :mod:`consensus.aggregators` (after optional
   pre-aggregators) on the nodes that answered with a valid candidate. With
   ``vote.groups = G`` the vote is hierarchical: the rule runs inside each of
   G contiguous node groups (for example the nodes of one host), then
   ``vote.top_rule`` votes over the G group results. The vote's
   ``info.selected`` is the set of *accepted* nodes.
2. **weights**: ``objective = "vote"`` keeps the vote's output; any other
   objective re-weighs the accepted nodes on the capped simplex (uniform,
   quadratic model of the held-out loss, mixture NLL of their held-out
   predictions, or closest to the vote's output) and merges them in one pass.
   A cap below ``1 / accepted`` would make the problem infeasible; the cap is
   raised to ``1 / accepted`` and the round's info says so.
3. **DP** (``dp.enabled``): the whole pipeline is wrapped by
   :func:`consensus.dp.privatize`: node updates are clipped to C around the
   last consensus before the vote, the pipeline's merged update is clipped to
   C again (a projection that leaves convex combinations of clipped updates
   unchanged), and Gaussian noise of std ``z * 2C`` is added. **Sensitivity
   assumption**: the merged update always lies in the C-ball, so adding,
   removing or replacing one node moves it by at most 2C, whatever the vote
   and the weights do with the data (they are data-dependent, so no smaller
   bound holds). The one exception is plain DP-FedAvg (vote "mean", objective
   "vote" or "uniform", no groups, no pre-aggregators), which uses
   :func:`consensus.dp.dp_fedavg` and its sensitivity C / n.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from consensus import registry, tree
from consensus.aggregators import process
from consensus.base import AggregationInfo, Aggregator, empty_info, get_info
from consensus.convex.curvature import softmax_gauss_newton
from consensus.convex.mixture import mixture_nll_weights
from consensus.convex.problems import ProblemCache
from consensus.convex.qp import ConvexWeights
from consensus.convex.weights import anchor_weights, trust_region_quadratic_weights
from consensus.dp import AdaptiveClipConfig, dp_fedavg, privatize
from consensus.mesh import to_host
from meta_consensus.config import Config, ConfigError, plain_fedavg
from strategies.tasks.base import Task

PyTree = Any


class RoundFailure(RuntimeError):
    """The round cannot produce a consensus (solver failure, ...); the previous consensus stays."""


class PipelineState(NamedTuple):
    """State of the merge pipeline (arrays only, so it checkpoints as is).

    Attributes:
      vote: the vote rule's state (one per group, then the top rule's, when hierarchical).
      info: the round's AggregationInfo: ``selected`` = accepted by the vote,
        ``weights`` = each node's weight in the consensus.
      solve_ms: convex solve time of the round (0 for "vote" / "uniform").
      cap: the weight cap used (after raising it to 1 / accepted when needed; NaN: none).
    """

    vote: Any
    info: AggregationInfo
    solve_ms: jax.Array
    cap: jax.Array


def _rule(name: str, f: int, cfg: Config) -> Aggregator:
    if name == "centered_clipping":
        return registry.make(name, f, clip_radius=cfg.vote.clip_norm)
    return registry.make(name, f)


def build_vote(cfg: Config) -> Aggregator:
    """The vote of a config (flat, or hierarchical over ``vote.groups`` groups)."""
    v, n = cfg.vote, cfg.nodes.count
    groups = v.groups if v.groups > 1 else 1
    size = n // groups
    f = (
        v.f(n)
        if groups == 1
        else (
            v.num_byzantine // groups
            if v.num_byzantine is not None
            else int(math.floor(v.fault_tolerance * size))
        )
    )
    pre = []
    for p in v.pre:
        pre.append(
            registry.make("clip", max_norm=v.clip_norm)
            if p == "clip"
            else registry.make("nnm", f)
        )
    inner = _rule(v.rule, f, cfg)
    inner = process(inner, pre=pre) if pre else inner
    if groups == 1:
        return inner
    top = _rule(v.top_rule, v.top_num_byzantine, cfg)
    return hierarchical_vote(inner, top, groups)


class HierarchicalVoteState(NamedTuple):
    """State of :func:`hierarchical_vote`: each group's rule state, the top rule's, the node-level info."""

    groups: tuple
    top: Any
    info: AggregationInfo


def hierarchical_vote(inner: Aggregator, top: Aggregator, groups: int) -> Aggregator:
    """Vote in each of ``groups`` contiguous node blocks with ``inner``, then over the results with ``top``.

    A node is accepted when its group's vote accepted it and the top vote accepted
    its group; its weight is the product of the two (exact for linear rules).
    """

    def init(params):
        return HierarchicalVoteState(
            tuple(inner.init(params) for _ in range(groups)), top.init(params), empty_info()
        )

    def update(stacked, state, params=None, *, mask=None, **extra):
        n = tree.num_nodes(stacked)
        size = n // groups
        mask = jnp.ones((n,), bool) if mask is None else jnp.asarray(mask, bool)
        results, states, infos = [], [], []
        for g in range(groups):
            rows = slice(g * size, (g + 1) * size)
            sub = jax.tree.map(lambda x, rows=rows: x[rows], stacked)
            merged, st = inner.update(sub, state.groups[g], params, mask=mask[rows], **extra)
            results.append(merged)
            states.append(st)
            infos.append(get_info(st))
        group_stack = tree.stack(results)
        group_ok = jnp.stack([jnp.any(i.selected) for i in infos])
        merged, top_state = top.update(group_stack, state.top, params, mask=group_ok, **extra)
        top_info = get_info(top_state)
        valid = jnp.concatenate([i.valid for i in infos])
        selected = jnp.concatenate([i.selected & top_info.selected[g] for g, i in enumerate(infos)])
        weights = jnp.concatenate([i.weights * top_info.weights[g] for g, i in enumerate(infos)])
        linear = bool(top_info.linear) and all(bool(i.linear) for i in infos)
        info = AggregationInfo(valid, selected, weights, linear)
        return merged, HierarchicalVoteState(tuple(states), top_state, info)

    return Aggregator(init, update, f"hierarchical({inner.name}->{top.name})", None)


@functools.lru_cache(maxsize=16)
def _true_label_probs(task: Task):
    @jax.jit
    def probs(stacked, batch):
        def one(p):
            logits = task.apply(p, batch["x"]).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits, axis=-1)
            return jnp.exp(
                jnp.take_along_axis(logp, batch["y"][..., None].astype(jnp.int32), -1)[..., 0]
            ).reshape(-1)

        return jax.vmap(one)(stacked)

    return probs


@functools.lru_cache(maxsize=16)
def _task_metrics(task: Task):
    return jax.jit(task.metrics)


class MergePipeline:
    """Builds the vote -> weights -> DP aggregator of a config (see the module docstring)."""

    def __init__(
        self, cfg: Config, task: Task, heldout: dict[str, np.ndarray], noise_multiplier: float | None
    ):
        self.cfg = cfg
        self.task = task
        k = cfg.weights.max_examples
        self.heldout = heldout if k is None else {name: v[:k] for name, v in heldout.items()}
        self.vote = build_vote(cfg)
        self.cache = ProblemCache()
        self.timing: dict[str, float] = {}
        self._probs = _true_label_probs(task)
        self._metrics = _task_metrics(task)
        self.plain_fedavg = plain_fedavg(cfg)
        if cfg.weights.objective == "quadratic" and cfg.task.name != "digits":
            raise ConfigError(
                "weights.objective = 'quadratic' needs a classification task (task.name = 'digits')"
            )
        merge = Aggregator(self._init, self._update, f"{self.vote.name}+{cfg.weights.objective}", None)
        d = cfg.dp
        if not d.enabled:
            self.aggregator = merge
        else:
            adaptive = AdaptiveClipConfig(d.target_quantile, d.adaptive_lr) if d.adaptive else None
            n = cfg.nodes.count
            if self.plain_fedavg:
                self.aggregator = dp_fedavg(d.clip_norm, noise_multiplier, adaptive=adaptive, key=0)
            else:
                merge = merge._replace(sensitivity=lambda clip, m: 2.0 * clip)
                self.aggregator = privatize(
                    merge, d.clip_norm, noise_multiplier, expected_nodes=n, adaptive=adaptive, key=0
                )

    # ---------------------------------------------------------------- the merge aggregator

    def _init(self, params: PyTree) -> PipelineState:
        return PipelineState(self.vote.init(params), empty_info(), jnp.float32(0.0), jnp.float32(jnp.nan))

    def _update(self, stacked, state: PipelineState, params=None, *, mask=None, post_clip=None, **extra):
        del extra
        t0 = time.perf_counter()
        voted, vote_state = self.vote.update(stacked, state.vote, params, mask=mask)
        vinfo = get_info(vote_state)
        accepted = np.asarray(to_host(vinfo.selected & vinfo.valid), bool)  # waits for the vote
        t1 = time.perf_counter()
        objective = self.cfg.weights.objective
        solve_ms, cap = 0.0, math.nan
        if objective == "vote":
            merged, info = voted, vinfo
        else:
            if not accepted.any():
                raise RoundFailure("the vote accepted no node")
            w, solve_ms, cap = self._weights(stacked, params, voted, accepted)
            wj = jnp.asarray(w, jnp.float32)
            merged = jax.block_until_ready(tree.weighted_sum(stacked, wj))
            info = AggregationInfo(vinfo.valid, jnp.asarray(accepted), wj, True)
        # Host-side telemetry of the last update (wall seconds), read by the coordinator's round info.
        self.timing = {"vote": t1 - t0, "weights": time.perf_counter() - t1}
        if post_clip is not None:
            merged = _clip_delta(merged, params, post_clip)
        return merged, PipelineState(vote_state, info, jnp.float32(solve_ms), jnp.float32(cap))

    def _weights(self, stacked, params, voted, accepted: np.ndarray) -> tuple[np.ndarray, float, float]:
        cfg = self.cfg.weights
        k = int(accepted.sum())
        if cfg.objective == "uniform":
            return accepted / k, 0.0, math.nan
        cap = None if cfg.max_weight is None else max(cfg.max_weight, 1.0 / k)
        # No solver warm start: a resumed run must solve exactly as an uninterrupted one.
        opts = {
            "lambda_reg": cfg.lambda_reg,
            "max_weight": cap,
            "mask": accepted,
            "cache": self.cache,
            "solver_options": {"warm_start": False},
        }
        if cfg.objective == "mixture_nll":
            probs = to_host(self._probs(stacked, self.heldout))
            # Damped Newton on the cached QP: as fast as the exponential-cone form at this size, and
            # on near-degenerate probabilities it solved rounds where the conic form failed in Clarabel.
            res = mixture_nll_weights(np.asarray(probs, np.float64), method="newton", **opts)
        elif cfg.objective == "anchor":
            res = anchor_weights(stacked, voted, **opts)
        else:  # quadratic, with the trust region on the true held-out loss
            x, y = self.heldout["x"], self.heldout["y"]
            ref = tree.weighted_sum(stacked, jnp.asarray(accepted / k, jnp.float32))

            def logits_fn(p, xi):
                return self.task.apply(p, xi[None])[0]

            model = softmax_gauss_newton(logits_fn, ref, x, y)
            res = trust_region_quadratic_weights(
                stacked,
                ref,
                model.grad,
                model.curvature,
                lambda p: float(self._metrics(p, self.heldout)["loss"]),
                loss=float(model.loss),
                **opts,
            )
        return self._check(res), 1e3 * res.solve_time, math.nan if cap is None else cap

    def _check(self, res: ConvexWeights) -> np.ndarray:
        if res.fallback and self.cfg.weights.on_solver_failure == "fail":
            cause = res.message.split("; fell back")[0]  # the library's fallback is not taken here
            raise RoundFailure(f"convex weights: solver failure ({res.status}): {cause}")
        return np.asarray(res.weights, np.float64)


@jax.jit
def _clip_delta(merged: PyTree, params: PyTree, radius: jax.Array) -> PyTree:
    """``params + clip_radius(merged - params)``: the whole-tree update projected onto the radius ball."""
    sq = sum(
        jnp.sum(jnp.square(m.astype(jnp.float32) - p.astype(jnp.float32)))
        for m, p in zip(jax.tree.leaves(merged), jax.tree.leaves(params), strict=True)
    )
    scale = jnp.minimum(1.0, radius / jnp.maximum(jnp.sqrt(sq), 1e-30))
    return jax.tree.map(
        lambda m, p: (p.astype(jnp.float32) + scale * (m.astype(jnp.float32) - p.astype(jnp.float32))).astype(
            m.dtype
        ),
        merged,
        params,
    )
