"""Offline tuning: tune the kernel calls of a recorded trace or of a lowered program."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

from ._cache import Caches, ConfigCache
from ._invocation import Invocation
from ._labels import find_labels_in_lowered, key_digest
from ._policy import AutotunePolicy
from ._record import get_invocations
from ._select import Decision, decide
from ._tune import Tuner

__all__ = ["AutotuningResult", "autotune_lowered", "autotune_recorded"]


class AutotuningResult(ConfigCache):
    """Tuned configs (a mapping from invocation key to config) with what was measured for each.

    Apply it explicitly as an overlay, ``caches.with_overlay(result)``, or for a block of notebook
    code with ``with result:`` (direct kernel calls inside select through it).

    Attributes:
        decisions: the :class:`ejkfn.Decision` of every tuned invocation, by key.
        unmatched: labels found in the program with no invocation to tune.
    """

    __slots__ = ("_contexts", "decisions", "unmatched")

    def __init__(self, decisions: Mapping[str, Decision] = (), unmatched: Iterable[str] = ()):
        decisions = dict(decisions)
        super().__init__({key: d.cfg for key, d in decisions.items()})
        self.decisions: Mapping[str, Decision] = decisions
        self.unmatched: tuple[str, ...] = tuple(unmatched)
        self._contexts: list[contextlib.AbstractContextManager[Any]] = []

    def __repr__(self) -> str:
        return f"AutotuningResult({len(self)} configs, {len(self.unmatched)} unmatched labels)"

    def __enter__(self) -> AutotuningResult:
        from ._ambient import overlay_cache

        context = overlay_cache(self)
        context.__enter__()
        self._contexts.append(context)
        return self

    def __exit__(self, *exc: object) -> None:
        self._contexts.pop().__exit__(*exc)


def _tune_all(
    invocations: Iterable[Invocation],
    caches: Caches,
    policy: AutotunePolicy | None,
    tuner: Tuner | None,
    unmatched: Iterable[str] = (),
) -> tuple[AutotuningResult, Caches]:
    decisions: dict[str, Decision] = {}
    for inv in invocations:
        if inv.key in decisions:
            continue
        decisions[inv.key], caches = decide(
            inv.replace(cfg=None), caches, policy=policy, tuner=tuner
        )
    return AutotuningResult(decisions, unmatched), caches


def autotune_recorded(
    invocations: Iterable[Invocation],
    caches: Caches,
    *,
    policy: AutotunePolicy | None = None,
    tuner: Tuner | None = None,
) -> tuple[AutotuningResult, Caches]:
    """Select (autotuning on a miss, per ``policy``) a config for each invocation.

    Returns the result and the updated caches; cached configs are reused, not re-measured.
    """
    return _tune_all(invocations, caches, policy, tuner)


def autotune_lowered(
    lowered: Any,
    caches: Caches,
    *,
    invocations: Iterable[Invocation] | None = None,
    policy: AutotunePolicy | None = None,
    tuner: Tuner | None = None,
) -> tuple[AutotuningResult, Caches]:
    """Tune every labelled kernel call of a lowered program.

    Each label is matched to an invocation: among ``invocations`` if given; else among those traced in
    this process (labels table, or ``EJKFN_OPS_RECORD=1`` recordings); else, for ``json`` stamps, the
    invocation the label itself carries, so a program can be tuned from its text alone.

    >>> import jax, jax.numpy as jnp, ejkfn
    >>> x = jnp.ones((8, 4))
    >>> lowered = jax.jit(lambda x: ejkfn.testing.Scale()(x)).lower(x)
    >>> result, caches = ejkfn.autotune_lowered(lowered, ejkfn.Caches(),
    ...                                         tuner=ejkfn.Tuner(warmup=0, iters=1))
    >>> len(result), result.unmatched
    (1, ())
    """
    labels = [lab for lab in find_labels_in_lowered(lowered) if lab.form != "f"]
    given = {key_digest(inv.key): inv for inv in invocations} if invocations is not None else None
    recorded = {key_digest(inv.key): inv for inv in get_invocations()}
    matched: list[Invocation] = []
    unmatched: list[str] = []
    for lab in labels:
        inv = None
        if given is not None:
            inv = given.get(lab.key_digest) if lab.form == "h" else None
            if inv is None and lab.form == "j":
                call = lab.call()
                inv = given.get(key_digest(call[0].key)) if call is not None else None
        else:
            call = lab.call()
            if call is not None:
                inv = call[0]
            elif lab.key_digest in recorded:
                inv = recorded[lab.key_digest]
        if inv is None:
            unmatched.append(lab.name)
        else:
            matched.append(inv)
    return _tune_all(matched, caches, policy, tuner, unmatched)
