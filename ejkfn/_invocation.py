"""An abstract description of one kernel call, and its cache key."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import jax
import numpy as np

from ._platform import device_fingerprint, sharding_fingerprint, software_versions
from ._serialize import stable_json

if TYPE_CHECKING:
    from ._kernel import Kernel

__all__ = ["Invocation", "abstractify", "split_static"]

Cfg = TypeVar("Cfg")


def _is_arraylike(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)) or isinstance(
        x, jax.core.Tracer
    )


def abstractify(tree: Any) -> Any:
    """Replace every array (concrete or traced) in ``tree`` by a ``jax.ShapeDtypeStruct``."""

    def one(x: Any) -> Any:
        if _is_arraylike(x):
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
        return x

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def split_static(tree: Any) -> tuple[list[Any], Any]:
    """Arrays of ``tree`` (dynamic) and a hashable description of the rest (static)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    dynamic = []
    static = []
    for leaf in leaves:
        if _is_arraylike(leaf):
            dynamic.append(leaf)
            static.append(_ARRAY)
        else:
            try:
                hash(leaf)
            except TypeError:
                raise TypeError(
                    f"non-array argument {leaf!r} of type {type(leaf).__name__} must be hashable: "
                    "everything that is not an array is static and decides the compiled program"
                ) from None
            static.append(leaf)
    return dynamic, (treedef, tuple(static))


def merge_static(dynamic: Any, static: Any) -> Any:
    """Inverse of :func:`split_static`."""
    treedef, leaves = static
    it = iter(dynamic)
    return jax.tree.unflatten(treedef, [next(it) if leaf is _ARRAY else leaf for leaf in leaves])


class _ArrayMarker:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<array>"

    def __reduce__(self) -> str:
        return "_ARRAY"


_ARRAY = _ArrayMarker()


def _describe(x: Any) -> Any:
    """JSON-ready description of an abstract leaf for the key."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return {"shape": list(x.shape), "dtype": np.dtype(x.dtype).name}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
        return {"dtype": np.dtype(x).name}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"dataclass": type(x).__qualname__, "repr": repr(x)}
    # Callables and other objects: their qualified name is stable where repr() may hold an address.
    name = getattr(x, "__qualname__", None)
    if name is not None:
        return {"object": f"{getattr(x, '__module__', '')}.{name}"}
    return {"repr": repr(x)}


def _tree_description(tree: Any) -> Any:
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return {"tree": str(treedef), "leaves": [_describe(leaf) for leaf in leaves]}


def kernel_fields(kernel: Kernel) -> dict[str, Any]:
    """The kernel's own fields except ``cfg``, abstracted (they are part of the key)."""
    out = {}
    for f in dataclasses.fields(kernel):
        if f.name == "cfg":
            continue
        out[f.name] = _tree_description(abstractify(getattr(kernel, f.name)))
    return out


def _key_of(name: str, payload: Mapping[str, Any]) -> str:
    return f"{name}/{hashlib.sha256(stable_json(payload).encode()).hexdigest()[:40]}"


