"""Registries of specs: the one place that names the library's rules for configs, benchmarks and tests.

The library API stays plain functions (``consensus.krum(2)``); a registry is the
edge that names them. Each entry is a :class:`RuleSpec` that says, once:

* ``factory``: the public function that builds the rule;
* ``kind``: ``"coordinatewise"`` (leaf by leaf over coordinates), ``"vector"``
  (whole-tree statistics, Gram space), ``"pre"`` (a node-to-node pre-aggregator)
  or ``"merge"`` (a model-merging method over task vectors, ``params`` = the base);
* ``takes_f``: whether the factory's first argument is ``num_byzantine``;
* ``precondition``: a static function of (n, f) that returns None when the rule can
  run on n valid nodes with f Byzantine ones, else the requirement ("n > 2f + 2 = 6");
  nothing is checked by running a rule on zeros;
* ``sensitivity``: the rule's node-level DP sensitivity, in words (see ``docs/rules.md``);
* ``elementwise``: output coordinate k depends only on coordinate k of the inputs (and the
  base) and on which nodes are valid (finite over what the rule is given): the rule gives
  the same values on any slice of a leaf's coordinates that it gives on the whole leaf,
  when every slice finds the same valid nodes (``meta-consensus merge`` streams such
  rules in cache-sized column chunks);
* ``needs``: what the caller must pass besides the stacked trees (``"params"`` for a
  merge method's base, ``"key"`` for randomized rules, ``"server_update"``, ...);
* the parameters, read from the factory's signature (:attr:`RuleSpec.params`), and
  ``defaults`` for the required ones that configs and benchmarks may leave unset
  (centered clipping's radius, the clip norm).

Adding a rule is one module plus one :func:`register` call next to it (or below,
for the built-in rules) plus its docs; configs ("valid choices: ..."), the
system's pipeline builder, the benchmarks and the property-table tests all read
:data:`RULES`.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

from consensus import aggregators as agg
from consensus.aggregators.bucketing import bucket_requirement
from consensus.aggregators.filters import SMEA_MAX_SUBSETS
from consensus.base import Aggregator, PreAggregator
from consensus.specs import DEFAULT_SENSITIVITY, RULES, Registry, RegistryError, Spec, at_least

__all__ = ["RULES", "Registry", "RegistryError", "RuleSpec", "Spec", "make", "register"]
from consensus.merging import (
    dare,
    fisher_merge,
    karcher_mean,
    model_stock,
    regmean,
    slerp,
    task_arithmetic,
    ties,
)

Kind = Literal["coordinatewise", "vector", "pre", "merge"]
RuleSpec = Spec  # the rule family's specs are plain specs


def register(
    name: str,
    factory: Callable[..., Aggregator | PreAggregator],
    kind: Kind,
    *,
    takes_f: bool = False,
    precondition: Callable[[int, int], str | None] | None = None,
    sensitivity: str | None = None,
    needs: tuple[str, ...] = (),
    summary: str = "",
    defaults: Mapping[str, Any] | None = None,
    order_matters: bool = False,
    elementwise: bool = False,
    replace: bool = False,
) -> Spec:
    """Register an existing factory under ``name`` (prefer ``@RULES.declare`` beside the factory)."""
    spec = Spec(
        name=name,
        family=RULES.family,
        factory=factory,
        kind=kind,
        takes_f=takes_f,
        precondition=precondition or at_least(1),
        sensitivity=sensitivity or DEFAULT_SENSITIVITY,
        needs=frozenset(needs),
        summary=summary or (inspect.getdoc(factory) or "").split("\n", 1)[0],
        defaults=dict(defaults or {}),
        order_matters=order_matters,
        elementwise=elementwise,
        module=getattr(factory, "__module__", ""),
    )
    return RULES.register(name, spec, replace=replace)


def _need(ok: bool, text: str) -> str | None:
    return None if ok else text


def _at_least_one(n: int, f: int) -> str | None:
    return _need(n >= 1, "at least 1 valid node")


# The built-in rules. Their conventions are in each factory's docstring and docs/rules.md.
register(
    "mean",
    agg.mean,
    "coordinatewise",
    precondition=_at_least_one,
    sensitivity="C / n (uniform mean)",
    elementwise=True,
)
register(
    "weighted_mean",
    agg.weighted_mean,
    "coordinatewise",
    precondition=_at_least_one,
    sensitivity="C * max_i w_i (fixed weights)",
    elementwise=True,
    needs=("weights",),  # at construction (its parameter) or as update(..., weights=...)
)
register("median", agg.median, "coordinatewise", precondition=_at_least_one, elementwise=True)
register(
    "trimmed_mean",
    agg.trimmed_mean,
    "coordinatewise",
    takes_f=True,
    elementwise=True,
    precondition=lambda n, f: _need(n > 2 * f, f"n > 2f = {2 * f}"),
)
register(
    "krum",
    agg.krum,
    "vector",
    takes_f=True,
    precondition=lambda n, f: _need(n > 2 * f + 2, f"n > 2f + 2 = {2 * f + 2}"),
)
register(
    "multi_krum",
    agg.multi_krum,
    "vector",
    takes_f=True,
    precondition=lambda n, f: _need(n > 2 * f + 2, f"n > 2f + 2 = {2 * f + 2}"),
)
register(
    "bulyan",
    agg.bulyan,
    "vector",
    takes_f=True,
    precondition=lambda n, f: _need(n >= 4 * f + 3, f"n >= 4f + 3 = {4 * f + 3}"),
)
register("geometric_median", agg.geometric_median, "vector", precondition=_at_least_one)
register(
    "centered_clipping",
    agg.centered_clipping,
    "vector",
    precondition=_at_least_one,
    defaults={"clip_radius": 10.0},
)
register(
    "clip",
    agg.clip,
    "pre",
    precondition=_at_least_one,
    defaults={"max_norm": 10.0},
    sensitivity="C (each node's delta clipped to max_norm = C)",
)
register("nnm", agg.nnm, "pre", takes_f=True, precondition=lambda n, f: _need(n > 2 * f, f"n > 2f = {2 * f}"))

# Server-guided and adaptive rules (issue 17: robust when honest nodes disagree).
_honest_majority = lambda n, f: _need(n > 2 * f, f"n > 2f = {2 * f}")  # noqa: E731
register(
    "fltrust",
    agg.fltrust,
    "vector",
    precondition=_at_least_one,
    sensitivity="2 ||g|| (the output update lies in the ball of the server update's norm)",
    needs=("params", "server_update"),
)
register(
    "server_monna",
    agg.server_monna,
    "vector",
    takes_f=True,
    precondition=lambda n, f: _need(n > f, f"n > f = {f}"),
    sensitivity="C / (n - f) once the selection is fixed; 2C in general (output in the C-ball)",
    needs=("params", "server_update"),
)
register(
    "arc",
    agg.arc,
    "pre",
    takes_f=True,
    precondition=_honest_majority,
    sensitivity="not bounded by a fixed C (the clip threshold is the data's (k+1)-th largest norm)",
)
register("dnc", agg.dnc, "vector", takes_f=True, precondition=_honest_majority, needs=("key",))
register(
    "signguard",
    agg.signguard,
    "vector",
    precondition=_at_least_one,
    sensitivity="not bounded by a fixed C (deltas clipped to the median norm)",
    needs=("key",),
)
register("caf", agg.caf, "vector", takes_f=True, precondition=_honest_majority)
register(
    "smea",
    agg.smea,
    "vector",
    takes_f=True,
    precondition=lambda n, f: (
        _need(n > 2 * f, f"n > 2f = {2 * f}")
        or _need(
            math.comb(n, f) <= SMEA_MAX_SUBSETS,
            f"C(n, f) = {math.comb(n, f)} <= {SMEA_MAX_SUBSETS} subsets",
        )
    ),
)
register(
    "meamed", agg.meamed, "coordinatewise", takes_f=True, precondition=_honest_majority, elementwise=True
)
register(
    "bucketing",
    agg.bucketing,
    "vector",
    takes_f=True,
    precondition=lambda n, f: bucket_requirement(n, f, 2),
    sensitivity="the inner rule's (geometric median by default: 2C)",
    needs=("key",),
)


# Merge methods over task vectors (consensus/merging): params = the base model; not robust on
# their own (compose them with the votes); see each factory's docstring for its paper.
def _merge_nodes(minimum: int, exact: bool = False):
    def precondition(n: int, f: int) -> str | None:
        if exact:
            return _need(n == minimum, f"exactly {minimum} valid nodes")
        return _need(n >= minimum, f"at least {minimum} valid node{'s' if minimum > 1 else ''}")

    return precondition


register(
    "task_arithmetic",
    task_arithmetic,
    "merge",
    precondition=_merge_nodes(1),
    sensitivity="scale * max_i w_i * C (a weighted sum of clipped deltas)",
    needs=("params",),
    elementwise=True,
)
register(
    "ties",
    ties,
    "merge",
    precondition=_merge_nodes(1),
    sensitivity="not bounded (one node can flip every elected sign)",
    needs=("params",),
    defaults={"density": 0.2},
)
register(
    "dare",
    dare,
    "pre",
    precondition=_merge_nodes(1),
    sensitivity="that of the rule after it (DARE rescales deltas by 1/density: C / density per node)",
    needs=("params", "key"),
    defaults={"density": 0.5},
)
register(
    "model_stock",
    model_stock,
    "merge",
    precondition=_merge_nodes(2),
    sensitivity="not bounded (t depends on every node)",
    needs=("params",),
)
register(
    "slerp",
    slerp,
    "merge",
    precondition=_merge_nodes(2, exact=True),
    sensitivity="not bounded",
    defaults={"t": 0.5},
    order_matters=True,  # SLERP(t) goes from the first node towards the second
)
register("karcher_mean", karcher_mean, "merge", precondition=_merge_nodes(1), sensitivity="not bounded")
register(
    "fisher_merge",
    fisher_merge,
    "merge",
    precondition=_merge_nodes(1),
    sensitivity="not bounded (data-dependent coordinate weights)",
    needs=("params", "fisher"),
)
register(
    "regmean",
    regmean,
    "merge",
    precondition=_merge_nodes(1),
    sensitivity="not bounded (data-dependent layer weights)",
    needs=("params", "grams"),
)


def vote_rules() -> list[str]:
    """Names of the registered n -> 1 rules (everything but pre-aggregators)."""
    return RULES.names(lambda s: s.kind != "pre")


def pre_aggregators() -> list[str]:
    return RULES.names(lambda s: s.kind == "pre")


def markdown_table() -> str:
    """The registry as the markdown table of ``docs/rules.md`` (a test keeps the two equal)."""
    rows = [
        "| name | kind | takes f | precondition (n valid nodes) | DP sensitivity | needs | parameters |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, spec in RULES.items():
        # The requirement text at a symbolic-looking example: f = 1 shows the formula's shape.
        need = spec.requirement(1, 1 if spec.takes_f else 0) or "n >= 1"
        need = re.sub(r" = -?\d+(\.\d+)?$", "", need)  # "n > 2f + 2 = 4" -> "n > 2f + 2"
        params = ", ".join(
            k if p.default is inspect.Parameter.empty else f"{k}={p.default!r}"
            for k, p in spec.params.items()
        )
        needs = ", ".join(sorted(spec.needs)) or "-"
        f = "yes" if spec.takes_f else "no"
        rows.append(
            f"| `{name}` | {spec.kind} | {f} | {need} | {spec.sensitivity} | {needs} | {params or '-'} |"
        )
    return "\n".join(rows) + "\n"


def make(name: str, f: int | None = None, **params: Any) -> Aggregator | PreAggregator:
    """Build a registered rule by name (``f`` for the rules that take one); errors list valid choices."""
    return RULES[name].build(f, **params)
