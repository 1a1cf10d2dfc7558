"""Flash attention backward in Pallas Mosaic GPU for Hopper (``BwdParams(variant="mosaic")`` and
``"mosaic_fused"``).

FlashAttention 3's split, without atomics, after ``delta = rowsum(dout * out)`` in XLA:

* dK/dV: one CTA per (key tile, kv head, batch). Each compute warpgroup keeps 64 key rows of K and V
  in shared memory (``kv_blocksize`` 64 or 128: one or two warpgroups); a memory warpgroup streams
  blocks of ``q_blocksize`` query rows (Q, dO, lse, delta) with TMA through a ring of
  ``num_stages`` slots. Per block a warpgroup issues S^T = K Q^T and dP^T = V dO^T together, forms
  P^T while dP^T is still on the tensor cores, issues dV += P^T dO (where registers allow) while it
  forms dS^T = P^T (dP^T - delta), then dK += dS^T Q.
  The query heads of a GQA group follow one another in the same stream, so the group's sum stays in
  the accumulators.
* dQ: tiles of (128 query rows, head, batch); two compute warpgroups of 64 rows hold Q and dO,
  the memory warpgroup streams K and V blocks of ``kv_blocksize`` rows; dQ += dS K, P formed while
  dP is on the tensor cores.

Either kernel runs one CTA per tile or the persistent grid of :mod:`._mosaic_grid` (its ring and
barrier phases carried from tile to tile; the next tile's dO, lse and delta loaded under the
epilogue). By default the dQ kernel is persistent except causal at head dims above 64, where it
measured 0.95-0.97x, and the split's dK/dV kernel only at head dims up to 64 (0.98-1.04x, mostly
above 1.00x; at 128 0.83-0.98x). The fused kernel runs one CTA per tile where it feeds itself
(:func:`backward_persistent`).

``"mosaic_fused"`` runs the dK/dV kernel alone (128 keys; head dims padded to 128 with 64 query rows a
block, or to 64 with 128): both warpgroups store their dS^T to a shared, double-buffered tile and
meet on a barrier; each then issues dV += P^T dO, dK += dS^T Q and its own 64 x 64 part of the
block's dQ = dS K (over all 128 keys; at head dim 128 a half of the columns, at 64 a half of the
rows) together, and adds that float32 part into a dQ accumulator in global memory with a TMA
reduce-add; XLA zeroes the accumulator before and scales and casts it after. Five matrix products per
block pair instead of seven; the order of the additions varies, so dQ's last bits do too. On an H200
it measured 1.01-1.06x the split forward+backward without a mask and 0.94-1.04x causal at head dim
128, and 1.04-1.09x and 1.00-1.05x at 64 (see benchmarks/NOTES.md); the forward backend's heuristic
takes it where nothing is masked. Without
GQA it has no memory warpgroup: warpgroup 0 issues each ring copy once both have released the slot,
and the compute warpgroups keep the registers a memory warpgroup would hold (``_Geom.self_fed``).

Both kernels number their tiles along the sequence (a head's tiles one after another, so CTAs at
work together read the same stream from L2, which saves HBM traffic and with it power, hence clock),
except the dK/dV kernel causal below 16k keys: there its tiles go heads fastest, which evens out
their unequal work, in bands of a few heads so that the CTAs at work still share their rows
(:func:`_along_sequence`, :func:`_dkdv_band`, :func:`._mosaic_grid.split_index`).

Causal attention skips blocks a warpgroup cannot see and masks only those that cross the diagonal
(the fused kernel masks instead of skipping: every block's dQ needs both warpgroups' dS).
Warpgroups of one CTA share the stream, so a warpgroup acknowledges the blocks only its neighbour
needs (it waits for each copy and releases the slot) and barrier phases stay in step. Sequences are
padded to whole tiles: padded query rows get lse = +inf, hence P = 0; padded keys are masked in the
dQ kernel (in dK/dV they only reach their own rows, which are cut off, and the fused dQ through their
K rows, which are zero).

Registers bound the head dim: a dK/dV warpgroup holds two 64 x D float32 accumulators (128 registers
per thread at D = 128) besides S^T and dP^T, so the head dim, padded to 64, may be at most 128.
Larger ones raise ``NotImplementedError``; the backend's heuristic keeps the Triton-lowering backward
for them.

On a CPU the kernels run in Mosaic GPU's interpreter, which takes wgmma operands only from shared
memory and no accumulators through ``pl.run_state``: there P^T, dS^T and dS are stored to shared
memory and each product is added to its accumulator in registers (``_Geom.registers_a`` off). It has
no TMA reduce either: there the fused kernel reads, adds and writes back its dQ part
(``_Geom.tma_reduce`` off). The rest (ring, barriers, masking, bounds) is the code that runs
on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .._registry import BwdParams
from ._backend import band_sizes, on_host, tile_div
from ._mosaic_grid import (
    FIRST_FREE_BARRIER,
    HOPPER_SMEM_BYTES,
    WARPGROUP_THREADS,
    Rounds,
    feed_ring,
    full_key_blocks,
    hardware_barrier,
    key_blocks,
    order_band,
    query_tile,
    query_tiles_work,
    resident_ctas,
    split_index,
)
from ._spec import AttentionSpec

__all__ = [
    "FUSED_VARIANT",
    "LOG2E",
    "MAX_HEAD_DIM",
    "VARIANT",
    "VARIANTS",
    "WG_ROWS",
    "bwd",
    "supports",
]

VARIANT = "mosaic"
FUSED_VARIANT = "mosaic_fused"
VARIANTS = (VARIANT, FUSED_VARIANT)
LOG2E = math.log2(math.e)
WG_ROWS = 64  # rows of one wgmma (m = 64 per warpgroup)
Q_TILE_WGS = 2  # compute warpgroups of the dQ kernel
MAX_HEAD_DIM = 128
BLOCKS = (64, 128)
# What our buffers may take of a CTA's shared memory, leaving room for what Mosaic adds (barriers,
# reduction scratch).
_SMEM_LIMIT = HOPPER_SMEM_BYTES - 4096
_TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
_TILED_F32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
# The fused kernel's query rows a block, by padded head dim: its two warpgroups share each dQ block
# by columns at 128 (64-row blocks), by rows at 64 (128-row blocks: each block pair then has the
# products and the exchange of one at head dim 128, not half of them).
FUSED_Q_ROWS = {128: WG_ROWS, 64: 2 * WG_ROWS}
_MEMORY_REGISTERS = 24  # the memory warpgroup only issues copies
# The self-fed kernel's hardware barriers: a dS^T half stored (one per buffer and waiting
# warpgroup: a warpgroup a block ahead must not complete the neighbour's barrier on its own), a ring
# slot released by warpgroup 1, K read by both. A hardware barrier counts arrivals, not phases: one
# release barrier is safe only because the dS^T exchange keeps warpgroup 1 within a block of
# warpgroup 0 (without it the GPU hung twice; benchmarks/NOTES.md, twentieth and twenty-first rounds).
_DS_STORED = FIRST_FREE_BARRIER
_RELEASED = _DS_STORED + 4
_K_READ = _RELEASED + 1
ONE_MEMORY_WARP = True  # one warp of it runs the copy loop (_mosaic_grid.feed_ring)


def _compute_registers(compute_wgs: int) -> int:
    """Per-thread registers of each compute warpgroup, in multiples of 8, at most 256.

    Every warpgroup starts with the register file shared out evenly (168 a thread for three), and
    ``setmaxnreg`` only moves registers between them: the compute warpgroups get what the memory
    warpgroup gives up. Asking for more waits forever (an H200 hung so).
    """
    wgs = compute_wgs + 1
    pool = wgs * min(256, 65536 // (128 * wgs) // 8 * 8)
    return min(256, (pool - _MEMORY_REGISTERS) // compute_wgs // 8 * 8)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dkdv_smem_bytes(d: int, key_rows: int, bq: int, slots: int) -> int:
    """K and V (16-bit) held, and per slot a Q and a dO block with their float32 lse and delta."""
    return 2 * 2 * key_rows * d + slots * (2 * 2 * bq * d + 2 * 4 * bq)


def _fused_smem_bytes(d: int, key_rows: int, bq: int, slots: int) -> int:
    """The dK/dV kernel's, the tile's dS^T (16-bit) twice over, and per warpgroup its float32 part of
    a dQ block on its way out."""
    return _dkdv_smem_bytes(d, key_rows, bq, slots) + 2 * key_rows * bq * 2 + bq * d * 4


def _fused_shape_ok(d: int, bq: int, key_rows: int) -> bool:
    """The fused kernel's shapes: two warpgroups of 64 keys, and query blocks of ``FUSED_Q_ROWS``
    for the head dim, so that each warpgroup's part of a dQ block is 64 x 64 float32 (beside dK and
    dV: 160 accumulator registers a thread at head dim 128, 96 at 64)."""
    return key_rows == 2 * WG_ROWS and FUSED_Q_ROWS.get(d) == bq


def _dq_smem_bytes(d: int, bk: int, slots: int) -> int:
    """Q, dO, lse and delta of the tile held, and per slot a K and a V block."""
    rows = Q_TILE_WGS * WG_ROWS
    return 2 * 2 * rows * d + 2 * 4 * rows + slots * 2 * 2 * bk * d


def _ring(num_stages: int, fits: Callable[[int], bool]) -> int:
    """The deepest ring of at most ``num_stages`` (at least 2) slots that fits shared memory."""
    for slots in range(max(2, num_stages), 1, -1):
        if fits(slots):
            return slots
    return 0


def supports(head_dim: int, params: BwdParams) -> bool:
    """Whether ``params.variant``'s kernels fit shared memory (and registers) with rings of at least
    two slots."""
    d = _cdiv(head_dim, 64) * 64
    if d > MAX_HEAD_DIM:
        return False
    if params.kv_blocksize not in BLOCKS or params.q_blocksize not in BLOCKS:
        return False
    if params.variant == FUSED_VARIANT:
        if not _fused_shape_ok(d, params.q_blocksize, params.kv_blocksize):
            return False
        fits = functools.partial(_fused_smem_bytes, d, params.kv_blocksize, params.q_blocksize)
        return bool(_ring(2, lambda s: fits(s) <= _SMEM_LIMIT))
    kv = _ring(
        2, lambda s: _dkdv_smem_bytes(d, params.kv_blocksize, params.q_blocksize, s) <= _SMEM_LIMIT
    )
    dq = _ring(2, lambda s: _dq_smem_bytes(d, params.kv_blocksize, s) <= _SMEM_LIMIT)
    return bool(kv and dq)


@dataclasses.dataclass(frozen=True)
class _Geom:
    causal: bool
    scale: float
    seq_q: int
    seq_k: int
    group: int
    dpad: int
    bq: int  # query rows of a block the dK/dV kernel streams
    bk: int  # key rows of a block the dQ kernel streams
    key_wgs: int  # compute warpgroups of the dK/dV kernel, 64 key rows each
    dkdv_slots: int  # ring depth of the dK/dV kernel (query blocks)
    dq_slots: int  # ring depth of the dQ kernel (key blocks)
    heads: int
    kv_heads: int
    batch: int
    resident: int  # CTAs a persistent grid may launch
    persistent: tuple[bool, bool]  # whether the dK/dV and the dQ kernel run on a persistent grid
    along_sequence: tuple[bool, bool]  # tile orders of the dK/dV and the dQ kernel (split_index)
    registers_a: bool = True
    fused: bool = False  # the dK/dV kernel also adds dQ into a float32 accumulator (no dQ kernel)
    tma_reduce: bool = True  # the fused dQ goes out by TMA reduce-add (else read-modify-write)
    balanced: bool = True  # persistent grids' CTA counts chosen for their busiest CTA's work
    dkdv_band: int = 0  # (batch, kv head) pairs a band of dK/dV tiles (0: along_sequence[0] says)

    @property
    def offset(self) -> int:
        """Key position of query row 0 on the causal diagonal (bottom-right alignment)."""
        return self.seq_k - self.seq_q

    @property
    def self_fed(self) -> bool:
        """Whether the fused kernel's compute warpgroups issue the ring's copies themselves, with no
        memory warpgroup: each thread may then hold 255 registers instead of 240, and the 152 bytes
        ptxas spilled went to none. Only without GQA. Forward+backward against the
        kernel with a memory warpgroup: 1.00-1.06x on an H100 at 4x2048, 4x4096, 2x8192, 2x16384,
        1x32768 and 1x3000 x16x128 over three runs, 1.00-1.02x on an H200; causal 1.03-1.21x on an
        H100 and 1.02-1.05x on an H200 at 4x4096, 2x8192, 2x16384 and 1x32768 (twentieth round);
        with GQA (32/8 heads) 0.92-0.93x on the H100, so GQA keeps the memory warpgroup
        (benchmarks/NOTES.md, seventeenth round). It runs on the persistent grid too, where ptxas
        spilled 160-172 bytes instead of 8-12 at head dim 128 and forward+backward read 0.90-0.91x
        one tile a CTA on an H200 (twenty-first round), so it takes one tile a CTA by
        default, at head dim 64 too (:func:`backward_persistent`)."""
        return feeds_itself(self.fused, self.group)

    @property
    def early_dv(self) -> bool:
        """Whether the dK/dV kernel issues a block's dV product before forming its dS^T (so the
        product runs beside that elementwise work). That holds P^T's 16-bit registers in flight beside
        S^T, dP^T and delta: per thread dK and dV (``dpad``) and 3/2 a query column of the block, 224
        at head dim 128 with 64-row blocks. Beyond that (head dim 64 with 128-row blocks: 256) it
        spilled and ran 0.77-0.85x cuDNN forward+backward at 8x2048x32x64 instead of 1.01-1.03x; the
        fused kernel, whose dQ product takes 32 registers more, ran 0.88-0.93x instead of 0.94-1.00x
        (H200, benchmarks/NOTES.md, fourteenth round). Both issue dV with dK there."""
        return not self.fused and self.dpad + 3 * self.bq // 2 <= 224

    @property
    def parts(self) -> int:
        """The fused kernel forms a block's S^T and dP^T in parts of 64 query columns, so that a
        128-row block holds no more registers at once than a 64-row one (its later parts' products
        run beside the earlier parts' elementwise work)."""
        return self.bq // WG_ROWS if self.fused else 1

    @property
    def dq_by_rows(self) -> bool:
        """Whether the fused kernel's warpgroups share a dQ block by query rows (128-row blocks),
        not by head-dim columns."""
        return self.fused and self.bq > WG_ROWS

    @property
    def dq_part(self) -> tuple[int, int]:
        """(rows, columns) of a fused warpgroup's part of a dQ block."""
        if self.dq_by_rows:
            return WG_ROWS, self.dpad
        return self.bq, self.dpad // 2

    @property
    def key_rows(self) -> int:
        return self.key_wgs * WG_ROWS

    @property
    def q_blocks(self) -> int:
        return _cdiv(self.seq_q, self.bq)

    @property
    def sqp(self) -> int:
        return _cdiv(self.seq_q, Q_TILE_WGS * WG_ROWS) * Q_TILE_WGS * WG_ROWS

    @property
    def skp(self) -> int:
        tile = max(self.key_rows, self.bk)
        return _cdiv(self.seq_k, tile) * tile

    @property
    def q_tiles(self) -> int:
        return self.sqp // (Q_TILE_WGS * WG_ROWS)

    @property
    def key_tiles(self) -> int:
        """The dK/dV kernel's tiles along the keys of one kv head."""
        return self.skp // self.key_rows

    @functools.cached_property
    def dkdv_rounds(self) -> Rounds:
        """The dK/dV kernel's tiles (key rows of a kv head) over its CTAs; a persistent causal grid
        balanced on their work (:meth:`Rounds.balanced`). Its rounds alternate direction, and
        where a band's heavy-to-light run falls in step with them, one CTA count puts the heavy
        tiles on the same CTAs: at 4x4096x32x64 causal in bands of 8 heads, the busiest of 132 CTAs
        did 1.47x their mean work (the grid ran 0.92x one CTA a tile on an H200); on 128 CTAs the
        busiest does 1.03x the same mean (benchmarks/NOTES.md, thirty-fifth round)."""
        if not (self.balanced and self.persistent[0] and self.causal):
            tiles = self.kv_heads * self.key_tiles * self.batch
            return Rounds.of(tiles, self.resident, self.persistent[0])
        return Rounds.balanced(self.dkdv_tile_work(), self.resident, True)

    @property
    def dkdv_tile_band(self) -> int:
        """(batch, kv head) pairs a band of the dK/dV kernel's tiles (:func:`split_index`):
        ``dkdv_band`` where set, else the plain order ``along_sequence[0]`` names."""
        return self.dkdv_band or order_band(self.along_sequence[0], self.kv_heads * self.batch)

    def dkdv_tile_work(self) -> np.ndarray:
        """Each dK/dV tile's work, in work-item order: the query blocks its keys see, once for each
        head of the group, plus one for its epilogue."""
        index = np.arange(self.kv_heads * self.key_tiles * self.batch, dtype=np.int32)
        _, _, rank = split_index(
            index, self.kv_heads, self.batch, self.key_tiles, self.dkdv_tile_band
        )
        return (self.q_blocks - self.first_q_block(rank * self.key_rows)) * self.group + 1.0

    @functools.cached_property
    def dq_rounds(self) -> Rounds:
        """The dQ kernel's tiles (query rows of a head) over its CTAs, balanced on their work as
        the forward's are (:meth:`Rounds.balanced`)."""
        if not (self.balanced and self.persistent[1]):  # nothing to balance: skip counting the work
            return Rounds.of(
                self.heads * self.q_tiles * self.batch, self.resident, self.persistent[1]
            )
        work = query_tiles_work(
            self.kv_steps, self.heads, self.batch, self.q_tiles, Q_TILE_WGS * WG_ROWS,
            self.causal, self.along_sequence[1],
        )  # fmt: skip
        return Rounds.balanced(work, self.resident, True)

    def key_tile(self, cta: Any, t: Any) -> tuple[Any, Any, Any]:
        """(batch, kv head, first key row) of the dK/dV kernel's ``t``-th tile in ``cta``; the
        first keys (which causal queries see most) first."""
        index = self.dkdv_rounds.index(cta, t)
        b, kvh, rank = split_index(
            index, self.kv_heads, self.batch, self.key_tiles, self.dkdv_tile_band
        )
        return b, kvh, rank * self.key_rows

    def query_tile(self, cta: Any, t: Any) -> tuple[Any, Any, Any]:
        """(batch, head, first query row) of the dQ kernel's ``t``-th tile in ``cta``."""
        index = self.dq_rounds.index(cta, t)
        rows = Q_TILE_WGS * WG_ROWS
        return query_tile(
            index, self.heads, self.batch, self.q_tiles, rows, self.causal, self.along_sequence[1]
        )

    # dK/dV: which query blocks the keys from ``key`` on see.

    def first_q_block(self, key: Any) -> Any:
        """The first query block that sees key ``key``: inside a kernel, or on numpy arrays (the
        grid planned on the host)."""
        host = on_host(key)
        if not self.causal:
            return np.zeros_like(key) if host else jnp.int32(0)
        xp = np if host else jnp
        return xp.minimum(tile_div(xp.maximum(key - self.offset, 0), self.bq), self.q_blocks)

    def first_full_q_block(self, key: Any, first: Any) -> Any:
        """The first query block (from ``first`` on) whose every row sees all 64 keys from ``key``."""
        if not self.causal:
            return first
        row = jnp.maximum(key + (WG_ROWS - 1) - self.offset, 0)
        full = lax.div(row + (self.bq - 1), self.bq)
        return jnp.clip(full, first, self.q_blocks)

    # dQ: which key blocks the query rows up to / from a row see (as the forward).

    def kv_steps(self, last_row: Any) -> Any:
        return key_blocks(last_row, self.seq_k, self.offset, self.bk, self.causal)

    def full_kv_steps(self, first_row: Any, steps: Any) -> Any:
        return full_key_blocks(first_row, steps, self.seq_k, self.offset, self.bk, self.causal)


def _acc(rows: int, cols: int) -> Any:
    return plgpu.layout_cast(jnp.full((rows, cols), 0, jnp.float32), plgpu.Layout.WGMMA)


def _indices(start: Any, shape: tuple[int, int], axis: int) -> Any:
    """``start, start + 1, ...`` along a WGMMA tile's ``axis``, the same across the other.

    Built as a vector and broadcast: a whole-tile iota does not depend on the step, and kept across
    the step loop it takes a register a score. Masks built from two of these spilled 34-100% fewer
    bytes and ran up to 1.07x faster at head dim 64 (benchmarks/NOTES.md, fortieth round)."""
    layout = plgpu.Layout.WGMMA.reduce(1 - axis)
    vector = plgpu.broadcasted_iota(jnp.int32, (shape[axis],), 0, layout=layout) + start
    return _spread(vector, shape, axis)


def _pipelined(
    g: _Geom,
    body: Callable[[tuple[Any, ...]], None],
    carried: tuple[Any, ...],
    fresh: tuple[tuple[int, int], ...],
) -> tuple[Any, ...]:
    """Runs ``body(refs)``, which issues wgmma products onto accumulator refs: one per ``carried``
    value, starting from it, then one per ``fresh`` shape, starting from zero. Returns every
    accumulator's final value.

    The body reads an accumulator while later products are still in flight
    (``plgpu.wgmma_accumulator_load(ref, wait_n=n)``; products complete in the order issued), so its
    elementwise work runs while the tensor cores work on its own later products.

    On the GPU: one ``pl.run_state``. The interpreter runs no accumulators through ``pl.run_state``:
    there every accumulator starts from zero in ``pl.run_scoped`` and the carried values are added
    afterwards.
    """
    if g.registers_a:
        inits = [plgpu.ACC.init(c) for c in carried] + [plgpu.ACC.init(_acc(*f)) for f in fresh]
        return tuple(pl.run_state(body)(tuple(inits)))

    def scoped(*refs: Any) -> tuple[Any, ...]:
        body(refs)
        return tuple(r[...] for r in refs)

    shapes = [c.shape for c in carried] + list(fresh)
    outs = pl.run_scoped(scoped, *[plgpu.ACC(sh, jnp.float32) for sh in shapes])
    n = len(carried)
    return tuple(c + o for c, o in zip(carried, outs[:n], strict=True)) + tuple(outs[n:])


def _operand(g: _Geom, value: Any, staging: Any) -> Any:
    """A wgmma left operand: ``value`` itself from registers on the GPU; the interpreter takes
    operands only from shared memory, so there it is stored to ``staging`` first."""
    if g.registers_a:
        return value
    staging[...] = value
    plgpu.commit_smem()
    return staging


def _spread(vector: Any, shape: tuple[int, int], axis: int) -> Any:
    """A vector laid along a tile's ``axis``, the same across the tile's other axis."""
    return lax.broadcast_in_dim(vector, shape, [axis])


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, g) -> None:
    # The fused kernel takes the float32 dQ accumulator as a further (aliased) input.
    dq_acc = refs[0] if g.fused else None
    dk_ref, dv_ref, smem, ready, consumed = refs[1:] if g.fused else refs
    k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, *extra = smem
    rest = iter(extra)
    p_stage = None if g.registers_a else next(rest)
    ds_stage = next(rest) if g.fused or not g.registers_a else None
    dq_stage = next(rest) if g.fused else None
    # A ring slot's four copies (Q, dO, lse, delta) arrive on one barrier: one wait a step.
    k_ready, v_ready, block_ready, *fused_barriers = ready
    # The fused kernel's: a dS^T buffer stored by both warpgroups, the interpreter's dQ read, K read
    # by both before dK overwrites it.
    ds_stored, dq_read, k_read = fused_barriers or (None, None, None)
    wg = lax.axis_index("wg")
    cta = lax.axis_index("cta")
    my_tiles = g.dkdv_rounds.tiles_of(cta)
    bq, slots, dtype = g.bq, g.dkdv_slots, q_ref.dtype
    # The self-fed kernel's handshakes between its two warpgroups go through hardware barriers on
    # the GPU (mbarriers in the interpreter): 0-5% faster on an H100, 1-4% on an H200. With GQA's
    # memory warpgroup beside them they measured 5-8% slower, so the other kernels keep mbarriers
    # (benchmarks/NOTES.md, eighteenth round).
    hardware = g.self_fed and g.registers_a
    both = g.key_wgs * WARPGROUP_THREADS  # the compute warpgroups

    def signal_ds_stored(buf: Any) -> None:
        if hardware:
            hardware_barrier("arrive", _DS_STORED + 2 * buf + (1 - wg), both)
        else:
            plgpu.barrier_arrive(ds_stored.at[buf])

    def wait_ds_stored(buf: Any) -> None:
        if hardware:
            hardware_barrier("sync", _DS_STORED + 2 * buf + wg, both)
        else:
            plgpu.barrier_wait(ds_stored.at[buf])

    def release(slot: Any) -> None:
        if not hardware:
            plgpu.barrier_arrive(consumed.at[slot])
        else:  # only warpgroup 0 waits, and it refills the slot after its own reads
            pl.when(wg == 1)(lambda: hardware_barrier("arrive", _RELEASED, both))

    def wait_released(slot: Any) -> None:
        """(Warpgroup 0 of a self-fed kernel) until both warpgroups have released ``slot``."""
        if hardware:
            hardware_barrier("sync", _RELEASED, both)
        else:
            plgpu.barrier_wait(consumed.at[slot])

    def tile(t: Any) -> tuple[Any, Any, Any, Any, Any]:
        """(batch, kv head, first key row, first query block, query blocks per head) of this
        CTA's ``t``-th tile; its ring items are per head x the group's heads."""
        b, kvh, tile_base = g.key_tile(cta, t)
        first = g.first_q_block(tile_base)
        return b, kvh, tile_base, first, g.q_blocks - first

    def copy_block(b: Any, h: Any, rows: Any, slot: Any) -> None:
        """A ring slot's four copies (Q, dO, lse and delta of head ``h``'s query ``rows``)."""
        for src, ring in (
            (q_ref.at[b, rows, h], q_ring),
            (do_ref.at[b, rows, h], do_ring),
            (lse_ref.at[b, h, rows], lse_ring),
            (delta_ref.at[b, h, rows], delta_ring),
        ):
            plgpu.copy_gmem_to_smem(src, ring.at[slot], block_ready.at[slot])

    @pl.when(wg < g.key_wgs)
    def _compute() -> None:
        if not g.self_fed:
            plgpu.set_max_registers(_compute_registers(g.key_wgs), action="increase")
        k_own, v_own = k_smem.at[wg], v_smem.at[wg]

        def run_tile(t: Any, start: Any) -> Any:
            b, kvh, tile_base, first, per_head = tile(t)
            key_base = tile_base + wg * WG_ROWS
            keys = (b, pl.ds(key_base, WG_ROWS), kvh)
            if g.self_fed:  # a self-fed tile streams the query blocks of its one head from first
                end = start + per_head

                def issue(pos: Any) -> None:
                    """Warpgroup 0 copies the block at stream position ``pos``, if it is this
                    tile's, into its ring slot. Python numbers only in here: constants closed over
                    by a ``pl.when`` branch fail Mosaic GPU's lowering."""

                    @pl.when((wg == 0) & (pos < end))
                    def _() -> None:
                        rows = pl.ds((first + (pos - start)) * bq, bq)
                        copy_block(b, kvh, rows, lax.rem(pos, slots))

                # The first slots but one now; each block's start issues the next.
                for n in range(slots - 1):
                    issue(start + n)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's dK and dV have left
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_own, k_ready.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_own, v_ready.at[wg])
            own_first = g.first_q_block(key_base)
            own_full = g.first_full_q_block(key_base, own_first)
            if g.fused:  # every warpgroup's dQ product reads all the tile's keys
                # Blocks this warpgroup's keys do not see are masked steps here (P = 0): each block's
                # dQ needs both warpgroups' dS.
                own_first = first
                plgpu.barrier_wait(k_ready.at[1 - wg])
            plgpu.barrier_wait(k_ready.at[wg])
            plgpu.barrier_wait(v_ready.at[wg])
            shape = (WG_ROWS, bq)
            part_shape = (WG_ROWS, bq // g.parts)

            def scaled(s_t: Any, qb: Any, masked: bool, part: int = 0) -> Any:
                s_t = s_t * (g.scale * LOG2E)
                if masked:
                    key = _indices(key_base, s_t.shape, 0)
                    row = _indices(qb * bq + part * part_shape[1] + g.offset, s_t.shape, 1)
                    s_t = jnp.where(key <= row, s_t, -jnp.inf)
                return s_t

            def part_of(block: Any, part: int) -> Any:
                """Query rows ``part`` of a ring slot's block (the whole block in one part)."""
                if g.parts == 1:
                    return block
                return block.at[pl.ds(part * part_shape[1], part_shape[1])]

            def tile_of(w: Any, part: Any) -> Any:
                """Warpgroup ``w``'s P^T or dS^T tile of ``part`` in the stages."""
                return w if g.parts == 1 else w * g.parts + part

            def row_vector(ring: Any, slot: Any, part: int = 0) -> Any:
                return plgpu.load(part_of(ring.at[slot], part), layout=plgpu.Layout.WGMMA.reduce(0))

            def split_block(
                refs: Any, q_blk: Any, do_blk: Any, slot: Any, qb: Any, masked: bool
            ) -> None:
                dv_ref, dk_ref, s_ref, dp_ref = refs
                plgpu.wgmma(s_ref, k_own, q_blk.transpose((1, 0)))
                plgpu.wgmma(dp_ref, v_own, do_blk.transpose((1, 0)))
                lse = row_vector(lse_ring, slot)
                s_t = scaled(plgpu.wgmma_accumulator_load(s_ref, wait_n=1), qb, masked)
                p_t = jnp.exp2(s_t - _spread(lse, shape, 1))  # queries along columns
                p_stage_own = None if g.registers_a else p_stage.at[wg]

                def dv_product() -> None:
                    plgpu.wgmma(dv_ref, _operand(g, p_t.astype(dtype), p_stage_own), do_blk)

                if g.early_dv:
                    dv_product()
                delta = row_vector(delta_ring, slot)
                dp_t = plgpu.wgmma_accumulator_load(dp_ref, wait_n=int(g.early_dv))
                ds_t = (p_t * (dp_t - _spread(delta, shape, 1))).astype(dtype)
                if not g.early_dv:
                    dv_product()
                ds_stage_own = None if g.registers_a else ds_stage.at[wg]
                plgpu.wgmma(dk_ref, _operand(g, ds_t, ds_stage_own), q_blk)

            def fused_block(
                refs: Any, q_blk: Any, do_blk: Any, slot: Any, qb: Any, masked: bool, buf: Any
            ) -> None:
                # Each part's S^T and dP^T issued together, parts in order, so a part's elementwise
                # work runs beside the next part's products. Its dS^T goes to shared memory (dK's
                # operand there, where it is anyway: fewer registers in flight; P^T from there too
                # measured slower and spilled more), then both warpgroups meet for dQ.
                dv_ref, dk_ref, *accs = refs
                s_refs, dp_refs = accs[: g.parts], accs[g.parts : 2 * g.parts]
                for part in range(g.parts):
                    plgpu.wgmma(s_refs[part], k_own, part_of(q_blk, part).transpose((1, 0)))
                    plgpu.wgmma(dp_refs[part], v_own, part_of(do_blk, part).transpose((1, 0)))
                p_t = []
                for part in range(g.parts):
                    later = 2 * (g.parts - 1 - part)  # the later parts' products, still in flight
                    lse = row_vector(lse_ring, slot, part)
                    s_t = plgpu.wgmma_accumulator_load(s_refs[part], wait_n=later + 1)
                    p = jnp.exp2(scaled(s_t, qb, masked, part) - _spread(lse, part_shape, 1))
                    delta = row_vector(delta_ring, slot, part)
                    dp_t = plgpu.wgmma_accumulator_load(dp_refs[part], wait_n=later)
                    ds_t = p * (dp_t - _spread(delta, part_shape, 1))
                    ds_stage.at[buf, tile_of(wg, part)][...] = ds_t.astype(dtype)
                    # The last part's P^T is cast where its product is issued; earlier ones now,
                    # which frees their float32 registers for the next part.
                    p_t.append(p if part == g.parts - 1 else p.astype(dtype))
                plgpu.commit_smem()
                signal_ds_stored(buf)
                for part in range(g.parts):
                    staging = None if g.registers_a else p_stage.at[tile_of(wg, part)]
                    p16 = p_t[part].astype(dtype)
                    plgpu.wgmma(dv_ref, _operand(g, p16, staging), part_of(do_blk, part))
                for part in range(g.parts):
                    plgpu.wgmma(dk_ref, ds_stage.at[buf, tile_of(wg, part)], part_of(q_blk, part))
                if g.registers_a:  # part 0's S^T registers take dQ: S^T is spent
                    s_refs[0][...] = _acc(*g.dq_part)
                    dq_ref = s_refs[0]
                else:  # the interpreter stores no accumulators: its own zeroed one
                    dq_ref = accs[-1]
                wait_ds_stored(buf)  # the other warpgroup's dS^T is stored
                for w in range(g.key_wgs):
                    if g.dq_by_rows:  # this warpgroup's query rows, every column
                        ds, k_cols = ds_stage.at[buf, tile_of(w, wg)], k_smem.at[w]
                    else:  # every query row, this warpgroup's columns
                        ds = ds_stage.at[buf, w]
                        k_cols = k_smem.at[w].at[:, pl.ds(wg * g.dq_part[1], g.dq_part[1])]
                    plgpu.wgmma(dq_ref, ds.transpose((1, 0)), k_cols)

            def step(qb: Any, carry: Any, base: Any, h: Any, masked: bool) -> Any:
                # FlashAttention 3's order within a block: S^T = K Q^T and dP^T = V dO^T issued
                # together, P^T formed while dP^T is still on the tensor cores, dV += P^T dO issued
                # before dS^T is formed where registers allow (_Geom.early_dv), dK += dS^T Q after
                # it. The fused kernel then adds this warpgroup's part of the block's dQ = dS K
                # (over both warpgroups' keys: dS^T goes through shared memory) and sends it out by
                # TMA reduce-add.
                dk, dv = carry
                t = base + qb
                slot, buf = lax.rem(t, jnp.int32(slots)), lax.rem(t, jnp.int32(2))
                q_blk, do_blk = q_ring.at[slot], do_ring.at[slot]
                if g.self_fed:
                    # Once both warpgroups have released the previous block (the kernel's start
                    # counts as one), its slot takes the block slots - 1 ahead: a block's lead, as
                    # a memory warpgroup would give it. No test of the block's place in the tile:
                    # without it ptxas spilled 8 bytes instead of 12 (twenty-first round).
                    pl.when(wg == 0)(lambda: wait_released(lax.rem(t + (slots - 1), slots)))
                    issue(t + (slots - 1))
                plgpu.barrier_wait(block_ready.at[slot])
                if not g.fused:
                    block = functools.partial(
                        split_block, q_blk=q_blk, do_blk=do_blk, slot=slot, qb=qb, masked=masked
                    )
                    dv, dk, *_ = _pipelined(g, block, (dv, dk), (shape, shape))
                    release(slot)
                    return dk, dv
                block = functools.partial(
                    fused_block, q_blk=q_blk, do_blk=do_blk, slot=slot, qb=qb, masked=masked,
                    buf=buf,
                )  # fmt: skip
                spare = () if g.registers_a else (g.dq_part,)
                fresh = (part_shape,) * (2 * g.parts) + spare
                dv, dk, *accs = _pipelined(g, block, (dv, dk), fresh)
                release(slot)
                dq = accs[0] if g.registers_a else accs[-1]
                dq_own = dq_stage.at[wg]
                if g.dq_by_rows:
                    dst = dq_acc.at[b, pl.ds(qb * bq + wg * WG_ROWS, WG_ROWS), h]
                else:
                    dst = dq_acc.at[
                        b, pl.ds(qb * bq, bq), h, pl.ds(wg * g.dq_part[1], g.dq_part[1])
                    ]
                if g.tma_reduce:
                    # The last reduce has read dq_own.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    dq_own[...] = dq
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(dq_own, dst, reduction_op="add")
                else:
                    # Mosaic GPU's interpreter has no TMA reduce: read, add and write back (CTAs run
                    # one after another there, and the warpgroups' parts are disjoint).
                    plgpu.copy_gmem_to_smem(dst, dq_own, dq_read.at[wg])
                    plgpu.barrier_wait(dq_read.at[wg])
                    dq_own[...] = dq_own[...] + dq
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(dq_own, dst)
                    plgpu.wait_smem_to_gmem(0)
                return dk, dv

            def acknowledge(qb: Any, carry: Any, base: Any) -> Any:
                # A block only the neighbour needs: wait for its copies (keeping barrier phases in step)
                # and release the slot.
                slot = lax.rem(base + qb, jnp.int32(slots))
                plgpu.barrier_wait(block_ready.at[slot])
                plgpu.barrier_arrive(consumed.at[slot])
                return carry

            def head(i: Any, carry: Any) -> Any:
                base = start + i * per_head - first  # stream position of this head's block 0
                h = kvh * g.group + i
                lax.fori_loop(first, own_first, functools.partial(acknowledge, base=base), None)
                masked = functools.partial(step, base=base, h=h, masked=True)
                carry = lax.fori_loop(own_first, own_full, masked, carry)
                unmasked = functools.partial(step, base=base, h=h, masked=False)
                return lax.fori_loop(own_full, g.q_blocks, unmasked, carry)

            zero = _acc(WG_ROWS, g.dpad)
            dk, dv = lax.fori_loop(0, g.group, head, (zero, zero))
            if g.fused:  # K is overwritten below: the neighbour's last dQ product must have read it
                if hardware:
                    hardware_barrier("sync", _K_READ, both)
                else:
                    plgpu.barrier_arrive(k_read)
                    plgpu.barrier_wait(k_read)
            k_own[...] = (dk * g.scale).astype(dtype)
            v_own[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_own, dk_ref.at[keys])
            plgpu.copy_smem_to_gmem(v_own, dv_ref.at[keys])
            return start + per_head * g.group

        if g.self_fed:  # stands for the release of the block before the first
            release(jnp.int32(slots - 1))
        streamed = lax.fori_loop(0, my_tiles, run_tile, jnp.int32(0))
        if g.self_fed:  # the last block's release: no barrier phase left unobserved
            pl.when(wg == 0)(lambda: wait_released(lax.rem(streamed + (slots - 1), slots)))
        plgpu.wait_smem_to_gmem(0)

    def _memory() -> None:
        plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

        def items(t: Any) -> tuple[Any, Any]:
            coords = tile(t)
            return coords[4] * g.group, coords

        def fetch(coords: Any, i: Any, slot: Any) -> tuple[Any]:
            b, kvh, _, first, per_head = coords
            blocks = jnp.maximum(per_head, 1)
            h = kvh * g.group + lax.div(i, blocks)
            rows = pl.ds((first + lax.rem(i, blocks)) * bq, bq)
            return (functools.partial(copy_block, b, h, rows, slot),)

        feed_ring(slots, my_tiles, items, fetch, (consumed,), ONE_MEMORY_WARP)

    if not g.self_fed:
        pl.when(wg == g.key_wgs)(_memory)


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, smem, ready, consumed, *, g
) -> None:
    q_smem, do_smem, lse_smem, delta_smem, k_ring, v_ring, *staging = smem
    # dO, lse and delta of a tile arrive on one barrier, and a ring slot's K and V on one.
    q_ready, rows_ready, block_ready = ready
    wg = lax.axis_index("wg")
    cta = lax.axis_index("cta")
    my_tiles = g.dq_rounds.tiles_of(cta)
    bk, slots, dtype = g.bk, g.dq_slots, q_ref.dtype

    def tile(t: Any) -> tuple[Any, Any, Any, Any]:
        """(batch, head, first query row, key blocks streamed) of this CTA's ``t``-th tile."""
        b, h, tile_base = g.query_tile(cta, t)
        return b, h, tile_base, g.kv_steps(tile_base + Q_TILE_WGS * WG_ROWS - 1)

    @pl.when(wg < Q_TILE_WGS)
    def _compute() -> None:
        plgpu.set_max_registers(_compute_registers(Q_TILE_WGS), action="increase")
        q_own, do_own = q_smem.at[wg], do_smem.at[wg]

        def load(t: Any, with_q: bool) -> None:
            """Q (``with_q``) or else dO, lse and delta of this warpgroup's rows of tile ``t``."""
            b, h, tile_base, _ = tile(t)
            rows = pl.ds(tile_base + wg * WG_ROWS, WG_ROWS)
            if with_q:
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_own, q_ready.at[wg])
                return
            plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_own, rows_ready.at[wg])
            plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[wg], rows_ready.at[wg])
            plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[wg], rows_ready.at[wg])

        load(jnp.int32(0), with_q=True)
        load(jnp.int32(0), with_q=False)

        def run_tile(t: Any, start: Any) -> Any:
            b, h, tile_base, cta_steps = tile(t)
            row_base = tile_base + wg * WG_ROWS
            rows = pl.ds(row_base, WG_ROWS)
            steps = g.kv_steps(row_base + WG_ROWS - 1)
            full = g.full_kv_steps(row_base, steps)
            plgpu.barrier_wait(q_ready.at[wg])
            plgpu.barrier_wait(rows_ready.at[wg])
            shape = (WG_ROWS, bk)
            # Row vectors, broadcast where used: whole tiles would hold registers across the loop.
            lse = plgpu.load(lse_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
            delta = plgpu.load(delta_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))

            def step(kv: Any, dq: Any, masked: bool) -> Any:
                slot = lax.rem(start + kv, jnp.int32(slots))
                k_blk, v_blk = k_ring.at[slot], v_ring.at[slot]
                plgpu.barrier_wait(block_ready.at[slot])

                def block(refs: Any) -> None:
                    # As the dK/dV kernel's: P formed while dP is still on the tensor cores.
                    dq_ref, s_ref, dp_ref = refs
                    plgpu.wgmma(s_ref, q_own, k_blk.transpose((1, 0)))
                    plgpu.wgmma(dp_ref, do_own, v_blk.transpose((1, 0)))
                    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1) * (g.scale * LOG2E)
                    if masked:
                        key = _indices(kv * bk, shape, 1)
                        ok = key < g.seq_k
                        if g.causal:
                            ok = ok & (key <= _indices(row_base + g.offset, shape, 0))
                        s = jnp.where(ok, s, -jnp.inf)
                    p = jnp.exp2(s - _spread(lse, shape, 0))  # queries along rows
                    dp = plgpu.wgmma_accumulator_load(dp_ref, wait_n=0)
                    ds = (p * (dp - _spread(delta, shape, 0))).astype(dtype)
                    staging_own = None if g.registers_a else staging[0].at[wg]
                    plgpu.wgmma(dq_ref, _operand(g, ds, staging_own), k_blk)

                dq, _, _ = _pipelined(g, block, (dq,), (shape, shape))
                plgpu.barrier_arrive(consumed.at[slot])
                return dq

            def acknowledge(kv: Any, carry: Any) -> Any:
                slot = lax.rem(start + kv, jnp.int32(slots))
                plgpu.barrier_wait(block_ready.at[slot])
                plgpu.barrier_arrive(consumed.at[slot])
                return carry

            dq = lax.fori_loop(
                0, full, functools.partial(step, masked=False), _acc(WG_ROWS, g.dpad)
            )
            dq = lax.fori_loop(full, steps, functools.partial(step, masked=True), dq)
            lax.fori_loop(steps, cta_steps, acknowledge, None)
            # dO, lse and delta are read: fetch the next tile's meanwhile. Q stages dQ on its way out.
            pl.when(t + 1 < my_tiles)(functools.partial(load, t + 1, with_q=False))
            q_own[...] = (dq * g.scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_own, dq_ref.at[b, rows, h])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            pl.when(t + 1 < my_tiles)(functools.partial(load, t + 1, with_q=True))
            return start + cta_steps

        lax.fori_loop(0, my_tiles, run_tile, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == Q_TILE_WGS)
    def _memory() -> None:
        plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

        def fetch(coords: Any, kv: Any, slot: Any) -> tuple[Any]:
            b, h, _, _ = coords
            keys = (b, pl.ds(kv * bk, bk), lax.div(h, jnp.int32(g.group)))

            def copy() -> None:
                plgpu.copy_gmem_to_smem(k_ref.at[keys], k_ring.at[slot], block_ready.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[keys], v_ring.at[slot], block_ready.at[slot])

            return (copy,)

        def items(t: Any) -> tuple[Any, Any]:
            coords = tile(t)
            return coords[3], coords

        feed_ring(slots, my_tiles, items, fetch, (consumed,), ONE_MEMORY_WARP)


