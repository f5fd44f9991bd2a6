"""Which formulation of a kernel runs on which backend: a named default per backend, and overrides.

Some kernels are written for XLA:CPU. The coordinate-wise order statistics (median, trimmed
mean, order statistics, Bulyan's and MeaMed's windows) run as sorting networks
(:mod:`kernels.sorting`) and, above the networks' limits, as bitwise selection with packed
counters (:mod:`kernels.selection`), because ``jnp.sort`` over the node axis costs about 100
passes over memory on XLA:CPU. On a GPU or TPU ``jnp.sort`` is the backend's own sort kernel, so
which formulation is faster there is a question for a measurement on that backend
(``python -m benchmarks accelerator`` times both), not for the CPU's numbers.

The formulations (``ORDER_IMPLS``):

* ``"network"``: sorting networks up to their limits, exact selection above (the CPU's);
* ``"sort"``: ``jnp.sort`` of the stack over the node axis (:mod:`kernels.stack_sort`);
* ``"hybrid"``: sorting networks up to their limits, ``jnp.sort`` above (the GPU's: exact
  selection's packed counters are shaped for XLA:CPU's loops, not for a GPU).

Both compute the same rule with the same semantics (excluded rows, NaN and ``poison``); the
results agree to float32 rounding (sums in another order). The default per backend is
:data:`DEFAULT_ORDER_IMPL`. Overrides, strongest first: the ``impl=`` argument of the public
kernels, :func:`forced_order_impl` (a context), the ``META_CONSENSUS_ORDER_IMPL`` variable.

The choice is made when the kernel is called, in Python: eagerly at every call, and inside the
user's ``jax.jit`` when it traces (a function traced once keeps the formulation it traced with).
:func:`kernels.compile_options.compiler_options` is the other backend dispatch of the package:
its XLA:CPU options are passed on CPU only.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping

import jax

ORDER_IMPLS = ("network", "sort", "hybrid")
ORDER_IMPL_ENV = "META_CONSENSUS_ORDER_IMPL"

# Chosen per backend by the accelerator benchmark run on that backend
# (benchmarks/results/accelerator_<backend>.md). On a GPU the networks beat jnp.sort where they
# fit, and exact selection, the CPU's path above the networks' limits, is far slower there than
# jnp.sort: hence "hybrid". TPU keeps the CPU's formulation until a run there says otherwise.
DEFAULT_ORDER_IMPL: Mapping[str, str] = {"cpu": "network", "gpu": "hybrid", "tpu": "network"}
FALLBACK_ORDER_IMPL = "network"  # a backend not in the table (a plugin)

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("order_impl", default=None)


def _checked(impl: str, source: str) -> str:
    if impl not in ORDER_IMPLS:
        raise ValueError(f"{source} must be one of {', '.join(ORDER_IMPLS)}, got {impl!r}")
    return impl


def order_impl(impl: str | None = None, backend: str | None = None) -> str:
    """The formulation of the order-statistic kernels: ``"network"``, ``"sort"`` or ``"hybrid"``.

    Args:
      impl: an explicit choice (returned as is once checked); None: the overrides, then the default.
      backend: the backend whose default applies (default: ``jax.default_backend()``).

    Returns:
      The formulation's name, one of ``ORDER_IMPLS``.

    Raises:
      ValueError: for a name not in ``ORDER_IMPLS`` (argument, context or environment).
    """
    if impl is not None:
        return _checked(impl, "impl")
    forced = _forced.get()
    if forced is not None:
        return forced
    env = os.environ.get(ORDER_IMPL_ENV, "").strip().lower()
    if env:
        return _checked(env, ORDER_IMPL_ENV)
    return DEFAULT_ORDER_IMPL.get(backend or jax.default_backend(), FALLBACK_ORDER_IMPL)


@contextlib.contextmanager
def forced_order_impl(impl: str | None) -> Iterator[None]:
    """Within the block, the order-statistic kernels use ``impl`` (None: back to the default).

    Args:
      impl: one of ``ORDER_IMPLS``, or None to clear an outer override.

    Yields:
      None; the choice holds until the block exits.

    Raises:
      ValueError: for a name not in ``ORDER_IMPLS``.
    """
    token = _forced.set(None if impl is None else _checked(impl, "forced_order_impl"))
    try:
        yield
    finally:
        _forced.reset(token)
