"""A finished run's consensus back to Hugging Face: a model folder, and a PEFT adapter for LoRA runs.

``meta-consensus export RUN`` reads a finished run's ``consensus.safetensors`` and ``task.json``
(which runs of a Hugging Face model, the ``causal_lm`` task, write: the model folder the task
started from, and a LoRA run's settings) and writes:

* ``RUN/hf/``: the consensus as a model folder that ``AutoModelForCausalLM.from_pretrained``
  loads (:func:`strategies.models.save`: ``config.json`` and the tokenizer files of the source
  folder, safetensors with ``"format": "pt"``, float32 recorded as ``torch_dtype``). In a LoRA
  run it is the base with the consensus adapter merged in, ``W + (alpha / r) a b``, in float64
  and cast once.
* ``RUN/adapter/`` (LoRA runs): the consensus adapter as a PEFT folder for the source model
  (``adapter_config.json``, ``adapter_model.safetensors``): ``lora_A.weight = a^T`` and
  ``lora_B.weight = b^T`` with PEFT's ``lora_alpha = alpha``, ``r = rank``, so PEFT's scaling
  ``alpha / r`` is the run's. Written only when the run's base is still the source model's
  weights: an adapter method that moves the base (``exact_residual``, ``svd``) leaves a base that
  no folder holds, and then only ``hf/`` is exported (the note says so).

Nothing is replaced: an existing ``hf/`` or ``adapter/`` is a user error unless another
``--out`` folder is given, and each folder is written under a temporary name and renamed into
place.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

#: The adapter folder's file names (PEFT's).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: PEFT's prefix of a causal LM's adapted module names.
PEFT_PREFIX = "base_model.model."


class ExportError(ValueError):
    """A run that cannot be exported as asked (a user error: one line, exit 2)."""


@dataclasses.dataclass(frozen=True)
class Exported:
    """What an export wrote.

    Attributes:
      model: the Hugging Face model folder.
      adapter: the PEFT adapter folder, or None (not a LoRA run, or a moved base).
      notes: one line per thing a user should know (why no adapter was written).
    """

    model: Path
    adapter: Path | None
    notes: tuple[str, ...] = ()


def read_record(run_dir: Path) -> dict[str, Any]:
    """The run's ``task.json``: the model folder the task started from, and a LoRA run's settings.

    Args:
      run_dir: the run folder.

    Returns:
      The record.

    Raises:
      ExportError: when the folder is not a finished run of a Hugging Face model.
    """
    from meta_consensus.run import CONSENSUS_FILE, TASK_FILE

    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run folder")
    path = run_dir / TASK_FILE
    if not path.is_file():
        raise ExportError(
            f"{run_dir}: no {TASK_FILE}: only runs of a Hugging Face model (task causal_lm) export to a "
            "Hugging Face folder"
        )
    if not (run_dir / CONSENSUS_FILE).is_file():
        raise ExportError(
            f"{run_dir}: no {CONSENSUS_FILE}: the run has not finished (continue it with --resume first)"
        )
    try:
        record = json.loads(path.read_text())
    except ValueError as e:
        raise ExportError(f"{path}: not JSON ({e})") from None
    folder = record.get("folder") or record.get("model_folder")
    if not folder:
        raise ExportError(f"{path}: names no model folder")
    if not Path(folder).is_dir():
        raise ExportError(f"{path}: the run's model folder {folder} is gone (export reads its config.json)")
    return record


def _consensus(run_dir: Path) -> dict[str, np.ndarray]:
    from consensus import io
    from meta_consensus.run import CONSENSUS_FILE

    with io.CheckpointReader(run_dir / CONSENSUS_FILE) as reader:
        return {k: np.asarray(reader.get(k)) for k in list(reader.specs)}


def _frozen(run_dir: Path) -> dict[str, np.ndarray] | None:
    """The frozen part (``base.*`` and FFA's ``a.*``) of the run's last checkpoint, flat; None without one."""
    from meta_consensus.checkpoint import TreeReader, find_step_directory

    if find_step_directory(run_dir) is None:
        return None
    try:
        with TreeReader(run_dir, tree="frozen") as reader:
            return {k: np.asarray(reader.get(k)) for k in list(reader.specs)}
    except ValueError:
        return None


def adapter_factors(
    flat: Mapping[str, np.ndarray], frozen: Mapping[str, np.ndarray] | None
) -> dict[str, dict[str, np.ndarray]]:
    """``{target path: {"a", "b"}}`` from a LoRA consensus (and FFA-LoRA's shared ``a`` in the frozen part).

    Args:
      flat: the consensus's dotted keys (``<path>.a``, ``<path>.b``).
      frozen: the frozen part's dotted keys (``a.<path>.a`` under FFA-LoRA), or None.

    Returns:
      The factors of every target.

    Raises:
      ExportError: when a target has no ``a`` in either tree.
    """
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, value in flat.items():
        path, _, part = key.rpartition(".")
        out.setdefault(path, {})[part] = value
    for path, factors in out.items():
        if "a" not in factors:
            shared = None if frozen is None else frozen.get(f"a.{path}.a")
            if shared is None:
                raise ExportError(f"the consensus adapter has no 'a' factor for {path} (nor a shared one)")
            factors["a"] = shared
    return out


def _base_params(folder: Path, frozen: Mapping[str, np.ndarray] | None) -> tuple[dict[str, Any], bool]:
    """The run's base as a nested dict, and whether it is still the source folder's weights."""
    from consensus import io
    from strategies import models

    _, source = models.load(folder, dtype=None)
    source_flat = {k: np.asarray(v) for k, v in io.flatten(source).items()}
    if frozen is None:
        return io.unflatten(source_flat), True
    base = {k[len("base.") :]: v for k, v in frozen.items() if k.startswith("base.")}
    if set(base) != set(source_flat):
        return io.unflatten(source_flat), True
    same = all(
        np.array_equal(base[k].astype(np.float32), source_flat[k].astype(np.float32)) for k in source_flat
    )
    return io.unflatten(base), same


def _set(tree: dict[str, Any], path: str, value: np.ndarray) -> None:
    parts = path.split("/")
    node = tree
    for p in parts[:-1]:
        node = node[p]
    node[parts[-1]] = value


def _get(tree: dict[str, Any], path: str) -> np.ndarray:
    node: Any = tree
    for p in path.split("/"):
        node = node[p]
    return np.asarray(node)


def write_peft_adapter(
    folder: Path,
    factors: Mapping[str, Mapping[str, np.ndarray]],
    lora: Mapping[str, Any],
    base_folder: Path,
) -> None:
    """A PEFT adapter folder of ``factors`` for the model in ``base_folder`` (written into ``folder``).

    Args:
      folder: the (new, empty) output folder.
      factors: ``{target path: {"a" (in, r), "b" (r, out)}}``.
      lora: the run's LoRA settings (``rank``, ``alpha``, ``dropout``).
      base_folder: the model the adapter applies to (``base_model_name_or_path``).

    Raises:
      ExportError: for a target that is not a Linear kernel PEFT adapts (``<module>/kernel``).
    """
    from consensus import io
    from strategies import models

    tensors: dict[str, np.ndarray] = {}
    modules: set[str] = set()
    fan_in_fan_out = False
    for path, f in factors.items():
        if not path.endswith("/kernel"):
            raise ExportError(f"LoRA target {path} is not a Linear kernel; PEFT cannot adapt it")
        module = models.hf_module(path)
        modules.add(module.rsplit(".", 1)[-1])
        # GPT-2's Conv1D kernels are stored (in, out): PEFT then sets fan_in_fan_out and keeps the
        # factors' own layout (lora_A (r, in), lora_B (out, r)) all the same.
        fan_in_fan_out = fan_in_fan_out or not models.transposes(path)
        a = np.ascontiguousarray(np.asarray(f["a"], np.float32).T)
        b = np.ascontiguousarray(np.asarray(f["b"], np.float32).T)
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b
    # PEFT's names hold dots: written flat, key by key, not as a tree.
    writer = io.ShardedWriter(folder, {k: (v.shape, v.dtype) for k, v in tensors.items()}, shard_size=None)
    try:
        for k, v in tensors.items():
            writer.write(k, v)
    finally:
        writer.abort()
    writer.close()
    (folder / io.safetensors.SINGLE_NAME).rename(folder / ADAPTER_WEIGHTS)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(Path(base_folder).resolve()),
        "r": int(lora["rank"]),
        "lora_alpha": float(lora["alpha"]),
        "lora_dropout": float(lora.get("dropout", 0.0)),
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "use_rslora": False,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": None,
    }
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export_run(run_dir: str | Path, *, out: str | Path | None = None) -> Exported:
    """Export a finished run's consensus as a Hugging Face folder (and a PEFT adapter for LoRA runs).

    Args:
      run_dir: the run folder (``runs/NAME``).
      out: the parent folder of ``hf/`` and ``adapter/`` (default ``run_dir``).

    Returns:
      What was written.

    Raises:
      ExportError: for a folder that is not a finished run of a Hugging Face model, or an
        output folder that exists already (nothing is replaced).
    """
    from consensus import io
    from strategies import models

    run_dir = Path(run_dir)
    record = read_record(run_dir)
    folder = Path(record.get("folder") or record["model_folder"])
    parent = Path(out) if out is not None else run_dir
    lora = record.get("lora")
    model_dir, adapter_dir = parent / "hf", parent / "adapter"
    for target in (model_dir, adapter_dir) if lora else (model_dir,):
        if target.exists():
            raise ExportError(
                f"{target} exists: an export never replaces a folder (move it away, or give --out DIR)"
            )
    flat = _consensus(run_dir)
    notes: list[str] = []
    try:
        if not lora:
            models.save(model_dir, io.unflatten(flat), like=folder)
            return Exported(model_dir, None)
        frozen = _frozen(run_dir)
        factors = adapter_factors(flat, frozen)
        base, unchanged = _base_params(folder, frozen)
        scale = float(lora["alpha"]) / float(lora["rank"])
        for path, f in factors.items():
            w = _get(base, path)
            delta = scale * (np.asarray(f["a"], np.float64) @ np.asarray(f["b"], np.float64))
            _set(base, path, (w.astype(np.float64) + delta.reshape(w.shape)).astype(w.dtype))
        models.save(model_dir, base, like=folder)
        if not unchanged:
            notes.append(
                f"no adapter/: the run's adapter method ({lora.get('adapter_method')}) moved the base away "
                f"from {folder}, so the consensus is exported merged into its base only (hf/)"
            )
            return Exported(model_dir, None, tuple(notes))
        with io.atomic_directory(adapter_dir) as tmp:
            write_peft_adapter(tmp, factors, lora, folder)
        return Exported(model_dir, adapter_dir, tuple(notes))
    except models.ModelError as e:
        raise ExportError(str(e)) from None
