"""Flash attention in Pallas, lowered through Triton on NVIDIA GPUs (variant ``"triton"``).

Forward: one program per (q block, batch * head) runs an online softmax over the key blocks that the
causal and window limits leave visible, and writes the output and the log-sum-exp.
Backward (FlashAttention 2, no atomics): ``delta = rowsum(dout * out)`` in XLA, then a dK/dV kernel
(one program per (kv block, batch * kv head); it loops over the query heads of its GQA group and the
visible q blocks, so the group sum happens in registers) and a dQ kernel (one program per (q block,
batch * head), looping over kv blocks; it also writes ``dbias = ds`` when there is a bias).

Shapes are padded outside the kernels: sequences to multiples of the block sizes (the kernels mask by
the true lengths) and the head dim to a power of two >= 16 (zero columns change no dot product).
Each key-block loop is split into blocks that need the element mask and blocks fully visible, so the
interior of a causal or windowed band pays nothing for masking.

On a CPU (tests) the kernels run in Pallas's interpreter; elsewhere they need a GPU with Triton.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .._platform import on_cuda
from .._registry import BwdParams, FwdParams
from ._backend import (
    FLOAT32_FWD_CANDIDATES,
    MIRRORED,
    MIRRORED_WIDE,
    SPLIT_DKDV,
    AttentionBackend,
    AttentionShape,
    banded_tile,
    dq_launch,
    forward_band,
    register_backend,
    segment_spans,
    shrink_to_fit,
)
from ._dropout import keep_mask, keep_scale, keep_tile
from ._spec import AttentionSpec

__all__ = ["bwd", "candidates", "fwd", "heuristic"]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_MIN_BLOCK = 16  # tensor-core dots need at least 16 rows/cols
# Bytes of shared memory we allow one program on Hopper (227 KiB at most): _smem_bytes came within
# 1 KiB under what the compiler asked where it failed (257 KiB, a float32 bias at D = 128).
_SMEM_LIMIT = 212 * 1024


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def padded_head_dim(d: int) -> int:
    """The head dim the kernels compute with: a power of two >= 16 (Triton tensors need it)."""
    return max(_MIN_BLOCK, _next_pow2(d))


def _resolve_interpret(interpret: bool | None) -> bool:
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _block(requested: int, seq: int) -> int:
    if requested < 1 or requested & (requested - 1):
        raise ValueError(f"block size {requested=} must be a power of two")
    return max(_MIN_BLOCK, min(requested, _next_pow2(seq)))


def _cdiv(a: Any, b: int) -> Any:
    return lax.div(a + (b - 1), b)


# ----------------------------------------------------------------------------------------------------
# Static description of one launch and the blockwise masks shared by the three kernels.


@dataclasses.dataclass(frozen=True)
class _Geom:
    """Everything static a kernel needs (true and padded sizes, features)."""

    spec: AttentionSpec
    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    dpad: int
    bq: int
    bk: int
    bias_bh: tuple[bool, bool]  # the bias has a (batch, heads) dim, else it broadcasts there
    mask_bh: tuple[bool, bool]
    f32: bool  # inputs are float32: keep full precision in the dots
    ptx_exp2: bool = False  # compiled for an NVIDIA GPU: exp2 as PTX's ex2.approx (_exp2)

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def sqp(self) -> int:
        return pl.cdiv(self.seq_q, self.bq) * self.bq

    @property
    def skp(self) -> int:
        return pl.cdiv(self.seq_k, self.bk) * self.bk

    @property
    def offset(self) -> int:
        """Position of query row 0 (bottom-right alignment)."""
        return self.seq_k - self.seq_q

    @property
    def elementwise(self) -> bool:
        """Visibility depends on data (mask or segment ids), so every block is masked."""
        return self.spec.has_mask or self.spec.has_segments

    @property
    def ragged_k(self) -> bool:
        return self.seq_k % self.bk != 0

    def fwd_tile(self, band: int, pid: Any) -> tuple[Any, Any]:
        """(q block, batch * head) of program ``pid`` of the forward's grid, in bands of ``band``
        pairs (``_backend.forward_band``)."""
        blocks = self.sqp // self.bq
        block, pair = banded_tile(pid, blocks, band)
        # Causal: the last q blocks see the most keys; they start first so the tail is short.
        return (blocks - 1 - block if self.spec.causal else block), pair


def _on_tiles(specs: list[pl.BlockSpec], tiles: Any) -> list[pl.BlockSpec]:
    """``specs`` written for a (block, pair) grid, indexed by the one-dimensional grid's tile."""
    return [
        pl.BlockSpec(s.block_shape, lambda pid, index=s.index_map: index(*tiles(pid)))
        for s in specs
    ]


_on_nvidia_gpu = on_cuda  # where PTX assembly compiles


def _exp2(g: _Geom, x: jax.Array) -> jax.Array:
    """``2 ** x`` of float32 scores. ``jnp.exp2`` lowers to libdevice's ``exp2f``; PTX's
    ``ex2.approx.ftz`` (what Triton's own ``tl.exp2`` becomes) ran the forward 1.05-1.12x and
    forward+backward 1.01-1.08x faster on an H200 (benchmarks/NOTES.md, twenty-third round). Its
    relative error is about 2**-22, and results below 2**-126 flush to 0: probabilities that small
    round away against the row sum anyway."""
    if not g.ptx_exp2 or x.dtype != jnp.float32:
        return jnp.exp2(x)
    [y] = pltriton.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;",
        args=[x],
        constraints="=f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
    )
    return y


def _exp2_affine(g: _Geom, x: jax.Array, scale: float, shift: jax.Array) -> jax.Array:
    """``2 ** (x * scale - shift)``, ``shift`` broadcastable to ``x``. XLA compiles Pallas-Triton
    kernels without fusing a multiply and an add into one instruction: under ``ncu`` its dQ kernel
    ran an FMUL and an FADD a score where Triton's runs one FFMA (benchmarks/NOTES.md,
    twenty-eighth round). On the PTX path they are one ``fma`` beside the ``ex2``."""
    if not g.ptx_exp2 or x.dtype != jnp.float32:
        return _exp2(g, x * scale - shift)
    [bits] = struct.unpack("<I", struct.pack("<f", scale))
    [y] = pltriton.elementwise_inline_asm(
        f"{{ .reg .f32 t; fma.rn.f32 t, $1, 0f{bits:08X}, $2; ex2.approx.ftz.f32 $0, t; }}",
        args=[x, jnp.broadcast_to(-shift, x.shape)],  # negated before the broadcast: once a row
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
    )
    return y


def _tanh(g: _Geom, x: jax.Array) -> jax.Array:
    """``tanh`` as ``1 - 2 / (2 ** (2x log2 e) + 1)``, on :func:`_exp2`, as the Triton kernels have
    it (saturating to +-1 where the power overflows or underflows). ``jnp.tanh`` lowers to
    libdevice's ``tanhf``: with it the soft-capped forward+backward ran 0.86-0.90x Triton's on an
    H200 (``benchmarks/features_gpu.py``; NOTES.md, forty-seventh round)."""
    return 1.0 - 2.0 / (_exp2(g, x * (2.0 * LOG2E)) + 1.0)


