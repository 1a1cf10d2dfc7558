"""The reference: dense attention in float32 (or float64), every feature, straight from the spec."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._dropout import keep_mask, keep_scale
from ._spec import AttentionSpec

__all__ = ["visible", "reference_attention"]


def visible(
    spec: AttentionSpec,
    seq_q: int,
    seq_k: int,
    mask: Any = None,
    q_seg: Any = None,
    kv_seg: Any = None,
    rows: Any = None,
    cols: Any = None,
) -> jax.Array:
    """Boolean ``[B|1, H|1, rows, cols]`` of the keys each query may see (see the spec's rules).

    ``rows``/``cols`` default to all positions; blockwise implementations pass index ranges.
    """
    rows = jnp.arange(seq_q) if rows is None else rows
    cols = jnp.arange(seq_k) if cols is None else cols
    pos = rows[:, None] + (seq_k - seq_q)
    col = cols[None, :]
    ok = jnp.ones((rows.shape[0], cols.shape[0]), bool)
    if spec.causal:
        ok &= col <= pos
    if spec.window is not None:
        left, right = spec.window
        ok &= (col >= pos - left) & (col <= pos + right)
    ok = ok[None, None]
    if q_seg is not None:
        ok = ok & (q_seg[:, None, rows, None] == kv_seg[:, None, None, cols])
    if mask is not None:
        ok = ok & mask[:, :, rows[:, None], cols[None, :]]
    return ok


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: Any = None,
    mask: Any = None,
    q_seg: Any = None,
    kv_seg: Any = None,
    seed: Any = None,
    *,
    spec: AttentionSpec,
    dtype: Any = jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)`` computed densely in ``dtype``; ``out`` is returned in ``dtype`` too."""
    batch, seq_q, heads, _ = q.shape
    _, seq_k, kv_heads, _ = k.shape
    group = heads // kv_heads
    qf, kf, vf = (x.astype(dtype) for x in (q, k, v))
    kf = jnp.repeat(kf, group, axis=2)
    vf = jnp.repeat(vf, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", qf, kf) * jnp.asarray(spec.scale, dtype)
    if spec.soft_cap is not None:
        s = spec.soft_cap * jnp.tanh(s / spec.soft_cap)
    if bias is not None:
        s = s + bias.astype(dtype)
    ok = visible(spec, seq_q, seq_k, mask, q_seg, kv_seg)
    s = jnp.where(ok, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    p = jnp.where(ok, jnp.exp(s - safe_lse[..., None]), 0.0)
    if spec.dropout_prob > 0.0:
        b = jnp.arange(batch)[:, None, None, None]
        h = jnp.arange(heads)[None, :, None, None]
        i = jnp.arange(seq_q)[None, None, :, None]
        j = jnp.arange(seq_k)[None, None, None, :]
        keep = keep_mask(seed, b, h, i, j, heads, seq_q, spec.dropout_prob)
        p = jnp.where(keep, p * keep_scale(spec.dropout_prob), 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, vf)
    return out, lse
