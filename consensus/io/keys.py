"""Flat dotted keys for parameter trees, and rename / transpose rules for foreign checkpoints.

A checkpoint stores a flat mapping ``"encoder.layer_0.kernel" -> array``; a tree
is a nested dict (or any pytree). :func:`flatten` and :func:`unflatten` convert
between the two; :class:`KeyMapping` turns the names and layouts of another
framework's checkpoint into this package's (PyTorch's ``fc1.weight`` of shape
(out, in) into Flax's ``fc1.kernel`` of shape (in, out)).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

PyTree = Any
SEPARATOR = "."


class CheckpointKeyError(ValueError):
    """Keys that cannot be written or that do not match the expected ones."""


def _key_part(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            part = str(getattr(entry, attr))
            break
    else:
        part = str(entry)
    if SEPARATOR in part or not part:
        raise CheckpointKeyError(
            f"tree key {part!r} is empty or contains {SEPARATOR!r}; dotted checkpoint keys would be ambiguous"
        )
    return part


def flatten(tree: PyTree) -> dict[str, Any]:
    """Flatten a tree into ``{"a.b.c": leaf}``, in the tree's flattening order.

    Keys join the path's dict keys, sequence indices and attribute names with dots.

    Args:
      tree: A nested dict (or any pytree) of leaves.

    Returns:
      The flat dict, dotted key -> leaf.

    Raises:
      CheckpointKeyError: If the tree is a bare leaf, or a path part is empty or holds a dot.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out: dict[str, Any] = {}
    for path, leaf in flat:
        key = SEPARATOR.join(_key_part(p) for p in path)
        if not key:
            raise CheckpointKeyError("a bare array is not a tree: wrap it in a dict, e.g. {'weight': x}")
        out[key] = leaf
    return out


def unflatten(flat: Mapping[str, Any], like: PyTree | None = None) -> PyTree:
    """Rebuild the tree of ``flat``: the structure of ``like`` when given, else nested dicts from the dots.

    With ``like`` the keys must be exactly ``flatten(like)``'s (callers check
    first, see :func:`check_against`).

    Args:
      flat: Dotted key -> leaf.
      like: A template tree, or None.

    Returns:
      The tree.

    Raises:
      CheckpointKeyError: Without ``like``, when a key is both a tensor and a prefix of others.
    """
    if like is not None:
        names = list(flatten(like))
        treedef = jax.tree_util.tree_structure(like)
        return jax.tree_util.tree_unflatten(treedef, [flat[k] for k in names])
    root: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split(SEPARATOR)
        node = root
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise CheckpointKeyError(
                    f"key {key!r} nests under {SEPARATOR.join(parts[: i + 1])!r}, which is also a tensor"
                )
            node = child
        if parts[-1] in node:
            raise CheckpointKeyError(f"key {key!r} is both a tensor and a prefix of other keys")
        node[parts[-1]] = value
    return root


