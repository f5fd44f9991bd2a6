"""Column-parallel dispatch: an eager call of a coordinate-wise kernel runs on every CPU core.

XLA:CPU runs each of the selection kernels' small per-block loops on one thread (their fusions
are below its parallel-task cost threshold), and a larger block spills out of the core's cache.
The columns of a coordinate-wise rule are independent, so an eager call on a large stack is
split here into one contiguous column range per core; each range runs the same compiled kernel
on its own Python thread (JAX releases the GIL while a computation runs, and the CPU client
runs concurrent executions side by side), reading the one input buffer in place. The result is
bit-identical to a single call: every column goes through the same code, only its range's start
differs (a traced argument, so one compilation serves every range).

Only eager calls on one CPU device are split. Inside a trace (the user's ``jax.jit``, ``vmap``,
or a kernel calling another) the kernel is traced as usual, once, over every column.

``META_CONSENSUS_KERNEL_THREADS`` sets the number of ranges: a positive integer, ``1`` to turn
the split off. The default is the number of cores this process may run on, at most
``MAX_THREADS``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ENV = "META_CONSENSUS_KERNEL_THREADS"
MAX_THREADS = 8
# Below this many stack entries (n * d) a call stays on one thread: the split's fixed cost (a
# thread hand-off and a concatenation, ~0.1 ms) would be a visible share of a ~1 ms kernel.
MIN_ENTRIES = 1 << 21

_pool_lock = threading.Lock()
_pool: tuple[int, int, concurrent.futures.ThreadPoolExecutor] | None = None  # (pid, workers, pool)


def available_cores() -> int:
    """The number of cores this process may run on (its CPU affinity; the CPU count elsewhere).

    Returns:
      At least 1.
    """
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def kernel_threads(env: str | None = None) -> int:
    """Column ranges an eager kernel call is split into (1: no split).

    Args:
      env: the setting (default: the ``META_CONSENSUS_KERNEL_THREADS`` variable); empty: the
        number of available cores, at most ``MAX_THREADS``.

    Returns:
      The number of ranges, at least 1.

    Raises:
      ValueError: for a ``META_CONSENSUS_KERNEL_THREADS`` that is not a positive integer.
    """
    value = (os.environ.get(ENV, "") if env is None else env).strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{ENV} must be a positive integer (1 turns the split off), got {value!r}")
        return int(value)
    return max(1, min(available_cores(), MAX_THREADS))


def _executor(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """A process-wide pool with ``workers`` threads (rebuilt after a fork or a new thread count)."""
    global _pool
    with _pool_lock:
        pid = os.getpid()
        if _pool is None or _pool[0] != pid or _pool[1] != workers:
            if _pool is not None and _pool[0] == pid:
                _pool[2].shutdown(wait=False)
            _pool = (pid, workers, concurrent.futures.ThreadPoolExecutor(workers, "meta-consensus-kernel"))
        return _pool[2]


def _trace_state_clean() -> bool:
    """Whether no trace (jit, vmap, grad) is active on this thread; False if it cannot tell."""
    try:
        from jax._src import core  # no public equivalent in jax 0.10

        return bool(core.trace_state_clean())
    except (ImportError, AttributeError):
        return False


def _on_one_cpu(x: Any) -> bool:
    if not isinstance(x, jax.Array):
        return isinstance(x, np.ndarray) and jax.default_backend() == "cpu"
    devices = x.devices()
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def ranges(columns: int, parts: int) -> tuple[int, list[tuple[int, int, int]]]:
    """``width = ceil(columns / parts)`` and (start, keep_from, keep_to) of each range.

    Range i covers [start, start + width) with start = min(i * width, columns - width), so every
    range has the same width (one compilation) and the last one may overlap its predecessor; its
    result keeps only the columns [keep_from, keep_to) of its own output.

    Args:
      columns: the number of columns to split.
      parts: the number of ranges wanted (at most ``columns``).

    Returns:
      ``(width, [(start, keep_from, keep_to), ...])``, one triple per range.
    """
    width = -(-columns // parts)
    out = []
    for lo in range(0, columns, width):
        hi = min(lo + width, columns)
        start = min(lo, columns - width)
        out.append((start, lo - start, hi - start))
    return width, out


def column_parallel(kernel: Callable, min_block: Callable[[int], int]) -> Callable:
    """Wrap ``kernel(x, *args, start=, width=, **kw)`` so an eager call runs its columns on every core.

    ``kernel`` must compute every column of ``x`` (n, ...) independently and, given a traced
    ``start`` and a static ``width``, return the flat (width,) float32 results of the columns
    [start, start + width) of ``x.reshape(n, -1)``; without them, the full ``x.shape[1:]``
    result. ``min_block(n)`` is the fewest columns worth a range of their own.

    Args:
      kernel: the coordinate-wise kernel, with the ``start`` and ``width`` keywords above.
      min_block: the fewest columns worth a range of their own, as a function of n.

    Returns:
      A function with ``kernel``'s signature (without ``start``/``width``) that splits eager
      calls on one CPU device over the cores; ``.kernel`` holds the unsplit kernel.
    """

    @functools.wraps(kernel)
    def call(x, *args, **kwargs):
        plan = _plan(x, args, kwargs, min_block)
        if plan is None:
            return kernel(x, *args, **kwargs)
        x = jnp.asarray(x)  # one device buffer, read in place by every range
        width, plan = plan

        def run(start: int) -> jax.Array:
            return kernel(x, *args, start=jnp.int32(start), width=width, **kwargs).block_until_ready()

        pool = _executor(kernel_threads() - 1)  # sized by the setting, so a short plan reuses it
        futures = [pool.submit(run, start) for start, _, _ in plan[1:]]
        outs = [run(plan[0][0])]
        outs += [f.result() for f in futures]
        pieces = [out[lo:hi] for out, (_, lo, hi) in zip(outs, plan, strict=True)]
        return jnp.concatenate(pieces).reshape(x.shape[1:])

    call.kernel = kernel  # type: ignore[attr-defined]  # a function attribute: the unsplit kernel
    return call


def _plan(x, args: tuple, kwargs: dict, min_block: Callable[[int], int]) -> tuple | None:
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves((x, args, kwargs))):
        return None
    if getattr(x, "ndim", 0) < 2 or not _trace_state_clean() or not _on_one_cpu(x):
        return None
    n, columns = x.shape[0], math.prod(x.shape[1:])
    threads = kernel_threads()
    parts = min(threads, columns // max(min_block(n), 1))
    if parts < 2 or n * columns < MIN_ENTRIES:
        return None
    return ranges(columns, parts)
