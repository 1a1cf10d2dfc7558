"""Counter-based dropout: the keep decision is a pure hash of (seed, batch, head, row, column).

Every backend computes the same 32-bit integer mix, so dropout is deterministic for a given seed and
identical across platforms (and can be recomputed in the backward pass instead of stored).

``bits = mix32((((b * H + h) * Sq + i) * 0x9E3779B1 + j) ^ mix32(seed))`` (all arithmetic mod 2^32),
and a weight is kept when ``bits >= threshold(p) = floor(p * 2^32)``. The seed is mixed once a call,
so each score pays for one ``mix32``: the portable kernels run their integer work beside the
tensor cores' products, and a second mix a score made dropout cost them half their speed. Two seeds
give masks that are one permutation of positions apart, so the same position's decisions under two
seeds are as independent as two positions' (``tests/test_dropout.py`` measures both).
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["GOLDEN", "keep_mask", "mix32", "threshold"]

GOLDEN = 0x9E3779B1
_M1 = 0x7FEB352D
_M2 = 0x846CA68B


def mix32(x: jnp.ndarray) -> jnp.ndarray:
    """A 32-bit integer finaliser (lowbias32): good avalanche with shifts, xors and two multiplies."""
    x = x.astype(jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(_M1)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(_M2)
    x = x ^ (x >> 16)
    return x


def threshold(p: float) -> int:
    """The uint32 threshold below which a weight is dropped."""
    return min(int(p * 4294967296.0), 4294967295)


def keep_mask(
    seed: jnp.ndarray,
    b: jnp.ndarray,
    h: jnp.ndarray,
    i: jnp.ndarray,
    j: jnp.ndarray,
    heads: int,
    seq_q: int,
    p: float,
) -> jnp.ndarray:
    """True where the weight at (b, h, i, j) is kept; the index arrays broadcast together."""
    u = jnp.uint32
    row = (b.astype(u) * u(heads) + h.astype(u)) * u(seq_q) + i.astype(u)
    bits = mix32((row * u(GOLDEN) + j.astype(u)) ^ mix32(seed))
    return bits >= u(threshold(p))