def _dtype_of(leaf: Any) -> np.dtype:
    """Return a template leaf's dtype: an array's or ``ShapeDtypeStruct``'s, or numpy's for a Python scalar.

    A step counter ``0`` in a template is saved and read back as a 0-d int64 array.
    """
    dtype = getattr(leaf, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.asarray(leaf).dtype


def check_against(
    flat_specs: Mapping[str, tuple[tuple[int, ...], np.dtype]], like: PyTree, origin: str
) -> None:
    """Check keys, shapes and dtypes of a checkpoint against a template; the error names the first mismatch.

    Args:
      flat_specs: key -> (shape, dtype) of what the checkpoint holds.
      like: the template tree (arrays or ``jax.ShapeDtypeStruct``).
      origin: what to call the checkpoint in messages (its path).

    Raises:
      CheckpointKeyError: If keys are missing or unexpected (all listed), or a shape or dtype
        differs (the first named).
    """
    expected = {k: (tuple(np.shape(v)), _dtype_of(v)) for k, v in flatten(like).items()}
    missing = [k for k in expected if k not in flat_specs]
    extra = [k for k in flat_specs if k not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if extra:
            parts.append(f"unexpected keys {extra}")
        raise CheckpointKeyError(f"{origin} does not match the template: {'; '.join(parts)}")
    for key, (shape, dtype) in expected.items():
        got_shape, got_dtype = flat_specs[key]
        if tuple(got_shape) != shape:
            raise CheckpointKeyError(f"{origin}: {key!r} has shape {tuple(got_shape)}, the template {shape}")
        if np.dtype(got_dtype) != dtype:
            raise CheckpointKeyError(
                f"{origin}: {key!r} has dtype {np.dtype(got_dtype)}, the template {dtype}"
            )


Rename = tuple[str, str | Callable[[re.Match[str]], str]]


@dataclasses.dataclass(frozen=True)
class KeyMapping:
    r"""Rename rules (regex -> replacement, applied in order) and per-key transposes.

    ``rename`` is a sequence of ``(pattern, replacement)`` pairs given to
    :func:`re.sub` one after the other (a replacement may be a function of the
    match). ``transpose`` is a sequence of patterns matched (``re.search``)
    against the *renamed* key: a matching array has its axes reversed (a 2-D
    ``(out, in)`` PyTorch weight becomes a Flax ``(in, out)`` kernel).

    Example (a PyTorch MLP ``fc1``, ``fc2`` read as this package's ``dense_0``, ``dense_1``)::

        KeyMapping(
            rename=[(r"^fc(\d+)\.", lambda m: f"dense_{int(m[1]) - 1}."), (r"\.weight$", ".kernel")],
            transpose=[r"\.kernel$"],
        )

    Attributes:
      rename: ``(pattern, replacement)`` pairs, applied in order with :func:`re.sub`.
      transpose: patterns searched in the renamed key; a matching array has its axes reversed.

    Raises:
      ValueError: a pattern that is not a valid regular expression.
    """

    rename: tuple[Rename, ...] = ()
    transpose: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "rename", tuple((str(p), r) for p, r in self.rename))
        object.__setattr__(self, "transpose", tuple(str(p) for p in self.transpose))
        for pattern in [p for p, _ in self.rename] + list(self.transpose):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"KeyMapping: bad regular expression {pattern!r}: {e}") from e

    @classmethod
    def torch_linear(cls, extra_rename: Iterable[Rename] = ()) -> KeyMapping:
        """Map PyTorch ``nn.Linear`` names to Flax's: ``*.weight`` -> ``*.kernel`` (transposed), ``*.bias``.

        Args:
          extra_rename: Rename rules applied before the built-in one.

        Returns:
          The :class:`KeyMapping`.
        """
        return cls(rename=(*extra_rename, (r"\.weight$", ".kernel")), transpose=(r"\.kernel$",))

    def new_key(self, key: str) -> str:
        """Return ``key`` after every rename rule, in order.

        Args:
          key: A checkpoint key.

        Returns:
          The renamed key.
        """
        for pattern, replacement in self.rename:
            key = re.sub(pattern, replacement, key)
        return key

    def transposes(self, new_key: str) -> bool:
        """Tell whether the tensor of a renamed key has its axes reversed.

        Args:
          new_key: A key after renaming.

        Returns:
          True when a ``transpose`` pattern matches it.
        """
        return any(re.search(p, new_key) for p in self.transpose)

    def apply_shape(self, new_key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Return the shape a stored tensor has after the mapping.

        Args:
          new_key: The key after renaming.
          shape: The stored shape.

        Returns:
          ``shape``, reversed when the key transposes.
        """
        return tuple(reversed(shape)) if self.transposes(new_key) else tuple(shape)

    def apply_array(self, new_key: str, array: np.ndarray) -> np.ndarray:
        """Return a stored tensor as the mapping lays it out.

        Args:
          new_key: The key after renaming.
          array: The stored array.

        Returns:
          ``array``, or a C-contiguous transposed copy when the key transposes.
        """
        # A contiguous copy: a transposed view would be written back in the wrong order by byte-level writers.
        return np.ascontiguousarray(array.T) if self.transposes(new_key) else array

    def rename_all(self, keys: Iterable[str]) -> dict[str, str]:
        """Rename every key.

        Args:
          keys: The checkpoint's keys.

        Returns:
          New key -> old key.

        Raises:
          CheckpointKeyError: If two old keys are renamed to one new key (naming both).
        """
        out: dict[str, str] = {}
        for old in keys:
            new = self.new_key(old)
            if new in out:
                raise CheckpointKeyError(f"rename rules map both {out[new]!r} and {old!r} to {new!r}")
            out[new] = old
        return out
