"""Registries of the node side: tasks and attacks (node strategies live in :mod:`strategies.node`).

Like :mod:`consensus.registry`, these are the edge that names things for configs
and benchmarks; the library API stays plain classes and functions. A task is
named in a config by a registered name (``"digits"``) or by an import path
``"package.module:factory"`` (:func:`resolve_task`), so a user's own model runs
through ``meta-consensus run`` without touching this package.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from consensus.registry import Registry, RegistryError
from strategies import attacks as attack_lib
from strategies.tasks.base import Task

# ----------------------------------------------------------------------------- tasks


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A registered task: ``factory(**options) -> Task``; its options are the factory's parameters."""

    name: str
    factory: Callable[..., Task]
    summary: str = ""

    @property
    def params(self) -> dict[str, inspect.Parameter]:
        return dict(inspect.signature(self.factory).parameters)

    def build(self, **options: Any) -> Task:
        valid = list(self.params)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in self.params.values()):
            unknown = sorted(set(options) - set(valid))
            if unknown:
                raise RegistryError(
                    f"task {self.name!r} takes no option(s) {unknown}; valid options: {valid}"
                )
        return self.factory(**options)


TASKS: Registry[TaskSpec] = Registry("task")


def register_task(name: str, factory: Callable[..., Task], summary: str = "") -> TaskSpec:
    """Register a task factory under ``name`` (its keyword arguments become ``task.options``)."""
    doc = (inspect.getdoc(factory) or "").split("\n", 1)[0]
    return TASKS.register(name, TaskSpec(name, factory, summary or doc))


def _digits(hidden: tuple[int, ...] = (32,)) -> Task:
    """scikit-learn's 8x8 digits (1,797 images), an MLP."""
    from strategies.tasks.digits import DigitsTask

    return DigitsTask(hidden=tuple(hidden))


def _text(**options: Any) -> Task:
    """A byte-level transformer on a small embedded text corpus."""
    from strategies.tasks.text import TextTask

    return TextTask(**options)


def _fashion_mnist(
    model: str = "mlp",
    hidden: tuple[int, ...] = (256,),
    channels: tuple[int, int] = (16, 32),
    data_dir: str | None = None,
    heldout_size: int = 5000,
    limit: int | None = None,
) -> Task:
    """Fashion-MNIST (70,000 28x28 images) from its IDX files, an MLP or a small CNN."""
    from strategies.tasks.fashion_mnist import FashionMNISTTask

    return FashionMNISTTask(
        model=model,
        hidden=tuple(hidden),
        channels=tuple(channels),
        data_dir=data_dir,
        heldout_size=heldout_size,
        limit=limit,
    )


register_task("digits", _digits)
register_task("text", _text)
register_task("fashion_mnist", _fashion_mnist)

# The methods every task must have (the Task protocol), for the error on an object that lacks some.
TASK_METHODS = ("init", "apply", "loss", "metrics", "logical_axes", "flip_labels", "splits")


def check_task(obj: Any, origin: str) -> Task:
    """Raise a TypeError naming what ``obj`` lacks of the :class:`~strategies.tasks.base.Task` protocol."""
    missing = [m for m in TASK_METHODS if not callable(getattr(obj, m, None))]
    if not isinstance(getattr(obj, "name", None), str):
        missing.insert(0, "name (a str attribute)")
    if missing:
        raise TypeError(
            f"{origin} is not a Task: it has no {', '.join(missing)} "
            "(see strategies.tasks.base.Task, or build one with strategies.tasks.task_from_arrays)"
        )
    return obj


def resolve_task(name: str, options: Mapping[str, Any] | None = None) -> Task:
    """The task a config names: a registered name, or ``"package.module:factory"`` called with the options.

    The import path may name a factory (called with ``**options``) or a ready Task object.
    """
    options = dict(options or {})
    if ":" not in name:
        return check_task(TASKS[name].build(**options), f"task {name!r}")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RegistryError(f"task {name!r}: cannot import module {module_name!r} ({e})") from e
    if not hasattr(module, attr):
        raise RegistryError(f"task {name!r}: module {module_name!r} has no attribute {attr!r}")
    target = getattr(module, attr)
    if isinstance(target, type) or (callable(target) and not hasattr(target, "splits")):
        try:
            obj = target(**options)
        except TypeError as e:
            raise RegistryError(f"task {name!r}: calling {attr}(**{options}) failed: {e}") from e
    else:
        if options:
            raise RegistryError(
                f"task {name!r} is an object, not a factory: it takes no options {sorted(options)}"
            )
        obj = target
    return check_task(obj, f"task {name!r}")


# ----------------------------------------------------------------------------- attacks


@dataclasses.dataclass(frozen=True)
class AttackSpec:
    """A registered attack. ``fn(key, honest, num_byzantine, **options)`` returns the f Byzantine trees.

    ``fn`` is None for data attacks (label flipping), which poison training instead of the update.
    """

    name: str
    fn: Callable[..., Any] | None
    summary: str = ""

    @property
    def options(self) -> list[str]:
        """The attack's keyword options (after key, honest, f; the system passes num_nodes itself)."""
        if self.fn is None:
            return []
        params = list(inspect.signature(self.fn).parameters)[3:]
        return [p for p in params if p != "num_nodes"]

    def check_options(self, options: Mapping[str, Any]) -> None:
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise RegistryError(
                f"{unknown} are not options of the {self.name!r} attack; valid options: {self.options}"
            )


ATTACKS: Registry[AttackSpec] = Registry("attack")


def register_attack(name: str, fn: Callable[..., Any] | None, summary: str = "") -> AttackSpec:
    doc = (inspect.getdoc(fn) or "").split("\n", 1)[0] if fn is not None else ""
    return ATTACKS.register(name, AttackSpec(name, fn, summary or doc))


register_attack("label_flip", None, "Byzantine nodes train on flipped labels (a data attack).")
for _name, _fn in attack_lib.ATTACKS.items():
    register_attack(_name, _fn)
