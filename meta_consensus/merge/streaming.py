"""How the merge moves bytes: reused aligned buffers, column chunks, two workers, write-behind.

The merge reads every input once and writes the output once; everything here keeps
that close to the cost of the copies themselves (``python -m benchmarks merge_io`` measures
it; docs/merging.md says how each part was chosen):

* **Aligned, reused buffers.** jax's CPU client aliases a host array instead of copying
  it when its data is 64-byte aligned (:func:`aligned_empty`), and every worker reuses
  its own (fresh pages for every leaf cost a page fault per 4 KiB).
* **Two workers** (:class:`Pipeline`): each reads a piece into its own buffers and merges
  it while the other does the same with the next (``os.preadv`` and XLA release the GIL);
  the caller takes the results in order.
* **Column chunks** (:func:`plan_pieces`): a leaf merged by an element-wise rule
  (:attr:`consensus.specs.Spec.elementwise`) is read and merged in chunks of
  columns of its flattened form, ``CHUNK_BYTES`` of stacked rows at a time, so the
  rule reads the rows while they are still in cache instead of from memory again,
  and every leaf of a model compiles one of a few chunk shapes (a full chunk, or a
  power of two for a smaller leaf) instead of one program per leaf shape.
* **Write-behind** (:class:`Writer`): a worker thread writes merged leaf k while
  leaf k + 1 merges.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

# jax's CPU client aliases a host array instead of copying it when the buffer is this aligned
# (XLA's minimum CPU alignment); numpy's large allocations are only 16-byte aligned, and a copy
# into an XLA buffer would cost more than the sorting network of a median.
ALIGN = 64

# Bytes of one chunk of stacked rows (n x columns, at least 4 bytes per value as merged).
# Smaller chunks let Python and dispatch per chunk dominate; larger ones (or whole leaves) fall
# out of cache. Chosen with ``python -m benchmarks merge_io`` (8 x 1 GB inputs, median and task
# arithmetic) run at several chunk sizes.
CHUNK_BYTES = 32 << 20
MIN_COLUMNS = 128  # the narrowest chunk: small leaves are padded up to a power of two >= this


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an ``ALIGN``-byte boundary.

    jax's CPU client aliases such an array instead of copying it.

    Args:
      shape: The array's shape.
      dtype: Its dtype.

    Returns:
      A view into a slightly larger byte buffer, which it keeps alive.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def view(raw: np.ndarray, shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
    """The first bytes of the aligned byte buffer ``raw`` as an array.

    Args:
      raw: A 1-D uint8 buffer from :func:`aligned_empty`.
      shape: The array's shape.
      dtype: Its dtype.

    Returns:
      The view, or None if ``raw`` is too small.
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return raw[:nbytes].view(dtype).reshape(shape) if nbytes <= raw.size else None