LONG_CAUSAL = 16384  # from here on causal dK/dV tiles go along the sequence too


def _along_sequence(causal: bool, seq_q: int, seq_k: int) -> tuple[bool, bool]:
    """The kernels' default tile orders, (dK/dV, dQ) (:func:`._mosaic_grid.split_index`): along the
    sequence, except the dK/dV kernel's causal below ``LONG_CAUSAL`` keys, whose tiles go heads
    fastest in bands (:func:`_dkdv_band`).

    Heads fastest over every head evens out causal tiles' unequal work, but the CTAs at work
    together then stream as many heads' rows as there are CTAs, more than L2 holds. At
    4x4096x16x128 causal the two kernels read 2.7 GB from HBM (cuDNN's backward 1.1 GB), and under
    the power cap the clock of the forward+backward fell to 1628 MHz, against 1755 along the
    sequence at the same 690 W (results/mosaic_variants_NVIDIA_H200_20261123-092040.json). Causal
    forward+backward along the sequence against that (results/bwd_orders_NVIDIA_H200_20261123-
    092530.json, -093257.json, bwd_orders_NVIDIA_H100_80GB_HBM3_20261123-092946.json): without GQA
    1.02-1.06x on an H200 and 0.99-1.06x on an H100 (4x2048-2x8192 at head dim 128, 8x2048-2x8192
    at 64); with GQA, whose dK/dV CTA takes its kv head's whole group, 0.96-0.99x; the dQ kernel
    1.00-1.01x (0.98-1.04x on the H100). Not causal, along the sequence ran 1.00-1.16x
    (results/mosaic_variants_NVIDIA_H200_20261121-174012.json); causal from 16k keys 1.05-1.06x.
    Bands beat both below 16k keys (:func:`_dkdv_band`)."""
    dkdv = not causal or max(seq_q, seq_k) >= LONG_CAUSAL
    return dkdv, True


