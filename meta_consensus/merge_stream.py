"""How ``meta-consensus merge`` moves bytes: reused aligned buffers, read-ahead, write-behind, chunks.

The merge reads every input once and writes the output once; everything here keeps
that close to the cost of the copies themselves:

* **Aligned, reused buffers.** jax's CPU client aliases a host array instead of copying
  it when its data is 64-byte aligned (:func:`aligned_empty`), and two buffers per kind
  take turns (fresh pages for every leaf cost a page fault per 4 KiB).
* **Read-ahead** (:class:`Prefetch`): a worker thread reads the next piece while the
  caller merges this one (``os.preadv`` and XLA release the GIL).
* **Column chunks** (:func:`plan_pieces`): a leaf merged by an element-wise rule
  (:attr:`consensus.registry.RuleSpec.elementwise`) is read and merged in chunks of
  columns of its flattened form, ``CHUNK_BYTES`` of stacked rows at a time, so the
  rule reads the rows while they are still in cache instead of from memory again,
  and every leaf of a model compiles one of a few chunk shapes (a full chunk, or a
  power of two for a smaller leaf) instead of one program per leaf shape.
* **Write-behind** (:class:`Writer`): a worker thread writes merged leaf k while
  leaf k + 1 merges.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

# jax's CPU client aliases a host array instead of copying it when the buffer is this aligned
# (XLA's minimum CPU alignment); numpy's large allocations are only 16-byte aligned, and the copy
# into an XLA buffer was the merge's largest cost (more than the sorting network of a median).
ALIGN = 64

# Bytes of one chunk of stacked rows (n x columns, at least 4 bytes per value as merged).
# Measured on a median of 8 x 1 GB inputs (2 cores, inputs in the page cache; the rows read,
# merged and the output kept, no writes): 1.83 s at 4 MB chunks, 1.35 s at 16 MB, 1.45 s at
# 32 MB, against 2.4 s for whole leaves of up to 128 MB. Small chunks pay the per-call
# dispatch (about 50 us); large ones fall out of cache.
CHUNK_BYTES = 16 << 20
MIN_COLUMNS = 128  # the narrowest chunk: small leaves are padded up to a power of two >= this


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an ``ALIGN``-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def view(raw: np.ndarray, shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
    """The first bytes of the aligned byte buffer ``raw`` as an array (None if it is too small)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return raw[:nbytes].view(dtype).reshape(shape) if nbytes <= raw.size else None


def stack(readers: Sequence[Any], key: str, into: np.ndarray | None = None) -> np.ndarray:
    """The n inputs' tensor ``key`` as one (n, ...) array, in ``into`` (raw bytes, reused) if given."""
    shape, dtype = readers[0].specs[key]
    buf = view(into, (len(readers), *shape), dtype) if into is not None else None
    if buf is None:
        buf = aligned_empty((len(readers), *shape), dtype)
    for i, r in enumerate(readers):
        r.read_into(key, buf[i])  # straight from the file into the stack: one copy, no mapped pages
    return buf


def read_one(reader: Any, key: str, into: np.ndarray | None = None) -> np.ndarray:
    shape, dtype = reader.specs[key]
    buf = view(into, shape, dtype) if into is not None else None
    if buf is None:
        buf = aligned_empty(shape, dtype)
    reader.read_into(key, buf)
    return buf


# ----------------------------------------------------------------------------- pieces


@dataclasses.dataclass(frozen=True)
class Piece:
    """What one read brings: a whole leaf (``start`` None), or columns ``[start, start + width)``
    of the flattened leaf, in a buffer of ``padded`` columns whose tail is zeros."""

    key: str
    start: int | None = None
    width: int = 0
    padded: int = 0
    last: bool = True  # the leaf's last piece

    @property
    def whole(self) -> bool:
        return self.start is None


