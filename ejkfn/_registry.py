"""Platform machinery: block-size parameters, a registry of implementations, platform detection."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from ._platform import device_kind

__all__ = [
    "Backend",
    "BwdParams",
    "FwdParams",
    "KernelConfig",
    "Platform",
    "available_platforms",
    "detect_platform",
    "get_kernel",
    "register_kernel",
]


class Platform(enum.StrEnum):
    """Implementation families."""

    TRITON = "triton"
    PALLAS = "pallas"
    CUDNN = "cudnn"
    CUDA = "cuda"
    XLA = "xla"
    AUTO = "auto"


class Backend(enum.StrEnum):
    """Hardware a registered implementation runs on."""

    GPU = "gpu"
    TPU = "tpu"
    CPU = "cpu"
    ANY = "any"


class _Validated:
    """Checks at construction that the fields named in ``_positive`` are positive ints."""

    __slots__ = ()
    _positive: ClassVar[tuple[str, ...]] = (
        "q_blocksize",
        "kv_blocksize",
        "num_warps",
        "num_stages",
    )

    def __post_init__(self) -> None:
        for name in self._positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FwdParams(_Validated):
    """Block sizes and launch parameters of a forward pass.

    ``kv_splits`` divides each query tile's keys among that many programs, whose partial results
    merge by their log-sum-exps (flash decoding): it fills the GPU where few queries meet many keys.
    Backends that do not split refuse more than 1.
    """

    _positive = (*_Validated._positive, "kv_splits")

    q_blocksize: int = 128
    kv_blocksize: int = 64
    num_warps: int = 4
    num_stages: int = 2
    kv_splits: int = 1


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BwdParams(_Validated):
    """Block sizes and launch parameters of a backward pass.

    ``variant`` names the backward kernels where a backend has more than one (Pallas Mosaic on
    Hopper: ``"mosaic"`` for its own kernels; ``None``, the default that older configs keep, for the
    Triton-lowering ones); backends with a single backward ignore it. ``dq_num_stages`` is the
    pipelining depth of the dQ kernel where a backend runs it apart from the dK/dV kernel (the
    portable backwards); ``None`` takes ``num_stages``, and other backends ignore it.
    ``kv_splits`` divides each dQ tile's keys among that many programs whose partial dQs add up
    (in float32): it fills the GPU where few queries meet many keys. Backends that do not split
    refuse more than 1.
    """

    _positive = (*_Validated._positive, "kv_splits")

    q_blocksize: int = 64
    kv_blocksize: int = 64
    num_warps: int = 4
    num_stages: int = 2
    variant: str | None = None
    dq_num_stages: int | None = None
    kv_splits: int = 1

    def __post_init__(self) -> None:
        super(BwdParams, self).__post_init__()
        if self.variant is not None and not (isinstance(self.variant, str) and self.variant):
            raise ValueError(f"variant={self.variant!r} must be None or a non-empty str")
        stages = self.dq_num_stages
        if stages is not None and (not isinstance(stages, int) or stages < 1):
            raise ValueError(f"dq_num_stages={stages!r} must be None or a positive int")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KernelConfig(_Validated):
    """The reference's shared kernel config: block sizes, launch parameters, platform."""

    _positive = ("block_q", "block_k", "block_d", "num_warps", "num_stages")

    block_q: int = 128
    block_k: int = 128
    block_d: int = 64
    num_warps: int = 4
    num_stages: int = 2
    platform: str = "auto"
    backend: str = "any"
    algorithm: str | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        super(KernelConfig, self).__post_init__()
        Platform(self.platform)
        Backend(self.backend)


# (algorithm, platform, backend) -> implementation. Filled at import time of the operation packages
# (a table of code, like a module's functions), never by selection.
_REGISTRY: dict[tuple[str, str, str], Any] = {}


def register_kernel(algorithm: str, platform: str, backend: str = "any") -> Callable[[Any], Any]:
    """Decorator registering an implementation (a function or a descriptor) of ``algorithm``."""
    key = (algorithm, Platform(platform).value, Backend(backend).value)

    def wrap(impl: Any) -> Any:
        _REGISTRY[key] = impl
        return impl

    return wrap


def get_kernel(algorithm: str, platform: str, backend: str | None = None) -> Any:
    """The implementation registered for ``algorithm`` on ``platform`` (this device's backend first)."""
    backend = backend or device_kind()
    for b in (backend, "any"):
        fn = _REGISTRY.get((algorithm, platform, b))
        if fn is not None:
            return fn
    raise ValueError(
        f"no implementation of {algorithm!r} for platform={platform!r} on backend={backend!r}; "
        f"registered: {sorted(p for a, p, _ in _REGISTRY if a == algorithm)}"
    )


def available_platforms(algorithm: str, backend: str | None = None) -> list[str]:
    """Platforms with an implementation of ``algorithm`` for ``backend`` (default: this device)."""
    backend = backend or device_kind()
    return sorted({p for a, p, b in _REGISTRY if a == algorithm and b in (backend, "any")})


_PREFERENCE = {
    "gpu": ("triton", "pallas", "cudnn", "xla"),
    "tpu": ("pallas", "xla"),
    "cpu": ("xla",),
}


def detect_platform(
    algorithm: str,
    platform: Literal["triton", "pallas", "cudnn", "cuda", "xla", "auto"] | None = "auto",
    backend: str | None = None,
) -> Platform:
    """The platform to run ``algorithm`` on: the one asked for, or the best available here.

    Raises ``ValueError`` when an explicitly requested platform has no implementation.
    """
    backend = backend or device_kind()
    available = available_platforms(algorithm, backend)
    if platform not in (None, "auto"):
        requested = Platform(platform).value
        if requested not in available:
            raise ValueError(
                f"platform={platform!r} is not available for {algorithm!r} on "
                f"{backend!r}; available: {available}"
            )
        return Platform(requested)
    for candidate in _PREFERENCE[backend]:
        if candidate in available:
            return Platform(candidate)
    raise ValueError(f"no platform implements {algorithm!r} on {backend!r}")
