"""The node side's declared families, gathered for configs: tasks, attacks and node strategies.

Each entry is declared beside its factory (:mod:`consensus.specs`): tasks with
``@TASKS.declare`` in their task module, attacks with ``@ATTACKS.declare`` in
:mod:`strategies.attacks`, node strategies with ``@STRATEGIES.declare`` in
:mod:`strategies.node`. Importing this module declares every built-in one. A
task is named in a config by a declared name (``"digits"``) or by an import path
``"package.module:factory"`` (:func:`resolve_task`), so a user's own model runs
through ``meta-consensus run`` without touching this package.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

# The task modules declare their tasks on import; fashion_mnist and causal_lm are not imported by
# strategies.tasks (causal_lm loads its model and tokenizer only when a task is built).
import strategies.tasks.causal_lm  # noqa: F401
import strategies.tasks.fashion_mnist  # noqa: F401
from consensus.plugins import make_cwd_importable
from consensus.specs import Registry, RegistryError, Spec
from strategies.attacks import ATTACKS, attack_options
from strategies.node import STRATEGIES, build_strategy, strategy_options
from strategies.tasks.base import TASKS, Task
from strategies.tasks.checks import NotATaskError, TaskError, one_line

__all__ = [
    "ATTACKS",
    "STRATEGIES",
    "TASKS",
    "Registry",
    "RegistryError",
    "Spec",
    "attack_options",
    "build_strategy",
    "build_task",
    "check_task",
    "resolve_task",
    "strategy_options",
]

# The methods every task must have (the Task protocol), for the error on an object that lacks some.
TASK_METHODS = ("init", "apply", "loss", "metrics", "logical_axes", "flip_labels", "splits")


def check_task(obj: Any, origin: str) -> Task:
    """Check that ``obj`` follows the :class:`~strategies.tasks.base.Task` protocol.

    Args:
      obj: the candidate task.
      origin: how the error names it (e.g. ``"task 'digits'"``).

    Returns:
      ``obj`` itself.

    Raises:
      NotATaskError: (a TypeError) naming what ``obj`` lacks of the protocol.
    """
    missing = [m for m in TASK_METHODS if not callable(getattr(obj, m, None))]
    if not isinstance(getattr(obj, "name", None), str):
        missing.insert(0, "name (a str attribute)")
    if missing:
        raise NotATaskError(
            f"{origin} is not a Task: it has no {', '.join(missing)} "
            "(see strategies.tasks.base.Task, or build one with strategies.tasks.task_from_arrays)"
        )
    return obj


def build_task(name: str, options: Mapping[str, Any] | None = None) -> Task:
    """The declared task ``name`` built with ``options``.

    Args:
      name: a name in :data:`TASKS`.
      options: keyword arguments of its factory (default: none).

    Returns:
      The task.

    Raises:
      RegistryError: for an unknown name or options the factory does not take.
      ValueError: for a bad option value (the factory's own error, a TaskError included).
      TaskError: when the factory fails otherwise (a plug-in's code, a data file it reads).
    """
    spec = TASKS[name]
    options = dict(options or {})
    unknown = sorted(set(options) - set(spec.params))
    if unknown and not spec.takes_any_option:
        raise RegistryError(f"task {name!r} takes no option(s) {unknown}; valid options: {list(spec.params)}")
    try:
        return spec.factory(**options)
    except (ValueError, KeyboardInterrupt):  # a bad option (or an already one-line TaskError)
        raise
    except Exception as e:  # the factory fails: a plug-in's code, a data file it reads
        raise TaskError(f"task {name!r}: its factory failed: {one_line(e)}") from e


def resolve_task(name: str, options: Mapping[str, Any] | None = None) -> Task:
    """The task a config names: a declared name, or ``"package.module:factory"`` called with the options.

    The import path may name a factory (called with ``**options``) or a ready Task object; the
    current directory is importable, as with ``python -m``.

    Args:
      name: a declared name, or ``"package.module:attribute"``.
      options: keyword arguments of the factory (default: none).

    Returns:
      The task, checked against the protocol (:func:`check_task`).

    Raises:
      RegistryError: for an unknown name, a module that cannot be imported, a missing
        attribute, options the factory does not take, or options given to a ready object.
      TaskError: when the user's module or factory fails.
      NotATaskError: when the result is not a Task.
    """
    options = dict(options or {})
    if ":" not in name:
        return check_task(build_task(name, options), f"task {name!r}")
    module_name, _, attr = name.partition(":")
    make_cwd_importable()
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RegistryError(f"task {name!r}: cannot import module {module_name!r} ({e})") from e
    except Exception as e:  # the user's module fails while it imports
        raise TaskError(f"task {name!r}: importing {module_name!r} failed: {one_line(e)}") from e
    if not hasattr(module, attr):
        raise RegistryError(f"task {name!r}: module {module_name!r} has no attribute {attr!r}")
    target = getattr(module, attr)
    if isinstance(target, type) or (callable(target) and not hasattr(target, "splits")):
        try:
            obj = target(**options)
        except TaskError as e:  # already one line (task_from_arrays' checks)
            raise TaskError(f"task {name!r}: {e}") from e
        except TypeError as e:
            if e.__traceback__ is not None and e.__traceback__.tb_next is None:  # the call's arguments
                raise RegistryError(f"task {name!r}: calling {attr}(**{options}) failed: {e}") from e
            raise TaskError(f"task {name!r}: {attr}(**{options}) failed: {one_line(e)}") from e
        except Exception as e:  # the user's factory fails
            raise TaskError(f"task {name!r}: {attr}(**{options}) failed: {one_line(e)}") from e
    else:
        if options:
            raise RegistryError(
                f"task {name!r} is an object, not a factory: it takes no options {sorted(options)}"
            )
        obj = target
    return check_task(obj, f"task {name!r}")
