"""A directory-backed config store whose in-memory value is immutable.

Disk IO happens only at the edges: constructing a :class:`PersistentCache` (load), :meth:`save`,
:meth:`reload`, :meth:`remove`, :meth:`clear`, :meth:`export` and :meth:`import_file`. Everything
else returns a new value and leaves the old one untouched.

On disk there is one JSON file per kernel name, ``<dir>/<kernel_name>.json``::

    {"schema": "ejkfn.cache/1", "entries": {"<kernel_name>/<digest>": record, ...}}

with ``record = {"cfg": cfg_to_dict(cfg), "meta": {...}, "written_at": "<UTC ISO time>",
"ejkfn_schema": 1}``. Writers take ``<dir>/.lock``, re-read the shard, merge, write a temporary
file in the same directory, fsync it and ``os.replace`` it over the shard, so readers (who take no
lock) always see a whole file and concurrent writers lose nothing.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import hashlib
import importlib.resources
import json
import os
import pathlib
import re
import tempfile
import time
import types
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import filelock

from ._serialize import cfg_from_dict, cfg_to_dict, stable_json

__all__ = ["SCHEMA", "CacheCorruptionWarning", "PersistentCache", "default_cache_dir"]

SCHEMA = "ejkfn.cache/1"
"""The ``schema`` tag of a shard file (and of an export file)."""
RECORD_SCHEMA = 1
"""The ``ejkfn_schema`` of the records this version writes and uses."""

_LOCK_NAME = ".lock"
_LOCK_TIMEOUT_S = 60.0
# At load time a corrupt file is only moved aside if the lock is free right away: a reader must
# never wait on a writer.
_LOAD_LOCK_TIMEOUT_S = 0.5
_STALE_TMP_S = 60.0
# Tests only: seconds to sleep between writing the temp file and replacing the shard.
_PAUSE_ENV = "EJKFN_TEST_SAVE_PAUSE"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_UNDECODED: Any = object()


class CacheCorruptionWarning(UserWarning):
    """A persistent-cache file or record could not be used; it is treated as absent."""


def default_cache_dir() -> pathlib.Path:
    """The user's cache directory.

    Returns:
        ``$EJKFN_CACHE_DIR`` if set and non-empty, else ``~/.cache/ejkfn``.
    """
    env = os.environ.get("EJKFN_CACHE_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "ejkfn"


def _shard_name(key: str) -> str:
    """File name of the shard holding ``key``: its kernel name, made safe for a file system."""
    kernel = key.partition("/")[0]
    safe = _UNSAFE.sub("_", kernel)
    if not safe or safe.startswith("."):
        # A leading dot would hide the file among lock and temporary files, which loading skips.
        safe = "_" + safe
    if len(safe) > 120:
        safe = safe[:100] + "-" + hashlib.sha256(kernel.encode()).hexdigest()[:16]
    return safe + ".json"


def _is_shard(name: str) -> bool:
    return name.endswith(".json") and not name.startswith(".")


def _utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


def _warn(message: str) -> None:
    warnings.warn(message, CacheCorruptionWarning, stacklevel=3)


class _Entry:
    """One stored record and its config, decoded lazily once."""

    __slots__ = ("_cfg", "key", "record", "source")

    def __init__(self, key: str, record: dict[str, Any], source: str, cfg: Any = _UNDECODED):
        self.key = key
        self.record = record
        self.source = source
        self._cfg = cfg

    def cfg(self) -> Any:
        cfg = self._cfg
        if cfg is _UNDECODED:
            try:
                cfg = cfg_from_dict(self.record["cfg"])
            except Exception as exc:  # an unimportable or changed config type is not fatal
                _warn(
                    f"{self.source}: entry {self.key!r} has an unusable config "
                    f"({type(exc).__name__}: {exc}); ignoring it"
                )
                cfg = None
            # Benign race: two threads may both decode; both store equal values.
            self._cfg = cfg
        return cfg


def _record_problem(record: Any) -> str | None:
    """Why ``record`` (of this ``ejkfn_schema``) is malformed, or None if it is fine."""
    cfg = record.get("cfg")
    if not isinstance(cfg, dict):
        return "'cfg' is not an object"
    if not isinstance(cfg.get("type"), str) or not isinstance(cfg.get("fields"), dict):
        return "'cfg' lacks a string 'type' and an object 'fields'"
    if not isinstance(record.get("meta", {}), dict):
        return "'meta' is not an object"
    if not isinstance(record.get("written_at", ""), str):
        return "'written_at' is not a string"
    return None


def _classify(record: Any) -> tuple[str, str | None]:
    """``("ok", None)``, ``("foreign", None)`` (another ejkfn_schema) or ``("bad", reason)``."""
    if not isinstance(record, dict):
        return "bad", f"record is a {type(record).__name__}, not an object"
    schema = record.get("ejkfn_schema")
    if not isinstance(schema, int) or isinstance(schema, bool):
        return "bad", f"'ejkfn_schema' is {schema!r}, not an integer"
    if schema != RECORD_SCHEMA:
        return "foreign", None
    problem = _record_problem(record)
    return ("bad", problem) if problem else ("ok", None)


def _parse_document(data: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """The ``entries`` of a cache document, or ``(None, reason)`` for a whole-file problem."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON ({exc})"
    if not isinstance(doc, dict):
        return None, f"top level is a {type(doc).__name__}, not an object"
    if doc.get("schema") != SCHEMA:
        return None, f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}"
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        return None, f"'entries' is a {type(entries).__name__}, not an object"
    return entries, None


