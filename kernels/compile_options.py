"""How the package's kernels are compiled: ``kernel_jit``, a ``jax.jit`` with XLA:CPU options.

XLA:CPU vectorizes for 256-bit registers by default, also on CPUs with AVX-512 (a choice made
for older Xeons, whose clocks dropped under 512-bit code). The streaming kernels here (the
selection and counting loops, the sorting networks, TIES's threshold search) are bound by
integer compares and adds, not by memory, and run faster with 512-bit vectors on such a CPU
(compare ``python -m benchmarks aggregators --n-sweep`` and ``python -m benchmarks merging_speed``
with ``META_CONSENSUS_CPU_VECTOR_WIDTH=256`` and without). ``kernel_jit`` passes
``xla_cpu_prefer_vector_width = 512`` to the compiler for the package's own jitted kernels when
the CPU has AVX-512 (``avx512f`` and ``avx512bw`` in ``/proc/cpuinfo``), and nothing on other
CPUs or backends.

Options belong to the outermost compiled function: a kernel called inside the user's own
``jax.jit`` is compiled with that jit's options. Pass the same option there
(``jax.jit(f, compiler_options={"xla_cpu_prefer_vector_width": 512})``) or set
``XLA_FLAGS=--xla_cpu_prefer_vector_width=512`` for the whole process.
``META_CONSENSUS_CPU_VECTOR_WIDTH`` overrides the choice: ``256`` or ``512`` forces a width,
``xla`` leaves XLA's default.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax

ENV = "META_CONSENSUS_CPU_VECTOR_WIDTH"
CHOICES = ("256", "512", "xla")


@functools.cache
def cpu_has_avx512() -> bool:
    """Whether this machine's CPU has AVX-512 with byte and word ops (Linux; False elsewhere).

    Returns:
      True when ``/proc/cpuinfo`` lists both ``avx512f`` and ``avx512bw``.
    """
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx512f", "avx512bw"} <= flags
    except OSError:
        pass
    return False


def vector_width(env: str | None = None, avx512: bool | None = None) -> int | None:
    """The vector width (bits) to ask XLA:CPU for, or None for XLA's default.

    Args:
      env: the override (default: the ``META_CONSENSUS_CPU_VECTOR_WIDTH`` variable).
      avx512: whether the CPU has AVX-512 (default: :func:`cpu_has_avx512`).

    Returns:
      256 or 512, or None for XLA's default width.

    Raises:
      ValueError: for an override other than ``256``, ``512`` or ``xla``.
    """
    value = os.environ.get(ENV, "") if env is None else env
    value = value.strip().lower()
    if value:
        if value not in CHOICES:
            raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {value!r}")
        return None if value == "xla" else int(value)
    has = cpu_has_avx512() if avx512 is None else avx512
    return 512 if has else None


def compiler_options(backend: str) -> dict[str, Any] | None:
    """XLA compile options for a kernel on ``backend`` (None: the backend's defaults).

    Args:
      backend: the JAX backend name (``"cpu"``, ``"gpu"``, ``"tpu"``, ...).

    Returns:
      ``{"xla_cpu_prefer_vector_width": width}`` on CPU when a width is chosen, else None.

    Raises:
      ValueError: for an invalid ``META_CONSENSUS_CPU_VECTOR_WIDTH`` (see :func:`vector_width`).
    """
    if backend != "cpu":
        return None
    width = vector_width()
    return None if width is None else {"xla_cpu_prefer_vector_width": width}


def _under_trace(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves((args, kwargs)))


class _Kernel:
    """A lazily built ``jax.jit`` of ``fun``: the options depend on the backend, known at the first call.

    JAX accepts compiler options on the outermost jit only, so a call inside a trace (the
    user's jit, vmap, or another kernel) goes through a plain ``jax.jit`` of the same function.
    """

    def __init__(self, fun: Callable, static_argnames: Sequence[str]):
        self._fun = fun
        self._static = tuple(static_argnames)
        self._plain = jax.jit(fun, static_argnames=self._static)
        self._jitted: dict[str, Callable] = {}
        functools.update_wrapper(self, fun)

    def _for_backend(self) -> Callable:
        backend = jax.default_backend()
        jitted = self._jitted.get(backend)
        if jitted is None:
            options = compiler_options(backend)
            jitted = (
                self._plain
                if options is None
                else jax.jit(self._fun, static_argnames=self._static, compiler_options=options)
            )
            self._jitted[backend] = jitted
        return jitted

    def __call__(self, *args, **kwargs):
        if _under_trace(args, kwargs):
            return self._plain(*args, **kwargs)
        try:
            return self._for_backend()(*args, **kwargs)
        except ValueError as err:
            # Concrete arguments inside an outer trace (closed-over constants) still nest.
            if "compiler_options" not in str(err):
                raise
            return self._plain(*args, **kwargs)

    def lower(self, *args, **kwargs):
        """Lower the jitted function for these arguments, as ``jax.jit(...).lower`` does.

        Args:
          *args: the kernel's positional arguments.
          **kwargs: the kernel's keyword arguments.

        Returns:
          The ``jax.stages.Lowered`` of the jit this call would run.
        """
        return (self._plain if _under_trace(args, kwargs) else self._for_backend()).lower(*args, **kwargs)


def kernel_jit(fun: Callable | None = None, *, static_argnames: Sequence[str] = ()) -> Any:
    """``jax.jit`` for the package's kernels, with :func:`compiler_options` (bare or with arguments).

    Usable bare (``@kernel_jit``) or with arguments (``@kernel_jit(static_argnames=("f",))``).

    Args:
      fun: the function to compile; None when used with arguments.
      static_argnames: names of the arguments that are static, as for ``jax.jit``.

    Returns:
      The compiled kernel (a callable with ``lower``), or a decorator when ``fun`` is None.
    """
    if fun is None:
        return functools.partial(kernel_jit, static_argnames=static_argnames)
    return _Kernel(fun, static_argnames)
