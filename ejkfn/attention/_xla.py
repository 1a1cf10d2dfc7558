"""XLA attention: a dense backend and a memory-efficient chunked backend.

Both follow the backend contract of ``_spec.py`` and compute every feature. Internally queries are
viewed grouped, ``[B, S, KVH, G, D]`` with ``G = heads // kv_heads``, so that GQA never repeats keys or
values; scores are ``[B, KVH, G, rows, cols]``. Arithmetic runs in float32 (float64 for float64 inputs)
whatever the input dtype; outputs are cast back to the input dtype.

- ``dense`` materialises the ``seq_q x seq_k`` scores; its backward recomputes the probabilities from the
  saved log-sum-exp (nothing quadratic is saved between the passes).
- ``chunked`` never holds more than one ``q_blocksize x kv_blocksize`` tile of scores per batch and head:
  the forward maps over query blocks and runs an online softmax over key blocks; the backward scans key
  blocks, loops over the query blocks that can see them, and accumulates ``dq`` (and ``dbias``) in place.
  Blocks that causal or window masking make fully invisible are skipped. Sequence lengths that are not
  multiples of the blocks are padded, and the padding is masked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._platform import device_kind
from .._registry import BwdParams, FwdParams
from ._backend import AttentionBackend, AttentionShape, decoding_rows, register_backend
from ._dropout import keep_mask, keep_scale
from ._spec import AttentionSpec

__all__ = ["CHUNKED", "DENSE", "preferred_variant"]


# --- pieces shared by both variants ----------------------------------------------------------------


def _acc_dtype(dtype: Any) -> Any:
    return jnp.float64 if np.dtype(dtype) == np.float64 else jnp.float32


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
    """``[Bx, Hx, r, c]`` (``Hx`` is 1 or all heads) as ``[Bx, KVH|1, G|1, r, c]``."""
    bx, hx, r, c = x.shape
    if hx == 1:
        return x[:, :, None]
    return x.reshape(bx, kv_heads, hx // kv_heads, r, c)


def _sum_to(ds: jax.Array, shape: Sequence[int]) -> jax.Array:
    """Grouped ``[B, KVH, G, r, c]`` summed over the dimensions a bias of ``shape`` broadcasts."""
    b, kvh, g, r, c = ds.shape
    ds = ds.reshape(b, kvh * g, r, c)
    axes = tuple(a for a in (0, 1) if shape[a] == 1 and ds.shape[a] != 1)
    return ds.sum(axes, keepdims=True) if axes else ds


def _and(a: jax.Array | None, b: jax.Array) -> jax.Array:
    return b if a is None else a & b


def _visible(
    spec: AttentionSpec,
    rows: jax.Array,
    cols: jax.Array,
    seq_q: int,
    seq_k: int,
    kv_heads: int,
    *,
    padded_k: bool,
    mask: jax.Array | None,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
) -> jax.Array | None:
    """Which keys each query row sees, broadcastable to ``[B, KVH, G, rows, cols]`` (None: all)."""
    pos = rows[:, None] + (seq_k - seq_q)
    col = cols[None, :]
    ok = None
    if padded_k:
        ok = _and(ok, col < seq_k)
    if spec.causal:
        ok = _and(ok, col <= pos)
    if spec.window is not None:
        left, right = spec.window
        ok = _and(ok, (col >= pos - left) & (col <= pos + right))
    if ok is not None:
        ok = ok[None, None, None]
    if q_seg is not None:
        ok = _and(ok, (q_seg[:, :, None] == kv_seg[:, None, :])[:, None, None])
    if mask is not None:
        ok = _and(ok, _grouped(mask, kv_heads))
    return ok


def _logits(
    qg: jax.Array, k: jax.Array, bias: jax.Array | None, spec: AttentionSpec, acc: Any
) -> tuple[jax.Array, jax.Array | None]:
    """Scores ``[B, KVH, G, r, c]`` and, with a soft cap, ``tanh(raw / cap)`` for its derivative."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=acc)
    s = s * jnp.asarray(spec.scale, acc)
    t = None
    if spec.soft_cap is not None:
        t = jnp.tanh(s / jnp.asarray(spec.soft_cap, acc))
        s = jnp.asarray(spec.soft_cap, acc) * t
    if bias is not None:
        s = s + _grouped(bias, k.shape[2]).astype(acc)
    return s, t


