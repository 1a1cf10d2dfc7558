"""The persistent grid the Mosaic GPU attention kernels share.

One CTA per multiprocessor walks the kernel's tiles in rounds of ``ctas`` tiles, taking one tile of
each round and alternating direction between rounds, so a CTA that took one of a round's heavier
(causal) tiles takes one of the next round's lighter. Against one CTA per tile (the hardware's own
scheduling) the forward measured 1.04-1.14x on an H200: a CTA's next tile starts without a launch,
and its memory warpgroup streams that tile's first blocks while the current one finishes
(``feed_ring``, the memory warpgroup's loop every kernel here shares).

The pairing of heavy with light tiles holds only where the work falls steadily along the
numbering; a causal head whose tile count is not a multiple of the rounds breaks it (1x32768
causal put 1.5x the mean work on the busiest of 132 CTAs). ``Rounds.balanced`` therefore takes the
CTA count, from all resident down to 7/8 of them, that loads the busiest CTA least. Where every
tile is the same work, ``SplitTail`` instead splits the last, partial round's tiles over all CTAs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm

from ._backend import banded_tile, on_host, tile_div, tile_rem

_HOPPER_SMS = 132  # multiprocessors of an H100 or H200 (SXM), where no GPU is there to ask
HOPPER_SMEM_BYTES = 232448  # shared memory one CTA may take on an H100 or H200 (227 KiB)
_INTERPRETER_CTAS = 3  # several tiles per CTA, so the CPU tests walk the rounds too
# Hardware barriers below this one are Mosaic GPU's: 0 the CTA's, 1-3 its warpgroups'.
FIRST_FREE_BARRIER = 4
WARPGROUP_THREADS = 128  # what a hardware barrier counts a warpgroup as


_SPARED_SMS = contextvars.ContextVar("spared_sms", default=0)


@contextlib.contextmanager
def sparing_sms(count: int) -> Iterator[None]:
    """Persistent grids planned (traced) in here leave ``count`` multiprocessors free (and kernels
    that would take one CTA a tile keep a persistent grid: ``_pallas_mosaic.forward_persistent``).

    A persistent kernel holds every multiprocessor until it ends, so a collective's kernel that
    XLA runs beside it (ring attention's transfers) waits for the end instead of overlapping it
    (:data:`._ring.TRANSFER_SMS` says what that measured)."""
    if count < 0:
        raise ValueError(f"count must be >= 0; got {count}")
    token = _SPARED_SMS.set(count)
    try:
        yield
    finally:
        _SPARED_SMS.reset(token)


def spared_sms() -> int:
    """Multiprocessors the grids being planned leave free (:func:`sparing_sms`)."""
    return _SPARED_SMS.get()


def resident_ctas(interpret: bool) -> int:
    """CTAs of a persistent grid: one per multiprocessor (a CTA's registers fill one), less those
    :func:`sparing_sms` leaves free (not in the interpreter, whose few CTAs stand for the rounds)."""
    if interpret:
        return _INTERPRETER_CTAS
    device = jax.devices()[0]
    sms = _HOPPER_SMS  # lowering ahead of time for a GPU not attached
    if device.platform == "gpu":
        sms = int(getattr(device, "core_count", 0) or _HOPPER_SMS)
    return max(1, sms - spared_sms())


@dataclasses.dataclass(frozen=True)
class Rounds:
    """``tiles`` work items over ``ctas`` CTAs (``ctas == tiles``: one tile per CTA)."""

    tiles: int
    ctas: int

    @classmethod
    def of(cls, tiles: int, resident: int, persistent: bool) -> Rounds:
        """Persistent: at most ``resident`` CTAs; else one CTA per tile."""
        return cls(tiles, min(tiles, resident) if persistent else tiles)

    @classmethod
    def balanced(cls, work: np.ndarray, resident: int, persistent: bool) -> Rounds:
        """As :meth:`of`, with the CTA count (``resident`` down to 7/8 of it) whose busiest CTA has
        the least of ``work`` (one entry a tile, in work-item order); the most CTAs among equals."""
        tiles = len(work)
        if not persistent or tiles <= resident:
            return cls.of(tiles, resident, persistent)
        counts = range(resident, resident - resident // 8 - 1, -1)
        return min((cls(tiles, c) for c in counts), key=lambda r: (r.busiest(work), -r.ctas))

    def owners(self) -> np.ndarray:
        """The CTA of each work item (the inverse of :meth:`index`)."""
        item = np.arange(self.tiles)
        t, pos = np.divmod(item, self.ctas)
        return np.where(t % 2 == 0, pos, (self.ctas - 1) - pos)

    def busiest(self, work: np.ndarray) -> float:
        """The most ``work`` (one entry a tile) any CTA gets."""
        return float(np.bincount(self.owners(), weights=work, minlength=self.ctas).max())

    def index(self, cta: Any, t: Any) -> Any:
        """Work item of ``cta``'s ``t``-th tile."""
        return t * self.ctas + jnp.where(lax.rem(t, 2) == 0, cta, (self.ctas - 1) - cta)

    def tiles_of(self, cta: Any) -> Any:
        """How many tiles ``cta`` runs (every CTA runs at least one)."""
        full_rounds = self.tiles // self.ctas
        last = self.index(cta, jnp.int32(full_rounds)) < self.tiles
        return full_rounds + last.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class SplitTail:
    """Tiles of equal work whose last round would leave CTAs idle: the whole rounds run as
    :class:`Rounds` of ``ctas``, and the remaining tiles' key blocks are dealt out to every CTA in
    runs of ``piece`` blocks (stream-K). A CTA's run covers the end of one tile, the start of the
    next or both, so it ends with at most two pieces, each a partial result the caller merges
    (:meth:`table` says which pieces make up each tile)."""

    tiles: int
    ctas: int
    blocks: int  # key blocks of each tile
    piece: int  # key blocks of a CTA's run of the tail

    @classmethod
    def plan(cls, tiles: int, ctas: int, blocks: int, min_piece: int) -> SplitTail | None:
        """The split of the tiles left after the whole rounds, or None where there is no partial
        round (or no whole one) to split."""
        rest = tiles % ctas
        if tiles <= ctas or rest == 0:
            return None
        piece = max(-(-rest * blocks // ctas), min_piece)
        return cls(tiles, ctas, blocks, piece) if piece < blocks else None  # else: no tile split

    @property
    def whole(self) -> int:
        """Tiles run whole (the first ones in work-item order)."""
        return self.tiles - self.tiles % self.ctas

    @property
    def whole_rounds(self) -> int:
        """Rounds of whole tiles (they come first, the pieces after them)."""
        return self.whole // self.ctas

    @property
    def rounds(self) -> Rounds:
        return Rounds(self.whole, self.ctas)

    def _run(self, cta: Any) -> tuple[Any, Any]:
        """``cta``'s run of the tail, as key blocks counted from the first tail tile's first."""
        xp = np if on_host(cta) else jnp
        units = (self.tiles - self.whole) * self.blocks
        start = xp.minimum(cta * self.piece, units)
        return start, xp.minimum(start + self.piece, units)

    def pieces_of(self, cta: Any) -> Any:
        """How many tail pieces ``cta`` runs: 0, 1 or 2."""
        start, stop = self._run(cta)
        xp = np if on_host(cta) else jnp
        first, last = tile_div(start, self.blocks), tile_div(stop - 1, self.blocks)
        return xp.where(stop > start, last - first + 1, 0)

    def piece_of(self, cta: Any, p: Any) -> tuple[Any, Any, Any]:
        """(work item, first key block, end key block) of ``cta``'s ``p``-th tail piece."""
        start, stop = self._run(cta)
        xp = np if on_host(cta) else jnp
        tile = tile_div(start, self.blocks) + p
        first = tile * self.blocks
        return (
            self.whole + tile,
            xp.maximum(start - first, 0),
            xp.minimum(stop - first, self.blocks),
        )

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, valid)``, each ``[tail tiles, most pieces a tile]``: the pieces of each tail
        tile, piece ``p`` of CTA ``c`` being slot ``2 c + p``; ``valid`` marks the padding false."""
        pieces: list[list[int]] = [[] for _ in range(self.tiles - self.whole)]
        for cta in range(self.ctas):
            for p in range(int(self.pieces_of(np.int64(cta)))):
                item, _, _ = self.piece_of(np.int64(cta), p)
                pieces[int(item) - self.whole].append(2 * cta + p)
        most = max(len(s) for s in pieces)
        slots = np.array([s + [0] * (most - len(s)) for s in pieces], np.int32)
        valid = np.array([[True] * len(s) + [False] * (most - len(s)) for s in pieces])
        return slots, valid


def query_tile(
    index: Any,
    heads: int,
    batch: int,
    q_tiles: int,
    rows: int,
    causal: bool,
    along_sequence: bool,
) -> tuple[Any, Any, Any]:
    """(batch, head, first query row) of work item ``index`` over tiles of ``rows`` query rows
    (numbered as :func:`split_index` says); causal: the last rows (which see the most keys) first,
    so the light tiles fill the tail."""
    b, h, rank = split_index(
        index, heads, batch, q_tiles, order_band(along_sequence, heads * batch)
    )
    return b, h, ((q_tiles - 1) - rank if causal else rank) * rows


def key_blocks(last_row: Any, seq_k: int, offset: int, block: int, bounded: bool) -> Any:
    """Key blocks (of ``block`` keys) that query rows up to ``last_row`` see; ``bounded`` rows see
    keys up to their own plus ``offset`` (causal: ``seq_k - seq_q``, bottom-right aligned; a
    window's right side adds to it). Inside a kernel, or on numpy arrays (the grid planned on the
    host)."""
    xp = np if on_host(last_row) else jnp
    last = xp.int32(seq_k - 1)
    if bounded:
        last = xp.minimum(last, last_row + offset)
    return tile_div(xp.maximum(last + 1, 0) + (block - 1), block)


def full_key_blocks(
    first_row: Any, steps: Any, seq_k: int, offset: int, block: int, bounded: bool
) -> Any:
    """Of the ``steps`` blocks a tile sees, the leading ones that every row from ``first_row`` on
    sees whole (no mask needed; ``offset`` and ``bounded`` as :func:`key_blocks` takes them)."""
    last = jnp.int32(seq_k - 1)
    if bounded:
        last = jnp.minimum(last, first_row + offset)
    return jnp.minimum(lax.div(jnp.maximum(last + 1, 0), block), steps)


def first_key_block(row: Any, offset: int, left: int, block: int, round_up: bool = False) -> Any:
    """The key block holding the first key that query ``row`` sees through a window reaching
    ``left`` keys before its position (``row + offset``); with ``round_up`` the first block past
    that key's, from which on ``row`` sees whole blocks. Inside a kernel, or on numpy arrays."""
    xp = np if on_host(row) else jnp
    first = xp.maximum(row + (offset - left), 0)
    return tile_div(first + (block - 1), block) if round_up else tile_div(first, block)


def query_tiles_work(
    steps: Any, heads: int, batch: int, q_tiles: int, rows: int, causal: bool, along_sequence: bool
) -> np.ndarray:
    """Each query tile's work, in work-item order (for :meth:`Rounds.balanced`): ``steps(last
    row)``, the key blocks its rows see (on numpy arrays), plus one for its epilogue."""
    index = np.arange(heads * q_tiles * batch, dtype=np.int32)
    _, _, base = query_tile(index, heads, batch, q_tiles, rows, causal, along_sequence)
    return np.broadcast_to(steps(base + rows - 1) + 1.0, index.shape)  # no mask: one for all


def split_index(index: Any, heads: int, batch: int, ranks: int, band: int) -> tuple[Any, Any, Any]:
    """(batch, head, rank) of a work item, ``rank`` being its tile along the sequence (of
    ``ranks``), the (batch, head) pairs taken in bands of ``band``, heads fastest within each.

    ``band=1`` (along the sequence): rank fastest, then head, then batch. The CTAs running at once
    then work on one or two heads and read the same keys and values, which L2 serves once; the
    order for tiles of equal work. ``band`` = every pair (heads fastest, then batch, then rank): a
    round's tiles sit at about the same rank, which evens out causal tiles' unequal work, but each
    head's keys and values are shared by only the few CTAs at its ranks. Bands in between take
    some of each (:func:`order_band` gives the two ends).
    """
    if band < 1 or (heads * batch) % band:
        raise ValueError(
            f"band={band} must be a positive divisor of the {heads * batch} (batch, head) pairs"
        )
    rank, pair = banded_tile(index, ranks, band)
    return tile_div(pair, heads), tile_rem(pair, heads), rank


def order_band(along_sequence: bool, pairs: int) -> int:
    """The :func:`split_index` band of one of the two plain orders over ``pairs`` (batch, head)
    pairs: along the sequence (1) or heads fastest (all of them)."""
    return 1 if along_sequence else pairs


def feed_ring(
    slots: int,
    tiles: Any,
    tile: Any,
    fetch: Any,
    releases: tuple[Any, ...],
    one_warp: bool = True,
) -> None:
    """The memory warpgroup's loop over its CTA's ``tiles``, one stream of ring items across them.

    ``tile(t)`` gives tile ``t``'s item count and coordinates; ``fetch(coords, i, slot)`` gives the
    copies of its ``i``-th item into ``slot``, one per barrier of ``releases`` (the consumers'
    arrivals on it free that part of the slot). Each copy into a used slot first waits for its part's
    release; at the end every last release is waited on too, so no barrier phase is left pending.

    With ``one_warp`` a single warp runs the loop and the warpgroup's other three wait at its end,
    issuing nothing: fewer warps polling barriers beside the compute warps on each scheduler, and
    no warpgroup barrier before each copy.
    """
    if one_warp:
        plgpu.warp_map(
            lambda warp: pl.when(warp == 0)(
                lambda: feed_ring(slots, tiles, tile, fetch, releases, one_warp=False)
            )
        )
        return

    def slot_of(n: Any) -> Any:
        return lax.rem(n, jnp.int32(slots))

    def stream(t: Any, start: Any) -> Any:
        count, coords = tile(t)

        def item(i: Any, carry: Any) -> Any:
            n = start + i
            slot = slot_of(n)
            for released, copy in zip(releases, fetch(coords, i, slot), strict=True):
                pl.when(n >= slots)(lambda released=released: plgpu.barrier_wait(released.at[slot]))
                copy()
            return carry

        lax.fori_loop(0, count, item, None)
        return start + count

    streamed = lax.fori_loop(0, tiles, stream, jnp.int32(0))

    def drain(n: Any, carry: Any) -> Any:
        for released in releases:
            plgpu.barrier_wait(released.at[slot_of(n)])
        return carry

    lax.fori_loop(jnp.maximum(streamed - slots, 0), streamed, drain, None)


def hardware_barrier(op: str, barrier: Any, threads: int) -> None:
    """``bar.<op>`` (``"arrive"`` or ``"sync"``) on the CTA's hardware barrier ``barrier`` (from
    :data:`FIRST_FREE_BARRIER` on; a Python or traced int) for ``threads`` threads in all.

    Where one warpgroup only waits for another, this costs less than an mbarrier: an arrive is one
    instruction a warp (an mbarrier's is an atomic a thread), and a sync parks the warps instead of
    polling shared memory. The two sides must pair up: a barrier completes once ``threads`` threads
    have arrived or synced, whoever they are. The GPU only: Mosaic GPU's interpreter has no
    hardware barriers (the kernels take mbarriers there).
    """

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
    def emit(_: Any, index: Any) -> None:
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"),
            [index.registers[()]],
            f"bar.{op} $0, {threads};",
            "r",
            has_side_effects=True,
        )

    emit(jnp.asarray(barrier, jnp.int32))