def _dot(g: _Geom, a: jax.Array, b: jax.Array, *, ta: bool = False, tb: bool = False) -> jax.Array:
    precision = lax.Precision.HIGHEST if g.f32 else None
    return pltriton.dot(a, b, trans_a=ta, trans_b=tb, precision=precision)


def _kv_range(g: _Geom, q0: Any, bq: int, bk: int) -> tuple[Any, Any, Any, Any]:
    """Key blocks ``[lo, hi)`` visible to rows ``[q0, q0 + bq)``; ``[full_lo, full_hi)`` needs no mask."""
    spec, off, nkb = g.spec, g.offset, g.skp // bk
    p0, p1 = q0 + off, q0 + (bq - 1) + off
    last = jnp.int32(g.seq_k - 1)
    if spec.causal:
        last = jnp.minimum(last, p1)
    if spec.window is not None:
        last = jnp.minimum(last, p1 + spec.window[1])
    hi = jnp.minimum(_cdiv(jnp.maximum(last + 1, 0), bk), nkb)
    lo = jnp.int32(0)
    if spec.window is not None:
        lo = lax.div(jnp.maximum(p0 - spec.window[0], 0), bk)
    lo = jnp.minimum(lo, hi)
    if g.elementwise:
        return lo, hi, hi, hi
    full_last = jnp.int32(g.seq_k - 1)
    if spec.causal:
        full_last = jnp.minimum(full_last, p0)
    if spec.window is not None:
        full_last = jnp.minimum(full_last, p0 + spec.window[1])
    full_hi = lax.div(jnp.maximum(full_last + 1, 0), bk)
    full_lo = lo
    if spec.window is not None:
        full_lo = _cdiv(jnp.maximum(p1 - spec.window[0], 0), bk)
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    return lo, full_lo, full_hi, hi


def _q_range(g: _Geom, k0: Any, bq: int, bk: int) -> tuple[Any, Any, Any, Any]:
    """Query blocks ``[lo, hi)`` that see keys ``[k0, k0 + bk)``; ``[full_lo, full_hi)`` needs no mask."""
    spec, off, nqb = g.spec, g.offset, g.sqp // bq
    k1 = k0 + (bk - 1)
    first = jnp.int32(0)
    last = jnp.int32(g.seq_q - 1)
    if spec.causal:
        first = jnp.maximum(first, k0 - off)
    if spec.window is not None:
        left, right = spec.window
        first = jnp.maximum(first, k0 - right - off)
        last = jnp.minimum(last, k1 + left - off)
    hi = jnp.minimum(_cdiv(jnp.maximum(last + 1, 0), bq), nqb)
    lo = jnp.minimum(lax.div(first, bq), hi)
    if g.elementwise:
        return lo, hi, hi, hi
    full_first = jnp.int32(0)
    full_end = jnp.int32(nqb)
    if spec.causal:
        full_first = jnp.maximum(full_first, k1 - off)
    if spec.window is not None:
        left, right = spec.window
        full_first = jnp.maximum(full_first, k1 - right - off)
        full_end = lax.div(jnp.maximum(k0 + left - off + 1, 0), bq)
    full_lo = jnp.clip(_cdiv(full_first, bq), lo, hi)
    full_hi = jnp.clip(full_end, full_lo, hi)
    if g.ragged_k:  # the last key block holds padding columns: mask all of it
        full_hi = jnp.where(k1 >= g.seq_k, full_lo, full_hi)
    return lo, full_lo, full_hi, hi


def _needs_left(g: _Geom, over_q: bool) -> bool:
    """Whether masked blocks can precede the unmasked interior (else that loop is not emitted)."""
    return g.spec.window is not None or (over_q and g.spec.causal)


def _needs_right(g: _Geom, over_q: bool) -> bool:
    if over_q:
        return g.spec.window is not None or g.ragged_k
    return g.spec.causal or g.spec.window is not None or g.ragged_k


def _visible(
    g: _Geom, rows: Any, cols: Any, qseg: Any = None, kseg: Any = None, mask: Any = None
) -> jax.Array:
    """Bool, the spec's visibility rules plus the true key length, broadcast from query and key
    indices (and segment ids) shaped ``[n, 1]`` and ``[1, m]`` or the reverse."""
    pos = rows + g.offset
    ok = cols < g.seq_k
    if g.spec.causal:
        ok &= cols <= pos
    if g.spec.window is not None:
        left, right = g.spec.window
        ok &= (cols >= pos - left) & (cols <= pos + right)
    if qseg is not None:
        ok &= qseg == kseg
    if mask is not None:
        ok &= mask != 0
    return ok


def _logits(g: _Geom, q: jax.Array, k: jax.Array, bias: Any) -> tuple[jax.Array, jax.Array | None]:
    """Scaled (soft-capped, biased) logits in base 2, and tanh of the capped part for the backward."""
    qk = _dot(g, q, k, tb=True)
    spec = g.spec
    if spec.soft_cap is None and bias is None:
        return qk * (spec.scale * LOG2E), None
    t = None
    if spec.soft_cap is not None:
        t = _tanh(g, qk * (spec.scale / spec.soft_cap))
        s = t * spec.soft_cap
    else:
        s = qk * spec.scale
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    return s * LOG2E, t


def _probs(
    g: _Geom, a: jax.Array, b: jax.Array, bias: Any, lse: jax.Array, visible: Any
) -> tuple[jax.Array, jax.Array | None]:
    """The backward's probabilities ``2 ** (logits(a b^T) - lse)``, 0 where ``visible`` is False
    (None: all visible), and ``_logits``'s tanh. ``lse`` is in base 2, broadcastable to the tile."""
    if g.spec.soft_cap is None and bias is None:
        p = _exp2_affine(g, _dot(g, a, b, tb=True), g.spec.scale * LOG2E, lse)
        return (p if visible is None else jnp.where(visible, p, 0.0)), None
    s, tanh = _logits(g, a, b, bias)
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    return _exp2(g, s - lse), tanh


def _keep(g: _Geom, seed: Any, b: Any, h: Any, rows: Any, cols: Any) -> jax.Array:
    """Dropout's keep mask, broadcast from index arrays shaped as for ``_visible``."""
    return keep_mask(seed, b, h, rows, cols, g.heads, g.seq_q, g.spec.dropout_prob)


def _keep_tile(g: _Geom, seed: Any, b: Any, h: Any, rows: Any, k0: Any) -> jax.Array:
    """Dropout's keep mask of the ``[rows, k0 + arange(g.bk)]`` tile, one hash a pair of keys."""
    return keep_tile(seed, b, h, rows, k0, g.bk, g.heads, g.seq_q, g.spec.dropout_prob)


