"""Deterministic JSON for configs and cache keys.

Configs are frozen dataclasses. On disk a config is ``{"type": "pkg.mod:Qual", "fields": {...}}`` so that a
cache file can be read back without knowing in advance which kernel wrote it. ``stable_json`` is the one
canonical text form used for keys: sorted keys, no whitespace, no NaN, tuples as lists.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
from typing import Any

import numpy as np

__all__ = ["cfg_from_dict", "cfg_to_dict", "from_json", "stable_json", "to_json", "type_path"]


def type_path(cls: type) -> str:
    """``module:qualname`` of a class, the form stored on disk."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve_any(path: str) -> type:
    """The class named by a ``module:Qualname`` path."""
    module_name, _, qualname = path.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"expected a type path 'module:Qualname', got {path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise TypeError(f"{path!r} does not name a class")
    return obj


def _resolve(path: str) -> type:
    obj = _resolve_any(path)
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
        raise TypeError(f"{path!r} is not a dataclass type; refusing to build it from JSON")
    return obj


def _plain(value: Any) -> Any:
    """Convert to JSON-ready builtins, deterministically."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        if f != f or f in (float("inf"), float("-inf")):
            raise ValueError(f"cannot serialise non-finite float {value!r}")
        return f
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return cfg_to_dict(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, np.dtype):
        return value.name
    if isinstance(value, type) and issubclass(value, np.generic):
        return np.dtype(value).name
    raise TypeError(f"cannot serialise {type(value).__name__} value {value!r}")


def cfg_to_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass config as ``{"type": ..., "fields": ...}`` (nested dataclasses likewise)."""
    if not (dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)):
        raise TypeError(f"expected a dataclass config instance, got {type(cfg).__name__}: {cfg!r}")
    fields = {f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    return {"type": type_path(type(cfg)), "fields": fields}


def _rebuild(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"type", "fields"}:
        return cfg_from_dict(value)
    if isinstance(value, list):
        return tuple(_rebuild(v) for v in value)
    return value


def cfg_from_dict(data: dict[str, Any], cls: type | None = None) -> Any:
    """Inverse of :func:`cfg_to_dict`. ``cls`` (if given) must match the stored type."""
    if not isinstance(data, dict) or "fields" not in data:
        raise ValueError(f"expected a serialised config with 'type' and 'fields', got {data!r}")
    stored = data.get("type")
    if cls is None:
        if not isinstance(stored, str):
            raise ValueError(f"serialised config has no type: {data!r}")
        cls = _resolve(stored)
    elif stored is not None and stored != type_path(cls):
        raise TypeError(f"stored config type {stored!r} does not match {type_path(cls)!r}")
    fields = data["fields"]
    if not isinstance(fields, dict):
        raise ValueError(f"config fields must be an object, got {fields!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(fields) - known
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)} for config type {type_path(cls)}")
    return cls(**{k: _rebuild(v) for k, v in fields.items()})


def stable_json(obj: Any) -> str:
    """Canonical JSON text: same value, same string, in every process."""
    return json.dumps(_plain(obj), sort_keys=True, separators=(",", ":"), allow_nan=False)


def to_json(cfg: Any) -> str:
    """A config as canonical JSON text.

    >>> from ejkfn.testing import ScaleCfg
    >>> to_json(ScaleCfg(block=4))
    '{"fields":{"block":4},"type":"ejkfn.testing:ScaleCfg"}'
    >>> from_json(to_json(ScaleCfg(block=4)))
    ScaleCfg(block=4)
    """
    return stable_json(cfg_to_dict(cfg))


def from_json(text: str, cls: type | None = None) -> Any:
    """A config from :func:`to_json` text."""
    return cfg_from_dict(json.loads(text), cls)
