"""Triton flash-attention kernels: forward, and a FlashAttention-2 style backward without atomics.

Imported only through :func:`ejkfn._triton_interpret.load_kernels`, which decides first whether
Triton runs compiled or in its interpreter (the choice is made when ``triton`` is first imported).

Layouts: q/out/dout ``[B, Sq, H, D]``, k/v ``[B, Sk, KVH, D]``, lse/delta ``[B, H, Sq]`` float32,
bias/mask ``[B|1, H|1, Sq|1, Sk|1]`` (a broadcast dimension has stride 0), segment ids ``[B, 3, S]``:
each row's id, then the first and past-the-last row of the other side in its segment
(``_backend.segment_spans``), from which a block's loop skips the blocks no segment of it reaches.
Each kernel is also ``@no_type_check`` so that jaxtyping's import hook (used by the test run) leaves
it undecorated: Triton reads the function's own source and globals.

Every size, stride and feature switch is a ``tl.constexpr``: JAX shapes are static, so a stride that
is a compile-time constant costs nothing and lets Triton prove alignment and vectorise loads.

Scores are kept in base-2 units (``s * log2(e)``) so that the softmax uses ``exp2``; the returned
log-sum-exp is in natural units, as the contract says. Masking is applied only on the key blocks
that need it: with no window, segment ids or mask, a q block runs over the key blocks it sees
entirely, and (causal diagonal, ragged last block) over the rest with the visibility mask; the
forward takes the masked blocks first where q and key blocks differ in size (see ``fwd_kernel``).
"""

from typing import no_type_check

import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
_GOLDEN = tl.constexpr(0x9E3779B1)
_M1 = tl.constexpr(0x7FEB352D)
_M2 = tl.constexpr(0x846CA68B)
_PAIR_HASH_MIN_KEYS = tl.constexpr(32)  # narrower key blocks hash every score (``_keep_tile``)


@triton.jit
@no_type_check
def _mix32(x):
    # lowbias32, exactly as ejkfn.attention._dropout.mix32 (uint32 arithmetic, logical shifts).
    x = x ^ (x >> 16)
    x = x * _M1
    x = x ^ (x >> 15)
    x = x * _M2
    x = x ^ (x >> 16)
    return x


@triton.jit
@no_type_check
def _row(b, h, rows, HEADS: tl.constexpr, SEQ_Q: tl.constexpr):
    """The counters of score rows ``(b, h, rows)`` (``_dropout``)."""
    return (b.to(tl.uint32) * HEADS + h.to(tl.uint32)) * SEQ_Q + rows.to(tl.uint32)


@triton.jit
@no_type_check
def _keep(key, b, h, rows, cols, HEADS: tl.constexpr, SEQ_Q: tl.constexpr, THRESH: tl.constexpr):
    """Dropout keep decision for the broadcast index tiles ``rows``/``cols`` (see ``_dropout``),
    one hash a score; ``key`` is the seed mixed once (:func:`_seed_key`)."""
    row = _row(b, h, rows, HEADS, SEQ_Q)
    cols = cols.to(tl.uint32)
    bits = _mix32((row * _GOLDEN + (cols >> 1)) ^ key)
    return bits << ((1 - (cols & 1)) * 16) >= THRESH


@triton.jit
@no_type_check
def _keep_tile(
    key, b, h, rows, col0, BLOCK_K: tl.constexpr, HEADS: tl.constexpr, SEQ_Q: tl.constexpr,
    THRESH: tl.constexpr,
):  # fmt: skip
    """``_keep`` of the ``[rows, col0 + arange(BLOCK_K)]`` tile (``col0`` even), one hash a pair
    of columns: interleaved, the halves land where a wgmma accumulator holds neighbouring columns,
    so this costs no data movement (the loops' SASS: 0.6x ``_keep``'s dropout instructions).

    Blocks narrower than ``_PAIR_HASH_MIN_KEYS`` hash every score: Triton 3.6's build of the
    interleave on 16-row, 16-key tiles beside a mask tile's load gave wrong outputs and dQ on an
    H200 (relative error 1.2-2.3, any warps or stages; the interpreter right, and every score
    hashed right; benchmarks/NOTES.md, fifty-sixth round)."""
    if BLOCK_K < _PAIR_HASH_MIN_KEYS:
        cols = col0 + tl.arange(0, BLOCK_K)
        return _keep(key, b, h, rows[:, None], cols[None, :], HEADS, SEQ_Q, THRESH)
    row = _row(b, h, rows, HEADS, SEQ_Q)
    pairs = (col0 // 2 + tl.arange(0, BLOCK_K // 2)).to(tl.uint32)
    bits = _mix32((row[:, None] * _GOLDEN + pairs[None, :]) ^ key)
    return tl.interleave(bits << 16, bits) >= THRESH


@triton.jit
@no_type_check
def _seed_key(Seed):
    return _mix32(tl.load(Seed).to(tl.uint32))


@triton.jit
@no_type_check
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): saturates cleanly to +-1 (exp overflow gives 1, underflow gives -1).
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * _LOG2E)) + 1.0)


@triton.jit
@no_type_check
def _scores(
    qk,
    rows,
    cols,
    bias_base,
    qseg_base,
    kvseg_base,
    mask_base,
    MASKED: tl.constexpr,
    SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SEQ_Q: tl.constexpr,
    SEQ_K: tl.constexpr,
    SBM: tl.constexpr,
    SBN: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SMM: tl.constexpr,
    SMN: tl.constexpr,
    ROW_GROUP: tl.constexpr = 1,
    CHECK_ROWS: tl.constexpr = True,
    CHECK_COLS: tl.constexpr = True,
):
    """Logits in base-2 units (``-inf`` where not visible, when ``MASKED``), and ``tanh(s / cap)``
    (for the soft cap's derivative; else ``qk``). ``rows``/``cols`` broadcast to the tile; the
    ``CHECK_*`` flags as :func:`_visible`'s."""
    t = qk
    if SOFT_CAP == 0 and not HAS_BIAS:
        s2 = qk * (SCALE * _LOG2E)  # one multiply a score, not two
    else:
        if SOFT_CAP > 0:
            t = _tanh(qk * (SCALE / SOFT_CAP))
            s = t * SOFT_CAP
        else:
            s = qk * SCALE
        if HAS_BIAS:
            inb = (rows < SEQ_Q) & (cols < SEQ_K)
            s += tl.load(bias_base + rows * SBM + cols * SBN, mask=inb, other=0.0).to(tl.float32)
        s2 = s * _LOG2E
    if MASKED:
        ok = _visible(
            rows, cols, qseg_base, kvseg_base, mask_base, SEQ_Q, SEQ_K, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, HAS_SEG, HAS_MASK, SMM, SMN, ROW_GROUP, CHECK_ROWS, CHECK_COLS,
        )  # fmt: skip
        s2 = tl.where(ok, s2, float("-inf"))
    return s2, t


