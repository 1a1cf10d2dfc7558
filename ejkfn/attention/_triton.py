"""Flash attention as Triton kernels (platform ``"triton"``), called through jax-triton on a GPU.

Forward: one program per (q block, batch * head) runs an online softmax over the key blocks the
causal and window limits leave visible, writing the output and the log-sum-exp. Backward
(FlashAttention 2, no atomics): a dQ kernel (one program per (q block, batch * head)) loops over key
blocks and also writes ``delta = rowsum(dout * out)`` of its rows; then a dK/dV kernel (one program
per (kv block, batch * kv head)) loops over the query heads of its GQA group and their visible q
blocks, so the group sum stays in registers, and writes ``dbias = ds`` tiles when there is a bias.
With ``BwdParams(variant="mirrored")`` the dQ kernel's blocks are the dK/dV kernel's turned around
(:func:`._backend.dq_launch`): both keep ``kv_blocksize`` rows and stream ``q_blocksize``; with
``"mirrored_half"`` the dQ kernel keeps half as many rows, with ``"mirrored_wide"`` it streams twice
as many keys on twice the warps; with ``"tall_dq"`` the dQ kernel keeps twice ``q_blocksize`` rows
on twice the warps and streams ``kv_blocksize`` keys. With ``"split_dkdv"`` two neighbouring
programs share each key block, one accumulating dV and one dK, each recomputing the scores, and
the dQ kernel is mirrored: at head dim 256 one float32 accumulator a program is what lets a wgmma
block fit the registers.

Tensors stay in their ``[B, S, H, D]`` layout (strides go to the kernels); ragged sequence lengths and
head dims that are not powers of two are handled by masked loads and stores. Every feature of
:class:`AttentionSpec` is supported. ``dbias`` is produced per (batch, head) in float32 and summed
over broadcast dimensions afterwards.

Without a GPU (``interpret=None`` on a CPU, or ``interpret=True``) the same kernels run in Triton's
interpreter inside ``jax.pure_callback``; that needs ``triton`` imported in interpreter mode, which
:mod:`ejkfn._triton_interpret` arranges (or explains) on first use.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._registry import BwdParams, FwdParams
from .._triton_interpret import default_interpret, launch, load_kernels
from ._backend import (
    FLOAT32_FWD_CANDIDATES,
    MIRRORED,
    MIRRORED_HALF,
    MIRRORED_WIDE,
    SPLIT_DKDV,
    TALL_DQ,
    AttentionBackend,
    AttentionShape,
    decoding_rows,
    dq_launch,
    folded_rows,
    forward_band,
    merge_partials,
    register_backend,
    segment_spans,
    shrink_to_fit,
)
from ._dropout import keep_scale, threshold
from ._spec import AttentionSpec

__all__ = ["bwd", "candidates", "fwd", "heuristic"]

_KERNELS = __name__.rsplit(".", 1)[0] + "._triton_kernels"
_MIN_BLOCK = 16  # tl.dot needs at least 16 along every dimension
_MAX_HEAD_DIM = 256
_SMEM_BYTES = 227 * 1024  # the most shared memory one program may opt into on Hopper
# What Triton's dK/dV kernel holds beyond its tiles (its count at head dims 64 and 128)
_DKDV_SCRATCH = 1024
# f32 tile values per thread beyond which ptxas spills (seen compiling for sm_90: the forward at
# 128 x 64 x 128 with 4 warps holds 192 and spills; the dK/dV kernel at 32 x 128 x 128, 288)
_FWD_VALUES_PER_THREAD = 160
_BWD_VALUES_PER_THREAD = 256
_DTYPES = ("float32", "bfloat16", "float16")


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _block_d(head_dim: int) -> int:
    return max(_MIN_BLOCK, _next_pow2(head_dim))


def _clamp_block(block: int, seq: int, what: str) -> int:
    """``block`` shrunk to the (power-of-two) sequence length; blocks beyond it only waste work."""
    if block < _MIN_BLOCK or block & (block - 1):
        raise ValueError(f"{what}={block} must be a power of two >= {_MIN_BLOCK}")
    return max(_MIN_BLOCK, min(block, _next_pow2(seq)))


def _kernels(interpret: bool) -> ModuleType:
    return load_kernels(_KERNELS, interpret)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------
# Arguments


def _check(q: Any, k: Any, v: Any) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"expected q, k, v of rank 4 ([batch, seq, heads, dim]); got {q.shape}, {k.shape}, "
            f"{v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"expected k and v of one shape; got {k.shape} and {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"kv heads ({k.shape[2]}) must divide query heads ({q.shape[2]})")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"expected q, k, v of one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if np.dtype(q.dtype).name not in _DTYPES:
        raise NotImplementedError(f"platform 'triton' supports {_DTYPES}; got {q.dtype}")
    if q.shape[3] > _MAX_HEAD_DIM:
        raise NotImplementedError(
            f"platform 'triton' supports head dims up to {_MAX_HEAD_DIM}; got {q.shape[3]}"
        )


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def _pairwise(x: Any, full: tuple[int, int, int, int], what: str) -> list[int]:
    """Element strides of a ``[B|1, H|1, Sq|1, Sk|1]`` operand, 0 along broadcast dimensions."""
    if x.ndim != 4 or any(n not in (1, f) for n, f in zip(x.shape, full, strict=True)):
        raise ValueError(f"expected {what} broadcastable to {full} (rank 4); got {x.shape}")
    return [
        0 if n == 1 and f != 1 else s
        for n, f, s in zip(x.shape, full, _strides(x.shape), strict=True)
    ]


def _smem_bytes(
    item: int,
    d: int,
    resident: int,
    kept: int,
    streamed: int,
    stages: int,
    tile_bytes: int = 0,
    extra_tile_bytes: int = 0,
) -> int:
    """Shared memory of one kernel as Triton 3.6 lays it out for sm_90 (``triton_sass.py``'s
    compile, ``metadata.shared``): ``resident`` kept ``[kept, d]`` blocks, ``stages`` buffers of two
    streamed ``[streamed, d]`` blocks, ``stages - 1`` of the bias and mask tiles (``tile_bytes`` a
    score), and one more tile of ``extra_tile_bytes`` a score. To the byte for the forward and dQ
    kernels at D = 128 with every bias dtype and mask; the dK/dV kernel keeps ``_DKDV_SCRATCH``
    more."""
    blocks = item * d * (resident * kept + 2 * streamed * stages)
    return blocks + ((stages - 1) * tile_bytes + extra_tile_bytes) * kept * streamed


@dataclasses.dataclass(frozen=True)
class _Call:
    """The operands and compile-time constants shared by all kernels of one attention call."""

    inputs: tuple[Any, ...]  # q, k, v, bias, mask, q_seg, kv_seg, seed (dummies when absent)
    meta: dict[str, Any]
    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_k: int
    block_d: int

    def stages(self, kept: int, streamed: int, stages: int, resident: int, dkdv: bool) -> int:
        """``stages``, fewer where the kernel's tiles would overflow Hopper's shared memory. Configs
        are chosen for 16-bit bias tiles (the dtype is not in the shape); with a float32 bias the
        mirrored dK/dV kernel at D = 128 took 241 KiB on 3 stages, 2.5 buffers of its bias tile
        where Triton pipelines 2 (``triton_sass.py --feature bias_f32``), so it counts one
        more."""
        q, bias = self.inputs[0], self.inputs[3]
        bias_bytes = np.dtype(bias.dtype).itemsize if self.meta["HAS_BIAS"] else 0
        tile_bytes = bias_bytes + int(self.meta["HAS_MASK"])
        extra, scratch = (bias_bytes if bias_bytes >= 4 else 0, _DKDV_SCRATCH) if dkdv else (0, 0)
        item = np.dtype(q.dtype).itemsize
        while stages > 1 and (
            _smem_bytes(item, self.block_d, resident, kept, streamed, stages, tile_bytes, extra)
            + scratch
            > _SMEM_BYTES
        ):
            stages -= 1
        return stages

    @property
    def row_stats(self) -> jax.ShapeDtypeStruct:
        """A float32 value per query row of each head ([B, H, Sq]): the forward's lse, delta."""
        return jax.ShapeDtypeStruct((self.batch, self.heads, self.seq_q), jnp.float32)


