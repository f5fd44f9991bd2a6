"""What a merge does: the plan (inputs, rules, overrides, output) and the checks on it.

The plan is read from a TOML file or the command line; the checks refuse a plan before
anything is read or written. A rule's precondition, parameters and needs come from its spec in
:data:`consensus.registry.RULES`; nothing here restates them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from meta_consensus.merge.errors import MergeError

# The rule kinds that map n inputs to one; pre-aggregators (n -> n) are refused.
MERGE_KINDS = ("coordinatewise", "vector", "merge")
# What the merge command passes a rule besides the stacked inputs: the base (``--base``), a key
# (from ``--seed``) and per-input weights (``--weights``, given to the rule's ``weights`` parameter).
PROVIDED_NEEDS = frozenset({"params", "key", "weights"})


def merge_methods() -> list[str]:
    """The rules ``--method`` offers, read from their specs.

    Those that map n inputs to one and need nothing the merge command cannot provide
    (pre-aggregators, and rules that need a server update, Fisher information or Gram
    statistics, are left out). A vector rule is streamed from whole-model weights, so one whose
    output is no weighted combination of the inputs (its spec's ``traits["linear"]`` is False:
    Bulyan) is left out too.

    Returns:
      The rule names, in :func:`consensus.registry.by_kind`'s order (plug-ins' rules included
      once their modules are imported).
    """
    from consensus.registry import RULES, by_kind

    del RULES  # importing the registry declares the built-in rules
    return [
        name
        for name, spec in by_kind()
        if spec.kind in MERGE_KINDS
        and set(spec.needs) <= PROVIDED_NEEDS
        and (spec.kind != "vector" or spec.traits.get("linear", True))
    ]


def parse_weights(text: Any) -> tuple[float, ...] | None:
    """Read ``--weights`` (or a config's ``weights``) as per-input weights.

    Args:
      text: ``"0.5,0.3,0.2"``, a list of numbers, or None.

    Returns:
      One float per input, in input order; None when ``text`` is None.

    Raises:
      MergeError: If an item is not a number, or a weight is negative or not finite.
    """
    if text is None:
        return None
    items = text.split(",") if isinstance(text, str) else list(text)
    try:
        weights = tuple(float(w) for w in items)
    except (TypeError, ValueError):
        raise MergeError(
            f"--weights {text!r}: expected numbers separated by commas, e.g. 0.5,0.3,0.2"
        ) from None
    if not weights or not all(math.isfinite(w) and w >= 0 for w in weights):
        raise MergeError(f"--weights {text!r}: weights must be finite and non-negative")
    return weights


@dataclasses.dataclass(frozen=True)
class RuleChoice:
    """One rule with its parameters (the plan's default rule, or an override's).

    Attributes:
      method: The rule's name in :data:`consensus.registry.RULES`.
      params: The rule's parameters as given (``--set``, a config's ``[params]``, an override's
        ``PARAM=VALUE``); ``weights`` holds the per-input weights. Defaults are the spec's.
      num_byzantine: f, for the rules that take one; None otherwise.
      pattern: The override's regular expression over tensor keys; None for the default rule.
    """

    method: str
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    num_byzantine: int | None = None
    pattern: str | None = None  # None for the default rule

    @property
    def spec(self) -> Any:
        """The rule's :class:`~consensus.specs.Spec` (an unknown method is a RegistryError)."""
        from consensus.registry import RULES

        return RULES[self.method]

    @property
    def key(self) -> str:
        """Tells the plan's rules apart (an override of the default's method is another rule)."""
        return json.dumps([self.method, self.pattern], default=str)

    def label(self) -> str:
        """The rule as messages name it.

        Returns:
          The method, followed by ``(override 'PATTERN')`` for an override.
        """
        return self.method if self.pattern is None else f"{self.method} (override {self.pattern!r})"

    def build(self) -> Any:
        """Build the rule's Aggregator from its spec, with f when it takes one.

        Returns:
          The :class:`~consensus.base.Aggregator`.

        Raises:
          RegistryError: If a parameter is unknown, or the rule takes f and none was given.
          TypeError: If the factory refuses the parameters (:func:`check_rule` names the rule).
          ValueError: If the factory refuses a parameter's value (likewise).
        """
        spec = self.spec
        return spec.build(self.num_byzantine if spec.takes_f else None, **self.params)

    def as_dict(self) -> dict[str, Any]:
        """The choice as the merge report records it (``pattern`` only for an override).

        Returns:
          ``{"pattern"?, "method", "params", "num_byzantine"}``, JSON-ready but for parameter values.
        """
        out = {} if self.pattern is None else {"pattern": self.pattern}
        params = dict(self.params)
        return {**out, "method": self.method, "params": params, "num_byzantine": self.num_byzantine}