def chunk_columns(n: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Columns of a full chunk: n rows of them within ``chunk_bytes``, a power of two >= MIN_COLUMNS."""
    fit = max(chunk_bytes // (n * max(itemsize, 4)), 1)
    return max(MIN_COLUMNS, 1 << (fit.bit_length() - 1))


def can_chunk(readers: Sequence[Any], key: str) -> bool:
    """Whether every reader can read column ranges of ``key`` (safetensors, not transposed)."""
    return all(
        hasattr(r, "read_range_into") and not r.mapping.transposes(key) for r in readers if r is not None
    )


def plan_pieces(
    keys: Sequence[str],
    specs: dict[str, tuple[tuple[int, ...], np.dtype]],
    chunked: set[str],
    n: int,
    chunk_bytes: int = CHUNK_BYTES,
) -> list[Piece]:
    """The reads of a pass over ``keys``: the leaves in ``chunked`` in column chunks, the others whole.

    A chunked leaf of ``size`` values comes in ``ceil(size / C)`` chunks of C =
    :func:`chunk_columns` columns (the last one padded with zeros); a leaf smaller than C
    comes as one chunk padded to the next power of two (at least ``MIN_COLUMNS``), so a
    model's many small shapes share a few compiled programs.
    """
    pieces = []
    for key in keys:
        shape, dtype = specs[key]
        size = int(np.prod(shape, dtype=np.int64))
        if key not in chunked or size == 0:
            pieces.append(Piece(key))
            continue
        columns = chunk_columns(n, dtype.itemsize, chunk_bytes)
        if size < columns:
            padded = max(MIN_COLUMNS, 1 << (size - 1).bit_length())
            pieces.append(Piece(key, 0, size, padded, True))
            continue
        for start in range(0, size, columns):
            width = min(columns, size - start)
            pieces.append(Piece(key, start, width, columns, start + columns >= size))
    return pieces


def read_chunk(readers: Sequence[Any], piece: Piece, into: np.ndarray | None = None) -> np.ndarray:
    """The (len(readers), piece.padded) chunk of ``piece`` (zeros past its width), in ``into`` if given."""
    _, dtype = readers[0].specs[piece.key]
    shape = (len(readers), piece.padded)
    buf = view(into, shape, dtype) if into is not None else None
    if buf is None:
        buf = aligned_empty(shape, dtype)
    for i, r in enumerate(readers):
        r.read_range_into(piece.key, piece.start, buf[i, : piece.width])
    if piece.width < piece.padded:
        buf[:, piece.width :] = 0  # finite filler: it is never written out, and selects no node away
    return buf


def _nbytes(specs: dict[str, tuple[tuple[int, ...], np.dtype]], piece: Piece, rows: int) -> int:
    shape, dtype = specs[piece.key]
    values = int(np.prod(shape, dtype=np.int64)) if piece.whole else piece.padded
    return rows * values * dtype.itemsize


class Prefetch:
    """Reads the next piece's inputs (and base) in a worker thread while the caller merges this one.

    Yields ``(piece, stacked, base)``: the (n, *shape) stack of a whole leaf or the (n,
    padded) chunk, and the base's leaf or chunk (None without a base). Two aligned byte
    buffers per kind (whole leaves, chunks; stacks, base) take turns. A buffer is handed out
    again only when the caller asks for the piece after next, i.e. when it is done with the
    piece the buffer held: the caller must not keep views of a yielded array past its next
    step. Memory: about 2n + 2 of the largest whole leaf, plus 2n + 2 chunks. (Reading up to
    three chunks ahead, with four chunk buffers, measured the same: 1.90 s against 1.84 s,
    median of 8 x 1 GB.)
    """

    def __init__(self, readers: Sequence[Any], base: Any | None, pieces: Sequence[Piece]):
        self.readers, self.base, self.pieces = readers, base, list(pieces)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="merge-read")
        specs = readers[0].specs
        n = len(readers)
        self.free: dict[tuple[bool, bool], list[np.ndarray]] = {}
        for whole in (True, False):
            sizes = [_nbytes(specs, p, 1) for p in self.pieces if p.whole == whole]
            if sizes:
                self.free[whole, False] = [aligned_empty((n * max(sizes),), np.uint8) for _ in range(2)]
                if base is not None:
                    self.free[whole, True] = [aligned_empty((max(sizes),), np.uint8) for _ in range(2)]

    def _read(self, piece: Piece, raw: np.ndarray, raw_base: np.ndarray | None) -> tuple[np.ndarray, Any]:
        if piece.whole:
            stacked = stack(self.readers, piece.key, raw)
            return stacked, (None if self.base is None else read_one(self.base, piece.key, raw_base))
        stacked = read_chunk(self.readers, piece, raw)
        return stacked, (None if self.base is None else read_chunk([self.base], piece, raw_base)[0])

    def _submit(self, piece: Piece) -> tuple[Any, np.ndarray, np.ndarray | None]:
        raw = self.free[piece.whole, False].pop()
        raw_base = self.free[piece.whole, True].pop() if self.base is not None else None
        return self.pool.submit(self._read, piece, raw, raw_base), raw, raw_base

    def __iter__(self):
        try:
            ahead = self._submit(self.pieces[0]) if self.pieces else None
            for i, piece in enumerate(self.pieces):
                future, raw, raw_base = ahead
                stacked, base_piece = future.result()
                ahead = self._submit(self.pieces[i + 1]) if i + 1 < len(self.pieces) else None
                yield piece, stacked, base_piece
                # The caller is done with this piece: its buffers serve the piece after next.
                self.free[piece.whole, False].append(raw)
                if raw_base is not None:
                    self.free[piece.whole, True].append(raw_base)
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


class Writer:
    """Writes the merged leaves in order in a worker thread (one write in flight), overlapping the merge."""

    def __init__(self, writer: Any):
        self.writer = writer
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="merge-write")
        self.pending: Any = None

    def write(self, key: str, array: np.ndarray | list[np.ndarray]) -> None:
        """Queue ``key``: one array, or a list of consecutive 1-D pieces (``write_parts``)."""
        self.wait()
        write = self.writer.write_parts if isinstance(array, list) else self.writer.write
        self.pending = self.pool.submit(write, key, array)

    def wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()  # a failed write raises here

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