@dataclasses.dataclass(slots=True)
class _Shard:
    keep: dict[str, Any]  # records to keep when rewriting: usable and foreign-schema ones
    usable: dict[str, _Entry]


def _read_shard(file: pathlib.Path, old: Mapping[str, _Entry]) -> tuple[_Shard | None, str | None]:
    """A shard file, or ``(None, reason)`` if unusable as a whole (``(None, None)`` if gone)."""
    try:
        data = file.read_bytes()
    except FileNotFoundError:  # moved aside or removed by another process since we listed it
        return None, None
    except OSError as exc:
        return None, f"cannot be read ({exc})"
    entries, reason = _parse_document(data)
    if entries is None:
        return None, reason
    shard = _Shard({}, {})
    source = str(file)
    for key, record in entries.items():
        kind, problem = _classify(record)
        if kind == "bad":
            _warn(f"{file}: skipping entry {key!r}: {problem}")
            continue
        shard.keep[key] = record
        if kind == "ok":
            prev = old.get(key)
            # Keep the memoised config of an unchanged record.
            reuse = prev is not None and prev.record == record
            shard.usable[key] = prev if reuse else _Entry(key, record, source)
    return shard, None


def _move_aside(file: pathlib.Path) -> None:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    target = file.with_name(f"{file.name}.corrupt-{stamp}")
    n = 0
    while target.exists():
        n += 1
        target = file.with_name(f"{file.name}.corrupt-{stamp}-{n}")
    with contextlib.suppress(FileNotFoundError):
        os.replace(file, target)


def _shard_files(directory: pathlib.Path) -> list[pathlib.Path]:
    try:
        with os.scandir(directory) as it:
            names = [e.name for e in it if _is_shard(e.name) and e.is_file()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [directory / name for name in sorted(names)]


def _scan(
    directory: pathlib.Path, old: Mapping[str, _Entry], *, locked: bool, fix: bool
) -> dict[str, _Shard]:
    """Read every shard of ``directory``; warn about corrupt files and, if ``fix``, move them aside.

    With ``locked`` the caller holds the directory lock; otherwise a corrupt file is moved only
    after taking the lock and seeing it still corrupt, so that a file another process just rewrote
    is never moved.
    """
    shards: dict[str, _Shard] = {}
    corrupt: list[pathlib.Path] = []
    for file in _shard_files(directory):
        shard, reason = _read_shard(file, old)
        if shard is not None:
            shards[file.name] = shard
        elif reason is not None:
            fixing = fix and (locked or os.access(directory, os.W_OK))
            action = "moving it aside" if fixing else "ignoring it"
            _warn(f"{file}: corrupt cache file ({reason}); {action}")
            if fixing:
                corrupt.append(file)
    if corrupt and locked:
        for file in corrupt:
            _move_aside(file)
    elif corrupt:
        lock = filelock.FileLock(str(directory / _LOCK_NAME), timeout=_LOAD_LOCK_TIMEOUT_S)
        with contextlib.suppress(filelock.Timeout, OSError), lock:
            for file in corrupt:
                if _read_shard(file, {})[1] is not None:
                    _move_aside(file)
    return shards


def _write_json(target: pathlib.Path, doc: Mapping[str, Any], *, pause: bool = False) -> None:
    """Write ``doc`` to ``target`` atomically: temp file in the same directory, fsync, replace."""
    text = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False, ensure_ascii=False) + "\n"
    try:
        mode = target.stat().st_mode & 0o777
    except FileNotFoundError:
        mode = 0o644
    fd, tmp = _mkstemp(target)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), mode)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if pause and (delay := os.environ.get(_PAUSE_ENV)):
            time.sleep(float(delay))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def _mkstemp(target: pathlib.Path) -> tuple[int, str]:
    # The leading dot and ".tmp" suffix keep loaders from taking it for a shard.
    return tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")