def feeds_itself(fused: bool, group: int) -> bool:
    """Whether the kernel's compute warpgroups fill its ring themselves: the fused kernel without
    GQA (query heads a kv head, ``group``, of 1; :attr:`_Geom.self_fed` says why)."""
    return fused and group == 1


def backward_persistent(causal: bool, head_dim: int, fused: bool, group: int) -> tuple[bool, bool]:
    """Which kernels, (dK/dV, dQ), run on the persistent grid by default, for the split
    (``fused=False``) or the fused backward, ``group`` query heads a kv head.

    The dQ kernel (H200, results/mosaic_variants_NVIDIA_H200_20261121-140226.json): 1.03-1.05x at
    head dim 64 and not causal at 128, 0.95-0.97x causal at 128. The split's dK/dV kernel,
    forward+backward against one CTA a tile (benchmarks/NOTES.md, thirty-fifth round): at head dim
    64 23 of 27 readings on an H100 and an H200 1.00-1.04x, 4 0.983-0.998x; at 128 0.83-0.98x.
    The fused kernel feeding itself (:attr:`_Geom.self_fed`) keeps one CTA a tile at every head
    dim: on the persistent grid at head dim 64 it ran forward+backward 0.94-0.99x that on an H200
    (8x2048x32x64, 4x4096x32x64, 2x8192x32x64 and 16x1024x16x64, both masks; 1.00x at the last
    causal), at 128 0.90-0.91x. With GQA (a memory warpgroup) at head dim 64 one CTA a tile ran
    0.981x and 0.994x the persistent grid at 8x2048x32(8 kv)x64 (results/mosaic_variants_NVIDIA_
    H200_20261128-075751.json, -080322.json)."""
    return head_dim <= 64 and not feeds_itself(fused, group), not (causal and head_dim > 64)