# Keys a window must span (left + right; the left side alone when causal) before the whole blocks
# between its edges run unmasked, by pass. Narrower, the extra loop costs more than the masks. On
# an H200 in bf16 the split forward ran 1.10-1.37x the all-masked one at 4x4096x16x64 causal from
# 128 to 512 keys, 1.05-1.12x at 2x8192x16x128 from 256, 0.99x there at 128; splitting the
# backward too ran 0.94-1.00x splitting the forward alone at 128-256 keys, 1.04x at 512 (NOTES.md,
# sixty-third round). Float32 never splits: its FFMA loop masks for little, and splitting made
# dK/dV spill.
WINDOW_SPLIT_KEYS = {"fwd": 128, "bwd": 512}


def splits_window(spec: AttentionSpec, dtype: Any, pass_: str) -> bool:
    """Whether ``pass_`` ("fwd", "bwd") runs a window's interior blocks unmasked
    (:data:`WINDOW_SPLIT_KEYS`); True without a window."""
    if spec.window is None:
        return True
    if np.dtype(dtype) == np.float32:
        return False
    return spec.window_keys >= WINDOW_SPLIT_KEYS[pass_]


def _prepare(q, k, v, bias, mask, q_seg, kv_seg, seed, spec: AttentionSpec, pass_: str) -> _Call:
    _check(q, k, v)
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    full = (batch, heads, seq_q, seq_k)
    has_bias, has_mask, has_seg = bias is not None, mask is not None, q_seg is not None
    dummy_f32 = jnp.zeros((1,), jnp.float32)
    if has_bias:
        sbb, sbh, sbm, sbn = _pairwise(bias, full, "bias")
    else:
        bias, (sbb, sbh, sbm, sbn) = dummy_f32, (0, 0, 0, 0)
    if has_mask:
        smb, smh, smm, smn = _pairwise(mask, full, "attention_mask")
        mask = mask.astype(jnp.int8)
    else:
        mask, (smb, smh, smm, smn) = jnp.zeros((1,), jnp.int8), (0, 0, 0, 0)
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    if has_seg:
        if q_seg.shape != (batch, seq_q) or kv_seg.shape != (batch, seq_k):
            raise ValueError(
                f"expected segment ids of shapes {(batch, seq_q)} and {(batch, seq_k)}; got "
                f"{q_seg.shape} and {kv_seg.shape}"
            )
        q_seg, kv_seg = segment_spans(q_seg, kv_seg)
    else:
        q_seg = kv_seg = jnp.zeros((1,), jnp.int32)
    if spec.dropout_prob > 0.0:
        if seed is None:
            raise ValueError("dropout_prob > 0 needs a dropout seed")
        seed = jnp.asarray(seed).astype(jnp.uint32).reshape(1)
    else:
        seed = jnp.zeros((1,), jnp.uint32)
    left, right = spec.window if spec.window is not None else (-1, -1)
    sq, sk = _strides(q.shape), _strides(k.shape)
    meta = dict(
        HEADS=heads,
        GROUP=heads // kv_heads,
        SEQ_Q=seq_q,
        SEQ_K=seq_k,
        HEAD_DIM=head_dim,
        SQB=sq[0], SQS=sq[1], SQH=sq[2],
        SKB=sk[0], SKS=sk[1], SKH=sk[2],
        SVB=sk[0], SVS=sk[1], SVH=sk[2],
        SBB=sbb, SBH=sbh, SBM=sbm, SBN=sbn,
        SMB=smb, SMH=smh, SMM=smm, SMN=smn,
        SCALE=float(spec.scale),
        SOFT_CAP=float(spec.soft_cap or 0.0),
        CAUSAL=bool(spec.causal),
        WINDOW_LEFT=int(left),
        WINDOW_RIGHT=int(right),
        HAS_BIAS=has_bias,
        HAS_MASK=has_mask,
        HAS_SEG=has_seg,
        DROP_THRESH=threshold(spec.dropout_prob) if spec.dropout_prob > 0.0 else 0,
        DROP_SCALE=keep_scale(spec.dropout_prob),
        SPLIT=not has_mask and not has_seg and splits_window(spec, q.dtype, pass_),
        DOT_PRECISION="ieee" if np.dtype(q.dtype) == np.float32 else "tf32",
    )  # fmt: skip
    return _Call(
        inputs=(q, k, v, bias, mask, q_seg, kv_seg, seed),
        meta=meta,
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        seq_q=seq_q,
        seq_k=seq_k,
        block_d=_block_d(head_dim),
    )


