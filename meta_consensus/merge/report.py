"""The merge report, ``merge_report.json`` in the output folder.

It records the plan as run, and for every leaf and every vector rule what the rule kept and how
it weighed the inputs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meta_consensus.merge.plan import MergePlan, RuleChoice

REPORT_NAME = "merge_report.json"


def _rounded(values: Any) -> list[float]:
    """Values as floats rounded to 8 decimals, so the report stays readable."""
    return [round(float(v), 8) for v in np.asarray(values)]


def new_report(plan: MergePlan, readers: Sequence[Any], base: Any | None) -> dict[str, Any]:
    """Start a report: the plan as run, with ``vector_rules`` and ``leaves`` filled in as the merge goes.

    Args:
      plan: The plan being run.
      readers: The inputs' readers, in the plan's order (an orbax reader's round is recorded).
      base: The base's reader, or None.

    Returns:
      The report as a dict of JSON values (:func:`write_report` writes it).
    """
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
    """Record a rule with every parameter it ran with, so a report alone says how to rerun it.

    ``params`` holds each parameter given and each default (the factory's, or the registry's
    declared default); ``params_given`` names those given on the command line or in the config.

    Args:
      choice: The rule.

    Returns:
      :meth:`RuleChoice.as_dict <meta_consensus.merge.plan.RuleChoice.as_dict>` with the
      defaults added and ``params_given``.
    """
    import inspect

    spec = choice.spec
    defaults = {k: p.default for k, p in spec.params.items() if p.default is not inspect.Parameter.empty}
    out = choice.as_dict()
    out["params"] = {**defaults, **spec.defaults, **dict(choice.params)}
    out["params_given"] = sorted(choice.params)
    return out


def leaf_report(choice: RuleChoice, info: Any) -> dict[str, Any]:
    """A leaf's entry: the inputs the rule selected, and its weights when its output is linear.

    Args:
      choice: The leaf's rule.
      info: The rule's :class:`~consensus.base.AggregationInfo` on the leaf (``selected``,
        ``linear``, ``weights``).

    Returns:
      ``{"method", "selected": [input indices], "weights"?: [...]}``.
    """
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
    """A vector rule's entry: its whole-model weights, the inputs it selected and those it left out.

    Args:
      inputs: The plan's inputs, which the entry names.
      leaves: How many leaves the rule merged.
      weights: (n,) the rule's whole-model weights.
      selected: (n,) bool, the inputs the rule selected.
      finite: (n,) bool, False for the inputs left out for holding NaN or Inf.

    Returns:
      ``{"leaves", "weights", "selected", "excluded_nonfinite"}``.
    """
    return {
        "leaves": leaves,
        "weights": _rounded(weights),
        "selected": [inputs[int(i)] for i in np.flatnonzero(selected)],
        "excluded_nonfinite": [inputs[int(i)] for i in np.flatnonzero(~finite)],
    }


def write_report(folder: Path, report: dict[str, Any]) -> None:
    """Write ``report`` as :data:`REPORT_NAME` in ``folder``.

    Args:
      folder: The output folder (the merge's temporary folder, renamed at the end).
      report: The report; a value that is no JSON value is written as its text.
    """
    # default=str: a parameter's default that is no JSON value (a dtype, a function) as its text
    (folder / REPORT_NAME).write_text(json.dumps(report, indent=2, default=str) + "\n")
