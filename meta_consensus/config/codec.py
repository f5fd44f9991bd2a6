"""A run config as TOML text and nested dicts: load, ``--set`` overrides, dump.

``--set section.key=value`` overrides (:func:`apply_overrides`) parse ``value`` as a TOML
value (``3``, ``0.5``, ``"alie"``, ``[6, 7]``, ``true``); a bare word is taken as a string.
Values are coerced to the dataclasses' field types (:func:`from_dict`), and TOML's missing
null is written as ``"none"`` (:func:`to_dict`), so :func:`load` of :func:`dumps` gives back
an equal config.

Presets are package data (``meta_consensus/presets/<name>.toml``, :func:`preset_names`): ``load``
takes one as ``preset=NAME``, and a config file that sets ``preset = "NAME"`` starts from it and
changes the keys it gives. Options follow their owner (:data:`OWNED_OPTIONS`): when an override
changes ``byzantine.attack``, ``vote.rule`` or ``vote.top_rule``, the options of the old choice
that came from the embedded default or a preset and that the new choice does not take are
dropped, with a note (:func:`load_with_notes`); options the user gave (in a file or a
``--set``) are kept, and the config check refuses them with the valid ones.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import logging
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
PRESETS_DIR = "presets"  # package data of meta_consensus: the named presets, one TOML file each
PRESET_KEY = "preset"  # a config file's top-level key naming the preset it starts from

# (owner key, its options key): the options belong to the owner's current choice.
OWNED_OPTIONS = (
    ("byzantine.attack", "byzantine.options"),
    ("vote.rule", "vote.options"),
    ("vote.top_rule", "vote.top_options"),
)


def default_text() -> str:
    """The TOML text of the embedded default config.

    Returns:
      The text of ``meta_consensus/default.toml``.
    """
    return importlib.resources.files("meta_consensus").joinpath(DEFAULT_FILE).read_text()


def preset_names() -> list[str]:
    """The presets shipped with the package (``meta-consensus run --preset NAME``), sorted.

    Returns:
      The preset names.
    """
    folder = importlib.resources.files("meta_consensus").joinpath(PRESETS_DIR)
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def preset_text(name: str) -> str:
    """The TOML text of the preset ``name``.

    Args:
      name: a preset's name.

    Returns:
      Its TOML text.

    Raises:
      ConfigError: listing the presets when there is no such preset.
    """
    _choices("preset", name, preset_names())
    return importlib.resources.files("meta_consensus").joinpath(PRESETS_DIR, f"{name}.toml").read_text()


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
        if value is None:
            # `--set key=none` on a key that takes a name: the name "none", so that the check of
            # the key's choices lists the valid names (the key has no "off" value of None).
            return "none"
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
    """``data`` with ``plugins`` appended to its ``plugins`` list (each module once, in order).

    Args:
      data: the config's nested dicts.
      plugins: plug-in module names.

    Returns:
      A shallow copy of ``data`` with the longer list.
    """
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

    Args:
      data: the config's nested dicts.
      plugins: plug-in modules to import and list.

    Returns:
      The validated config.

    Raises:
      ConfigError: for an unknown key, a value of the wrong type or an invalid value.
    """
    return _build(Config, with_plugins(data, plugins))


def load(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    plugins: Sequence[str] = (),
    *,
    preset: str | None = None,
) -> Config:
    """The config of a file (None: the embedded default, or ``preset``) with overrides and plug-ins.

    Options dropped with their owner are logged (:func:`load_with_notes`).

    Args:
      path: a TOML file (None: the embedded default, or ``preset``).
      overrides: ``section.key=value`` overrides (values parsed as TOML).
      plugins: plug-in modules to import.
      preset: a shipped preset instead of a file.

    Returns:
      The validated config.

    Raises:
      ConfigError: for a missing or invalid file, both a file and a preset, a bad override or
        an invalid config.
    """
    cfg, notes = load_with_notes(path, overrides, plugins, preset=preset)
    for note in notes:
        logging.getLogger(__name__).warning("meta-consensus: note: %s", note)
    return cfg


