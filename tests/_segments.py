"""Segment ids for the attention tests, in layouts that exercise the kernels' block skipping."""

import jax.numpy as jnp
import numpy as np


def segment_ids(rng, layout, batch, seq_q, seq_k):
    """Segment ids: ``True`` sorted draws of 3 ids; ``"packed"`` runs longer than the test's blocks,
    so whole blocks are skipped; ``"interleaved"`` unsorted draws, where each id spans most rows;
    ``"unmatched"`` packed, with ids on either side that the other lacks (rows that see no key)."""
    if layout is True:
        q_seg, kv_seg = (np.sort(rng.integers(0, 3, (batch, n)), axis=1) for n in (seq_q, seq_k))
    elif layout == "interleaved":
        q_seg, kv_seg = (rng.integers(0, 4, (batch, n)) for n in (seq_q, seq_k))
    elif layout in ("packed", "unmatched"):
        ids = [0, 1, 2, 3] if layout == "packed" else [0, 5, 2, 3]

        def runs(n):  # four runs of random lengths, the same ids in every batch row
            cuts = np.sort(rng.choice(np.arange(1, n), 3, replace=False))
            return np.broadcast_to(np.repeat(ids, np.diff([0, *cuts, n])), (batch, n))

        q_seg, kv_seg = runs(seq_q), runs(seq_k)
        if layout == "unmatched":
            kv_seg = np.where(kv_seg == 5, 7, kv_seg)
    else:
        raise ValueError(f"unknown segment layout {layout!r}")
    return jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)
