"""Reader of the IDX format (MNIST, Fashion-MNIST), gzip or plain; never downloads anything.

IDX layout (LeCun et al., http://yann.lecun.com/exdb/mnist/): a 4-byte magic
number ``0x00 0x00 TYPE NDIM``, then NDIM big-endian uint32 dimension sizes,
then the data in C order, big-endian. TYPE is 0x08 uint8, 0x09 int8, 0x0B
int16, 0x0C int32, 0x0D float32, 0x0E float64.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class IDXError(ValueError):
    """A file that is not a well-formed IDX file, or not the one expected."""


def _open(path: Path):
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gzipped else open(path, "rb")  # noqa: SIM115 (returned to a with)


def read_idx(
    path: str | os.PathLike,
    *,
    dtype: np.dtype | type | None = None,
    shape: tuple[int | None, ...] | None = None,
) -> np.ndarray:
    """The array stored in an IDX file (gzip-compressed or not), in native byte order.

    Args:
      path: the file.
      dtype: when given, the dtype the file must declare (e.g. ``np.uint8``).
      shape: when given, the shape it must have; None entries accept any size
        (``(None, 28, 28)`` for images).

    Returns:
      The array, in native byte order.

    Raises:
      IDXError: a bad magic number, an unknown type code, a size that does not
        match the header, or a dtype / shape other than the expected one. The
        message names the file.
    """
    path = Path(path)
    with _open(path) as f:
        try:
            raw = f.read()
        except (OSError, EOFError) as e:
            raise IDXError(f"{path}: cannot read ({e})") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        magic = raw[:4].hex() or "missing"
        raise IDXError(f"{path}: not an IDX file (magic number {magic}; expected 0000TTNN)")
    code, ndim = raw[2], raw[3]
    if code not in IDX_TYPES:
        raise IDXError(f"{path}: unknown IDX type code 0x{code:02x}; known: {[hex(c) for c in IDX_TYPES]}")
    stored = IDX_TYPES[code]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IDXError(f"{path}: truncated header ({len(raw)} bytes for {ndim} dimensions)")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    expected = int(np.prod(dims, dtype=np.int64)) * stored.itemsize
    if len(raw) - header != expected:
        raise IDXError(
            f"{path}: the header says {dims} {stored.name} ({expected} bytes) "
            f"but {len(raw) - header} bytes follow"
        )
    if dtype is not None and stored.newbyteorder("=") != np.dtype(dtype).newbyteorder("="):
        raise IDXError(f"{path}: holds {stored.newbyteorder('=').name}, expected {np.dtype(dtype).name}")
    if shape is not None and (
        len(shape) != len(dims) or any(s is not None and s != d for s, d in zip(shape, dims, strict=True))
    ):
        raise IDXError(f"{path}: has shape {dims}, expected {tuple(shape)} (None = any size)")
    data = np.frombuffer(raw, stored, offset=header).reshape(dims)
    return data.astype(stored.newbyteorder("="))


def write_idx(path: str | os.PathLike, array: np.ndarray, *, compress: bool | None = None) -> Path:
    """Write ``array`` as an IDX file (gzip when ``compress`` or the name ends in ``.gz``); for tests.

    Args:
      path: the file to write.
      array: the array (a dtype IDX can store).
      compress: gzip the file (default: when the name ends in ``.gz``).

    Returns:
      The path written.

    Raises:
      IDXError: for a dtype IDX cannot store.
    """
    path = Path(path)
    array = np.asarray(array)
    codes = {v.newbyteorder("="): k for k, v in IDX_TYPES.items()}
    native = array.dtype.newbyteorder("=")
    if native not in codes:
        raise IDXError(f"IDX cannot store {array.dtype}; supported: {[d.name for d in codes]}")
    code = codes[native]
    head = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    body = np.ascontiguousarray(array, IDX_TYPES[code]).tobytes()
    compress = path.suffix == ".gz" if compress is None else compress
    with gzip.open(path, "wb") if compress else open(path, "wb") as f:
        f.write(head + body)
    return path
