"""The merge's inputs: a reader for each checkpoint, and the check that they all agree.

An input is safetensors or this package's orbax; all must hold the same keys, shapes and dtypes
(up to tied copies and mixed float dtypes, reconciled by :func:`prepare_inputs`).

Both readers expose ``specs`` (key -> (shape, dtype)), ``read_into(key, out)`` and ``close()``;
a safetensors reader also reads column ranges (``read_range_into``). An orbax checkpoint's
consensus is read under the dotted keys :func:`consensus.io.save_safetensors` writes for the
same tree, so the two kinds mix.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meta_consensus.merge.errors import MergeError


def open_input(path: str | Path) -> Any:
    """Open one input: safetensors, or an orbax checkpoint of this package.

    A folder holding ``.safetensors`` files is read as safetensors (a run folder's final
    ``consensus.safetensors`` included); a folder without any is read as an orbax step folder,
    ``checkpoints`` folder or run folder (the latest round). Anything else is a
    :class:`MergeError` naming both kinds.

    Args:
      path: A ``.safetensors`` file, a (sharded) safetensors folder, or an orbax step, checkpoints
        or run folder.

    Returns:
      A :class:`~consensus.io.CheckpointReader` for safetensors, else a
      :class:`~meta_consensus.checkpoint.TreeReader`.

    Raises:
      MergeError: If the input is a PyTorch pickle (``.bin``, ``.pt``, ...), which is never read
        (loading one runs arbitrary code), or a folder that is neither kind.
      CheckpointError: If a safetensors input is missing or unreadable.
    """
    from consensus import io

    p = Path(path)
    _refuse_pickles(p)
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
    """Check that every input (and the base) holds the first input's keys, shapes and dtypes.

    Args:
      readers: The inputs' readers; the first is the reference.
      base: The base's reader, or None.

    Raises:
      MergeError: If a reader lacks a key or has an extra one (both listed, up to five), or a
        tensor's shape or dtype differs.
    """
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


# PyTorch's pickled weights (``torch.save``): reading them runs arbitrary code, and needs torch.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def _refuse_pickles(p: Path) -> None:
    """A ``.bin`` (or ``.pt``) checkpoint, or a folder holding only such files, named in one line."""
    pickles = (
        [q.name for q in sorted(p.iterdir()) if q.suffix in PICKLE_SUFFIXES]
        if p.is_dir() and not any(p.glob("*.safetensors"))
        else [p.name]
        if p.suffix in PICKLE_SUFFIXES
        else []
    )
    if pickles:
        raise MergeError(
            f"{p}: {', '.join(pickles[:3])} is a PyTorch pickle (.bin/.pt), which merge does not read; "
            "save it as safetensors first (model.save_pretrained(dir, safe_serialization=True))"
        )


def prepare_inputs(
    readers: Sequence[Any], base: Any | None, out_dtype: Any | None
) -> tuple[list[Any], Any | None]:
    """The readers as the merge reads them, after :func:`check_inputs`' checks.

    Two differences between inputs are reconciled instead of refused:

    * a tied weight stored in one input and left out of another (Hugging Face drops a tied
      ``lm_head.weight`` on save; other writers keep it): a key that an input holds and
      another lacks is accepted when, in the input holding it, it equals another tensor of
      that input bit for bit; an input lacking it reads that other tensor under its name. The
      output has the first input's keys (its convention); an extra tied copy in a later input
      is not read.
    * float tensors stored in different float dtypes (fp32 and bf16 fine-tunes): accepted when
      ``out_dtype`` (``--dtype``) says what the output is; they are read as float32.

    Args:
      readers: The inputs' readers; the first one's keys are the output's.
      base: The base's reader, or None.
      out_dtype: The output dtype of float tensors (``--dtype``), or None.

    Returns:
      (the inputs' readers, the base's reader or None), wrapped to read under the first input's
      keys and with the mixed float dtypes as float32.

    Raises:
      MergeError: If keys, shapes or dtypes differ in any other way (a float tensor in mixed
        dtypes without ``out_dtype`` is one: the message asks for ``--dtype``).
    """
    ref = readers[0]
    wrapped = [ref, *readers[1:], *([base] if base is not None else [])]
    tied: dict[str, str] = {}  # a key of the first input -> the tensor it is a tied copy of
    for r in wrapped[1:]:
        missing = [k for k in ref.specs if k not in r.specs and k not in tied]
        extra = [k for k in r.specs if k not in ref.specs]
        if len(missing) + len(extra) > MAX_TIED:  # another model: no search for tied copies
            check_inputs([ref, r], None)
        extra = [k for k in extra if _tied_source(r, k) is None]
        for k in list(missing):
            source = _tied_source(ref, k)
            if source is not None and source in r.specs:
                tied[k] = source
                missing.remove(k)
        if missing or extra:
            parts = ([f"lacks {missing[:5]}"] if missing else []) + (
                [f"has extra {extra[:5]}"] if extra else []
            )
            raise MergeError(f"{r.path} does not have the keys of {ref.path}: {'; '.join(parts)}")
    views = [_View(r, ref, tied) for r in wrapped]
    mixed = [k for k in ref.specs if len({v.stored_dtype(k) for v in views}) > 1]
    for k in mixed:
        kinds = {v.path: v.stored_dtype(k) for v in views}
        if out_dtype is None or not all(_is_float(d) for d in kinds.values()):
            where = ", ".join(f"{d} in {p}" for p, d in list(kinds.items())[:3])
            hint = " (give --dtype for the output, e.g. --dtype bfloat16)" if out_dtype is None else ""
            raise MergeError(f"{k!r} has different dtypes: {where}{hint}")
    for v in views:
        v.cast(mixed)
    check_inputs(views[: len(readers)], views[-1] if base is not None else None)
    return views[: len(readers)], (views[-1] if base is not None else None)


# At most this many keys that one input holds and another lacks are looked at as tied copies.
MAX_TIED = 8


def _is_float(dtype: Any) -> bool:
    """Whether ``dtype`` is a float dtype, bfloat16 included."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


