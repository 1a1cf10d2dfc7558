"""What machine and software a config was chosen for.

Everything here is read once per process and memoised: the device and library versions do not change
while a program runs, and cache keys must be cheap to build.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Mapping
from typing import Any, Literal

import jax

from ._serialize import stable_json

__all__ = [
    "device_fingerprint",
    "device_kind",
    "get_device_platform",
    "sharding_fingerprint",
    "software_versions",
]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def software_versions() -> Mapping[str, str | None]:
    """Versions of the libraries that can change the best config (part of every key)."""
    from . import __version__

    return {
        "ejkfn": __version__,
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "triton": _version("triton"),
    }


def _default_device() -> jax.Device:
    return jax.devices()[0]


def device_kind(device: jax.Device | None = None) -> Literal["gpu", "tpu", "cpu"]:
    """The kind of accelerator: ``"gpu"``, ``"tpu"`` or ``"cpu"``.

    >>> device_kind() in ("gpu", "tpu", "cpu")
    True
    """
    platform = (device or _default_device()).platform
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    if platform == "tpu":
        return "tpu"
    return "cpu"


def on_cuda() -> bool:
    """Whether the default device is an NVIDIA GPU under CUDA, where cuDNN and PTX run (False where
    no backend starts)."""
    try:
        device = _default_device()
    except RuntimeError:
        return False
    version = device_fingerprint(device)["platform_version"]
    return device_kind(device) == "gpu" and "cuda" in version.lower()


def get_device_platform(device: jax.Device | None = None) -> Literal["triton", "pallas", "xla"]:
    """The implementation family that suits the device best: Triton on GPUs, Pallas on TPUs, else XLA."""
    kind = device_kind(device)
    return {"gpu": "triton", "tpu": "pallas", "cpu": "xla"}[kind]


@functools.cache
def _fingerprint_of(platform: str, kind: str, platform_version: str) -> Mapping[str, Any]:
    return {"platform": platform, "device_kind": kind, "platform_version": platform_version}


def device_fingerprint(device: jax.Device | None = None) -> Mapping[str, Any]:
    """Device identity for cache keys: platform, device kind (e.g. ``"NVIDIA H200"``) and driver version.

    >>> sorted(device_fingerprint())
    ['device_kind', 'platform', 'platform_version']
    """
    device = device or _default_device()
    try:
        platform_version = str(device.client.platform_version)
    except Exception:  # some backends do not report one
        platform_version = "unknown"
    return _fingerprint_of(device.platform, str(device.device_kind), platform_version)


def sharding_fingerprint(x: Any) -> str | None:
    """A stable text for the sharding of an array (``None`` for unsharded or abstract values).

    Device ids are left out: the same mesh shape and partition spec pick the same config wherever they
    are placed.
    """
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return None
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is not None and mesh is not None:
        axes = dict(getattr(mesh, "shape", {}))
        return stable_json({"mesh": axes, "spec": [str(s) for s in spec]})
    if getattr(sharding, "is_fully_replicated", False) and len(sharding.device_set) == 1:
        return None
    return stable_json({"sharding": type(sharding).__name__, "devices": len(sharding.device_set)})
