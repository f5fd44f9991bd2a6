"""Pure jitted array kernels on (n, ...) stacks: no pytrees, no state.

* :mod:`kernels.rows` - unrolled streaming sums, norms, finiteness, mixing;
* :mod:`kernels.sorting` - sorting-network order statistics (median, trimmed mean, Bulyan);
* :mod:`kernels.selection` - the same order statistics above 128 rows (64 for traced positions),
  by exact bitwise selection;
* :mod:`kernels.stack_sort` - the same order statistics by ``jnp.sort`` over the node axis;
* :mod:`kernels.backend` - which of those formulations runs on which backend (and overrides);
* :mod:`kernels.gram` - streamed Gram matrices and pairwise distances;
* :mod:`kernels.krum` - Krum scores and selections from distances;
* :mod:`kernels.weiszfeld` - geometric median, centered clipping, NNM in Gram space.
"""

from kernels import gram, krum, rows, selection, sorting, weiszfeld

__all__ = ["gram", "krum", "rows", "selection", "sorting", "weiszfeld"]
