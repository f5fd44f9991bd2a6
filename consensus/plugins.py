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
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
import traceback
from collections.abc import Iterable
from types import ModuleType

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

    Args:
      modules: Module names.

    Returns:
      The modules.

    Raises:
      PluginError: If one cannot be imported.
    """
    return [import_module(name) for name in modules]


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
        except Exception as e:
            where = _where(e)
            raise PluginError(
                f"installed plug-in {ep.name!r} ({ep.value}) failed to load{where}: {type(e).__name__}: {e}"
            ) from e
        _loaded_entry_points.add(key)
        loaded.append(ep.name)
    return loaded
