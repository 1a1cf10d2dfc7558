"""``Kernel``: an equinox Module with a static config, and the path of a call through it."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar

import equinox as eqx
import jax

from ._ambient import current_session
from ._invocation import Invocation, merge_static, split_static

__all__ = ["Kernel"]

Cfg = TypeVar("Cfg")
Out = TypeVar("Out")
K = TypeVar("K", bound="Kernel")

try:
    # The concrete type of jax arrays, for the eager fast path's exact type checks. Making an array to
    # learn it would start a backend at import, before users can call jax.distributed.initialize.
    from jax._src.array import ArrayImpl as _ArrayImpl
except ImportError:  # pragma: no cover - a jax without it: every call takes the general path
    _ArrayImpl = None
_SCALARS = (int, float, bool, str, type(None))
_MEMO_LIMIT = 4096


class Kernel(eqx.Module, Generic[Cfg, Out]):
    """Base class of kernels: an ``eqx.Module`` whose config is a static field.

    Subclasses set the class attributes ``name`` and ``version`` (both part of every cache key) and
    define ``run`` (or ``run_{platform}`` methods: ``run_gpu``/``run_cuda``, ``run_tpu``, ``run_cpu``,
    or ``run_triton``/``run_pallas``/``run_xla``), ``heuristic_cfg`` and ``candidate_cfgs`` (the
    reference's name ``config_space`` works too). A kernel that also defines ``fwd`` (forward returning
    ``(out, residuals)``) and ``bwd`` (``(residuals, cotangent) -> gradients``) gets a custom VJP;
    one that further defines ``inference`` (same arguments and ``cfg`` as ``fwd``, returning the
    output alone) computes calls that nothing differentiates with it, e.g. on a backend whose
    forward is faster than the one that suits training.

    ``cfg`` is static: it decides the compiled program, so a configured kernel is a hashable pytree
    value that can sit inside a model and cross ``jax.jit`` boundaries. With ``cfg=None`` a call selects
    a config at trace time (through the ambient session, see :func:`ejkfn.use_caches`).

    >>> import jax, jax.numpy as jnp, ejkfn
    >>> k = ejkfn.testing.Scale()
    >>> float(jax.jit(k)(jnp.ones((4, 8)))[0, 0])
    2.0
    >>> k.with_cfg(ejkfn.testing.ScaleCfg(block=2)).cfg
    ScaleCfg(block=2)
    """

    cfg: Cfg | None = eqx.field(static=True, default=None, kw_only=True)

    name: ClassVar[str] = "kernel"
    version: ClassVar[str] = "0"

    # --- hooks -------------------------------------------------------------------------------

    def run(self, *args: Any, cfg: Cfg, **kwargs: Any) -> Out:
        """Compute the kernel with ``cfg`` (default: the ``run_{platform}`` method for the device)."""
        method = self._platform_method()
        if method is None:
            raise NotImplementedError(
                f"kernel {self.name!r} has no run() and no run_{{platform}} method for "
                f"platform {jax.default_backend()!r}"
            )
        return method(*args, cfg=cfg, **kwargs)

    def heuristic_cfg(self, inv: Invocation) -> Cfg:
        """A good config for ``inv`` without measuring."""
        raise NotImplementedError(f"kernel {self.name!r} defines no heuristic_cfg")

    def candidate_cfgs(self, inv: Invocation) -> Sequence[Cfg]:
        """Configs the tuner may try for ``inv`` (default: ``config_space``, else the heuristic)."""
        if type(self).config_space is not Kernel.config_space:
            return self.config_space(inv)
        return [self.heuristic_cfg(inv)]

    def config_space(self, inv: Invocation) -> Sequence[Cfg]:
        """The reference's name for :meth:`candidate_cfgs`."""
        if type(self).candidate_cfgs is not Kernel.candidate_cfgs:
            return self.candidate_cfgs(inv)
        return [self.heuristic_cfg(inv)]

    def reference_kernel(self, inv: Invocation) -> Kernel | None:
        """A configured kernel whose outputs on ``inv``'s arguments the tuner checks every
        candidate's against (default: this kernel on its heuristic config; None: not checked).
        Kernels with a plainer implementation (e.g. attention's XLA platform) return that."""
        try:
            cfg = self.heuristic_cfg(inv)
        except NotImplementedError:
            return None
        return self.with_cfg(cfg)

    def prepare(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Normalise arguments before keys are built and the kernel runs (default: unchanged)."""
        return args, kwargs

    def sample_inputs(
        self, inv: Invocation, key: jax.Array
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Inputs for the tuner shaped like ``inv`` (default: random, never zeros)."""
        from ._tune import random_like

        args, kwargs = random_like((inv.args, dict(inv.kwargs)), key)
        return tuple(args), kwargs

    # --- values --------------------------------------------------------------------------------

    def with_cfg(self: K, cfg: Any) -> K:
        """This kernel with ``cfg`` as its static config (a new value; this one is unchanged)."""
        new = copy.copy(self)
        object.__setattr__(new, "cfg", cfg)
        return new

    @property
    def has_custom_vjp(self) -> bool:
        """Whether the kernel defines ``fwd`` and ``bwd``."""
        return callable(getattr(self, "fwd", None)) and callable(getattr(self, "bwd", None))

    def _platform_method(self) -> Any:
        from ._platform import device_kind, get_device_platform

        backend = jax.default_backend()
        for suffix in (backend, device_kind(), get_device_platform()):
            method = getattr(self, f"run_{suffix}", None)
            if method is not None:
                return method
        return None

    # --- calls ---------------------------------------------------------------------------------

    def execute(self, cfg: Cfg, args: Sequence[Any], kwargs: dict[str, Any]) -> Out:
        """Run on already-prepared arguments with ``cfg``: labels, custom VJP, platform dispatch."""
        from ._labels import labelled
        from ._record import note_call

        note_call(self, cfg, args, kwargs)
        return labelled(self, cfg, args, kwargs)

    def __call__(self, *args: Any, cfg: Cfg | None = None, **kwargs: Any) -> Out:
        chosen = cfg if cfg is not None else self.cfg
        signature = _eager_signature(args, kwargs)
        if signature is not None:
            return _eager_call(self, chosen, signature, args, kwargs)
        args, kwargs = self.prepare(*args, **kwargs)
        if chosen is None:
            chosen = _select_ambient(self, args, kwargs)
        return self.execute(chosen, args, kwargs)


def _select_ambient(kernel: Kernel, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    from ._select import select

    session = current_session()
    inv = Invocation.of_prepared(kernel, args, kwargs)
    cfg, session.caches = select(inv, session.caches, policy=session.policy, tuner=session.tuner)
    return cfg


def _eager_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """A cheap hashable signature when every argument is a concrete array or a plain scalar."""
    sig: list[Any] = []
    for a in args:
        t = type(a)
        if t is _ArrayImpl:
            sig.append((a.shape, a.dtype, a.weak_type))
        elif t in _SCALARS or (t is tuple and all(type(e) in _SCALARS for e in a)):
            sig.append((t, a))
        else:
            return None
    for k, a in kwargs.items():
        t = type(a)
        if t is _ArrayImpl:
            sig.append((k, a.shape, a.dtype, a.weak_type))
        elif t in _SCALARS or (t is tuple and all(type(e) in _SCALARS for e in a)):
            sig.append((k, t, a))
        else:
            return None
    return tuple(sig)


def _eager_call(
    kernel: Kernel,
    cfg: Any,
    signature: tuple[Any, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    session = current_session()
    memo_key = (id(kernel), cfg, signature)
    hit = session.memo.get(memo_key)
    if hit is not None and hit[0] is kernel:
        if hit[2]:
            return hit[1](*args)
        return hit[1](args, kwargs)
    fn, flat = _build_eager(kernel, cfg, args, kwargs)
    if len(session.memo) >= _MEMO_LIMIT:
        session.memo.clear()
    session.memo[memo_key] = (kernel, fn, flat)  # holding the kernel keeps its id from being reused
    return fn(*args) if flat else fn(args, kwargs)


def _build_eager(
    kernel: Kernel, cfg: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, bool]:
    """A jitted function of the call's arrays, with the config chosen once, here.

    Returns it and whether it is "flat": called as ``fn(*args)`` (only positional arrays, a kernel
    without array fields: the common case, kept to one Python call on the hot path), otherwise
    ``fn(args, kwargs)``.
    """
    prepared_args, prepared_kwargs = kernel.prepare(*args, **kwargs)
    if cfg is None:
        cfg = _select_ambient(kernel, prepared_args, prepared_kwargs)
    configured = kernel.with_cfg(cfg)
    _, static = split_static((args, kwargs))
    kernel_leaves, kernel_static = split_static(configured)

    @jax.jit
    def run(kernel_dynamic: list[Any], dynamic: list[Any]) -> Any:
        k = merge_static(kernel_dynamic, kernel_static)
        a, kw = merge_static(dynamic, static)
        a, kw = k.prepare(*a, **kw)
        return k.execute(cfg, a, kw)

    def call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Same order as split_static: positional, then keywords sorted by name; scalars are static.
        dynamic = [a for a in args if type(a) is _ArrayImpl]
        if kwargs:
            dynamic += [kwargs[k] for k in sorted(kwargs) if type(kwargs[k]) is _ArrayImpl]
        return run(kernel_leaves, dynamic)

    if kernel_leaves or kwargs or any(type(a) is not _ArrayImpl for a in args):
        return call, False

    @jax.jit
    def run_flat(*dynamic: Any) -> Any:
        a, kw = merge_static(list(dynamic), static)
        a, kw = configured.prepare(*a, **kw)
        return configured.execute(cfg, a, kw)

    return run_flat, True
