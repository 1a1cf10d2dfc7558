"""Notebook convenience: an ambient cache state for kernels called without a config.

This is a thin layer over the explicit forms (:func:`ejkfn.select`, :func:`ejkfn.configure`): a context
variable holds a session with caches, a policy and a tuner; an unconfigured kernel called directly selects
through it and stores the updated caches back. Everything here has an explicit equivalent.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from typing import Any

from jax._src import config as _jax_config

from ._cache import Caches
from ._policy import AutotunePolicy
from ._tune import Tuner

__all__ = [
    "Session",
    "current_session",
    "default_caches",
    "forward_autotune_only",
    "overlay_cache",
    "policy_override",
    "use_caches",
]

# Without a session set up by the user, a direct call uses heuristics: it never benchmarks behind the
# user's back.
_DEFAULT_POLICY = AutotunePolicy(allow_autotune=False, cache_miss_fallback="heuristics")


@dataclasses.dataclass(eq=False)
class Session:
    """The ambient selection state: caches (updated as calls select), policy, tuner.

    ``memo`` maps an eager call's signature to its jitted configured function; it is a cache of a pure
    function of the session's inputs and is dropped whenever the user changes them.
    """

    caches: Caches
    policy: AutotunePolicy
    tuner: Tuner | None = None
    memo: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def derive(self, **changes: Any) -> Session:
        return Session(
            **{"caches": self.caches, "policy": self.policy, "tuner": self.tuner, **changes}
        )


_SESSION: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "ejkfn_session", default=None
)


def current_session() -> Session:
    """The ambient session (created with empty caches and a heuristics policy on first use)."""
    session = _SESSION.get()
    if session is None:
        session = Session(Caches(), _DEFAULT_POLICY)
        _SESSION.set(session)
    return session


def default_caches() -> Caches:
    """The ambient caches, as updated by direct kernel calls so far (save them with ``.save()``)."""
    return current_session().caches


# JAX reuses a function's trace while its cache key is unchanged, and the ambient session is not
# part of that key: a program re-traced under an overlay would keep the configs of its first trace.
# Each change of the session enters a fresh value of this state, which JAX includes in its keys.
_EPOCH = _jax_config.int_state(
    "ejkfn_selection_epoch",
    0,
    "Changes whenever ejkfn's ambient selection inputs change (internal).",
    include_in_jit_key=True,
    include_in_trace_context=True,
)
_EPOCHS = itertools.count(1)


@contextlib.contextmanager
def fresh_traces() -> Iterator[None]:
    """Inside the block, JAX re-traces functions instead of reusing traces made outside it."""
    with _EPOCH(next(_EPOCHS)):
        yield


@contextlib.contextmanager
def _pushed(session: Session) -> Iterator[Session]:
    token = _SESSION.set(session)
    try:
        with fresh_traces():
            yield session
    finally:
        _SESSION.reset(token)


@contextlib.contextmanager
def use_caches(
    caches: Caches, *, policy: AutotunePolicy | None = None, tuner: Tuner | None = None
) -> Iterator[Session]:
    """Direct kernel calls inside the block select through ``caches`` (and ``policy``/``tuner``).

    Yields the session; after the block ``session.caches`` holds the updated caches.

    >>> import jax.numpy as jnp, ejkfn
    >>> tuner = ejkfn.Tuner(warmup=0, iters=1, progress=False)
    >>> with ejkfn.use_caches(ejkfn.Caches(), policy=ejkfn.AutotunePolicy(), tuner=tuner) as session:
    ...     _ = ejkfn.testing.Scale()(jnp.ones((4, 8)))
    >>> len(session.caches.memory)   # the autotuned config is remembered
    1
    """
    outer = current_session()
    with _pushed(Session(caches, policy or outer.policy, tuner or outer.tuner)) as session:
        yield session


@contextlib.contextmanager
def policy_override(**changes: Any) -> Iterator[Session]:
    """Direct kernel calls inside the block use the ambient policy with ``changes`` applied."""
    outer = current_session()
    inner = outer.derive(policy=outer.policy.replace(**changes))
    with _pushed(inner) as session:
        yield session
    outer.caches = inner.caches  # what was selected inside stays known outside


@contextlib.contextmanager
def forward_autotune_only() -> Iterator[Session]:
    """Autotuning inside the block times the forward pass only."""
    with policy_override(validate_backward=False) as session:
        yield session


@contextlib.contextmanager
def overlay_cache(overlay: Mapping[str, Any]) -> Iterator[Session]:
    """Direct kernel calls inside the block consult ``overlay`` first (after an explicit config)."""
    outer = current_session()
    with _pushed(outer.derive(caches=outer.caches.with_overlay(overlay))) as session:
        yield session