def _segment_blocks(bounds: Any, span: Any, block: Any) -> tuple[Any, Any, Any, Any]:
    """``bounds`` (every block masked) cut to the blocks of ``block`` rows on the other side that
    the segments of this tile's rows reach; ``span`` is the ref of their ``[2, n]`` (first, end)
    rows (read a row at a time: the Triton lowering cannot slice a loaded array)."""
    lo, _, _, hi = bounds
    hi = jnp.minimum(hi, _cdiv(jnp.max(span[1]), block))
    lo = jnp.minimum(jnp.maximum(lo, lax.div(jnp.min(span[0]), block)), hi)
    return lo, hi, hi, hi


def _three_loops(g: _Geom, bounds: Any, body: Any, carry: Any, over_q: bool) -> Any:
    """Run ``body(index, carry, masked)`` over the masked edges and the unmasked interior."""
    lo, full_lo, full_hi, hi = bounds
    if g.elementwise:
        return lax.fori_loop(lo, hi, functools.partial(body, masked=True), carry)
    if _needs_left(g, over_q):
        carry = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
    if _needs_right(g, over_q):
        carry = lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), carry)
    return carry


class _Refs:
    """Named access to a kernel's positional refs, in the order ``_operands`` builds them."""

    def __init__(
        self, g: _Geom, refs: tuple[Any, ...], names: tuple[str, ...], spans: bool = False
    ):
        it = iter(refs)
        self.q, self.k, self.v = next(it), next(it), next(it)
        for name in names:
            setattr(self, name, next(it))
        self.bias = next(it) if g.spec.has_bias else None
        self.mask = next(it) if g.spec.has_mask else None
        self.qseg, self.kseg = (next(it), next(it)) if g.spec.has_segments else (None, None)
        # (first, end) on the other side of each row's segment (``_backend.segment_spans``), where
        # the kernels skip by them (``spans``; the TPU kernels share these refs without them)
        with_spans = spans and g.spec.has_segments
        self.qspan, self.kspan = (next(it), next(it)) if with_spans else (None, None)
        self.seed = next(it) if g.spec.dropout_prob > 0 else None
        self.outs = tuple(it)


def _key_block_bias(g: _Geom, r: _Refs, k0: Any) -> jax.Array | None:
    """The bias tile of a q block against the key block at ``k0`` (forward and dQ kernels)."""
    return r.bias[:, pl.ds(k0, g.bk)] if r.bias is not None else None


def _key_block_visible(
    g: _Geom, r: _Refs, k0: Any, rows: Any, cols: Any, qseg: Any, masked: bool
) -> jax.Array | None:
    """``_visible`` of a q block against the key block at ``k0``; None when not ``masked``."""
    if not masked:
        return None
    kseg = r.kseg[pl.ds(k0, g.bk)] if r.kseg is not None else None
    mask = r.mask[:, pl.ds(k0, g.bk)] if r.mask is not None else None
    if kseg is not None:
        qseg, kseg = qseg[:, None], kseg[None, :]
    return _visible(g, rows[:, None], cols[None, :], qseg, kseg, mask)


def _key_block_logits(
    g: _Geom, r: _Refs, q: Any, k: Any, k0: Any, rows: Any, cols: Any, qseg: Any, masked: bool
) -> tuple[jax.Array, jax.Array | None]:
    """``_logits`` of a q block against the key block at ``k0``, ``-inf`` where not visible when
    ``masked``."""
    s, tanh = _logits(g, q, k, _key_block_bias(g, r, k0))
    visible = _key_block_visible(g, r, k0, rows, cols, qseg, masked)
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    return s, tanh


# ----------------------------------------------------------------------------------------------------
# Kernels.


def _fwd_kernel(*refs: Any, g: _Geom, tiles: Any) -> None:
    r = _Refs(g, refs, (), spans=True)
    o_ref, lse_ref = r.outs
    bq, bk = g.bq, g.bk
    qi, bh = tiles(pl.program_id(0))
    b, h = bh // g.heads, bh % g.heads
    q0 = qi * bq
    rows = q0 + jnp.arange(bq, dtype=jnp.int32)
    q = r.q[...]
    qseg = r.qseg[...] if r.qseg is not None else None
    seed = r.seed[0] if r.seed is not None else None
    inv_keep = keep_scale(g.spec.dropout_prob)
    # No bias or cap and a positive scale: the row max of the raw products, scaled once, is the
    # max of the logits, and the scale folds into the exponent's fused multiply-add.
    raw_max = g.spec.soft_cap is None and r.bias is None and g.spec.scale > 0
    scale2 = g.spec.scale * LOG2E
    # The row sums in parts, as the Triton forward's (``_triton_kernels._row_sum_parts``): each
    # thread adds its own columns of every 8 and the parts cross threads once, after the loop. In
    # XLA's build that ran 1.018-1.029x the plain sums at 4x4096x16x128 and 1.017-1.026x at
    # 8x2048x32x64 causal, but 0.948-0.957x there without a mask (NOTES.md, eighty-fourth round).
    parts = 8 if g.spec.causal or g.dpad > 64 else 1

    def body(kb: Any, carry: Any, masked: bool) -> Any:
        acc, m, den = carry
        k0 = pl.multiple_of(kb * bk, bk)
        cols = k0 + jnp.arange(bk, dtype=jnp.int32)
        k = r.k[pl.ds(k0, bk), :]
        v = r.v[pl.ds(k0, bk), :]
        if raw_max and not masked:  # every key visible: every row's max is finite
            qk = _dot(g, q, k, tb=True)
            m_new = jnp.maximum(m, jnp.max(qk, axis=1) * scale2)
            alpha = _exp2(g, m - m_new)
            if g.dpad <= 64:
                p = _exp2_affine(g, qk, scale2, m_new[:, None])
            else:  # at D = 128 the fused form ran this forward 0.97-1.00x (NOTES.md, 28th round)
                p = _exp2(g, qk * scale2 - m_new[:, None])
        else:
            s, _ = _key_block_logits(g, r, q, k, k0, rows, cols, qseg, masked)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
            alpha = _exp2(g, m - m_use)
            p = _exp2(g, s - m_use[:, None])
        if parts > 1:
            den = den * alpha[:, None] + p.reshape(bq, bk // parts, parts).sum(axis=1)
        else:
            den = den * alpha + jnp.sum(p, axis=1)
        if seed is not None:
            p = jnp.where(_keep_tile(g, seed, b, h, rows, k0), p * inv_keep, 0.0)
        acc = acc * alpha[:, None] + _dot(g, p.astype(v.dtype), v)
        return acc, m_new, den

    carry = (
        jnp.zeros((bq, g.dpad), jnp.float32),
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq, parts) if parts > 1 else (bq,), jnp.float32),
    )
    bounds = _kv_range(g, q0, bq, bk)
    if r.qspan is not None:
        bounds = _segment_blocks(bounds, r.qspan, bk)
    acc, m, den = _three_loops(g, bounds, body, carry, over_q=False)
    if parts > 1:
        den = jnp.sum(den, axis=1)
    empty = den == 0.0
    den = jnp.where(empty, 1.0, den)
    out = acc / den[:, None]
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m * LN2 + jnp.log(den))


