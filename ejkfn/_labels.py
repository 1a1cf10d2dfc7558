"""Labels that make every kernel call findable in lowered and compiled programs.

A kernel call is traced inside a nested ``jax.jit`` named by its label and a ``jax.named_scope`` of the
same name: the label is then the name of a function in the lowered StableHLO text, and part of every
op's ``op_name`` metadata in the compiled HLO. ``EJKFN_OPS_STAMP`` picks the label form:

- ``hash`` (default): ``ejkfn.<kernel>.h<16 hex of the key><8 hex of the config>``; this process
  also keeps a table from label to call.
- ``json``: ``ejkfn.<kernel>.j<base64 of the compressed call description>``: a program can be tuned
  offline from its text alone.
- ``none``: no label, the bare kernel.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax._src import config as _jax_config

from ._invocation import Invocation, merge_static, split_static
from ._serialize import cfg_from_dict, cfg_to_dict, stable_json, type_path

__all__ = [
    "Label",
    "extract_labels_from_hlo_text",
    "find_labels_in_lowered",
    "label",
    "labels_to_configs",
    "stamp_mode",
    "stamping",
]

PREFIX = "ejkfn."
_LABEL_RE = re.compile(r"ejkfn\.([A-Za-z0-9_]+)\.([hjf])([A-Za-z0-9_\-]*)")
_MODES = ("hash", "json", "none")

# Labels traced in this process, for ``hash`` stamps: label -> (invocation, cfg). Filled at trace time
# only; selection never reads it.
_TABLE: dict[str, tuple[Invocation, Any]] = {}
_TABLE_LOCK = threading.Lock()


# A block's stamp mode lives in a JAX config state so that it is part of JAX's trace key: a function
# traced under one mode is traced again under another.
_STAMP = _jax_config.optional_enum_state(
    "ejkfn_ops_stamp",
    list(_MODES),
    None,
    "Label form of ejkfn kernel calls for a block (internal; see ejkfn.stamping).",
    include_in_jit_key=True,
    include_in_trace_context=True,
)


def stamp_mode() -> str:
    """The label form in force: that of the innermost :func:`stamping` block, else ``EJKFN_OPS_STAMP``.

    The environment variable is read when a function is traced; to switch forms within a process use
    :func:`stamping`, which also makes JAX re-trace.
    """
    if _STAMP.value is not None:
        return _STAMP.value
    mode = os.environ.get("EJKFN_OPS_STAMP", "hash").strip().lower() or "hash"
    if mode not in _MODES:
        raise ValueError(f"EJKFN_OPS_STAMP must be one of {_MODES}; got {mode!r}")
    return mode


@contextlib.contextmanager
def stamping(mode: str) -> Iterator[None]:
    """Kernel calls traced inside the block are labelled in form ``mode`` (hash, json or none)."""
    if mode not in _MODES:
        raise ValueError(f"stamp mode must be one of {_MODES}; got {mode!r}")
    with _STAMP(mode):
        yield


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name) or "kernel"


# --- describing a call so that it can be rebuilt from a json label ------------------------------


def _encode_tree(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return {"@a": [list(x.shape), np.dtype(x.dtype).name]}
    if isinstance(x, tuple):
        return {"@t": [_encode_tree(v) for v in x]}
    if isinstance(x, list):
        return [_encode_tree(v) for v in x]
    if isinstance(x, Mapping):
        return {"@d": {str(k): _encode_tree(v) for k, v in x.items()}}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"@c": cfg_to_dict(x)}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot describe {type(x).__name__} in a json label")


def _decode_tree(x: Any) -> Any:
    if isinstance(x, dict):
        if "@a" in x:
            shape, dtype = x["@a"]
            return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))
        if "@t" in x:
            return tuple(_decode_tree(v) for v in x["@t"])
        if "@d" in x:
            return {k: _decode_tree(v) for k, v in x["@d"].items()}
        if "@c" in x:
            return cfg_from_dict(x["@c"])
    if isinstance(x, list):
        return [_decode_tree(v) for v in x]
    return x


def _describe_call(inv: Invocation, cfg: Any) -> dict[str, Any]:
    kernel = inv.kernel
    fields = {
        f.name: _encode_tree(getattr(kernel, f.name))
        for f in dataclasses.fields(kernel)
        if f.name != "cfg"
    }
    return {
        "k": type_path(type(kernel)),
        "f": fields,
        "a": _encode_tree(tuple(inv.args)),
        "kw": _encode_tree(dict(inv.kwargs)),
        "b": _encode_tree(inv.batch_axes),
        "c": cfg_to_dict(cfg) if cfg is not None else None,
    }


def _rebuild_call(desc: Mapping[str, Any]) -> tuple[Invocation, Any]:
    from ._serialize import _resolve_any

    cls = _resolve_any(desc["k"])
    kernel = cls(**{k: _decode_tree(v) for k, v in desc["f"].items()})
    inv = Invocation.of_prepared(
        kernel,
        _decode_tree(desc["a"]),
        _decode_tree(desc["kw"]),
        batch_axes=_decode_tree(desc["b"]),
    )
    cfg = cfg_from_dict(desc["c"]) if desc.get("c") is not None else None
    return inv, cfg


def key_digest(key: str) -> str:
    """The part of an invocation key that a hash label carries (16 hex digits)."""
    return key.rpartition("/")[2][:16]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# --- stamping -------------------------------------------------------------------------------------


def make_label(inv: Invocation, cfg: Any, mode: str | None = None) -> str | None:
    """The label of a call of ``inv`` with ``cfg`` (``None`` when stamps are off)."""
    mode = mode or stamp_mode()
    if mode == "none":
        return None
    name = _safe(inv.kernel.name)
    if mode == "json":
        text = json.dumps(_describe_call(inv, cfg), sort_keys=True, separators=(",", ":"))
        return f"{PREFIX}{name}.j{_b64(zlib.compress(text.encode(), 9))}"
    # The key's digest first (to match invocations from any process), then the config's.
    cfg_text = stable_json(cfg_to_dict(cfg)) if cfg is not None else ""
    cfg_digest = hashlib.sha256(cfg_text.encode()).hexdigest()[:8]
    label = f"{PREFIX}{name}.h{key_digest(inv.key)}{cfg_digest}"
    with _TABLE_LOCK:
        _TABLE[label] = (inv, cfg)
    return label


def _named_jit(label: str, fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    def body(dynamic: list[Any]) -> Any:
        return fn(dynamic)

    body.__name__ = body.__qualname__ = label
    return jax.jit(body)


def _invoke(kernel: Any, cfg: Any, args: Any, kwargs: Mapping[str, Any]) -> Any:
    if kernel.has_custom_vjp:
        from ._vjp import call_with_custom_vjp

        return call_with_custom_vjp(kernel, cfg, args, kwargs)
    return kernel.run(*args, cfg=cfg, **kwargs)


def labelled(kernel: Any, cfg: Any, args: Any, kwargs: Mapping[str, Any]) -> Any:
    """Call ``kernel`` with ``cfg`` under its label, per ``EJKFN_OPS_STAMP``."""
    mode = stamp_mode()
    if mode == "none":
        return _invoke(kernel, cfg, args, kwargs)
    from ._batch import current_batch_axes

    inv = Invocation.of_prepared(kernel, args, kwargs, batch_axes=current_batch_axes())
    name = make_label(inv, cfg, mode)
    dynamic, static = split_static((tuple(args), dict(kwargs)))

    def call(dyn: list[Any]) -> Any:
        a, kw = merge_static(dyn, static)
        return _invoke(kernel, cfg, a, kw)

    with jax.named_scope(name):
        return _named_jit(name, call)(dynamic)


def label(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: calls of the function appear in programs under the label ``ejkfn.<name>.f``.

    >>> import jax, jax.numpy as jnp, ejkfn
    >>> @ejkfn.label("double")
    ... def double(x):
    ...     return 2 * x
    >>> [l.name for l in ejkfn.find_labels_in_lowered(jax.jit(double).lower(jnp.ones(3)))]
    ['ejkfn.double.f']
    """
    tag = f"{PREFIX}{_safe(name)}.f"

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if stamp_mode() == "none":
                return fn(*args, **kwargs)
            dynamic, static = split_static((args, kwargs))

            def call(dyn: list[Any]) -> Any:
                a, kw = merge_static(dyn, static)
                return fn(*a, **kw)

            with jax.named_scope(tag):
                return _named_jit(tag, call)(dynamic)

        return wrapped

    return wrap