def _keep(
    seed: jax.Array,
    spec: AttentionSpec,
    batch: int,
    heads: int,
    kv_heads: int,
    seq_q: int,
    rows: jax.Array,
    cols: jax.Array,
) -> jax.Array:
    """The dropout keep mask of a tile, ``[B, KVH, G, rows, cols]`` (query head ``kvh * G + g``)."""
    group = heads // kv_heads
    b = jnp.arange(batch)[:, None, None, None, None]
    h = (jnp.arange(kv_heads)[:, None] * group + jnp.arange(group)[None, :])[None, :, :, None, None]
    i = rows[None, None, None, :, None]
    j = cols[None, None, None, None, :]
    return keep_mask(seed, b, h, i, j, heads, seq_q, spec.dropout_prob)


def _probs(s: jax.Array, ok: jax.Array | None, lse: jax.Array) -> jax.Array:
    """``exp(s - lse)`` on visible entries, 0 elsewhere and on rows that see nothing (lse = -inf)."""
    if ok is not None:
        s = jnp.where(ok, s, -jnp.inf)
    # An empty row has lse = -inf: shifting by +inf instead gives exp(-inf) = 0 without NaNs.
    return jnp.exp(s - jnp.where(lse == -jnp.inf, jnp.inf, lse))


def _sizes(q: jax.Array, k: jax.Array) -> tuple[int, int, int, int, int, int, int]:
    batch, seq_q, heads, dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    return batch, seq_q, seq_k, heads, kv_heads, heads // kv_heads, dim


# --- dense -----------------------------------------------------------------------------------------


def _dense_fwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    seed: jax.Array | None,
    *,
    spec: AttentionSpec,
    params: FwdParams,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    del params, interpret
    batch, seq_q, seq_k, heads, kv_heads, group, dim = _sizes(q, k)
    acc = _acc_dtype(q.dtype)
    rows, cols = jnp.arange(seq_q), jnp.arange(seq_k)
    qg = q.reshape(batch, seq_q, kv_heads, group, dim)
    s, _ = _logits(qg, k, bias, spec, acc)
    ok = _visible(
        spec, rows, cols, seq_q, seq_k, kv_heads, padded_k=False, mask=mask, q_seg=q_seg,
        kv_seg=kv_seg,
    )  # fmt: skip
    if ok is not None:
        s = jnp.where(ok, s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp(s - m)
    den = p.sum(-1, keepdims=True)
    lse = jnp.where(den > 0, m + jnp.log(den), -jnp.inf)
    p = p / jnp.where(den > 0, den, 1.0)
    if spec.dropout_prob > 0.0:
        keep = _keep(seed, spec, batch, heads, kv_heads, seq_q, rows, cols)
        p = jnp.where(keep, p * keep_scale(spec.dropout_prob), 0.0)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(acc))
    return out.reshape(q.shape).astype(q.dtype), lse.reshape(batch, heads, seq_q)


