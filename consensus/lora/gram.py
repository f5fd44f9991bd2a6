r"""The Gram matrix of the nodes' LoRA updates, formed from the factors.

For updates ``P_i = s_i a_i b_i`` (a_i (in, r), b_i (r, out)),

.. math:: \langle P_i, P_j \rangle_F = s_i s_j \operatorname{tr}(b_i^T a_i^T a_j b_j)
          = s_i s_j \sum_{p,q} (a_i^T a_j)_{pq} (b_i b_j^T)_{pq},

so each pair costs two r x r products, O(r^2 (in + out)), instead of O(in out) on the dense
updates. All pairs at once are two Gram products of the concatenated factors
``[a_1 ... a_n]`` (in, n r) and ``[b_1; ...; b_n]`` (n r, out), one BLAS call each, in float64 on
the host: distances ``G_ii + G_jj - 2 G_ij`` between close fine-tunes cancel, and float64 keeps
them accurate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from consensus.lora._core import check_stacked, node_scales


def target_gram(a: Any, b: Any, s: np.ndarray) -> np.ndarray:
    """(n, n) float64 Gram of one target's updates ``s_i a_i b_i`` from its stacked factors.

    Args:
      a: (n, in, r) stacked ``a`` factors.
      b: (n, r, out) stacked ``b`` factors.
      s: (n,) per-node scales.

    Returns:
      ``G[i, j] = <s_i a_i b_i, s_j a_j b_j>_F``.
    """
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    n, fan_in, r = a64.shape
    a_cat = np.moveaxis(a64, 0, 1).reshape(fan_in, n * r)
    b_cat = b64.reshape(n * r, -1)
    ata = (a_cat.T @ a_cat).reshape(n, r, n, r)
    bbt = (b_cat @ b_cat.T).reshape(n, r, n, r)
    return np.einsum("ipjq,ipjq->ij", ata, bbt) * np.outer(s, s)


def product_gram(stacked: Mapping[str, Mapping[str, Any]], scale: Any) -> np.ndarray:
    """The (n, n) Gram matrix of the nodes' whole-adapter updates, summed over targets, from the factors.

    ``G[i, j] = sum over targets of <s_i a_i b_i, s_j a_j b_j>_F`` in O(n^2 r^2 (in + out)) per
    target, never forming an (in, out) update (see the module docstring). Non-finite factors give
    non-finite rows (robust callers read validity off the diagonal).

    Args:
      stacked: ``{target: {"a": (n, in, r), "b": (n, r, out)}}``.
      scale: The adapters' scale, one float or one per node.

    Returns:
      (n, n) float64 Gram matrix.
    """
    n, _ = check_stacked(stacked, finite=False)
    s = node_scales(scale, n)
    total = np.zeros((n, n))
    for f in stacked.values():
        total += target_gram(f["a"], f["b"], s)
    return total