@triton.jit
@no_type_check
def _probs(
    qk,
    lse2,
    rows,
    cols,
    bias_base,
    qseg_base,
    kvseg_base,
    mask_base,
    MASKED: tl.constexpr,
    SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SEQ_Q: tl.constexpr,
    SEQ_K: tl.constexpr,
    SBM: tl.constexpr,
    SBN: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SMM: tl.constexpr,
    SMN: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    CHECK_COLS: tl.constexpr,
):
    """The backward's probabilities ``exp2(s - lse2)`` (0 where not visible) and ``t`` as
    :func:`_scores` gives it; ``lse2`` broadcasts to the tile, the ``CHECK_*`` flags as
    :func:`_visible`'s."""
    if SOFT_CAP == 0 and not HAS_BIAS and WINDOW_LEFT < 0 and WINDOW_RIGHT < 0:
        # The scale folds into the exponent's fused multiply-add and hidden scores are zeroed
        # after it: masked to -inf before, each took a multiply and a subtract more, and the dQ
        # kernel ran 3.4% slower at 8x2048x32x64 causal (NOTES.md, eightieth round). With a
        # window ptxas fenced the dK/dV kernel's wgmmas for it (C7519).
        p = tl.exp2(qk * (SCALE * _LOG2E) - lse2)
        if MASKED:
            ok = _visible(
                rows, cols, qseg_base, kvseg_base, mask_base, SEQ_Q, SEQ_K, CAUSAL, WINDOW_LEFT,
                WINDOW_RIGHT, HAS_SEG, HAS_MASK, SMM, SMN, 1, CHECK_ROWS, CHECK_COLS,
            )  # fmt: skip
            p = tl.where(ok, p, 0.0)
        return p, qk
    s, t = _scores(
        qk, rows, cols, bias_base, qseg_base, kvseg_base, mask_base, MASKED, SCALE, SOFT_CAP,
        HAS_BIAS, SEQ_Q, SEQ_K, SBM, SBN, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEG, HAS_MASK,
        SMM, SMN, 1, CHECK_ROWS, CHECK_COLS,
    )  # fmt: skip
    return tl.exp2(s - lse2), t


@triton.jit
@no_type_check
def _visible(
    rows,
    cols,
    qseg_base,
    kvseg_base,
    mask_base,
    SEQ_Q: tl.constexpr,
    SEQ_K: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SMM: tl.constexpr,
    SMN: tl.constexpr,
    ROW_GROUP: tl.constexpr = 1,
    CHECK_ROWS: tl.constexpr = True,
    CHECK_COLS: tl.constexpr = True,
):
    """Which (row, col) pairs of the broadcast index tiles are visible (the spec's rules). Row
    ``r`` is query ``r // ROW_GROUP`` (a forward with a GQA group folded into its rows). Without
    ``CHECK_ROWS`` / ``CHECK_COLS`` the caller knows its rows / cols lie inside the sequence."""
    # (``x == x`` folds to true: a bound test costs each score a compare and a select, SASS)
    inb = (rows < SEQ_Q) if CHECK_ROWS else (rows == rows)
    inb = inb & ((cols < SEQ_K) if CHECK_COLS else (cols == cols))
    ok = inb
    pos = rows // ROW_GROUP + (SEQ_K - SEQ_Q // ROW_GROUP)
    if CAUSAL:
        ok = ok & (cols <= pos)
    if WINDOW_LEFT >= 0:
        ok = ok & (cols >= pos - WINDOW_LEFT)
    if WINDOW_RIGHT >= 0:
        ok = ok & (cols <= pos + WINDOW_RIGHT)
    if HAS_SEG:
        qs = tl.load(qseg_base + rows, mask=rows < SEQ_Q, other=-1)
        ks = tl.load(kvseg_base + cols, mask=cols < SEQ_K, other=-2)
        ok = ok & (qs == ks)
    if HAS_MASK:
        mk = tl.load(mask_base + rows * SMM + cols * SMN, mask=inb, other=0)
        ok = ok & (mk != 0)
    return ok