def _dense_bwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    seed: jax.Array | None,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    *,
    spec: AttentionSpec,
    params: BwdParams,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    del out, params, interpret
    batch, seq_q, seq_k, heads, kv_heads, group, dim = _sizes(q, k)
    acc = _acc_dtype(q.dtype)
    rows, cols = jnp.arange(seq_q), jnp.arange(seq_k)
    qg = q.reshape(batch, seq_q, kv_heads, group, dim)
    dog = dout.reshape(batch, seq_q, kv_heads, group, dim).astype(acc)
    s, t = _logits(qg, k, bias, spec, acc)
    ok = _visible(
        spec, rows, cols, seq_q, seq_k, kv_heads, padded_k=False, mask=mask, q_seg=q_seg,
        kv_seg=kv_seg,
    )  # fmt: skip
    p = _probs(s, ok, lse.astype(acc).reshape(batch, kv_heads, group, seq_q, 1))
    dp = jnp.einsum("bqkgd,bskd->bkgqs", dog, v.astype(acc))
    pd = p
    if spec.dropout_prob > 0.0:
        keep = _keep(seed, spec, batch, heads, kv_heads, seq_q, rows, cols)
        inv = keep_scale(spec.dropout_prob)
        pd = jnp.where(keep, p * inv, 0.0)
        dp = jnp.where(keep, dp * inv, 0.0)
    dv = jnp.einsum("bkgqs,bqkgd->bskd", pd, dog)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))  # gradient of the (capped, biased) logits
    dbias = None if bias is None else _sum_to(ds, bias.shape).astype(bias.dtype)
    if t is not None:
        ds = ds * (1.0 - t * t)
    ds = ds * jnp.asarray(spec.scale, acc)
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, k.astype(acc)).reshape(q.shape)
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, qg.astype(acc))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias


# --- chunked ---------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad(x: jax.Array | None, axis: int, size: int, value: Any = 0) -> jax.Array | None:
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _tile(x: jax.Array | None, r0: Any, br: int, c0: Any, bc: int) -> jax.Array | None:
    """The ``[.., r0:r0+br, c0:c0+bc]`` tile of a ``[Bx, Hx, R, C]`` bias or mask."""
    if x is None:
        return None
    return lax.dynamic_slice(x, (0, 0, r0, c0), (x.shape[0], x.shape[1], br, bc))


def _rows(x: jax.Array | None, start: Any, size: int, axis: int = 1) -> jax.Array | None:
    return None if x is None else lax.dynamic_slice_in_dim(x, start, size, axis)


def _blocks(seq_q: int, seq_k: int, q_block: int, kv_block: int) -> tuple[int, int]:
    return min(q_block, seq_q), min(kv_block, seq_k)


