"""The merge command's user errors: :class:`MergeError`, and every exception type that is the user's."""

from __future__ import annotations


class MergeError(ValueError):
    """A user error of the merge command (found before any output is written)."""


def user_errors() -> tuple[type[Exception], ...]:
    """The exception types that are the user's mistake (one line, exit 2 in the CLI).

    ``meta_consensus.cli`` turns these into its one-line user error.

    Returns:
      :class:`MergeError`, and the library's ``RegistryError``, ``CheckpointError``,
      ``CheckpointKeyError``, ``ByzantineToleranceError`` and ``AdapterError``.
    """
    from consensus.base import ByzantineToleranceError
    from consensus.io import CheckpointError, CheckpointKeyError
    from consensus.lora import AdapterError
    from consensus.registry import RegistryError

    return (
        MergeError,
        RegistryError,
        CheckpointError,
        CheckpointKeyError,
        ByzantineToleranceError,
        AdapterError,
    )
