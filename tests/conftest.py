"""Test-run settings that must be in place before JAX or Triton is imported, and shared fixtures."""

import os

# Several host devices for the mapping and sharding tests.
# On the CPU (the default here; run on a GPU with JAX_PLATFORMS=cuda) Triton kernels run in its
# interpreter, which must be chosen before triton is first imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On a GPU each pytest-xdist worker is a JAX process: without this the first one takes 75% of the
# GPU's memory up front and the others run out of it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import zlib

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "interpreted: runs a backend in an interpreter on this machine (slow; fewer cases)",
    )


@pytest.fixture
def key(request: pytest.FixtureRequest):
    """A PRNG key of the test's own: different for every test and parameter, stable across runs."""
    import jax

    return jax.random.key(zlib.crc32(request.node.nodeid.encode()))