# ----------------------------------------------------------------------------------------------
# The contract's functions


def fwd(
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
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention forward: ``(out [B, Sq, H, D] like q, lse [B, H, Sq] float32)``.

    ``spec`` and ``params`` are static (they pick the compiled kernel); ``interpret`` runs the
    kernels in Triton's interpreter (default: when JAX has no GPU).
    """
    interpret = default_interpret(interpret)
    if spec.causal and q.shape[1] == 1:
        # One query, at the last position, sees every key: the unmasked loop does it. Kept causal,
        # 1x1:32768x32(8 kv)x128 ran 85.7 us (results/decode_NVIDIA_H200_20261129-182827.json);
        # without causal the same call had run 57.1 us (-144243.json).
        spec = dataclasses.replace(spec, causal=False)
    group = q.shape[2] // k.shape[2]
    rows = folded_rows(AttentionShape.of(q, k, spec), params.q_blocksize)
    if rows > q.shape[1] and bias is None and mask is None:
        # The group's queries become rows of one head: each key block is read once for all of them
        # (row i * group + g is query i, for the causal and window limits).
        q_rows = None if q_seg is None else jnp.repeat(q_seg, group, axis=1)
        out, lse = _fwd(
            fold_group(q, group), k, v, None, None, q_rows, kv_seg, seed, spec, params, interpret,
            row_group=group,
        )  # fmt: skip
        return unfold_group(out, group), unfold_group_lse(lse, group)
    return _fwd(q, k, v, bias, mask, q_seg, kv_seg, seed, spec, params, interpret)


def fold_group(q: jax.Array, group: int) -> jax.Array:
    """``[B, Sq, H, D]`` -> ``[B, Sq * group, H / group, D]``: row ``i * group + g`` is query ``i``
    of head ``kv_head * group + g``."""
    b, sq, h, d = q.shape
    return q.reshape(b, sq, h // group, group, d).swapaxes(2, 3).reshape(b, sq * group, -1, d)


def unfold_group(out: jax.Array, group: int) -> jax.Array:
    """The inverse of :func:`fold_group`."""
    b, rows, kvh, d = out.shape
    return (
        out.reshape(b, rows // group, group, kvh, d).swapaxes(2, 3).reshape(b, -1, kvh * group, d)
    )


def unfold_group_lse(lse: jax.Array, group: int) -> jax.Array:
    """``[B, H / group, Sq * group]`` row statistics of a folded call as ``[B, H, Sq]``."""
    b, kvh, rows = lse.shape
    return lse.reshape(b, kvh, rows // group, group).swapaxes(2, 3).reshape(b, kvh * group, -1)


def _fwd(q, k, v, bias, mask, q_seg, kv_seg, seed, spec, params, interpret, row_group=1):
    call = _prepare(q, k, v, bias, mask, q_seg, kv_seg, seed, spec, "fwd")
    block_q = _clamp_block(params.q_blocksize, call.seq_q, "q_blocksize")
    block_k = _clamp_block(params.kv_blocksize, call.seq_k, "kv_blocksize")
    splits = min(params.kv_splits, _cdiv(call.seq_k, block_k))  # at least a block each
    out_shape, out_stride = _split_outputs(q.shape, q.dtype, splits)  # merged below
    lse_shape, lse_stride = _split_outputs(call.row_stats.shape, jnp.float32, splits)
    kern = _kernels(interpret)
    out, lse = launch(
        kern.fwd_kernel,
        *call.inputs,
        grid=(_cdiv(call.seq_q, block_q) * call.batch * call.heads, splits),  # numbered by _tile
        out_shapes=(out_shape, lse_shape),
        num_warps=params.num_warps,
        num_stages=call.stages(block_q, block_k, params.num_stages, resident=1, dkdv=False),
        interpret=interpret,
        **call.meta,
        SOB=call.meta["SQB"],
        SOS=call.meta["SQS"],
        SOH=call.meta["SQH"],
        BAND=forward_band(AttentionShape.of(q, k, spec), _cdiv(call.seq_q, block_q)),
        KV_SPLITS=splits,
        SOX=out_stride,
        SLX=lse_stride,
        ROW_GROUP=row_group,
        BLOCK_Q=block_q,
        BLOCK_K=block_k,
        BLOCK_D=call.block_d,
    )
    if splits > 1:
        out, lse = merge_partials(out, lse)
        out = out.astype(q.dtype)
    return out, lse


def _split_outputs(
    shape: tuple[int, ...], dtype: Any, splits: int
) -> tuple[jax.ShapeDtypeStruct, int]:
    """The output of a kernel whose programs split the keys ``splits`` ways, and the stride
    between its partial results: float32 partials stacked ahead, each ``shape`` (summed or merged
    by the caller), or without a split the output itself (stride 0)."""
    if splits > 1:
        return jax.ShapeDtypeStruct((splits, *shape), jnp.float32), int(np.prod(shape))
    return jax.ShapeDtypeStruct(shape, dtype), 0


def bwd(
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
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Attention backward: ``(dq, dk, dv, dbias)``; dbias is None without a bias, else shaped like
    it (summed over its broadcast dimensions). Static arguments as in :func:`fwd`."""
    interpret = default_interpret(interpret)
    call = _prepare(q, k, v, bias, mask, q_seg, kv_seg, seed, spec, "bwd")
    block_q = _clamp_block(params.q_blocksize, call.seq_q, "q_blocksize")
    block_k = _clamp_block(params.kv_blocksize, call.seq_k, "kv_blocksize")
    dq_run = dq_launch(params)
    dq_rows = _clamp_block(dq_run.rows, call.seq_q, "dQ rows")
    dq_cols = _clamp_block(dq_run.cols, call.seq_k, "dQ columns")
    kern = _kernels(interpret)
    meta = call.meta
    dout = dout.astype(q.dtype)
    out = out.astype(q.dtype)
    bh = call.batch * call.heads
    lse = lse.astype(jnp.float32)
    common = dict(
        **meta, SDOB=meta["SQB"], SDOS=meta["SQS"], SDOH=meta["SQH"], BLOCK_D=call.block_d
    )
    splits = min(params.kv_splits, _cdiv(call.seq_k, dq_cols))  # at least a block each
    dq_shape, dq_stride = _split_outputs(q.shape, q.dtype, splits)  # summed below
    dq, delta, lse2 = launch(
        kern.bwd_dq_kernel,
        *call.inputs,
        dout,
        lse,
        out,
        grid=(_cdiv(call.seq_q, dq_rows), bh, splits),
        out_shapes=(dq_shape, call.row_stats, call.row_stats),
        num_warps=dq_run.num_warps,
        num_stages=call.stages(dq_rows, dq_cols, dq_run.num_stages, resident=2, dkdv=False),
        interpret=interpret,
        KV_SPLITS=splits,
        SDX=dq_stride,
        BLOCK_Q=dq_rows,
        BLOCK_K=dq_cols,
        **common,
    )
    if splits > 1:
        dq = dq.sum(axis=0).astype(q.dtype)
    has_bias = bias is not None
    dbias_shape = (call.batch, call.heads, call.seq_q, call.seq_k) if has_bias else (1,)
    parts = 2 if params.variant == SPLIT_DKDV else 1  # dV and dK in programs of their own
    dk, dv, dbias_full = launch(
        kern.bwd_dkdv_kernel,
        *call.inputs,
        dout,
        lse2,
        delta,
        grid=(_cdiv(call.seq_k, block_k) * parts, call.batch * call.kv_heads),
        out_shapes=(
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(dbias_shape, jnp.float32),
        ),
        num_warps=params.num_warps,
        num_stages=call.stages(block_k, block_q, params.num_stages, resident=2, dkdv=True),
        interpret=interpret,
        zeroed=(2,) if has_bias else (),
        BLOCK_Q=block_q,
        BLOCK_K=block_k,
        PARTS=parts,
        **common,
    )
    dbias = None
    if has_bias:
        axes = tuple(i for i, n in enumerate(bias.shape) if n == 1 and dbias_shape[i] != 1)
        dbias = jnp.sum(dbias_full, axis=axes, keepdims=True).astype(bias.dtype)
    return dq, dk, dv, dbias


# ----------------------------------------------------------------------------------------------
# Configurations


def _fits(shape: AttentionShape, p: FwdParams | BwdParams, backward: bool) -> bool:
    """Whether ``p`` is worth compiling: blocks no larger than needed, pipelined tiles within
    Hopper's shared memory, f32 tiles within the registers (estimates that match what Triton 3.6
    allocates for sm_90: q and the streamed k/v stages for the forward; resident k, v and streamed
    q, dout stages for dK/dV, and the mirror image for dQ)."""
    item = 4 if shape.dtype == "float32" else 2
    d = _block_d(shape.head_dim)
    bq, bk, stages = p.q_blocksize, p.kv_blocksize, p.num_stages
    threads = 32 * p.num_warps
    if min(bq, bk) < _MIN_BLOCK:
        return False
    rows = shape.seq_q if backward else folded_rows(shape, bq)
    if bq > max(_MIN_BLOCK, _next_pow2(rows)) or bk > max(_MIN_BLOCK, _next_pow2(shape.seq_k)):
        return False  # a smaller block covers the sequence: same result, less work
    if not backward:
        smem = _smem_bytes(item, d, 1, bq, bk, stages)
        values = (bq * d + bq * bk) / threads
        return smem <= _SMEM_BYTES and values <= _FWD_VALUES_PER_THREAD
    # dK/dV keeps k, v blocks and streams q, do; dQ keeps its rows of q, do and streams k, v
    rows, cols, dq_warps, dq_stages = dq_launch(p)
    if dq_warps > 8:
        return False  # two warpgroups at most: a 128-row dQ block on more splits its products
    smem = max(
        _smem_bytes(item, d, 2, bk, bq, stages) + _DKDV_SCRATCH,
        _smem_bytes(item, d, 2, rows, cols, dq_stages),
    )
    accumulators = 1 if p.variant == SPLIT_DKDV else 2
    values = max(
        (max(accumulators * bk * d, bq * d) + bq * bk) / threads,
        (rows * d + rows * cols) / (32 * dq_warps),
    )
    return smem <= _SMEM_BYTES and values <= _BWD_VALUES_PER_THREAD


def _float32_blocks(shape: AttentionShape) -> tuple[FwdParams, BwdParams]:
    """Blocks for float32 inputs, whose products are FMAs with their operands in registers: the
    16-bit blocks spill (NOTES.md, fifty-third and fifty-fourth rounds)."""
    d = _block_d(shape.head_dim)
    plain_causal = shape.spec.features == {"causal"}
    if d > 128:
        # The 16-bit blocks spill 51824 bytes a thread (forward) and 65688 (dK/dV) at D = 256;
        # 16 x 32 spill 4 and 8 and ran the forward even with 32 x 32 on 8 warps
        # (results/features_NVIDIA_H200_20261129-125503.json, 2x4096x8x256).
        blocks = FwdParams(q_blocksize=16, kv_blocksize=32, num_warps=4, num_stages=2)
        return blocks, BwdParams(q_blocksize=16, kv_blocksize=32, num_warps=4, num_stages=2)
    # 32 x 32 on 4 warps, 2 stages: forward+backward 1.07x the 16-bit blocks at 8x2048x32x64
    # causal and 2.76x at 4x4096x16x128 causal (results/features_NVIDIA_H200_20261129-111921.json,
    # -114127.json); 32 x 64 on 8 warps ran 1.06x it at D = 128 causal, 0.96-1.00x elsewhere
    # (-125700.json).
    bp = BwdParams(q_blocksize=32, kv_blocksize=32, num_warps=4, num_stages=2)
    if d > 64 and plain_causal:
        bp = dataclasses.replace(bp, kv_blocksize=64, num_warps=8)
    if d <= 64:
        if plain_causal:  # the 16-bit forward's 1.2 KB spill costs less than fewer rows
            return FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=8, num_stages=3), bp
        # Elsewhere it spills 1-3 KB (with a feature) and 64 x 64 on 8 warps, 3 stages at most
        # 772 bytes (triton_sass.py); without a mask that ran 1.08x it at 8x2048x32x64
        # (results/features_NVIDIA_H200_20261129-125249.json); causal 0.73x (-111921.json).
        return FwdParams(q_blocksize=64, kv_blocksize=64, num_warps=8, num_stages=3), bp
    # At D = 128, 32 x 64 on 4 warps ran the causal forward 15.4x the 16-bit blocks (-113536.json,
    # -114127.json), but without a mask, or with a mask tensor, ptxas fits it in 32 registers
    # and spills 13 KB a thread: 574 ms against 46 ms on 8 warps at 4x4096x16x128
    # (-124136.json, -125019.json). On 8 warps it spills nothing with any feature
    # (triton_sass.py), and ran 0.94x 4 warps causal.
    warps = 4 if plain_causal else 8
    return FwdParams(q_blocksize=32, kv_blocksize=64, num_warps=warps, num_stages=2), bp