@dataclasses.dataclass(frozen=True)
class MergePlan:
    """What to merge, how, and where.

    Built by :func:`~meta_consensus.merge.cli.plan_from_args`, :func:`plan_from_toml` or
    :func:`~meta_consensus.merge.mergekit.plan_from_mergekit`; :func:`check_plan` refuses one that
    cannot run.

    Attributes:
      inputs: The checkpoints to merge (safetensors files or folders, orbax checkpoints of this
        package, or PEFT adapter folders), in order: per-input weights and the report follow it.
      out: The output folder; it must not exist.
      rule: The default rule, for every key no override matches.
      overrides: Rules for the keys their patterns match (the first match wins).
      base: The common base model (``--base``), for the rules that merge task vectors.
      dtype: The output dtype of float tensors (``--dtype``); None keeps the inputs'.
      shard_size: Bytes above which the output is sharded; None writes one file.
      seed: The seed of randomized rules (a leaf's key is ``fold_in(key(seed), leaf index)``).
      plugins: Modules imported before the rules are checked, so their rules are valid names.
      merge_into_base: PEFT adapter inputs: the Hugging Face model folder the merged update is
        added to (a full checkpoint out, instead of an adapter folder).
      adapter_method: PEFT adapter inputs: the adapter method after a robust rule.
      space: PEFT adapter inputs: where a robust rule works, ``"products"`` or ``"factors"``.
    """

    inputs: tuple[str, ...]
    out: str
    rule: RuleChoice
    overrides: tuple[RuleChoice, ...] = ()
    base: str | None = None
    dtype: str | None = None
    shard_size: int | None = None
    seed: int = 0
    plugins: tuple[str, ...] = ()  # modules imported before the rules are checked
    # PEFT adapter inputs (meta_consensus.merge.adapters): a base model the merged update is added
    # to (a full checkpoint out), the adapter method after a robust rule, and the rule's space.
    merge_into_base: str | None = None
    adapter_method: str | None = None
    space: str = "products"


# ----------------------------------------------------------------------------- reading


