"""Flash attention in Pallas for TPUs through Mosaic (variant ``"tpu"``).

The arrays are laid out ``[batch, heads, seq, dim]`` outside the kernels so that every block's last two
dims are (sequence, head dim), the TPU's (sublane, lane) tiles. The grids put the reduction axis last,
marked ``"arbitrary"``, with accumulators in VMEM scratch:

- forward, grid (B, H, q blocks, kv blocks): online softmax; ``lse`` leaves lane-broadcast as
  ``[B, H, Sq, 128]`` (a layout Mosaic stores without relayouts) and is sliced outside;
- dK/dV, grid (B, KV heads, kv blocks, group * q blocks): sums over the query heads of a GQA group;
- dQ (and dbias), grid (B, H, q blocks, kv blocks).

Blocks outside the causal/window band are skipped twice: their index maps are clamped into the band
(the pipeline sees the same block index and issues no copy) and ``pl.when`` skips the compute. Blocks
inside the band that need no element mask take an unmasked path. With segment ids the band is cut
further to the blocks that share a segment with the tile's rows: each tile's span of blocks on the
other side comes from ``_backend.segment_spans``, reduced per block outside the kernels and read by
the index maps and kernels as scalar prefetch (packed documents skip the blocks of the others).

A boolean mask is folded into the bias as ``-inf`` outside the kernel (its gradient is unaffected:
masked weights are zero). Sequences are padded to block multiples and masked by their true lengths.
On a CPU (tests) the kernels run in Pallas's interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._registry import BwdParams, FwdParams
from ._backend import AttentionBackend, AttentionShape, register_backend, segment_spans
from ._dropout import keep_mask, keep_scale
from ._pallas_gpu import _Geom, _kv_range, _q_range, _Refs, _segment_blocks
from ._spec import AttentionSpec

__all__ = ["bwd", "candidates", "fwd", "heuristic"]

LANES = 128
SUBLANES = 8


def _resolve_interpret(interpret: bool | None) -> bool:
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _block(requested: int, seq: int, lane: bool) -> int:
    """A block of ``requested`` rows, or one block over the whole (padded) sequence when shorter."""
    if requested < 1 or requested % SUBLANES:
        raise ValueError(f"TPU block size {requested=} must be a positive multiple of {SUBLANES}")
    whole = _round_up(seq, SUBLANES)
    if whole <= requested:
        return whole
    if lane and requested % LANES:
        raise ValueError(
            f"TPU kv block size {requested=} must be a multiple of {LANES} (it is a lane dimension)"
            f" when it does not cover the whole key sequence ({seq=})"
        )
    return requested


def _geom(q: Any, k: Any, bias: Any, spec: AttentionSpec, bq: int, bk: int) -> _Geom:
    batch, seq_q, heads, head_dim = q.shape
    _, seq_k, kv_heads, _ = k.shape
    if heads % kv_heads:
        raise ValueError(f"{heads=} must be a multiple of {kv_heads=}")
    dims = (bias is not None and bias.shape[0] != 1, bias is not None and bias.shape[1] != 1)
    return _Geom(
        spec=spec,
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        seq_q=seq_q,
        seq_k=seq_k,
        head_dim=head_dim,
        dpad=head_dim,
        bq=_block(bq, seq_q, lane=False),
        bk=_block(bk, seq_k, lane=True),
        bias_bh=dims,
        mask_bh=(False, False),
        f32=jnp.dtype(q.dtype) == jnp.float32,
    )


def _kernel_spec(spec: AttentionSpec) -> AttentionSpec:
    """The spec the kernels see: a mask travels inside the bias."""
    if not spec.has_mask:
        return spec
    return dataclasses.replace(spec, has_mask=False, has_bias=True)


def _dot(g: _Geom, a: Any, b: Any, contract: tuple[int, int]) -> jax.Array:
    precision = lax.Precision.HIGHEST if g.f32 else None
    return lax.dot_general(
        a,
        b,
        (((contract[0],), (contract[1],)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


def _logits(g: _Geom, q: Any, k: Any, bias: Any) -> tuple[jax.Array, jax.Array | None]:
    """Scaled (soft-capped, biased) logits in natural units, and the tanh for the backward."""
    qk = _dot(g, q, k, (1, 1))
    spec = g.spec
    t = None
    if spec.soft_cap is not None:
        t = jnp.tanh(qk * (spec.scale / spec.soft_cap))
        s = t * spec.soft_cap
    else:
        s = qk * spec.scale
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    return s, t


def _visible(g: _Geom, rows: Any, cols: Any, qseg: Any, kseg: Any) -> jax.Array:
    """Bool block from 2-D row/col index arrays (TPU vectors are 2-D)."""
    pos = rows + g.offset
    ok = cols < g.seq_k
    if g.spec.causal:
        ok &= cols <= pos
    if g.spec.window is not None:
        left, right = g.spec.window
        ok &= (cols >= pos - left) & (cols <= pos + right)
    if qseg is not None:
        ok &= qseg == kseg
    return ok


def _iota(g: _Geom, q0: Any, k0: Any) -> tuple[jax.Array, jax.Array]:
    shape = (g.bq, g.bk)
    return (
        q0 + lax.broadcasted_iota(jnp.int32, shape, 0),
        k0 + lax.broadcasted_iota(jnp.int32, shape, 1),
    )


def _keep(g: _Geom, seed: Any, b: Any, h: Any, rows: Any, cols: Any) -> jax.Array:
    return keep_mask(seed, b, h, rows, cols, g.heads, g.seq_q, g.spec.dropout_prob)


def _segs(r: _Refs) -> tuple[Any, Any]:
    if r.qseg is None:
        return None, None
    return r.qseg[:, 0:1], r.kseg[0:1, :]


def _in_band(bounds: Any, idx: Any) -> tuple[Any, Any]:
    lo, full_lo, full_hi, hi = bounds
    inside = (idx >= lo) & (idx < hi)
    full = (idx >= full_lo) & (idx < full_hi)
    return inside & full, inside & jnp.logical_not(full)


def _clamp(bounds: Any, idx: Any, count: int) -> Any:
    """A block index inside the band (so the pipeline copies nothing for skipped steps)."""
    lo, _, _, hi = bounds
    return jnp.clip(idx, jnp.minimum(lo, count - 1), jnp.clip(hi - 1, 0, count - 1))


def _block_spans(first: Any, end: Any, rows: int, block: int) -> jax.Array:
    """Per block of ``block`` rows, the rows of the other side that its rows' segments reach,
    ``(min first, max end)``, flattened to ``[B * blocks * 2]`` int32 for SMEM; ``first`` and
    ``end`` are ``segment_spans``' ``[B, S]`` per row (padding rows reach nothing)."""
    batch = first.shape[0]
    first = _pad(first, 1, rows, jnp.iinfo(jnp.int32).max).reshape(batch, rows // block, block)
    end = _pad(end, 1, rows, 0).reshape(batch, rows // block, block)
    return jnp.stack([jnp.min(first, axis=2), jnp.max(end, axis=2)], axis=2).reshape(-1)


def _segment_band(
    bounds: Any, spans: Any, b: Any, blk: Any, blocks: int, other_block: int
) -> tuple[Any, ...]:
    """``bounds`` cut to the span of block ``blk`` of batch row ``b`` (``_segment_blocks``)."""
    at = (b * blocks + blk) * 2
    return _segment_blocks(bounds, (spans[at], spans[at + 1]), other_block)


def _kv_band(g: _Geom, b: Any, i: Any, spans: Any) -> tuple[Any, ...]:
    """Key blocks of query block ``i`` (``_kv_range``), cut to its segments' span if any."""
    bounds = _kv_range(g, i * g.bq, g.bq, g.bk)
    return bounds if spans is None else _segment_band(bounds, spans, b, i, g.sqp // g.bq, g.bk)


def _q_band(g: _Geom, b: Any, kb: Any, spans: Any) -> tuple[Any, ...]:
    """Query blocks of key block ``kb`` (``_q_range``), cut to its segments' span if any."""
    bounds = _q_range(g, kb * g.bk, g.bq, g.bk)
    return bounds if spans is None else _segment_band(bounds, spans, b, kb, g.skp // g.bk, g.bq)


def _split_spans(g: _Geom, refs: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """The scalar-prefetched spans (first with segment ids) and the other refs."""
    return (refs[0], refs[1:]) if g.spec.has_segments else (None, refs)


# ----------------------------------------------------------------------------------------------------
# Kernels.


def _fwd_kernel(*refs: Any, g: _Geom) -> None:
    spans, refs = _split_spans(g, refs)
    r = _Refs(g, refs, ())
    o_ref, lse_ref, m_sc, l_sc, acc_sc = r.outs
    b, h, i, j = (pl.program_id(a) for a in range(4))
    nkb = g.skp // g.bk

    @pl.when(j == 0)
    def _init() -> None:
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def step(masked: bool) -> None:
        v = r.v[...]
        s, _ = _logits(g, r.q[...], r.k[...], r.bias[...] if r.bias is not None else None)
        rows, cols = _iota(g, i * g.bq, j * g.bk)
        if masked:
            s = jnp.where(_visible(g, rows, cols, *_segs(r)), s, -jnp.inf)
        m_prev, l_prev = m_sc[:, 0:1], l_sc[:, 0:1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m_prev - m_use)
        p = jnp.exp(s - m_use)
        l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        if r.seed is not None:
            keep = _keep(g, r.seed[0], b, h, rows, cols)
            p = jnp.where(keep, p * keep_scale(g.spec.dropout_prob), 0.0)
        acc_sc[...] = acc_sc[...] * alpha + _dot(g, p.astype(v.dtype), v, (1, 0))
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
        l_sc[...] = jnp.broadcast_to(l_new, l_sc.shape)

    unmasked, masked = _in_band(_kv_band(g, b, i, spans), j)
    pl.when(unmasked)(functools.partial(step, False))
    pl.when(masked)(functools.partial(step, True))

    @pl.when(j == nkb - 1)
    def _finish() -> None:
        den = l_sc[:, 0:1]
        empty = den == 0.0
        den = jnp.where(empty, 1.0, den)
        o_ref[...] = (acc_sc[...] / den).astype(o_ref.dtype)
        lse = jnp.where(empty, -jnp.inf, m_sc[:, 0:1] + jnp.log(den))
        lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def _dkdv_kernel(*refs: Any, g: _Geom) -> None:
    spans, refs = _split_spans(g, refs)
    r = _Refs(g, refs, ("do", "lse", "delta"))
    dk_ref, dv_ref, dk_sc, dv_sc = r.outs
    b, kvh, kb, step_idx = (pl.program_id(a) for a in range(4))
    nqb = g.sqp // g.bq
    t, qi = step_idx // nqb, step_idx % nqb
    h = kvh * g.group + t

    @pl.when(step_idx == 0)
    def _init() -> None:
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    def step(masked: bool) -> None:
        q, do, k, v = r.q[...], r.do[...], r.k[...], r.v[...]
        s, tanh = _logits(g, q, k, r.bias[...] if r.bias is not None else None)
        rows, cols = _iota(g, qi * g.bq, kb * g.bk)
        if masked:
            s = jnp.where(_visible(g, rows, cols, *_segs(r)), s, -jnp.inf)
        p = jnp.exp(s - r.lse[:, 0:1])
        dp = _dot(g, do, v, (1, 1))
        pd = p
        if r.seed is not None:
            keep = _keep(g, r.seed[0], b, h, rows, cols)
            inv = keep_scale(g.spec.dropout_prob)
            pd = jnp.where(keep, p * inv, 0.0)
            dp = jnp.where(keep, dp * inv, 0.0)
        dv_sc[...] += _dot(g, pd.astype(do.dtype), do, (0, 0))
        ds = p * (dp - r.delta[:, 0:1])
        if tanh is not None:
            ds = ds * (1.0 - tanh * tanh)
        dk_sc[...] += _dot(g, ds.astype(q.dtype), q, (0, 0))

    unmasked, masked = _in_band(_q_band(g, b, kb, spans), qi)
    pl.when(unmasked)(functools.partial(step, False))
    pl.when(masked)(functools.partial(step, True))

    @pl.when(step_idx == g.group * nqb - 1)
    def _finish() -> None:
        dk_ref[...] = (dk_sc[...] * g.spec.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(*refs: Any, g: _Geom, want_dbias: bool) -> None:
    spans, refs = _split_spans(g, refs)
    r = _Refs(g, refs, ("do", "lse", "delta"))
    if want_dbias:
        dq_ref, dbias_ref, dq_sc = r.outs
    else:
        (dq_ref, dq_sc), dbias_ref = r.outs, None
    b, h, i, j = (pl.program_id(a) for a in range(4))
    nkb = g.skp // g.bk

    @pl.when(j == 0)
    def _init() -> None:
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    def step(masked: bool) -> None:
        q, do, k, v = r.q[...], r.do[...], r.k[...], r.v[...]
        s, tanh = _logits(g, q, k, r.bias[...] if r.bias is not None else None)
        rows, cols = _iota(g, i * g.bq, j * g.bk)
        if masked:
            s = jnp.where(_visible(g, rows, cols, *_segs(r)), s, -jnp.inf)
        p = jnp.exp(s - r.lse[:, 0:1])
        dp = _dot(g, do, v, (1, 1))
        if r.seed is not None:
            keep = _keep(g, r.seed[0], b, h, rows, cols)
            dp = jnp.where(keep, dp * keep_scale(g.spec.dropout_prob), 0.0)
        ds = p * (dp - r.delta[:, 0:1])
        if dbias_ref is not None:
            dbias_ref[...] = ds
        if tanh is not None:
            ds = ds * (1.0 - tanh * tanh)
        dq_sc[...] += _dot(g, ds.astype(k.dtype), k, (1, 0))

    unmasked, masked = _in_band(_kv_band(g, b, i, spans), j)
    pl.when(unmasked)(functools.partial(step, False))
    pl.when(masked)(functools.partial(step, True))
    if dbias_ref is not None:

        @pl.when(jnp.logical_not(unmasked | masked))
        def _zero() -> None:
            dbias_ref[...] = jnp.zeros(dbias_ref.shape, jnp.float32)

    @pl.when(j == nkb - 1)
    def _finish() -> None:
        dq_ref[...] = (dq_sc[...] * g.spec.scale).astype(dq_ref.dtype)


# ----------------------------------------------------------------------------------------------------
# Wrappers.


def _pad(x: Any, axis: int, size: int, value: Any = 0) -> Any:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _bhsd(x: Any, seq: int) -> Any:
    """``[B, S, H, D]`` -> ``[B, H, S_padded, D]``."""
    return _pad(jnp.swapaxes(x, 1, 2), 2, seq)


def _check(spec: AttentionSpec, bias: Any, mask: Any, q_seg: Any, seed: Any) -> None:
    if spec.has_bias != (bias is not None):
        raise ValueError(f"spec.has_bias={spec.has_bias} but bias is {type(bias).__name__}")
    if spec.has_mask != (mask is not None):
        raise ValueError(f"spec.has_mask={spec.has_mask} but mask is {type(mask).__name__}")
    if spec.has_segments != (q_seg is not None):
        raise ValueError(
            f"spec.has_segments={spec.has_segments} but q_seg is {type(q_seg).__name__}"
        )
    if spec.dropout_prob > 0 and seed is None:
        raise ValueError("dropout_prob > 0 needs a seed")


def _merged_bias(q: Any, k: Any, bias: Any, mask: Any) -> Any:
    """Bias with the mask folded in as ``-inf``, ``[B|1, H|1, Sq, Sk]`` float32 (None if neither)."""
    if mask is None:
        return bias
    sq, sk = q.shape[1], k.shape[1]
    add = jnp.where(mask, 0.0, -jnp.inf).astype(jnp.float32)
    add = jnp.broadcast_to(add, (*add.shape[:2], sq, sk))
    return add if bias is None else bias.astype(jnp.float32) + add


def _extras(g: _Geom, bias: Any, q_seg: Any, kv_seg: Any, seed: Any) -> list[Any]:
    ops: list[Any] = []
    if bias is not None:
        full = jnp.broadcast_to(bias, (*bias.shape[:2], g.seq_q, g.seq_k))
        ops.append(_pad(_pad(full, 2, g.sqp), 3, g.skp))
    if q_seg is not None:
        qs = _pad(q_seg.astype(jnp.int32), 1, g.sqp)
        ks = _pad(kv_seg.astype(jnp.int32), 1, g.skp)
        ops.append(jnp.broadcast_to(qs[:, :, None], (g.batch, g.sqp, LANES)))
        ops.append(jnp.broadcast_to(ks[:, None, :], (g.batch, SUBLANES, g.skp)))
    if seed is not None:
        ops.append(jnp.reshape(jnp.asarray(seed).astype(jnp.uint32), (1,)))
    return ops


def _extra_specs(g: _Geom, index: Any) -> list[pl.BlockSpec]:
    """Specs of bias/segments/seed; ``index(*grid) -> (b, h, q block, kv block)``."""
    specs: list[pl.BlockSpec] = []
    if g.spec.has_bias:
        bb, bh = g.bias_bh

        def bias_map(*idx: Any) -> tuple[Any, ...]:
            b, h, qi, kj = index(*idx)
            return (b if bb else 0, h if bh else 0, qi, kj)

        specs.append(pl.BlockSpec((None, None, g.bq, g.bk), bias_map))
    if g.spec.has_segments:
        specs.append(
            pl.BlockSpec((None, g.bq, LANES), lambda *idx: (index(*idx)[0], index(*idx)[2], 0))
        )
        specs.append(
            pl.BlockSpec((None, SUBLANES, g.bk), lambda *idx: (index(*idx)[0], 0, index(*idx)[3]))
        )
    if g.spec.dropout_prob > 0:
        specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    return specs


def _params(semantics: tuple[str, ...]) -> Any:
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _spans(q_seg: Any, kv_seg: Any) -> tuple[Any, Any]:
    """``segment_spans`` as ``[B, 2, Sq]`` and ``[B, 2, Sk]`` (first, end); Nones without ids."""
    if q_seg is None:
        return None, None
    q_span, kv_span = segment_spans(q_seg, kv_seg)
    return q_span[:, 1:], kv_span[:, 1:]


def _first(prefetched: tuple[Any, ...]) -> Any:
    return prefetched[0] if prefetched else None


def _call(
    kernel: Any,
    spans: Any,
    *,
    grid: tuple[int, ...],
    in_specs: list[Any],
    out_specs: list[Any],
    scratch_shapes: list[Any],
    **options: Any,
) -> Any:
    """``pl.pallas_call`` (``options`` passed on) whose index maps and kernel get ``spans`` (if
    any) as scalar prefetch: index maps take ``(*grid indices, *prefetched)``, the kernel the
    prefetched refs before its others."""
    prefetch = () if spans is None else (spans,)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch_shapes,
    )
    call = pl.pallas_call(kernel, grid_spec=grid_spec, **options)
    return lambda *args: call(*prefetch, *args)


def fwd(
    q: Any,
    k: Any,
    v: Any,
    bias: Any = None,
    mask: Any = None,
    q_seg: Any = None,
    kv_seg: Any = None,
    seed: Any = None,
    *,
    spec: AttentionSpec,
    params: FwdParams | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Forward pass: ``(out [B, Sq, H, D], lse [B, H, Sq] float32)`` per the contract in ``_spec``."""
    params = params or heuristic(AttentionShape.of(q, k, spec))[0]
    _check(spec, bias, mask, q_seg, seed)
    bias = _merged_bias(q, k, bias, mask)
    kspec = _kernel_spec(spec)
    g = _geom(q, k, bias, kspec, params.q_blocksize, params.kv_blocksize)
    nqb, nkb = g.sqp // g.bq, g.skp // g.bk
    q_span, _ = _spans(q_seg, kv_seg)
    spans = None if q_span is None else _block_spans(q_span[:, 0], q_span[:, 1], g.sqp, g.bq)

    def kv_block(b: Any, h: Any, i: Any, j: Any, *prefetched: Any) -> Any:
        return _clamp(_kv_band(g, b, i, _first(prefetched)), j, nkb)

    qspec = pl.BlockSpec((None, None, g.bq, g.head_dim), lambda b, h, i, j, *_: (b, h, i, 0))
    kvspec = pl.BlockSpec(
        (None, None, g.bk, g.head_dim),
        lambda b, h, i, j, *sp: (b, h // g.group, kv_block(b, h, i, j, *sp), 0),
    )
    extra_specs = _extra_specs(g, lambda b, h, i, j, *sp: (b, h, i, kv_block(b, h, i, j, *sp)))
    out, lse = _call(
        functools.partial(_fwd_kernel, g=g),
        spans,
        grid=(g.batch, g.heads, nqb, nkb),
        in_specs=[qspec, kvspec, kvspec, *extra_specs],
        out_specs=[
            qspec,
            pl.BlockSpec((None, None, g.bq, LANES), lambda b, h, i, j, *_: (b, h, i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((g.batch, g.heads, g.sqp, g.head_dim), q.dtype),
            jax.ShapeDtypeStruct((g.batch, g.heads, g.sqp, LANES), jnp.float32),
        ],
        scratch_shapes=[
            pltpu.VMEM((g.bq, LANES), jnp.float32),
            pltpu.VMEM((g.bq, LANES), jnp.float32),
            pltpu.VMEM((g.bq, g.head_dim), jnp.float32),
        ],
        compiler_params=_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=_resolve_interpret(interpret),
        name="ejkfn_flash_fwd_tpu",
    )(_bhsd(q, g.sqp), _bhsd(k, g.skp), _bhsd(v, g.skp), *_extras(g, bias, q_seg, kv_seg, seed))
    return jnp.swapaxes(out[:, :, : g.seq_q], 1, 2), lse[:, :, : g.seq_q, 0]


def bwd(
    q: Any,
    k: Any,
    v: Any,
    bias: Any,
    mask: Any,
    q_seg: Any,
    kv_seg: Any,
    seed: Any,
    out: Any,
    lse: Any,
    dout: Any,
    *,
    spec: AttentionSpec,
    params: BwdParams | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Backward pass: ``(dq, dk, dv, dbias)``; dbias is shaped like ``bias`` (None without one)."""
    params = params or heuristic(AttentionShape.of(q, k, spec))[1]
    _check(spec, bias, mask, q_seg, seed)
    user_bias = bias
    bias = _merged_bias(q, k, bias, mask)
    kspec = _kernel_spec(spec)
    g = _geom(q, k, bias, kspec, params.q_blocksize, params.kv_blocksize)
    interpret = _resolve_interpret(interpret)
    nqb, nkb, group = g.sqp // g.bq, g.skp // g.bk, g.group

    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), dout.astype(jnp.float32))
    # Rows that see no key have lse = -inf; +inf makes their probabilities exactly 0.
    lse_in = jnp.where(jnp.isneginf(lse), jnp.inf, lse).astype(jnp.float32)
    lse_in = jnp.broadcast_to(
        _pad(lse_in, 2, g.sqp, jnp.inf)[..., None], (*lse.shape[:2], g.sqp, LANES)
    )
    delta = jnp.broadcast_to(_pad(delta, 2, g.sqp)[..., None], (*lse.shape[:2], g.sqp, LANES))
    qp, dop = _bhsd(q, g.sqp), _bhsd(dout.astype(q.dtype), g.sqp)
    kp, vp = _bhsd(k, g.skp), _bhsd(v, g.skp)
    extras = _extras(g, bias, q_seg, kv_seg, seed)
    semantics = ("parallel", "parallel", "parallel", "arbitrary")
    q_span, kv_span = _spans(q_seg, kv_seg)
    q_spans = kv_spans = None
    if q_span is not None:
        q_spans = _block_spans(q_span[:, 0], q_span[:, 1], g.sqp, g.bq)
        kv_spans = _block_spans(kv_span[:, 0], kv_span[:, 1], g.skp, g.bk)

    # dK, dV: grid (B, KV heads, kv blocks, group * q blocks).
    def qrow(b: Any, kvh: Any, kb: Any, s: Any, *prefetched: Any) -> tuple[Any, Any, Any]:
        q_block = _clamp(_q_band(g, b, kb, _first(prefetched)), s % nqb, nqb)
        return b, kvh * group + s // nqb, q_block

    qs = pl.BlockSpec((None, None, g.bq, g.head_dim), lambda *i: (*qrow(*i), 0))
    rows = pl.BlockSpec((None, None, g.bq, LANES), lambda *i: (*qrow(*i), 0))
    kvs = pl.BlockSpec((None, None, g.bk, g.head_dim), lambda b, kvh, kb, s, *_: (b, kvh, kb, 0))
    dk, dv = _call(
        functools.partial(_dkdv_kernel, g=g),
        kv_spans,
        grid=(g.batch, g.kv_heads, nkb, group * nqb),
        in_specs=[
            qs,
            kvs,
            kvs,
            qs,
            rows,
            rows,
            *_extra_specs(g, lambda b, kvh, kb, s, *sp: (*qrow(b, kvh, kb, s, *sp), kb)),
        ],
        out_specs=[kvs, kvs],
        out_shape=[
            jax.ShapeDtypeStruct(kp.shape, k.dtype),
            jax.ShapeDtypeStruct(vp.shape, v.dtype),
        ],
        scratch_shapes=[
            pltpu.VMEM((g.bk, g.head_dim), jnp.float32),
            pltpu.VMEM((g.bk, g.head_dim), jnp.float32),
        ],
        compiler_params=_params(semantics),
        interpret=interpret,
        name="ejkfn_flash_bwd_dkdv_tpu",
    )(qp, kp, vp, dop, lse_in, delta, *extras)

    # dQ (and dbias): grid (B, H, q blocks, kv blocks).
    want_dbias = user_bias is not None

    def kv_block(b: Any, h: Any, i: Any, j: Any, *prefetched: Any) -> Any:
        return _clamp(_kv_band(g, b, i, _first(prefetched)), j, nkb)

    qspec = pl.BlockSpec((None, None, g.bq, g.head_dim), lambda b, h, i, j, *_: (b, h, i, 0))
    rowspec = pl.BlockSpec((None, None, g.bq, LANES), lambda b, h, i, j, *_: (b, h, i, 0))
    kvspec = pl.BlockSpec(
        (None, None, g.bk, g.head_dim),
        lambda b, h, i, j, *sp: (b, h // group, kv_block(b, h, i, j, *sp), 0),
    )
    out_specs = [qspec]
    out_shape = [jax.ShapeDtypeStruct(qp.shape, q.dtype)]
    if want_dbias:
        out_specs.append(
            pl.BlockSpec((None, None, g.bq, g.bk), lambda b, h, i, j, *_: (b, h, i, j))
        )
        out_shape.append(jax.ShapeDtypeStruct((g.batch, g.heads, g.sqp, g.skp), jnp.float32))
    res = _call(
        functools.partial(_dq_kernel, g=g, want_dbias=want_dbias),
        q_spans,
        grid=(g.batch, g.heads, nqb, nkb),
        in_specs=[
            qspec,
            kvspec,
            kvspec,
            qspec,
            rowspec,
            rowspec,
            *_extra_specs(g, lambda b, h, i, j, *sp: (b, h, i, kv_block(b, h, i, j, *sp))),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((g.bq, g.head_dim), jnp.float32)],
        compiler_params=_params(semantics),
        interpret=interpret,
        name="ejkfn_flash_bwd_dq_tpu",
    )(qp, kp, vp, dop, lse_in, delta, *extras)
    dq = jnp.swapaxes(res[0][:, :, : g.seq_q], 1, 2)
    dbias = None
    if want_dbias:
        full = res[1][:, :, : g.seq_q, : g.seq_k]
        axes = tuple(a for a in range(4) if user_bias.shape[a] == 1 and full.shape[a] != 1)
        dbias = jnp.sum(full, axis=axes, keepdims=True).astype(user_bias.dtype)
    return (
        dq,
        jnp.swapaxes(dk[:, :, : g.seq_k], 1, 2),
        jnp.swapaxes(dv[:, :, : g.seq_k], 1, 2),
        dbias,
    )


# ----------------------------------------------------------------------------------------------------
# Configurations.

_VMEM_BUDGET = 12 * 1024 * 1024  # under the default 16 MiB scoped VMEM, double buffering included


def _vmem_bytes(bq: int, bk: int, d: int, itemsize: int, bias: bool) -> int:
    blocks = 2 * (2 * bq * d + 2 * bk * d) * itemsize  # double-buffered q, do/out, k, v
    blocks += 2 * 2 * bq * LANES * 4  # lse, delta
    if bias:
        blocks += 2 * 2 * bq * bk * 4  # bias in, dbias out
    scratch = (bq + bk) * d * 4 * 2 + 2 * bq * LANES * 4
    return blocks + scratch + 3 * bq * bk * 4  # s, p, ds live in VMEM too


def _fits(shape: AttentionShape, bq: int, bk: int) -> bool:
    item = 4 if shape.dtype == "float32" else 2
    if bq > _round_up(shape.seq_q, SUBLANES) and bq != 128:
        return False
    if bk > _round_up(shape.seq_k, SUBLANES) and bk != 128:
        return False
    has_bias = shape.spec.has_bias or shape.spec.has_mask
    return _vmem_bytes(bq, bk, shape.head_dim, item, has_bias) <= _VMEM_BUDGET


def heuristic(shape: AttentionShape) -> tuple[FwdParams, BwdParams]:
    """Large blocks (the MXU is 128 or 256 wide), smaller when the head dim is large."""
    if shape.head_dim <= 128:
        fq, fk, bq, bk = 512, 512, 256, 256
    else:
        fq, fk, bq, bk = 256, 256, 128, 256
    return (
        FwdParams(q_blocksize=fq, kv_blocksize=fk, num_warps=1, num_stages=2),
        BwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=1, num_stages=2),
    )


def candidates(shape: AttentionShape) -> list[tuple[FwdParams, BwdParams]]:
    """Block sizes (multiples of 128) that fit VMEM and are not longer than the sequence needs."""
    heur_f, heur_b = heuristic(shape)
    sizes = (128, 256, 512, 1024)
    fwds = [(a, b) for a in sizes for b in sizes if _fits(shape, a, b)]
    bwds = [(a, b) for a in sizes[:3] for b in sizes[:3] if _fits(shape, a, b)]
    out = [(heur_f, heur_b)]
    for a, b in fwds:
        fp = FwdParams(q_blocksize=a, kv_blocksize=b, num_warps=1, num_stages=2)
        if (fp, heur_b) not in out:
            out.append((fp, heur_b))
    for a, b in bwds:
        bp = BwdParams(q_blocksize=a, kv_blocksize=b, num_warps=1, num_stages=2)
        if (heur_f, bp) not in out:
            out.append((heur_f, bp))
    return out


BACKEND = register_backend(
    AttentionBackend(
        platform="pallas",
        variant="tpu",
        devices=("tpu",),
        fwd=fwd,
        bwd=bwd,
        unsupported=frozenset(),
        heuristic=heuristic,
        candidates=candidates,
        available=lambda: jax.default_backend() in ("tpu", "cpu"),  # cpu: the interpreter
    )
)
