"""Parameter trees <-> Flower's ``ArrayRecord``, by dotted key paths, checked on the way in.

A tree travels as one :class:`flwr.app.ArrayRecord` whose keys are the tree's dotted
paths (:func:`consensus.io.keys.flatten`, the same names a safetensors checkpoint of the
package uses) and whose values are Flower :class:`~flwr.app.Array` s: numpy's ``.npy``
bytes, so float32 travels bit for bit. Dtypes numpy does not know natively (bfloat16 and
the other ``ml_dtypes``) are written as raw bytes of the same width and viewed back as
the dtype the record names.

On the way in, :func:`from_array_record` checks the record against a template tree:
the same keys, shapes and dtypes, and bytes that decode to what the record declares.
A mismatch raises :class:`ArrayRecordMismatch` naming the first problem; the strategy
turns it into a missing answer with that reason, never a crash of the round.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_dtypes  # noqa: F401 - registers bfloat16 & co. with numpy, so np.dtype("bfloat16") resolves
import numpy as np
from flwr.app import Array, ArrayRecord

from consensus.io.keys import CheckpointKeyError, check_against, flatten, unflatten

PyTree = Any


class ArrayRecordMismatch(ValueError):
    """An ArrayRecord that does not match the template tree (keys, shapes, dtypes or bytes)."""


def _encode(value: Any) -> Array:
    """One leaf as a Flower Array (ml_dtypes as raw unsigned bytes under their real dtype's name)."""
    x = np.ascontiguousarray(np.asarray(jax.device_get(value)))
    if x.dtype.kind == "V" or x.dtype.type.__module__.startswith("ml_dtypes"):
        # .npy cannot name ml_dtypes: ship the bytes as unsigned ints, keep the real dtype's name.
        raw = x.view(np.dtype(f"u{x.dtype.itemsize}"))
        arr = Array(raw)
        return Array(dtype=str(x.dtype), shape=tuple(x.shape), stype=arr.stype, data=arr.data)
    return Array(x)


def _declared_dtype(key: str, arr: Array) -> np.dtype:
    """The dtype an Array names (ArrayRecordMismatch for a name numpy does not know)."""
    try:
        return np.dtype(arr.dtype)
    except TypeError as e:
        raise ArrayRecordMismatch(f"{key!r} has an unknown dtype {arr.dtype!r}") from e


def _decode(key: str, arr: Array) -> np.ndarray:
    """An Array's bytes as the dtype and shape it declares (ArrayRecordMismatch if they differ)."""
    dtype = _declared_dtype(key, arr)
    try:
        x = arr.numpy()
    except Exception as e:  # noqa: BLE001 - undecodable bytes are a bad answer, not a crash
        raise ArrayRecordMismatch(f"{key!r}: its bytes do not decode ({type(e).__name__}: {e})") from e
    if x.dtype != dtype:
        if x.dtype.itemsize != dtype.itemsize or x.dtype.kind not in "uV":
            raise ArrayRecordMismatch(f"{key!r}: declared dtype {dtype}, its bytes hold {x.dtype}")
        x = x.view(dtype)
    if tuple(x.shape) != tuple(arr.shape):
        raise ArrayRecordMismatch(f"{key!r}: declared shape {tuple(arr.shape)}, its bytes hold {x.shape}")
    return x


def to_array_record(tree: PyTree) -> ArrayRecord:
    """The tree as an ArrayRecord keyed by dotted paths (host copies of the leaves).

    Args:
      tree: a parameter tree (nested dicts of arrays; any dtype, bfloat16 included).

    Returns:
      The ArrayRecord.
    """
    return ArrayRecord({key: _encode(leaf) for key, leaf in flatten(tree).items()})


def from_array_record(record: Any, like: PyTree, origin: str = "the ArrayRecord") -> PyTree:
    """The tree of ``record`` in the structure of ``like``, after checking keys, shapes and dtypes.

    Args:
      record: what a message carries (anything: a non-ArrayRecord is refused).
      like: the template tree (arrays or ``jax.ShapeDtypeStruct`` leaves).
      origin: what the record is, for the error message.

    Returns:
      The tree, with numpy leaves of the record's dtypes.

    Raises:
      ArrayRecordMismatch: not an ArrayRecord, or keys / shapes / dtypes / bytes that do not
        match ``like`` (the message names the first mismatch and ``origin``).
    """
    if not isinstance(record, ArrayRecord):
        raise ArrayRecordMismatch(f"{origin} is a {type(record).__name__}, not an ArrayRecord")
    specs = {key: (tuple(arr.shape), _declared_dtype(key, arr)) for key, arr in record.items()}
    try:
        check_against(specs, like, origin)
    except CheckpointKeyError as e:
        raise ArrayRecordMismatch(str(e)) from e
    return unflatten({key: _decode(key, arr) for key, arr in record.items()}, like)