DKDV_BAND = 8  # (batch, kv head) pairs a band of the dK/dV kernel's tiles, where heads go fastest


def _dkdv_band(pairs: int) -> int:
    """Where the dK/dV kernel's tiles go heads fastest by default (causal below ``LONG_CAUSAL``
    keys), they go in bands of the largest divisor of its ``pairs`` up to ``DKDV_BAND``: heads
    fastest within a band, so its heaviest tiles start first and the band's lightest end it, but
    the CTAs at work stream only a band's rows.

    Causal forward+backward (benchmarks/NOTES.md, thirty-second round), bands of 8 pairs:
    - with GQA, against heads fastest over all pairs (2x8192, 4x4096 and 2x4096 x32(8 kv)x128,
      8x2048x32(8 kv)x64): 1.005-1.028x at all 8 readings of two runs on an H200, 1.019-1.034x at
      all 4 on an H100; bands of 4 0.974-1.049x (results/mosaic_variants_NVIDIA_H200_20261127-
      144702.json, -144954.json, mosaic_variants_NVIDIA_H100_80GB_HBM3_20261127-145515.json);
    - without GQA, against along the sequence (4x4096 and 2x8192 x16x128, split and fused
      backward; 8x2048x32x64 split): 1.007-1.028x at all 5 on an H200 (-150021.json)."""
    return band_sizes(pairs, DKDV_BAND)[-1]