# --- finding labels -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Label:
    """A label found in a program: its text, kernel name, form (``h``/``j``/``f``) and payload."""

    name: str
    kernel: str
    form: str
    payload: str

    @property
    def key_digest(self) -> str | None:
        """For hash labels, the digest of the invocation key they were made from."""
        return self.payload[:16] if self.form == "h" else None

    def call(self) -> tuple[Invocation, Any] | None:
        """The ``(invocation, cfg)`` this label stands for, if this process or the label knows it."""
        if self.form == "j":
            return _rebuild_call(json.loads(zlib.decompress(_unb64(self.payload))))
        if self.form == "h":
            with _TABLE_LOCK:
                return _TABLE.get(self.name)
        return None


def extract_labels_from_hlo_text(text: str) -> list[Label]:
    """Every distinct ejkfn label in StableHLO or HLO text, in order of first appearance."""
    seen: dict[str, Label] = {}
    for m in _LABEL_RE.finditer(text):
        name = m.group(0)
        if name not in seen:
            seen[name] = Label(name, m.group(1), m.group(2), m.group(3))
    return list(seen.values())


def find_labels_in_lowered(lowered: Any) -> list[Label]:
    """Labels in a ``jax.jit(f).lower(...)`` result (or its compiled form, or plain text)."""
    if isinstance(lowered, str):
        return extract_labels_from_hlo_text(lowered)
    return extract_labels_from_hlo_text(lowered.as_text())


def labels_to_configs(labels: Iterable[Label | str]) -> dict[str, Any]:
    """Map each label that names a known call to ``{invocation key: config}``."""
    out: dict[str, Any] = {}
    for item in labels:
        lab = item if isinstance(item, Label) else (extract_labels_from_hlo_text(item) or [None])[0]
        if lab is None:
            continue
        call = lab.call()
        if call is not None and call[1] is not None:
            out[call[0].key] = call[1]
    return out