@triton.jit
@no_type_check
def _tile(pid, BLOCKS: tl.constexpr, BAND: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """(block along the sequence, batch * head pair) of program ``pid`` on a one-dimensional grid,
    numbered as ``_backend.banded_tile`` does. With ``HEAVY_LAST`` (causal q blocks) the last
    block runs first."""
    per_band = BAND * BLOCKS
    r = pid % per_band
    block = r // BAND
    if HEAVY_LAST:
        block = BLOCKS - 1 - block
    return block, pid // per_band * BAND + r % BAND


@triton.jit
@no_type_check
def _kv_blocks(
    m0,
    SEQ_Q: tl.constexpr,
    SEQ_K: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    SPLIT: tl.constexpr,
    ROW_GROUP: tl.constexpr = 1,
):
    """Key range ``[lo, hi)`` a q block starting at ``m0`` may see, and its fully visible blocks
    ``[full_lo, full_hi)``, which need no mask: the blocks before them (a window's left edge) and
    after them (the causal diagonal, a window's right edge, a ragged end) do. Without ``SPLIT``
    every block is masked (``full_lo == full_hi == lo``). Row ``r`` is query ``r // ROW_GROUP``."""
    shift = SEQ_K - SEQ_Q // ROW_GROUP
    first = m0 // ROW_GROUP  # the block's first and one past its last query
    end = (m0 + BLOCK_Q - 1) // ROW_GROUP + 1
    lo = m0 * 0
    hi = m0 * 0 + SEQ_K
    if CAUSAL:
        hi = tl.minimum(hi, end + shift)
    if WINDOW_RIGHT >= 0:
        hi = tl.minimum(hi, end + (shift + WINDOW_RIGHT))
    if WINDOW_LEFT >= 0:
        lo = tl.maximum(first + (shift - WINDOW_LEFT), 0) // BLOCK_K * BLOCK_K
    full_lo = lo
    full_hi = lo
    if SPLIT:
        # a block is whole where the first query sees its last key and the last query its first
        full_hi = m0 * 0 + (SEQ_K // BLOCK_K) * BLOCK_K
        if CAUSAL:
            full_hi = tl.minimum(full_hi, tl.maximum(first + (shift + 1), 0) // BLOCK_K * BLOCK_K)
        if WINDOW_RIGHT >= 0:
            seen = tl.maximum(first + (shift + WINDOW_RIGHT + 1), 0)
            full_hi = tl.minimum(full_hi, seen // BLOCK_K * BLOCK_K)
        if WINDOW_LEFT >= 0:
            unseen = tl.maximum(end + (shift - 1 - WINDOW_LEFT), 0)
            full_lo = (unseen + BLOCK_K - 1) // BLOCK_K * BLOCK_K
        if WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0:  # a window's edges may leave no whole block
            full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
            full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, hi, full_lo, full_hi


@triton.jit
@no_type_check
def _split_run(lo, hi, full_lo, full_hi, split, KV_SPLITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Run ``split`` of ``KV_SPLITS`` runs of whole key blocks of ``[lo, hi)``, as ``(lo, hi,
    full_lo, full_hi)``: ``lo`` stays a multiple of ``BLOCK_K``, and a run past ``hi`` is empty."""
    n_blocks = (tl.maximum(hi - lo, 0) + BLOCK_K - 1) // BLOCK_K
    run = (n_blocks + KV_SPLITS - 1) // KV_SPLITS * BLOCK_K
    lo = lo + split * run
    hi = tl.minimum(hi, lo + run)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    return lo, hi, full_lo, tl.minimum(tl.maximum(full_hi, full_lo), hi)


@triton.jit
@no_type_check
def _masked_run(lo, hi, full_lo, full_hi, EDGES: tl.constexpr):
    """The masked loop's ``(lo, hi, gap)`` over blocks ``[lo, hi)`` whose ``[full_lo, full_hi)``
    run unmasked: with ``EDGES`` (a window's two edges) one run that steps ``gap`` blocks' keys or
    queries over the interior; otherwise the blocks after it."""
    gap = full_hi - full_lo
    if EDGES:
        masked_lo = lo
        masked_hi = hi - gap
    else:
        masked_lo = full_hi
        masked_hi = hi
    return masked_lo, masked_hi, gap


@triton.jit
@no_type_check
def _q_blocks(
    n0,
    SEQ_Q: tl.constexpr,
    SEQ_K: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Query range ``[lo, hi)`` that may see the key block starting at ``n0``, and the q blocks
    ``[full_lo, full_hi)`` that see all of it (need no mask): those before them (the causal
    diagonal, a window's right edge) and after them (a window's left edge) do. Without ``SPLIT``
    every block is masked (``full_lo == full_hi == hi``)."""
    shift = SEQ_K - SEQ_Q
    lo = n0 * 0
    hi = n0 * 0 + SEQ_Q
    if CAUSAL:
        lo = tl.maximum(n0 - shift, 0) // BLOCK_Q * BLOCK_Q
    if WINDOW_RIGHT >= 0:
        lo = tl.maximum(lo, tl.maximum(n0 - (shift + WINDOW_RIGHT), 0) // BLOCK_Q * BLOCK_Q)
    if WINDOW_LEFT >= 0:
        hi = tl.minimum(hi, n0 + (BLOCK_K + WINDOW_LEFT - shift))
    full_lo = hi
    full_hi = hi
    if SPLIT:
        # a q block is whole where its first query sees the last key and its last query the first
        full_lo = lo
        if CAUSAL:
            first = tl.maximum(n0 + (BLOCK_K - 1 - shift), 0)
            full_lo = tl.maximum(full_lo, (first + BLOCK_Q - 1) // BLOCK_Q * BLOCK_Q)
        if WINDOW_RIGHT >= 0:
            first = tl.maximum(n0 + (BLOCK_K - 1 - shift - WINDOW_RIGHT), 0)
            full_lo = tl.maximum(full_lo, (first + BLOCK_Q - 1) // BLOCK_Q * BLOCK_Q)
        full_lo = tl.minimum(full_lo, hi)
        if WINDOW_LEFT >= 0:  # the window's edges may leave no whole block
            seen = tl.maximum(n0 + (WINDOW_LEFT + 1 - shift), 0)
            full_hi = tl.minimum(tl.maximum(seen // BLOCK_Q * BLOCK_Q, full_lo), hi)
    return lo, hi, full_lo, full_hi


@triton.jit
@no_type_check
def _segment_span(spans, idx, lo, hi, N: tl.constexpr, OTHER: tl.constexpr, BLOCK: tl.constexpr):
    """``[lo, hi)`` cut to the span (rows of the other side, of ``OTHER``) that the segments of
    rows ``idx`` reach: ``spans`` holds each row's first, then (``N`` on) its end; ``lo`` stays a
    multiple of ``BLOCK``. Empty (``lo >= hi``) where no row shares a segment with the other side."""
    inside = idx < N
    first = tl.min(tl.load(spans + idx, mask=inside, other=OTHER), 0)
    end = tl.max(tl.load(spans + N + idx, mask=inside, other=0), 0)
    return tl.maximum(lo, first // BLOCK * BLOCK), tl.minimum(hi, end)


# ----------------------------------------------------------------------------------------------
# Forward


@triton.jit
@no_type_check
def _row_sum_parts(p, BLOCK_K: tl.constexpr, PARTS: tl.constexpr):
    """``p``'s row sums in ``PARTS`` parts: those of its columns ``c`` with ``c % PARTS`` alike.

    A wgmma accumulator gives each thread the same two columns of every 8, so with 8 parts the
    sum stays within each thread, and the rows' sums can cross threads once, after the loop,
    instead of by shuffles in every step (9% of the forward's stall samples at 4x4096x16x128;
    benchmarks/NOTES.md, eighty-fourth round). Float32 products run on FMAs in other layouts,
    where 8 parts spilled: they take one."""
    return tl.sum(tl.reshape(p, [p.shape[0], BLOCK_K // PARTS, PARTS]), 1)


@triton.jit
@no_type_check
def _fwd_inner(
    acc,
    l_parts,
    m_i,
    q,
    b,
    h,
    rows,
    k_base,
    v_base,
    bias_base,
    mask_base,
    qseg_base,
    kvseg_base,
    drop_key,
    start,
    stop,
    gap_at,
    gap,
    MASKED: tl.constexpr,
    HEADS: tl.constexpr,
    SEQ_Q: tl.constexpr,
    SEQ_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SKS: tl.constexpr,
    SVS: tl.constexpr,
    SBM: tl.constexpr,
    SBN: tl.constexpr,
    SMM: tl.constexpr,
    SMN: tl.constexpr,
    SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DROP_THRESH: tl.constexpr,
    DROP_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROW_GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GAP: tl.constexpr,
):
    # With ``GAP`` the key blocks from ``gap_at`` on lie ``gap`` keys further on (the masked loop
    # steps over the unmasked blocks between a window's two edges).
    offs_d = tl.arange(0, BLOCK_D)
    # No bias or cap and a positive scale: the row max of the raw products, scaled once, is the
    # max of the logits, and the scale folds into the exponent's fused multiply-add.
    RAW_MAX: tl.constexpr = not MASKED and SOFT_CAP == 0 and not HAS_BIAS and SCALE > 0
    for n0 in range(start, stop, BLOCK_K):
        if GAP:
            n0 = tl.where(n0 >= gap_at, n0 + gap, n0)
        cols = n0 + tl.arange(0, BLOCK_K)
        # Masked loads even where the block lies inside the keys: without masks, causal kernels
        # (two loops) ran 19-22% slower on an H200 (benchmarks/NOTES.md, ninth round).
        kv_mask = (cols[:, None] < SEQ_K) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_base + cols[:, None] * SKS + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if RAW_MAX:
            # Every key is visible, so every row's max is finite from the first block on.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * (SCALE * _LOG2E))
            p = tl.exp2(qk * (SCALE * _LOG2E) - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
        else:
            s, _t = _scores(
                qk, rows[:, None], cols[None, :], bias_base, qseg_base, kvseg_base, mask_base,
                MASKED, SCALE, SOFT_CAP, HAS_BIAS, SEQ_Q, SEQ_K, SBM, SBN, CAUSAL, WINDOW_LEFT,
                WINDOW_RIGHT, HAS_SEG, HAS_MASK, SMM, SMN, ROW_GROUP,
            )  # fmt: skip
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no visible key keeps m = -inf; shift it by 0 so exp2 gives 0,
            # not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
        l_parts = l_parts * alpha[:, None] + _row_sum_parts(p, BLOCK_K, l_parts.shape[1])
        if DROP_SCALE != 1.0:  # dropout on
            p = tl.where(
                _keep_tile(drop_key, b, h, rows, n0, BLOCK_K, HEADS, SEQ_Q, DROP_THRESH), p, 0.0
            )
        v = tl.load(v_base + cols[:, None] * SVS + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_parts, m_i


@triton.jit
@no_type_check
def fwd_kernel(
    Q,
    K,
    V,
    Bias,
    Mask,
    QSeg,
    KVSeg,
    Seed,
    Out,
    Lse,
    HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    SEQ_Q: tl.constexpr,
    SEQ_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SQB: tl.constexpr,
    SQS: tl.constexpr,
    SQH: tl.constexpr,
    SKB: tl.constexpr,
    SKS: tl.constexpr,
    SKH: tl.constexpr,
    SVB: tl.constexpr,
    SVS: tl.constexpr,
    SVH: tl.constexpr,
    SOB: tl.constexpr,
    SOS: tl.constexpr,
    SOH: tl.constexpr,
    SBB: tl.constexpr,
    SBH: tl.constexpr,
    SBM: tl.constexpr,
    SBN: tl.constexpr,
    SMB: tl.constexpr,
    SMH: tl.constexpr,
    SMM: tl.constexpr,
    SMN: tl.constexpr,
    SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DROP_THRESH: tl.constexpr,
    DROP_SCALE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BAND: tl.constexpr,
    KV_SPLITS: tl.constexpr,
    SOX: tl.constexpr,
    SLX: tl.constexpr,
    ROW_GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Causal: the last q blocks see the most keys; they start first so the grid's tail is short.
    pid_m, bh = _tile(tl.program_id(0), (SEQ_Q + BLOCK_Q - 1) // BLOCK_Q, BAND, CAUSAL)
    b = bh // HEADS
    h = bh % HEADS
    kvh = h // GROUP
    b64 = b.to(tl.int64)
    m0 = pid_m * BLOCK_Q
    rows = m0 + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (rows[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(
        Q + b64 * SQB + h * SQH + rows[:, None] * SQS + offs_d[None, :], mask=q_mask, other=0.0
    )
    k_base = K + b64 * SKB + kvh * SKH
    v_base = V + b64 * SVB + kvh * SVH
    bias_base = Bias + b64 * SBB + h * SBH
    mask_base = Mask + b64 * SMB + h * SMH
    qseg_base = QSeg + b64 * (3 * SEQ_Q)
    kvseg_base = KVSeg + b64 * (3 * SEQ_K)
    drop_key = _seed_key(Seed)

    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    SUM_PARTS: tl.constexpr = 1 if DOT_PRECISION == "ieee" else 8
    l_parts = tl.zeros([BLOCK_Q, SUM_PARTS], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    lo, hi, full_lo, full_hi = _kv_blocks(
        m0, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SPLIT, ROW_GROUP
    )
    if HAS_SEG:  # every block is masked (no SPLIT)
        lo, hi = _segment_span(qseg_base + SEQ_Q, rows, lo, hi, SEQ_Q, SEQ_K, BLOCK_K)
        full_lo = lo
        full_hi = lo
    if KV_SPLITS > 1:  # flash decoding: this program takes one of KV_SPLITS runs of whole blocks
        split = tl.program_id(1)
        Out += split.to(tl.int64) * SOX  # and writes partial result ``split``
        Lse += split.to(tl.int64) * SLX
        lo, hi, full_lo, full_hi = _split_run(lo, hi, full_lo, full_hi, split, KV_SPLITS, BLOCK_K)
    # Where q and key blocks differ in size (128 x 64, 64 x 128), the masked blocks (the causal
    # diagonal, a ragged end) run before the interior: after it, ptxas serialized every wgmma of
    # the kernel, each k-step waited on alone (its warning C7515). With square blocks it does not,
    # and the interior first ran 2% faster at 4x4096x16x128 causal (NOTES.md, 43rd round).
    # A window's two masked edges, [lo, full_lo) and [full_hi, hi), run as one loop that steps over
    # the interior between them: a loop for each had cost the forward 0.75-0.93x at 128-512 keys.
    MASKED_FIRST: tl.constexpr = BLOCK_Q != BLOCK_K
    EDGES: tl.constexpr = SPLIT and WINDOW_LEFT >= 0
    masked_lo, masked_hi, gap = _masked_run(lo, hi, full_lo, full_hi, EDGES)
    if MASKED_FIRST:
        acc, l_parts, m_i = _fwd_inner(
            acc, l_parts, m_i, q, b, h, rows, k_base, v_base, bias_base, mask_base, qseg_base,
            kvseg_base, drop_key, masked_lo, masked_hi, full_lo, gap, True, HEADS, SEQ_Q, SEQ_K,
            HEAD_DIM, SKS, SVS, SBM, SBN, SMM, SMN, SCALE, SOFT_CAP, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, HAS_BIAS, HAS_MASK, HAS_SEG, DROP_THRESH, DROP_SCALE, DOT_PRECISION,
            ROW_GROUP, BLOCK_K, BLOCK_D, EDGES,
        )  # fmt: skip
    if SPLIT:
        acc, l_parts, m_i = _fwd_inner(
            acc, l_parts, m_i, q, b, h, rows, k_base, v_base, bias_base, mask_base, qseg_base,
            kvseg_base, drop_key, full_lo, full_hi, hi, 0, False, HEADS, SEQ_Q, SEQ_K, HEAD_DIM,
            SKS, SVS, SBM, SBN, SMM, SMN, SCALE, SOFT_CAP, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
            HAS_BIAS, HAS_MASK, HAS_SEG, DROP_THRESH, DROP_SCALE, DOT_PRECISION, ROW_GROUP, BLOCK_K,
            BLOCK_D, False,
        )  # fmt: skip
    if not MASKED_FIRST:
        acc, l_parts, m_i = _fwd_inner(
            acc, l_parts, m_i, q, b, h, rows, k_base, v_base, bias_base, mask_base, qseg_base,
            kvseg_base, drop_key, masked_lo, masked_hi, full_lo, gap, True, HEADS, SEQ_Q, SEQ_K,
            HEAD_DIM, SKS, SVS, SBM, SBN, SMM, SMN, SCALE, SOFT_CAP, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, HAS_BIAS, HAS_MASK, HAS_SEG, DROP_THRESH, DROP_SCALE, DOT_PRECISION,
            ROW_GROUP, BLOCK_K, BLOCK_D, EDGES,
        )  # fmt: skip

    l_i = tl.sum(l_parts, 1)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (DROP_SCALE / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * _LN2)
    o_ptrs = Out + b64 * SOB + h * SOH + rows[:, None] * SOS + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=q_mask)
    tl.store(Lse + bh.to(tl.int64) * SEQ_Q + rows, lse, mask=rows < SEQ_Q)


# ----------------------------------------------------------------------------------------------
# Backward


@triton.jit
@no_type_check
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    b,
    h,
    cols,
    q_base,
    do_base,
    lse2_base,
    delta_base,
    bias_base,
    mask_base,
    qseg_base,
    kvseg_base,
    dbias_base,
    drop_key,
    start,
    stop,
    gap_at,
    gap,
    MASKED: tl.constexpr,
    HEADS: tl.constexpr,
    SEQ_Q: tl.constexpr,
    SEQ_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SQS: tl.constexpr,
    SDOS: tl.constexpr,
    SBM: tl.constexpr,
    SBN: tl.constexpr,
    SMM: tl.constexpr,
    SMN: tl.constexpr,
    SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DROP_THRESH: tl.constexpr,
    DROP_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GAP: tl.constexpr,
    WANT_DK: tl.constexpr,
    WANT_DV: tl.constexpr,
    CHECK_COLS: tl.constexpr,
):
    # Works on transposed tiles ([keys, queries]) so that dv += p^T dout and dk += ds^T q need no
    # transposes of the large operands. With ``GAP`` the q blocks from ``gap_at`` on lie ``gap``
    # rows further on (the loop steps over the unmasked blocks between a window's two edges).
    # ``CHECK_COLS``: whether the key block may pass the last key.
    offs_d = tl.arange(0, BLOCK_D)
    # the q blocks start on whole blocks, but after a window's gap
    CHECK_ROWS: tl.constexpr = SEQ_Q % BLOCK_Q != 0 or GAP
    # delta read before dP's product, not after its wait, where ptxas left the read of its
    # shared-memory copy, right before its first use: 7.7% of the kernel's stall samples at
    # 8x2048x32x64 causal. The early read holds its registers through the step, which spills
    # 8-24 bytes without a feature (the kernel alone 0.941x at 8x2048x32x64 causal, 0.975-0.987x
    # at head dim 128), 40-236 with dropout or a soft cap and 24-32 with a window: those keep
    # the late read (benchmarks/NOTES.md, eighty-fourth round).
    EARLY_DELTA: tl.constexpr = (
        WANT_DK and DROP_SCALE == 1.0 and SOFT_CAP == 0 and WINDOW_LEFT < 0 and WINDOW_RIGHT < 0
    )
    for m0 in range(start, stop, BLOCK_Q):
        if GAP:
            m0 = tl.where(m0 >= gap_at, m0 + gap, m0)
        rows = m0 + tl.arange(0, BLOCK_Q)
        q_mask = (rows[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(q_base + rows[:, None] * SQS + offs_d[None, :], mask=q_mask, other=0.0)
        lse2 = tl.load(lse2_base + rows, mask=rows < SEQ_Q, other=0.0)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        p_t, t_t = _probs(
            qk_t, lse2[None, :], rows[None, :], cols[:, None], bias_base, qseg_base, kvseg_base,
            mask_base, MASKED, SCALE, SOFT_CAP, HAS_BIAS, SEQ_Q, SEQ_K, SBM, SBN, CAUSAL,
            WINDOW_LEFT, WINDOW_RIGHT, HAS_SEG, HAS_MASK, SMM, SMN, CHECK_ROWS, CHECK_COLS,
        )  # fmt: skip
        if EARLY_DELTA:
            delta = tl.load(delta_base + rows, mask=rows < SEQ_Q, other=0.0)
        do = tl.load(do_base + rows[:, None] * SDOS + offs_d[None, :], mask=q_mask, other=0.0)
        if WANT_DK:
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if DROP_SCALE != 1.0:  # dropout on
            keep = _keep(drop_key, b, h, rows[None, :], cols[:, None], HEADS, SEQ_Q, DROP_THRESH)
            if WANT_DV:
                kept = tl.where(keep, p_t, 0.0).to(do.dtype)
                dv += tl.dot(kept, do, input_precision=DOT_PRECISION)
            if WANT_DK:
                dp_t = tl.where(keep, dp_t * DROP_SCALE, 0.0)
        elif WANT_DV:
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        if WANT_DK:
            if not EARLY_DELTA:
                delta = tl.load(delta_base + rows, mask=rows < SEQ_Q, other=0.0)
            ds_t = p_t * (dp_t - delta[None, :])
            if HAS_BIAS:
                inb = (rows[None, :] < SEQ_Q) & (cols[:, None] < SEQ_K)
                tl.store(dbias_base + rows[None, :] * SEQ_K + cols[:, None], ds_t, mask=inb)
            if SOFT_CAP > 0:
                ds_t = ds_t * (1.0 - t_t * t_t)
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
@no_type_check
def _dkdv_block(
    Q,
    K,
    V,
    Bias,
    Mask,
    QSeg,
    KVSeg,
    Seed,
    DOut,
    Lse2,
    Delta,
    DK,
    DV,
    DBias,
    HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    SEQ_Q: tl.constexpr,
    SEQ_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SQB: tl.constexpr,
    SQS: tl.constexpr,
    SQH: tl.constexpr,
    SKB: tl.constexpr,
    SKS: tl.constexpr,
    SKH: tl.constexpr,
    SVB: tl.constexpr,
    SVS: tl.constexpr,
    SVH: tl.constexpr,
    SDOB: tl.constexpr,
    SDOS: tl.constexpr,
    SDOH: tl.constexpr,
    SBB: tl.constexpr,
    SBH: tl.constexpr,
    SBM: tl.constexpr,
    SBN: tl.constexpr,
    SMB: tl.constexpr,
    SMH: tl.constexpr,
    SMM: tl.constexpr,
    SMN: tl.constexpr,
    SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DROP_THRESH: tl.constexpr,
    DROP_SCALE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    pid_n,
    bkvh,
    WANT_DK: tl.constexpr,
    WANT_DV: tl.constexpr,
):
    """dK and/or dV of key block ``pid_n`` of kv head ``bkvh``, summed over the query heads of
    its group."""
    kv_heads = HEADS // GROUP
    b = bkvh // kv_heads
    kvh = bkvh % kv_heads
    b64 = b.to(tl.int64)
    n0 = pid_n * BLOCK_K
    cols = n0 + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (cols[:, None] < SEQ_K) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(
        K + b64 * SKB + kvh * SKH + cols[:, None] * SKS + offs_d[None, :], mask=kv_mask, other=0.0
    )
    v = k  # the dV program's products do not read v
    if WANT_DK:
        v = tl.load(
            V + b64 * SVB + kvh * SVH + cols[:, None] * SVS + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
    drop_key = _seed_key(Seed)
    qseg_base = QSeg + b64 * (3 * SEQ_Q)
    kvseg_base = KVSeg + b64 * (3 * SEQ_K)
    # the accumulator a program does not want stays a constant that the compiler drops
    dk = tl.zeros([BLOCK_K, BLOCK_D] if WANT_DK else [1, 1], dtype=tl.float32)
    dv = tl.zeros([BLOCK_K, BLOCK_D] if WANT_DV else [1, 1], dtype=tl.float32)
    lo, hi, full_lo, full_hi = _q_blocks(
        n0, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SPLIT
    )
    if HAS_SEG:  # every block is masked (no SPLIT)
        lo, hi = _segment_span(kvseg_base + SEQ_K, cols, lo, hi, SEQ_K, SEQ_Q, BLOCK_Q)
        full_lo = hi
        full_hi = hi
    gap = full_hi - full_lo  # the unmasked q blocks, which the masked loop steps over
    EDGES: tl.constexpr = SPLIT and WINDOW_LEFT >= 0  # as in the forward and dQ
    CHECK_COLS: tl.constexpr = SEQ_K % BLOCK_K != 0
    for g in range(GROUP):
        h = kvh * GROUP + g
        bh64 = b64 * HEADS + h
        q_base = Q + b64 * SQB + h * SQH
        do_base = DOut + b64 * SDOB + h * SDOH
        lse2_base = Lse2 + bh64 * SEQ_Q
        delta_base = Delta + bh64 * SEQ_Q
        bias_base = Bias + b64 * SBB + h * SBH
        mask_base = Mask + b64 * SMB + h * SMH
        dbias_base = DBias + bh64 * SEQ_Q * SEQ_K
        # The unmasked q blocks first. With the diagonal's two or so masked blocks ahead of them,
        # the causal kernel took 1.26x as long at 4x4096x16x128 (ncu; NOTES.md, twenty-third round).
        if SPLIT:
            dk, dv = _dkdv_inner(
                dk, dv, k, v, b, h, cols, q_base, do_base, lse2_base, delta_base, bias_base,
                mask_base, qseg_base, kvseg_base, dbias_base, drop_key, full_lo, full_hi, hi, 0,
                False, HEADS, SEQ_Q, SEQ_K, HEAD_DIM, SQS, SDOS, SBM, SBN, SMM, SMN, SCALE,
                SOFT_CAP, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_BIAS, HAS_MASK, HAS_SEG,
                DROP_THRESH, DROP_SCALE, DOT_PRECISION, BLOCK_Q, BLOCK_D, False, WANT_DK, WANT_DV,
                CHECK_COLS,
            )  # fmt: skip
        # The masked ones in one loop: [lo, full_lo) (the diagonal, a window's right edge), then
        # [full_hi, hi) (a window's left edge). A loop of its own for the second made ptxas spill
        # 128-156 bytes at head dim 128 (benchmarks/triton_sass.py; NOTES.md, sixty-first round).
        dk, dv = _dkdv_inner(
            dk, dv, k, v, b, h, cols, q_base, do_base, lse2_base, delta_base, bias_base,
            mask_base, qseg_base, kvseg_base, dbias_base, drop_key, lo, hi - gap, full_lo, gap,
            True, HEADS, SEQ_Q, SEQ_K, HEAD_DIM, SQS, SDOS, SBM, SBN, SMM, SMN, SCALE, SOFT_CAP,
            CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_BIAS, HAS_MASK, HAS_SEG, DROP_THRESH,
            DROP_SCALE, DOT_PRECISION, BLOCK_Q, BLOCK_D, EDGES, WANT_DK, WANT_DV, CHECK_COLS,
        )  # fmt: skip
    if WANT_DK:
        dk = dk * SCALE
        dk_ptrs = DK + b64 * SKB + kvh * SKH + cols[:, None] * SKS + offs_d[None, :]
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=kv_mask)
    if WANT_DV:
        if DROP_SCALE != 1.0:  # dropout on
            dv = dv * DROP_SCALE
        dv_ptrs = DV + b64 * SVB + kvh * SVH + cols[:, None] * SVS + offs_d[None, :]
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
@no_type_check
def bwd_dkdv_kernel(
    Q,
    K,
    V,
    Bias,
    Mask,
    QSeg,
    KVSeg,
    Seed,
    DOut,
    Lse2,
    Delta,
    DK,
    DV,
    DBias,
    HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    SEQ_Q: tl.constexpr,
    SEQ_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SQB: tl.constexpr,
    SQS: tl.constexpr,
    SQH: tl.constexpr,
    SKB: tl.constexpr,
    SKS: tl.constexpr,
    SKH: tl.constexpr,
    SVB: tl.constexpr,
    SVS: tl.constexpr,
    SVH: tl.constexpr,
    SDOB: tl.constexpr,
    SDOS: tl.constexpr,
    SDOH: tl.constexpr,
    SBB: tl.constexpr,
    SBH: tl.constexpr,
    SBM: tl.constexpr,
    SBN: tl.constexpr,
    SMB: tl.constexpr,
    SMH: tl.constexpr,
    SMM: tl.constexpr,
    SMN: tl.constexpr,
    SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DROP_THRESH: tl.constexpr,
    DROP_SCALE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTS: tl.constexpr,
):
    """dK and dV of one key block of one kv head, summed over the query heads of its group. With
    ``PARTS = 2`` two neighbouring programs share the block, the first for dV and the second for dK,
    each recomputing the scores: one float32 accumulator leaves room where two spill (head dim 256,
    NOTES.md, seventy-second round)."""
    bkvh = tl.program_id(1)
    if PARTS == 1:
        _dkdv_block(
            Q, K, V, Bias, Mask, QSeg, KVSeg, Seed, DOut, Lse2, Delta, DK, DV, DBias, HEADS, GROUP,
            SEQ_Q, SEQ_K, HEAD_DIM, SQB, SQS, SQH, SKB, SKS, SKH, SVB, SVS, SVH, SDOB, SDOS, SDOH,
            SBB, SBH, SBM, SBN, SMB, SMH, SMM, SMN, SCALE, SOFT_CAP, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, HAS_BIAS, HAS_MASK, HAS_SEG, DROP_THRESH, DROP_SCALE, SPLIT,
            DOT_PRECISION, BLOCK_Q, BLOCK_K, BLOCK_D, tl.program_id(0), bkvh, True, True,
        )  # fmt: skip
    else:
        pid = tl.program_id(0)
        if pid % 2 == 0:
            _dkdv_block(
                Q, K, V, Bias, Mask, QSeg, KVSeg, Seed, DOut, Lse2, Delta, DK, DV, DBias, HEADS,
                GROUP, SEQ_Q, SEQ_K, HEAD_DIM, SQB, SQS, SQH, SKB, SKS, SKH, SVB, SVS, SVH, SDOB,
                SDOS, SDOH, SBB, SBH, SBM, SBN, SMB, SMH, SMM, SMN, SCALE, SOFT_CAP, CAUSAL,
                WINDOW_LEFT, WINDOW_RIGHT, HAS_BIAS, HAS_MASK, HAS_SEG, DROP_THRESH, DROP_SCALE,
                SPLIT, DOT_PRECISION, BLOCK_Q, BLOCK_K, BLOCK_D, pid // 2, bkvh, False, True,
            )  # fmt: skip
        else:
            _dkdv_block(
                Q, K, V, Bias, Mask, QSeg, KVSeg, Seed, DOut, Lse2, Delta, DK, DV, DBias, HEADS,
                GROUP, SEQ_Q, SEQ_K, HEAD_DIM, SQB, SQS, SQH, SKB, SKS, SKH, SVB, SVS, SVH, SDOB,
                SDOS, SDOH, SBB, SBH, SBM, SBN, SMB, SMH, SMM, SMN, SCALE, SOFT_CAP, CAUSAL,
                WINDOW_LEFT, WINDOW_RIGHT, HAS_BIAS, HAS_MASK, HAS_SEG, DROP_THRESH, DROP_SCALE,
                SPLIT, DOT_PRECISION, BLOCK_Q, BLOCK_K, BLOCK_D, pid // 2, bkvh, True, False,
            )  # fmt: skip


@triton.jit
@no_type_check
def _dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,
    b,
    h,
    rows,
    k_base,
    v_base,
    bias_base,
    mask_base,
    qseg_base,
    kvseg_base,
    drop_key,
    start,
    stop,
    gap_at,
    gap,
    MASKED: tl.constexpr,
    HEADS: tl.constexpr,
    SEQ_Q: tl.constexpr,
    SEQ_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SKS: tl.constexpr,
    SVS: tl.constexpr,
    SBM: tl.constexpr,
    SBN: tl.constexpr,
    SMM: tl.constexpr,
    SMN: tl.constexpr,
    SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DROP_THRESH: tl.constexpr,
    DROP_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GAP: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_D)
    CHECK_COLS: tl.constexpr = SEQ_K % BLOCK_K != 0 or GAP  # as the dK/dV kernel's rows
    for n0 in range(start, stop, BLOCK_K):
        if GAP:  # as in _fwd_inner
            n0 = tl.where(n0 >= gap_at, n0 + gap, n0)
        cols = n0 + tl.arange(0, BLOCK_K)
        kv_mask = (cols[:, None] < SEQ_K) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_base + cols[:, None] * SKS + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * SVS + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p, t = _probs(
            qk, lse2[:, None], rows[:, None], cols[None, :], bias_base, qseg_base, kvseg_base,
            mask_base, MASKED, SCALE, SOFT_CAP, HAS_BIAS, SEQ_Q, SEQ_K, SBM, SBN, CAUSAL,
            WINDOW_LEFT, WINDOW_RIGHT, HAS_SEG, HAS_MASK, SMM, SMN, CHECK_ROWS, CHECK_COLS,
        )  # fmt: skip
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROP_SCALE != 1.0:  # dropout on
            keep = _keep_tile(drop_key, b, h, rows, n0, BLOCK_K, HEADS, SEQ_Q, DROP_THRESH)
            dp = tl.where(keep, dp * DROP_SCALE, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFT_CAP > 0:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
@no_type_check
def bwd_dq_kernel(
    Q,
    K,
    V,
    Bias,
    Mask,
    QSeg,
    KVSeg,
    Seed,
    DOut,
    Lse,
    Out,
    DQ,
    Delta,
    Lse2,
    HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    SEQ_Q: tl.constexpr,
    SEQ_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SQB: tl.constexpr,
    SQS: tl.constexpr,
    SQH: tl.constexpr,
    SKB: tl.constexpr,
    SKS: tl.constexpr,
    SKH: tl.constexpr,
    SVB: tl.constexpr,
    SVS: tl.constexpr,
    SVH: tl.constexpr,
    SDOB: tl.constexpr,
    SDOS: tl.constexpr,
    SDOH: tl.constexpr,
    SBB: tl.constexpr,
    SBH: tl.constexpr,
    SBM: tl.constexpr,
    SBN: tl.constexpr,
    SMB: tl.constexpr,
    SMH: tl.constexpr,
    SMM: tl.constexpr,
    SMN: tl.constexpr,
    SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DROP_THRESH: tl.constexpr,
    DROP_SCALE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_SPLITS: tl.constexpr,
    SDX: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dQ of one query block of one head, looping over the key blocks it sees, and the block's
    ``delta = rowsum(dout * out)`` (float32), which it stores for the dK/dV kernel: read here,
    beside dout, it costs no pass over out and dout of its own. It stores the rows' lse in base 2
    too, so that the dK/dV kernel's loop does not convert it at every step (24 of the 229
    instructions of its step at 8x2048x32x64)."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        # The last q blocks see the most keys: start them first so the tail of the grid is short.
        # (The forward's bands of heads, tried here and in dK/dV, ran the backward 3-5% slower.)
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = bh // HEADS
    h = bh % HEADS
    kvh = h // GROUP
    b64 = b.to(tl.int64)
    m0 = pid_m * BLOCK_Q
    rows = m0 + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (rows[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(
        Q + b64 * SQB + h * SQH + rows[:, None] * SQS + offs_d[None, :], mask=q_mask, other=0.0
    )
    do = tl.load(
        DOut + b64 * SDOB + h * SDOH + rows[:, None] * SDOS + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )
    o = tl.load(
        Out + b64 * SDOB + h * SDOH + rows[:, None] * SDOS + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    split = tl.program_id(2)  # which run of the keys this program takes (KV_SPLITS > 1)
    stores = (rows < SEQ_Q) & (split == 0)  # the first run stores the rows' statistics
    tl.store(Delta + bh.to(tl.int64) * SEQ_Q + rows, delta, mask=stores)
    lse = tl.load(Lse + bh.to(tl.int64) * SEQ_Q + rows, mask=rows < SEQ_Q, other=0.0)
    # A row with no visible key has lse = -inf; all its scores are masked to -inf too.
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * _LOG2E)
    tl.store(Lse2 + bh.to(tl.int64) * SEQ_Q + rows, lse2, mask=stores)
    k_base = K + b64 * SKB + kvh * SKH
    v_base = V + b64 * SVB + kvh * SVH
    bias_base = Bias + b64 * SBB + h * SBH
    mask_base = Mask + b64 * SMB + h * SMH
    qseg_base = QSeg + b64 * (3 * SEQ_Q)
    kvseg_base = KVSeg + b64 * (3 * SEQ_K)
    drop_key = _seed_key(Seed)
    dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    lo, hi, full_lo, full_hi = _kv_blocks(
        m0, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SPLIT
    )
    if HAS_SEG:  # every block is masked (no SPLIT)
        lo, hi = _segment_span(qseg_base + SEQ_Q, rows, lo, hi, SEQ_Q, SEQ_K, BLOCK_K)
        full_lo = lo
        full_hi = lo
    if KV_SPLITS > 1:  # partial dQ ``split``, over one run of whole key blocks
        DQ += split.to(tl.int64) * SDX
        lo, hi, full_lo, full_hi = _split_run(lo, hi, full_lo, full_hi, split, KV_SPLITS, BLOCK_K)
    EDGES: tl.constexpr = SPLIT and WINDOW_LEFT >= 0  # one masked loop for both, as forward
    CHECK_ROWS: tl.constexpr = SEQ_Q % BLOCK_Q != 0
    masked_lo, masked_hi, gap = _masked_run(lo, hi, full_lo, full_hi, EDGES)
    if SPLIT:
        dq = _dq_inner(
            dq, q, do, lse2, delta, b, h, rows, k_base, v_base, bias_base, mask_base, qseg_base,
            kvseg_base, drop_key, full_lo, full_hi, hi, 0, False, HEADS, SEQ_Q, SEQ_K, HEAD_DIM,
            SKS, SVS, SBM, SBN, SMM, SMN, SCALE, SOFT_CAP, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
            HAS_BIAS, HAS_MASK, HAS_SEG, DROP_THRESH, DROP_SCALE, DOT_PRECISION, BLOCK_K, BLOCK_D,
            False, CHECK_ROWS,
        )  # fmt: skip
    dq = _dq_inner(
        dq, q, do, lse2, delta, b, h, rows, k_base, v_base, bias_base, mask_base, qseg_base,
        kvseg_base, drop_key, masked_lo, masked_hi, full_lo, gap, True, HEADS, SEQ_Q, SEQ_K,
        HEAD_DIM, SKS, SVS, SBM, SBN, SMM, SMN, SCALE, SOFT_CAP, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
        HAS_BIAS, HAS_MASK, HAS_SEG, DROP_THRESH, DROP_SCALE, DOT_PRECISION, BLOCK_K, BLOCK_D,
        EDGES, CHECK_ROWS,
    )  # fmt: skip
    dq = dq * SCALE
    dq_ptrs = DQ + b64 * SQB + h * SQH + rows[:, None] * SQS + offs_d[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=q_mask)
