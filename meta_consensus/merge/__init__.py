"""``meta-consensus merge``: merge checkpoints made anywhere with any registered rule, streaming leaf by leaf.

Any rule of :data:`consensus.registry.RULES` that maps n inputs to one merges safetensors
checkpoints and this package's orbax checkpoints, mixed, with per-key overrides; memory stays
a few leaves, never n models. docs/merging.md describes the design; the modules, by job:

* :mod:`~meta_consensus.merge.cli`: the subcommand's arguments and the plan they give;
* :mod:`~meta_consensus.merge.plan`: the plan (TOML file, overrides) and its checks;
* :mod:`~meta_consensus.merge.inputs`: a reader for each input, and their agreement;
* :mod:`~meta_consensus.merge.engine`: :func:`merge_checkpoints`, the passes over the pieces;
* :mod:`~meta_consensus.merge.compute`: the rules on one piece (compiled updates, Gram programs);
* :mod:`~meta_consensus.merge.streaming`: buffers, column chunks, workers and write-behind;
* :mod:`~meta_consensus.merge.report`: ``merge_report.json``;
* :mod:`~meta_consensus.merge.adapters`: PEFT LoRA adapter folders in and out (``consensus.lora``);
* :mod:`~meta_consensus.merge.errors`: :class:`MergeError` and the user-error types.

jax and the library are imported in the functions that use them: building the CLI parser
(``meta-consensus --help``, ``run``, ``report``) must not pay for importing jax.
"""

from __future__ import annotations

from meta_consensus.merge.cli import add_parser, merge_cmd, plan_from_args
from meta_consensus.merge.engine import merge_checkpoints
from meta_consensus.merge.errors import MergeError, user_errors
from meta_consensus.merge.inputs import check_inputs, open_input
from meta_consensus.merge.plan import (
    MERGE_KINDS,
    MergePlan,
    RuleChoice,
    assign_rules,
    check_plan,
    check_rule,
    parse_override,
    parse_sets,
    parse_value,
    plan_from_toml,
)
from meta_consensus.merge.report import REPORT_NAME

__all__ = [
    "MERGE_KINDS",
    "REPORT_NAME",
    "MergeError",
    "MergePlan",
    "RuleChoice",
    "add_parser",
    "assign_rules",
    "check_inputs",
    "check_plan",
    "check_rule",
    "merge_checkpoints",
    "merge_cmd",
    "open_input",
    "parse_override",
    "parse_sets",
    "parse_value",
    "plan_from_args",
    "plan_from_toml",
    "user_errors",
]