# A decoding call's key splits: until about this many programs run (two a multiprocessor on an
# H200). 256 ran 1.02-1.14x 512 at four of seven decoding shapes and 0.98x at
# 1x1:32768x32(8 kv)x128; at the other two both counts split nothing
# (results/decode_NVIDIA_H200_20261129-142753.json). 128-row tiles (8 warps, three stages of
# 128-key blocks) take a multiprocessor each: there 128 programs ran 1.03-1.12x 256 at
# 4x32:16384x32(8 kv)x128 and 1x128:32768x32(8 kv)x128 causal (-181613.json).
DECODE_PROGRAMS = 256
DECODE_MIN_BLOCKS = 4  # key blocks a split walks at least
# Key blocks of a 16-bit decoding forward at head dims over 128, on three stages: at four
# Gemma-like shapes (16 heads, 8 kv, head dim 256; 1-128 queries) 0.89-1.00x the fastest of eight
# blocks, where 32 keys on two stages ran 0.83-0.95x
# (results/decode_NVIDIA_H200_20261129-210334.json); beside them again at seven shapes 1.12-1.52x
# (-210755.json). They spill nothing (benchmarks/NOTES.md, fifty-eighth round).
DECODE_WIDE_HEAD_KEYS = 64
# A float32 decoding forward's most query rows a block above head dim 128 (64 up to it; 32-key
# blocks, two stages, the training forward's warps). Compiled for sm_90a (triton_sass.py): at head
# dim 256, 64 rows spill 28 KB a thread on 4 warps (3.3 KB on 8), where a 13 KB spill had run 12x
# slower (_float32_blocks), and 16 rows, the training blocks there, nothing. At head dim 128
# without a mask 4 warps spill 280-2360 bytes (16-64 rows) and 8 nothing. Timed against the old
# blocks (4 warps, up to 64 rows): at head dim 256, 1.47x and 1.57x at 4x16:8192x16(8 kv)x256
# causal and not, 11.2x at 2x64 causal; 8 warps on 64 rows, 1.70x and 1.73x at head dim 128
# (results/decode_NVIDIA_H200_20261129-224342.json to -224630.json).
DECODE_FLOAT32_WIDE_HEAD_ROWS = 16
# A float32 decoding forward whose rows fit one 16-row block at head dims up to 128 walks 64-key
# blocks on 4 warps: 1.52-1.85x the 32-key blocks on the training forward's 8 warps at
# 1x1:32768x32(8 kv)x128, 8x1:8192x32(8 kv)x128 and 8x1:8192x16x64, where 32 keys on 4 warps ran
# 1.05-1.10x 8 warps (results/decode_NVIDIA_H200_20261129-224926.json, -230141.json). On more rows
# 8 warps ran 1.08-1.73x 4 (-224342.json). Compiled for sm_90a (triton_sass.py) it spills 420
# bytes a thread at head dim 128 without a mask (the timed calls), nothing causal or with a bias
# or dropout.
DECODE_FLOAT32_FEW_ROWS_KEYS = 64