def _read_toml(p: Path) -> dict[str, Any]:
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from e


def _merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``top``'s keys over it, tables merged key by key."""
    out = _deep_copy(dict(base))
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def _keys(data: Mapping[str, Any], prefix: str = "") -> set[str]:
    """Every dotted key of nested tables, tables included."""
    out = set()
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else k
        out.add(key)
        if isinstance(v, Mapping):
            out |= _keys(v, key)
    return out


def load_with_notes(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    plugins: Sequence[str] = (),
    *,
    preset: str | None = None,
) -> tuple[Config, list[str]]:
    """:func:`load`, one line per option dropped because its owner changed, and :func:`stage_notes`.

    Args:
      path: a TOML file (None: the embedded default, or ``preset``).
      overrides: ``section.key=value`` overrides.
      plugins: plug-in modules to import.
      preset: a shipped preset instead of a file.

    Returns:
      ``(config, notes)``.

    Raises:
      ConfigError: as :func:`load`.
    """
    if path is not None and preset is not None:
        raise ConfigError("give a config file or a preset, not both")
    if path is None:
        data = tomllib.loads(preset_text(preset) if preset is not None else default_text())
        user_keys: set[str] = set()
    else:
        data = _read_toml(Path(path))
        user_keys = _keys(data)
        if PRESET_KEY in data:
            name = data.pop(PRESET_KEY)
            if not isinstance(name, str):
                raise ConfigError(f"preset = {name!r} must be a string; choose one of {preset_names()}")
            user_keys = _keys(data)
            data = _merge(tomllib.loads(preset_text(name)), data)
    changed = {item.split("=", 1)[0].strip() for item in overrides if "=" in item}
    merged = apply_overrides(data, overrides)
    notes = _drop_orphaned_options(merged, changed, user_keys | changed, with_plugins(merged, plugins))
    notes += _drop_defaults_lora_refuses(merged, user_keys | changed, changed)
    cfg = from_dict(merged, plugins)
    return cfg, notes + stage_notes(cfg)


def stage_notes(cfg: Config) -> list[str]:
    """One line when the config's weights will replace its vote's output (so the rule changes nothing).

    A coordinate-wise rule other than the mean keeps every node; a weight objective that reads
    only the vote's mask (not ``anchor``, whose trait ``reads_vote_output`` is set) then re-weighs
    all of them, and the rule's own output is not used. The run's table says it again for the
    rounds where it happened (vector rules that keep every node, such as the geometric median,
    are only known at run time).

    Args:
      cfg: a validated config.

    Returns:
      The note, or nothing.
    """
    from consensus.registry import RULES
    from meta_consensus.objectives import OBJECTIVES

    v, objective = cfg.vote, OBJECTIVES[cfg.weights.objective]
    rule = RULES[v.rule]
    if objective.name == "vote" or objective.traits.get("reads_vote_output", False) or v.groups > 1:
        return []
    if rule.kind != "coordinatewise" or rule.traits.get("uniform_mean", False):
        return []
    return [
        f"vote.rule = {v.rule!r} keeps every node, so weights.objective = {objective.name!r} will "
        f"re-weigh all of them and the rule's own output will not be used (weights.objective = 'vote' "
        f"merges with it, 'anchor' weighs the nodes towards it)"
    ]


def _taken_options(owner: str, choice: Any) -> list[str] | None:
    """The options ``choice`` of ``owner`` takes (None: any, or a choice the config check refuses)."""
    try:
        if owner == "byzantine.attack":
            from strategies import attacks
            from strategies import registry as node_registry

            spec = node_registry.ATTACKS[choice]
            return None if spec.takes_any_option else attacks.attack_options(spec)
        from consensus.registry import RULES

        rule = RULES[choice]
        return None if rule.takes_any_option else list(rule.params)
    except Exception:  # noqa: BLE001 - an unknown choice: the config check names it
        return None


def _get(data: Mapping[str, Any], dotted: str) -> Any:
    node: Any = data
    for k in dotted.split("."):
        if not isinstance(node, Mapping) or k not in node:
            return None
        node = node[k]
    return node


