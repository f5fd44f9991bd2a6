"""kernel_jit: the package's kernels compiled with XLA:CPU options chosen per backend and CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import compile_options as co
from kernels import selection


def test_vector_width_follows_the_cpu_and_the_override():
    assert co.vector_width(env="", avx512=True) == 512
    assert co.vector_width(env="", avx512=False) is None  # XLA's default elsewhere
    assert co.vector_width(env="256", avx512=True) == 256
    assert co.vector_width(env=" 512 ", avx512=False) == 512
    assert co.vector_width(env="XLA", avx512=True) is None
    with pytest.raises(ValueError, match="META_CONSENSUS_CPU_VECTOR_WIDTH must be one of 256, 512, xla"):
        co.vector_width(env="1024", avx512=True)


def test_options_only_for_the_cpu_backend(monkeypatch):
    monkeypatch.setenv(co.ENV, "512")
    assert co.compiler_options("cpu") == {"xla_cpu_prefer_vector_width": 512}
    assert co.compiler_options("gpu") is None
    monkeypatch.setenv(co.ENV, "xla")
    assert co.compiler_options("cpu") is None


def test_kernel_jit_hands_its_options_to_the_compiler(monkeypatch):
    # An option XLA does not know makes the compile fail: proof that the options reach it.
    monkeypatch.setattr(co, "compiler_options", lambda backend: {"xla_cpu_no_such_option": 1})

    @co.kernel_jit(static_argnames=("k",))
    def add(x, k):
        return x + k

    with pytest.raises(Exception, match="xla_cpu_no_such_option"):
        add(jnp.ones(3), k=2)
    assert add.__name__ == "add" and add.__wrapped__ is not None


def test_kernel_jit_keeps_results_and_static_arguments(monkeypatch):
    monkeypatch.setattr(co, "compiler_options", lambda backend: {"xla_cpu_prefer_vector_width": 512})

    @co.kernel_jit(static_argnames=("k",))
    def top(x, k):
        return jax.lax.top_k(x, k)[0]

    x = jnp.asarray(np.random.default_rng(0).standard_normal(50), jnp.float32)
    np.testing.assert_array_equal(np.asarray(top(x, k=3)), np.sort(np.asarray(x))[::-1][:3])
    assert top.lower(x, k=3).compile() is not None
    # Inside a user's jit the kernel is inlined (compiled with the outer jit's options).
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda y: top(y, k=3))(x)), np.asarray(top(x, k=3)))


@pytest.mark.parametrize("width", ["256", "512"])
def test_selection_is_exact_at_either_vector_width(monkeypatch, width):
    monkeypatch.setenv(co.ENV, width)

    @co.kernel_jit
    def med(x):
        return selection.median.__wrapped__(x)  # compiled here, with this width

    rng = np.random.default_rng(1)
    x = rng.standard_normal((70, 300)).astype(np.float32)
    x[:, :20] = np.round(x[:, :20])  # ties
    np.testing.assert_array_equal(np.asarray(med(jnp.asarray(x))), np.median(x, axis=0).astype(np.float32))


def test_kernel_jit_nests_inside_other_traces(monkeypatch):
    monkeypatch.setattr(co, "compiler_options", lambda backend: {"xla_cpu_prefer_vector_width": 512})

    @co.kernel_jit
    def inner(x):
        return 2.0 * x

    @co.kernel_jit
    def outer(x):
        return inner(x) + inner(jnp.ones(3))  # a traced argument and a concrete one

    x = jnp.arange(3.0)
    want = 2.0 * np.arange(3.0) + 2.0
    np.testing.assert_array_equal(np.asarray(outer(x)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(outer)(x)), want)
    np.testing.assert_array_equal(np.asarray(jax.vmap(inner)(jnp.ones((2, 3)))), np.full((2, 3), 2.0))