def _decoding_params(shape: AttentionShape) -> FwdParams | None:
    """The forward of a decoding call (:func:`._backend.decoding_rows`), or None for any other
    call: the queries' rows in as few q blocks as fit (a GQA group folded into one where
    :func:`._backend.foldable`), the keys split so that the programs fill the GPU. 128-key blocks
    on 4 warps and 3 stages ran within 5% of the fastest blocks tried at 6 of 7 and 10 of 11
    decoding shapes of up to 64 rows in two runs (0.92x and 0.94x at the others;
    results/decode_NVIDIA_H200_20261129-142753.json, -143452.json); 128 rows on 8 warps were the
    fastest of ten blocks at 32 queries of a GQA group of 4 and at 128 queries
    (-181613.json: 2.2x the unsplit forward, 2.4x cuDNN without a mask), and split two ways at 256
    queries a head (-184738.json: 1.22-1.24x the unsplit 64-row forward)."""
    if decoding_rows(shape) is None:
        return None
    d = _block_d(shape.head_dim)
    float32 = shape.dtype == "float32"  # products as FMAs, their operands in registers
    if float32:
        most, stages = (64 if d <= 128 else DECODE_FLOAT32_WIDE_HEAD_ROWS), 2
    else:
        most, kv_block, stages = (128, 128, 3) if d <= 128 else (64, DECODE_WIDE_HEAD_KEYS, 3)
    rows = folded_rows(shape, most)
    q_block = max(_MIN_BLOCK, _next_pow2(min(rows, most)))
    folded = rows > shape.seq_q
    heads = shape.kv_heads if folded else shape.heads
    warps = 4 if q_block <= 64 else 8
    if float32:
        few = d <= 128 and q_block == _MIN_BLOCK
        kv_block = DECODE_FLOAT32_FEW_ROWS_KEYS if few else 32
        if not few:  # the training forward's warps (_float32_blocks), measured there
            warps = _float32_blocks(shape)[0].num_warps
    return FwdParams(
        q_blocksize=q_block,
        kv_blocksize=kv_block,
        num_warps=warps,
        num_stages=stages,
        kv_splits=_key_splits(shape.batch * heads, rows, q_block, shape.seq_k, kv_block),
    )


