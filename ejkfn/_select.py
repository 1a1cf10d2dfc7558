"""Selection: a pure function from an invocation and caches to a config and new caches.

Order, first hit wins: explicit override, overlays (innermost first), memory, persistent (the user's,
then the shipped layer), then autotune and heuristics in the order the policy asks, then an error.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Literal

from ._cache import Caches
from ._distributed import agree
from ._invocation import Invocation
from ._policy import AutotunePolicy
from ._tune import Tuner, TuneReport

__all__ = ["Decision", "NoConfigError", "choose_config", "configure", "decide", "select"]

logger = logging.getLogger("ejkfn")

Tier = Literal["override", "overlay", "memory", "persistent", "shipped", "autotune", "heuristics"]

_DEFAULT_POLICY = AutotunePolicy()


class NoConfigError(LookupError):
    """Selection found no config and the policy allowed no way to make one."""


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """What selection did: the config, which tier answered, and what was tried on the way.

    Attributes:
        key: the invocation key.
        cfg: the chosen config.
        tier: which tier answered.
        tune: the tuner's report when autotuning ran (candidate timings and failures).
        notes: why earlier tiers did not answer, in order.
    """

    key: str
    cfg: Any
    tier: Tier
    tune: TuneReport | None = None
    notes: tuple[str, ...] = ()


def _autotune(
    inv: Invocation, caches: Caches, policy: AutotunePolicy, tuner: Tuner | None, notes: list[str]
) -> tuple[Any, Caches, TuneReport | None]:
    if not policy.allow_autotune:
        notes.append("autotune not allowed by the policy")
        return None, caches, None
    if policy.forbid_reautotune and inv.key in caches.failed:
        notes.append("autotune failed earlier for this key (forbid_reautotune)")
        return None, caches, None
    try:
        candidates = list(inv.kernel.candidate_cfgs(inv))
    except NotImplementedError as exc:
        notes.append(f"kernel has no candidate configs ({exc})")
        return None, caches, None
    if not candidates:
        notes.append("kernel offered no candidate configs")
        return None, caches, None
    report = (tuner or Tuner()).tune(inv, candidates, validate_backward=policy.validate_backward)
    if report.best is None:
        notes.append(f"every one of {len(candidates)} candidates failed")
        return None, caches.replace(failed=caches.failed | {inv.key}), report
    caches = caches.remember(inv.key, report.best)
    if policy.persist_autotune:
        meta = {
            "invocation": inv.payload,
            "seconds": min(r.seconds for r in report.results if r.ok),
            "backward": report.backward,
            "candidates": len(candidates),
        }
        caches = caches.persist(inv.key, report.best, meta=meta)
    return report.best, caches, report


def _heuristic(inv: Invocation, policy: AutotunePolicy, notes: list[str]) -> Any:
    if not policy.allow_heuristics:
        notes.append("heuristics not allowed by the policy")
        return None
    try:
        return inv.kernel.heuristic_cfg(inv)
    except NotImplementedError as exc:
        notes.append(f"kernel has no heuristic config ({exc})")
        return None


def decide(
    inv: Invocation,
    caches: Caches,
    *,
    policy: AutotunePolicy | None = None,
    tuner: Tuner | None = None,
    on_event: Callable[[Decision], None] | None = None,
) -> tuple[Decision, Caches]:
    """Like :func:`select`, but returns the whole :class:`Decision` instead of the config alone.

    >>> import jax.numpy as jnp, ejkfn
    >>> inv = ejkfn.Invocation.of(ejkfn.testing.Scale(), jnp.ones((4, 8)))
    >>> decision, caches = ejkfn.decide(inv, ejkfn.Caches(), tuner=ejkfn.Tuner(warmup=0, iters=1))
    >>> decision.tier, len(decision.tune.results)   # blocks 1, 2 and 4 divide 4 rows
    ('autotune', 3)
    >>> ejkfn.decide(inv, caches)[0].tier
    'memory'
    """
    policy = policy or _DEFAULT_POLICY
    override = inv.cfg if inv.cfg is not None else inv.kernel.cfg
    if override is not None:
        decision = Decision(inv.key, override, "override")
    else:
        decision, caches = _decide_miss_or_hit(inv, caches, policy, tuner)
    decision, caches = agree(decision, caches)
    if logger.isEnabledFor(logging.INFO):
        logger.info(
            "select %s: %s answered with %r%s",
            inv.key,
            decision.tier,
            decision.cfg,
            f" ({'; '.join(decision.notes)})" if decision.notes else "",
        )
    if on_event is not None:
        on_event(decision)
    return decision, caches


def _decide_miss_or_hit(
    inv: Invocation, caches: Caches, policy: AutotunePolicy, tuner: Tuner | None
) -> tuple[Decision, Caches]:
    key = inv.key
    hit = caches.lookup(key, portable_key=lambda: inv.portable_key)
    if hit is not None:
        tier, cfg = hit
        if tier in ("persistent", "shipped"):
            caches = caches.remember(key, cfg)  # later lookups stop at the memory tier
        return Decision(key, cfg, tier), caches

    notes: list[str] = ["no cache holds the key"]
    report = None
    order = (
        ("autotune", "heuristics")
        if policy.cache_miss_fallback == "autotune"
        else ("heuristics", "autotune")
    )
    for way in order:
        if way == "autotune":
            cfg, caches, report = _autotune(inv, caches, policy, tuner, notes)
        else:
            cfg = _heuristic(inv, policy, notes)
        if cfg is not None:
            return Decision(key, cfg, way, report, tuple(notes)), caches
    raise NoConfigError(
        f"no config for {inv!r}: "
        + "; ".join(notes)
        + (f"\n{report.table()}" if report is not None else "")
    )


def select(
    inv: Invocation,
    caches: Caches,
    *,
    policy: AutotunePolicy | None = None,
    tuner: Tuner | None = None,
    on_event: Callable[[Decision], None] | None = None,
) -> tuple[Any, Caches]:
    """Choose the config for ``inv``; returns it with the updated caches (``caches`` is unchanged).

    Args:
        inv: the call, from :meth:`Invocation.of`.
        caches: the cache state to read.
        policy: what a cache miss may do (default: autotune, then heuristics).
        tuner: how to benchmark candidates (default: ``Tuner()``).
        on_event: called with the :class:`Decision` (which tier answered, timings, failures).

    Raises:
        NoConfigError: nothing answered and the policy allowed no fallback.

    >>> import jax.numpy as jnp, ejkfn
    >>> inv = ejkfn.Invocation.of(ejkfn.testing.Scale(), jnp.ones((4, 8)))
    >>> policy = ejkfn.AutotunePolicy(allow_autotune=False)
    >>> cfg, caches = ejkfn.select(inv, ejkfn.Caches(), policy=policy)
    >>> cfg
    ScaleCfg(block=4)
    """
    decision, caches = decide(inv, caches, policy=policy, tuner=tuner, on_event=on_event)
    return decision.cfg, caches


def choose_config(
    kernel: Any,
    *args: Any,
    caches: Caches,
    cfg: Any = None,
    policy: AutotunePolicy | None = None,
    tuner: Tuner | None = None,
    **kwargs: Any,
) -> tuple[Any, Caches]:
    """The config ``kernel(*args, **kwargs)`` would use; returns it with the updated caches."""
    inv = Invocation.of(kernel, *args, cfg=cfg, **kwargs)
    return select(inv, caches, policy=policy, tuner=tuner)


def configure(
    kernel: Any,
    *args: Any,
    caches: Caches,
    cfg: Any = None,
    policy: AutotunePolicy | None = None,
    tuner: Tuner | None = None,
    **kwargs: Any,
) -> tuple[Any, Caches]:
    """``kernel`` with the config for this call baked in, and the updated caches.

    >>> import jax, jax.numpy as jnp, ejkfn
    >>> x = jnp.ones((4, 8))
    >>> k, caches = ejkfn.configure(ejkfn.testing.Scale(), x, caches=ejkfn.Caches(),
    ...                             policy=ejkfn.AutotunePolicy(allow_autotune=False))
    >>> k.cfg, float(jax.jit(k)(x)[0, 0])
    (ScaleCfg(block=4), 2.0)
    """
    chosen, caches = choose_config(
        kernel, *args, caches=caches, cfg=cfg, policy=policy, tuner=tuner, **kwargs
    )
    return kernel.with_cfg(chosen), caches