def _dkdv_kernel(*refs: Any, g: _Geom, parts: int) -> None:
    """dK and dV of a key block, summed over its GQA group's query heads. With ``parts = 2`` two
    neighbouring programs share the block, the first writing dV and the second dK into one stacked
    output, each recomputing the scores with one float32 accumulator."""
    r = _Refs(g, refs, ("do", "lse", "delta"), spans=True)
    bq, bk = g.bq, g.bk
    kb = pl.program_id(0) // parts if parts > 1 else pl.program_id(0)
    bkv = pl.program_id(1)
    b, kvh = bkv // g.kv_heads, bkv % g.kv_heads
    k0 = kb * bk
    cols = (k0 + jnp.arange(bk, dtype=jnp.int32))[:, None]
    if parts == 1:  # (the split programs load theirs in their own branch)
        k, v = r.k[...], r.v[...]
    kseg = r.kseg[...][:, None] if r.kseg is not None else None
    seed = r.seed[0] if r.seed is not None else None
    inv_keep = keep_scale(g.spec.dropout_prob)
    bounds = _q_range(g, k0, bq, bk)
    if r.kspan is not None:
        bounds = _segment_blocks(bounds, r.kspan, bq)

    def accumulate(k: Any, v: Any, want_dk: bool, want_dv: bool) -> tuple[Any, Any]:
        """(dk, dv) in float32, None for the one not wanted (``v`` is read only for dk)."""

        def head(t: Any, carry: Any) -> Any:
            h = kvh * g.group + t

            # On [keys, queries] tiles: p^T and ds^T are then the products' left operands as they
            # stand, where [queries, keys] tiles needed both turned around through shared memory.
            def body(qb: Any, carry: Any, masked: bool) -> Any:
                dk, dv = carry
                q0 = pl.multiple_of(qb * bq, bq)
                rows = (q0 + jnp.arange(bq, dtype=jnp.int32))[None, :]
                q = r.q[pl.ds(q0, bq), t, :]
                do = r.do[pl.ds(q0, bq), t, :]
                lse = r.lse[t, pl.ds(q0, bq)]
                delta = r.delta[t, pl.ds(q0, bq)] if want_dk else None
                bias = None
                if r.bias is not None:
                    bias = r.bias[t, pl.ds(q0, bq), :] if g.bias_bh[1] else r.bias[pl.ds(q0, bq), :]
                    bias = bias.T
                visible = None
                if masked:
                    qseg = r.qseg[pl.ds(q0, bq)][None, :] if r.qseg is not None else None
                    mask = None
                    if r.mask is not None:
                        mask = (
                            r.mask[t, pl.ds(q0, bq), :]
                            if g.mask_bh[1]
                            else r.mask[pl.ds(q0, bq), :]
                        )
                        mask = mask.T
                    visible = _visible(g, rows, cols, qseg, kseg, mask)
                p, tanh = _probs(g, k, q, bias, lse[None, :], visible)
                dp = _dot(g, v, do, tb=True) if want_dk else None
                pd = p
                if seed is not None:
                    keep = _keep(g, seed, b, h, rows, cols)
                    pd = jnp.where(keep, p * inv_keep, 0.0) if want_dv else None
                    dp = jnp.where(keep, dp * inv_keep, 0.0) if want_dk else None
                if want_dv:
                    dv = dv + _dot(g, pd.astype(do.dtype), do)
                if want_dk:
                    ds = p * (dp - delta[None, :])
                    if tanh is not None:
                        ds = ds * (1.0 - tanh * tanh)
                    dk = dk + _dot(g, ds.astype(q.dtype), q)
                return dk, dv

            return _three_loops(g, bounds, body, carry, over_q=True)

        zeros = jnp.zeros((bk, g.dpad), jnp.float32)
        start = (zeros if want_dk else None, zeros if want_dv else None)
        return lax.fori_loop(0, g.group, head, start)

    if parts == 1:
        dk_ref, dv_ref = r.outs
        dk, dv = accumulate(k, v, True, True)
        dk_ref[...] = (dk * g.spec.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv.astype(dv_ref.dtype)
        return
    (out_ref,) = r.outs
    out_ref[...] = lax.cond(
        pl.program_id(0) % 2 == 0,
        lambda: accumulate(r.k[...], None, False, True)[1],
        lambda: accumulate(r.k[...], r.v[...], True, False)[0] * g.spec.scale,
    ).astype(out_ref.dtype)


def _dq_kernel(*refs: Any, g: _Geom) -> None:
    """dQ of a q block, and its rows' ``delta = rowsum(dout * out)``, stored for the dK/dV kernel
    (read here beside dout, it needs no pass over out and dout of its own)."""
    r = _Refs(g, refs, ("do", "lse", "out"), spans=True)
    dq_ref, delta_ref = r.outs[:2]
    dbias_ref = r.outs[2] if g.spec.has_bias else None
    bq, bk = g.bq, g.bk
    qi, bh = pl.program_id(0), pl.program_id(1)
    b, h = bh // g.heads, bh % g.heads
    q0 = qi * bq
    rows = q0 + jnp.arange(bq, dtype=jnp.int32)
    q = r.q[...]
    do = r.do[...]
    lse = r.lse[...]
    delta = jnp.sum(r.out[...].astype(jnp.float32) * do.astype(jnp.float32), axis=1)
    delta_ref[...] = delta
    qseg = r.qseg[...] if r.qseg is not None else None
    seed = r.seed[0] if r.seed is not None else None
    inv_keep = keep_scale(g.spec.dropout_prob)

    def body(kb: Any, dq: Any, masked: bool) -> Any:
        k0 = pl.multiple_of(kb * bk, bk)
        cols = k0 + jnp.arange(bk, dtype=jnp.int32)
        k = r.k[pl.ds(k0, bk), :]
        v = r.v[pl.ds(k0, bk), :]
        visible = _key_block_visible(g, r, k0, rows, cols, qseg, masked)
        p, tanh = _probs(g, q, k, _key_block_bias(g, r, k0), lse[:, None], visible)
        dp = _dot(g, do, v, tb=True)
        if seed is not None:
            dp = jnp.where(_keep_tile(g, seed, b, h, rows, k0), dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        if dbias_ref is not None:
            dbias_ref[:, pl.ds(k0, bk)] = ds
        if tanh is not None:
            ds = ds * (1.0 - tanh * tanh)
        return dq + _dot(g, ds.astype(k.dtype), k)

    bounds = _kv_range(g, q0, bq, bk)
    if r.qspan is not None:
        bounds = _segment_blocks(bounds, r.qspan, bk)
    lo, _, _, hi = bounds
    dq = _three_loops(g, bounds, body, jnp.zeros((bq, g.dpad), jnp.float32), over_q=False)
    dq_ref[...] = (dq * g.spec.scale).astype(dq_ref.dtype)
    if dbias_ref is not None:  # key blocks the loops skipped get a zero gradient

        def zero(kb: Any, carry: Any) -> Any:
            dbias_ref[:, pl.ds(pl.multiple_of(kb * bk, bk), bk)] = jnp.zeros((bq, bk), jnp.float32)
            return carry

        lax.fori_loop(0, lo, zero, 0)
        lax.fori_loop(hi, g.skp // bk, zero, 0)


# ----------------------------------------------------------------------------------------------------
# Wrappers: padding, block specs, launches.


def _geom(
    q: Any, k: Any, bias: Any, mask: Any, spec: AttentionSpec, bq: int, bk: int, interpret: bool
) -> _Geom:
    batch, seq_q, heads, head_dim = q.shape
    _, seq_k, kv_heads, _ = k.shape
    if heads % kv_heads:
        raise ValueError(f"{heads=} must be a multiple of {kv_heads=}")

    def bh(x: Any) -> tuple[bool, bool]:
        return (x is not None and x.shape[0] != 1, x is not None and x.shape[1] != 1)

    return _Geom(
        spec=spec,
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        seq_q=seq_q,
        seq_k=seq_k,
        head_dim=head_dim,
        dpad=padded_head_dim(head_dim),
        bq=_block(bq, seq_q),
        bk=_block(bk, seq_k),
        bias_bh=bh(bias),
        mask_bh=bh(mask),
        f32=jnp.dtype(q.dtype) == jnp.float32,
        ptx_exp2=not interpret and _on_nvidia_gpu(),
    )


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


def _pad(x: Any, axis: int, size: int, value: Any = 0) -> Any:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _pad_qkv(g: _Geom, x: Any, seq: int) -> Any:
    return _pad(_pad(x, 1, seq), 3, g.dpad)


def _pad_pair(g: _Geom, x: Any, dtype: Any = None) -> Any:
    """Bias or mask ``[B|1, H|1, Sq, Sk]`` padded to the block multiples."""
    x = jnp.broadcast_to(x, (*x.shape[:2], g.seq_q, g.seq_k))
    if dtype is not None:
        x = x.astype(dtype)
    return _pad(_pad(x, 2, g.sqp), 3, g.skp)


def _extras(g: _Geom, bias: Any, mask: Any, q_seg: Any, kv_seg: Any, seed: Any) -> list[Any]:
    ops: list[Any] = []
    if bias is not None:
        ops.append(_pad_pair(g, bias))
    if mask is not None:
        ops.append(_pad_pair(g, mask, jnp.int8))
    if q_seg is not None:
        q_side, kv_side = segment_spans(q_seg, kv_seg)
        ops.append(_pad(q_side[:, 0], 1, g.sqp))
        ops.append(_pad(kv_side[:, 0], 1, g.skp))
        # padded rows reach nothing: first past the other side's end, end 0
        for side, seq, other in ((q_side, g.sqp, g.skp), (kv_side, g.skp, g.sqp)):
            first, end = _pad(side[:, 1], 1, seq, other), _pad(side[:, 2], 1, seq, 0)
            ops.append(jnp.stack([first, end], axis=1))
    if seed is not None:
        ops.append(jnp.reshape(jnp.asarray(seed).astype(jnp.uint32), (1,)))
    return ops


def _bh(g: _Geom, j: Any) -> tuple[Any, Any]:
    return j // g.heads, j % g.heads


def _pair_index(dims: tuple[bool, bool], b: Any, h: Any) -> tuple[Any, Any]:
    return (b if dims[0] else 0), (h if dims[1] else 0)


def _extra_specs_rows(g: _Geom, rows: int, row_block: Any) -> list[pl.BlockSpec]:
    """Specs for bias/mask/segments/seed in the kernels with grid (q block, batch * head)."""
    specs: list[pl.BlockSpec] = []
    for present, dims in ((g.spec.has_bias, g.bias_bh), (g.spec.has_mask, g.mask_bh)):
        if present:
            specs.append(
                pl.BlockSpec(
                    (None, None, rows, g.skp),
                    lambda i, j, dims=dims: (*_pair_index(dims, *_bh(g, j)), row_block(i), 0),
                )
            )
    if g.spec.has_segments:
        specs.append(pl.BlockSpec((None, rows), lambda i, j: (_bh(g, j)[0], row_block(i))))
        specs.append(pl.BlockSpec((None, g.skp), lambda i, j: (_bh(g, j)[0], 0)))
        specs.append(pl.BlockSpec((None, 2, rows), lambda i, j: (_bh(g, j)[0], 0, row_block(i))))
        specs.append(pl.BlockSpec((None, 2, g.skp), lambda i, j: (_bh(g, j)[0], 0, 0)))
    if g.spec.dropout_prob > 0:
        specs.append(pl.BlockSpec((1,), lambda i, j: (0,)))
    return specs


def _compiler_params(params: Any) -> Any:
    return pltriton.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages)


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
    params = params or FwdParams()
    _check(spec, bias, mask, q_seg, seed)
    interpret = _resolve_interpret(interpret)
    g = _geom(q, k, bias, mask, spec, params.q_blocksize, params.kv_blocksize, interpret)
    qp = _pad_qkv(g, q, g.sqp)
    kp, vp = _pad_qkv(g, k, g.skp), _pad_qkv(g, v, g.skp)
    band = forward_band(AttentionShape.of(q, k, spec), g.sqp // g.bq)
    tiles = functools.partial(g.fwd_tile, band)
    qspec = pl.BlockSpec(
        (None, g.bq, None, g.dpad), lambda i, j: (_bh(g, j)[0], i, _bh(g, j)[1], 0)
    )
    kvspec = pl.BlockSpec(
        (None, g.skp, None, g.dpad),
        lambda i, j: (_bh(g, j)[0], 0, _bh(g, j)[1] // g.group, 0),
    )
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, g=g, tiles=tiles),
        grid=(g.sqp // g.bq * g.batch * g.heads,),
        in_specs=_on_tiles(
            [qspec, kvspec, kvspec, *_extra_specs_rows(g, g.bq, lambda i: i)], tiles
        ),
        out_specs=_on_tiles(
            [qspec, pl.BlockSpec((None, None, g.bq), lambda i, j: (*_bh(g, j), i))], tiles
        ),
        out_shape=[
            jax.ShapeDtypeStruct(qp.shape, q.dtype),
            jax.ShapeDtypeStruct((g.batch, g.heads, g.sqp), jnp.float32),
        ],
        compiler_params=_compiler_params(params),
        interpret=interpret,
        name="ejkfn_flash_fwd",
    )(qp, kp, vp, *_extras(g, bias, mask, q_seg, kv_seg, seed))
    return out[:, : g.seq_q, :, : g.head_dim], lse[:, :, : g.seq_q]


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
    """Backward pass: ``(dq, dk, dv, dbias)``; dbias is shaped like ``bias`` (None without one).
    ``params.variant="mirrored"`` gives the dQ kernel the dK/dV kernel's blocks turned around
    (:func:`._backend.dq_launch`, which also says what the other variants ask); ``"split_dkdv"``
    runs dV and dK in programs of their own (:func:`_dkdv_kernel`)."""
    params = params or BwdParams()
    _check(spec, bias, mask, q_seg, seed)
    interpret = _resolve_interpret(interpret)
    g = _geom(q, k, bias, mask, spec, params.q_blocksize, params.kv_blocksize, interpret)
    dq_run = dq_launch(params)
    gq = _geom(q, k, bias, mask, spec, dq_run.rows, dq_run.cols, interpret)
    # Rows that see no key have lse = -inf; +inf makes their probabilities exactly 0 in the kernels.
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2E).astype(jnp.float32)
    cp = _compiler_params(params)
    group = g.group

    def padded(geom: _Geom, last: Any) -> list[Any]:
        """The operands padded to ``geom``'s blocks (the two kernels' pads are one under jit when
        their blocks pad to the same sizes), then ``last`` (out for dQ, delta for dK/dV)."""
        sqp, skp = geom.sqp, geom.skp
        return [
            _pad_qkv(geom, q, sqp),
            _pad_qkv(geom, k, skp),
            _pad_qkv(geom, v, skp),
            _pad_qkv(geom, dout.astype(q.dtype), sqp),
            _pad(lse2, 2, sqp, jnp.inf),
            last,
            *_extras(geom, bias, mask, q_seg, kv_seg, seed),
        ]

    # dQ (and dbias): grid (q block, batch * head).
    qspec = pl.BlockSpec(
        (None, gq.bq, None, gq.dpad), lambda i, j: (_bh(gq, j)[0], i, _bh(gq, j)[1], 0)
    )
    kvspec = pl.BlockSpec(
        (None, gq.skp, None, gq.dpad),
        lambda i, j: (_bh(gq, j)[0], 0, _bh(gq, j)[1] // group, 0),
    )
    rowspec = pl.BlockSpec((None, None, gq.bq), lambda i, j: (*_bh(gq, j), i))
    out_specs = [qspec, rowspec]
    out_shape = [
        jax.ShapeDtypeStruct((gq.batch, gq.sqp, gq.heads, gq.dpad), q.dtype),
        jax.ShapeDtypeStruct((gq.batch, gq.heads, gq.sqp), jnp.float32),
    ]
    if spec.has_bias:
        out_specs.append(
            pl.BlockSpec((None, None, gq.bq, gq.skp), lambda i, j: (*_bh(gq, j), i, 0))
        )
        out_shape.append(jax.ShapeDtypeStruct((gq.batch, gq.heads, gq.sqp, gq.skp), jnp.float32))
    res = pl.pallas_call(
        functools.partial(_dq_kernel, g=gq),
        grid=(gq.sqp // gq.bq, gq.batch * gq.heads),
        in_specs=[
            qspec,
            kvspec,
            kvspec,
            qspec,
            rowspec,
            qspec,
            *_extra_specs_rows(gq, gq.bq, lambda i: i),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=dataclasses.replace(
            cp, num_warps=dq_run.num_warps, num_stages=dq_run.num_stages
        ),
        interpret=interpret,
        name="ejkfn_flash_bwd_dq",
    )(*padded(gq, _pad_qkv(gq, out.astype(q.dtype), gq.sqp)))
    delta = _pad(res[1][:, :, : g.seq_q], 2, g.sqp)  # to the dK/dV kernel's padding

    # dK, dV: grid (kv block [and part], batch * kv head); each program sums over its group's
    # query heads. With split_dkdv program 2i writes dV of key block i and 2i + 1 its dK, both into
    # one output stacked [dV, dK].
    parts = 2 if params.variant == SPLIT_DKDV else 1

    def bkvh(j: Any) -> tuple[Any, Any]:
        return j // g.kv_heads, j % g.kv_heads

    def kvb(i: Any) -> Any:  # the key block of grid index i
        return i // parts if parts > 1 else i

    qgroup = pl.BlockSpec((None, g.sqp, group, g.dpad), lambda i, j: (bkvh(j)[0], 0, bkvh(j)[1], 0))
    kvblock = pl.BlockSpec(
        (None, g.bk, None, g.dpad), lambda i, j: (bkvh(j)[0], kvb(i), bkvh(j)[1], 0)
    )
    rowgroup = pl.BlockSpec((None, group, g.sqp), lambda i, j: (bkvh(j)[0], bkvh(j)[1], 0))
    extra_specs: list[pl.BlockSpec] = []
    for present, dims in ((spec.has_bias, g.bias_bh), (spec.has_mask, g.mask_bh)):
        if present:
            extra_specs.append(
                pl.BlockSpec(
                    (None, group if dims[1] else None, g.sqp, g.bk),
                    lambda i, j, dims=dims: (*_pair_index(dims, *bkvh(j)), 0, kvb(i)),
                )
            )
    if spec.has_segments:
        extra_specs.append(pl.BlockSpec((None, g.sqp), lambda i, j: (bkvh(j)[0], 0)))
        extra_specs.append(pl.BlockSpec((None, g.bk), lambda i, j: (bkvh(j)[0], kvb(i))))
        extra_specs.append(pl.BlockSpec((None, 2, g.sqp), lambda i, j: (bkvh(j)[0], 0, 0)))
        extra_specs.append(pl.BlockSpec((None, 2, g.bk), lambda i, j: (bkvh(j)[0], 0, kvb(i))))
    if spec.dropout_prob > 0:
        extra_specs.append(pl.BlockSpec((1,), lambda i, j: (0,)))
    kv_shape = (g.batch, g.skp, g.kv_heads, g.dpad)
    if parts == 1:
        out_specs = [kvblock, kvblock]
        out_shape = [
            jax.ShapeDtypeStruct(kv_shape, k.dtype),
            jax.ShapeDtypeStruct(kv_shape, v.dtype),
        ]
    else:
        out_specs = [
            pl.BlockSpec(
                (None, None, g.bk, None, g.dpad),
                lambda i, j: (i % 2, bkvh(j)[0], i // 2, bkvh(j)[1], 0),
            )
        ]
        # float32 where k and v differ in dtype, so that each is rounded once, to its own
        stacked = k.dtype if k.dtype == v.dtype else jnp.float32
        out_shape = [jax.ShapeDtypeStruct((2, *kv_shape), stacked)]  # dV, dK
    outs = pl.pallas_call(
        functools.partial(_dkdv_kernel, g=g, parts=parts),
        grid=(g.skp // g.bk * parts, g.batch * g.kv_heads),
        in_specs=[qgroup, kvblock, kvblock, qgroup, rowgroup, rowgroup, *extra_specs],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=cp,
        interpret=interpret,
        name="ejkfn_flash_bwd_dkdv",
    )(*padded(g, delta))
    if parts == 1:
        dk, dv = outs
    else:
        dv, dk = outs[0][0].astype(v.dtype), outs[0][1].astype(k.dtype)

    dq = res[0][:, : g.seq_q, :, : g.head_dim]
    dbias = None
    if spec.has_bias:
        full = res[2][:, :, : g.seq_q, : g.seq_k]
        axes = tuple(a for a in (0, 1) if bias.shape[a] == 1 and full.shape[a] != 1)
        full = jnp.sum(full, axis=axes, keepdims=True)
        dbias = jnp.sum(full, axis=tuple(a for a in (2, 3) if bias.shape[a] == 1), keepdims=True)
        dbias = dbias.astype(bias.dtype)
    return (
        dq,
        dk[:, : g.seq_k, :, : g.head_dim],
        dv[:, : g.seq_k, :, : g.head_dim],
        dbias,
    )


# ----------------------------------------------------------------------------------------------------
# Configurations.


def _smem_bytes(
    kept: int, streamed: int, dpad: int, stages: int, itemsize: int, pair: int, resident: int = 1
) -> int:
    """Shared memory of one program: ``resident`` kept blocks, ``stages`` buffers of the streamed
    blocks, a score tile per kept block, and ``stages - 1`` buffers of the bias and mask tiles
    (``pair`` bytes a score). Triton 3.6 keeps ``stages - 1`` buffers of a pipelined load that
    feeds no dot: its count for the portable Triton kernels at D = 128 grows by 2 x 8 KiB with a
    128 x 64 int8 mask on 3 stages (``triton_sass.py``'s compile, ``metadata.shared``); at 3 a
    buffer each had put the mirrored backward with a mask over the limit, and 3 stages ran
    1.10-1.22x the 2 it fell to (results/features_NVIDIA_H200_20261129-075338.json)."""
    outer = resident * kept
    blocks = (outer * dpad + 2 * stages * streamed * dpad + outer * streamed) * itemsize
    return blocks + max(stages - 1, 1) * kept * streamed * pair


def _fits_pass(shape: AttentionShape, p: FwdParams | BwdParams, backward: bool) -> bool:
    """Whether ``p`` suits one pass: blocks no larger than the sequences need, float32
    accumulators within the registers, tiles within :data:`_SMEM_LIMIT`."""
    dpad = padded_head_dim(shape.head_dim)
    item = 4 if shape.dtype == "float32" else 2
    # bias (float32 at most) and int8 mask tiles, pipelined like the blocks
    pair = 4 * shape.spec.has_bias + shape.spec.has_mask
    seq_q = max(_MIN_BLOCK, _next_pow2(shape.seq_q))
    seq_k = max(_MIN_BLOCK, _next_pow2(shape.seq_k))
    if p.q_blocksize > seq_q or p.kv_blocksize > seq_k:
        return False
    if p.q_blocksize < _MIN_BLOCK or p.kv_blocksize < _MIN_BLOCK:
        return False
    # f32 accumulators held in registers by the program's threads
    if (p.q_blocksize * dpad + p.q_blocksize * p.kv_blocksize) / (32 * p.num_warps) > 256:
        return False
    if not backward:
        smem = _smem_bytes(p.q_blocksize, p.kv_blocksize, dpad, p.num_stages, item, pair)
        return smem <= _SMEM_LIMIT
    # dK/dV keeps k, v blocks and streams q, do; dQ the reverse (or the same sizes, mirrored)
    dkdv = _smem_bytes(p.kv_blocksize, p.q_blocksize, dpad, p.num_stages, item, pair, resident=2)
    rows, cols, _, dq_stages = dq_launch(p)
    dq = _smem_bytes(rows, cols, dpad, dq_stages, item, pair, resident=2)
    return max(dkdv, dq) <= _SMEM_LIMIT


def _fits(shape: AttentionShape, fp: FwdParams, bp: BwdParams) -> bool:
    return _fits_pass(shape, fp, backward=False) and _fits_pass(shape, bp, backward=True)


# Features with which, at head dim 64, the 64 x 64 backward on 4 warps and 3 stages ran
# forward+backward faster than the mirrored_wide blocks, at 8x2048x32x64 (GQA too), causal: a
# bias 1.28-1.33x, a soft cap 1.06-1.19x, a window 1.10-1.21x (also 1.10x at 2x8192x32/8kvx64),
# segment ids 1.17-1.20x, dropout 1.06-1.30x, a mask 1.03x; not causal: a bias 1.30x, a soft cap
# 1.04x, a window 1.07x, but a mask 0.98x (segment ids and dropout not measured there)
# (results/features_NVIDIA_H200_20261129-053037.json, -053743.json, -053823.json, -054357.json,
# -054613.json, -055551.json). Without a feature they ran 0.98x.
_SLOW_WIDE_FEATURES = frozenset({"bias", "logits_soft_cap", "sliding_window"})
_SLOW_WIDE_CAUSAL_FEATURES = frozenset({"attention_mask", "segment_ids", "dropout"})


def heuristic(shape: AttentionShape) -> tuple[FwdParams, BwdParams]:
    """Block sizes that work well on Hopper for the head dim, shrunk to short sequences and until
    they fit (float32 tiles are twice the 16-bit ones measured).

    Measured on an H200 in bf16 (results/portable_sweep_NVIDIA_H200_20261121-184554.json and the
    two before it): the forward at D = 128 with (128, 64, 4 warps, 3 stages) ran 1.04-1.18x
    (64, 64, 4, 3) at 2x8192 and 4x4096 x16, causal and not. With PTX's exponentials, causal at
    D = 128 on 8 warps ran 1.04-1.07x 4 warps at 4x4096, 2x8192 and 2x16384, and 0.97-0.99x
    without a mask (results/portable_sweep_NVIDIA_H200_20261123-032051.json, -032206.json). At
    D = 64, with the fused exponent, (128, 64, 4, 3) ran 1.04-1.11x (64, 64, 4, 3) at 8x2048x32
    and 2x8192x32, causal and not (results/portable_sweep_NVIDIA_H200_20261123-054724.json,
    -054814.json).

    The backward, since its dK/dV kernel works on [keys, queries] tiles
    (results/pt_bwd_probe_NVIDIA_H200_20261123-024446.json, -024656.json, forward+backward): at
    D = 128 both kernels keeping 128 rows and streaming 64 (mirrored) with 8 warps and 3 stages ran
    1.00-1.07x the 64 x 64, 4-warp blocks kept before; at D = 64 mirrored 128 kept and 32
    streamed, 4 warps, 1.01-1.02x 64 x 64 with 3 stages. With a float32 bias the mirrored blocks
    fit one stage, and 64 x 64 with 3 ran 1.15-1.21x them
    (results/pt_bias_probe_NVIDIA_H200_20261123-041317.json; counted as below they fit 2, and
    64 x 64 still ran 1.10x them, results/features_NVIDIA_H200_20261129-074659.json). At D = 64
    the dQ kernel then streaming 64 keys on 8 warps (mirrored_wide) ran 1.022-1.037x at 8x2048x32
    and 2x8192x32, causal and not (results/revision_ab_NVIDIA_H200_20261128-115536.json). Counting
    the bias and mask tiles' buffers as Triton does (:func:`_smem_bytes`) kept 3 stages where
    they had cut them to 2 at D = 128: the mirrored backward with a mask ran forward+backward
    1.10x (causal) and 1.22x (not) at 4x4096x16 (-075338.json against -074528.json), the forward
    with a bias 1.25x (-080159.json).
    """
    d = padded_head_dim(shape.head_dim)
    if d <= 64:
        fp = FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=4, num_stages=3)
        features, causal = shape.spec.features, shape.spec.causal
        if _SLOW_WIDE_FEATURES & features or (causal and _SLOW_WIDE_CAUSAL_FEATURES & features):
            bp = BwdParams(q_blocksize=64, kv_blocksize=64, num_warps=4, num_stages=3)
        else:
            bp = BwdParams(
                q_blocksize=32, kv_blocksize=128, num_warps=4, num_stages=3, variant=MIRRORED_WIDE
            )
    elif d <= 128:
        warps = 8 if shape.spec.causal else 4
        fp = FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=warps, num_stages=3)
        if shape.spec.has_bias:  # the mirrored blocks fit 2 stages, 0.91x these on 3
            bp = BwdParams(q_blocksize=64, kv_blocksize=64, num_warps=4, num_stages=3)
        else:
            bp = BwdParams(
                q_blocksize=64, kv_blocksize=128, num_warps=8, num_stages=3, variant=MIRRORED
            )
    else:
        # 128 x 64 on 8 warps ran the forward 1.07-1.33x 64 x 32 on 4 (its blocks before) at
        # 2x4096x8x256 and 1x8192x16(8 kv)x256, causal and not, plain and with a soft cap, a
        # window, a bias, dropout or segment ids (results/features_NVIDIA_H200_20261201-023441.json,
        # -023919.json); with 3 stages they do not fit shared memory. With a bias they ran 1.26x
        # on 2 stages, which fit a 16-bit bias only; the fit counts a float32 one (and a mask's
        # tiles overflow its limit), so with either they would run on 1 stage: 0.70-0.98x the
        # blocks before there, which those keep (-055237.json).
        fp = FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=8, num_stages=2)
        if shape.spec.has_bias or shape.spec.has_mask:
            fp = FwdParams(q_blocksize=64, kv_blocksize=32, num_warps=4, num_stages=2)
        # Triton's split backward (dV and dK in programs of their own, 128 keys kept, 32 queries
        # streamed, 8 warps, 2 stages) ran forward+backward 1.35-1.98x the 32 x 32 blocks on
        # 4 warps and 1 stage before at 2x4096x8x256, causal and not, plain and with a soft cap,
        # segment ids or dropout; 64 keys kept 0.87-0.95x those
        # (results/features_NVIDIA_H200_20261201-051036.json). With a bias (its float32 tiles
        # leave it 1 stage), a mask or a window 1.19-2.11x; at 1x8192x16(8 kv)x256 and
        # 4x2048x16x256 1.72-2.00x (-051714.json, -052605.json).
        bp = BwdParams(
            q_blocksize=32, kv_blocksize=128, num_warps=8, num_stages=2, variant=SPLIT_DKDV
        )
    if shape.dtype == "float32":
        # FMA products keep their operands in registers, and the blocks above spill. The backward
        # takes the blocks of Triton's that ran 1.07-2.76x its spilling ones; on 8 warps they ran
        # 0.61-0.68x (results/features_NVIDIA_H200_20261129-125700.json). The forward on
        # 32 x 32, 4 warps, 2 stages ran 9.8x the 16-bit blocks at 4x4096x16x128 causal
        # (-114127.json); at D = 128, 32 x 64 on 8 warps ran 1.15x that causal and 1.25x without
        # a mask, and at D = 64 without a mask the 16-bit 128 x 64 on 8 warps 1.12x (-125019.json,
        # -125249.json; causal it ran 0.62x). Above D = 128, 16 x 32 as Triton's (even with
        # 32 x 32 on 8 warps, -125503.json).
        rows = 16 if d > 128 else 32
        if d > 128:
            fp = FwdParams(q_blocksize=16, kv_blocksize=32, num_warps=4, num_stages=2)
        elif d > 64:
            fp = FwdParams(q_blocksize=32, kv_blocksize=64, num_warps=8, num_stages=2)
        elif shape.spec.features:
            fp = FwdParams(q_blocksize=32, kv_blocksize=32, num_warps=4, num_stages=2)
        else:
            fp = FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=8, num_stages=3)
        bp = BwdParams(q_blocksize=rows, kv_blocksize=32, num_warps=4, num_stages=2)
    fp = shrink_to_fit(shape, fp, lambda p: _fits_pass(shape, p, backward=False), _MIN_BLOCK)
    bp = shrink_to_fit(shape, bp, lambda p: _fits_pass(shape, p, backward=True), _MIN_BLOCK)
    return fp, bp


def candidates(shape: AttentionShape) -> list[tuple[FwdParams, BwdParams]]:
    """Configurations the tuner may try, without those that cannot compile or fit on the chip."""
    out: list[tuple[FwdParams, BwdParams]] = []
    fwds = [
        FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s)
        for bq, bk in ((64, 32), (64, 64), (128, 32), (128, 64), (128, 128))
        for w in (4, 8)
        for s in (2, 3)
    ]
    bwds = [
        BwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s)
        for bq, bk in ((32, 32), (32, 64), (64, 32), (64, 64), (64, 128), (128, 64))
        for w in (4, 8)
        for s in (1, 2)
    ]
    bwds += [
        BwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s, variant=MIRRORED)
        for bq, bk, w in ((32, 64, 4), (32, 128, 4), (64, 128, 8))
        for s in (2, 3, 4)
    ]
    bwds += [
        BwdParams(q_blocksize=32, kv_blocksize=bk, num_warps=4, num_stages=s, variant=MIRRORED_WIDE)
        for bk in (64, 128)
        for s in (2, 3, 4)
    ]
    if shape.dtype == "float32":
        fwds += FLOAT32_FWD_CANDIDATES
    heur = heuristic(shape)
    if _fits(shape, *heur):
        out.append(heur)
    for fp in fwds:
        bp = heur[1]
        if (fp, bp) not in out and _fits(shape, fp, bp):
            out.append((fp, bp))
    for bp in bwds:
        fp = heur[0]
        if (fp, bp) not in out and _fits(shape, fp, bp):
            out.append((fp, bp))
    if not out:
        out.append(heur)
    return out


BACKEND = register_backend(
    AttentionBackend(
        platform="pallas",
        variant="triton",
        devices=("gpu",),
        fwd=fwd,
        bwd=bwd,
        unsupported=frozenset(),
        heuristic=heuristic,
        candidates=candidates,
        available=lambda: jax.default_backend() in ("gpu", "cpu"),  # cpu: the interpreter
    )
)
