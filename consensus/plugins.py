"""Plug-ins: the user's own modules declare rules, attacks, strategies, objectives and tasks.

A plug-in is any importable module whose import declares entries with a registry's
decorator (:mod:`consensus.specs`). It is loaded

* by name: ``plugins = ["my_rules"]`` in a run's config, ``--plugin my_rules`` on
  ``meta-consensus run`` and ``meta-consensus merge``, or :func:`load_plugins` from Python;
* by installation: a package that lists a module (or a zero-argument callable) under the
  entry-point group ``meta_consensus.plugins`` is loaded by :func:`load_entry_points`,
  which the command line and config loading call once per process.

The current directory is importable, as with ``python -m``: a ``my_rules.py`` next to
the config is found without setting ``PYTHONPATH``.

A plug-in's vector rules are checked when it loads (:func:`check_vector_rule`): ``meta-consensus
merge`` runs a vector rule on whole-model weights computed from an n x n embedding of the inputs,
so a vector rule must report ``merged = sum_i weights[i] x_i`` in its ``AggregationInfo``, or
declare ``traits={"linear": False}`` (it then serves as a vote only). A rule that breaks this
fails its plug-in's load in one line, not in the middle of a merge.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
import traceback
from collections.abc import Iterable
from types import ModuleType
from typing import Any

ENTRY_POINT_GROUP = "meta_consensus.plugins"

_loaded_entry_points: set[str] = set()


class PluginError(ValueError):
    """A plug-in could not be imported or raised while declaring its entries."""


def make_cwd_importable() -> None:
    """Put the current directory first on ``sys.path`` (as ``python -m`` does) if it is not there."""
    cwd = os.getcwd()
    if not any(os.path.abspath(p or ".") == cwd for p in sys.path):
        sys.path.insert(0, cwd)


def _where(error: BaseException) -> str:
    """``file:line`` of the innermost frame of the error's traceback (the user's own code), or ''."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" at {last.filename}:{last.lineno}"


def import_module(name: str, what: str = "plug-in") -> ModuleType:
    """Import ``name`` (the current directory importable) or raise a one-line PluginError.

    Args:
      name: A module name such as ``"my_rules"``.
      what: What to call it in messages.

    Returns:
      The module.

    Raises:
      PluginError: If the name is empty, the module is not found, or importing it raises
        (the message names the file and line).
    """
    if not isinstance(name, str) or not name.strip():
        raise PluginError(f"{what} must be a module name such as 'my_rules', got {name!r}")
    make_cwd_importable()
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise PluginError(
                f"{what} {name!r}: no module named {e.name!r} "
                f"(looked in the current directory {os.getcwd()} and on sys.path)"
            ) from e
        raise PluginError(f"{what} {name!r} failed to import{_where(e)}: {type(e).__name__}: {e}") from e
    except Exception as e:
        raise PluginError(f"{what} {name!r} failed to import{_where(e)}: {type(e).__name__}: {e}") from e


def load_plugins(modules: Iterable[str]) -> list[ModuleType]:
    """Import each named module (its declarations register its entries); a second import is a no-op.

    The vector rules a module declares are checked against the merge contract
    (:func:`check_vector_rule`) the first time it loads.

    Args:
      modules: Module names.

    Returns:
      The modules.

    Raises:
      PluginError: If one cannot be imported, or one of its vector rules breaks the contract.
    """
    loaded = []
    for name in modules:
        module = import_module(name)
        check_declared_rules(module.__name__, f"plug-in {name!r}")
        loaded.append(module)
    return loaded


_checked_modules: set[str] = set()


def check_declared_rules(module: str, what: str) -> None:
    """Check every vector rule ``module`` declared (once per module and process).

    Args:
      module: The declaring module's name (``Spec.module``; its submodules count too).
      what: What to call the plug-in in messages.

    Raises:
      PluginError: If a declared vector rule breaks the contract of :func:`check_vector_rule`.
    """
    if module in _checked_modules:
        return
    from consensus.specs import RULES

    for _name, spec in list(RULES.items()):
        declared_here = spec.module == module or spec.module.startswith(module + ".")
        if declared_here and spec.kind == "vector" and spec.traits.get("linear", True):
            try:
                check_vector_rule(spec)
            except PluginError as e:
                raise PluginError(f"{what}: {e}") from None
    _checked_modules.add(module)