def _drop_orphaned_options(
    data: dict[str, Any], changed: set[str], user_keys: set[str], with_plugin_list: Mapping[str, Any]
) -> list[str]:
    """Drop (in place) the default's options that a changed owner's new choice does not take."""
    notes: list[str] = []
    if not any(owner in changed for owner, _ in OWNED_OPTIONS):
        return notes
    try:  # the choice may be a plug-in's; a plug-in that fails to import is reported by the check
        from consensus.plugins import load_entry_points, load_plugins

        load_entry_points()
        listed = with_plugin_list.get("plugins", [])
        load_plugins([listed] if isinstance(listed, str) else list(listed))
    except Exception:  # noqa: BLE001
        pass
    for owner, key in OWNED_OPTIONS:
        options, choice = _get(data, key), _get(data, owner)
        if owner not in changed or not isinstance(options, dict) or not options:
            continue
        taken = _taken_options(owner, choice)
        if taken is None:
            continue
        dropped = sorted(
            k for k in options if k not in taken and key not in user_keys and f"{key}.{k}" not in user_keys
        )
        for k in dropped:
            del options[k]
        if dropped:
            notes.append(
                f"{owner} = {choice!r} does not take the default's {key} {dropped}; dropped them "
                f"(its options: {taken}; set some with --set '{key}={{...}}')"
            )
    return notes


# What a LoRA run refuses and the embedded default sets: (table, key, the value a LoRA run takes,
# why). A value the user did not write gives way, with a note; one the user wrote is refused by
# the config check, with the reason.
LORA_GIVES_WAY: tuple[tuple[str, str, Any, str], ...] = (
    ("nodes", "public_warm_start", 0, "[nodes.lora] pretrains its base with nodes.lora.pretrain_steps"),
    ("vote", "server_step", 0.0, "[nodes.lora] merges the adapters by vote.adapter_method with vote.rule"),
    (
        "weights",
        "objective",
        "uniform",
        "[nodes.lora] merges the adapters by vote.adapter_method with vote.rule",
    ),
)


def _drop_defaults_lora_refuses(data: dict[str, Any], user_keys: set[str], changed: set[str]) -> list[str]:
    """Set (in place) the defaults a LoRA run refuses to the values it takes (:data:`LORA_GIVES_WAY`).

    With ``[nodes.lora]`` in the config: the public warm start (the base is pretrained by
    ``nodes.lora.pretrain_steps``), the server step and the weight objective (the adapters are
    merged by their own method).

    Only values the user did not write give way: one given with ``[nodes.lora]`` (a ``--set`` of
    it or of its whole table, or a file's) is still refused by the config check, with the reason.
    """
    nodes = data.get("nodes")
    if not isinstance(nodes, dict) or nodes.get("lora") is None:
        return []
    notes = []
    for table, key, value, why in LORA_GIVES_WAY:
        section = data.get(table)
        if not isinstance(section, dict) or key not in section or section[key] == value:
            continue
        if f"{table}.{key}" in user_keys or table in changed:
            continue
        old, section[key] = section[key], value
        notes.append(f"{why}; dropped the default's {table}.{key} = {old!r} (now {value!r})")
    return notes


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
    """Apply ``section.key=value`` overrides to nested dicts (``value`` parsed as TOML).

    A value that is not TOML is taken as a string; ``none``/``null`` sets None.

    Args:
      data: the config's nested dicts (not modified).
      overrides: the overrides, in order.

    Returns:
      A deep copy of ``data`` with the overrides applied.

    Raises:
      ConfigError: for an override without ``=`` or one whose path crosses a non-table.
    """
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
    """Plain nested dicts of a config (tuples as lists; TOML has no null, so None is "none").

    Args:
      cfg: a config.

    Returns:
      Nested dicts of TOML values.
    """

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
    """TOML text of a config; :func:`load` of it gives back an equal config.

    Args:
      cfg: a config.

    Returns:
      The TOML text.
    """
    return tomli_w.dumps(to_dict(cfg))
