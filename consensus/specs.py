"""Declarations: every nameable thing is declared once, beside its factory.

A *spec* says once what the package needs to know about a rule, merge method,
attack, node strategy, weight objective or task: its kind, its parameters (read
from the factory's signature, with defaults), its precondition on (n, f) with the
message, its DP sensitivity, what the caller must pass (a key, a base model), and
its capabilities. The registry entry, config validation, the runtime check, the
merge command's ``--method`` choices, the docs tables and the test table's
coverage all read the spec, so nothing about an entry is written twice.

One :class:`Registry` type serves every family. A factory is declared with the
registry's decorator, in the manner of mergekit's ``@merge_method``::

    from consensus.specs import RULES, need

    @RULES.declare(kind="coordinatewise", takes_f=True,
                   precondition=lambda n, f: need(n > 2 * f, f"n > 2f = {2 * f}"))
    def my_rule(num_byzantine: int) -> Aggregator: ...

A user's own module declares entries the same way; naming that module in a
config (``plugins = ["my_module"]``), on the command line (``--plugin``) or as an
entry point of the group ``meta_consensus.plugins`` (see :mod:`consensus.plugins`)
makes them valid everywhere a built-in entry is.

The library API stays plain functions: a declared rule factory still returns an
:class:`~consensus.base.Aggregator`, which carries its spec (``agg.spec``) so that
a pipeline reads capabilities as data, never from the rule's name.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, ItemsView, Iterator, Mapping
from typing import Any, Generic, TypeVar

Precondition = Callable[[int, int], str | None]
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

#: The node-level DP sensitivity of a rule whose output stays in the clipping ball around the last
#: consensus; rules that know better say so in their declaration.
DEFAULT_SENSITIVITY = "2C (any output in the C-ball around the last consensus)"


class RegistryError(ValueError):
    """An unknown name, a duplicate declaration, or a parameter the declared factory does not take."""


def need(ok: bool, text: str) -> str | None:
    """Return a precondition's answer: None when it holds, else what is needed (``"n > 2f = 4"``).

    Args:
      ok: Whether the precondition holds.
      text: The requirement in words.

    Returns:
      None when ``ok``, else ``text``.
    """
    return None if ok else text


@functools.cache
def at_least(k: int) -> Precondition:
    """Return the precondition "at least k valid nodes" (f plays no part).

    Args:
      k: The fewest valid nodes.

    Returns:
      A precondition ``(n, f) -> str | None`` (cached: one function per k).
    """
    plural = "s" if k > 1 else ""
    return lambda n, f: need(n >= k, f"at least {k} valid node{plural}")


@functools.cache
def exactly(k: int) -> Precondition:
    """Return the precondition "exactly k valid nodes" (f plays no part).

    Args:
      k: The number of valid nodes.

    Returns:
      A precondition ``(n, f) -> str | None`` (cached: one function per k).
    """
    return lambda n, f: need(n == k, f"exactly {k} valid nodes")


def honest_majority(n: int, f: int) -> str | None:
    """Check the honest-majority precondition n > 2f: more honest than Byzantine nodes.

    Args:
      n: The number of valid nodes.
      f: The number of Byzantine nodes.

    Returns:
      None when it holds, else the requirement in words.
    """
    return need(n > 2 * f, f"n > 2f = {2 * f}")


def least_count(precondition: Precondition, f: int, upto: int) -> int:
    """Return the fewest valid nodes, at most ``upto``, for which ``precondition`` holds.

    Preconditions are monotone in the count (more valid nodes never hurt up to the stack's n), so
    under an outer jit a rule compares its traced valid count with this bound, found on the host
    from the same declared precondition.

    Args:
      precondition: A precondition ``(n, f) -> str | None``.
      f: The number of Byzantine nodes.
      upto: The largest count tried (the stack's n).

    Returns:
      The fewest count, or ``upto + 1`` when none up to ``upto`` suffices.
    """
    return next((m for m in range(upto + 1) if precondition(m, f) is None), upto + 1)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One declared entry of a family (see the module docstring).

    Attributes:
      name: the name configs, the CLI and the docs use.
      family: the registry's family ("aggregation rule", "attack", ...).
      factory: the declared callable; for rules it returns an Aggregator or PreAggregator
        that carries this spec.
      kind: the family's sub-kind: for rules ``"coordinatewise"``, ``"vector"``, ``"pre"``
        (n -> n) or ``"merge"`` (a merge method over task vectors); for attacks ``"update"``
        or ``"data"``; empty where the family has one kind.
      takes_f: the factory's first argument is ``num_byzantine``.
      precondition: static function of (n valid nodes, f): None when the entry can run,
        else the requirement. The config check, the merge command and the rule's own runtime
        check all call it.
      formula: the precondition in words for the docs table, where its requirement at
        n = 1, f = 1 would not show its shape (a rule with parameters in its precondition).
      sensitivity: the node-level DP sensitivity, in words.
      needs: what the caller must pass besides the stacked trees: ``"params"`` (the base /
        current global model), ``"key"`` (randomized), ``"server_update"``, ``"fisher"``, ...
      defaults: values for required parameters that configs and benchmarks may leave unset.
      summary: one line for docs and error messages (the docstring's first line by default).
      order_matters: the output depends on the nodes' order (SLERP's endpoints).
      elementwise: output coordinate k depends only on coordinate k of the inputs (and the base)
        and on which nodes are valid, so the rule may be streamed in column chunks.
      reads_views: the rule's update reads a pre-aggregator's lazy view (no materialised stack).
      reads_dropped: the rule's update reads DARE's lazily dropped rows.
      centre: for pre-aggregators without a base: where a view is centred. ``"median"`` (the
        coordinate-wise median of the nodes), ``"zero"`` (clipping is around 0) or ``"none"``
        (mixing needs no centre).
      traits: family-specific data (for example ``{"classification": True}`` for a weight
        objective that needs per-class logits).
      module: the module that declared the entry (``consensus.aggregators.krum``, or the
        user's plug-in).
    """

    name: str
    family: str
    factory: Callable[..., Any]
    kind: str = ""
    takes_f: bool = False
    precondition: Precondition = at_least(1)
    formula: str = ""
    sensitivity: str = DEFAULT_SENSITIVITY
    needs: frozenset[str] = frozenset()
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    summary: str = ""
    order_matters: bool = False
    elementwise: bool = False
    reads_views: bool = False
    reads_dropped: bool = False
    centre: str = "median"
    traits: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    module: str = ""

    @property
    def randomized(self) -> bool:
        """The entry draws randomness: the caller passes a ``jax.random`` key."""
        return "key" in self.needs

    @property
    def needs_base(self) -> bool:
        """The entry needs the base (or current global) model as ``params``."""
        return "params" in self.needs

    @property
    def permutation_invariant(self) -> bool:
        """Whether permuting the nodes leaves the output unchanged (not for keyed draws per node)."""
        return not self.order_matters and not self.randomized

    @property
    def params(self) -> dict[str, inspect.Parameter]:
        """The factory's parameters other than ``num_byzantine`` (name -> inspect.Parameter)."""
        sig = inspect.signature(self.factory).parameters
        return {
            k: p
            for k, p in sig.items()
            if not (self.takes_f and k == "num_byzantine")
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        }

    @property
    def takes_any_option(self) -> bool:
        """The factory takes ``**options`` (then unknown option names cannot be checked here)."""
        sig = inspect.signature(self.factory).parameters
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.values())

    @property
    def required(self) -> tuple[str, ...]:
        """Parameters without a default and without a declared default: the caller must give them."""
        return tuple(
            k
            for k, p in self.params.items()
            if p.default is inspect.Parameter.empty and k not in self.defaults
        )

    def requirement(self, n: int, f: int) -> str | None:
        """Return None when the entry runs on n valid nodes with f Byzantine ones, else what it needs.

        Args:
          n: The number of valid nodes.
          f: The number of Byzantine nodes.

        Returns:
          None, or the requirement in words.
        """
        return self.precondition(n, f)

    def check(self, n: int, f: int) -> None:
        """Raise ByzantineToleranceError naming the entry, n, f and what it needs (base.require's text).

        Args:
          n: The number of valid nodes.
          f: The number of Byzantine nodes.

        Raises:
          ByzantineToleranceError: If the precondition does not hold.
        """
        from consensus.base import require

        needed = self.precondition(n, f)
        require(self.name, n, f, needed is None, needed or "")

    def check_params(self, params: Mapping[str, Any]) -> None:
        """Check parameter names against the factory's; unknown ones are an error listing the valid ones.

        Args:
          params: Parameter name -> value.

        Raises:
          RegistryError: If a name is not a parameter of the factory (unless it takes
            ``**options``).
        """
        if self.takes_any_option:
            return
        valid = list(self.params)
        unknown = sorted(set(params) - set(valid))
        if unknown:
            raise RegistryError(f"{self.name} takes no parameter(s) {unknown}; valid parameters: {valid}")

    def build(self, f: int | None = None, **params: Any) -> Any:
        """Build the entry with f (when it takes one) and the given parameters over ``defaults``.

        The parameter names are checked first (:meth:`check_params`).

        Args:
          f: The number of Byzantine nodes, for entries that take one.
          **params: The factory's other parameters.

        Returns:
          What the factory returns (for rules, an Aggregator or PreAggregator).

        Raises:
          RegistryError: If a parameter is unknown, or f is missing for an entry that takes one.
        """
        self.check_params(params)
        params = {**self.defaults, **params}
        if self.takes_f:
            if f is None:
                raise RegistryError(f"{self.name} needs num_byzantine (f)")
            return self.factory(f, **params)
        return self.factory(**params)


class Registry(Generic[T]):
    """Name -> spec for one family, with errors that list the valid names.

    Iteration is in declaration order. ``stamp(built, spec)``, when given, is applied to
    what a declared factory returns (the rule registry hands the spec to each Aggregator).
    """

    def __init__(self, family: str, stamp: Callable[[Any, Spec], Any] | None = None):
        self.family = family
        self._stamp = stamp
        self._specs: dict[str, T] = {}

    def register(self, name: str, spec: T, *, replace: bool = False) -> T:
        """Add ``spec`` under ``name``; a second entry of one name is an error unless ``replace``.

        Args:
          name: The entry's name.
          spec: Its spec.
          replace: Replace an existing entry of that name.

        Returns:
          ``spec``.

        Raises:
          RegistryError: If the name is taken and ``replace`` is False.
        """
        if name in self._specs and not replace:
            raise RegistryError(f"{self.family} {name!r} is already registered")
        self._specs[name] = spec
        return spec

    def unregister(self, name: str) -> T:
        """Remove and return an entry (for tests and for plug-ins that replace a built-in).

        Args:
          name: The entry's name.

        Returns:
          Its spec.

        Raises:
          KeyError: If there is no such entry.
        """
        return self._specs.pop(name)

    def declare(self, name: str | None = None, *, replace: bool = False, **fields: Any) -> Callable[[F], F]:
        """Declare the decorated factory under ``name`` (its own name by default) with the spec's fields.

        The summary defaults to the first line of the factory's docstring.

        Args:
          name: The entry's name, or None for the factory's ``__name__``.
          replace: Replace an existing entry of that name.
          **fields: The :class:`Spec` fields (``kind``, ``takes_f``, ``precondition``, ...).

        Returns:
          A decorator that registers the factory and returns it (wrapped to stamp its results
          when this registry stamps).

        Raises:
          RegistryError: When decorating, if the name is taken and ``replace`` is False.
        """

        def decorate(factory: F) -> F:
            entry = name or factory.__name__
            declared: F = factory
            if self._stamp is not None:
                stamp = self._stamp

                @functools.wraps(factory)
                def declared_factory(*args: Any, **kwargs: Any) -> Any:
                    return stamp(factory(*args, **kwargs), spec)

                declared = declared_factory  # type: ignore[assignment]
            fields.setdefault("summary", (inspect.getdoc(factory) or "").split("\n", 1)[0])
            fields["needs"] = frozenset(fields.get("needs", ()))
            fields["defaults"] = dict(fields.get("defaults") or {})
            spec = Spec(name=entry, family=self.family, factory=declared, module=factory.__module__, **fields)
            self.register(entry, spec, replace=replace)  # type: ignore[arg-type]
            return declared

        return decorate

    def __getitem__(self, name: str) -> T:
        try:
            return self._specs[name]
        except KeyError:
            valid = sorted(self._specs)
            raise RegistryError(f"unknown {self.family} {name!r}; valid choices: {valid}") from None

    def get(self, name: str, default: T | None = None) -> T | None:
        """Return the spec of ``name``, or ``default`` when there is none."""
        return self._specs.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def names(self, predicate: Callable[[T], bool] | None = None) -> list[str]:
        """Return the registered names (those whose spec satisfies ``predicate``), in declaration order.

        Args:
          predicate: A test on specs, or None for every entry.

        Returns:
          The names.
        """
        return [k for k, s in self._specs.items() if predicate is None or predicate(s)]

    def items(self) -> ItemsView[str, T]:
        """Return (name, spec) pairs, in declaration order."""
        return self._specs.items()


def _stamp_rule(built: Any, spec: Spec) -> Any:
    """Hand a rule's spec to the Aggregator / PreAggregator its factory built (capabilities as data)."""
    fields = getattr(built, "_fields", ())
    if "spec" in fields:
        return built._replace(spec=spec)
    return built


#: Aggregation rules, pre-aggregators and merge methods (``kind`` tells which).
RULES: Registry[Spec] = Registry("aggregation rule", stamp=_stamp_rule)

#: LoRA adapter merge methods (:mod:`consensus.lora`; ``kind="adapter"``). A separate family: they
#: merge factor pairs (a, b) into an adapter, not stacked trees into one, so they are neither vote
#: rules nor ``merge --method`` choices for full checkpoints.
ADAPTER_METHODS: Registry[Spec] = Registry("adapter merge method")