def check_vector_rule(
    spec: Any, rule: Any = None, n: int | None = None, num_byzantine: int | None = None
) -> None:
    """Check that a vector rule can serve as ``merge --method``: its output is its reported weighting.

    The contract: ``update(stacked, state, params, mask=...)`` returns ``(merged, state)`` whose
    ``AggregationInfo`` has ``linear`` True and (n,) finite ``weights`` with ``merged = sum_i
    weights[i] x_i`` (the centre ``params`` is 0 here, so ``(1 - sum w) params`` vanishes). The
    merge command relies on it: it runs the rule on an n x n embedding of the inputs and applies
    the weights to every tensor. A rule whose output is no weighting of the inputs declares
    ``traits={"linear": False}`` and is then a vote only. The check runs the rule once on n random
    rows of dimension n (n: the fewest its precondition takes at f, at least 3).

    Args:
      spec: The rule's :class:`~consensus.specs.Spec` (kind ``"vector"``).
      rule: The built rule (default: built from the spec with f and its declared defaults).
      n: The number of rows (default: the fewest the precondition takes, at least 3).
      num_byzantine: f (default 1 for a rule that takes f).

    Raises:
      PluginError: One line naming the rule and what it breaks. A rule that needs parameters
        without defaults is not built here (the merge command checks it with its parameters).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from consensus.base import get_info
    from consensus.specs import least_count

    f = (1 if spec.takes_f else 0) if num_byzantine is None else num_byzantine
    if rule is None:
        if spec.required or set(spec.needs) - {"params", "key"}:
            return  # needs what only its caller has (parameters, a server update, weights)
        rule = spec.build(f if spec.takes_f else None)
    if n is None:
        n = max(3, least_count(spec.precondition, f, 64))
    where = f"vector rule {spec.name!r} cannot serve as a merge method"
    fix = " (or declare it with traits={'linear': False}: a vote only)"
    x = np.random.default_rng(0).normal(size=(n, n)).astype(np.float32)
    centre = {"e": jnp.zeros((n,), jnp.float32)}
    extra = {"key": jax.random.key(0)} if "key" in spec.needs else {}
    try:
        merged, state = rule.update(
            {"e": jnp.asarray(x)}, rule.init(centre), centre, mask=jnp.ones((n,), bool), **extra
        )
        info = get_info(state)
    except Exception as e:  # noqa: BLE001 - any failure of the user's rule is its plug-in's error
        raise PluginError(f"{where}: its update on {n} rows raised {type(e).__name__}: {e}") from None
    w = np.asarray(info.weights, np.float64)
    if not info.linear:
        raise PluginError(f"{where}: its AggregationInfo says linear=False{fix}")
    if w.shape != (n,) or not np.all(np.isfinite(w)):
        raise PluginError(
            f"{where}: its AggregationInfo.weights must be {n} finite numbers, got shape {w.shape}"
        )
    got = np.asarray(merged["e"], np.float64)
    want = w @ x.astype(np.float64)
    err = float(np.max(np.abs(got - want)))
    if not err <= 1e-4 * max(1.0, float(np.max(np.abs(x)))):
        raise PluginError(
            f"{where}: its output is not sum_i weights[i] x_i of its AggregationInfo (off by {err:.3g})"
            f"; report the weights its output uses{fix}"
        )


def load_entry_points(group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Load the installed plug-ins of ``group`` once per process; return the names loaded now.

    An entry point may name a module (importing it declares its entries) or a callable,
    which is called with no arguments.

    Args:
      group: The entry-point group (default ``meta_consensus.plugins``).

    Returns:
      The names of the entry points loaded by this call.

    Raises:
      PluginError: If one fails to load (naming it, its file:line and the error).
    """
    loaded = []
    for ep in importlib.metadata.entry_points(group=group):
        key = f"{ep.name}={ep.value}"
        if key in _loaded_entry_points:
            continue
        try:
            target = ep.load()
            if callable(target) and not isinstance(target, ModuleType):
                target()
            check_declared_rules(ep.value.split(":")[0].strip(), f"installed plug-in {ep.name!r}")
        except PluginError:
            raise
        except Exception as e:
            where = _where(e)
            raise PluginError(
                f"installed plug-in {ep.name!r} ({ep.value}) failed to load{where}: {type(e).__name__}: {e}"
            ) from e
        _loaded_entry_points.add(key)
        loaded.append(ep.name)
    return loaded