def _key_splits(heads: int, rows: int, block_rows: int, keys: int, block_keys: int) -> int:
    """How many ways a decoding kernel's programs split each q tile's keys: until about
    ``DECODE_PROGRAMS`` programs run (half as many of tiles over 64 rows), each walking at least
    ``DECODE_MIN_BLOCKS`` key blocks. ``heads`` counts (batch, head) pairs of ``rows`` rows."""
    tiles = heads * _cdiv(rows, block_rows)
    programs = DECODE_PROGRAMS if block_rows <= 64 else DECODE_PROGRAMS // 2
    runs = max(1, _cdiv(keys, block_keys * DECODE_MIN_BLOCKS))
    return max(1, min(runs, programs // tiles))


def _dq_splits(shape: AttentionShape, bp: BwdParams) -> int:
    """Key splits of a decoding call's dQ kernel, whose few q tiles each walk every key, as the
    forward's (:func:`_key_splits`)."""
    run = dq_launch(bp)
    rows = _clamp_block(run.rows, shape.seq_q, "dQ rows")
    cols = _clamp_block(run.cols, shape.seq_k, "dQ columns")
    return _key_splits(shape.batch * shape.heads, shape.seq_q, rows, shape.seq_k, cols)


def heuristic(shape: AttentionShape) -> tuple[FwdParams, BwdParams]:
    """Hopper-friendly block sizes for the head dim, shrunk for short sequences."""
    # From sweeps on an H200 in bf16 (results/portable_sweep_NVIDIA_H200_20261121-184554.json and
    # the two before it): the forward with 64 x 64, 4 warps, 3 stages was the fastest of the blocks
    # swept then at 5 of 6 shapes (2x8192 and 4x4096 x16x128, 8x2048x32x64, causal and not),
    # 1.02-1.10x the blocks before it, and 0.97x the fastest at 4x4096x16x128; it stays at D = 128
    # (at D = 64, below, a later sweep with 128 x 64 among the blocks moved it). The backward from
    # portable_sweep_NVIDIA_H200_20261122-002211 and -002627 (forward+backward): at D = 128 both
    # kernels keeping 128 rows and streaming 64 with 8 warps and 3 stages (mirrored) ran
    # 1.02-1.07x the 64 x 64, 4-warp blocks before it, causal and not; at D = 64 mirrored 64 kept
    # and 32 streamed ran 1.05-1.06x causal (since beaten by mirrored_half, then mirrored_wide,
    # below), and 64 x 64 with 3 stages stayed fastest without a mask.
    d = _block_d(shape.head_dim)
    if d <= 64:
        # 128 x 64 on 8 warps ran 1.02-1.07x 64 x 64 on 4 at 8x2048x32x64 and 2x8192x32x64, causal
        # and not (portable_sweep_NVIDIA_H200_20261123-054724.json, -054814.json)
        fp = FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=8, num_stages=3)
        # With a feature the causal blocks below spill in the dK/dV kernel (segment ids 272 bytes,
        # dropout 164, a soft cap 132, a bias 332; with GQA a mask 104, a window 72); 64 x 64 on
        # 4 warps spills little or nothing and ran forward+backward 1.09-1.85x them at
        # 8x2048x32x64 causal, with GQA too: segment ids 1.85x, dropout 1.09x, a soft cap
        # 1.13-1.16x, a bias 1.10-1.11x, a mask 1.09-1.11x, a window 1.14x
        # (results/features_NVIDIA_H200_20261128-194741.json, 20261129-053037.json, -053743.json).
        if shape.spec.causal and shape.spec.features == {"causal"}:
            # dK/dV keeping 128 keys on 4 warps and streaming 32; dQ keeping 128 rows on 8 and
            # streaming 64. Forward+backward 1.008-1.044x dQ keeping 64 rows on 4 warps
            # (mirrored_half) at 8x2048x32x64 and 2x8192x32x64 causal, alone about as fast but at
            # the power cap clocked higher (results/revision_ab_NVIDIA_H200_20261128-114527.json,
            # -114930.json); mirrored_half had run 1.020-1.021x both keeping 64 (-102809.json).
            bp = BwdParams(
                q_blocksize=32, kv_blocksize=128, num_warps=4, num_stages=3, variant=MIRRORED_WIDE
            )
        else:
            bp = BwdParams(q_blocksize=64, kv_blocksize=64, num_warps=4, num_stages=3)
    elif d <= 128:
        fp = FwdParams(q_blocksize=64, kv_blocksize=64, num_warps=4, num_stages=3)
        if shape.spec.causal and {"dropout", "bias", "attention_mask"} & shape.spec.features:
            # ptxas serializes every wgmma of 64 x 64 blocks on 4 warps with dropout or a bias
            # here (C7515). 128 x 64 on 8 warps does not, and ran forward 1.18x (dropout), 1.56x
            # (bias) and 1.22x (mask) them, forward+backward 1.04x, 1.11x and 1.06x, at
            # 4x4096x16x128 causal (results/features_NVIDIA_H200_20261128-195336.json,
            # 20261129-052834.json); with a soft cap, segment ids or a window, 0.93-0.95x.
            fp = FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=8, num_stages=3)
        bp = BwdParams(
            q_blocksize=64, kv_blocksize=128, num_warps=8, num_stages=3, variant=MIRRORED
        )
    else:
        # 128 x 64 on 8 warps ran the forward 1.27-2.25x 64 x 64 (its blocks before) at
        # 2x4096x8x256, causal and not, plain and with a soft cap, a bias, dropout or segment ids;
        # 64 x 64 on 4 warps and 3 stages 0.95-1.05x it plain, with a soft cap or segment ids, but
        # 0.58-0.70x with a bias or causal dropout (results/features_NVIDIA_H200_20261201-004924.json,
        # -005056.json)
        fp = FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=8, num_stages=2)
        # dV and dK in programs of their own, each keeping 128 keys on 8 warps and streaming 32
        # queries: one float32 accumulator a program, wgmma without a spill with every feature
        # (triton_sass.py), where keeping both spilled on any wgmma block. Forward+backward
        # 1.21-1.51x the blocks before (mirrored 32 x 64 on 8 warps plain, else 32 x 32 on 4 with
        # mma.sync, dQ on 64 rows with dropout) at 2x4096x8x256, causal and not, plain, with a
        # soft cap, segment ids or dropout; against 32 x 32 1.38-1.66x at 1x8192x16(8 kv)x256 and
        # 4x2048x16x256, 1.29-1.70x with a bias, a mask or 256 keys a side. Streaming 16 queries
        # on 3 or 4 stages ran 0.76-0.88x these, keeping 64 keys 0.55-0.81x
        # (results/features_NVIDIA_H200_20261201-025147.json, -030009.json, -030342.json).
        bp = BwdParams(
            q_blocksize=32, kv_blocksize=128, num_warps=8, num_stages=2, variant=SPLIT_DKDV
        )
    if shape.dtype == "float32":
        fp, bp = _float32_blocks(shape)
    decoding = _decoding_params(shape)
    if decoding is not None and shape.seq_q <= 64 and shape.dtype != "float32":
        # The rule above would give the dQ kernel 16 x 16 tiles here (its rows clamped to the
        # queries). Plain blocks keep the queries' rows and stream 64 keys: forward+backward at
        # 2x16:8192x8x128 with every feature they ran 0.194 ms where 16 x 16 tiles on 8 warps ran
        # 0.244 ms (results/small_tiles_tune_NVIDIA_H200_20261129-171500.json); at 32 and 64
        # queries against 16384 keys (GQA, causal) 830 and 764 us where the rule above ran 1013
        # and 868 with its dQ keys split (decode_NVIDIA_H200_20261129-184414.json, -184128.json,
        # -185644.json, -185714.json).
        bp = BwdParams(q_blocksize=16, kv_blocksize=64, num_warps=4, num_stages=2)
    fp = shrink_to_fit(
        shape,
        decoding or fp,
        lambda p: _fits(shape, p, backward=False),
        _MIN_BLOCK,
        q_rows=decoding and decoding.q_blocksize,
    )
    bp = shrink_to_fit(shape, bp, lambda p: _fits(shape, p, backward=True), _MIN_BLOCK)
    if decoding is not None:
        bp = dataclasses.replace(bp, kv_splits=_dq_splits(shape, bp))
    return fp, bp


