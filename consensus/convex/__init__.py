"""Convex merge weights solved with cvxpy: quadratic loss model, mixture NLL, robust anchor.

Weighers return :class:`ConvexWeights` (simplex weights, objective, status,
solve time, fallback); :func:`convex_merge` wraps one as an aggregator.
"""

from consensus.convex.curvature import LossModel, empirical_fisher, softmax_gauss_newton
from consensus.convex.firstorder import accelerated_projected_gradient, frank_wolfe_gap, linear_minimizer
from consensus.convex.merge import (
    ConvexMergeState,
    SolverFailure,
    Weigher,
    anchor_weigher,
    convex_merge,
    mixture_nll_weigher,
    quadratic_weigher,
)
from consensus.convex.mixture import mixture_nll_weights
from consensus.convex.problems import (
    DEFAULT_CACHE,
    DEFAULT_SOLVER,
    CompiledProblem,
    ProblemCache,
    ProblemKey,
    project_capped_simplex,
    weight_bounds,
)
from consensus.convex.qp import ConvexWeights, solve_qp_weights
from consensus.convex.weights import (
    anchor_weights,
    quadratic_statistics,
    quadratic_weights,
    trust_region_quadratic_weights,
)

__all__ = [
    "DEFAULT_CACHE",
    "DEFAULT_SOLVER",
    "CompiledProblem",
    "ConvexMergeState",
    "ConvexWeights",
    "LossModel",
    "ProblemCache",
    "ProblemKey",
    "SolverFailure",
    "accelerated_projected_gradient",
    "Weigher",
    "anchor_weigher",
    "anchor_weights",
    "convex_merge",
    "empirical_fisher",
    "frank_wolfe_gap",
    "linear_minimizer",
    "mixture_nll_weigher",
    "mixture_nll_weights",
    "project_capped_simplex",
    "quadratic_statistics",
    "quadratic_weigher",
    "quadratic_weights",
    "softmax_gauss_newton",
    "solve_qp_weights",
    "trust_region_quadratic_weights",
    "weight_bounds",
]