def _tied_source(reader: Any, key: str) -> str | None:
    """The key of another tensor of ``reader`` that ``key`` equals bit for bit (a tied copy), if any."""
    shape, dtype = reader.specs[key]
    candidates = [k for k, (s, d) in reader.specs.items() if k != key and s == shape and d == dtype]
    if not candidates:
        return None
    mine = np.empty(shape, dtype)
    reader.read_into(key, mine)
    other = np.empty(shape, dtype)
    for k in candidates:
        reader.read_into(k, other)
        if mine.tobytes() == other.tobytes():
            return k
    return None


class _View:
    """An input read under the first input's keys: tied copies from their source, mixed dtypes as float32."""

    def __init__(self, reader: Any, ref: Any, tied: dict[str, str]):
        self.reader = reader
        self.path = reader.path
        self.source = {
            k: (k if k in reader.specs else tied[k]) for k in ref.specs if k in reader.specs or k in tied
        }
        self.specs = {k: reader.specs[s] for k, s in self.source.items()}
        self.casts: set[str] = set()
        if hasattr(reader, "read_range_into"):  # safetensors: column ranges (streaming.can_chunk)
            self.read_range_into = self._read_range_into

    def __getattr__(self, name: str) -> Any:  # mapping, step_directory, ...: the reader's
        return getattr(self.__dict__["reader"], name)

    def stored_dtype(self, key: str) -> Any:
        return self.reader.specs[self.source[key]][1]

    def cast(self, keys: Sequence[str]) -> None:
        self.casts = set(keys)
        for k in keys:
            self.specs[k] = (self.specs[k][0], np.dtype(np.float32))

    def read_into(self, key: str, out: np.ndarray) -> None:
        source = self.source[key]
        if key not in self.casts:
            self.reader.read_into(source, out)
            return
        shape, dtype = self.reader.specs[source]
        raw = np.empty(shape, dtype)
        self.reader.read_into(source, raw)
        out[...] = raw.astype(out.dtype)

    def _read_range_into(self, key: str, start: int, out: np.ndarray) -> None:
        source = self.source[key]
        if key not in self.casts:
            self.reader.read_range_into(source, start, out)
            return
        raw = np.empty(out.shape, self.reader.specs[source][1])
        self.reader.read_range_into(source, start, raw)
        out[...] = raw.astype(out.dtype)

    def close(self) -> None:
        self.reader.close()


# ----------------------------------------------------------------------------- model files

# What a Hugging Face model folder holds besides its weights, copied from the first input (or
# ``--config-from``) so that ``from_pretrained(out)`` finds the architecture and the tokenizer.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)


def model_folder(plan_inputs: Sequence[str], config_from: str | None) -> Path | None:
    """The folder whose model files (config, tokenizer) the output gets, if any.

    Args:
      plan_inputs: The plan's inputs.
      config_from: ``--config-from``, or None.

    Returns:
      ``config_from``; else the first input when it is a folder holding a ``config.json`` (a
      Hugging Face model folder); else None.

    Raises:
      MergeError: If ``config_from`` holds no ``config.json``.
    """
    if config_from is not None:
        folder = Path(config_from)
        if not (folder / "config.json").is_file():
            raise MergeError(f"--config-from {folder}: no config.json there (a Hugging Face model folder)")
        return folder
    first = Path(plan_inputs[0])
    return first if first.is_dir() and (first / "config.json").is_file() else None


def copy_model_files(folder: Path, out: Path, float_dtype: Any | None) -> list[str]:
    """Copy the :data:`MODEL_FILES` that ``folder`` holds into ``out``, so ``from_pretrained(out)`` works.

    ``config.json`` gets the output's float dtype as ``torch_dtype`` (and ``dtype``, its newer
    name, when present), so the config describes the weights written.

    Args:
      folder: A Hugging Face model folder (:func:`model_folder`).
      out: The output folder.
      float_dtype: The output's float dtype, or None to copy ``config.json`` as it is.

    Returns:
      The names of the files copied.

    Raises:
      MergeError: If ``config.json`` is not JSON.
    """
    copied = []
    for name in MODEL_FILES:
        src = folder / name
        if not src.is_file():
            continue
        if name == "config.json" and float_dtype is not None:
            try:
                config = json.loads(src.read_text())
            except ValueError as e:
                raise MergeError(f"{src}: not JSON ({e})") from e
            dtype_name = np.dtype(float_dtype).name
            config["torch_dtype"] = dtype_name
            if "dtype" in config:
                config["dtype"] = dtype_name
            (out / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(src, out / name)
        copied.append(name)
    return copied
