"""Test setup: 8 host CPU devices, so that meshes of 8 devices are real.

XLA reads XLA_FLAGS once, when the backend starts, so this must run before any
test module imports jax.
"""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Tests check numerics, not speed: compile fast.
jax.config.update("jax_disable_most_optimizations", True)
