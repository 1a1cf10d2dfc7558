"""Mapping transforms that select one config for the per-example (or per-shard) call, then map."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from ._cache import Caches
from ._invocation import Invocation, abstractify
from ._policy import AutotunePolicy
from ._select import select
from ._tune import Tuner

__all__ = ["current_batch_axes", "pmap_with_config", "shard_map_with_config", "vmap_with_config"]

_BATCH: contextvars.ContextVar[Any] = contextvars.ContextVar("ejkfn_batch_axes", default=None)


def current_batch_axes() -> Any:
    """The batch axes of the mapping transform being traced (``None`` outside one)."""
    return _BATCH.get()


@contextlib.contextmanager
def _batch_axes(axes: Any) -> Iterator[None]:
    token = _BATCH.set(axes)
    try:
        yield
    finally:
        _BATCH.reset(token)


def _drop_axis(x: Any, axis: int | None) -> Any:
    if axis is None or not isinstance(x, jax.ShapeDtypeStruct):
        return x
    axis = axis % len(x.shape)
    return jax.ShapeDtypeStruct(x.shape[:axis] + x.shape[axis + 1 :], x.dtype)


def _per_example(args: Sequence[Any], in_axes: Any) -> tuple[tuple[Any, ...], int | None]:
    axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
    if len(axes) != len(args):
        raise ValueError(f"in_axes has {len(axes)} entries for {len(args)} positional arguments")
    size = None
    out = []
    for arg, axis in zip(args, axes, strict=True):
        abstract = abstractify(arg)
        for leaf in jax.tree.leaves(
            abstract, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)
        ):
            if axis is not None and isinstance(leaf, jax.ShapeDtypeStruct):
                size = leaf.shape[axis]
        out.append(
            jax.tree.map(
                lambda x, a=axis: _drop_axis(x, a),
                abstract,
                is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
            )
        )
    return tuple(out), size


class _Mapped:
    """A mapped kernel: selects once per traced call shape, then maps the configured kernel."""

    def __init__(
        self,
        kernel: Any,
        describe: Callable[..., tuple[Any, Any, Any]],
        mapper: Callable[[Callable[..., Any]], Callable[..., Any]],
        policy: AutotunePolicy | None,
        tuner: Tuner | None,
    ):
        self.kernel = kernel
        self._describe = describe
        self._mapper = mapper
        self._policy = policy
        self._tuner = tuner
        functools.update_wrapper(self, type(kernel).__call__)

    def invocation(self, *args: Any, **kwargs: Any) -> Invocation:
        """The per-example invocation whose config the mapped call uses."""
        per_args, per_kwargs, axes = self._describe(args, kwargs)
        return Invocation.of(self.kernel, *per_args, batch_axes=axes, **per_kwargs)

    def _mapped(self, cfg: Any, axes: Any) -> Callable[..., Any]:
        configured = self.kernel.with_cfg(cfg)

        def call(*args: Any, **kwargs: Any) -> Any:
            # Keyword arguments are bound, not mapped: the transforms map positional ones only.
            def body(*a: Any) -> Any:
                with _batch_axes(axes):
                    return configured(*a, **kwargs)

            return self._mapper(body)(*args)

        return call

    def configure(
        self, *args: Any, caches: Caches, **kwargs: Any
    ) -> tuple[Callable[..., Any], Caches]:
        """The mapped function with its config chosen for these arguments, and the updated caches."""
        inv = self.invocation(*args, **kwargs)
        cfg, caches = select(inv, caches, policy=self._policy, tuner=self._tuner)
        return self._mapped(cfg, inv.batch_axes), caches

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from ._ambient import current_session

        inv = self.invocation(*args, **kwargs)
        if self.kernel.cfg is not None:
            cfg = self.kernel.cfg
        else:
            session = current_session()
            cfg, session.caches = select(
                inv,
                session.caches,
                policy=self._policy or session.policy,
                tuner=self._tuner or session.tuner,
            )
        return self._mapped(cfg, inv.batch_axes)(*args, **kwargs)


def vmap_with_config(
    kernel: Any,
    in_axes: Any = 0,
    out_axes: Any = 0,
    *,
    axis_name: Any = None,
    policy: AutotunePolicy | None = None,
    tuner: Tuner | None = None,
) -> _Mapped:
    """``jax.vmap`` of ``kernel`` with one config, selected for the per-example call.

    The mapped axes and the batch size are part of the key. Keyword arguments are not mapped. Call the
    result directly (selection through the ambient session) or use ``.configure(*args, caches=...)``
    for the explicit form.

    >>> import jax.numpy as jnp, ejkfn
    >>> f = ejkfn.vmap_with_config(ejkfn.testing.Scale())
    >>> f.invocation(jnp.ones((3, 4, 8))).args[0].shape
    (4, 8)
    """

    def describe(args: Any, kwargs: Any) -> tuple[Any, Any, Any]:
        per_args, size = _per_example(args, in_axes)
        return per_args, kwargs, {"vmap": jax.tree.map(str, in_axes), "size": size}

    def mapper(body: Callable[..., Any]) -> Callable[..., Any]:
        return jax.vmap(body, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name)

    return _Mapped(kernel, describe, mapper, policy, tuner)


def pmap_with_config(
    kernel: Any,
    axis_name: Any = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    devices: Sequence[jax.Device] | None = None,
    policy: AutotunePolicy | None = None,
    tuner: Tuner | None = None,
) -> _Mapped:
    """``jax.pmap`` of ``kernel`` with one config, selected for the per-device call."""

    def describe(args: Any, kwargs: Any) -> tuple[Any, Any, Any]:
        per_args, size = _per_example(args, in_axes)
        return per_args, kwargs, {"pmap": jax.tree.map(str, in_axes), "size": size}

    def mapper(body: Callable[..., Any]) -> Callable[..., Any]:
        return jax.pmap(
            body, axis_name=axis_name, in_axes=in_axes, out_axes=out_axes, devices=devices
        )

    return _Mapped(kernel, describe, mapper, policy, tuner)


def _shard_shape(x: Any, spec: Any, mesh: jax.sharding.Mesh) -> Any:
    if not isinstance(x, jax.ShapeDtypeStruct) or spec is None:
        return x
    shape = list(x.shape)
    for dim, names in enumerate(tuple(spec)):
        if names is None:
            continue
        for name in (names,) if isinstance(names, str) else names:
            size = mesh.shape[name]
            if shape[dim] % size:
                raise ValueError(
                    f"dimension {dim} of size {shape[dim]} is not divisible by mesh "
                    f"axis {name!r} of size {size}"
                )
            shape[dim] //= size
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)


def shard_map_with_config(
    kernel: Any,
    mesh: jax.sharding.Mesh,
    in_specs: Any,
    out_specs: Any,
    *,
    check_vma: bool = False,
    policy: AutotunePolicy | None = None,
    tuner: Tuner | None = None,
) -> _Mapped:
    """``jax.shard_map`` of ``kernel`` with one config, selected for the per-shard call.

    The mesh shape and partition specs are part of the key. ``in_specs`` has one spec per positional
    argument (arrays are placed accordingly); keyword arguments are bound, i.e. replicated.
    """
    specs = in_specs if isinstance(in_specs, (tuple, list)) else (in_specs,)

    def describe(args: Any, kwargs: Any) -> tuple[Any, Any, Any]:
        if len(specs) != len(args):
            raise ValueError(
                f"in_specs has {len(specs)} entries for {len(args)} positional arguments"
            )
        per_args = tuple(
            jax.tree.map(
                lambda x, s=spec: _shard_shape(x, s, mesh),
                abstractify(arg),
                is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
            )
            for arg, spec in zip(args, specs, strict=True)
        )
        axes = {"shard_map": [str(s) for s in specs], "mesh": dict(mesh.shape)}
        return per_args, kwargs, axes

    def mapper(body: Callable[..., Any]) -> Callable[..., Any]:
        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs, check_vma=check_vma
        )

        def placed(*args: Any) -> Any:
            # Arrays are moved to the shardings the specs name (a no-op when they already are).
            args = tuple(
                jax.tree.map(lambda x, s=spec: jax.device_put(x, NamedSharding(mesh, s)), arg)
                for arg, spec in zip(args, specs, strict=True)
            )
            return mapped(*args)

        return placed

    return _Mapped(kernel, describe, mapper, policy, tuner)
