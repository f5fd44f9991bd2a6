"""mergekit's YAML configuration as a merge (``meta-consensus merge --mergekit-config merge.yml``).

:func:`read_mergekit` routes a file: what the plan-based merge does the same way runs as a
:class:`~meta_consensus.merge.plan.MergePlan` (:func:`plan_from_mergekit`); everything else
mergekit 0.1.5 reads (``slices:`` and passthrough, gradients over layers, parameters that differ
per model, breadcrumbs, DELLA, SCE, NuSLERP, Multi-SLERP, NearSwap, RAM, Arcee Fusion,
``--compute-dtype config``) runs tensor by tensor with mergekit's formulas
(:mod:`meta_consensus.merge.mergekit_exec`); a file of several YAML documents (mergekit-multi)
runs them in order (:mod:`meta_consensus.merge.mergekit_multi`).

The plan-based reader takes the methods both packages have: ``linear``, ``task_arithmetic``,
``ties``, ``dare_ties``, ``dare_linear``, ``slerp``, ``model_stock`` and ``karcher``, with
``models`` (``model`` paths: safetensors files or folders), ``base_model``, per-model ``weight``
and ``density``, the method's ``parameters`` (``normalize``, ``lambda``, ``rescale``, ``t``,
``int8_mask``, ``max_iter``, ``tol``, ``filter_wise: false``), ``dtype`` / ``out_dtype``, and
per-tensor settings as mergekit writes them: a list of ``{filter: NAME, value: V}`` where
the first entry whose filter is a substring of the tensor's name (or has no filter, or
``"*"``) gives the value. Keys whose settings differ get their own rule (an override whose
pattern lists them). mergekit's conventions, as in its source: ``linear`` normalizes by default,
the task-vector methods skip the base model when it is listed among the models, ``ties``
normalizes and the others do not, a missing ``density`` is 1, and ``rescale: true`` of the
DARE methods keeps each tensor's L1 norm (``rescale="l1"``).

References:
  Goddard, Siriwardhana, Ehghaghi, Meyers, Karpukhin, Benedict, McQuade and Solawetz 2024,
  EMNLP Industry Track, "Arcee's MergeKit: A Toolkit for Merging Large Language Models";
  github.com/arcee-ai/mergekit.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meta_consensus.merge.errors import MergeError
from meta_consensus.merge.plan import MergePlan, RuleChoice, parse_shard_size

# mergekit's method -> (our rule, its method parameters with mergekit's defaults, per-model ones).
METHODS: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "linear": ("linear", {"normalize": True}, ("weight",)),
    "task_arithmetic": (
        "task_arithmetic",
        {"normalize": False, "lambda": 1.0, "int8_mask": False},
        ("weight",),
    ),
    "ties": (
        "ties",
        {"normalize": True, "lambda": 1.0, "int8_mask": False, "rescale": False},
        ("weight", "density"),
    ),
    "dare_ties": (
        "dare_ties",
        {"normalize": False, "lambda": 1.0, "int8_mask": False, "rescale": True},
        ("weight", "density"),
    ),
    "dare_linear": (
        "dare_linear",
        {"normalize": False, "lambda": 1.0, "int8_mask": False, "rescale": True},
        ("weight", "density"),
    ),
    "slerp": ("slerp", {"t": None}, ()),
    "model_stock": ("model_stock", {"filter_wise": False}, ()),
    "karcher": ("karcher_mean", {"max_iter": 10, "tol": 1e-5}, ()),
}
TOP_KEYS = ("merge_method", "models", "base_model", "parameters", "dtype", "out_dtype")
REFUSED_TOP = {
    "slices": "layer slices run tensor by tensor (read_mergekit)",
    "modules": "modules are not supported (give models:)",
    "tokenizer_source": "tokenizers are not merged here (the output holds the merged tensors)",
    "tokenizer": "tokenizers are not merged here (the output holds the merged tensors)",
    "chat_template": "chat templates are not written here",
}


def _fail(path: Path, key: str, why: str) -> MergeError:
    """A one-line error naming the file and the configuration key at fault."""
    return MergeError(f"{path}: {key}: {why}")


def _setting(path: Path, key: str, setting: Any, tensor: str | None) -> Any:
    """Evaluate a setting for one tensor name as mergekit's ``evaluate_setting`` does (None: no tensor)."""
    if setting is None or isinstance(setting, (bool, int, float, str)):
        return setting
    if isinstance(setting, Mapping):  # a single ConditionalParameter
        setting = [setting]
    if isinstance(setting, list) and setting and all(isinstance(e, (int, float)) for e in setting):
        raise _fail(path, key, "a gradient over layers (a list of numbers) is not supported; give one value")
    if not isinstance(setting, list) or not all(isinstance(e, Mapping) and "value" in e for e in setting):
        raise _fail(path, key, f"expected a value or a list of {{filter, value}}, got {setting!r}")
    for cond in setting:
        extra = sorted(set(cond) - {"filter", "value"})
        if extra:
            raise _fail(path, key, f"unknown keys {extra} in a conditional value")
        flt = cond.get("filter")
        if flt is None or flt == "*" or (tensor is not None and str(flt) in tensor):
            return _setting(path, key, cond["value"], tensor)
        if tensor is None:
            raise _fail(path, key, "a per-tensor filter needs the tensor names")
    return None


