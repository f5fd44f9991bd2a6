"""Run what :func:`~meta_consensus.merge.mergekit.read_mergekit` returns: a plan, a job or a multi-merge.

A plan runs through :func:`~meta_consensus.merge.engine.merge_checkpoints`; its report then gets
the configuration's keys (``mergekit.keys_read``) and those that change nothing with why
(``mergekit.no_effect``: ``int8_mask``), so every key the file gave is on record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def run_any(
    job: Any,
    *,
    progress: bool = True,
    overwrite: bool = False,
    strict: bool = False,
    config_from: str | None = None,
    config_path: str | Path | None = None,
) -> dict[str, Any]:
    """Run a mergekit configuration as read.

    Args:
      job: A :class:`~meta_consensus.merge.plan.MergePlan`, a
        :class:`~meta_consensus.merge.mergekit_exec.MergekitJob` or a
        :class:`~meta_consensus.merge.mergekit_multi.MultiMerge`.
      progress: Show progress bars.
      overwrite: Replace an existing output folder.
      strict: A plan's NaN / Inf inputs are errors (the plan-based merge's ``strict``).
      config_from: The model folder whose config and tokenizer files the output gets.
      config_path: The YAML file, for a plan's report.

    Returns:
      The report (a multi-merge: the final stage's, with ``stages`` holding the others').

    Raises:
      MergeError: From the merge (one line).
    """
    from meta_consensus.merge.engine import merge_checkpoints
    from meta_consensus.merge.mergekit import keys_of
    from meta_consensus.merge.mergekit_exec import MergekitJob, run_job
    from meta_consensus.merge.mergekit_multi import MultiMerge, run_multi
    from meta_consensus.merge.report import write_report

    if isinstance(job, MultiMerge):
        reports = run_multi(job, progress=progress, overwrite=overwrite)
        final = dict(reports[-1])
        # the stages' folders, so the final report says what its inputs were made from
        final["stages"] = [
            {"name": name, "out": str(Path(f"{job.out}.stages") / str(name)), "method": r.get("method")}
            for (name, _), r in zip(job.stages[:-1], reports[:-1], strict=True)
        ]
        final["mergekit_multi"] = str(job.path)
        write_report(Path(job.out), final)
        return final
    if isinstance(job, MergekitJob):
        return run_job(job, progress=progress, overwrite=overwrite, config_from=config_from)
    report = merge_checkpoints(
        job, progress=progress, overwrite=overwrite, strict=strict, config_from=config_from
    )
    if config_path is not None:
        keys, no_effect = keys_of(config_path)
        report["mergekit"] = {"config": str(config_path), "keys_read": keys, "no_effect": no_effect}
        write_report(Path(job.out), report)
    return report
