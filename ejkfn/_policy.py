"""How selection may answer a cache miss."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

__all__ = ["AutotunePolicy"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AutotunePolicy:
    """What :func:`ejkfn.select` may do when no cache holds a config.

    Attributes:
        allow_autotune: may benchmark candidate configs.
        allow_heuristics: may fall back to the kernel's ``heuristic_cfg``.
        cache_miss_fallback: which of the two to try first on a miss.
        validate_backward: time forward plus backward when autotuning (forward alone where the kernel
            cannot be differentiated).
        persist_autotune: write autotuned configs to the persistent cache (pending until ``save()``).
        forbid_reautotune: never autotune a key again whose earlier autotuning found no working
            candidate.

    >>> AutotunePolicy().replace(allow_autotune=False).allow_autotune
    False
    """

    allow_autotune: bool = True
    allow_heuristics: bool = True
    cache_miss_fallback: Literal["autotune", "heuristics"] = "autotune"
    validate_backward: bool = False
    persist_autotune: bool = True
    forbid_reautotune: bool = True

    def __post_init__(self) -> None:
        if self.cache_miss_fallback not in ("autotune", "heuristics"):
            raise ValueError(
                f"cache_miss_fallback must be 'autotune' or 'heuristics'; got {self.cache_miss_fallback!r}"
            )
        for name in (
            "allow_autotune",
            "allow_heuristics",
            "validate_backward",
            "persist_autotune",
            "forbid_reautotune",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool; got {value!r}")

    def replace(self, **changes: Any) -> AutotunePolicy:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)
