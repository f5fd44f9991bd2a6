"""The config's error and the two checks every part of it raises through."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ConfigError(ValueError):
    """A configuration key or value that is not valid; the message says which and what is."""


def check_choice(key: str, value: Any, valid: Sequence[Any]) -> None:
    """Check that ``value`` is one of ``valid``.

    Args:
      key: the dotted key, for the message.
      value: its value.
      valid: the valid choices.

    Raises:
      ConfigError: listing the valid choices.
    """
    if value not in valid:
        raise ConfigError(f"{key} = {value!r} is not valid; choose one of {list(valid)}")


def check(cond: bool, key: str, value: Any, need: str) -> None:
    """Check that ``cond`` holds.

    Args:
      cond: the condition.
      key: the dotted key, for the message.
      value: its value.
      need: what the key needs, for the message.

    Raises:
      ConfigError: saying what ``key`` needs.
    """
    if not cond:
        raise ConfigError(f"{key} = {value!r} is not valid: {need}")
