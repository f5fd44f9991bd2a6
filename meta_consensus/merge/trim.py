"""TIES' per-node trim thresholds of a leaf, found over its column chunks (host, numpy).

TIES keeps, per node i and per leaf, the entries with ``|x_i - base| >= t_i``, t_i the exact
k-th largest magnitude of the leaf (k = :func:`consensus.merging.ties.trim_count`). The library
finds t_i over a whole (n, size) leaf; the merge command streams the leaf in column chunks
instead, so it finds t_i in two counting passes over the chunks, then merges chunk by chunk
with the thresholds given (``update(..., thresholds=...)``), an element-wise pass:

* The float32 bit patterns of non-negative floats, read as integers, are ordered like the
  values (NaN is clamped to +inf's pattern, as :mod:`consensus.merging._select` does), so
  t_i's pattern T_i is the largest integer with ``count(bits >= T_i) >= k``.
* Pass 1 counts each node's patterns by their high 16 bits (a 65536-bin histogram per node,
  summed over the chunks): the bin holding the k-th largest, and the rank of t_i inside it.
* Pass 2 counts, for each node, the low 16 bits of the patterns in that bin: the exact T_i.

Counting is exact, so t_i is the library's threshold bit for bit and the merged values are
those of the whole-leaf TIES (``tests/system/test_merge_streaming.py``). Memory: a chunk and a
(n, 65536) count per worker. Each pass reads the leaf once more (from the page cache, after
the first), so TIES costs three reads of its leaves instead of one.

References:
  Yadav, Tam, Choshen, Raffel and Bansal 2023, NeurIPS, "TIES-Merging: Resolving Interference
  When Merging Models".
"""

from __future__ import annotations

import numpy as np

BINS = 1 << 16
INF_BITS = 0x7F800000


def _row_bits(row: np.ndarray, base: np.ndarray) -> np.ndarray:
    """int32 patterns of ``|row - base|`` in float32 (the rule's compute dtype), NaN clamped to +inf."""
    d = np.subtract(row.astype(np.float32, copy=False), base.astype(np.float32, copy=False), dtype=np.float32)
    np.abs(d, out=d)
    bits = d.view(np.int32)
    np.minimum(bits, INF_BITS, out=bits)
    return bits


def high_counts(stacked: np.ndarray, base: np.ndarray, width: int) -> np.ndarray:
    """Pass 1 on one chunk: count each row's magnitudes by the high 16 bits of their float32 patterns.

    Args:
      stacked: (n, ...) the inputs' chunk.
      base: The base's chunk (same columns).
      width: The chunk's real columns; the zero padding after them is not counted.

    Returns:
      (n, 65536) int64 counts, summed over the leaf's chunks by :meth:`LeafTrim.add_high`.
    """
    n = len(stacked)
    rows = stacked.reshape(n, -1)
    b = base.reshape(-1)[:width]
    out = np.empty((n, BINS), np.int64)
    for i in range(n):  # a row at a time: temporaries of one row of the chunk
        bits = _row_bits(rows[i, :width], b)
        np.right_shift(bits, 16, out=bits)
        out[i] = np.bincount(bits, minlength=BINS)
    return out


def low_counts(stacked: np.ndarray, base: np.ndarray, width: int, high: np.ndarray) -> np.ndarray:
    """Pass 2 on one chunk: count row i's magnitudes in bin ``high[i]`` by their low 16 bits.

    Args:
      stacked: (n, ...) the inputs' chunk.
      base: The base's chunk (same columns).
      width: The chunk's real columns; the zero padding after them is not counted.
      high: (n,) each row's bin from :meth:`LeafTrim.split`; a negative bin skips the row.

    Returns:
      (n, 65536) int64 counts, summed over the leaf's chunks by :meth:`LeafTrim.add_low`.
    """
    n = len(stacked)
    rows = stacked.reshape(n, -1)
    b = base.reshape(-1)[:width]
    out = np.zeros((n, BINS), np.int64)
    for i in range(n):
        if high[i] < 0:  # nothing to find in this row (threshold 0)
            continue
        bits = _row_bits(rows[i, :width], b)
        hit = bits[(bits >> 16) == high[i]]
        out[i] = np.bincount(hit & 0xFFFF, minlength=BINS)
    return out


def _bin_of_rank(counts: np.ndarray, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the bin holding the ``rank``-th largest entry, and that entry's rank inside its bin.

    ``rank`` is 1-based; ``counts`` are by ascending bin.
    """
    above = np.cumsum(counts[:, ::-1], axis=1)  # above[:, j]: entries in the top j + 1 bins
    top = np.array([np.searchsorted(above[i], rank[i]) for i in range(len(counts))])  # first >= rank
    bins = BINS - 1 - top
    before = np.where(top > 0, above[np.arange(len(counts)), np.maximum(top - 1, 0)], 0)
    return bins.astype(np.int64), (rank - before).astype(np.int64)


class LeafTrim:
    """One leaf's exact TIES thresholds, found from counts over its chunks.

    Call ``add_high`` with every chunk's :func:`high_counts`, then ``split``, ``add_low`` with
    every chunk's :func:`low_counts`, then ``thresholds``.

    Args:
      n: The number of nodes (rows).
      k: How many of each row's magnitudes the trim keeps
        (:func:`consensus.merging.ties.trim_count`), at least 1.

    References:
      Yadav, Tam, Choshen, Raffel and Bansal 2023, NeurIPS, "TIES-Merging: Resolving
      Interference When Merging Models".
    """

    def __init__(self, n: int, k: int):
        self.n, self.k = n, k
        self.counts = np.zeros((n, BINS), np.int64)
        self.high: np.ndarray | None = None
        self.rank: np.ndarray | None = None

    def add_high(self, counts: np.ndarray) -> None:
        """Add one chunk's pass-1 counts.

        Args:
          counts: (n, 65536) from :func:`high_counts`.
        """
        self.counts += counts

    def split(self) -> np.ndarray:
        """End pass 1: find each row's bin, and reset the counts for pass 2.

        Returns:
          (n,) int64, each row's high 16 bits (the bin of its k-th largest magnitude), for
          :func:`low_counts`.
        """
        self.high, self.rank = _bin_of_rank(self.counts, np.full(self.n, self.k, np.int64))
        self.counts[:] = 0
        return self.high

    def add_low(self, counts: np.ndarray) -> None:
        """Add one chunk's pass-2 counts.

        Args:
          counts: (n, 65536) from :func:`low_counts`.
        """
        self.counts += counts

    def thresholds(self) -> np.ndarray:
        """End pass 2: the thresholds, the library's bit for bit.

        Returns:
          (n,) float32: node i keeps ``|d_i| >= t_i``, t_i its exact k-th largest magnitude.
        """
        assert self.high is not None and self.rank is not None
        low, _ = _bin_of_rank(self.counts, self.rank)
        bits = ((self.high << 16) | low).astype(np.int32)
        return bits.view(np.float32)
