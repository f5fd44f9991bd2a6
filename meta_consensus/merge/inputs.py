"""The merge's inputs: a reader for each checkpoint (safetensors or this package's orbax), and the
check that they all hold the same keys, shapes and dtypes.

Both readers expose ``specs`` (key -> (shape, dtype)), ``read_into(key, out)`` and ``close()``;
a safetensors reader also reads column ranges (``read_range_into``). An orbax checkpoint's
consensus is read under the dotted keys :func:`consensus.io.save_safetensors` writes for the
same tree, so the two kinds mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meta_consensus.merge.errors import MergeError


def open_input(path: str | Path) -> Any:
    """A reader of one input: :class:`~consensus.io.CheckpointReader` for safetensors, else
    :class:`~meta_consensus.checkpoint.TreeReader` for an orbax checkpoint of this package.

    A folder holding ``.safetensors`` files is read as safetensors (a run folder's final
    ``consensus.safetensors`` included); a folder without any is read as an orbax step folder,
    ``checkpoints`` folder or run folder (the latest round). Anything else is a
    :class:`MergeError` naming both kinds.
    """
    from consensus import io

    p = Path(path)
    if p.is_dir() and not any(p.glob("*.safetensors")) and not any(p.glob("*.index.json")):
        # Imported here: the orbax side pulls in the run's modules (flax, optax, the node side),
        # which a merge of safetensors files does not need.
        from meta_consensus.checkpoint import TreeReader, find_step_directory

        if find_step_directory(p) is None:
            raise MergeError(
                f"{p}: not a checkpoint: no .safetensors files and no orbax checkpoint of this package "
                "(<run>/checkpoints/<round>/arrays)"
            )
        return TreeReader(p.absolute())  # orbax reads absolute paths only; the user's may be relative
    return io.CheckpointReader(p)


def check_inputs(readers: Sequence[Any], base: Any | None) -> None:
    """Every input (and the base) holds the first input's keys, with its shapes and dtypes."""
    ref = readers[0]
    for r in [*readers[1:], *([base] if base is not None else [])]:
        missing = [k for k in ref.specs if k not in r.specs]
        extra = [k for k in r.specs if k not in ref.specs]
        if missing or extra:
            parts = ([f"lacks {missing[:5]}"] if missing else []) + (
                [f"has extra {extra[:5]}"] if extra else []
            )
            raise MergeError(f"{r.path} does not have the keys of {ref.path}: {'; '.join(parts)}")
        for k, (shape, dtype) in ref.specs.items():
            s, d = r.specs[k]
            if s != shape or d != dtype:
                raise MergeError(f"{k!r} is {d}{list(s)} in {r.path} but {dtype}{list(shape)} in {ref.path}")