def _conditional(setting: Any) -> bool:
    """Whether a setting is per-tensor (a ``{filter, value}`` list or mapping), not one value."""
    return isinstance(setting, (list, Mapping)) and not (
        isinstance(setting, list) and all(isinstance(e, (int, float)) for e in setting)
    )


def _models(path: Path, doc: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The configuration's ``models`` as (path, per-model parameters), checked."""
    models = doc.get("models")
    if not isinstance(models, list) or not models:
        raise _fail(path, "models", "give a list of {model: PATH, parameters: {...}}")
    out = []
    for i, m in enumerate(models):
        if isinstance(m, str):
            m = {"model": m}
        if not isinstance(m, Mapping) or "model" not in m:
            raise _fail(path, f"models[{i}]", f"expected {{model: PATH, parameters: ...}}, got {m!r}")
        extra = sorted(set(m) - {"model", "parameters"})
        if extra:
            raise _fail(path, f"models[{i}]", f"unknown keys {extra}")
        params = m.get("parameters") or {}
        if not isinstance(params, Mapping):
            raise _fail(path, f"models[{i}].parameters", f"expected a mapping, got {params!r}")
        out.append((str(m["model"]), dict(params)))
    return out


def plan_from_mergekit(path: str | Path, **values: Any) -> MergePlan:
    """Read a plan from a mergekit YAML configuration.

    Settings that differ per tensor (``{filter, value}`` lists) are evaluated for every tensor
    name of the plan's first input, whose header is read for that; the tensors that share
    settings get one rule, the largest group the default and the others overrides.

    Args:
      path: The YAML file.
      **values: The command line's values under the plan's names: ``out``, ``seed``, ``dtype``
        (wins over the file's ``out_dtype`` / ``dtype``) and ``shard_size``. A method, inputs,
        a base, weights, f, parameters or overrides are refused: the file gives them.

    Returns:
      The plan, not yet checked (:func:`~meta_consensus.merge.plan.check_plan`).

    Raises:
      MergeError: If the file cannot be read or is not a YAML mapping, uses a key or method this
        reader does not know or cannot do the same way (slices, gradients over layers, tokenizer
        settings, per-model densities that differ, ...), lacks what its method needs (a base
        model, a weight per model, ``t``), or the command line gives what the file gives.
      CheckpointError: If a per-tensor setting needs the tensor names and the first input is not
        a readable checkpoint.

    References:
      Goddard et al. 2024, EMNLP Industry Track, "Arcee's MergeKit: A Toolkit for Merging Large
      Language Models"; the conventions are those of its source (github.com/arcee-ai/mergekit).
    """
    import yaml  # type: ignore[import-untyped]

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise MergeError(f"cannot read mergekit config {path}: {e}") from e
    if not isinstance(doc, Mapping):
        raise MergeError(f"{path}: expected a mergekit configuration (a mapping), got {type(doc).__name__}")
    for key, why in REFUSED_TOP.items():
        if doc.get(key) is not None:
            raise _fail(path, key, why)
    unknown = sorted(set(doc) - set(TOP_KEYS) - set(REFUSED_TOP))
    if unknown:
        raise _fail(path, str(unknown[0]), f"not a key this reader knows; known: {list(TOP_KEYS)}")
    for key in ("method", "overrides", "inputs", "base", "weights", "num_byzantine"):
        if values.get(key) not in (None, [], (), {}):
            raise MergeError(f"--mergekit-config gives the {key}: drop it from the command line")
    if values.get("params"):
        raise MergeError("--mergekit-config gives the parameters: drop --set")
    name = doc.get("merge_method")
    if name not in METHODS:
        raise _fail(path, "merge_method", f"{name!r} is not one of the methods read here: {sorted(METHODS)}")
    rule, method_defaults, per_model = METHODS[name]
    base = doc.get("base_model")
    base = None if base is None else str(base)
    models = _models(path, doc)
    global_params = dict(doc.get("parameters") or {})
    bad = sorted(set(global_params) - set(method_defaults) - set(per_model))
    if bad:
        raise _fail(
            path,
            f"parameters.{bad[0]}",
            f"{name} takes no such parameter; it takes {sorted(method_defaults)}",
        )
    for i, (_, params) in enumerate(models):
        bad = sorted(set(params) - set(per_model))
        if bad:
            raise _fail(path, f"models[{i}].parameters.{bad[0]}", f"{name} takes no per-model {bad[0]!r}")

    # Which models are merged, in which order, and what --base is.
    if name in ("task_arithmetic", "ties", "dare_ties", "dare_linear", "model_stock", "slerp"):
        if base is None:
            raise _fail(path, "base_model", f"{name} needs a base_model")
        merged = [(p, q) for p, q in models if p != base]
    else:
        if base is not None and base not in [p for p, _ in models]:
            raise _fail(path, "base_model", f"{name} uses no base model (list it under models to merge it)")
        merged, base = models, None
    if name == "slerp":
        if len(merged) != 1:
            raise _fail(
                path, "models", f"slerp merges the base_model with exactly one other model, got {len(merged)}"
            )
        inputs, base_arg = [str(doc["base_model"]), merged[0][0]], None
    else:
        inputs, base_arg = [p for p, _ in merged], base

    settings = {f"parameters.{k}": v for k, v in global_params.items()}
    for i, (_, params) in enumerate(merged):
        settings.update({f"models[{i}].parameters.{k}": v for k, v in params.items()})
    tensors: list[str | None] = [None]
    if any(_conditional(v) for v in settings.values()):
        tensors = list(_tensor_names(inputs[0]))

    def params_for(tensor: str | None) -> dict[str, Any]:
        def get(key: str, setting: Any, default: Any) -> Any:
            v = _setting(path, key, setting, tensor)
            return default if v is None else v

        p = {k: get(f"parameters.{k}", global_params.get(k), d) for k, d in method_defaults.items()}
        out: dict[str, Any] = {}
        if name == "slerp":
            if p["t"] is None:
                raise _fail(path, "parameters.t", "slerp needs t")
            return {"t": float(p["t"])}
        if name == "model_stock":
            if p["filter_wise"]:
                raise _fail(path, "parameters.filter_wise", "filter_wise: true is not supported")
            return {}
        if name == "karcher":
            return {"max_iter": int(p["max_iter"]), "tol": float(p["tol"])}
        if "weight" in per_model:
            w = []
            for i, (_, q) in enumerate(merged):
                if "weight" not in q and "weight" not in global_params:
                    raise _fail(path, f"models[{i}].parameters.weight", f"{name} needs a weight per model")
                w.append(
                    float(
                        get(
                            f"models[{i}].parameters.weight",
                            q.get("weight", global_params.get("weight")),
                            None,
                        )
                    )
                )
            out["weights"] = w
        if "density" in per_model:
            dens = [
                float(
                    get(
                        f"models[{i}].parameters.density", q.get("density", global_params.get("density")), 1.0
                    )
                )
                for i, (_, q) in enumerate(merged)
            ]
            if len(set(dens)) > 1:
                raise _fail(
                    path,
                    "models[*].parameters.density",
                    f"densities that differ per model ({dens}) are not supported",
                )
            out["density"] = dens[0]
        if "normalize" in p:
            out["normalize"] = bool(p["normalize"])
        if float(p.get("lambda", 1.0)) != 1.0:
            out["scale"] = float(p["lambda"])
        if name in ("dare_ties", "dare_linear"):
            out["rescale"] = "l1" if p["rescale"] else False
        elif p.get("rescale"):
            raise _fail(path, "parameters.rescale", f"{name} has no rescale")
        if name == "ties" and out["density"] >= 1.0:
            out["density"] = 1.0
        return out

    groups: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for t in tensors:
        p = params_for(t)
        key = repr(sorted(p.items()))
        groups.setdefault(key, (p, []))[1].append(t)  # type: ignore[arg-type]
    ordered = sorted(groups.values(), key=lambda g: -len(g[1]))
    default, *others = ordered
    overrides = tuple(
        RuleChoice(rule, p, None, "^(?:" + "|".join(re.escape(str(k)) for k in keys) + ")$")
        for p, keys in others
    )
    dtype = values.get("dtype") or doc.get("out_dtype") or doc.get("dtype")
    return MergePlan(
        inputs=tuple(inputs),
        out=values.get("out") or "",
        rule=RuleChoice(rule, default[0], None),
        overrides=overrides,
        base=base_arg,
        dtype=None if dtype is None else str(dtype),
        shard_size=parse_shard_size(values.get("shard_size")),
        seed=int(values.get("seed") or 0),
    )


def _tensor_names(source: str) -> list[str]:
    """The tensor names of a checkpoint (its header only)."""
    from meta_consensus.merge.inputs import open_input

    reader = open_input(source)
    try:
        return list(reader.specs)
    finally:
        reader.close()


def needs_executor(doc: Mapping[str, Any]) -> str | None:
    """Why a configuration must run tensor by tensor (:mod:`~meta_consensus.merge.mergekit_exec`), or None.

    Args:
      doc: The YAML document.

    Returns:
      The reason (slices, a method only mergekit has, a gradient, parameters that differ per
      model), or None when the plan-based merge does it the same way.
    """
    from meta_consensus.merge.mergekit_config import has_gradient

    if doc.get("slices") is not None:
        return "slices"
    if doc.get("merge_method") not in METHODS:
        return f"method {doc.get('merge_method')!r}"
    models: list[Any] = doc["models"] if isinstance(doc.get("models"), list) else []
    settings = (
        [v for v in (doc.get("parameters") or {}).values()]
        if isinstance(doc.get("parameters"), Mapping)
        else []
    )
    per_model: dict[str, set[str]] = {}
    base = doc.get("base_model")
    for m in models:
        params = m.get("parameters") if isinstance(m, Mapping) else None
        if isinstance(params, Mapping):
            settings += list(params.values())
            if m.get("model") != base:
                for k, v in params.items():
                    per_model.setdefault(str(k), set()).add(repr(v))
        elif isinstance(m, Mapping) and m.get("model") != base:
            per_model.setdefault("density", set()).add(repr(None))
    if any(has_gradient(v) for v in settings):
        return "a gradient over layers"
    if len(per_model.get("density", set())) > 1 and doc.get("merge_method") in (
        "ties",
        "dare_ties",
        "dare_linear",
    ):
        return "densities that differ per model"
    return None


def read_mergekit(path: str | Path, *, compute: str | None = None, **values: Any) -> Any:
    """Read a mergekit configuration: a plan, a tensor-by-tensor job, or a multi-merge.

    Args:
      path: The YAML file (one document, or several: mergekit-multi).
      compute: ``--compute-dtype``: None / ``"float32"`` (the default) or ``"config"``
        (mergekit's arithmetic in the configuration's dtype; always tensor by tensor).
      **values: The command line's values, as for :func:`plan_from_mergekit`.

    Returns:
      A :class:`~meta_consensus.merge.plan.MergePlan` (with ``mergekit_keys`` noted by
      :func:`keys_of`), a :class:`~meta_consensus.merge.mergekit_exec.MergekitJob`, or a
      :class:`~meta_consensus.merge.mergekit_multi.MultiMerge`.

    Raises:
      MergeError: If the file cannot be read, or is refused (one line naming the key and why).
    """
    import yaml

    from meta_consensus.merge.mergekit_config import read_config
    from meta_consensus.merge.mergekit_exec import MergekitJob

    path = Path(path)
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        raise MergeError(f"cannot read mergekit config {path}: {e}") from e
    if len(docs) > 1:
        from meta_consensus.merge.mergekit_multi import multi_from_docs

        return multi_from_docs(path, docs, compute=compute, **values)
    if not docs or not isinstance(docs[0], Mapping):
        got = type(docs[0]).__name__ if docs else "an empty file"
        raise MergeError(f"{path}: expected a mergekit configuration (a mapping), got {got}")
    doc = docs[0]
    for key in ("method", "overrides", "inputs", "base", "weights", "num_byzantine"):
        if values.get(key) not in (None, [], (), {}):
            raise MergeError(f"--mergekit-config gives the {key}: drop it from the command line")
    if values.get("params"):
        raise MergeError("--mergekit-config gives the parameters: drop --set")
    if doc.get("name") is not None:
        raise _fail(path, "name", "names a mergekit-multi stage; a file of one merge has none")
    if (compute or "float32") != "float32" or needs_executor(doc):
        return MergekitJob(
            read_config(path, doc),
            out=values.get("out") or "",
            seed=int(values.get("seed") or 0),
            dtype=values.get("dtype"),
            compute=compute or "float32",
            shard_size=parse_shard_size(values.get("shard_size")),
        )
    return plan_from_mergekit(path, **values)


def keys_of(path: str | Path) -> tuple[list[str], dict[str, str]]:
    """The keys a one-document configuration gives, and those among them that change nothing.

    Args:
      path: The YAML file.

    Returns:
      (every key path, ``parameters.int8_mask`` -> why it changes nothing, ...).
    """
    import yaml

    from meta_consensus.merge.mergekit_config import NO_EFFECT

    doc = yaml.safe_load(Path(path).read_text())
    keys: list[str] = []
    for k, v in doc.items():
        keys.append(str(k))
        if k == "parameters" and isinstance(v, Mapping):
            keys += [f"parameters.{p}" for p in v]
        if k == "models" and isinstance(v, list):
            for i, m in enumerate(v):
                if isinstance(m, Mapping) and isinstance(m.get("parameters"), Mapping):
                    keys += [f"models[{i}].parameters.{p}" for p in m["parameters"]]
    return keys, {k: NO_EFFECT[k.rsplit(".", 1)[-1]] for k in keys if k.rsplit(".", 1)[-1] in NO_EFFECT}
