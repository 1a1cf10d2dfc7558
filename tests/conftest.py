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


@pytest.fixture
def cudnn_lowering(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN attention lowers for "cuda" on this machine: a compile check without a GPU.

    jax checks the cuDNN version and the GPU's compute capability while tracing, which needs its
    CUDA plugin; both checks are patched (private jax functions), as for a Hopper, so that lowering
    can proceed; ejkfn takes the machine for a CUDA GPU. It skips if jax moves the version check.
    """
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused
    except ImportError:
        pytest.skip("jax has no cuDNN fused attention module")
    if not hasattr(fused, "check_cudnn_version"):
        pytest.skip("jax's cuDNN version check moved")
    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)
    if hasattr(fused, "check_compute_capability"):  # head dims over 128 need a Hopper
        monkeypatch.setattr(fused, "check_compute_capability", lambda capability: True)
    from ejkfn.attention import _api, _cudnn

    monkeypatch.setattr(_cudnn, "_on_cuda", lambda: True)
    monkeypatch.setattr(_api, "_interpret", lambda backend: False)  # cuDNN is native there
