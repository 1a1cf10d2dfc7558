"""One config everywhere: in a multi-process program, process 0 decides and the others follow.

The choice travels through the key-value store of JAX's own distributed runtime (the one
``jax.distributed.initialize`` starts), which works at trace time, where device collectives cannot run.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
from typing import Any

import jax

from ._serialize import cfg_from_dict, cfg_to_dict, stable_json

__all__ = ["agree"]

# How many times this process has agreed on each key: SPMD processes select the same invocations in
# the same order, so the n-th agreement on a key pairs up across processes.
_ROUNDS: collections.Counter[str] = collections.Counter()
_LOCK = threading.Lock()


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "jax.process_count() > 1 but the distributed runtime client is missing; "
            "call jax.distributed.initialize() first"
        )
    return client


def _single_process() -> bool:
    from jax._src import distributed

    # Cheap test first: this runs on every selection, and a program without a distributed client is
    # a single process.
    return distributed.global_state.client is None or jax.process_count() == 1


def _timeout_ms() -> int:
    return int(float(os.environ.get("EJKFN_AGREE_TIMEOUT_S", "600")) * 1000)


def agree(decision: Any, caches: Any) -> tuple[Any, Any]:
    """Replace ``decision``'s config by process 0's (a no-op in a single-process program).

    Explicit overrides are the program's own and are not exchanged.
    """
    if decision.tier == "override" or _single_process():
        return decision, caches
    with _LOCK:
        _ROUNDS[decision.key] += 1
        slot = f"ejkfn/agree/{decision.key}/{_ROUNDS[decision.key]}"
    mine = stable_json(cfg_to_dict(decision.cfg))
    client = _client()
    if jax.process_index() == 0:
        client.key_value_set(slot, mine)
        return decision, caches
    chosen = client.blocking_key_value_get(slot, _timeout_ms())
    if chosen == mine:
        return decision, caches
    cfg = cfg_from_dict(json.loads(chosen))
    notes = (*decision.notes, f"process 0 chose {cfg!r}; this process had {decision.cfg!r}")
    caches = caches.remember(decision.key, cfg)
    if caches.persistent is not None and decision.key in caches.persistent.pending:
        caches = caches.persist(decision.key, cfg)  # never save a choice the program did not use
    return dataclasses.replace(decision, cfg=cfg, notes=notes), caches
