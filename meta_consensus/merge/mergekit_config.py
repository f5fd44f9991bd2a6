"""mergekit's configuration as mergekit 0.1.5 evaluates it: slices, gradients, per-model parameters.

:func:`read_config` turns a YAML mapping into a :class:`MergekitConfig` whose output is always a
list of slices (``models:`` is one slice over every layer, the base appended when it is not
listed, as mergekit's ``normalize_config`` does). :meth:`MergekitConfig.parameter` resolves a
parameter for one tensor as mergekit's ``ConfigReader`` does: the source's (model's) value, then
the slice's, then the global ``parameters``, then the method's default; each value may be a
number, a per-tensor ``{filter, value}`` list, or a gradient (a list of numbers interpolated
piecewise-linearly over ``t``, the layer's position in its slice). Every key read is recorded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meta_consensus.merge.errors import MergeError

TOP_KEYS = ("merge_method", "models", "slices", "base_model", "parameters", "dtype", "out_dtype", "name")
REFUSED_TOP = {
    "modules": "modules are not supported (give models: or slices:)",
    "tokenizer_source": "tokenizers are not merged here (the output holds the merged tensors)",
    "tokenizer": "tokenizers are not merged here (the output holds the merged tensors)",
    "chat_template": "chat templates are not written here",
}
# Keys mergekit reads that change nothing in the merged values: recorded, with why.
NO_EFFECT = {
    "int8_mask": "the sign mask's storage dtype (int8 or the tensors'); the merged values are the same",
}


def fail(path: Any, key: str, why: str) -> MergeError:
    """A one-line error naming the file and the configuration key at fault.

    Args:
      path: The configuration file.
      key: The key at fault.
      why: What is wrong.

    Returns:
      The :class:`MergeError` to raise.
    """
    return MergeError(f"{path}: {key}: {why}")


def is_gradient(setting: Any) -> bool:
    """Whether a setting is a gradient: a non-empty list of numbers (booleans are not numbers here).

    Args:
      setting: A configuration value.

    Returns:
      True for ``[0, 0.5, 1]`` and the like.
    """
    return (
        isinstance(setting, list)
        and bool(setting)
        and all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in setting)
    )


def has_gradient(setting: Any) -> bool:
    """Whether a setting holds a gradient anywhere (also inside a ``{filter, value}`` entry).

    Args:
      setting: A configuration value.

    Returns:
      True when some value is a list of numbers.
    """
    if is_gradient(setting):
        return True
    if isinstance(setting, Mapping):
        return has_gradient(setting.get("value"))
    if isinstance(setting, list):
        return any(has_gradient(e) for e in setting)
    return False


def evaluate(path: Any, key: str, setting: Any, tensor: str, t: float) -> Any:
    """A setting's value for one tensor at layer position ``t``, as mergekit's ``evaluate_setting``.

    A scalar is itself; a gradient ``[v_0, ..., v_m]`` is ``(1 - f) v_i + f v_{i+1}`` with
    ``s = t m``, ``i = floor(s)``, ``f = s - i`` (booleans and strings: ``v_{floor(t m)}``); a
    ``{filter, value}`` list gives the value of its first entry whose filter is missing, ``"*"``
    or a substring of the tensor's name (None when none matches).

    Args:
      path: The configuration file, for messages.
      key: The setting's key, for messages.
      setting: The value as written.
      tensor: The tensor's name.
      t: The layer's position in its slice, in [0, 1] (0 outside the layers).

    Returns:
      The value, or None when no filter matches.

    Raises:
      MergeError: If the setting is of no form mergekit reads.
    """
    if setting is None or isinstance(setting, (bool, int, float, str)):
        return setting
    if isinstance(setting, Mapping):
        setting = [setting]
    if isinstance(setting, list) and setting:
        if is_gradient(setting):
            scaled = t * (len(setting) - 1)
            i0 = int(scaled)
            i1 = min(len(setting) - 1, i0 + 1)
            frac = scaled - i0
            return (1 - frac) * setting[i0] + frac * setting[i1]
        if all(isinstance(e, (bool, int, float, str)) for e in setting):
            return setting[int(t * (len(setting) - 1))]
        if all(isinstance(e, Mapping) and "value" in e for e in setting):
            for cond in setting:
                extra = sorted(set(cond) - {"filter", "value"})
                if extra:
                    raise fail(path, key, f"unknown keys {extra} in a conditional value")
                flt = cond.get("filter")
                if flt is None or flt == "*" or str(flt) in tensor:
                    return evaluate(path, key, cond["value"], tensor, t)
            return None
    raise fail(
        path,
        key,
        f"expected a number, a gradient [a, b, ...] or a list of {{filter, value}}, got {setting!r}",
    )


@dataclasses.dataclass
class Source:
    """One input of an output slice.

    Attributes:
      model: The model's path as written (a safetensors file or folder).
      layer_range: ``(start, end)`` of its layers, or None for "every layer" (``models:``).
      params: Its per-model parameters, as written.
      where: Its key in the file, for messages (``models[1]``, ``slices[0].sources[2]``).
    """

    model: str
    layer_range: tuple[int, int] | None
    params: dict[str, Any]
    where: str


@dataclasses.dataclass
class Slice:
    """One output slice: its sources (of equal layer counts), base and parameters.

    Attributes:
      sources: The inputs.
      base_model: The slice's ``base_model``, or None for the configuration's.
      params: The slice's parameters, as written.
      where: Its key in the file.
    """

    sources: list[Source]
    base_model: str | None
    params: dict[str, Any]
    where: str


@dataclasses.dataclass
class MergekitConfig:
    """A mergekit configuration, read and normalised to slices.

    Attributes:
      path: The file it was read from.
      method: ``merge_method``.
      slices: The output slices (``models:`` gives one, with ``from_models`` set).
      base_model: The configuration's ``base_model``, or None.
      params: The global ``parameters``.
      dtype: ``dtype`` (mergekit's compute dtype), or None.
      out_dtype: ``out_dtype``, or None.
      from_models: Whether the file gave ``models:`` (not ``slices:``).
      name: ``name`` (a mergekit-multi stage), or None.
      keys_read: Every key read, in reading order.
    """

    path: Path
    method: str
    slices: list[Slice]
    base_model: str | None
    params: dict[str, Any]
    dtype: str | None
    out_dtype: str | None
    from_models: bool
    name: str | None = None
    keys_read: list[str] = dataclasses.field(default_factory=list)

    def read(self, key: str) -> None:
        """Record a key as read (once).

        Args:
          key: The key's path in the file.
        """
        if key not in self.keys_read:
            self.keys_read.append(key)

    def base_of(self, s: Slice) -> str | None:
        """The base model of a slice: its own, else the configuration's.

        Args:
          s: The slice.

        Returns:
          The base model's path, or None.
        """
        return s.base_model or self.base_model

    def parameter(
        self,
        name: str,
        s: Slice,
        *,
        source: Source | None,
        tensor: str,
        t: float,
        default: Any = None,
        required: bool = False,
    ) -> Any:
        """Resolve a parameter for one tensor as mergekit does: source, slice, global, default.

        Args:
          name: The parameter.
          s: The output slice.
          source: The model whose parameter it is (None: a shared parameter).
          tensor: The tensor's name (the source's input name for a per-model parameter).
          t: The layer's position in its slice.
          default: The method's default.
          required: Whether a missing value is an error.

        Returns:
          The value.

        Raises:
          MergeError: If it is required and given nowhere, or a value is malformed.
        """
        scopes: list[tuple[str, Mapping[str, Any]]] = []
        if source is not None:
            scopes.append((f"{source.where}.parameters", source.params))
        scopes += [(f"{s.where}.parameters", s.params), ("parameters", self.params)]
        for where, scope in scopes:
            if name in scope:
                key = f"{where}.{name}"
                self.read(key)
                value = evaluate(self.path, key, scope[name], tensor, t)
                if value is not None:
                    return value
        if required:
            who = f"{source.where}.parameters." if source is not None else "parameters."
            raise fail(self.path, f"{who}{name}", f"{self.method} needs {name!r} (for {tensor})")
        return default


def _params(path: Path, where: str, value: Any) -> dict[str, Any]:
    """A ``parameters`` mapping, checked."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise fail(
            path, f"{where}.parameters" if where else "parameters", f"expected a mapping, got {value!r}"
        )
    return dict(value)