def parse_value(text: str) -> Any:
    """Read a parameter value as TOML (``3``, ``0.5``, ``true``, ``[1, 2]``, ``"s"``), else as a string.

    Args:
      text: The value as typed after ``=``.

    Returns:
      The TOML value, or ``text`` itself when it is no TOML value (``--set method.x=median``).
    """
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """Read ``--set`` options: ``["method.beta=0.1", ...]`` -> ``{"beta": 0.1}``.

    Args:
      items: The ``method.PARAM=VALUE`` strings; values are read by :func:`parse_value`.

    Returns:
      Parameter name -> value (a later item wins over an earlier one of the same name).

    Raises:
      MergeError: If an item has no ``=``, or its name lacks the ``method.`` prefix.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.startswith("method.") or key == "method.":
            raise MergeError(f"--set {item!r}: expected method.PARAM=VALUE (e.g. --set method.max_iter=50)")
        out[key.removeprefix("method.")] = parse_value(value)
    return out


def parse_override(text: str) -> RuleChoice:
    """Read an ``--override``: ``PATTERN=METHOD[,PARAM=VALUE...][,num_byzantine=F]``.

    The pattern ends at the first ``=``, so it cannot hold one; the method and parameters are
    checked later, with the plan (:func:`check_rule`).

    Args:
      text: The option's value.

    Returns:
      A :class:`RuleChoice` whose ``pattern`` selects the keys it merges.

    Raises:
      MergeError: If the pattern or method is missing, or a parameter is not ``PARAM=VALUE``.
    """
    pattern, eq, rest = text.partition("=")  # so a pattern holds no '='
    if not eq or not pattern or not rest:
        raise MergeError(f"--override {text!r}: expected PATTERN=METHOD[,PARAM=VALUE...]")
    method, *pairs = rest.split(",")
    params: dict[str, Any] = {}
    for pair in pairs:
        k, eq2, v = pair.partition("=")
        if not eq2:
            raise MergeError(f"--override {text!r}: {pair!r} is not PARAM=VALUE")
        params[k.strip()] = parse_value(v)
    f = params.pop("num_byzantine", None)
    return RuleChoice(method.strip(), params, f, pattern)


def parse_shard_size(text: Any) -> int | None:
    """Read a shard size (``"2GB"``, ``"500MB"``, a number of bytes) as bytes.

    Args:
      text: The size, or None.

    Returns:
      The size in bytes; None when ``text`` is None.

    Raises:
      MergeError: If the size is malformed.
    """
    from consensus.io import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise MergeError(f"shard size: {e}") from e


def plan_from_toml(path: str | Path, **overrides: Any) -> MergePlan:
    """Read a plan from a TOML file; keyword arguments (from the command line) win over its values.

    Keys: ``method``, ``num_byzantine``, ``inputs`` (list), ``out``, ``base``,
    ``dtype``, ``shard_size``, ``seed``, ``weights`` (one per input, as ``--weights``),
    ``plugins`` (modules that declare more merge methods, as ``--plugin``), for PEFT adapter
    inputs ``merge_into_base``, ``adapter_method`` and ``space`` (as the options), ``[params]``
    (the method's parameters) and ``[[overrides]]`` tables with ``pattern``, ``method``, ``num_byzantine`` and
    ``params``. The plan's plug-ins are the file's, then the command line's.

    Args:
      path: The TOML file.
      **overrides: Values from the command line, under the file's key names (plus ``overrides``,
        a list of :class:`RuleChoice`, added after the file's); None and empty values are unset
        and leave the file's. ``params`` are merged into the file's ``[params]``.

    Returns:
      The plan, not yet checked (:func:`check_plan`).

    Raises:
      MergeError: If the file cannot be read or is not TOML, holds an unknown key, gives no
        method, has an ``[[overrides]]`` table without a pattern or a method, lists plug-ins
        that are not module names, or has malformed weights or shard size.
    """
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise MergeError(f"cannot read merge config {path}: {e}") from e
    known = {
        "method",
        "num_byzantine",
        "inputs",
        "out",
        "base",
        "dtype",
        "shard_size",
        "seed",
        "weights",
        "params",
        "overrides",
        "plugins",
        "merge_into_base",
        "adapter_method",
        "space",
    }
    unknown = sorted(set(doc) - known)
    if unknown:
        raise MergeError(f"{path}: unknown keys {unknown}; valid keys: {sorted(known)}")
    values = {k: v for k, v in overrides.items() if v not in (None, [], (), {})}
    method = values.get("method", doc.get("method"))
    if not method:
        raise MergeError(f'{path}: no method (set method = "..." or pass --method)')
    params = {**dict(doc.get("params", {})), **values.get("params", {})}
    weights = parse_weights(values.get("weights", doc.get("weights")))
    if weights is not None:
        params["weights"] = list(weights)
    f = values.get("num_byzantine", doc.get("num_byzantine"))
    over = []
    for o in doc.get("overrides", []):
        if "pattern" not in o or "method" not in o:
            raise MergeError(f"{path}: every [[overrides]] needs a pattern and a method, got {o}")
        over.append(RuleChoice(o["method"], dict(o.get("params", {})), o.get("num_byzantine"), o["pattern"]))
    over += list(values.get("overrides", []))
    listed = doc.get("plugins", [])
    if not isinstance(listed, list) or not all(isinstance(m, str) and m.strip() for m in listed):
        raise MergeError(
            f'{path}: plugins must be a list of module names (plugins = ["my_rules"]), got {listed!r}'
        )
    return MergePlan(
        inputs=tuple(values.get("inputs", doc.get("inputs", ()))),
        out=values.get("out", doc.get("out")) or "",
        rule=RuleChoice(method, params, f),
        overrides=tuple(over),
        base=values.get("base", doc.get("base")),
        dtype=values.get("dtype", doc.get("dtype")),
        shard_size=parse_shard_size(values.get("shard_size", doc.get("shard_size"))),
        seed=int(values.get("seed", doc.get("seed", 0))),
        plugins=tuple(dict.fromkeys([*listed, *values.get("plugins", [])])),
        merge_into_base=values.get("merge_into_base", doc.get("merge_into_base")),
        adapter_method=values.get("adapter_method", doc.get("adapter_method")),
        space=values.get("space", doc.get("space", "products")),
    )


# ----------------------------------------------------------------------------- checks


def check_plan(plan: MergePlan, *, overwrite: bool = False) -> Any:
    """Refuse a plan that cannot run, before any input is opened.

    The plan's plug-ins are imported first, so that their rules are valid names.

    Args:
      plan: The plan to check.
      overwrite: Accept an existing output folder (the merge replaces it).

    Returns:
      The output dtype of float tensors, or None to keep the inputs'.

    Raises:
      MergeError: If there are no inputs or no output, the output exists, the dtype is no
        safetensors dtype, an adapter-only option is given for checkpoints, a plug-in cannot be
        imported, or a rule cannot merge the inputs as given (:func:`check_rule`; its
        ``ByzantineToleranceError`` becomes a MergeError naming the number of inputs).
      RegistryError: If a rule is given a parameter it does not take.
    """
    from consensus.base import ByzantineToleranceError

    load_plan_plugins(plan)
    if len(plan.inputs) < 1:
        raise MergeError("no inputs: give the checkpoints to merge (files or folders)")
    if not plan.out:
        raise MergeError("no output folder: give --out DIR")
    out = Path(plan.out)
    if out.exists() and not overwrite:
        raise MergeError(f"output {out} exists; choose a new folder (nothing is ever overwritten)")
    out_dtype = None if plan.dtype is None else output_dtype(plan.dtype)
    adapter_options = [
        name
        for name, given in (
            ("--merge-into-base", plan.merge_into_base is not None),
            ("--adapter-method", plan.adapter_method is not None),
            ("--space", plan.space != "products"),
        )
        if given
    ]
    if adapter_options:
        raise MergeError(
            f"{', '.join(adapter_options)}: for PEFT adapter inputs (folders with adapter_config.json); "
            "these inputs are checkpoints"
        )
    n = len(plan.inputs)
    try:
        for choice in (plan.rule, *plan.overrides):
            check_rule(choice, n, plan.base is not None)
    except ByzantineToleranceError as e:
        raise MergeError(f"{e} ({n} inputs given)") from e
    return out_dtype


def load_plan_plugins(plan: MergePlan) -> None:
    """Import the plan's plug-in modules, so their rules are valid names (a second import is a no-op).

    Args:
      plan: The plan whose ``plugins`` are imported.

    Raises:
      MergeError: If a module is missing or raises on import (one line, naming it).
    """
    from consensus.plugins import PluginError, load_plugins

    try:
        load_plugins(plan.plugins)
    except PluginError as e:
        raise MergeError(f"plugins: {e}") from None


def output_dtype(name: str) -> Any:
    """Look up the safetensors dtype called ``name``.

    Args:
      name: A dtype name (``bfloat16``, ``float32``) or a safetensors code (``BF16``, ``F32``).

    Returns:
      The numpy dtype (``ml_dtypes.bfloat16`` for bfloat16).

    Raises:
      MergeError: If ``name`` is no dtype that safetensors stores.
    """
    from consensus import io

    try:
        names = {d.name: d for d in io.safetensors.DTYPE_CODES.values()}
        dtype = names.get(name) or io.safetensors.DTYPE_CODES.get(name.upper())
        if dtype is None:
            raise MergeError(f"--dtype {name!r} is not a safetensors dtype; valid: {sorted(names)}")
        io.safetensors.dtype_code(dtype)
    except io.CheckpointError as e:
        raise MergeError(f"--dtype {name!r}: {e}") from e
    return dtype


def check_rule(choice: RuleChoice, n: int, has_base: bool) -> None:
    """Refuse a rule that does not merge n inputs into one as the plan gives it.

    Everything is read from the rule's spec: its kind, parameters, needs and precondition on
    (n, f); the rule is then built once, so a parameter value its factory refuses is found here.

    Args:
      choice: The rule and its parameters.
      n: The number of inputs.
      has_base: Whether the plan gives a base model.

    Raises:
      MergeError: If the method is unknown or is no merge (a pre-aggregator), the weights are
        not one per input or the rule takes none, a required parameter or f is missing, f is
        negative, the rule needs more inputs, a vector rule's output is no weighted combination
        of the inputs, the rule needs a base and none is given, needs what the merge command
        cannot provide, or its factory refuses the parameters.
      RegistryError: If a parameter is not one of the rule's.
      ByzantineToleranceError: If n inputs are too few for f Byzantine ones.
    """
    from consensus.registry import RULES

    if choice.method not in RULES:
        raise MergeError(f"unknown method {choice.method!r}; valid methods: {merge_methods()}")
    spec = choice.spec
    if spec.kind not in MERGE_KINDS:
        raise MergeError(
            f"{choice.method} is a {spec.kind!r} rule (n -> n), not a merge; valid methods: {merge_methods()}"
        )
    weights = choice.params.get("weights")
    if weights is not None and "weights" not in spec.params:
        takes = [m for m in merge_methods() if "weights" in RULES[m].params]
        raise MergeError(f"{choice.label()} takes no per-input weights; methods that do: {takes}")
    if weights is not None and (not isinstance(weights, (list, tuple)) or len(weights) != n):
        raise MergeError(
            f"{choice.label()}: {len(weights) if isinstance(weights, (list, tuple)) else weights!r} "
            f"weights for {n} inputs; give one weight per input (--weights W1,W2,...)"
        )
    spec.check_params(choice.params)
    missing = [p for p in spec.required if p not in choice.params]
    if missing:
        raise MergeError(f"{choice.label()} needs parameter(s) {missing} (--set method.NAME=VALUE)")
    if spec.takes_f and choice.num_byzantine is None:
        raise MergeError(
            f"{choice.label()} needs --num-byzantine F (how many of the {n} inputs may be Byzantine)"
        )
    f = choice.num_byzantine or 0
    if f < 0:
        raise MergeError(f"num_byzantine must be >= 0, got {f}")
    if not spec.takes_f and spec.requirement(n, 0) is not None:
        need = str(spec.requirement(n, 0)).replace("valid node", "input")
        raise MergeError(f"{choice.label()} needs {need}; {n} given")
    spec.check(n, f)
    if spec.kind == "vector" and not spec.traits.get("linear", True):
        raise MergeError(
            f"{choice.method}: its output is no weighted combination of the inputs, so it cannot be "
            f"streamed from whole-model weights; valid methods: {merge_methods()}"
        )
    if spec.needs_base and not has_base:
        raise MergeError(
            f"{choice.label()} merges task vectors: it needs --base BASE (the common pre-trained model)"
        )
    if "weights" in spec.needs and weights is None:
        raise MergeError(
            f"{choice.label()} needs per-input weights: give --weights W1,W2,... (one per input)"
        )
    unsupported = sorted(set(spec.needs) - PROVIDED_NEEDS)
    if unsupported:
        raise MergeError(
            f"{choice.label()} needs {unsupported}, which the merge command cannot provide; "
            f"valid methods: {merge_methods()}"
        )
    try:
        choice.build()
    except (TypeError, ValueError) as e:
        raise MergeError(f"{choice.label()}: {e}") from e


def assign_rules(keys: Sequence[str], plan: MergePlan) -> dict[str, RuleChoice]:
    """Give every key its rule: the first override whose pattern matches it, else the default.

    Patterns are regular expressions searched anywhere in the key (``re.search``).

    Args:
      keys: The inputs' tensor keys.
      plan: The plan with the default rule and the overrides.

    Returns:
      Key -> its :class:`RuleChoice`, in ``keys``' order.

    Raises:
      MergeError: If a pattern is not a regular expression, or matches no key (a typo would
        otherwise merge those tensors with the default rule unnoticed).
    """
    compiled = []
    for o in plan.overrides:
        try:
            compiled.append((re.compile(o.pattern or ""), o))
        except re.error as e:
            raise MergeError(f"override pattern {o.pattern!r} is not a regular expression: {e}") from e
    out, used = {}, set()
    for k in keys:
        choice = plan.rule
        for i, (rx, o) in enumerate(compiled):
            if rx.search(k):
                choice = o
                used.add(i)
                break
        out[k] = choice
    unused = [o.pattern for i, (_, o) in enumerate(compiled) if i not in used]
    if unused:
        raise MergeError(
            f"override pattern(s) {unused} match no key of the inputs (keys look like {keys[:3]})"
        )
    return out
