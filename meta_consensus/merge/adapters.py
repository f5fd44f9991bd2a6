"""PEFT LoRA adapter folders in and out of ``meta-consensus merge``.

An input folder holding ``adapter_config.json`` and ``adapter_model.safetensors`` (what PEFT's
``save_pretrained`` writes) is read as a LoRA adapter: its ``...<module>.lora_A.weight`` (r, in)
and ``...<module>.lora_B.weight`` (out, r) become the factors ``a = A^T`` (in, r) and
``b = B^T`` (r, out) of :mod:`consensus.lora`, with the scale ``lora_alpha / r`` (``/ sqrt(r)``
with ``use_rslora``). The adapters are merged by :func:`consensus.lora.merge_adapters`, with an
adapter method (``--method fedit``, ``cat``, ``svd``, ...) or a robust rule of the registry
(``--method krum -f 1``, ``--method median``) applied in ``--space products`` (default) or
``factors`` and followed by ``--adapter-method`` (default ``stack`` after a vector rule, ``svd``
after a coordinate-wise one, ``fedit`` on the factors).

The output is an adapter folder that ``PeftModel.from_pretrained(base, out)`` loads: the first
input's ``adapter_config.json`` with ``r`` the merged rank, ``lora_alpha = r`` and
``use_rslora = false`` (scale 1, the merged scale folded into ``lora_B``, as PEFT's own
``add_weighted_adapter`` does), and the factors under PEFT's keys. With
``--merge-into-base BASE`` (a Hugging Face model folder) the output is instead a full checkpoint:
the base's tensors with the merged update added (``W + delta^T`` for a ``Linear``'s (out, in)
weight, ``W + delta`` for a ``fan_in_fan_out`` one such as GPT-2's ``Conv1D``), and the base's
config and tokenizer files. Methods with a dense residual (``exact_residual``) need that form.
Reading and writing use safetensors alone (no torch).

References:
  Hu, Shen, Wallis, Allen-Zhu, Li, Wang, Wang and Chen 2022, ICLR, "LoRA: Low-Rank Adaptation
  of Large Language Models"; Kalajdzievski 2023, "A Rank Stabilization Scaling Factor for
  Fine-Tuning with LoRA" (arXiv:2312.03732, ``use_rslora``); Hugging Face PEFT (the folder
  format, ``PeftModel.from_pretrained`` and ``add_weighted_adapter``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meta_consensus.merge.errors import MergeError
from meta_consensus.merge.plan import MergePlan, RuleChoice

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
FACTOR_KEY = re.compile(r"^(?P<target>.+)\.lora_(?P<factor>[AB])\.weight$")
UNSUPPORTED = {
    "lora_embedding_": "embedding LoRA",
    "lora_magnitude_vector": "DoRA's magnitude vector",
    "modules_to_save": "a fully trained module (modules_to_save)",
}
SPACE_DEFAULTS = {"vector": "stack", "factors": "fedit"}
DEFAULT_DENSE = "svd"


def is_adapter_folder(path: str | Path) -> bool:
    """Whether ``path`` is a PEFT adapter folder: ``adapter_config.json`` and ``adapter_model.safetensors``.

    Args:
      path: An input of the plan.

    Returns:
      True for an adapter folder, which :func:`merge_adapter_folders` merges.
    """
    p = Path(path)
    return p.is_dir() and (p / ADAPTER_CONFIG).is_file() and (p / ADAPTER_WEIGHTS).is_file()


@dataclasses.dataclass
class AdapterFolder:
    """One PEFT LoRA adapter read from its folder.

    Attributes:
      path: The folder.
      config: Its ``adapter_config.json``.
      factors: ``{module: {"a": (in, r), "b": (r, out)}}`` in the Flax layout (numpy).
      scale: ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``).
      rank: r.
      dtype: The factors' dtype as stored.
    """

    path: Path
    config: dict[str, Any]
    factors: dict[str, dict[str, np.ndarray]]
    scale: float
    rank: int
    dtype: np.dtype


def read_adapter(path: str | Path) -> AdapterFolder:
    """Read a PEFT LoRA adapter folder; anything this merge cannot represent is a one-line MergeError.

    Args:
      path: The adapter folder (:func:`is_adapter_folder`).

    Returns:
      The adapter, its factors in the Flax layout.

    Raises:
      MergeError: If the config is not a JSON object with an integer ``r`` and a number
        ``lora_alpha``, or is no plain LoRA config (another PEFT type, DoRA, per-module rank or
        alpha patterns); or the weights hold keys of an embedding LoRA, DoRA or
        ``modules_to_save``, a key that is no LoRA factor, a factor that is not 2-D or lacks its
        partner, shapes that disagree with the config's rank, or no factor at all.
      CheckpointError: If ``adapter_model.safetensors`` is not a readable safetensors file.
    """
    from consensus import io

    p = Path(path)
    try:
        config = json.loads((p / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise MergeError(f"{p / ADAPTER_CONFIG}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise MergeError(f"{p / ADAPTER_CONFIG}: expected a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise MergeError(f"{p}: a {config.get('peft_type')} adapter; only LoRA adapters are merged")
    if config.get("use_dora"):
        raise MergeError(f"{p}: a DoRA adapter (use_dora); only plain LoRA adapters are merged")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if config.get(pattern):
            raise MergeError(
                f"{p}: {pattern} gives some modules their own rank or alpha, which is not supported"
            )
    try:
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha", 8))
    except (KeyError, TypeError, ValueError):
        raise MergeError(f"{p / ADAPTER_CONFIG}: needs an integer r and a number lora_alpha") from None
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    factors: dict[str, dict[str, np.ndarray]] = {}
    dtype = None
    with io.CheckpointReader(p / ADAPTER_WEIGHTS) as reader:
        for key in reader.specs:
            for part, what in UNSUPPORTED.items():
                if part in key:
                    raise MergeError(f"{p}: {key!r} is {what}, which this merge does not support")
            m = FACTOR_KEY.match(key)
            if m is None:
                raise MergeError(f"{p}: {key!r} is no LoRA factor (…lora_A.weight / …lora_B.weight)")
            target = m["target"].removeprefix(PREFIX)
            x = reader.get(key)
            if x.ndim != 2:
                raise MergeError(
                    f"{p}: {key!r} has shape {x.shape}; only 2-D (Linear, Conv1D) LoRA factors merge"
                )
            dtype = x.dtype
            factors.setdefault(target, {})["a" if m["factor"] == "A" else "b"] = x.T.copy()
    for target, f in factors.items():
        if set(f) != {"a", "b"}:
            lacking = "lora_B" if "a" in f else "lora_A"
            raise MergeError(f"{p}: module {target!r} has no {lacking}.weight")
        if f["a"].shape[1] != rank or f["b"].shape[0] != rank:
            raise MergeError(
                f"{p}: module {target!r} has rank {f['a'].shape[1]} (lora_A) / {f['b'].shape[0]} (lora_B) "
                f"but adapter_config.json says r={rank}"
            )
    if not factors:
        raise MergeError(f"{p / ADAPTER_WEIGHTS}: no LoRA factors")
    assert dtype is not None
    return AdapterFolder(p, config, factors, scale, rank, np.dtype(dtype))


def check_agree(adapters: Sequence[AdapterFolder]) -> None:
    """Check that every adapter adapts the first one's modules with its rank and shapes.

    Args:
      adapters: The adapters, the first the reference.

    Raises:
      MergeError: If an adapter lacks a module or has an extra one, or its rank or a factor's
        shape differs (the message names both folders).
    """
    ref = adapters[0]
    for ad in adapters[1:]:
        missing = sorted(set(ref.factors) - set(ad.factors))
        extra = sorted(set(ad.factors) - set(ref.factors))
        if missing or extra:
            what = (
                f"lacks target(s) {missing[:5]}"
                if missing
                else f"has target(s) {extra[:5]} that {ref.path} lacks"
            )
            raise MergeError(f"{ad.path} {what}; every adapter must adapt the same modules")
        if ad.rank != ref.rank:
            raise MergeError(
                f"rank mismatch: {ref.path} has r={ref.rank}, {ad.path} r={ad.rank}; the merge needs one rank"
            )
        for t, f in ref.factors.items():
            g = ad.factors[t]
            if f["a"].shape != g["a"].shape or f["b"].shape != g["b"].shape:
                raise MergeError(
                    f"module {t!r}: {ref.path} has lora_A {f['a'].shape[::-1]}, lora_B {f['b'].shape[::-1]}; "
                    f"{ad.path} lora_A {g['a'].shape[::-1]}, lora_B {g['b'].shape[::-1]}"
                )


# ----------------------------------------------------------------------------- the merge


@dataclasses.dataclass(frozen=True)
class AdapterPlan:
    """What ``--method`` means for adapters: an adapter method, or a robust rule then an adapter method.

    Attributes:
      method: The adapter method (a name of :data:`consensus.lora.ADAPTER_METHODS`).
      options: The adapter method's parameters (``--set``); empty after a robust rule.
      weights: Per-adapter weights (``--weights``), or None.
      rule: The robust rule of the registry, or None for an adapter method alone.
      space: Where the rule works: ``"products"`` (the updates B A) or ``"factors"``.
    """

    method: str  # the adapter method (consensus.lora.ADAPTER_METHODS)
    options: dict[str, Any]
    weights: list[float] | None
    rule: RuleChoice | None = None
    space: str = "products"


def adapter_plan(plan: MergePlan, n: int) -> AdapterPlan:
    """Read the plan's method as an adapter method or a robust rule, checked before anything is written.

    Args:
      plan: The plan.
      n: The number of adapters.

    Returns:
      The adapter plan; after a robust rule, the adapter method is ``--adapter-method``, else
      ``fedit`` on the factors, ``stack`` after a vector rule and ``svd`` after another.

    Raises:
      MergeError: If the plan has overrides, an unknown ``--space``, weights not one per adapter
        or together with a robust rule, ``--adapter-method`` after an adapter method, an adapter
        method without a required parameter, an unknown method or adapter method, or a rule that
        cannot merge n adapters (:func:`~meta_consensus.merge.plan.check_rule`).
      RegistryError: If a method is given a parameter it does not take.
      ByzantineToleranceError: If n adapters are too few for the rule's f.
    """
    from consensus import lora
    from consensus.registry import RULES
    from meta_consensus.merge.plan import check_rule, merge_methods

    choice = plan.rule
    params = dict(choice.params)
    weights = params.pop("weights", None)
    if plan.overrides:
        raise MergeError(
            "--override applies to checkpoints; an adapter merge uses one method for every module"
        )
    if plan.space not in lora.SPACES:
        raise MergeError(f"--space {plan.space!r}: expected one of {list(lora.SPACES)}")
    if weights is not None and len(weights) != n:
        raise MergeError(
            f"{len(weights)} weights for {n} adapters; give one weight per input (--weights W1,W2,...)"
        )
    if choice.method in lora.ADAPTER_METHODS:
        if plan.adapter_method is not None:
            raise MergeError(
                f"--adapter-method follows a robust rule; {choice.method} is itself an adapter method"
            )
        spec = lora.ADAPTER_METHODS[choice.method]
        spec.check_params(params)
        missing = [k for k in spec.required if k not in params]
        if missing:
            raise MergeError(f"{choice.method} needs parameter(s) {missing} (--set method.NAME=VALUE)")
        return AdapterPlan(choice.method, params, weights)
    if choice.method not in RULES:
        raise MergeError(
            f"unknown method {choice.method!r} for adapters; adapter methods: {list(lora.ADAPTER_METHODS)}; "
            f"robust rules (with --space and --adapter-method): {merge_methods()}"
        )
    if weights is not None:
        raise MergeError(
            f"--weights and the rule {choice.method} together: the rule sets the adapters' weights"
        )
    check_rule(choice, n, True)  # the base of the products is 0: merge methods over task vectors get it
    kind = choice.spec.kind
    default = (
        SPACE_DEFAULTS["factors"] if plan.space == "factors" else SPACE_DEFAULTS.get(kind, DEFAULT_DENSE)
    )
    method = plan.adapter_method or default
    if method not in lora.ADAPTER_METHODS:
        raise MergeError(f"--adapter-method {method!r}: valid adapter methods: {list(lora.ADAPTER_METHODS)}")
    return AdapterPlan(method, {}, None, choice, plan.space)


def merge_adapter_folders(
    plan: MergePlan, *, overwrite: bool = False, config_from: str | None = None
) -> dict[str, Any]:
    """Merge PEFT adapter folders into an adapter folder (or, with ``merge_into_base``, a full checkpoint).

    Every check runs before the output folder is created; the output is written to a temporary
    folder and renamed at the end.

    Args:
      plan: The plan; its inputs are adapter folders.
      overwrite: Replace an existing output folder.
      config_from: Must be None: an adapter output keeps the first adapter's config.

    Returns:
      The report (also written as ``merge_report.json``).

    Raises:
      MergeError: If there are fewer than 2 adapters, no output or an existing one, an input
        that is no adapter folder, ``--base`` or ``--config-from``, a bad ``--dtype``, an
        adapter plan that cannot run (:func:`adapter_plan`), adapters that cannot be read or
        disagree (:func:`read_adapter`, :func:`check_agree`), a ``--merge-into-base`` folder
        without ``config.json`` or without the adapted weights (:func:`check_base`), a merge
        the library refuses (its message naming the input folders), or a dense residual
        without ``--merge-into-base``.
      RegistryError: If a method is given a parameter it does not take.
      ByzantineToleranceError: If the adapters are too few for the rule's f.
      CheckpointError: If a safetensors file is unreadable.
    """
    from consensus import io

    if len(plan.inputs) < 2:
        raise MergeError(f"{len(plan.inputs)} adapter(s): a merge needs at least 2")
    if not plan.out:
        raise MergeError("no output folder: give --out DIR")
    if Path(plan.out).exists() and not overwrite:
        raise MergeError(f"output {plan.out} exists; choose a new folder (nothing is ever overwritten)")
    others = [p for p in plan.inputs if not is_adapter_folder(p)]
    if others:
        raise MergeError(
            f"{others[0]} is not a PEFT adapter folder ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}); adapters and "
            "checkpoints cannot be merged together"
        )
    if plan.base is not None:
        raise MergeError(
            "--base is for checkpoints; to add the merged adapter to a model give --merge-into-base BASE"
        )
    if config_from is not None:
        raise MergeError(
            "--config-from is for checkpoints; an adapter output keeps the first adapter's config"
        )
    out_dtype = None
    if plan.dtype is not None:
        from meta_consensus.merge.plan import output_dtype

        out_dtype = np.dtype(output_dtype(plan.dtype))
    n = len(plan.inputs)
    what = adapter_plan(plan, n)
    base_reader = None
    if plan.merge_into_base is not None:
        base_dir = Path(plan.merge_into_base)
        if not (base_dir / "config.json").is_file():
            raise MergeError(
                f"--merge-into-base {base_dir}: no config.json there (a Hugging Face model folder)"
            )
    adapters = [read_adapter(p) for p in plan.inputs]
    check_agree(adapters)
    if plan.merge_into_base is not None:
        base_reader = io.CheckpointReader(Path(plan.merge_into_base))
    try:
        if base_reader is not None:
            check_base(base_reader, Path(plan.merge_into_base or ""), adapters[0])
        return _merge_and_write(plan, what, adapters, base_reader, out_dtype, overwrite)
    finally:
        if base_reader is not None:
            base_reader.close()


def _merge_and_write(
    plan: MergePlan,
    what: AdapterPlan,
    adapters: Sequence[AdapterFolder],
    base_reader: Any,
    out_dtype: np.dtype | None,
    overwrite: bool,
) -> dict[str, Any]:
    """The merge of the checked adapters, then the output (written to a temporary folder, renamed)."""
    import jax

    from consensus import io, lora
    from meta_consensus.merge.report import write_report

    targets = list(adapters[0].factors)
    stacked = {t: {k: np.stack([ad.factors[t][k] for ad in adapters]) for k in ("a", "b")} for t in targets}
    rule = what.rule.build() if what.rule is not None else None
    try:
        merged = lora.merge_adapters(
            what.method,
            stacked,
            scale=[ad.scale for ad in adapters],
            weights=what.weights,
            key=jax.random.key(plan.seed),
            rule=rule,
            space=what.space,
            **what.options,
        )
    except lora.AdapterError as e:
        raise MergeError(_name_nodes(str(e), plan.inputs)) from None
    if merged.base_delta is not None and plan.merge_into_base is None:
        raise MergeError(
            f"{what.method} puts a dense residual into the base model, which an adapter folder cannot hold: "
            "give --merge-into-base BASE (a Hugging Face model folder) for a full checkpoint"
        )
    report = {
        "method": plan.rule.method,
        "adapter_method": what.method,
        "rule": None if what.rule is None else what.rule.as_dict(),
        "space": what.space if rule is not None else None,
        "options": what.options,
        "inputs": [str(p) for p in plan.inputs],
        "scales": [ad.scale for ad in adapters],
        "rank_in": adapters[0].rank,
        "targets": len(targets),
        "seed": plan.seed,
        "merge_into_base": plan.merge_into_base,
        "info": merged.info,
        "leaves": {t: "adapted" for t in targets},
        # inputs a robust rule left out for holding NaN or Inf (without a rule they are an error)
        "nonfinite": {
            str(p): targets
            for i, p in enumerate(plan.inputs)
            if "valid" in merged.info and i not in merged.info["valid"]
        },
    }
    with io.atomic_directory(Path(plan.out), overwrite=overwrite) as tmp:
        if base_reader is None:
            write_adapter(tmp, adapters[0].config, merged, out_dtype or adapters[0].dtype)
        else:
            report["model_files"] = write_merged_base(
                tmp,
                base_reader,
                Path(plan.merge_into_base or ""),
                adapters[0].config,
                merged,
                plan,
                out_dtype,
            )
        write_report(tmp, report)
    return report


def _name_nodes(message: str, inputs: Sequence[str]) -> str:
    """The library names nodes by index (``node 2``, ``node(s) [0, 2]``); the command names them by folder."""

    def name(i: str) -> str:
        return str(inputs[int(i)]) if int(i) < len(inputs) else f"node {i}"

    message = re.sub(
        r"node\(s\) \[([\d, ]+)\]", lambda m: ", ".join(name(i) for i in m[1].split(", ")), message
    )
    return re.sub(r"node (\d+)", lambda m: name(m[1]), message)


# ----------------------------------------------------------------------------- writing


def write_adapter(folder: Path, config: dict[str, Any], merged: Any, dtype: np.dtype) -> None:
    """The merged adapter as a PEFT folder: ``adapter_config.json`` and ``adapter_model.safetensors``.

    ``lora_A.weight = a^T``, ``lora_B.weight = (scale b)^T`` and ``lora_alpha = r``, so PEFT's
    scaling is 1 and its update ``B A`` is the merged ``scale * (a b)^T``.

    Args:
      folder: The output folder (exists, empty).
      config: The first input's ``adapter_config.json``, written with the merged rank.
      merged: The :class:`consensus.lora.AdapterMerge` (``adapter``, ``scale``, ``info["rank"]``).
      dtype: The factors' dtype as written.
    """
    from consensus import io

    rank = int(merged.info["rank"])
    tensors = {}
    for t, f in merged.adapter.items():
        tensors[f"{PREFIX}{t}.lora_A.weight"] = np.ascontiguousarray(np.asarray(f["a"], np.float64).T).astype(
            dtype
        )
        b = merged.scale * np.asarray(f["b"], np.float64)
        tensors[f"{PREFIX}{t}.lora_B.weight"] = np.ascontiguousarray(b.T).astype(dtype)
    writer = io.ShardedWriter(folder, {k: (v.shape, v.dtype) for k, v in tensors.items()})
    try:
        for k, v in tensors.items():
            writer.write(k, v)
    finally:
        writer.abort()
    writer.close()
    (folder / io.safetensors.SINGLE_NAME).rename(folder / ADAPTER_WEIGHTS)
    out = dict(config)
    out.update(r=rank, lora_alpha=rank, use_rslora=False, rank_pattern={}, alpha_pattern={})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")


def check_base(reader: Any, base_dir: Path, adapter: AdapterFolder) -> None:
    """Check that the base holds ``<module>.weight`` for every adapted module, in the adapter's layout.

    Checked before the merge, so a wrong base costs no merge.

    Args:
      reader: The base's reader.
      base_dir: The base's folder, for messages.
      adapter: The first adapter (its ``fan_in_fan_out`` gives the layout).

    Raises:
      MergeError: If a module's weight is missing, or its shape is not the update's.
    """
    transposed = bool(adapter.config.get("fan_in_fan_out", False))
    where = {f"{t}.weight": t for t in adapter.factors}
    missing = sorted(k for k in where if k not in reader.specs)
    if missing:
        raise MergeError(
            f"--merge-into-base {base_dir}: no tensor {missing[0]!r} for the adapted module "
            f"{where[missing[0]]!r} (keys look like {reader.keys()[:3]})"
        )
    for key, t in where.items():
        shape = tuple(reader.specs[key][0])
        fan_in, fan_out = adapter.factors[t]["a"].shape[0], adapter.factors[t]["b"].shape[1]
        want = (fan_in, fan_out) if transposed else (fan_out, fan_in)
        if shape != want:
            raise MergeError(
                f"--merge-into-base {base_dir}: {key!r} has shape {shape}, the adapter's update {want} "
                f"(fan_in_fan_out={transposed})"
            )


def write_merged_base(
    folder: Path,
    reader: Any,
    base_dir: Path,
    config: dict[str, Any],
    merged: Any,
    plan: MergePlan,
    out_dtype: np.dtype | None,
) -> dict[str, Any]:
    """Write the base model's tensors with the merged update added, tensor by tensor, and its model files.

    Args:
      folder: The output folder.
      reader: The base's reader.
      base_dir: The base's folder, whose model files are copied.
      config: The first adapter's config (its ``fan_in_fan_out`` gives the layout).
      merged: The :class:`consensus.lora.AdapterMerge`.
      plan: The plan (its ``shard_size``).
      out_dtype: The output dtype of float tensors, or None to keep the base's.

    Returns:
      The report's ``model_files`` entry: ``{"from", "files"}``.
    """
    from consensus import io
    from meta_consensus.merge.inputs import copy_model_files

    transposed = bool(config.get("fan_in_fan_out", False))
    where = {f"{t}.weight": t for t in merged.adapter}
    specs = {
        k: (shape, out_dtype if (out_dtype is not None and np.issubdtype(np.dtype(dt), np.floating)) else dt)
        for k, (shape, dt) in reader.specs.items()
    }
    writer = io.ShardedWriter(
        folder, specs, shard_size=plan.shard_size, metadata={"merged_by": "meta-consensus merge"}
    )
    try:
        for key, (_, dt) in specs.items():
            w = reader.get(key)
            if key in where:
                delta = np.asarray(merged.delta(where[key]), np.float64)
                w = (np.asarray(w, np.float64) + (delta if transposed else delta.T)).astype(dt)
            writer.write(key, np.asarray(w).astype(dt, copy=False))
    finally:
        writer.abort()
    writer.close()
    float_dtypes = [dt for _, dt in specs.values() if np.issubdtype(np.dtype(dt), np.floating)]
    return {"from": str(base_dir), "files": copy_model_files(base_dir, folder, (float_dtypes or [None])[0])}
