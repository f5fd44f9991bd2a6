"""LoRA adapters by consensus: merge n nodes' low-rank adapters exactly, approximately or robustly.

A target kernel W (in, out) is adapted by ``a`` (in, r) and ``b`` (r, out) with update
``scale * a @ b`` (Flax layout; PEFT stores the transposes). The methods, declared in
:data:`ADAPTER_METHODS`, differ in what they keep exact:

* ``fedit`` (FedIT): factor-wise weighted mean; approximate (product of means).
* ``ffa`` (FFA-LoRA): shared frozen ``a``, mean of ``b``; exact.
* ``stack`` (FLoRA): ranks concatenated; exact, rank n * r.
* ``svd``: the weighted sum of the products, truncated to rank r' by SVD; the error is reported.
* ``exact_residual`` (FedEx-LoRA): factor means plus the residual in ``base_delta``; exact.
* PEFT's ``add_weighted_adapter`` combinations ``linear``, ``cat``, ``ties``, ``dare_linear``,
  ``dare_ties`` (and ``svd``), with PEFT's formulas.

Robust rules apply on the products (exact; Gram from the factors, :func:`product_gram`) or on
the factors (cheap): :func:`merge_adapters` with ``rule=`` and ``space=``.
"""

from consensus.lora import peft_methods  # noqa: F401  (importing it declares PEFT's combinations)
from consensus.lora._core import (
    Adapter,
    AdapterError,
    AdapterMerge,
    check_stacked,
    dense_delta,
    fresh_adapter,
    stack_adapters,
)
from consensus.lora._merge import SPACES, merge_adapters
from consensus.lora.gram import product_gram
from consensus.lora.methods import AdapterMethod
from consensus.specs import ADAPTER_METHODS

__all__ = [
    "ADAPTER_METHODS",
    "SPACES",
    "Adapter",
    "AdapterError",
    "AdapterMerge",
    "AdapterMethod",
    "check_stacked",
    "dense_delta",
    "fresh_adapter",
    "merge_adapters",
    "product_gram",
    "stack_adapters",
]
