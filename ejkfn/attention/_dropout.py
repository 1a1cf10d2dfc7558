"""Counter-based dropout: the keep decision is a pure hash of (seed, batch, head, row, column).

Every backend computes the same 32-bit integer mix, so dropout is deterministic for a given seed and
identical across platforms (and can be recomputed in the backward pass instead of stored).

Each hash decides two neighbouring columns: ``bits = mix32((((b * H + h) * Sq + i) * 0x9E3779B1
+ j // 2) ^ mix32(seed))`` (all arithmetic mod 2^32), whose low 16 bits are column ``2 (j // 2)``'s
and high 16 bits column ``2 (j // 2) + 1``'s; a weight is kept when its 16 bits, moved to the top,
are ``>= threshold(p) = floor(p * 2^16) * 2^16``: the hash drops at ``p`` rounded down to a
multiple of 2^-16 (under 1.6e-5 off), and kept weights are scaled by one over the rate it keeps
(``keep_scale``), so each weight's expectation is exact. A rate under 2^-16 (``MIN_RATE``) would
drop nothing; the spec refuses it. The seed is mixed once a call and each pair of scores once:
the portable kernels run this integer work beside the tensor cores' products, and two mixes a score
made dropout cost them half their speed. The pairs are neighbours along the keys, which each thread
of a Hopper wgmma accumulator holds side by side, so a kernel's ``[queries, keys]`` tile
interleaves them without moving data; a ``[keys, queries]`` tile computes each column's hash
itself. Two seeds give masks that are one permutation of positions apart, so the same position's
decisions under two seeds are as independent as two positions' (``tests/test_dropout.py`` measures
both).
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["GOLDEN", "MIN_RATE", "keep_mask", "keep_scale", "keep_tile", "mix32", "threshold"]

GOLDEN = 0x9E3779B1
MIN_RATE = 2.0**-16  # the finest dropout rate a decision's 16 bits resolve
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
    """The uint32 threshold below which a weight's 16 bits (in the top half) drop it."""
    return min(int(p * 65536.0), 65535) << 16


def keep_scale(p: float) -> float:
    """What a kept weight is scaled by at dropout rate ``p``: one over the probability the hash
    keeps it, ``1 - floor(p * 2^16) / 2^16``, not ``1 - p`` (up to 1.6e-5 apart)."""
    return 65536.0 / (65536 - (threshold(p) >> 16))


def _row(b: jnp.ndarray, h: jnp.ndarray, i: jnp.ndarray, heads: int, seq_q: int) -> jnp.ndarray:
    """The counter of score row ``(b, h, i)``, mod 2^32."""
    u = jnp.uint32
    return (b.astype(u) * u(heads) + h.astype(u)) * u(seq_q) + i.astype(u)


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
    j = j.astype(u)
    bits = mix32((_row(b, h, i, heads, seq_q) * u(GOLDEN) + (j >> 1)) ^ mix32(seed))
    # Even columns move their low 16 bits to the top; odd ones keep theirs there (below them,
    # bits the threshold's zero low half cannot tip).
    return bits << ((u(1) - (j & 1)) * u(16)) >= u(threshold(p))


def keep_tile(
    seed: jnp.ndarray,
    b: jnp.ndarray,
    h: jnp.ndarray,
    rows: jnp.ndarray,
    col0: jnp.ndarray,
    block_k: int,
    heads: int,
    seq_q: int,
    p: float,
) -> jnp.ndarray:
    """:func:`keep_mask` of the ``[rows, col0 + arange(block_k)]`` tile (``col0`` even), one hash a
    pair of columns. The halves are interleaved by a stack on a last axis of two and a reshape,
    which Triton lowers to a join that moves no data (module doc)."""
    u = jnp.uint32
    row = _row(b, h, rows, heads, seq_q)
    pairs = (col0 // 2).astype(u) + jnp.arange(block_k // 2, dtype=u)
    bits = mix32((row[:, None] * u(GOLDEN) + pairs[None, :]) ^ mix32(seed))
    halves = jnp.stack([bits << u(16), bits], axis=-1).reshape(rows.shape[0], block_k)
    return halves >= u(threshold(p))