def _kv_range(
    spec: AttentionSpec, r0: jax.Array, bq: int, bk: int, seq_q: int, seq_k: int
) -> tuple[jax.Array, jax.Array]:
    """Key blocks ``[lo, hi)`` that query rows ``[r0, r0 + bq)`` can see under causal/window masks."""
    off = seq_k - seq_q
    lo_col = jnp.int32(0)
    hi_col = jnp.int32(seq_k)
    last = r0 + bq - 1 + off  # position of the block's last row
    if spec.causal:
        hi_col = jnp.minimum(hi_col, last + 1)
    if spec.window is not None:
        left, right = spec.window
        lo_col = jnp.maximum(lo_col, r0 + off - left)
        hi_col = jnp.minimum(hi_col, last + right + 1)
    lo = lo_col // bk
    hi = jnp.maximum(lo, (jnp.maximum(hi_col, 0) + bk - 1) // bk)
    return lo, hi


def _q_range(
    spec: AttentionSpec, c0: jax.Array, bq: int, bk: int, seq_q: int, seq_k: int
) -> tuple[jax.Array, jax.Array]:
    """Query blocks ``[lo, hi)`` whose rows can see some key of ``[c0, c0 + bk)``."""
    off = seq_k - seq_q
    lo_row = jnp.int32(0)
    hi_row = jnp.int32(seq_q)
    reach = None  # how far right of its position a row may look
    if spec.causal:
        reach = 0
    if spec.window is not None:
        left, right = spec.window
        reach = right if reach is None else min(reach, right)
        hi_row = jnp.minimum(hi_row, c0 + bk - 1 - off + left + 1)
    if reach is not None:
        lo_row = jnp.maximum(lo_row, c0 - off - reach)
    lo = lo_row // bq
    hi = jnp.maximum(lo, (jnp.maximum(hi_row, 0) + bq - 1) // bq)
    return lo, hi


def _chunked_fwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    seed: jax.Array | None,
    *,
    spec: AttentionSpec,
    params: FwdParams,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    del interpret
    batch, seq_q, seq_k, heads, kv_heads, group, dim = _sizes(q, k)
    acc = _acc_dtype(q.dtype)
    bq, bk = _blocks(seq_q, seq_k, params.q_blocksize, params.kv_blocksize)
    nq, nk = _cdiv(seq_q, bq), _cdiv(seq_k, bk)
    sqp, skp = nq * bq, nk * bk
    qp = _pad(q, 1, sqp)
    kp, vp = _pad(k, 1, skp), _pad(v, 1, skp)
    biasp = _pad(_pad(bias, 2, sqp), 3, skp)
    maskp = _pad(_pad(mask, 2, sqp), 3, skp, False)
    qsegp, kvsegp = _pad(q_seg, 1, sqp), _pad(kv_seg, 1, skp)
    drop = spec.dropout_prob > 0.0
    inv_keep = keep_scale(spec.dropout_prob)

    def q_block(i: jax.Array) -> tuple[jax.Array, jax.Array]:
        r0 = i * bq
        qg = lax.dynamic_slice_in_dim(qp, r0, bq, 1).reshape(batch, bq, kv_heads, group, dim)
        rows = r0 + jnp.arange(bq)
        qs = _rows(qsegp, r0, bq)

        def kv_step(j: jax.Array, carry: Any) -> Any:
            m, den, o = carry
            c0 = j * bk
            cols = c0 + jnp.arange(bk)
            s, _ = _logits(qg, _rows(kp, c0, bk), _tile(biasp, r0, bq, c0, bk), spec, acc)
            ok = _visible(
                spec, rows, cols, seq_q, seq_k, kv_heads, padded_k=skp != seq_k,
                mask=_tile(maskp, r0, bq, c0, bk), q_seg=qs, kv_seg=_rows(kvsegp, c0, bk),
            )  # fmt: skip
            if ok is not None:
                s = jnp.where(ok, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1, keepdims=True))
            shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - shift)
            corr = jnp.exp(m - shift)
            den = den * corr + p.sum(-1, keepdims=True)
            if drop:
                keep = _keep(seed, spec, batch, heads, kv_heads, seq_q, rows, cols)
                p = jnp.where(keep, p * inv_keep, 0.0)
            o = o * corr + jnp.einsum("bkgqs,bskd->bkgqd", p, _rows(vp, c0, bk).astype(acc))
            return m_new, den, o

        init = (
            jnp.full((batch, kv_heads, group, bq, 1), -jnp.inf, acc),
            jnp.zeros((batch, kv_heads, group, bq, 1), acc),
            jnp.zeros((batch, kv_heads, group, bq, dim), acc),
        )
        lo, hi = _kv_range(spec, r0, bq, bk, seq_q, seq_k)
        m, den, o = lax.fori_loop(lo, hi, kv_step, init)
        o = o / jnp.where(den > 0, den, 1.0)
        lse = jnp.where(den > 0, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(den), -jnp.inf)
        o = jnp.moveaxis(o, 3, 1).reshape(batch, bq, heads, dim).astype(q.dtype)
        return o, lse.reshape(batch, heads, bq)

    outs, lses = lax.map(q_block, jnp.arange(nq, dtype=jnp.int32))
    out = jnp.moveaxis(outs, 0, 1).reshape(batch, sqp, heads, dim)[:, :seq_q]
    lse = jnp.moveaxis(lses, 0, 2).reshape(batch, heads, sqp)[:, :, :seq_q]
    return out, lse


