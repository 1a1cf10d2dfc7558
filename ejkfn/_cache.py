"""Cache state as immutable values: the memory cache, overlays, and the bundle :class:`Caches`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ._persistent import PersistentCache

__all__ = ["Caches", "ConfigCache"]


class ConfigCache(Mapping[str, Any]):
    """An immutable mapping from invocation key to config.

    ``put`` and ``merge`` return new caches and leave this one as it was, so a cache can be threaded
    through a program like any other value (and used as an overlay).

    >>> c0 = ConfigCache()
    >>> c1 = c0.put("k", 1)
    >>> len(c0), c1.get("k")
    (0, 1)
    """

    __slots__ = ("_entries",)

    def __init__(self, entries: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()):
        self._entries: dict[str, Any] = dict(entries)

    def __getitem__(self, key: str) -> Any:
        return self._entries[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self._entries.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"ConfigCache({len(self)} entries)"

    def put(self, key: str, cfg: Any) -> ConfigCache:
        """A new cache with ``key`` mapped to ``cfg``."""
        if not isinstance(key, str):
            raise TypeError(
                f"cache keys are strings (Invocation.key); got {type(key).__name__}: {key!r}"
            )
        if cfg is None:
            raise ValueError(f"cannot cache None as the config of {key!r}")
        entries = dict(self._entries)
        entries[key] = cfg
        return ConfigCache(entries)

    def merge(self, other: Mapping[str, Any]) -> ConfigCache:
        """A new cache holding both; entries of ``other`` win."""
        return ConfigCache({**self._entries, **other})

    def without(self, keys: Iterable[str]) -> ConfigCache:
        """A new cache without ``keys``."""
        drop = set(keys)
        return ConfigCache({k: v for k, v in self._entries.items() if k not in drop})


@functools.cache
def _shipped_layer() -> PersistentCache:
    # Package data never changes while the program runs: load it once.
    return PersistentCache.shipped()


@dataclasses.dataclass(frozen=True, eq=False)
class Caches:
    """Everything selection reads and writes, as one immutable value.

    Attributes:
        memory: configs chosen in this program so far.
        persistent: the user's on-disk cache (``None`` for none). New entries stay pending until
            :meth:`save`.
        overlays: mappings consulted before everything else but an explicit config, innermost first.
        shipped: whether to consult the read-only layer of pre-tuned configs shipped with ejkfn.
        failed: keys whose autotuning found no working candidate (so it is not tried again under
            ``forbid_reautotune``).

    >>> caches = Caches()
    >>> caches.with_overlay({"k": 1}).lookup("k")
    ('overlay', 1)
    >>> caches.lookup("k") is None   # the original is unchanged
    True
    """

    memory: ConfigCache = dataclasses.field(default_factory=ConfigCache)
    persistent: PersistentCache | None = None
    overlays: tuple[Mapping[str, Any], ...] = ()
    shipped: bool = True
    failed: frozenset[str] = frozenset()

    def replace(self, **changes: Any) -> Caches:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def with_overlay(self, overlay: Mapping[str, Any]) -> Caches:
        """A copy with ``overlay`` as the innermost overlay."""
        if not isinstance(overlay, Mapping):
            raise TypeError(f"an overlay maps keys to configs; got {type(overlay).__name__}")
        return self.replace(overlays=(overlay, *self.overlays))

    def without_overlay(self, overlay: Mapping[str, Any]) -> Caches:
        """A copy without ``overlay`` (compared by identity)."""
        return self.replace(overlays=tuple(o for o in self.overlays if o is not overlay))

    def lookup(
        self, key: str, *, portable_key: str | Callable[[], str] | None = None
    ) -> tuple[str, Any] | None:
        """``(tier, cfg)`` of the first cache layer holding ``key``, or ``None``.

        Tiers in order: ``"overlay"``, ``"memory"``, ``"persistent"``, ``"shipped"``. The shipped layer
        is keyed by ``portable_key`` (see :attr:`ejkfn.Invocation.portable_key`) where one is given,
        or by what it returns when it is a function (called only if that layer is reached).
        """
        for overlay in self.overlays:
            cfg = overlay.get(key)
            if cfg is not None:
                return "overlay", cfg
        cfg = self.memory.get(key)
        if cfg is not None:
            return "memory", cfg
        if self.persistent is not None:
            cfg = self.persistent.get(key)
            if cfg is not None:
                return "persistent", cfg
        if self.shipped:
            shipped_key = portable_key() if callable(portable_key) else portable_key
            cfg = _shipped_layer().get(shipped_key or key)
            if cfg is not None:
                return "shipped", cfg
        return None

    def remember(self, key: str, cfg: Any) -> Caches:
        """A copy with ``key -> cfg`` in the memory cache."""
        return self.replace(memory=self.memory.put(key, cfg))

    def persist(self, key: str, cfg: Any, *, meta: Mapping[str, Any] | None = None) -> Caches:
        """A copy with the entry pending in the persistent cache (a no-op without one)."""
        if self.persistent is None:
            return self
        return self.replace(persistent=self.persistent.put(key, cfg, meta=meta))

    def save(self) -> Caches:
        """Write pending persistent entries to disk; returns the updated caches."""
        if self.persistent is None:
            return self
        return self.replace(persistent=self.persistent.save())
