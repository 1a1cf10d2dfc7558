"""One config everywhere: in a multi-process program, process 0 decides and the others follow."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ._serialize import cfg_from_dict, cfg_to_dict, stable_json

__all__ = ["agree"]


def _broadcast_text(text: str) -> str:
    from jax.experimental import multihost_utils

    data = np.frombuffer(text.encode(), dtype=np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.array(len(data), np.int32)))
    padded = np.zeros(size, np.uint8)
    if jax.process_index() == 0:
        padded[:] = data
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(padded), np.uint8)).decode()


def agree(decision: Any, caches: Any) -> tuple[Any, Any]:
    """Replace ``decision``'s config by process 0's (a no-op in a single-process program).

    Every process must select the same invocations in the same order (as SPMD programs do), since
    agreeing is a collective. Explicit overrides are the program's own and are not exchanged.
    """
    if jax.process_count() == 1 or decision.tier == "override":
        return decision, caches
    mine = stable_json(cfg_to_dict(decision.cfg))
    chosen = _broadcast_text(mine)
    if chosen == mine:
        return decision, caches
    import json

    cfg = cfg_from_dict(json.loads(chosen))
    notes = (*decision.notes, f"process 0 chose {cfg!r}; this process had {decision.cfg!r}")
    return dataclasses.replace(decision, cfg=cfg, notes=notes), caches.remember(decision.key, cfg)
