"""Flash attention forward in Pallas Mosaic GPU for Hopper (variant ``"mosaic"``).

CTAs of the persistent grid of :mod:`._mosaic_grid` walk the tiles of (head, 128 query rows, batch),
a head's tiles one after another (CTAs at work together share its keys and values in L2), causal
tiles last rows first (they see the most keys). Causal from ``ONE_TILE_CAUSAL_KEYS`` keys the grid
has one CTA a tile instead (its CTAs stay closer together along the keys). Each CTA runs three
warpgroups: two compute warpgroups of 64 rows each and one memory warpgroup. The memory warpgroup
streams K and V blocks with TMA into a ring of shared memory slots (``num_stages`` deep), running on
into the next tile's blocks while the compute warpgroups finish a tile; the compute warpgroups load
their next Q as soon as the last product has read the current one, and stage O in a buffer of its
own where shared memory allows. Each compute warpgroup multiplies with ``wgmma`` (Q from shared
memory, P from registers), runs the online softmax in registers, and marks each slot consumed so the
ring refills. The two compute warpgroups take turns, so one's softmax runs while the other's
products hold the tensor cores (ping-pong: on an H200 this took the forward from 199 to 246 TFLOP/s,
and causal from 133 to 226, at 2x4096x16x128): each waits for its turn before its P V and passes the
turn once its next S = Q K^T is issued, warpgroup 1 starting a turn behind. The turns go through
hardware barriers, mostly 1-4% faster than mbarriers on an H100 and an H200 (0.94-1.04x over four
runs of eight shapes; benchmarks/NOTES.md, eighteenth round).
With ``q_blocksize=256`` two CTAs on neighbouring query tiles form a cluster: each memory
warpgroup copies half of every key and value block and TMA multicasts it to both, and a slot is
refilled once both CTAs have released it (the heuristic's on the grid of one CTA a tile; a tuner
candidate elsewhere, where it measured even with one CTA a tile). ``q_blocksize=512`` makes
clusters of four the same way: at long causal context they clocked 4-5% higher than pairs and did
9-10% less a clock (benchmarks/NOTES.md, fifty-eighth round), so nothing chooses them.
Without a mask, where a last round of tiles would leave CTAs idle, its key blocks are dealt out to
every CTA instead (``_mosaic_grid.SplitTail``) and each split tile's pieces merged after the kernel
by their softmax sums (1-2% on an H200 where the last round idled most CTAs).
Causal attention skips key blocks past the diagonal: a warpgroup stops computing at its own last
visible block and only acknowledges the rest (which its neighbour still needs), so barrier phases
stay in step. Blocks wholly below the diagonal take an unmasked path. A sliding window streams a
tile's blocks from the first its first row sees; a warpgroup acknowledges the leading blocks only
its neighbour's rows see, masks the window's left edge, runs the blocks between the edges unmasked
and masks the right edge (the diagonal, or the window's right side). On an H200 this forward ran
1.09-1.20x cuDNN's with a causal window at head dim 128 from 512 to 4096 keys (1.27-1.35x at 128 and
256) and 1.13x at head dim 256 (benchmarks/NOTES.md, sixty-fourth round).

On a CPU the kernel runs in Mosaic GPU's interpreter, which simulates the warpgroups, barriers and TMA
but takes wgmma operands only from shared memory and cannot run ``pl.run_state`` with accumulators;
there P goes through shared memory and P @ V is added in registers (``_Geom.fused_pv``), the rest of
the kernel (pipeline, barriers, masking, bounds) being the code that runs on the GPU.

Four backward passes take the natural-log ``lse`` this forward writes, chosen by
``BwdParams.variant``: ``"mosaic"``, the Mosaic GPU kernels of :mod:`._pallas_mosaic_bwd`
(FlashAttention 3's split, head dims up to 128); ``"mosaic_fused"``, its dK/dV kernel adding dQ
into a float32 accumulator by TMA reduce-add (no dQ kernel; head dims up to 128); ``"cudnn"``,
cuDNN's backward kernel fed this forward's output and ``lse`` (:func:`._cudnn.residual_bwd`; a CUDA
GPU, ``seq_q == seq_k`` where causal); or ``None``, the Triton-lowering kernels of
:mod:`._pallas_gpu` (FlashAttention 2 without atomics, every head dim). The heuristic takes
``"mosaic_fused"`` where it fits and nothing is masked, or the mask is causal over 2048 keys or more
at head dim 64 and 4096 above (there without GQA; faster there on an H200), else ``"mosaic"`` where
it can; the tuner tries them all. With a sliding window the portable backward trains, or cuDNN's
kernel (the Mosaic kernels refuse it: ``AttentionBackend.bwd_unsupported``).

Supported: causal, sliding windows, GQA/MQA, softmax scale, any sequence lengths (padded to blocks,
masked by the true key length), head dims padded to a multiple of 64 up to 256, float16 and bfloat16.
Refused with ``NotImplementedError``: bias, mask, segment ids, soft cap, dropout, float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .._registry import BwdParams, FwdParams
from . import _cudnn, _pallas_gpu, _pallas_mosaic_bwd
from ._backend import (
    CUDNN_BWD,
    PORTABLE_VARIANTS,
    AttentionBackend,
    AttentionShape,
    on_host,
    register_backend,
)
from ._mosaic_grid import (
    FIRST_FREE_BARRIER,
    HOPPER_SMEM_BYTES,
    WARPGROUP_THREADS,
    Rounds,
    SplitTail,
    feed_ring,
    first_key_block,
    full_key_blocks,
    hardware_barrier,
    key_blocks,
    query_tile,
    query_tiles_work,
    resident_ctas,
    spared_sms,
)
from ._pallas_mosaic_bwd import LOG2E, WG_ROWS
from ._spec import AttentionSpec

__all__ = ["available", "bwd", "candidates", "fwd", "heuristic"]

LN2 = math.log(2.0)
COMPUTE_WGS = 2
CTA_ROWS = WG_ROWS * COMPUTE_WGS
# Per-thread registers of the compute and memory warpgroups. The backward's 240/24 measured the same
# within noise on an H200 (benchmarks/results/mosaic_forward_registers_ab_h200.txt).
COMPUTE_REGISTERS, MEMORY_REGISTERS = 232, 40
_UNSUPPORTED = frozenset({"bias", "attention_mask", "segment_ids", "logits_soft_cap", "dropout"})
# A window trains on the portable backward or cuDNN's backward kernel, not on the Mosaic ones.
_BWD_UNSUPPORTED = tuple(
    (variant, frozenset({"sliding_window"})) for variant in _pallas_mosaic_bwd.VARIANTS
)
# Shared memory for our buffers: Mosaic's barriers and alignment took a further 2.6 KB of the 227 KB
# on an H200 (the 128 x 128 key blocks three deep at head dim 128 needed 232568 bytes in all).
_SMEM_LIMIT = HOPPER_SMEM_BYTES - 3072
# Tiles along the sequence (_mosaic_grid.split_index), causal too: against heads fastest, 1.01-1.18x
# at 10 of 12 shapes on an H200 and 0.96-0.98x at two, within that run's noise; 1.12-1.18x at
# 1x65536 (results/mosaic_variants_NVIDIA_H200_20261121-174012.json).
FWD_ALONG_SEQUENCE = True
_FINITE_FLOOR = -1e30  # running max starts here, so fully masked rows never compute inf - inf
# Causal, the fused backward from this many keys, by head dim padded to 64 (see heuristic).
FUSED_CAUSAL_KEYS = {64: 2048, 128: 4096}
# Causal from this many keys the forward runs one CTA a tile (the heuristic's in clusters of two).
# The hardware's block scheduler keeps the CTAs at work on neighbouring tiles of one head, which
# then read its keys and values from HBM about once; the persistent grid's CTAs drift apart along
# the keys over their rounds and read them 4-5 times (ncu, H200: 1.22 GB against 0.40 GB at
# 2x16384x16x128, 6.5 GB against 1.3 GB at 1x65536). One cluster a tile ran 1.03-1.05x the
# persistent grid from 16k keys on an H200 and 1.02-1.04x on an H100 (GQA and head dim 64 among
# them); one CTA a tile ran 0.96-0.97x at 4x4096 and 2x8192 (results/mosaic_variants_NVIDIA_H200_
# 20261127-232134.json, ..._H100_80GB_HBM3_20261127-232629.json, -232704.json; benchmarks/NOTES.md,
# thirty-seventh round).
ONE_TILE_CAUSAL_KEYS = 16384
# A window of at most this many keys (besides the diagonal) runs on these narrower key blocks and
# ring, by head dim padded to 64: fewer of a row's keys lie in its masked edge blocks. On an H200
# (bf16, causal; results/features_NVIDIA_H200_20261130-121706.json to -124028.json) 128-key blocks
# at head dim 64 ran 1.43 / 1.31 / 1.14 / 1.07 / 1.04x the 256-key ones at 128 / 256 / 512 / 1024 /
# 2048 keys (8x2048x32x64, 2x8192x32(8 kv)x64), 0.97-1.02x at 1536 and 3072, 0.98x at 4096;
# 64-key blocks on 4 slots at head dim 128 1.05 / 1.09 / 1.01-1.02x the 128-key ones at 128 / 192
# / 256 keys (4x4096x16x128, 2x8192x16x128).
NARROW_WINDOW_BLOCKS = {64: (2048, 128, 2), 128: (256, 64, 4)}
# Query rows of a cluster's tile: two or four CTAs of CTA_ROWS sharing each key/value copy.
CLUSTER_ROWS = (2 * CTA_ROWS, 4 * CTA_ROWS)
# Fewest key blocks of a CTA's share of a split last round: a piece also pays for a Q load, a ring
# to fill and an epilogue.
MIN_TAIL_PIECE = 4
# The last round split only for tiles of this many key blocks or more, at (padded) head dims of
# 128 or more. On an H200 (forward, against the whole last round): 2x8192x16x128 1.005-1.02x, GQA
# 2x8192x32(8)x128 1.007-1.03x, 2x16384x16x128 1.008-1.012x over three runs; 4x4096x16x128 (32
# blocks) 0.98-1.00x, the merge weighing on a shorter kernel; 8x2048x32x64 0.92-0.95x, where ptxas
# spilled 116 bytes with the tail's code in the kernel and none without (benchmarks/NOTES.md,
# twelfth round).
MIN_SPLIT_BLOCKS, MIN_SPLIT_HEAD_DIM = 64, 128
_MAX_MERGE_RUNS = 8  # runs of consecutive tiles _merge_tail writes as slices (else one scatter)


def available() -> bool:
    """Whether the default device is a Hopper (sm_90) GPU."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")) == "9.0"