def _array(into: np.ndarray | None, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An array of ``shape`` in the raw bytes ``into`` when given and large enough, else a new one."""
    buf = view(into, shape, dtype) if into is not None else None
    return aligned_empty(shape, dtype) if buf is None else buf


def stack(readers: Sequence[Any], key: str, into: np.ndarray | None = None) -> np.ndarray:
    """Read the n inputs' tensor ``key`` as one (n, ...) array, each straight from its file.

    Args:
      readers: The inputs' readers.
      key: The tensor.
      into: Raw bytes to read into when large enough (a worker's reused buffer), or None.

    Returns:
      The (n, ...) stack, in ``into`` when it fits.
    """
    shape, dtype = readers[0].specs[key]
    buf = _array(into, (len(readers), *shape), dtype)
    for i, r in enumerate(readers):
        r.read_into(key, buf[i])  # straight from the file into the stack: one copy, no mapped pages
    return buf


def read_one(reader: Any, key: str, into: np.ndarray | None = None) -> np.ndarray:
    """Read one reader's tensor ``key``.

    Args:
      reader: The reader (the base's).
      key: The tensor.
      into: Raw bytes to read into when large enough, or None.

    Returns:
      The tensor, in ``into`` when it fits.
    """
    shape, dtype = reader.specs[key]
    buf = _array(into, shape, dtype)
    reader.read_into(key, buf)
    return buf


# ----------------------------------------------------------------------------- pieces


@dataclasses.dataclass(frozen=True)
class Piece:
    """What one read brings: a whole leaf, or a column chunk of the flattened leaf.

    Attributes:
      key: The leaf's key.
      start: The chunk's first column; None for a whole leaf.
      width: The chunk's columns, ``[start, start + width)``.
      padded: The columns of the chunk's buffer; those past ``width`` are zeros.
      last: Whether this is the leaf's last piece.
    """

    key: str
    start: int | None = None
    width: int = 0
    padded: int = 0
    last: bool = True  # the leaf's last piece

    @property
    def whole(self) -> bool:
        """Whether the piece is a whole leaf."""
        return self.start is None


def chunk_columns(n: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """The columns of a full chunk: n rows of them within ``chunk_bytes``.

    Args:
      n: The number of rows (inputs).
      itemsize: Bytes per stored value; at least 4 are counted, as values are merged in float32.
      chunk_bytes: The chunk's size budget.

    Returns:
      A power of two, at least ``MIN_COLUMNS`` (so a tiny budget still makes progress).
    """
    fit = max(chunk_bytes // (n * max(itemsize, 4)), 1)
    return max(MIN_COLUMNS, 1 << (fit.bit_length() - 1))


def can_chunk(readers: Sequence[Any], key: str) -> bool:
    """Whether every reader can read column ranges of ``key`` (safetensors, not transposed).

    Args:
      readers: The readers; None entries (no base) are skipped.
      key: The tensor.

    Returns:
      True when the leaf can be streamed in column chunks.
    """
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

    Args:
      keys: The leaves, in the order they are read.
      specs: Key -> (shape, stored dtype).
      chunked: The keys read in column chunks.
      n: The number of inputs.
      chunk_bytes: The size of a full chunk of n rows (:func:`chunk_columns`).

    Returns:
      The pieces, in order; an empty leaf comes whole.
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
    """Read the (len(readers), piece.padded) chunk of ``piece``, zeros past its width.

    Args:
      readers: Readers that read column ranges (:func:`can_chunk`).
      piece: A chunk (``start`` not None).
      into: Raw bytes to read into when large enough, or None.

    Returns:
      The chunk, in ``into`` when it fits.
    """
    _, dtype = readers[0].specs[piece.key]
    buf = _array(into, (len(readers), piece.padded), dtype)
    for i, r in enumerate(readers):
        r.read_range_into(piece.key, piece.start, buf[i, : piece.width])
    if piece.width < piece.padded:
        buf[:, piece.width :] = 0  # finite filler: it is never written out, and selects no node away
    return buf


def _nbytes(specs: dict[str, tuple[tuple[int, ...], np.dtype]], piece: Piece, rows: int) -> int:
    """Bytes of ``rows`` rows of ``piece`` as stored (a chunk's padding included)."""
    shape, dtype = specs[piece.key]
    values = int(np.prod(shape, dtype=np.int64)) if piece.whole else piece.padded
    return rows * values * dtype.itemsize


class Pipeline:
    """``work(piece, buffers)`` for every piece on ``workers`` threads; the results in piece order.

    Each worker reads its piece into buffers of its own (``buffers``, a dict the work fills
    once and reuses for that worker's next pieces: fresh pages for every piece cost a page
    fault per 4 KiB) and merges it there, so a worker's rows are still in its cache when it
    merges them, and the two cores read and merge at once (``os.preadv`` and XLA release the
    GIL). With whole leaves each worker holds one (n, leaf) stack: two in all, as when one
    thread read leaf k + 1 while leaf k merged. A result must not be a view of the buffers.
    At most ``workers + ahead`` pieces are in flight. Two workers, and ``ahead = 2``, were
    chosen with ``python -m benchmarks merge_io`` over one worker, one thread reading ahead
    while the caller merges, and ``ahead = 1``.

    Args:
      work: ``work(piece, buffers) -> result``, run on the worker threads.
      pieces: The pieces, in order.
      workers: The number of worker threads.
      ahead: How many more pieces than workers may be in flight.
    """

    def __init__(self, work: Any, pieces: Sequence[Piece], workers: int = 2, ahead: int = 2):
        self.work, self.pieces, self.workers, self.ahead = work, list(pieces), workers, ahead

    def __iter__(self) -> Iterator[Any]:
        import collections
        import threading

        local = threading.local()

        def run(piece: Piece) -> Any:
            if not hasattr(local, "buffers"):
                local.buffers = {}
            return self.work(piece, local.buffers)

        pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="merge-work")
        queue: collections.deque = collections.deque()
        try:
            for piece in self.pieces:
                queue.append(pool.submit(run, piece))
                if len(queue) > self.workers + self.ahead:
                    yield queue.popleft().result()
            while queue:
                yield queue.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def buffer(buffers: dict[str, np.ndarray], name: str, nbytes: int) -> np.ndarray:
    """The aligned byte buffer ``name`` of a worker, grown to at least ``nbytes``.

    Args:
      buffers: The worker's buffers (the dict :class:`Pipeline` hands it).
      name: Which buffer.
      nbytes: The bytes needed.

    Returns:
      The buffer, reused when large enough (a larger one replaces it otherwise).
    """
    raw = buffers.get(name)
    if raw is None or raw.size < nbytes:
        raw = buffers[name] = aligned_empty((nbytes,), np.uint8)
    return raw


def read_piece(
    readers: Sequence[Any], base: Any | None, piece: Piece, buffers: dict
) -> tuple[np.ndarray, Any]:
    """Read a piece's (n, ...) stack and its base leaf or chunk into a worker's buffers.

    Args:
      readers: The inputs' readers.
      base: The base's reader, or None.
      piece: The piece.
      buffers: The worker's buffers (:func:`buffer`).

    Returns:
      (stack, base piece); the base piece is None without a base.
    """
    n = len(readers)
    specs = readers[0].specs
    if piece.whole:
        raw = buffer(buffers, "whole", _nbytes(specs, piece, n))
        stacked = stack(readers, piece.key, raw)
        if base is None:
            return stacked, None
        return stacked, read_one(base, piece.key, buffer(buffers, "whole base", _nbytes(specs, piece, 1)))
    stacked = read_chunk(readers, piece, buffer(buffers, "chunk", _nbytes(specs, piece, n)))
    if base is None:
        return stacked, None
    return stacked, read_chunk([base], piece, buffer(buffers, "chunk base", _nbytes(specs, piece, 1)))[0]


class Writer:
    """Writes the merged leaves in order in a worker thread, overlapping the merge.

    Leaves wait their turn up to ``budget`` bytes in all (at least one leaf): with a single
    leaf in flight the merge waits for the writer (``python -m benchmarks merge_io``), while a
    queue of large leaves would cost their memory.

    Args:
      writer: A :class:`consensus.io.ShardedWriter` (``write`` and ``write_parts``).
      budget: The bytes of leaves that may wait to be written.
    """

    def __init__(self, writer: Any, budget: int = 64 << 20):
        import collections

        self.writer, self.budget = writer, budget
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="merge-write")
        self.pending: collections.deque = collections.deque()  # (future, bytes)

    def write(self, key: str, array: np.ndarray | list[np.ndarray]) -> None:
        """Queue ``key`` for writing, first waiting for earlier writes while over the budget.

        Args:
          key: The tensor.
          array: One array, or a list of consecutive 1-D pieces (``write_parts``).

        Raises:
          OSError: If an earlier write failed (a full disk, ...): its error is raised here.
        """
        nbytes = sum(a.nbytes for a in array) if isinstance(array, list) else array.nbytes
        while self.pending and sum(b for _, b in self.pending) + nbytes > self.budget:
            self.pending.popleft()[0].result()  # a failed write raises here
        write = self.writer.write_parts if isinstance(array, list) else self.writer.write
        self.pending.append((self.pool.submit(write, key, array), nbytes))

    def wait(self) -> None:
        """Wait for every queued write; a failed write raises here."""
        while self.pending:
            self.pending.popleft()[0].result()

    def close(self) -> None:
        """Wait for every queued write, then stop the thread; a failed write raises here."""
        try:
            self.wait()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