@dataclasses.dataclass(frozen=True, eq=False)
class Invocation(Generic[Cfg]):
    """One call of a kernel, abstracted: what selection needs, and nothing concrete.

    Attributes:
        kernel: the kernel module (with ``cfg`` cleared: the key never depends on a config).
        args: positional arguments, arrays replaced by ``jax.ShapeDtypeStruct``.
        kwargs: keyword arguments, likewise (a read-only mapping).
        cfg: the explicit override given as ``cfg=`` at the call, if any.
        batch_axes: for calls mapped by ``vmap_with_config`` and friends, the mapped axes.
        device: the device fingerprint (see :func:`ejkfn.device_fingerprint`).
        sharding: sharding fingerprints of the arguments, when asked for with ``with_sharding=True``.

    >>> import jax.numpy as jnp, ejkfn
    >>> inv = ejkfn.Invocation.of(ejkfn.testing.Scale(), jnp.ones((4, 8)))
    >>> inv.args[0]
    ShapeDtypeStruct(shape=(4, 8), dtype=float32)
    """

    kernel: Kernel
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    cfg: Any = None
    batch_axes: Any = None
    device: Mapping[str, Any] = dataclasses.field(default_factory=device_fingerprint)
    sharding: Any = None

    @classmethod
    def of(
        cls,
        kernel: Kernel,
        *args: Any,
        cfg: Any = None,
        batch_axes: Any = None,
        with_sharding: bool = False,
        device: jax.Device | None = None,
        **kwargs: Any,
    ) -> Invocation:
        """Describe ``kernel(*args, **kwargs)`` abstractly (after the kernel's ``prepare``).

        ``cfg`` is the explicit override of the call; ``batch_axes`` the axes a batching transform maps;
        ``with_sharding`` adds the arguments' shardings to the key.
        """
        args, kwargs = kernel.prepare(*args, **kwargs)
        return cls.of_prepared(
            kernel,
            args,
            kwargs,
            cfg=cfg,
            batch_axes=batch_axes,
            with_sharding=with_sharding,
            device=device,
        )

    @classmethod
    def of_prepared(
        cls,
        kernel: Kernel,
        args: Any,
        kwargs: Mapping[str, Any],
        *,
        cfg: Any = None,
        batch_axes: Any = None,
        with_sharding: bool = False,
        device: jax.Device | None = None,
    ) -> Invocation:
        """Like :meth:`of`, for arguments that already went through the kernel's ``prepare``."""
        sharding = None
        if with_sharding:
            sharding = jax.tree.map(
                sharding_fingerprint, (tuple(args), dict(kwargs)), is_leaf=_is_arraylike
            )
        return cls(
            kernel=kernel.with_cfg(None) if kernel.cfg is not None else kernel,
            args=tuple(abstractify(tuple(args))),
            kwargs=MappingProxyType(dict(abstractify(dict(kwargs)))),
            cfg=cfg,
            batch_axes=batch_axes,
            device=device_fingerprint(device),
            sharding=sharding,
        )

    @functools.cached_property
    def payload(self) -> Mapping[str, Any]:
        """Everything the key is made from, as JSON-ready data (also stored beside cache entries)."""
        kernel = self.kernel
        return {
            "kernel": kernel.name,
            "version": kernel.version,
            "kernel_type": f"{type(kernel).__module__}.{type(kernel).__qualname__}",
            "fields": kernel_fields(kernel),
            "args": _tree_description(self.args),
            "kwargs": _tree_description(dict(self.kwargs)),
            "batch_axes": _tree_description(self.batch_axes),
            "sharding": _tree_description(self.sharding),
            "device": dict(self.device),
            "software": dict(software_versions()),
        }

    @functools.cached_property
    def key(self) -> str:
        """A stable key: ``"<kernel name>/<sha256 of the payload>"``, equal across processes and runs."""
        return _key_of(self.kernel.name, self.payload)

    @functools.cached_property
    def portable_key(self) -> str:
        """The key of the configs shipped with ejkfn: the payload without driver and library versions.

        A config tuned for a device model stays right on another driver or jax release far more often
        than not, and is only a starting point (any tier above the shipped one wins); the kernel's own
        ``version`` still separates incompatible configs.
        """
        payload = dict(self.payload)
        payload["device"] = {k: self.device[k] for k in ("platform", "device_kind")}
        del payload["software"]
        return _key_of(self.kernel.name, payload)

    def replace(self, **changes: Any) -> Invocation:
        """A copy with some fields changed (the key is recomputed)."""
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{np.dtype(a.dtype).name}{list(a.shape)}"
            if isinstance(a, jax.ShapeDtypeStruct)
            else repr(a)
            for a in jax.tree.leaves(
                self.args, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)
            )
        )
        options = "".join(
            f", {k}={v!r}"
            for k, v in sorted(self.kwargs.items())
            if not isinstance(v, jax.ShapeDtypeStruct) and v is not None
        )
        return f"Invocation({self.kernel.name}({shapes}{options}), key={self.key!r})"