def _source(path: Path, where: str, item: Any, sliced: bool) -> Source:
    """One ``models`` entry or one slice source, checked."""
    if isinstance(item, str) and not sliced:
        item = {"model": item}
    if not isinstance(item, Mapping) or "model" not in item:
        shape = "{model: PATH, layer_range: [A, B]}" if sliced else "{model: PATH, parameters: ...}"
        raise fail(path, where, f"expected {shape}, got {item!r}")
    allowed = {"model", "parameters"} | ({"layer_range"} if sliced else set())
    extra = sorted(set(item) - allowed)
    if extra:
        raise fail(path, where, f"unknown keys {extra}")
    rng = None
    if sliced:
        r = item.get("layer_range")
        if not (
            isinstance(r, list) and len(r) == 2 and all(isinstance(v, int) for v in r) and 0 <= r[0] < r[1]
        ):
            raise fail(
                path, f"{where}.layer_range", f"expected [START, END] with 0 <= START < END, got {r!r}"
            )
        rng = (int(r[0]), int(r[1]))
    return Source(str(item["model"]), rng, _params(path, where, item.get("parameters")), where)


def read_config(path: str | Path, doc: Mapping[str, Any]) -> MergekitConfig:
    """Read a mergekit configuration mapping into slices.

    Args:
      path: The file, for messages.
      doc: The YAML document.

    Returns:
      The configuration; ``models:`` becomes one slice (layer ranges filled in when the models
      are opened), the base appended as a source when it is not listed.

    Raises:
      MergeError: If a key is unknown or refused (``modules``, tokenizer settings), both or
        neither of ``models`` and ``slices`` are given, or an entry is malformed.
    """
    path = Path(path)
    for key, why in REFUSED_TOP.items():
        if doc.get(key) is not None:
            raise fail(path, key, why)
    unknown = sorted(set(doc) - set(TOP_KEYS) - set(REFUSED_TOP))
    if unknown:
        raise fail(path, str(unknown[0]), f"not a key this reader knows; known: {list(TOP_KEYS)}")
    method = doc.get("merge_method")
    if not isinstance(method, str):
        raise fail(path, "merge_method", f"give the method's name, got {method!r}")
    models, slices = doc.get("models"), doc.get("slices")
    if (models is None) == (slices is None):
        raise fail(path, "models", "give exactly one of models: and slices:")
    base = None if doc.get("base_model") is None else str(doc["base_model"])
    out: list[Slice] = []
    if models is not None:
        if not isinstance(models, list) or not models:
            raise fail(path, "models", "give a list of {model: PATH, parameters: {...}}")
        sources = [_source(path, f"models[{i}]", m, False) for i, m in enumerate(models)]
        if base is not None and base not in [s.model for s in sources]:
            sources.append(Source(base, None, {}, "base_model"))
        out.append(Slice(sources, None, {}, "models"))
    else:
        if not isinstance(slices, list) or not slices:
            raise fail(path, "slices", "give a list of {sources: [{model, layer_range}, ...]}")
        for i, sl in enumerate(slices):
            where = f"slices[{i}]"
            if not isinstance(sl, Mapping) or not isinstance(sl.get("sources"), list) or not sl["sources"]:
                raise fail(path, where, "expected {sources: [{model: PATH, layer_range: [A, B]}, ...]}")
            extra = sorted(set(sl) - {"sources", "base_model", "parameters", "residual_weight"})
            if extra:
                raise fail(path, where, f"unknown keys {extra}")
            if sl.get("residual_weight") is not None:
                raise fail(
                    path, f"{where}.residual_weight", "mergekit reads it but never uses it; leave it out"
                )
            srcs = [_source(path, f"{where}.sources[{j}]", m, True) for j, m in enumerate(sl["sources"])]
            lengths = {s.layer_range[1] - s.layer_range[0] for s in srcs if s.layer_range}
            if len(lengths) > 1:
                raise fail(path, where, f"its sources have different layer counts {sorted(lengths)}")
            sb = sl.get("base_model")
            out.append(
                Slice(
                    srcs, None if sb is None else str(sb), _params(path, where, sl.get("parameters")), where
                )
            )
    cfg = MergekitConfig(
        path=path,
        method=method,
        slices=out,
        base_model=base,
        params=_params(path, "", doc.get("parameters")),
        dtype=None if doc.get("dtype") is None else str(doc["dtype"]),
        out_dtype=None if doc.get("out_dtype") is None else str(doc["out_dtype"]),
        from_models=models is not None,
        name=None if doc.get("name") is None else str(doc["name"]),
    )
    for key in doc:
        cfg.read(str(key))
    return cfg
