"""mergekit-multi files: several merges in one YAML file (``---`` between them), one feeding the next.

As ``mergekit-multi`` reads them: every document but the final one has a ``name``; a later
document names an earlier merge as a ``model`` or ``base_model`` by that name. Here the named
merges are written to ``OUT.stages/NAME`` (kept, so the final merge's inputs can be inspected)
and the last document's merge to ``--out``; a name that is also a path on disk is refused
(it would be ambiguous). mergekit's ``--lazy`` reuse of finished stages is not offered:
``OUT.stages`` must not exist.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from meta_consensus.merge.errors import MergeError


@dataclasses.dataclass
class MultiMerge:
    """The stages of a mergekit-multi file, in order (the last one is written to ``out``).

    Attributes:
      path: The file.
      stages: (name, YAML document with stage names replaced by their output folders), in order.
      out: The final output folder.
      compute: ``--compute-dtype``.
      values: The command line's other values (seed, dtype, shard size).
    """

    path: Path
    stages: list[tuple[str | None, dict[str, Any]]]
    out: str
    compute: str | None
    values: dict[str, Any]

    @property
    def inputs(self) -> list[str]:
        """The stage names, for the command's summary line."""
        return [name or "final" for name, _ in self.stages]


def _replace(value: Any, names: Mapping[str, str]) -> Any:
    """A document with each ``model`` / ``base_model`` naming a stage replaced by its folder."""
    if isinstance(value, Mapping):
        return {
            k: (
                names.get(v, v) if k in ("model", "base_model") and isinstance(v, str) else _replace(v, names)
            )
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_replace(v, names) for v in value]
    return value


def multi_from_docs(
    path: Path, docs: Sequence[Any], *, compute: str | None = None, **values: Any
) -> MultiMerge:
    """Read a mergekit-multi file's documents as stages.

    Args:
      path: The file.
      docs: Its YAML documents.
      compute: ``--compute-dtype``.
      **values: The command line's values (``out`` is the final merge's folder).

    Returns:
      The :class:`MultiMerge`.

    Raises:
      MergeError: If a document is not a mapping, a stage before the last has no name, two share
        a name, a name is also a path on disk, or ``--out`` is missing.
    """
    out = values.get("out") or ""
    if not out:
        raise MergeError("no output folder: give --out DIR (the final merge's; stages go to DIR.stages/)")
    stages: list[tuple[str | None, dict[str, Any]]] = []
    folders: dict[str, str] = {}
    for i, doc in enumerate(docs):
        if not isinstance(doc, Mapping):
            raise MergeError(f"{path}: document {i + 1}: expected a mergekit configuration (a mapping)")
        name = doc.get("name")
        last = i == len(docs) - 1
        if name is None and not last:
            raise MergeError(f"{path}: document {i + 1}: name: every merge but the last needs a name")
        if name is not None:
            name = str(name)
            if name in folders:
                raise MergeError(f"{path}: document {i + 1}: name: {name!r} is used twice")
            if Path(name).exists():
                raise MergeError(
                    f"{path}: document {i + 1}: name: {name!r} is also a path on disk; rename it"
                )
        body = _replace({k: v for k, v in doc.items() if k != "name"}, folders)
        stages.append((name, body))
        if name is not None:
            folders[name] = str(Path(f"{out}.stages") / name)
    return MultiMerge(path, stages, out, compute, dict(values))


def run_multi(multi: MultiMerge, *, progress: bool = True, overwrite: bool = False) -> list[dict[str, Any]]:
    """Run the stages in order: named ones into ``OUT.stages/NAME``, the last into ``OUT``.

    Args:
      multi: The stages.
      progress: Show progress bars.
      overwrite: Replace existing outputs.

    Returns:
      The stages' reports, in order.

    Raises:
      MergeError: If ``OUT.stages`` exists (without ``overwrite``), or a stage fails (its message
        names the stage).
    """
    import yaml  # type: ignore[import-untyped]

    from meta_consensus.merge.mergekit import read_mergekit
    from meta_consensus.merge.mergekit_run import run_any

    stages_dir = Path(f"{multi.out}.stages")
    if stages_dir.exists() and not overwrite:
        raise MergeError(f"{stages_dir} exists (a mergekit-multi run's stages); choose a new --out")
    stages_dir.mkdir(parents=True, exist_ok=True)
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, body) in enumerate(multi.stages):
            out = str(stages_dir / name) if i < len(multi.stages) - 1 and name else multi.out
            if i == len(multi.stages) - 1 and name:
                out = multi.out
            doc_path = Path(tmp) / f"{name or 'final'}.yml"
            doc_path.write_text(yaml.safe_dump(body, sort_keys=False))
            try:
                job = read_mergekit(doc_path, compute=multi.compute, **{**multi.values, "out": out})
                reports.append(run_any(job, progress=progress, overwrite=overwrite, config_path=doc_path))
            except MergeError as e:
                raise MergeError(f"{multi.path}: stage {name or 'final'}: {e}") from None
    return reports
