"""What each attention platform module provides, and how it is found."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._registry import BwdParams, FwdParams, available_platforms, get_kernel, register_kernel
from ._spec import AttentionSpec

__all__ = [
    "ALGORITHM",
    "MIRRORED",
    "MIRRORED_HALF",
    "MIRRORED_WIDE",
    "PORTABLE_VARIANTS",
    "SPLIT_DKDV",
    "TALL_DQ",
    "AttentionBackend",
    "AttentionShape",
    "backend_for",
    "band_pairs",
    "banded_tile",
    "DqLaunch",
    "FLOAT32_FWD_CANDIDATES",
    "dq_launch",
    "forward_band",
    "on_host",
    "register_backend",
    "segment_spans",
    "shrink_to_fit",
]

ALGORITHM = "flash_attention"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AttentionShape:
    """The sizes of a call, for heuristics and for filtering candidates that cannot work."""

    batch: int
    seq_q: int
    seq_k: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    spec: AttentionSpec

    @classmethod
    def of(cls, q: Any, k: Any, spec: AttentionSpec) -> AttentionShape:
        return cls(
            batch=q.shape[0],
            seq_q=q.shape[1],
            seq_k=k.shape[1],
            heads=q.shape[2],
            kv_heads=k.shape[2],
            head_dim=q.shape[3],
            dtype=np.dtype(q.dtype).name,
            spec=spec,
        )


# BwdParams.variant of the portable backwards (Triton, Pallas-Triton) whose dQ kernel mirrors the
# dK/dV kernel: each keeps kv_blocksize rows resident and streams q_blocksize blocks of the other
# side. With the default (None) both kernels take (q_blocksize, kv_blocksize) as (query, key)
# blocks, so a pair that suits dK/dV (a wide resident key block, narrow streamed query blocks)
# leaves dQ with narrow resident rows.
MIRRORED = "mirrored"
# BwdParams.variant of the portable backwards whose dQ kernel keeps half of kv_blocksize rows (at
# least 16) and streams q_blocksize keys, while the dK/dV kernel keeps kv_blocksize keys: each
# kernel's best resident block where they differ (Triton at head dim 64: dK/dV keeping 128 keys,
# dQ 64 rows; NOTES.md, forty-third round), until mirrored_wide's dQ kernel on 8 warps beat it.
MIRRORED_HALF = "mirrored_half"
# BwdParams.variant of the portable backwards whose dQ kernel keeps kv_blocksize rows on twice
# num_warps and streams twice q_blocksize keys, while the dK/dV kernel keeps kv_blocksize keys on
# num_warps. At the power cap a dQ kernel that keeps more rows reads each key block fewer times
# and runs at a higher clock (Triton at head dim 64 causal, NOTES.md, forty-fourth round).
MIRRORED_WIDE = "mirrored_wide"
# BwdParams.variant of the portable backwards whose dQ kernel keeps twice q_blocksize rows on twice
# num_warps and streams kv_blocksize keys, while the dK/dV kernel runs the blocks as given: at head
# dim 256 the dK/dV kernel's float32 dK and dV leave wgmma blocks no registers (32 x 32 on 4 warps
# runs mma.sync without a spill) where the dQ kernel's 64 rows on 8 warps compile to wgmma
# (NOTES.md, seventy-first round).
TALL_DQ = "tall_dq"
# BwdParams.variant of the portable backwards whose dK/dV kernel runs dV and dK in two programs a
# key block, each recomputing the scores (4 products become 5), and whose dQ kernel mirrors it: at
# head dim 256 one float32 accumulator of 128 x 256 on 8 warps compiles to wgmma without a spill
# in Triton, where two spilled on any wgmma block (NOTES.md, seventy-second round).
SPLIT_DKDV = "split_dkdv"
# The portable backwards' variants besides None (their dQ kernel's launch: dq_launch).
PORTABLE_VARIANTS = (MIRRORED, MIRRORED_HALF, MIRRORED_WIDE, TALL_DQ, SPLIT_DKDV)
# BwdParams.variant of the Mosaic backend: cuDNN's backward kernel on the Mosaic forward's residuals.
CUDNN_BWD = "cudnn"
# Forwards the portable tuners add for float32 inputs, whose products are FMAs with their operands
# in registers: small blocks, on 4 or 8 warps, hold them with little or no spill (which of them
# least depends on the head dim, the mask and the features; NOTES.md, fifty-second to fifty-fourth
# rounds).
FLOAT32_FWD_CANDIDATES = tuple(
    FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=2)
    for bq, bk in ((16, 32), (32, 32), (32, 64))
    for w in (4, 8)
)


class DqLaunch(NamedTuple):
    """How a portable dQ kernel runs: query rows kept, key columns streamed, warps, stages."""

    rows: int
    cols: int
    num_warps: int
    num_stages: int


def dq_launch(params: BwdParams) -> DqLaunch:
    """The dQ kernel's launch that ``params`` asks of a portable backward."""
    stages = params.dq_num_stages or params.num_stages
    if params.variant is None:
        return DqLaunch(params.q_blocksize, params.kv_blocksize, params.num_warps, stages)
    if params.variant in (MIRRORED, SPLIT_DKDV):
        return DqLaunch(params.kv_blocksize, params.q_blocksize, params.num_warps, stages)
    if params.variant == MIRRORED_HALF:
        rows = max(params.kv_blocksize // 2, 16)
        return DqLaunch(rows, params.q_blocksize, params.num_warps, stages)
    if params.variant == MIRRORED_WIDE:
        return DqLaunch(params.kv_blocksize, 2 * params.q_blocksize, 2 * params.num_warps, stages)
    if params.variant == TALL_DQ:
        return DqLaunch(2 * params.q_blocksize, params.kv_blocksize, 2 * params.num_warps, stages)
    raise ValueError(
        f"variant={params.variant!r}: the portable backwards take None or one of "
        f"{PORTABLE_VARIANTS}"
    )


# Causal tiles differ in work by up to the number of blocks along the sequence. Numbered one
# (batch, head) pair after another, the heaviest tiles of the last pairs start near the end of the
# grid and finish alone. A band of pairs numbered pairs fastest puts all of its heavy tiles first;
# a band of at least this many tiles (about four waves of two programs on each of 132 SMs) leaves
# only light tiles for the band's end.
_BAND_TILES = 1024
_MAX_BAND = 16
# But a band's programs soon sit all along their pairs' key/value streams, which should stay in
# L2 (50 MB on an H100/H200). On an H200 (benchmarks/NOTES.md, ninth round) 8 MB bands ran the
# causal forwards at D=128 4-7% faster than one pair a band and up to 7% faster than 16 MB bands;
# the backwards' kernels ran 3-5% slower in bands, and keep the plain order.
BAND_BYTES = 8 << 20


def band_sizes(pairs: int, most: int) -> list[int]:
    """The band sizes a grid of ``pairs`` (batch, head) pairs can take up to ``most``: the divisors
    of ``pairs``, ascending (every band whole)."""
    return [d for d in range(1, max(1, min(pairs, most)) + 1) if pairs % d == 0]


def band_pairs(pairs: int, blocks: int, causal: bool, stream_bytes: int) -> int:
    """How many (batch, head) pairs a band of a blocked grid holds (a divisor of ``pairs``).

    Kernels number tile ``t`` of ``pairs * blocks`` as band ``t // (band * blocks)``, then block
    along the sequence, then pair fastest (:func:`banded_tile`). Without a causal mask a band is
    one pair: each pair's blocks in turn, one key/value stream in L2 at a time. Causal grids take
    the fewest pairs that make a band of ``_BAND_TILES`` tiles, as far as ``stream_bytes`` (what
    one pair's programs all read: its share of the key/value heads, or of the query-side
    operands) keeps a band within ``BAND_BYTES``.
    """
    if not causal:
        return 1
    divisors = band_sizes(pairs, min(_MAX_BAND, BAND_BYTES // max(1, stream_bytes)))
    enough = [d for d in divisors if d * blocks >= _BAND_TILES]
    return enough[0] if enough else divisors[-1]


def forward_band(shape: AttentionShape, q_blocks: int) -> int:
    """:func:`band_pairs` of a forward grid of ``q_blocks`` query blocks per (batch, head) pair;
    a pair streams its share of a kv head's keys and values."""
    group = shape.heads // shape.kv_heads
    stream = 2 * shape.seq_k * shape.head_dim * np.dtype(shape.dtype).itemsize // group
    return band_pairs(shape.batch * shape.heads, q_blocks, shape.spec.causal, stream)


def on_host(x: Any) -> bool:
    """Whether ``x`` is a numpy value (a grid schedule planned on the host) rather than a scalar
    traced inside a kernel; the grid's arithmetic serves both."""
    return isinstance(x, (np.ndarray, np.generic))


def tile_div(a: Any, b: Any) -> Any:
    """``a // b`` of non-negative ints: ``lax.div`` inside kernels (truncating, no floor fix-up),
    numpy's on the host (:func:`on_host`)."""
    return a // b if on_host(a) else lax.div(a, b)


def tile_rem(a: Any, b: Any) -> Any:
    """``a % b`` of non-negative ints, as :func:`tile_div` divides."""
    return a % b if on_host(a) else lax.rem(a, b)


def banded_tile(index: Any, blocks: int, band: int) -> tuple[Any, Any]:
    """(block along the sequence, pair) of tile ``index`` (an int32 scalar inside a kernel, or a
    numpy array of them): bands of ``band`` pairs in turn, each band's ``blocks`` in turn, pairs
    fastest. ``band=1`` numbers each pair's blocks in turn; ``band`` = all pairs numbers pairs
    fastest throughout. (The Triton kernels have this numbering in Triton's language,
    ``_triton_kernels._tile``.)"""
    per_band = band * blocks
    r = tile_rem(index, per_band)
    return tile_div(r, band), tile_div(index, per_band) * band + tile_rem(r, band)


def _spans(ids: jax.Array, other: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For each ``ids[b, i]``, ``[first, end)``: from the first to past the last position of
    ``other[b]`` holding the same id; ``(m, 0)`` where none does (``other`` is ``[B, m]``)."""
    m = other.shape[1]
    order = jnp.argsort(other, axis=1, stable=True)  # equal ids keep their positions' order
    ranked = jnp.take_along_axis(other, order, axis=1)
    # by a sort: JAX's default binary search, a loop of small kernels, took 0.53-1.06 ms a side
    # on an H200 from 8x2048 to 1x65536 ids, this 0.12-0.41 ms (NOTES.md, forty-seventh round)
    search = functools.partial(jnp.searchsorted, method="sort")
    left = jax.vmap(functools.partial(search, side="left"))(ranked, ids)
    right = jax.vmap(functools.partial(search, side="right"))(ranked, ids)
    found = right > left
    first = jnp.take_along_axis(order, jnp.minimum(left, m - 1), axis=1)
    last = jnp.take_along_axis(order, jnp.maximum(right - 1, 0), axis=1)
    return jnp.where(found, first, m).astype(jnp.int32), jnp.where(found, last + 1, 0).astype(
        jnp.int32
    )


def segment_spans(q_seg: jax.Array, kv_seg: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Segment ids with the span each row's segment covers on the other side, for block skipping:
    ``[B, 3, Sq]`` of (id, first key, end key) per query row and ``[B, 3, Sk]`` of (id, first
    query, end query) per key row, int32. Keys outside ``[min first, max end)`` of a block of rows
    share no id with any of them, whatever the ids' order; for packed sequences (each id one run)
    that range is exactly the block's documents."""
    q_seg, kv_seg = q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)
    key_first, key_end = _spans(q_seg, kv_seg)
    query_first, query_end = _spans(kv_seg, q_seg)
    return (
        jnp.stack([q_seg, key_first, key_end], axis=1),
        jnp.stack([kv_seg, query_first, query_end], axis=1),
    )


def foldable(shape: AttentionShape) -> bool:
    """Whether the forward may fold a GQA group's query heads into the rows of one head (it does
    where all of a kv head's queries fit one q block: decoding): nothing in the call tells the
    heads apart (a bias, a mask, dropout). The causal and window limits follow the rows'
    queries."""
    spec = shape.spec
    return shape.heads > shape.kv_heads and not (
        spec.has_bias or spec.has_mask or spec.dropout_prob > 0.0
    )


# A call whose heads hold at most this many query rows (after folding a GQA group), against at
# least DECODE_KEYS_PER_ROW keys a row, is decoding: few queries against many keys (one token, a
# speculative draft, a chunk of a prefill), whose forward has too few q tiles to fill the GPU
# unless it splits the keys among programs. So is a call with more rows whose DECODE_ROWS-row
# tiles number at most DECODE_TILES, half an H200's multiprocessors: at 64 such tiles (256
# queries a head) Triton's forward split two ways ran 1.26-1.34x the Mosaic forward, at 128
# (512 queries) 0.80x (results/decode_NVIDIA_H200_20261129-184738.json).
DECODE_ROWS = 128
DECODE_KEYS_PER_ROW = 8
DECODE_TILES = 64


def folded_rows(shape: AttentionShape, q_block: int) -> int:
    """The query rows a head holds in a forward on ``q_block``-row blocks: its GQA group's queries
    where :func:`foldable` and they fit one block, else its own."""
    rows = shape.seq_q * (shape.heads // shape.kv_heads)
    return rows if foldable(shape) and rows <= q_block else shape.seq_q


def decoding_rows(shape: AttentionShape) -> int | None:
    """The query rows a head of a decoding call holds (:func:`folded_rows`), or None for a call
    with fewer than ``DECODE_KEYS_PER_ROW`` keys a row, or with more than ``DECODE_ROWS`` rows
    in more than ``DECODE_TILES`` tiles of that many."""
    rows = folded_rows(shape, DECODE_ROWS)
    if shape.seq_k < DECODE_KEYS_PER_ROW * rows:
        return None
    tiles = shape.batch * shape.heads * -(-rows // DECODE_ROWS)
    return rows if rows <= DECODE_ROWS or tiles <= DECODE_TILES else None


def merge_partials(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Partial attention results over disjoint key ranges, ``out [N, B, Sq, H, D]`` (each
    normalised over its own keys) and ``lse [N, B, H, Sq]``, combined into the whole range's (in
    float32; rows that no range saw stay zero with lse -inf)."""
    lse = lse.astype(jnp.float32)
    total = jax.nn.logsumexp(lse, axis=0)
    seen = jnp.isfinite(total)
    weight = jnp.where(seen, jnp.exp(lse - jnp.where(seen, total, 0.0)), 0.0)  # [N, B, H, Sq]
    weight = jnp.moveaxis(weight, 2, 3)[..., None]  # as [N, B, Sq, H, 1]
    return (weight * out.astype(jnp.float32)).sum(axis=0), total


def shrink_to_fit(
    shape: AttentionShape,
    params: Any,
    fits: Callable[[Any], bool],
    min_block: int,
    q_rows: int | None = None,
) -> Any:
    """``params`` (``FwdParams`` or ``BwdParams``) with blocks cut to the sequences' next powers of
    two (the queries' to ``q_rows`` where a forward folds more rows into a head), then fewer
    stages, then halved blocks (the key block first) until ``fits(params)``, or as small as
    ``min_block`` allows. Heuristics tuned for 16-bit tiles go through it: float32 tiles are twice
    as large."""

    def cut(block: int, seq: int) -> int:
        return min(block, max(min_block, 1 << max(0, seq - 1).bit_length()))

    p = dataclasses.replace(
        params,
        q_blocksize=cut(params.q_blocksize, q_rows or shape.seq_q),
        kv_blocksize=cut(params.kv_blocksize, shape.seq_k),
    )
    while not fits(p):
        if p.num_stages > 1:
            p = dataclasses.replace(p, num_stages=p.num_stages - 1)
        elif p.kv_blocksize > min_block and p.kv_blocksize >= p.q_blocksize:
            p = dataclasses.replace(p, kv_blocksize=p.kv_blocksize // 2)
        elif p.q_blocksize > min_block:
            p = dataclasses.replace(p, q_blocksize=p.q_blocksize // 2)
        else:
            break
    return p


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AttentionBackend:
    """One implementation of the backend contract in ``_spec.py``.

    Attributes:
        platform: ``"xla"``, ``"pallas"``, ``"triton"`` or ``"cudnn"``.
        variant: which implementation of the platform (``"dense"``, ``"chunked"``, ``"triton"``,
            ``"mosaic"``, ``"tpu"``, ...).
        devices: device kinds where it runs natively (elsewhere only in an interpreter, for tests).
        fwd, bwd: the contract's functions; both take ``spec=``, ``params=`` and ``interpret=``.
        infer: ``fwd``'s output alone, for calls that nothing differentiates, where leaving out the
            log-sum-exp makes the forward cheaper (cuDNN's forward without its softmax statistics
            is another cuDNN graph); None: ``fwd``'s output is used.
        unsupported: feature names (``AttentionSpec.features``) it refuses.
        bwd_unsupported: ``(BwdParams.variant, feature names)`` pairs: what a backward variant
            refuses besides ``unsupported`` (the Mosaic forward takes a window, its own backward
            kernels do not).
        heuristic: params for a shape, without measuring.
        candidates: params the tuner may try for a shape (already filtered to ones that can work).
        available: whether it can run on this device at all (e.g. cuDNN needs a GPU).
        bwd_uses_residuals: whether ``bwd`` normalises with the ``out`` and ``lse`` it is given; ring
            attention passes the whole sequence's, so it needs this (cuDNN and dense XLA recompute
            their own).
        splits_keys: whether ``fwd`` honours ``FwdParams.kv_splits`` (flash decoding) and ``bwd``
            ``BwdParams.kv_splits``.
    """

    platform: str
    variant: str
    devices: tuple[str, ...]
    fwd: Callable[..., tuple[jax.Array, jax.Array]]
    bwd: Callable[..., tuple[Any, Any, Any, Any]]
    infer: Callable[..., jax.Array] | None = None
    unsupported: frozenset[str] = frozenset()
    bwd_unsupported: tuple[tuple[str, frozenset[str]], ...] = ()
    heuristic: Callable[[AttentionShape], tuple[FwdParams, BwdParams]]
    candidates: Callable[[AttentionShape], Sequence[tuple[FwdParams, BwdParams]]]
    available: Callable[[], bool] = lambda: True
    bwd_uses_residuals: bool = True
    splits_keys: bool = False

    def check(
        self, spec: AttentionSpec, fwd: FwdParams | None = None, bwd: BwdParams | None = None
    ) -> None:
        """Raise ``NotImplementedError`` naming the first feature of ``spec`` this backend (or
        ``bwd``'s variant) lacks, or ``fwd``'s or ``bwd``'s key split where it does not split."""
        missing = sorted(spec.features & self.unsupported)
        if missing:
            raise NotImplementedError(
                f"platform {self.platform!r} ({self.variant}) does not support {', '.join(missing)}"
            )
        for variant, features in self.bwd_unsupported:
            missing = sorted(spec.features & features)
            if bwd is not None and bwd.variant == variant and missing:
                raise NotImplementedError(
                    f"platform {self.platform!r} ({self.variant}) backward variant {variant!r} "
                    f"does not support {', '.join(missing)}"
                )
        for name, params in (("fwd", fwd), ("bwd", bwd)):
            if params is not None and params.kv_splits > 1 and not self.splits_keys:
                raise NotImplementedError(
                    f"platform {self.platform!r} ({self.variant}) does not split the keys "
                    f"({name}.kv_splits={params.kv_splits}); the triton platform does"
                )


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    """Register ``backend`` for each device kind it runs on (and as ``any`` for interpreters)."""
    table = _variants.setdefault(backend.platform, {})
    table[backend.variant] = backend
    for device in (*backend.devices, "any"):
        register_kernel(ALGORITHM, backend.platform, device)(_Dispatch(backend.platform))
    return backend


# platform -> variant -> backend
_variants: dict[str, dict[str, AttentionBackend]] = {}


@dataclasses.dataclass(frozen=True)
class _Dispatch:
    platform: str


def backend_for(platform: str, variant: str | None = None) -> AttentionBackend:
    """The backend of ``platform`` (and ``variant``; default: the first registered that is available)."""
    get_kernel(ALGORITHM, platform, "any")  # raises a clear error for unknown platforms
    table = _variants[platform]
    if variant is not None:
        if variant not in table:
            raise ValueError(
                f"platform {platform!r} has no variant {variant!r}; has {sorted(table)}"
            )
        return table[variant]
    for backend in table.values():
        if backend.available():
            return backend
    return next(iter(table.values()))


def platforms() -> list[str]:
    """Registered attention platforms."""
    return available_platforms(ALGORITHM, "any")