def candidates(shape: AttentionShape) -> list[tuple[FwdParams, BwdParams]]:
    """Configs for the tuner: forward variants with the heuristic backward, then backward variants
    with the heuristic forward (among them the heuristic's backward with its dQ kernel on fewer
    stages, where ptxas serialized its wgmmas with a bias or a mask, and in float32 small blocks
    that do not spill), leaving out those that cannot fit or are larger than needed."""
    heur_f, heur_b = heuristic(shape)
    fwds = [
        FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s)
        for bq in (64, 128)
        for bk in (32, 64, 128)
        for w in (4, 8)
        for s in (2, 3, 4)
    ]
    bwds = [
        BwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s)
        for bq, bk in ((32, 64), (64, 64), (32, 128), (64, 128), (128, 64), (128, 128))
        for w in (4, 8)
        for s in (1, 2, 3)
    ]
    bwds += [
        BwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s, variant=variant)
        for variant in (MIRRORED, MIRRORED_HALF, MIRRORED_WIDE)
        for bq, bk in ((32, 64), (32, 128), (64, 128))
        for w in (4, 8)
        for s in (3, 4)
    ]
    if shape.head_dim > 128:
        # dK/dV on mma.sync blocks that do not spill, dQ on wgmma ones (on 2 stages they ran
        # 0.89-0.93x 3, results/features_NVIDIA_H200_20261201-023207.json)
        bwds += [
            BwdParams(q_blocksize=32, kv_blocksize=32, num_warps=4, num_stages=3, variant=TALL_DQ)
        ]
    bwds += [dataclasses.replace(heur_b, dq_num_stages=s) for s in range(1, heur_b.num_stages)]
    if shape.dtype == "float32":
        # the 16-bit blocks above spill in float32 (the 16-bit heuristic's dK/dV kernel 91140
        # bytes a thread at D = 128); small ones hold the FMA operands
        fwds += FLOAT32_FWD_CANDIDATES
        bwds += [  # (32 x 64 on 8 warps, 2 stages, is among the 16-bit ones)
            BwdParams(q_blocksize=bq, kv_blocksize=32, num_warps=4, num_stages=2) for bq in (16, 32)
        ]
    if _decoding_params(shape) is not None:
        # decoding: the heuristic's forward with half and twice the splits, 64-key blocks, fewer
        # stages (each within 0-14% of it somewhere in results/decode_NVIDIA_H200_20261129-142753.json)
        splits = {max(1, heur_f.kv_splits // 2), heur_f.kv_splits * 2}
        fwds = [dataclasses.replace(heur_f, kv_splits=n) for n in sorted(splits)]
        fwds += [dataclasses.replace(heur_f, kv_blocksize=64, num_stages=s) for s in (3, 4)]
        fwds += [dataclasses.replace(heur_f, num_stages=2)]
        splits = {max(1, heur_b.kv_splits // 2), heur_b.kv_splits * 2} - {heur_b.kv_splits}
        bwds += [dataclasses.replace(heur_b, kv_splits=n) for n in sorted(splits)]
    out = [(heur_f, heur_b)]
    out += [(f, heur_b) for f in fwds if f != heur_f and _fits(shape, f, backward=False)]
    out += [(heur_f, b) for b in bwds if b != heur_b and _fits(shape, b, backward=True)]
    return out


def _available() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    if jax.default_backend() == "gpu":
        return importlib.util.find_spec("jax_triton") is not None
    return True  # the interpreter runs the kernels anywhere (slowly: for tests)


BACKEND = register_backend(
    AttentionBackend(
        platform="triton",
        variant="triton",
        devices=("gpu",),
        fwd=fwd,
        bwd=bwd,
        unsupported=frozenset(),
        heuristic=heuristic,
        candidates=candidates,
        available=_available,
        splits_keys=True,
    )
)