def _chunked_bwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    seed: jax.Array | None,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    *,
    spec: AttentionSpec,
    params: BwdParams,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    del interpret
    batch, seq_q, seq_k, heads, kv_heads, group, dim = _sizes(q, k)
    acc = _acc_dtype(q.dtype)
    bq, bk = _blocks(seq_q, seq_k, params.q_blocksize, params.kv_blocksize)
    nq, nk = _cdiv(seq_q, bq), _cdiv(seq_k, bk)
    sqp, skp = nq * bq, nk * bk
    # delta_i = sum_j p_ij dp_ij = dout_i . out_i (also with dropout): one number per row.
    delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(acc), out.astype(acc))
    delta = _pad(delta, 2, sqp).reshape(batch, kv_heads, group, sqp)
    lsep = _pad(lse.astype(acc), 2, sqp, -jnp.inf).reshape(batch, kv_heads, group, sqp)
    qp, dop = _pad(q, 1, sqp), _pad(dout, 1, sqp)
    kp, vp = _pad(k, 1, skp), _pad(v, 1, skp)
    biasp = _pad(_pad(bias, 2, sqp), 3, skp)
    maskp = _pad(_pad(mask, 2, sqp), 3, skp, False)
    qsegp, kvsegp = _pad(q_seg, 1, sqp), _pad(kv_seg, 1, skp)
    drop = spec.dropout_prob > 0.0
    inv_keep = keep_scale(spec.dropout_prob)
    scale = jnp.asarray(spec.scale, acc)

    def kv_block(carry: Any, j: jax.Array) -> Any:
        c0 = j * bk
        cols = c0 + jnp.arange(bk)
        kb, vb = _rows(kp, c0, bk), _rows(vp, c0, bk)
        ks = _rows(kvsegp, c0, bk)

        def q_step(i: jax.Array, inner: Any) -> Any:
            dq_acc, dbias_acc, dk_b, dv_b = inner
            r0 = i * bq
            rows = r0 + jnp.arange(bq)
            qg = _rows(qp, r0, bq).reshape(batch, bq, kv_heads, group, dim)
            dog = _rows(dop, r0, bq).reshape(batch, bq, kv_heads, group, dim).astype(acc)
            bias_t = _tile(biasp, r0, bq, c0, bk)
            s, t = _logits(qg, kb, bias_t, spec, acc)
            ok = _visible(
                spec, rows, cols, seq_q, seq_k, kv_heads, padded_k=skp != seq_k,
                mask=_tile(maskp, r0, bq, c0, bk), q_seg=_rows(qsegp, r0, bq), kv_seg=ks,
            )  # fmt: skip
            p = _probs(s, ok, _rows(lsep, r0, bq, 3)[..., None])
            dp = jnp.einsum("bqkgd,bskd->bkgqs", dog, vb.astype(acc))
            pd = p
            if drop:
                keep = _keep(seed, spec, batch, heads, kv_heads, seq_q, rows, cols)
                pd = jnp.where(keep, p * inv_keep, 0.0)
                dp = jnp.where(keep, dp * inv_keep, 0.0)
            dv_b = dv_b + jnp.einsum("bkgqs,bqkgd->bskd", pd, dog)
            ds = p * (dp - _rows(delta, r0, bq, 3)[..., None])
            if dbias_acc is not None:
                tile = _tile(dbias_acc, r0, bq, c0, bk) + _sum_to(ds, bias_t.shape)
                dbias_acc = lax.dynamic_update_slice(dbias_acc, tile, (0, 0, r0, c0))
            if t is not None:
                ds = ds * (1.0 - t * t)
            ds = ds * scale
            dq_b = jnp.einsum("bkgqs,bskd->bqkgd", ds, kb.astype(acc))
            dq_b = _rows(dq_acc, r0, bq) + dq_b.reshape(batch, bq, heads, dim)
            dq_acc = lax.dynamic_update_slice_in_dim(dq_acc, dq_b, r0, 1)
            dk_b = dk_b + jnp.einsum("bkgqs,bqkgd->bskd", ds, qg.astype(acc))
            return dq_acc, dbias_acc, dk_b, dv_b

        dq_acc, dbias_acc = carry
        zeros = jnp.zeros((batch, bk, kv_heads, dim), acc)
        lo, hi = _q_range(spec, c0, bq, bk, seq_q, seq_k)
        dq_acc, dbias_acc, dk_b, dv_b = lax.fori_loop(
            lo, hi, q_step, (dq_acc, dbias_acc, zeros, zeros)
        )
        return (dq_acc, dbias_acc), (dk_b, dv_b)

    dbias0 = None if biasp is None else jnp.zeros(biasp.shape, acc)
    (dq, dbias), (dks, dvs) = lax.scan(
        kv_block,
        (jnp.zeros((batch, sqp, heads, dim), acc), dbias0),
        jnp.arange(nk, dtype=jnp.int32),
    )
    dk = jnp.moveaxis(dks, 0, 1).reshape(batch, skp, kv_heads, dim)[:, :seq_k]
    dv = jnp.moveaxis(dvs, 0, 1).reshape(batch, skp, kv_heads, dim)[:, :seq_k]
    dq = dq[:, :seq_q]
    if dbias is not None:
        dbias = dbias[:, :, :seq_q, :seq_k].astype(bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias


# --- heuristics ------------------------------------------------------------------------------------

# Dense scores above this many elements per call go to the chunked variant (256 MiB in float32);
# a chunked tile of scores for all batches and heads on a GPU holds as many at most.
_DENSE_LIMIT = 1 << 26
# Off GPUs a chunked tile holds this many at most (64 MiB in float32).
_SHORT_TILE_LIMIT = 1 << 24


def preferred_variant(shape: AttentionShape) -> str:
    """``dense`` for short sequences and for decoding (few queries: the chunked scan over the keys
    ran 18x slower there, results/decode_NVIDIA_H200_20261129-142044.json), ``chunked`` when the
    scores would be large."""
    scores = shape.batch * shape.heads * shape.seq_q * shape.seq_k
    short = shape.seq_k <= 2048 or decoding_rows(shape) is not None
    return "dense" if short and scores <= _DENSE_LIMIT else "chunked"


def _dense_heuristic(shape: AttentionShape) -> tuple[FwdParams, BwdParams]:
    del shape
    return FwdParams(), BwdParams()  # block sizes do not apply


def _dense_candidates(shape: AttentionShape) -> list[tuple[FwdParams, BwdParams]]:
    return [_dense_heuristic(shape)]


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _fit(block: int, seq: int) -> int:
    """A block no longer than the sequence (a sequence shorter than the block is one block)."""
    return seq if seq <= block else block


def _halve_to_fit(rows: int, bq: int, bk: int, limit: int) -> tuple[int, int]:
    """``bq``, then ``bk``, halved (to 16) until ``rows`` tiles hold ``limit`` scores or fewer."""
    while rows * bq * bk > limit and bq > 16:
        bq = max(16, _pow2_at_least(bq) // 2)
    while rows * bq * bk > limit and bk > 16:
        bk = max(16, _pow2_at_least(bk) // 2)
    return bq, bk


def _gpu_blocks(shape: AttentionShape, unmasked: tuple[int, int]) -> tuple[int, int]:
    """A chunked tile ``(queries, keys)`` on a GPU: ``unmasked`` without a mask; causal an eighth
    of the keys (512-2048) by half as many queries, whose diagonal blocks compute fewer hidden
    scores; with a window keys as many as its wider side (512-2048) by half as many queries, the
    left side alone when causal (the mask hides the right). Halved until the tiles of all batches
    and heads hold ``_DENSE_LIMIT`` scores or fewer."""
    spec = shape.spec
    if spec.window is None and not spec.causal:
        bq, bk = unmasked
    else:
        if spec.window is None:
            span = shape.seq_k // 8
        else:
            span = spec.window[0] if spec.causal else max(spec.window)
        bk = min(2048, max(512, _pow2_at_least(span)))
        bq = bk // 2
    rows = shape.batch * shape.heads
    return _halve_to_fit(rows, _fit(bq, shape.seq_q), _fit(bk, shape.seq_k), _DENSE_LIMIT)


def _chunked_heuristic(shape: AttentionShape) -> tuple[FwdParams, BwdParams]:
    """On GPUs, tiles as long as the masks allow. In float32 on an H200 the forward ran 2.0x faster
    on 1024 x 2048 tiles than on 256 x 512 at 1x16384x16x128 causal, 1.7x on 1024 x 4096 at
    2x4096x8x256 and 1.4x on 128 x 2048 at 8x2048x32x64, whose scan rescales its output a quarter
    as often; causal at 8x2048x32x64, 256 x 512 led longer tiles (results/decode_NVIDIA_H200_
    20261130-004704.json to -005035.json). Forward+backward on both tiles, 1024 x 2048 ran 1.8x
    256 x 512 at 1x16384 causal, and 128 x 2048 1.23x 128 x 512 at 8x2048x32x64 (-010153.json,
    -010531.json). With a window the tile that led followed its width: 256 x 512 at 256 keys a
    side, 512 x 1024 at 1024 (1.07x 256 x 512 forward at 2x8192x8x128 causal and 4x4096x16x128,
    1.57x at 2x8192x16x64 causal; 1.09x forward+backward), 1024 x 2048 at 4096 (1.45x;
    -025847.json to -030830.json). Elsewhere at most 256 x 512 and ``_SHORT_TILE_LIMIT`` scores:
    on a CPU the long tiles ran 2.1-2.5x slower without a mask and 1.2-1.4x causal (1x8192x8x64)."""
    if device_kind() == "gpu":
        fwd_q, fwd_k = _gpu_blocks(shape, (1024, 4096))
        bwd_q, bwd_k = _gpu_blocks(shape, (1024, 2048))
    else:
        rows, seq_q, seq_k = shape.batch * shape.heads, shape.seq_q, shape.seq_k
        fwd_q, fwd_k = _halve_to_fit(rows, _fit(256, seq_q), _fit(512, seq_k), _SHORT_TILE_LIMIT)
        bwd_q, bwd_k = fwd_q, fwd_k
    return (
        FwdParams(q_blocksize=fwd_q, kv_blocksize=fwd_k),
        BwdParams(q_blocksize=bwd_q, kv_blocksize=bwd_k),
    )


def _chunked_candidates(shape: AttentionShape) -> list[tuple[FwdParams, BwdParams]]:
    out = [_chunked_heuristic(shape)]
    long = device_kind() == "gpu"
    for bq in (128, 256, 512, 1024) if long else (64, 128, 256, 512):
        for bk in (512, 1024, 2048, 4096) if long else (128, 256, 512, 1024):
            q_b, k_b = _fit(bq, shape.seq_q), _fit(bk, shape.seq_k)
            if shape.batch * shape.heads * q_b * k_b > _DENSE_LIMIT:
                continue
            pair = (
                FwdParams(q_blocksize=q_b, kv_blocksize=k_b),
                BwdParams(q_blocksize=q_b, kv_blocksize=k_b),
            )
            if pair not in out:
                out.append(pair)
    return out


def _exact_f32(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with float32 (and wider) inputs multiplied in full precision.

    JAX's default lets GPUs and TPUs multiply float32 in reduced precision (TF32, bf16 passes); here
    float32 in means float32 arithmetic, as in the Pallas and Triton backends.
    """

    @functools.wraps(fn)
    def wrapped(q: jax.Array, *args: Any, **kwargs: Any) -> Any:
        if jnp.dtype(q.dtype).itemsize >= 4:
            with jax.default_matmul_precision("highest"):
                return fn(q, *args, **kwargs)
        return fn(q, *args, **kwargs)

    return wrapped


DENSE = register_backend(
    AttentionBackend(
        platform="xla",
        variant="dense",
        devices=("cpu", "gpu", "tpu"),
        fwd=_exact_f32(_dense_fwd),
        bwd=_exact_f32(_dense_bwd),
        heuristic=_dense_heuristic,
        candidates=_dense_candidates,
        bwd_uses_residuals=False,
    )
)

CHUNKED = register_backend(
    AttentionBackend(
        platform="xla",
        variant="chunked",
        devices=("cpu", "gpu", "tpu"),
        fwd=_exact_f32(_chunked_fwd),
        bwd=_exact_f32(_chunked_bwd),
        heuristic=_chunked_heuristic,
        candidates=_chunked_candidates,
    )
)