def _whole_64s(n: int) -> int:
    """A head dim or sequence length padded to whole 64s (at least 64)."""
    return max(64, -(-n // 64) * 64)


def _refuse(spec: AttentionSpec, q: Any, k: Any, bwd: BwdParams | None = None) -> None:
    """``NotImplementedError`` for what this backend (and ``bwd``'s variant) cannot do."""
    BACKEND.check(spec, bwd=bwd)
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        raise NotImplementedError(
            f"platform 'pallas' (mosaic) needs float16 or bfloat16 inputs; got {jnp.dtype(q.dtype)}"
        )
    if not (q.dtype == k.dtype):
        raise NotImplementedError(f"q and k/v must share a dtype; got {q.dtype} and {k.dtype}")
    if _whole_64s(q.shape[-1]) > 256:
        raise NotImplementedError(
            f"platform 'pallas' (mosaic) supports head dim up to 256; got {q.shape[-1]}"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"heads={q.shape[2]} must be a multiple of kv_heads={k.shape[2]}")


@dataclasses.dataclass(frozen=True)
class _Geom:
    causal: bool
    scale: float
    seq_q: int
    seq_k: int
    group: int
    dpad: int
    bk: int
    slots: int
    heads: int
    batch: int
    resident: int  # CTAs the persistent grid may launch
    persistent: bool
    along_sequence: bool  # tile order (see _mosaic_grid.split_index)
    fused_pv: bool = True
    pingpong: bool = True
    hardware_barriers: bool = True  # the ping-pong turns' (the GPU; the interpreter has none)
    cluster: int = 1  # CTAs on neighbouring query tiles that share each K/V copy (multicast)
    balanced: bool = True  # the persistent grid's CTA count chosen for its busiest CTA's work
    split_tail: bool = True  # tiles of equal work: the last round's spread over every CTA
    one_memory_warp: bool = True  # the memory warpgroup's other three warps idle at its end
    window: tuple[int, int] | None = None  # (left, right) keys about each query's position

    @property
    def offset(self) -> int:
        return self.seq_k - self.seq_q

    @property
    def bounded(self) -> bool:
        """Whether a row's keys end before the last (causal, or a window's right side)."""
        return self.causal or self.window is not None

    @property
    def reach(self) -> int:
        """How far past its row the last key a bounded row sees lies: the offset, and a window's
        right side where not causal (the causal mask cuts it at the diagonal)."""
        right = self.window[1] if self.window is not None and not self.causal else 0
        return self.offset + right

    @property
    def fold_scale(self) -> bool:
        """Scale inside exp2's argument (measured 1.01-1.08x scaling the scores first, H200:
        results/mosaic_variants_NVIDIA_H200_20261121-145438.json); a negative scale would turn
        the row max over."""
        return self.scale > 0

    @property
    def cluster_rows(self) -> int:
        return CTA_ROWS * self.cluster

    @property
    def q_tiles(self) -> int:
        """Tiles along the query sequence, each of ``cluster_rows`` rows (one per cluster)."""
        return -(-self.seq_q // self.cluster_rows)

    @functools.cached_property
    def tail(self) -> SplitTail | None:
        """Without a mask every tile sees every key block, and a last round of fewer tiles than
        CTAs would leave the rest idle: its key blocks are dealt out to every CTA instead, each
        CTA's pieces merged after the kernel (:func:`_merge_tail`)."""
        if not (self.split_tail and self.persistent) or self.bounded or self.cluster > 1:
            return None
        blocks = -(-self.seq_k // self.bk)
        if blocks < MIN_SPLIT_BLOCKS or self.dpad < MIN_SPLIT_HEAD_DIM:
            return None
        tiles = self.heads * self.q_tiles * self.batch
        return SplitTail.plan(tiles, self.resident, blocks, MIN_TAIL_PIECE)

    @functools.cached_property
    def rounds(self) -> Rounds:
        """The persistent grid's rounds, over clusters, balanced on each tile's key blocks (the
        whole rounds where the last is split)."""
        if self.tail is not None:
            return self.tail.rounds
        resident = max(1, self.resident // self.cluster)
        if not (self.balanced and self.persistent):  # nothing to balance: skip counting the work
            return Rounds.of(self.heads * self.q_tiles * self.batch, resident, self.persistent)
        return Rounds.balanced(self.tile_work(), resident, self.persistent)

    def tile_work(self) -> np.ndarray:
        """Each tile's key blocks (from a window's first) plus one (its epilogue), in work-item
        order."""

        def streamed(last_row: Any) -> Any:
            first, stop = self.blocks_of(last_row - (self.cluster_rows - 1))
            return stop - first

        return query_tiles_work(
            streamed, self.heads, self.batch, self.q_tiles, self.cluster_rows, self.causal,
            self.along_sequence,
        )  # fmt: skip

    @property
    def out_buffer(self) -> bool:
        """O staged apart from Q (where shared memory allows), so the next tile's Q loads during
        the epilogue."""
        return self.persistent and _smem_bytes(self.dpad, self.bk, self.slots, True) <= _SMEM_LIMIT

    def tiles_of(self, cluster: Any) -> Any:
        """How many tiles (and tail pieces) ``cluster`` runs."""
        if self.tail is None:
            return self.rounds.tiles_of(cluster)
        return self.tail.whole_rounds + self.tail.pieces_of(cluster)

    def tail_piece(self, t: Any) -> Any:
        """Which of its tail pieces a CTA's ``t``-th tile is; negative for a whole tile."""
        assert self.tail is not None
        return t - self.tail.whole_rounds

    def item(self, cluster: Any, t: Any) -> tuple[Any, Any, Any]:
        """(work item, first key block, end key block) of ``cluster``'s ``t``-th tile."""
        if self.tail is None:  # the first key block follows from the tile's rows (tile_of)
            return self.rounds.index(cluster, t), None, None
        piece = self.tail_piece(t)
        index, first, stop = self.tail.piece_of(cluster, jnp.maximum(piece, 0))
        whole = piece < 0
        return (
            jnp.where(
                whole, self.rounds.index(cluster, jnp.minimum(t, self.tail.whole_rounds - 1)), index
            ),
            jnp.where(whole, 0, first),
            jnp.where(whole, self.tail.blocks, stop),
        )

    def tile_of(self, index: Any) -> tuple[Any, Any, Any]:
        """(batch, head, first query row) of work item ``index`` (``cluster_rows`` rows)."""
        return query_tile(
            index, self.heads, self.batch, self.q_tiles, self.cluster_rows, self.causal,
            self.along_sequence,
        )  # fmt: skip

    def steps(self, last_row: Any) -> Any:
        """Key blocks that rows up to ``last_row`` see (:func:`._mosaic_grid.key_blocks`)."""
        return key_blocks(last_row, self.seq_k, self.reach, self.bk, self.bounded)

    def full_steps(self, first_row: Any, steps: Any) -> Any:
        """Key blocks up to which every row from ``first_row`` on sees whole ones (no mask needed
        on the right)."""
        return full_key_blocks(first_row, steps, self.seq_k, self.reach, self.bk, self.bounded)

    def blocks_of(self, cluster_base: Any) -> tuple[Any, Any]:
        """(first, end) key block a cluster's tile from row ``cluster_base`` streams."""
        stop = self.steps(cluster_base + self.cluster_rows - 1)
        if self.window is None:
            return 0, stop
        xp = np if on_host(cluster_base) else jnp
        return xp.minimum(self.first_step(cluster_base), stop), stop

    def first_step(self, first_row: Any) -> Any:
        """The first key block that rows from ``first_row`` on see through the window."""
        assert self.window is not None
        return first_key_block(first_row, self.offset, self.window[0], self.bk)

    def full_from(self, last_row: Any) -> Any:
        """The first key block from which every row up to ``last_row`` sees whole ones through the
        window (no mask needed on the left)."""
        assert self.window is not None
        return first_key_block(last_row, self.offset, self.window[0], self.bk, round_up=True)


def _fwd_kernel(q_ref, k_ref, v_ref, *refs: Any, g: _Geom) -> None:
    (o_ref, lse_ref, *pieces_out), (smem, ready, consumed, schedule) = refs[:-4], refs[-4:]
    q_tiles, k_smem, v_smem, *extra = smem
    o_tiles = extra.pop(0) if g.out_buffer else q_tiles
    p_tiles = None if g.fused_pv else extra.pop(0)
    k_ready, v_ready, q_ready = ready
    k_used, v_used = consumed
    wg = lax.axis_index("wg")
    cta = lax.axis_index("cta")  # the cluster's index on the grid
    rank = lax.axis_index("cluster") if g.cluster > 1 else 0  # this CTA's place in its cluster
    my_tiles = g.tiles_of(cta)
    bk, slots = g.bk, g.slots
    dtype = q_ref.dtype

    def tile(t: Any) -> tuple[Any, ...]:
        """(batch, head, first row, first and end key block the cluster streams) of this CTA's
        ``t``-th tile (see ``_Geom.item``)."""
        index, first, stop = g.item(cta, t)
        b, h, cluster_base = g.tile_of(index)
        if stop is None:
            first, stop = g.blocks_of(cluster_base)
        return b, h, cluster_base + rank * CTA_ROWS, first, stop

    def slot_of(step: Any) -> Any:
        return lax.rem(step, jnp.int32(slots))

    # Ping-pong: warpgroup w's turn is barrier w's completion. On the GPU a hardware barrier of
    # both warpgroups' threads, which the other warpgroup arrives on; in the interpreter, which has
    # none, an mbarrier of one arrival.
    def pass_turn() -> None:
        if not g.pingpong:
            return
        if g.hardware_barriers:
            hardware_barrier("arrive", FIRST_FREE_BARRIER + 1 - wg, COMPUTE_WGS * WARPGROUP_THREADS)
        else:
            plgpu.barrier_arrive(schedule.at[1 - wg])

    def wait_turn() -> None:
        if not g.pingpong:
            return
        if g.hardware_barriers:
            hardware_barrier("sync", FIRST_FREE_BARRIER + wg, COMPUTE_WGS * WARPGROUP_THREADS)
        else:
            plgpu.barrier_wait(schedule.at[wg])

    def wait_values(slot: Any) -> None:
        plgpu.barrier_wait(v_ready.at[slot])
        wait_turn()

    @pl.when(wg < COMPUTE_WGS)
    def _compute() -> None:
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        q_smem, o_smem = q_tiles.at[wg], o_tiles.at[wg]

        def load_q(t: Any) -> None:
            b, h, cta_base, *_ = tile(t)
            rows = pl.ds(cta_base + wg * WG_ROWS, WG_ROWS)
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem, q_ready.at[wg])

        load_q(0)  # every CTA has a tile: ctas <= tiles
        pl.when(wg == 1)(wait_turn)  # a turn behind

        def run_tile(t: Any, first_step: Any) -> Any:
            b, h, cta_base, first, cta_steps = tile(t)
            ring_base = first_step - first  # block kv's ring slot: slot_of(ring_base + kv)
            q_base = cta_base + wg * WG_ROWS
            q_last = q_base + WG_ROWS - 1
            # This warpgroup's blocks [start, steps) of the CTA's [first, cta_steps): the left edge
            # masked to `left`, whole blocks to `right`, then the right edge (the diagonal) masked.
            if g.window is None:
                steps = jnp.minimum(g.steps(q_last), cta_steps)
                start = left = first
                right = jnp.maximum(g.full_steps(q_base, steps), first)
            else:
                steps = jnp.clip(g.steps(q_last), first, cta_steps)
                start = jnp.clip(g.first_step(q_base), first, steps)
                right = jnp.maximum(g.full_steps(q_base, steps), start)
                left = jnp.clip(g.full_from(q_last), start, right)
            plgpu.barrier_wait(q_ready.at[wg])

            def step(kv: Any, carry: Any, masked: str | None) -> Any:
                acc, m, den = carry
                slot = slot_of(ring_base + kv)
                plgpu.barrier_wait(k_ready.at[slot])

                def qk(acc_ref: Any) -> Any:
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    pass_turn()
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((WG_ROWS, bk), jnp.float32))
                plgpu.barrier_arrive(k_used.at[slot])
                log2_scale = g.scale * LOG2E
                if not g.fold_scale:
                    s = s * log2_scale
                if masked:
                    # Whole-tile iotas, unlike the backward's masks (_pallas_mosaic_bwd._indices):
                    # this kernel does not spill with them, and index vectors read 0.985x at
                    # 8x2048x32x64 causal on an H100 (benchmarks/NOTES.md, fortieth round).
                    shape = (WG_ROWS, bk)
                    rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                    cols = cols + kv * bk
                    ok = None
                    if masked == "right":  # the key length, the diagonal or a window's right side
                        ok = cols < g.seq_k
                        if g.bounded:
                            ok = ok & (cols <= rows + (q_base + g.reach))
                    if g.window is not None:  # a narrow window's right edge may be its left too
                        seen = cols >= rows + (q_base + g.offset - g.window[0])
                        ok = seen if ok is None else ok & seen
                    s = jnp.where(ok, s, -jnp.inf)
                # With a positive scale the raw scores' row max, scaled, is the scaled scores', and
                # scaling inside exp2's argument makes one fused multiply-add per score.
                row_max = s.max(axis=1)
                m_new = jnp.maximum(m, row_max * log2_scale if g.fold_scale else row_max)
                alpha = jnp.exp2(m - m_new)
                scaled = s * log2_scale if g.fold_scale else s
                p = jnp.exp2(scaled - lax.broadcast_in_dim(m_new, s.shape, [0]))
                den = den * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dtype)
                wait_values(slot)

                if g.fused_pv:  # accumulate onto the rescaled output in the wgmma accumulator

                    def pv(acc_ref: Any) -> None:
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                else:  # the interpreter's wgmma takes operands from shared memory, without run_state
                    p_smem = p_tiles.at[wg]
                    p_smem[...] = p16
                    plgpu.commit_smem()

                    def pv_alone(acc_ref: Any) -> Any:
                        plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                        return acc_ref[...]

                    acc = acc + pl.run_scoped(pv_alone, plgpu.ACC((WG_ROWS, g.dpad), jnp.float32))
                plgpu.barrier_arrive(v_used.at[slot])
                return acc, m_new, den

            def acknowledge(kv: Any, carry: Any) -> Any:
                # Blocks only the other warpgroup needs: wait for each copy before releasing its
                # slot, so this warpgroup's arrivals never count towards a later phase of the slot.
                slot = slot_of(ring_base + kv)
                plgpu.barrier_wait(k_ready.at[slot])
                pass_turn()
                plgpu.barrier_arrive(k_used.at[slot])
                wait_values(slot)
                plgpu.barrier_arrive(v_used.at[slot])
                return carry

            carry = (
                plgpu.layout_cast(jnp.full((WG_ROWS, g.dpad), 0, jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(
                    jnp.full((WG_ROWS,), _FINITE_FLOOR, jnp.float32), plgpu.Layout.WGMMA.reduce(1)
                ),
                plgpu.layout_cast(
                    jnp.full((WG_ROWS,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1)
                ),
            )
            if g.window is not None:  # blocks only the other warpgroup's rows see, then the edge
                lax.fori_loop(first, start, acknowledge, None)
                carry = lax.fori_loop(start, left, functools.partial(step, masked="left"), carry)
            carry = lax.fori_loop(left, right, functools.partial(step, masked=None), carry)
            acc, m, den = lax.fori_loop(
                right, steps, functools.partial(step, masked="right"), carry
            )
            lax.fori_loop(steps, cta_steps, acknowledge, None)
            if g.out_buffer:  # the last product has read Q: fetch the next tile's meanwhile
                pl.when(t + 1 < my_tiles)(functools.partial(load_q, t + 1))

            den = jnp.maximum(den, 1e-30)  # rows with no visible key: acc is 0, out is 0
            acc = acc / lax.broadcast_in_dim(den, acc.shape, [0])
            lse = m * LN2 + jnp.log(den)
            rows = pl.ds(q_base, WG_ROWS)

            def store() -> None:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last O has left o_smem
                o_smem[...] = acc.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, rows, h])
                # From registers: a staging buffer would cost shared memory the key ring needs.
                lse_ref.at[b, h, rows][...] = lse

            def store_piece() -> None:
                # A tail piece, normalised on its own keys, to its slot for _merge_tail; in float32
                # from registers (a few a CTA), so the merge rounds to 16 bits once.
                o_pieces, lse_pieces = pieces_out
                slot, wg_rows = 2 * cta + g.tail_piece(t), pl.ds(wg * WG_ROWS, WG_ROWS)
                o_pieces.at[slot, wg_rows][...] = acc
                lse_pieces.at[slot, wg_rows][...] = lse

            if g.tail is None:
                store()
            else:
                pl.when(g.tail_piece(t) < 0)(store)
                pl.when(g.tail_piece(t) >= 0)(store_piece)
            if not g.out_buffer:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                pl.when(t + 1 < my_tiles)(functools.partial(load_q, t + 1))
            return ring_base + cta_steps

        lax.fori_loop(0, my_tiles, run_tile, jnp.int32(0))
        pl.when(wg == 0)(pass_turn)  # warpgroup 1's last turn
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory() -> None:
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

        def items(t: Any) -> tuple[Any, Any]:
            b, h, _, first, stop = tile(t)
            return stop - first, (b, lax.div(h, jnp.int32(g.group)), first)

        # In a cluster, each CTA copies its share of a block and TMA multicasts it to all of them.
        shared = dict(collective_axes="cluster") if g.cluster > 1 else {}

        def fetch(coords: Any, kv: Any, slot: Any) -> tuple[Any, Any]:
            # K and V apart: K's slot is released after S = Q K^T, before P V reads V.
            src = (coords[0], pl.ds((coords[2] + kv) * bk, bk), coords[1])
            return (
                lambda: plgpu.copy_gmem_to_smem(
                    k_ref.at[src], k_smem.at[slot], k_ready.at[slot], **shared
                ),
                lambda: plgpu.copy_gmem_to_smem(
                    v_ref.at[src], v_smem.at[slot], v_ready.at[slot], **shared
                ),
            )

        feed_ring(slots, my_tiles, items, fetch, (k_used, v_used), g.one_memory_warp)


def _one_tile_grid(causal: bool, seq_k: int) -> bool:
    """Whether the shape's forward runs one CTA a tile: causal from ``ONE_TILE_CAUSAL_KEYS`` keys."""
    return causal and seq_k >= ONE_TILE_CAUSAL_KEYS


def forward_persistent(causal: bool, seq_k: int) -> bool:
    """Whether the forward takes the persistent grid: all but :func:`_one_tile_grid`'s shapes, and
    those too where SMs are being spared (``_mosaic_grid.sparing_sms``, ring attention's transfers),
    which a grid of one CTA a tile would take."""
    return not _one_tile_grid(causal, seq_k) or spared_sms() > 0


def _interpreting(interpret: bool | None) -> bool:
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


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
    """Forward pass: ``(out [B, Sq, H, D], lse [B, H, Sq] float32)``.

    ``params.kv_blocksize`` is the key block (64, 128, 192 or 256), ``params.num_stages`` the depth of the
    shared-memory ring (>= 2); query tiles are 128 rows (two warpgroups of 64), or with
    ``params.q_blocksize=256`` 256 rows on a cluster of two CTAs, each key/value block copied once
    and multicast to both (512: four CTAs; any ``q_blocksize`` up to 128 means one CTA a tile).
    On a CPU the kernel runs in Mosaic GPU's interpreter (threads, barriers and TMA simulated: slow).
    """
    return _forward(q, k, v, spec=spec, params=params, interpret=interpret)


def _forward(
    q: Any,
    k: Any,
    v: Any,
    *,
    spec: AttentionSpec,
    params: FwdParams | None,
    interpret: bool | None,
    pingpong: bool = True,
    persistent: bool | None = None,
    along_sequence: bool | None = None,
    balanced: bool = True,
    split_tail: bool = True,
    one_memory_warp: bool = True,
) -> tuple[jax.Array, jax.Array]:
    _refuse(spec, q, k)
    batch, seq_q, heads, head_dim = q.shape
    _, seq_k, kv_heads, _ = k.shape
    params = params or heuristic(AttentionShape.of(q, k, spec))[0]
    bk = min(params.kv_blocksize, _whole_64s(seq_k))
    if bk % 64 or bk > 256:
        raise ValueError(f"kv_blocksize={params.kv_blocksize} must be 64, 128, 192 or 256")
    cluster = max(1, params.q_blocksize // CTA_ROWS)
    if params.q_blocksize > CTA_ROWS and params.q_blocksize not in CLUSTER_ROWS:
        raise ValueError(
            f"q_blocksize={params.q_blocksize} must be at most {CTA_ROWS} (one CTA a tile of "
            f"{CTA_ROWS} rows) or one of {CLUSTER_ROWS} (a cluster of CTAs sharing each key/value "
            "copy)"
        )
    sqp = -(-seq_q // (cluster * CTA_ROWS)) * cluster * CTA_ROWS
    skp = -(-seq_k // bk) * bk
    g = _Geom(
        causal=spec.causal,
        scale=spec.scale,
        seq_q=seq_q,
        seq_k=seq_k,
        group=heads // kv_heads,
        dpad=_whole_64s(head_dim),
        bk=bk,
        slots=min(max(2, params.num_stages), max(2, skp // bk)),
        heads=heads,
        batch=batch,
        resident=resident_ctas(_interpreting(interpret)),
        persistent=forward_persistent(spec.causal, seq_k) if persistent is None else persistent,
        along_sequence=FWD_ALONG_SEQUENCE if along_sequence is None else along_sequence,
        fused_pv=not _interpreting(interpret),
        pingpong=pingpong,
        hardware_barriers=not _interpreting(interpret),
        cluster=cluster,
        balanced=balanced,
        split_tail=split_tail,
        one_memory_warp=one_memory_warp,
        window=spec.window,
    )

    def pad(x: Any, seq: int) -> Any:
        return jnp.pad(x, ((0, 0), (0, seq - x.shape[1]), (0, 0), (0, g.dpad - x.shape[3])))

    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = (
        plgpu.SMEM((COMPUTE_WGS, WG_ROWS, g.dpad), q.dtype, transforms=tiled),
        plgpu.SMEM((g.slots, bk, g.dpad), q.dtype, transforms=tiled),
        plgpu.SMEM((g.slots, bk, g.dpad), q.dtype, transforms=tiled),
    )
    if g.out_buffer:
        smem = (*smem, plgpu.SMEM((COMPUTE_WGS, WG_ROWS, g.dpad), q.dtype, transforms=tiled))
    if not g.fused_pv:
        smem = (*smem, plgpu.SMEM((COMPUTE_WGS, WG_ROWS, bk), q.dtype, transforms=tiled))
    ready = (
        plgpu.Barrier(num_barriers=g.slots),
        plgpu.Barrier(num_barriers=g.slots),
        plgpu.Barrier(num_barriers=COMPUTE_WGS),
    )
    # A slot is refilled once every CTA it was multicast to has consumed it.
    release = (
        functools.partial(plgpu.ClusterBarrier, collective_axes=("cluster",))
        if cluster > 1
        else plgpu.Barrier
    )
    consumed = (
        release(num_arrivals=COMPUTE_WGS, num_barriers=g.slots),
        release(num_arrivals=COMPUTE_WGS, num_barriers=g.slots),
    )
    clustered = dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}
    out_type = (
        jax.ShapeDtypeStruct((batch, sqp, heads, g.dpad), q.dtype),
        jax.ShapeDtypeStruct((batch, heads, sqp), jnp.float32),
    )
    if g.tail is not None:  # two pieces a CTA at most (SplitTail)
        out_type += (
            jax.ShapeDtypeStruct((2 * g.rounds.ctas, CTA_ROWS, g.dpad), jnp.float32),
            jax.ShapeDtypeStruct((2 * g.rounds.ctas, CTA_ROWS), jnp.float32),
        )
    out, lse, *pieces = plgpu.kernel(
        functools.partial(_fwd_kernel, g=g),
        out_type=out_type,
        # The interpreter's ping-pong turns (the GPU's are hardware barriers).
        scratch_types=(smem, ready, consumed, plgpu.Barrier(num_barriers=COMPUTE_WGS)),
        grid=(g.rounds.ctas,),
        grid_names=("cta",),
        **clustered,
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if _interpreting(interpret) else None,
    )(pad(q, sqp), pad(k, skp), pad(v.astype(q.dtype), skp))
    if g.tail is not None:
        out, lse = _merge_tail(out, lse, *pieces, g=g)
    lse = lse[:, :, :seq_q]
    lse = jnp.where(lse < 0.5 * _FINITE_FLOOR, -jnp.inf, lse)  # rows that saw no key
    return out[:, :seq_q, :, :head_dim], lse


def _merge_tail(
    out: Any, lse: Any, o_pieces: Any, lse_pieces: Any, *, g: _Geom
) -> tuple[jax.Array, jax.Array]:
    """The split last round's tiles, each from its pieces' outputs (each normalised over its own
    keys) weighted by their share of the row's softmax sum, written into ``out`` and ``lse``."""
    assert g.tail is not None
    slots, valid = g.tail.table()
    piece_lse = jnp.where(valid[..., None], lse_pieces[slots], -jnp.inf)  # [tiles, pieces, rows]
    tile_lse = jax.nn.logsumexp(piece_lse, axis=1)
    weight = jnp.exp(piece_lse - tile_lse[:, None])
    # Unused slots were never written: zero them, not only their weights (0 * NaN is NaN).
    piece_out = jnp.where(valid[..., None, None], o_pieces[slots], 0.0)
    tile_out = (weight[..., None] * piece_out).sum(axis=1).astype(out.dtype)  # no TF32 rounding
    b, h, first_row = g.tile_of(np.arange(g.tail.whole, g.tail.tiles, dtype=np.int32))
    runs = _runs(b, h, first_row)
    if len(runs) > _MAX_MERGE_RUNS:  # tiles scattered over the heads: one scatter
        rows = first_row[:, None] + np.arange(CTA_ROWS, dtype=np.int32)
        out = out.at[b[:, None], rows, h[:, None]].set(tile_out)
        return out, lse.at[b[:, None], h[:, None], rows].set(tile_lse)
    # Consecutive tiles of a head as slices: on an H200 the scatter of 68 tiles took 16 us, about
    # 1% of the 2x8192x16x128 forward (ncu).
    for i, j in runs:
        bi, hi, row = int(b[i]), int(h[i]), int(first_row[i])
        out = out.at[bi, row : row + (j - i) * CTA_ROWS, hi].set(tile_out[i:j].reshape(-1, g.dpad))
        lse = lse.at[bi, hi, row : row + (j - i) * CTA_ROWS].set(tile_lse[i:j].reshape(-1))
    return out, lse


def _runs(b: np.ndarray, h: np.ndarray, first_row: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of tiles that follow one another along one head's rows."""
    starts = [0] + [
        i
        for i in range(1, len(b))
        if (b[i], h[i], first_row[i]) != (b[i - 1], h[i - 1], first_row[i - 1] + CTA_ROWS)
    ]
    return list(zip(starts, [*starts[1:], len(b)], strict=True))


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
    """Backward pass: ``(dq, dk, dv, None)``.

    ``params.variant`` ``"mosaic"`` (dK/dV and dQ kernels) or ``"mosaic_fused"`` (one kernel, dQ
    added by TMA reduce-add) runs the Mosaic GPU kernels of :mod:`._pallas_mosaic_bwd`
    (``NotImplementedError`` for head dims above 128); ``None`` (or ``"mirrored"``) the
    Triton-lowering ones of :mod:`._pallas_gpu`.
    """
    params = params or heuristic(AttentionShape.of(q, k, spec))[1]
    _refuse(spec, q, k, params)
    if params.variant in _pallas_mosaic_bwd.VARIANTS:
        dq, dk, dv = _pallas_mosaic_bwd.bwd(
            q, k, v, out, lse, dout, spec=spec, params=params, interpret=_interpreting(interpret)
        )
        return dq, dk, dv, None
    if params.variant == CUDNN_BWD:
        if _interpreting(interpret):
            raise NotImplementedError(
                f"BwdParams.variant={CUDNN_BWD!r} runs cuDNN's kernel, which has no interpreter"
            )
        return (*_cudnn.residual_bwd(q, k, v, out, lse, dout, spec=spec), None)
    if params.variant is not None and params.variant not in PORTABLE_VARIANTS:
        raise ValueError(
            f"BwdParams.variant={params.variant!r} must be one of "
            f"{(*_pallas_mosaic_bwd.VARIANTS, CUDNN_BWD, *PORTABLE_VARIANTS)} or None"
        )
    return _pallas_gpu.bwd(
        q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, dout,
        spec=spec, params=params, interpret=interpret,
    )  # fmt: skip


def _smem_bytes(d: int, bk: int, slots: int, out_buffer: bool = False) -> int:
    return 2 * ((2 if out_buffer else 1) * CTA_ROWS * d + 2 * slots * bk * d)


def _mosaic_bwd(shape: AttentionShape) -> BwdParams | None:
    """The Mosaic backward's blocks, or None where it cannot take the head dim.

    128 key rows per dK/dV CTA (two warpgroups) and query blocks of 64 rows at D = 128 (S^T and dP^T
    beside two 64 x 128 float32 accumulators fill a warpgroup's registers), 128 below; two stages.
    Chosen for registers and shared memory; the GPU runs since have kept it (benchmarks/NOTES.md).
    """
    d = _whole_64s(shape.head_dim)
    seq_q, seq_k = _whole_64s(shape.seq_q), _whole_64s(shape.seq_k)
    bq = min(128 if d <= 64 else 64, seq_q)
    bp = BwdParams(
        q_blocksize=bq,
        kv_blocksize=min(128, seq_k),
        num_warps=12,
        num_stages=2,
        variant=_pallas_mosaic_bwd.VARIANT,
    )
    return bp if _pallas_mosaic_bwd.supports(shape.head_dim, bp) else None


def heuristic(shape: AttentionShape) -> tuple[FwdParams, BwdParams]:
    """128-row query tiles (causal from ``ONE_TILE_CAUSAL_KEYS`` keys, 256 in clusters of two CTAs,
    one cluster a tile); the largest key block and ring that fit shared memory, narrower for a
    narrow window (``NARROW_WINDOW_BLOCKS``); the Mosaic backward where it takes the head dim (up
    to 128), fused where it fits and nothing is masked or the mask is causal over
    ``FUSED_CAUSAL_KEYS`` keys or more (at head dims above 64 without GQA), else the split one, and
    the Triton-lowering one above head dim 128.

    On an H200 at 2x4096x16x128 bf16, (128-key blocks, 2 slots) ran at 246 (full) and 226 (causal)
    TFLOP/s, (64, 4 slots) at 215 and 146 (benchmarks/results/check_pallas_gpu_h200.json). At head
    dim 64, 256-key blocks ran 1.12x (128, 3) not causal and the same causal at 8x2048x32x64
    (results/mosaic_variants_NVIDIA_H200_20261121-134541.json); 192-key blocks spilled registers
    and lost at every shape. At D=128 the fused backward ran forward+backward 1.01-1.06x the split
    one not causal and 0.94-1.04x causal on an H200
    (results/mosaic_variants_NVIDIA_H200_20261121-174012.json); causal from 16k keys 1.03-1.04x
    (2x16384, 1x32768, 1x65536), with GQA (1x32768, 32/8 heads) 0.99x
    (results/mosaic_variants_NVIDIA_H200_20261121-213925.json, -214449.json). Below 16k keys it
    read 0.94-1.01x with its tiles heads fastest; along the sequence (the order it now takes causal)
    1.00-1.03x the split one at 4x4096 and 0.99-1.03x at 2x8192 over three runs on an H200 and one
    on an H100, 0.96-0.98x at 4x2048 (results/bwd_orders_NVIDIA_H200_20261123-092530.json,
    -093257.json, bwd_orders_NVIDIA_H100_80GB_HBM3_20261123-092946.json,
    mosaic_variants_NVIDIA_H200_20261123-092040.json).

    At head dim 64 the fused backward (128-row query blocks) ran forward+backward 1.07 / 1.09 /
    1.07x the split one without a mask at 8x2048x32x64, 2x8192x32x64 and 4x4096x32x64, 1.04-1.06x
    with 8 kv heads at the first two; causal 1.04-1.05x from 4096 keys (with GQA too) and 0.98x at
    2048 (results/mosaic_variants_NVIDIA_H200_20261128-022354.json, -022539.json). With the
    backward's masks built from index vectors (fortieth round) it read at 2048 keys 1.003x the split
    on an H200 and 0.94x on an H100, with GQA 1.009x and 0.99x (mosaic_variants_NVIDIA_H200_
    20261128-042246.json, ..._H100_80GB_HBM3_20261128-042842.json). On one CTA a tile without GQA
    (forty-second round; it had run on the persistent grid) it read 1.06x the split at 8x2048x32x64
    causal on an H200, and with GQA (persistent) 1.026x at 8x2048x32(8 kv)x64; at 1024 keys
    (16x1024x16x64) 0.99x (mosaic_variants_NVIDIA_H200_20261128-075751.json, -080322.json): it
    takes causal from 2048 keys at head dim 64.

    Causal at head dim 64 without GQA the Triton-lowering backward had led the split one by
    1.02-1.10x, until the split's dK/dV kernel went persistent there (benchmarks/NOTES.md,
    thirty-fifth round). Since then the split leads it after this forward, forward+backward:
    1.009x at 16x1024x16x64, 1.027x at 4x4096x32x64, 1.035x at 8x2048x32x64 and 1.049x at
    2x8192x32x64 on an H200; 1.030x and 1.042x at the last two on an H100
    (results/tune_shipped_NVIDIA_H200_d64_causal_split_vs_portable_20261127.json,
    tune_shipped_NVIDIA_H200_d64_persistent_20261127.json, ..._H100_80GB_HBM3_d64_persistent_...).
    """
    d = _whole_64s(shape.head_dim)
    bk, slots = (256, 2) if d <= 64 else (128, 2) if d <= 128 else (64, 2)
    seen, narrow = shape.spec.window_keys, NARROW_WINDOW_BLOCKS.get(d)
    if seen is not None and narrow is not None and seen <= narrow[0]:
        bk, slots = narrow[1:]
    rows = 2 * CTA_ROWS if _clustered(shape) else CTA_ROWS
    fp = FwdParams(q_blocksize=rows, kv_blocksize=bk, num_warps=12, num_stages=slots)
    split = _mosaic_bwd(shape)
    if split is None or shape.spec.window is not None:
        return fp, _pallas_gpu.heuristic(shape)[1]
    fused = _fused_bwd(shape, split)
    # Causal with GQA the fused kernel led the split at head dim 64, not at 128 (0.99x; docstring).
    fused_causal = shape.seq_k >= FUSED_CAUSAL_KEYS.get(d, 0) and (
        d <= 64 or shape.heads == shape.kv_heads
    )
    return fp, fused if fused and (not shape.spec.causal or fused_causal) else split


def _clustered(shape: AttentionShape) -> bool:
    """The forward in clusters of two CTAs: on its grid of one CTA a tile (causal from
    ``ONE_TILE_CAUSAL_KEYS`` keys), where clusters ran 1.01-1.02x single CTAs on an H200 and
    1.00-1.03x on an H100 (the files of ``ONE_TILE_CAUSAL_KEYS``)."""
    return shape.seq_q > CTA_ROWS and _one_tile_grid(shape.spec.causal, shape.seq_k)


def _fused_bwd(shape: AttentionShape, split: BwdParams) -> BwdParams | None:
    """The fused backward's block shape for the head dim (128 key rows; 64 query rows at head dims
    65-128, 128 at up to 64; two stages), or None where it cannot take the shape (a whole block of
    each)."""
    q_rows = _pallas_mosaic_bwd.FUSED_Q_ROWS.get(_whole_64s(shape.head_dim))
    if q_rows is None:
        return None
    fused = dataclasses.replace(
        split, q_blocksize=q_rows, kv_blocksize=128, num_stages=2,
        variant=_pallas_mosaic_bwd.FUSED_VARIANT,
    )  # fmt: skip
    # (shorter sequences shrink the blocks: _pallas_mosaic_bwd._geom)
    whole = _whole_64s(shape.seq_q) >= q_rows and _whole_64s(shape.seq_k) >= 128
    return fused if whole and _pallas_mosaic_bwd.supports(shape.head_dim, fused) else None


def candidates(shape: AttentionShape) -> list[tuple[FwdParams, BwdParams]]:
    """Key blocks and ring depths that fit shared memory, and the heuristic's in clusters of two
    CTAs (256 query rows; on an H200 0.97-1.00x one CTA a tile without a mask and 0.96-0.98x causal
    at D = 128: results/mosaic_variants_NVIDIA_H200_20261121-211951.json); backward: Mosaic blocks
    (64 or 128 key rows per CTA, 2 or 3 stages) where the head dim allows, the fused Mosaic backward
    (dQ by TMA reduce-add; 128 key rows by 64 query rows at head dims 65-128 or 128 up to 64, 2
    stages), cuDNN's backward
    on this forward's residuals where cuDNN runs (on an H200 1.00-1.04x cuDNN's forward+backward:
    results/mosaic_variants_NVIDIA_H200_20261122-223652.json), and the Triton-lowering candidates."""
    d = _whole_64s(shape.head_dim)
    heur = heuristic(shape)
    out = [heur]
    seq_k = _whole_64s(shape.seq_k)
    for bk in (64, 128, 256):
        for slots in (2, 3, 4):
            fp = FwdParams(q_blocksize=CTA_ROWS, kv_blocksize=bk, num_warps=12, num_stages=slots)
            if (
                bk <= seq_k
                and _smem_bytes(d, bk, slots) <= _SMEM_LIMIT
                and (fp, heur[1]) not in out
            ):
                out.append((fp, heur[1]))
    if shape.seq_q > CTA_ROWS:  # the heuristic's blocks in clusters of two CTAs or not
        other_rows = CTA_ROWS if heur[0].q_blocksize > CTA_ROWS else 2 * CTA_ROWS
        other = (dataclasses.replace(heur[0], q_blocksize=other_rows), heur[1])
        if other not in out:
            out.append(other)
    bwds: list[BwdParams] = []
    base = _mosaic_bwd(shape) if shape.spec.window is None else None
    if base is not None:
        blocks = [
            dataclasses.replace(base, kv_blocksize=key_rows, num_stages=stages)
            for key_rows in (64, 128)
            for stages in (2, 3)
        ]
        # The default blocks first: a tune that times one candidate of each backward kernel (the
        # shipped tunes) takes the first.
        for bp in sorted(blocks, key=lambda bp: bp != base):
            if bp.kv_blocksize <= seq_k and _pallas_mosaic_bwd.supports(shape.head_dim, bp):
                bwds.append(bp)
        fused = _fused_bwd(shape, base)
        if fused:
            bwds.append(fused)
    if _cudnn.available() and _cudnn.mask_refusal(shape.spec, shape.seq_q, shape.seq_k) is None:
        bwds.append(BwdParams(variant=CUDNN_BWD))
    bwds += [bp for _, bp in _pallas_gpu.candidates(shape)]
    for bp in bwds:
        if (heur[0], bp) not in out:
            out.append((heur[0], bp))
    return out


BACKEND = register_backend(
    AttentionBackend(
        platform="pallas",
        variant="mosaic",
        devices=("gpu",),
        fwd=fwd,
        bwd=bwd,
        unsupported=_UNSUPPORTED,
        bwd_unsupported=_BWD_UNSUPPORTED,
        heuristic=heuristic,
        candidates=candidates,
        available=available,
    )
)
