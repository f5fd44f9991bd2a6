"""Test setup: 8 simulated CPU devices and strict dtype promotion for every test."""

import os

# Must happen before jax is imported anywhere in the test session.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
