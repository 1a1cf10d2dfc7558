"""Custom VJP as a transform: a forward with residuals and a backward become one differentiable call."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._invocation import merge_static, split_static

__all__ = ["call_with_custom_vjp", "custom_vjp"]


def _zero_cotangent(shape: tuple[int, ...], dtype: Any) -> Any:
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.zeros(shape, dtype)
    return np.zeros(shape, dtype=jax.dtypes.float0)  # integer and bool inputs take no gradient


def _grad_for(grads: Any, where: int | str, count: int, differentiable: bool) -> Any:
    if isinstance(grads, Mapping):
        return grads.get(where)
    if isinstance(where, str):
        if differentiable:
            raise TypeError(
                f"keyword argument {where!r} holds a floating array, but bwd returned a tuple, which "
                "only covers positional arguments; return a mapping such as "
                f"{{0: ..., {where!r}: ...}} (None for no gradient)"
            )
        return None
    if not isinstance(grads, (tuple, list)) or len(grads) != count:
        raise TypeError(
            f"bwd must return a tuple with one gradient per positional argument ({count}), or a "
            f"mapping from position/keyword to gradient; got {type(grads).__name__} of length "
            f"{len(grads) if hasattr(grads, '__len__') else '?'}"
        )
    return grads[where]


def custom_vjp(
    fwd: Callable[..., tuple[Any, Any]],
    bwd: Callable[[Any, Any], Any],
    *,
    primal: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """A function computing ``fwd(*args, **kwargs)[0]`` whose gradient is given by ``bwd``.

    ``fwd`` returns ``(out, residuals)``; ``bwd(residuals, cotangent)`` returns one gradient per
    positional argument (a tuple; ``None`` for none), or a mapping from position or keyword name to
    gradient, so keyword arrays such as a bias get gradients too. Arrays of any argument are
    differentiable; everything else is static and never differentiated. ``primal``, if given,
    computes the output where the call is not differentiated (inference), in place of ``fwd``: it
    must return what ``fwd``'s output would be, and may get there another way.

    >>> import jax, jax.numpy as jnp, ejkfn
    >>> square = ejkfn.custom_vjp(lambda x: (x * x, x), lambda x, g: (2 * x * g,))
    >>> float(jax.grad(square)(3.0))
    6.0
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        dynamic, static = split_static((args, kwargs))
        avals = [(jnp.shape(d), jnp.result_type(d)) for d in dynamic]
        # Which dynamic leaf belongs to which argument, to place the gradients bwd returns.
        owners: list[int | str] = []
        for where, value in [*enumerate(args), *sorted(kwargs.items())]:
            owners += [where] * len(split_static(value)[0])

        @jax.custom_vjp
        def f(*dyn: Any) -> Any:  # traced only where nothing differentiates the call
            a, kw = merge_static(list(dyn), static)
            return fwd(*a, **kw)[0] if primal is None else primal(*a, **kw)

        def f_fwd(*dyn: Any) -> tuple[Any, Any]:
            a, kw = merge_static(list(dyn), static)
            out, res = fwd(*a, **kw)
            return out, res

        def f_bwd(saved: Any, g: Any) -> tuple[Any, ...]:
            grads = bwd(saved, g)
            out: list[Any] = []
            cursor: dict[int | str, list[Any] | None] = {}
            for i, where in enumerate(owners):
                if where not in cursor:
                    floating = any(
                        jnp.issubdtype(avals[j][1], jnp.inexact)
                        for j, w in enumerate(owners)
                        if w == where
                    )
                    gw = _grad_for(grads, where, len(args), floating)
                    cursor[where] = None if gw is None else list(jax.tree.leaves(gw))
                pending = cursor[where]
                if pending is None:
                    out.append(_zero_cotangent(*avals[i]))
                else:
                    if not pending:
                        raise ValueError(
                            f"bwd returned too few gradient leaves for argument {where!r}"
                        )
                    grad = pending.pop(0)
                    shape, dtype = avals[i]
                    if jnp.issubdtype(dtype, jnp.inexact):
                        out.append(jnp.asarray(grad, dtype).reshape(shape))
                    else:
                        out.append(_zero_cotangent(*avals[i]))
            return tuple(out)

        f.defvjp(f_fwd, f_bwd)
        return f(*dynamic)

    return call


def call_with_custom_vjp(kernel: Any, cfg: Any, args: Any, kwargs: Mapping[str, Any]) -> Any:
    """Call a kernel that defines ``fwd``/``bwd`` so that its backward gives the gradients; where
    the call is not differentiated, its ``inference`` hook (if it has one) gives the output."""

    def fwd(*a: Any, **kw: Any) -> tuple[Any, Any]:
        return kernel.fwd(*a, cfg=cfg, **kw)

    def bwd(res: Any, g: Any) -> Any:
        return kernel.bwd(res, g, cfg=cfg)

    inference = getattr(kernel, "inference", None)
    primal = None if inference is None else functools.partial(inference, cfg=cfg)
    return custom_vjp(fwd, bwd, primal=primal)(*args, **kwargs)
