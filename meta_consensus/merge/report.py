"""The merge report (``merge_report.json`` in the output folder): the plan, and for every leaf and
every vector rule what the rule kept and how it weighed the inputs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meta_consensus.merge.plan import MergePlan, RuleChoice

REPORT_NAME = "merge_report.json"


def _rounded(values: Any) -> list[float]:
    return [round(float(v), 8) for v in np.asarray(values)]


def new_report(plan: MergePlan, readers: Sequence[Any], base: Any | None) -> dict[str, Any]:
    """The report's header (the plan as run); ``vector_rules`` and ``leaves`` fill in as the merge goes."""
    return {
        **rule_record(plan.rule),
        "overrides": [rule_record(o) for o in plan.overrides],
        "inputs": [str(p) for p in plan.inputs],
        "base": plan.base,
        # the round each orbax input was read from (a checkpoints or run folder: its latest)
        "orbax_steps": {
            str(p): str(r.step_directory)
            for p, r in zip([*plan.inputs, plan.base], [*readers, base], strict=True)
            if hasattr(r, "step_directory")
        },
        "dtype": plan.dtype,
        "seed": plan.seed,
        "plugins": list(plan.plugins),
        "vector_rules": {},
        "leaves": {},
    }


def rule_record(choice: RuleChoice) -> dict[str, Any]:
    """A rule as the report records it: ``params`` holds every parameter the rule ran with, each
    given one and each default (the factory's, or the registry's declared default), and
    ``params_given`` the names given on the command line or in the config."""
    import inspect

    spec = choice.spec
    defaults = {k: p.default for k, p in spec.params.items() if p.default is not inspect.Parameter.empty}
    out = choice.as_dict()
    out["params"] = {**defaults, **spec.defaults, **dict(choice.params)}
    out["params_given"] = sorted(choice.params)
    return out


def leaf_report(choice: RuleChoice, info: Any) -> dict[str, Any]:
    """A leaf's entry: the inputs the rule selected, and its weights when its output is linear."""
    out: dict[str, Any] = {
        "method": choice.method,
        "selected": [int(i) for i in np.flatnonzero(np.asarray(info.selected))],
    }
    if info.linear:
        out["weights"] = _rounded(info.weights)
    return out


def vector_rule_report(
    inputs: Sequence[str], leaves: int, weights: np.ndarray, selected: np.ndarray, finite: np.ndarray
) -> dict[str, Any]:
    """A vector rule's entry: its whole-model weights, the inputs it selected and those it left out."""
    return {
        "leaves": leaves,
        "weights": _rounded(weights),
        "selected": [inputs[int(i)] for i in np.flatnonzero(selected)],
        "excluded_nonfinite": [inputs[int(i)] for i in np.flatnonzero(~finite)],
    }


def write_report(folder: Path, report: dict[str, Any]) -> None:
    # default=str: a parameter's default that is no JSON value (a dtype, a function) as its text
    (folder / REPORT_NAME).write_text(json.dumps(report, indent=2, default=str) + "\n")
