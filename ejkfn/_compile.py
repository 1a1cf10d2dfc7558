"""Configure once, run many times: ``compile`` for one kernel, ``configure_tree`` for a whole model."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax

from ._cache import Caches
from ._kernel import Kernel
from ._policy import AutotunePolicy
from ._record import recording
from ._select import configure, select
from ._tune import Tuner

__all__ = ["compile", "configure_tree"]


def compile(
    kernel: Kernel,
    *example_args: Any,
    caches: Caches,
    cfg: Any = None,
    policy: AutotunePolicy | None = None,
    tuner: Tuner | None = None,
    **example_kwargs: Any,
) -> tuple[Callable[..., Any], Caches]:
    """A jitted function of ``kernel`` with its config selected once, for these example arguments.

    Returns the function and the updated caches.

    >>> import jax.numpy as jnp, ejkfn
    >>> fn, caches = ejkfn.compile(ejkfn.testing.Scale(), jnp.ones((8, 4)), caches=ejkfn.Caches(),
    ...                            policy=ejkfn.AutotunePolicy(allow_autotune=False))
    >>> float(fn(jnp.ones((8, 4)))[0, 0])
    2.0
    """
    configured, caches = configure(
        kernel, *example_args, caches=caches, cfg=cfg, policy=policy, tuner=tuner, **example_kwargs
    )
    return jax.jit(configured), caches


def _is_kernel(x: Any) -> bool:
    return isinstance(x, Kernel)


def configure_tree(
    fn: Callable[..., Any],
    model: Any,
    *example_args: Any,
    caches: Caches,
    policy: AutotunePolicy | None = None,
    tuner: Tuner | None = None,
    **example_kwargs: Any,
) -> tuple[Any, Caches]:
    """``model`` with a config baked into every kernel module that ``fn(model, *args)`` calls.

    Traces ``fn(model, *example_args, **example_kwargs)`` once (nothing runs), notes which kernel
    modules of ``model`` are called and with which shapes, selects a config for each call site, and
    returns the configured model with the updated caches. Kernels already configured keep their
    config. A kernel called at several shapes gets the config of its first call (with a warning when
    the others would choose differently).

    >>> import equinox as eqx, jax.numpy as jnp, ejkfn
    >>> from ejkfn.testing import Scale
    >>> class Model(eqx.Module):
    ...     small: Scale
    ...     large: Scale
    >>> model = Model(Scale(), Scale())
    >>> fn = lambda m, x, y: m.small(x).sum() + m.large(y).sum()
    >>> configured, caches = ejkfn.configure_tree(fn, model, jnp.ones((2, 4)), jnp.ones((64, 4)),
    ...     caches=ejkfn.Caches(), policy=ejkfn.AutotunePolicy(allow_autotune=False))
    >>> configured.small.cfg, configured.large.cfg
    (ScaleCfg(block=2), ScaleCfg(block=64))
    """
    inside = {id(k): k for k in jax.tree.leaves(model, is_leaf=_is_kernel) if _is_kernel(k)}
    with recording() as recorder:
        # The model is closed over, not passed: its kernel objects stay the ones called in the trace.
        jax.eval_shape(lambda *a, **kw: fn(model, *a, **kw), *example_args, **example_kwargs)
    chosen: dict[int, Any] = {}
    for kernel, inv in recorder.calls:
        if id(kernel) not in inside or kernel.cfg is not None:
            continue
        cfg, caches = select(inv, caches, policy=policy, tuner=tuner)
        if id(kernel) not in chosen:
            chosen[id(kernel)] = cfg
        elif chosen[id(kernel)] != cfg:
            warnings.warn(
                f"kernel {kernel.name!r} is called at several shapes that choose different configs; "
                f"keeping {chosen[id(kernel)]!r} over {cfg!r} ({inv!r})",
                stacklevel=2,
            )
    configured = jax.tree.map(
        lambda x: x.with_cfg(chosen[id(x)]) if _is_kernel(x) and id(x) in chosen else x,
        model,
        is_leaf=_is_kernel,
    )
    return configured, caches
