"""Recording the kernel calls a trace makes, as values."""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from ._invocation import Invocation

__all__ = ["Recorder", "clear_recorded", "get_invocations", "note_call", "record", "recording"]


class Recorder:
    """The kernel calls traced while it was active, in order, with the kernel object of each call."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Invocation]] = []

    @property
    def invocations(self) -> list[Invocation]:
        """Distinct invocations, in order of first call."""
        return list({inv.key: inv for _, inv in self.calls}.values())


_ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "ejkfn_recording", default=None
)
# EJKFN_OPS_RECORD=1: calls traced anywhere in this process are kept here (sugar over ``record``).
_PROCESS: dict[str, Invocation] = {}
_LOCK = threading.Lock()


def note_call(kernel: Any, cfg: Any, args: Any, kwargs: Any) -> None:
    """Called by every kernel call at trace time; records it where recording is on."""
    active = _ACTIVE.get()
    process_wide = os.environ.get("EJKFN_OPS_RECORD", "") in ("1", "true", "yes")
    if active is None and not process_wide:
        return
    from ._batch import current_batch_axes

    inv = Invocation.of_prepared(kernel, args, kwargs, batch_axes=current_batch_axes())
    if active is not None:
        active.calls.append((kernel, inv))
    if process_wide:
        with _LOCK:
            _PROCESS.setdefault(inv.key, inv)


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """Collect the kernel calls traced inside the block."""
    from ._ambient import fresh_traces

    recorder = Recorder()
    token = _ACTIVE.set(recorder)
    try:
        with fresh_traces():  # a cached trace would record nothing
            yield recorder
    finally:
        _ACTIVE.reset(token)


def record(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Invocation]:
    """The distinct kernel invocations a trace of ``fn(*args, **kwargs)`` makes (nothing runs).

    >>> import jax.numpy as jnp, ejkfn
    >>> invs = ejkfn.record(lambda x: ejkfn.testing.Scale()(x) + 1, jnp.ones((4, 8)))
    >>> [inv.kernel.name for inv in invs]
    ['scale']
    """
    with recording() as recorder:
        jax.eval_shape(fn, *args, **kwargs)
    return recorder.invocations


def get_invocations() -> list[Invocation]:
    """Invocations recorded process-wide under ``EJKFN_OPS_RECORD=1``."""
    with _LOCK:
        return list(_PROCESS.values())


def clear_recorded() -> None:
    """Forget the process-wide recorded invocations."""
    with _LOCK:
        _PROCESS.clear()
