"""A run config as TOML text and nested dicts: load, ``--set`` overrides, dump.

``--set section.key=value`` overrides (:func:`apply_overrides`) parse ``value`` as a TOML
value (``3``, ``0.5``, ``"alie"``, ``[6, 7]``, ``true``); a bare word is taken as a string.
Values are coerced to the dataclasses' field types (:func:`from_dict`), and TOML's missing
null is written as ``"none"`` (:func:`to_dict`), so :func:`load` of :func:`dumps` gives back
an equal config.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import tomli_w

from meta_consensus.config.errors import ConfigError
from meta_consensus.config.errors import check_choice as _choices
from meta_consensus.config.schema import Config

DEFAULT_FILE = "default.toml"  # package data of meta_consensus: the embedded default of `meta-consensus run`


def default_text() -> str:
    """The TOML text of the embedded default config."""
    return importlib.resources.files("meta_consensus").joinpath(DEFAULT_FILE).read_text()


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(key: str, value: Any, hint: Any) -> Any:
    """Coerce a TOML value to the field's type, or raise ConfigError naming the key."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise ConfigError(f"[{key}] must be a table, got {value!r}")
        return _build(hint, value, key)
    if origin in (types.UnionType, typing.Union):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() == "none")):
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(key, value, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key} = {value!r}: " + "; ".join(errors))
    if origin is Literal:
        _choices(key, value, args)
        return value
    if origin is tuple:
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise ConfigError(f"{key} = {value!r} must be a list")
        item = args[0]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(f"{key}[{i}]", v, item) for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key} = {value!r} must have {len(args)} entries")
        return tuple(_convert(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if origin is Mapping or hint is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} = {value!r} must be a table")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {value!r} must be an integer")
        return value
    if hint is float:
        if isinstance(value, str) and value.lower() in ("inf", "+inf", "infinity"):
            return math.inf
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} = {value!r} must be a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r} must be a string")
        return value
    return value


def _build(cls: Any, data: Mapping[str, Any], prefix: str = "") -> Any:
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = f"[{prefix}]" if prefix else "the top level"
        raise ConfigError(f"unknown key(s) {unknown} in {where}; valid keys: {names}")
    kwargs = {}
    for k, v in data.items():
        kwargs[k] = _convert(f"{prefix}.{k}" if prefix else k, v, hints[k])
    return cls(**kwargs)


def with_plugins(data: Mapping[str, Any], plugins: Sequence[str]) -> dict[str, Any]:
    """``data`` with ``plugins`` appended to its ``plugins`` list (each module once, in order)."""
    out = dict(data)
    if plugins:
        listed = out.get("plugins", [])
        listed = list(listed) if isinstance(listed, list | tuple) else [listed]
        out["plugins"] = listed + [m for m in plugins if m not in listed]
    return out


def from_dict(data: Mapping[str, Any], plugins: Sequence[str] = ()) -> Config:
    """A validated :class:`Config` from nested dicts (TOML tables); ``plugins`` adds plug-in modules.

    The plug-ins are imported before any name is checked and stay listed in the config, so
    its TOML text (:func:`dumps`) loads them again wherever it is read.
    """
    return _build(Config, with_plugins(data, plugins))


def load(
    path: str | Path | None = None, overrides: Sequence[str] = (), plugins: Sequence[str] = ()
) -> Config:
    """The config of a file (None: the embedded default) with ``key=value`` overrides and plug-ins."""
    if path is None:
        data = tomllib.loads(default_text())
    else:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from e
    return from_dict(apply_overrides(data, overrides), plugins)


def _deep_copy(d: Any) -> Any:
    if isinstance(d, Mapping):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list | tuple):
        return [_deep_copy(v) for v in d]
    return d


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        if text.lower() in ("none", "null"):
            return None
        return text  # a bare word: a string


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides to nested dicts (``value`` parsed as TOML)."""
    out = _deep_copy(dict(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        path, text = item.split("=", 1)
        keys = path.strip().split(".")
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {k!r} is not a table")
        value = _parse_value(text.strip())
        if value is None:
            node.pop(keys[-1], None)
            node[keys[-1]] = None
        else:
            node[keys[-1]] = value
    return out


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dicts of a config (tuples as lists; TOML has no null, so None is "none")."""

    def clean(x: Any) -> Any:
        if x is None:
            return "none"
        if isinstance(x, Mapping):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x  # TOML writes inf and nan itself

    return clean(dataclasses.asdict(cfg))


def dumps(cfg: Config) -> str:
    """TOML text of a config; :func:`load` of it gives back an equal config."""
    return tomli_w.dumps(to_dict(cfg))