def _geom(
    q: Any,
    k: Any,
    spec: AttentionSpec,
    params: BwdParams,
    interpret: bool,
    persistent: tuple[bool, bool] | None,
    along_sequence: bool | tuple[bool, bool] | None = None,
    balanced: bool = True,
    dkdv_band: int | None = None,
) -> _Geom:
    batch, seq_q, heads, head_dim = q.shape
    _, seq_k, kv_heads, _ = k.shape
    dpad = _cdiv(head_dim, 64) * 64
    if dpad > MAX_HEAD_DIM:
        raise NotImplementedError(
            f"the Mosaic GPU attention backward supports head dims up to {MAX_HEAD_DIM} (its "
            f"float32 dK and dV accumulators live in registers); got head_dim={head_dim}"
        )
    for name in ("q_blocksize", "kv_blocksize"):
        if getattr(params, name) not in BLOCKS:
            raise ValueError(f"{name}={getattr(params, name)} must be one of {BLOCKS}")
    # Short sequences take smaller blocks rather than padding to a whole large one.
    bq = min(params.q_blocksize, _cdiv(seq_q, 64) * 64)
    key_rows = min(params.kv_blocksize, _cdiv(seq_k, 64) * 64)
    fused = params.variant == FUSED_VARIANT
    if fused and not _fused_shape_ok(dpad, bq, key_rows):
        raise NotImplementedError(
            f"the fused Mosaic GPU attention backward takes kv_blocksize={2 * WG_ROWS} and, by "
            f"head dim padded to 64 or 128, q_blocksize {FUSED_Q_ROWS} (after short sequences "
            f"shrink them); got {head_dim=}, q_blocksize={bq}, kv_blocksize={key_rows}"
        )
    smem_bytes = _fused_smem_bytes if fused else _dkdv_smem_bytes
    dkdv_slots = _ring(
        params.num_stages, lambda s: smem_bytes(dpad, key_rows, bq, s) <= _SMEM_LIMIT
    )
    dq_slots = _ring(params.num_stages, lambda s: _dq_smem_bytes(dpad, key_rows, s) <= _SMEM_LIMIT)
    if not (dkdv_slots and (fused or dq_slots)):
        raise NotImplementedError(
            f"the Mosaic GPU attention backward does not fit shared memory with {head_dim=}, "
            f"q_blocksize={bq}, kv_blocksize={key_rows}"
        )
    if along_sequence is None:
        order = _along_sequence(spec.causal, seq_q, seq_k)
        if dkdv_band is None and not order[0]:
            dkdv_band = _dkdv_band(kv_heads * batch)
    elif isinstance(along_sequence, bool):
        order = (along_sequence, along_sequence)
    else:
        order = along_sequence
    return _Geom(
        causal=spec.causal,
        scale=spec.scale,
        seq_q=seq_q,
        seq_k=seq_k,
        group=heads // kv_heads,
        dpad=dpad,
        bq=bq,
        bk=key_rows,
        key_wgs=key_rows // WG_ROWS,
        dkdv_slots=dkdv_slots,
        dq_slots=dq_slots,
        heads=heads,
        kv_heads=kv_heads,
        batch=batch,
        resident=resident_ctas(interpret),
        persistent=(
            backward_persistent(spec.causal, dpad, fused, heads // kv_heads)
            if persistent is None
            else persistent
        ),
        along_sequence=order,
        registers_a=not interpret,
        fused=fused,
        tma_reduce=not interpret,
        balanced=balanced,
        dkdv_band=dkdv_band or 0,
    )


def bwd(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    dout: Any,
    *,
    spec: AttentionSpec,
    params: BwdParams,
    interpret: bool,
    persistent: tuple[bool, bool] | None = None,
    along_sequence: bool | tuple[bool, bool] | None = None,
    balanced: bool = True,
    dkdv_band: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` of the forward in :mod:`._pallas_mosaic`, whose ``lse`` [B, H, Sq] it takes.

    ``params.variant`` picks the kernels: ``"mosaic"``, a dK/dV kernel and a dQ kernel;
    ``"mosaic_fused"``, the dK/dV kernel alone, which also adds each block's dQ into a float32
    accumulator by TMA reduce-add (5 matrix products per block pair instead of 7; the order of the
    float32 sums, hence dQ's last bits, varies from run to run). ``params.kv_blocksize`` (64 or 128)
    is the key rows of a dK/dV CTA (one warpgroup per 64) and the key block the dQ kernel streams;
    ``params.q_blocksize`` (64 or 128) the query block the dK/dV kernel streams (fused: at most 64 at
    head dim 128, for registers); ``params.num_stages`` the ring depth, shrunk where shared memory is
    short. ``num_warps`` is not used: the warpgroups follow from the blocks. ``persistent`` (dK/dV,
    dQ) overrides which kernels run on the persistent grid, ``along_sequence`` their tile order
    (:func:`._mosaic_grid.split_index`), ``dkdv_band`` puts the dK/dV tiles in bands of that many
    (batch, kv head) pairs (by default :func:`_dkdv_band` where they go heads fastest),
    ``balanced=False`` runs a persistent dQ grid, or causal dK/dV grid, on every resident CTA (for
    comparison). The caller checks dtypes and features (as for the forward).
    """
    batch, seq_q, heads, head_dim = q.shape
    _, seq_k, kv_heads, _ = k.shape
    g = _geom(q, k, spec, params, interpret, persistent, along_sequence, balanced, dkdv_band)
    dtype = q.dtype
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), dout.astype(jnp.float32))
    # Rows that saw no key have lse = -inf; +inf, like padded rows, makes their P exactly 0.
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2E).astype(jnp.float32)
    lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, g.sqp - seq_q)), constant_values=jnp.inf)
    delta = jnp.pad(delta, ((0, 0), (0, 0), (0, g.sqp - seq_q)))

    def pad(x: Any, seq: int) -> Any:
        x = x.astype(dtype)
        return jnp.pad(x, ((0, 0), (0, seq - x.shape[1]), (0, 0), (0, g.dpad - x.shape[3])))

    qp, dop = pad(q, g.sqp), pad(dout, g.sqp)
    kp, vp = pad(k, g.skp), pad(v, g.skp)
    operands = (qp, kp, vp, dop, lse2, delta)
    compiler_params = plgpu.CompilerParams(approx_math=True)
    interpret_params = plgpu.InterpretGPUParams() if interpret else None

    kv_smem = [
        plgpu.SMEM((g.key_wgs, WG_ROWS, g.dpad), dtype, transforms=_TILED),
        plgpu.SMEM((g.key_wgs, WG_ROWS, g.dpad), dtype, transforms=_TILED),
        plgpu.SMEM((g.dkdv_slots, g.bq, g.dpad), dtype, transforms=_TILED),
        plgpu.SMEM((g.dkdv_slots, g.bq, g.dpad), dtype, transforms=_TILED),
        plgpu.SMEM((g.dkdv_slots, g.bq), jnp.float32),
        plgpu.SMEM((g.dkdv_slots, g.bq), jnp.float32),
    ]
    # P^T or dS^T by (warpgroup, part): tile w * parts + part
    parts = (g.key_wgs * g.parts, WG_ROWS, g.bq // g.parts)
    stage = plgpu.SMEM(parts, dtype, transforms=_TILED)
    if not g.registers_a:  # staging for P^T
        kv_smem.append(stage)
    if g.fused:  # the tile's dS^T, double-buffered: the dQ products' operand
        kv_smem.append(plgpu.SMEM((2, *parts), dtype, transforms=_TILED))
        # each warpgroup's part of a dQ block on its way out
        kv_smem.append(plgpu.SMEM((g.key_wgs, *g.dq_part), jnp.float32, transforms=_TILED_F32))
    elif not g.registers_a:  # staging for dS^T
        kv_smem.append(stage)
    kv_ready = [
        *[plgpu.Barrier(num_barriers=g.key_wgs)] * 2,
        plgpu.Barrier(num_arrivals=4, num_barriers=g.dkdv_slots),  # Q, dO, lse and delta
    ]
    dkdv_operands: tuple[Any, ...] = operands
    if g.fused:
        # ds_stored, dq_read and k_read (see the kernel)
        kv_ready.append(plgpu.Barrier(num_arrivals=g.key_wgs, num_barriers=2))
        kv_ready.append(plgpu.Barrier(num_barriers=g.key_wgs))
        kv_ready.append(plgpu.Barrier(num_arrivals=g.key_wgs))
        # Zeros from XLA, passed as a mutable ref: the kernel adds into it in place (an aliased
        # output).
        dq_acc = jax.new_ref(jnp.zeros((batch, g.sqp, heads, g.dpad), jnp.float32))
        dkdv_operands = (*operands, dq_acc)
    dk, dv = plgpu.kernel(
        functools.partial(_dkdv_kernel, g=g),
        out_type=(
            jax.ShapeDtypeStruct(kp.shape, dtype),
            jax.ShapeDtypeStruct(vp.shape, dtype),
        ),
        scratch_types=(
            tuple(kv_smem),
            tuple(kv_ready),
            plgpu.Barrier(num_arrivals=g.key_wgs, num_barriers=g.dkdv_slots),
        ),
        grid=(g.dkdv_rounds.ctas,),
        grid_names=("cta",),
        num_threads=g.key_wgs + (0 if g.self_fed else 1),
        thread_name="wg",
        compiler_params=compiler_params,
        interpret=interpret_params,
    )(*dkdv_operands)
    dk = dk[:, :seq_k, :, :head_dim].astype(k.dtype)
    dv = dv[:, :seq_k, :, :head_dim].astype(v.dtype)
    if g.fused:
        acc = jax.freeze(dq_acc)
        return (acc[:, :seq_q, :, :head_dim] * g.scale).astype(dtype), dk, dv

    q_smem = [
        plgpu.SMEM((Q_TILE_WGS, WG_ROWS, g.dpad), dtype, transforms=_TILED),
        plgpu.SMEM((Q_TILE_WGS, WG_ROWS, g.dpad), dtype, transforms=_TILED),
        plgpu.SMEM((Q_TILE_WGS, WG_ROWS), jnp.float32),
        plgpu.SMEM((Q_TILE_WGS, WG_ROWS), jnp.float32),
        plgpu.SMEM((g.dq_slots, g.bk, g.dpad), dtype, transforms=_TILED),
        plgpu.SMEM((g.dq_slots, g.bk, g.dpad), dtype, transforms=_TILED),
    ]
    if not g.registers_a:  # staging for dS
        q_smem.append(plgpu.SMEM((Q_TILE_WGS, WG_ROWS, g.bk), dtype, transforms=_TILED))
    q_ready = (
        plgpu.Barrier(num_barriers=Q_TILE_WGS),
        plgpu.Barrier(num_arrivals=3, num_barriers=Q_TILE_WGS),  # dO, lse and delta
        plgpu.Barrier(num_arrivals=2, num_barriers=g.dq_slots),  # K and V
    )
    dq = plgpu.kernel(
        functools.partial(_dq_kernel, g=g),
        out_type=jax.ShapeDtypeStruct(qp.shape, dtype),
        scratch_types=(
            tuple(q_smem),
            q_ready,
            plgpu.Barrier(num_arrivals=Q_TILE_WGS, num_barriers=g.dq_slots),
        ),
        grid=(g.dq_rounds.ctas,),
        grid_names=("cta",),
        num_threads=Q_TILE_WGS + 1,
        thread_name="wg",
        compiler_params=compiler_params,
        interpret=interpret_params,
    )(*operands)
    return dq[:, :seq_q, :, :head_dim], dk, dv