def _fsync_dir(directory: pathlib.Path) -> None:
    # Makes the rename durable; not every file system allows fsync on a directory.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _clean_stale_temps(directory: pathlib.Path) -> None:
    """Remove temp files left by killed writers (older than a minute, so never a live one)."""
    cutoff = time.time() - _STALE_TMP_S
    with contextlib.suppress(OSError), os.scandir(directory) as it:
        for e in it:
            if e.name.startswith(".") and e.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    if e.stat().st_mtime < cutoff:
                        os.unlink(e.path)


def _document(entries: Mapping[str, Any]) -> dict[str, Any]:
    return {"schema": SCHEMA, "entries": dict(entries)}


class PersistentCache:
    """A directory of cached configs, held as an immutable value.

    Constructing one loads what is on disk now; :meth:`put` returns a new value with the entry
    pending, and :meth:`save` writes pending entries (merging with whatever other processes wrote
    meanwhile) and returns the new value. Nothing is created on disk until something is saved.

    Args:
        path: the cache directory; ``None`` means :func:`default_cache_dir`.
        readonly: refuse :meth:`put`, :meth:`import_file`, :meth:`remove` and :meth:`clear`, and
            never touch the directory (corrupt files are then ignored, not moved aside).

    Example:
        >>> import tempfile
        >>> from ejkfn.testing import ScaleCfg
        >>> cache = PersistentCache(tempfile.mkdtemp())
        >>> saved = cache.put("scale/ab12", ScaleCfg(block=4), meta={"time_ms": 1.5}).save()
        >>> saved.get("scale/ab12"), cache.get("scale/ab12")
        (ScaleCfg(block=4), None)
        >>> PersistentCache(saved.path).get("scale/ab12")
        ScaleCfg(block=4)
    """

    __slots__ = ("_loaded", "_merged", "_path", "_pending", "_readonly")

    _path: pathlib.Path
    _readonly: bool
    _loaded: dict[str, _Entry]
    _pending: dict[str, _Entry]
    _merged: dict[str, _Entry] | None

    def __init__(self, path: str | os.PathLike[str] | None = None, *, readonly: bool = False):
        directory = default_cache_dir() if path is None else pathlib.Path(path).expanduser()
        directory = directory.absolute()
        shards = _scan(directory, {}, locked=False, fix=not readonly)
        self._set(directory, readonly, _usable(shards), {})

    def _set(
        self,
        path: pathlib.Path,
        readonly: bool,
        loaded: dict[str, _Entry],
        pending: dict[str, _Entry],
    ) -> None:
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_readonly", readonly)
        object.__setattr__(self, "_loaded", loaded)
        object.__setattr__(self, "_pending", pending)
        object.__setattr__(self, "_merged", None)

    def _evolve(
        self, loaded: dict[str, _Entry] | None = None, pending: dict[str, _Entry] | None = None
    ) -> PersistentCache:
        new = object.__new__(PersistentCache)
        new._set(
            self._path,
            self._readonly,
            self._loaded if loaded is None else loaded,
            self._pending if pending is None else pending,
        )
        return new

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"PersistentCache is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"PersistentCache is immutable; cannot delete {name!r}")

    @property
    def path(self) -> pathlib.Path:
        """The cache directory (absolute)."""
        return self._path

    @property
    def readonly(self) -> bool:
        """Whether this value refuses writes."""
        return self._readonly

    @property
    def pending(self) -> Mapping[str, Mapping[str, Any]]:
        """Records not yet saved, as a read-only mapping of copies."""
        return types.MappingProxyType(
            {k: copy.deepcopy(e.record) for k, e in self._pending.items()}
        )

    def _all(self) -> dict[str, _Entry]:
        merged = self._merged
        if merged is None:
            merged = {**self._loaded, **self._pending} if self._pending else self._loaded
            # A pure function of the value, so memoising it keeps the value immutable.
            object.__setattr__(self, "_merged", merged)
        return merged

    def get(self, key: str) -> Any | None:
        """The config stored under ``key``.

        Args:
            key: a cache key, ``"<kernel_name>/<digest>"``.

        Returns:
            The config (pending entries first, then loaded ones), or None if absent or unusable.
        """
        entry = self._pending.get(key)
        if entry is None:
            entry = self._loaded.get(key)
            if entry is None:
                return None
        return entry.cfg()

    def record(self, key: str) -> Mapping[str, Any] | None:
        """The raw record stored under ``key`` (a copy), for inspection.

        Returns:
            ``{"cfg": ..., "meta": ..., "written_at": ..., "ejkfn_schema": ...}`` or None.
        """
        entry = self._all().get(key)
        return None if entry is None else copy.deepcopy(entry.record)

    def put(self, key: str, cfg: Any, *, meta: Mapping[str, Any] | None = None) -> PersistentCache:
        """A new value with ``cfg`` pending under ``key``; call :meth:`save` to write it.

        Args:
            key: a non-empty string, ``"<kernel_name>/<digest>"``.
            cfg: a dataclass config instance.
            meta: JSON-serialisable information stored beside it (timings, device, ...).

        Returns:
            The new value; this one is unchanged.

        Raises:
            ValueError: if this value is read-only or the key is empty.
            TypeError: if ``cfg`` is not a dataclass instance or ``meta`` cannot be serialised.
        """
        self._check_writable("put")
        if not isinstance(key, str) or not key:
            raise ValueError(f"expected a non-empty string key, got {key!r}")
        record = {
            "cfg": cfg_to_dict(cfg),
            "meta": json.loads(stable_json(dict(meta or {}))),
            "written_at": _utc_now(),
            "ejkfn_schema": RECORD_SCHEMA,
        }
        pending = dict(self._pending)
        pending[key] = _Entry(key, record, "pending entry", cfg)
        return self._evolve(pending=pending)

    def save(self) -> PersistentCache:
        """Write pending entries to disk, merged with what is there now.

        Takes the directory lock, re-reads the shards, writes each changed shard to a temporary file
        and atomically replaces it. Without pending entries this does no disk IO at all.

        Returns:
            A new value holding the merged disk state, with nothing pending (``self`` if nothing was
            pending).

        Raises:
            TimeoutError: if the directory lock cannot be taken within 60 s.
        """
        if not self._pending:
            return self
        self._check_writable("save")
        self._path.mkdir(parents=True, exist_ok=True)
        old = {**self._loaded, **self._pending}
        with self._lock():
            shards = _scan(self._path, old, locked=True, fix=True)
            by_shard: dict[str, dict[str, _Entry]] = {}
            for key, entry in self._pending.items():
                by_shard.setdefault(_shard_name(key), {})[key] = entry
            for name, entries in by_shard.items():
                shard = shards.setdefault(name, _Shard({}, {}))
                for key, entry in entries.items():
                    shard.keep[key] = entry.record
                    shard.usable[key] = entry
                _write_json(self._path / name, _document(shard.keep), pause=True)
            _clean_stale_temps(self._path)
        return self._evolve(loaded=_usable(shards), pending={})

    def reload(self) -> PersistentCache:
        """A new value re-read from disk, keeping pending entries."""
        shards = _scan(self._path, self._loaded, locked=False, fix=not self._readonly)
        return self._evolve(loaded=_usable(shards))

    def remove(self, keys: Iterable[str]) -> PersistentCache:
        """Remove ``keys`` from disk now (under the lock) and from the pending entries.

        Returns:
            A new value re-read from disk, without those keys.
        """
        self._check_writable("remove")
        doomed = set(keys)
        pending = {k: e for k, e in self._pending.items() if k not in doomed}
        if not self._path.is_dir():
            return self._evolve(loaded={}, pending=pending)
        with self._lock():
            shards = _scan(self._path, self._loaded, locked=True, fix=True)
            for name, shard in shards.items():
                hit = doomed.intersection(shard.keep)
                if not hit:
                    continue
                for key in hit:
                    del shard.keep[key]
                    shard.usable.pop(key, None)
                if shard.keep:
                    _write_json(self._path / name, _document(shard.keep))
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._path / name)
            _clean_stale_temps(self._path)
        return self._evolve(loaded=_usable(shards), pending=pending)

    def clear(self) -> PersistentCache:
        """Remove every shard file (and set-aside corrupt copies) under the lock.

        Returns:
            A new, empty value (pending entries are dropped too).
        """
        self._check_writable("clear")
        if self._path.is_dir():
            with self._lock():
                with os.scandir(self._path) as it:
                    names = [e.name for e in it if e.is_file()]
                for name in names:
                    if _is_shard(name) or (".json.corrupt-" in name and not name.startswith(".")):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(self._path / name)
                _clean_stale_temps(self._path)
        return self._evolve(loaded={}, pending={})

    def export(self, file: str | os.PathLike[str]) -> int:
        """Write all entries (loaded and pending) to one JSON file in the shard schema.

        Returns:
            The number of entries written.
        """
        entries = {k: e.record for k, e in self._all().items()}
        target = pathlib.Path(file)
        target.parent.mkdir(parents=True, exist_ok=True)
        _write_json(target, _document(entries))
        return len(entries)

    def import_file(self, file: str | os.PathLike[str]) -> PersistentCache:
        """A new value with the entries of an exported file pending (then :meth:`save` writes them).

        Records of another ``ejkfn_schema`` are skipped.

        Raises:
            ValueError: if this value is read-only, or the file cannot be read or is malformed.
        """
        self._check_writable("import_file")
        path = pathlib.Path(file)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read cache export {path}: {exc}") from exc
        entries, reason = _parse_document(data)
        if entries is None:
            raise ValueError(f"{path} is not an ejkfn cache export: {reason}")
        pending = dict(self._pending)
        for key, record in entries.items():
            kind, problem = _classify(record)
            if kind == "bad" or not key:
                raise ValueError(f"{path}: entry {key!r} is malformed: {problem or 'empty key'}")
            if kind == "ok":
                pending[key] = _Entry(key, record, str(path))
        return self._evolve(pending=pending)

    def keys(self) -> Iterator[str]:
        """Keys of all entries, loaded and pending."""
        return iter(self._all())

    def items(self) -> Iterator[tuple[str, Any]]:
        """``(key, cfg)`` for every usable entry, loaded and pending (undecodable ones skipped)."""
        for key, entry in self._all().items():
            cfg = entry.cfg()
            if cfg is not None:
                yield key, cfg

    def __contains__(self, key: object) -> bool:
        return key in self._pending or key in self._loaded

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __repr__(self) -> str:
        return (
            f"PersistentCache({str(self._path)!r}, readonly={self._readonly}, "
            f"entries={len(self)}, pending={len(self._pending)})"
        )

    @classmethod
    def shipped(cls) -> PersistentCache:
        """The read-only layer shipped in the package (``ejkfn/_shipped/*.json``); empty if none."""
        folder = importlib.resources.files("ejkfn").joinpath("_shipped")
        with importlib.resources.as_file(folder) as path:
            # as_file copies out of a zip only for the duration; loading reads everything now.
            return cls(path, readonly=True)

    def _check_writable(self, what: str) -> None:
        if self._readonly:
            raise ValueError(f"cannot {what}: the persistent cache at {self._path} is read-only")

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        lock_file = self._path / _LOCK_NAME
        lock = filelock.FileLock(str(lock_file), timeout=_LOCK_TIMEOUT_S)
        try:
            lock.acquire()
        except filelock.Timeout as exc:
            raise TimeoutError(
                f"could not lock the persistent cache {self._path} within {_LOCK_TIMEOUT_S:g} s "
                f"(lock file {lock_file}); another process may be stuck holding it"
            ) from exc
        try:
            yield
        finally:
            lock.release()


def _usable(shards: Mapping[str, _Shard]) -> dict[str, _Entry]:
    out: dict[str, _Entry] = {}
    for shard in shards.values():
        out.update(shard.usable)
    return out
