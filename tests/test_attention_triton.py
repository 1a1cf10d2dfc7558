"""The Triton attention kernels, run in Triton's interpreter, against the dense reference.

Triton decides between compiling and interpreting when it is first imported, so this must come
before anything imports it (conftest.py may set it too; setdefault keeps an explicit choice).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import json
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkfn._registry import BwdParams, FwdParams
from ejkfn._triton_interpret import import_triton
from ejkfn.attention import _triton as tri
from ejkfn.attention._backend import (
    MIRRORED,
    MIRRORED_HALF,
    MIRRORED_WIDE,
    SPLIT_DKDV,
    TALL_DQ,
    AttentionShape,
    backend_for,
)
from ejkfn.attention._reference import reference_attention
from ejkfn.attention._spec import AttentionSpec

from ._segments import segment_ids
from ._subprocess import ROOT, child_env

SPLITS_WINDOW = tri.splits_window  # the rule itself, before the fixture below replaces it


@pytest.fixture(autouse=True)
def _every_window_splits(monkeypatch):
    """Every window's interior blocks run unmasked here, however narrow and in float32 too, so
    that the small cases test the split loops; :func:`test_windows_masked_throughout` runs the
    narrow windows' path, and :func:`test_only_wide_16_bit_windows_split` the rule."""
    monkeypatch.setattr(tri, "splits_window", lambda spec, dtype, pass_: True)


# Small blocks so that short sequences still cross several blocks (and the causal diagonal).
FP = FwdParams(q_blocksize=32, kv_blocksize=32)
BP = BwdParams(q_blocksize=16, kv_blocksize=32)

# (atol, rtol) against a float32 reference on the same (rounded) inputs.
TOL = {
    jnp.float32: (2e-5, 2e-5),
    jnp.float16: (4e-3, 4e-3),
    jnp.bfloat16: (3e-2, 3e-2),
}
GRAD_TOL = {
    jnp.float32: (1e-4, 1e-4),
    jnp.float16: (1e-2, 1e-2),
    jnp.bfloat16: (8e-2, 5e-2),
}


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def _case(
    name,
    *,
    batch=2,
    seq_q=64,
    seq_k=64,
    heads=2,
    kv_heads=None,
    dim=32,
    dtype=jnp.float32,
    bias_shape=None,
    mask_shape=None,
    segments=False,
    dropout=0.0,
    **spec_kw,
):
    """Fresh random operands (never zeros) and the spec for one test."""
    rng = _rng(name)
    kv_heads = kv_heads or heads

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)

    q = normal(batch, seq_q, heads, dim)
    k = normal(batch, seq_k, kv_heads, dim)
    v = normal(batch, seq_k, kv_heads, dim)
    dout = normal(batch, seq_q, heads, dim)
    bias = normal(*bias_shape) if bias_shape else None
    mask = None
    if mask_shape:
        mask = jnp.asarray(rng.random(mask_shape) < 0.7)
    q_seg = kv_seg = None
    if segments:
        q_seg, kv_seg = segment_ids(rng, segments, batch, seq_q, seq_k)
    seed = jnp.asarray(rng.integers(0, 2**32, dtype=np.uint32)) if dropout else None
    spec = AttentionSpec(
        scale=1.0 / dim**0.5,
        dropout_prob=dropout,
        has_bias=bias is not None,
        has_mask=mask is not None,
        has_segments=bool(segments),
        **spec_kw,
    )
    return (q, k, v, bias, mask, q_seg, kv_seg, seed), dout, spec


def _close(name, got, want, tol):
    atol, rtol = tol
    got = np.asarray(got).astype(np.float32)
    want = np.asarray(want).astype(np.float32)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert not np.isnan(got).any(), f"{name}: NaN"
    scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
    np.testing.assert_allclose(got, want, atol=atol * scale, rtol=rtol, err_msg=name)


def _check(args, dout, spec, fp=FP, bp=BP):
    """Forward and backward under jit against the reference (and its VJP)."""
    q, k, v, bias, mask, q_seg, kv_seg, seed = args
    dtype = q.dtype.type

    @jax.jit
    def run(q, k, v, bias, dout):
        out, lse = tri.fwd(q, k, v, bias, mask, q_seg, kv_seg, seed, spec=spec, params=fp)
        grads = tri.bwd(
            q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, dout, spec=spec, params=bp
        )
        return out, lse, grads

    out, lse, (dq, dk, dv, dbias) = run(q, k, v, bias, dout)

    @jax.jit  # eagerly, each of the reference's operations would compile on its own
    def ref(q, k, v, bias, dout):
        def attend(q, k, v, bias):
            return reference_attention(q, k, v, bias, mask, q_seg, kv_seg, seed, spec=spec)

        (out, lse), vjp = jax.vjp(attend, q, k, v, bias)
        return out, lse, vjp((dout.astype(jnp.float32), jnp.zeros_like(lse)))

    ref_out, ref_lse, (ref_dq, ref_dk, ref_dv, ref_dbias) = ref(q, k, v, bias, dout)

    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    _close("out", out, ref_out, TOL[dtype])
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    _close("lse", np.where(finite, lse, 0.0), np.where(finite, ref_lse, 0.0), TOL[jnp.float32])
    for name, got, want in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        assert got.dtype == q.dtype
        _close(name, got, want, GRAD_TOL[dtype])
    if bias is None:
        assert dbias is None
    else:
        assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
        _close("dbias", dbias, ref_dbias, GRAD_TOL[dtype])


FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "causal_q_shorter": dict(causal=True, seq_q=40, seq_k=72, heads=1),
    "causal_k_shorter": dict(causal=True, seq_q=72, seq_k=40, heads=1),  # early rows see no key
    "ragged": dict(seq_q=50, seq_k=70),
    "gqa_causal": dict(heads=4, kv_heads=2, causal=True),
    "mqa": dict(heads=4, kv_heads=1, seq_q=48, seq_k=80),
    "window": dict(window=(9, 5)),
    "window_causal": dict(window=(20, 0), causal=True, seq_q=56),
    "window_narrow_gqa": dict(window=(0, 3), heads=4, kv_heads=2, seq_k=80),
    # wide enough for whole blocks between the edges (unmasked), the last key block ragged
    "window_wide": dict(window=(56, 40), seq_q=128, seq_k=144, heads=1),
    "window_wide_causal_gqa": dict(
        window=(70, 0), causal=True, seq_q=120, seq_k=136, heads=4, kv_heads=2, batch=1
    ),
    "segments": dict(segments=True),
    "segments_causal_gqa": dict(segments=True, causal=True, heads=4, kv_heads=2),
    # whole blocks skipped by the segments' spans (blocks of 16 and 32 over 160 rows)
    "segments_packed": dict(segments="packed", seq_q=160, seq_k=160, heads=1),
    "segments_packed_causal_gqa": dict(
        segments="packed", causal=True, seq_q=160, seq_k=160, heads=4, kv_heads=2, batch=1
    ),
    "segments_packed_q_shorter": dict(segments="packed", causal=True, seq_q=72, seq_k=136),
    "segments_interleaved": dict(segments="interleaved", seq_q=96, seq_k=80, heads=1),
    "segments_unmatched_causal": dict(segments="unmatched", causal=True, seq_q=128, seq_k=128),
    "mask_batch": dict(mask_shape=(2, 1, 64, 64)),
    "mask_full_causal": dict(mask_shape=(2, 2, 64, 64), causal=True),
    "bias_heads": dict(bias_shape=(1, 2, 64, 64)),
    "bias_full_causal_gqa": dict(
        bias_shape=(1, 4, 48, 64), batch=1, seq_q=48, heads=4, kv_heads=2, causal=True
    ),
    "bias_rows": dict(bias_shape=(2, 1, 1, 48), seq_k=48),
    "soft_cap": dict(soft_cap=2.0),
    "soft_cap_bias_causal": dict(soft_cap=3.0, bias_shape=(2, 2, 64, 64), causal=True),
    "dropout_low": dict(dropout=0.1),  # threshold below 2**31
    "dropout_finest": dict(dropout=2**-16, seq_q=32, seq_k=32, batch=1),  # the lowest threshold
    "dropout_high_causal_gqa": dict(dropout=0.6, causal=True, heads=4, kv_heads=2),
    "scale": dict(scale_factor=3.0),
    "scale_negative": dict(scale_factor=-30.0),  # max of raw products is the min; exp2 overflows
    # the forward's grid: 40 (batch, head) pairs in causal bands of 10
    "causal_bands_gqa": dict(causal=True, heads=20, kv_heads=10, seq_q=48, seq_k=48, dim=16),
    "head_dim_80": dict(dim=80, seq_q=40, seq_k=24, heads=1, batch=1),
    "head_dim_96_gqa": dict(dim=96, seq_q=32, seq_k=48, heads=2, kv_heads=1, batch=1),
    "everything": dict(
        heads=4,
        kv_heads=2,
        seq_q=40,
        seq_k=56,
        causal=True,
        window=(24, 2),
        segments=True,
        mask_shape=(1, 4, 40, 56),
        bias_shape=(2, 1, 40, 56),
        soft_cap=4.0,
        dropout=0.25,
    ),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_feature_f32(feature):
    kw = dict(FEATURES[feature])
    factor = kw.pop("scale_factor", None)
    args, dout, spec = _case(feature, **kw)
    if factor is not None:
        spec = AttentionSpec(scale=spec.scale * factor)
    _check(args, dout, spec)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("feature", ["plain", "causal_q_shorter", "bias_heads"])
def test_low_precision(feature, dtype):
    args, dout, spec = _case(f"{feature}-{dtype.__name__}", dtype=dtype, **FEATURES[feature])
    _check(args, dout, spec)


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_head_dims(dim):
    args, dout, spec = _case(f"dim{dim}", dim=dim, seq_q=32, seq_k=32, heads=1, batch=1)
    _check(args, dout, spec, fp=FwdParams(q_blocksize=16, kv_blocksize=16))


@pytest.mark.parametrize(
    "feature",
    ["causal", "causal_q_shorter", "causal_k_shorter", "ragged", "window_wide", "everything"],
)
@pytest.mark.parametrize(
    "variant, kv_block, dq",
    [
        (MIRRORED, 32, (32, 16, 4)),
        (MIRRORED_HALF, 64, (32, 16, 4)),
        (MIRRORED_WIDE, 32, (32, 32, 8)),
        (TALL_DQ, 32, (32, 32, 8)),
        (SPLIT_DKDV, 32, (32, 16, 4)),
    ],
)
def test_mirrored_backward(feature, variant, kv_block, dq):
    """dQ keeping kv_blocksize rows (mirrored; half as many: mirrored_half) and streaming
    q_blocksize keys (twice as many on twice the warps: mirrored_wide), or keeping twice
    q_blocksize rows on twice the warps (tall_dq); dV and dK in programs of their own
    (split_dkdv, dQ mirrored): the same gradients, including where the two kernels' diagonal
    blocks fall differently."""
    kw = dict(FEATURES[feature])
    args, dout, spec = _case(f"mirrored-{feature}", **kw)
    bp = BwdParams(q_blocksize=16, kv_blocksize=kv_block, variant=variant)
    assert tri.dq_launch(bp) == (*dq, bp.num_stages)
    _check(args, dout, spec, bp=bp)


def test_dq_kernel_takes_its_own_stages():
    """``dq_num_stages`` sets the dQ kernel's pipelining apart from dK/dV's (ptxas serialized the
    dQ kernel's wgmmas with a causal bias at head dim 128 on 3 stages, not on 2), the gradients
    unchanged; the fit estimate counts the dQ tiles at that depth."""
    bp = BwdParams(q_blocksize=16, kv_blocksize=32, num_stages=3, variant=MIRRORED, dq_num_stages=1)
    assert tri.dq_launch(bp) == (32, 16, 4, 1)
    assert tri.dq_launch(dataclasses.replace(bp, dq_num_stages=None)).num_stages == 3
    args, dout, spec = _case("dq-stages", **FEATURES["everything"])
    _check(args, dout, spec, bp=bp)
    spec = AttentionSpec(scale=0.1, causal=True, has_bias=True)
    shape = AttentionShape(
        batch=1, seq_q=4096, seq_k=4096, heads=1, kv_heads=1, head_dim=128, dtype="bfloat16",
        spec=spec,
    )  # fmt: skip
    deep = BwdParams(q_blocksize=64, kv_blocksize=64, num_warps=4, num_stages=2, dq_num_stages=9)
    assert tri._fits(shape, dataclasses.replace(deep, dq_num_stages=2), backward=True)
    assert not tri._fits(shape, deep, backward=True)  # nine stages of dQ tiles overflow
    with pytest.raises(ValueError, match="dq_num_stages=0"):
        BwdParams(dq_num_stages=0)


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32)])
@pytest.mark.parametrize(
    "feature", ["causal", "causal_k_shorter", "ragged", "window_wide_causal_gqa", "everything"]
)
def test_forward_blocks_of_two_sizes(feature, blocks):
    """With q and key blocks of different sizes the forward runs its masked blocks first (ptxas
    serializes the wgmmas otherwise); the result must not depend on that order."""
    kw = dict(FEATURES[feature])
    args, dout, spec = _case(f"blocks-{feature}-{blocks}", **kw)
    _check(args, dout, spec, fp=FwdParams(q_blocksize=blocks[0], kv_blocksize=blocks[1]))


@pytest.mark.parametrize(
    "feature", ["window", "window_causal", "window_wide", "window_wide_causal_gqa"]
)
def test_windows_masked_throughout(feature, monkeypatch):
    """The path of windows too narrow to split: every block masked, the diagonal too."""
    monkeypatch.setattr(tri, "splits_window", lambda spec, dtype, pass_: False)
    args, dout, spec = _case(f"masked-{feature}", **FEATURES[feature])
    _check(args, dout, spec)


def test_only_wide_16_bit_windows_split(monkeypatch):
    """A window's interior runs unmasked from 128 keys seen in the forward, 512 in the backward
    (one side when causal, both when not), never in float32 nor with a mask; and the kernels get
    what the rule says."""
    monkeypatch.setattr(tri, "splits_window", SPLITS_WINDOW)

    def split(window, causal, dtype="bfloat16"):
        spec = AttentionSpec(scale=1.0, causal=causal, window=window)
        return tuple(SPLITS_WINDOW(spec, dtype, p) for p in ("fwd", "bwd"))

    assert split(None, True, "float32") == (True, True)
    assert split((127, 4096), True) == (False, False)
    assert split((128, 0), True) == (True, False)
    assert split((511, 0), True, "float16") == (True, False)
    assert split((512, 0), True) == (True, True)
    assert split((64, 63), False) == (False, False)
    assert split((64, 64), False) == (True, False)
    assert split((0, 512), False) == (True, True)
    assert split((4096, 4096), False, "float32") == (False, False)

    q = jnp.zeros((1, 64, 2, 32), jnp.bfloat16)
    mask = jnp.ones((1, 1, 64, 64), bool)
    for window, mask_, pass_, want in [
        ((300, 0), None, "fwd", True),
        ((100, 0), None, "fwd", False),
        ((300, 0), None, "bwd", False),
        ((600, 0), None, "bwd", True),
        ((600, 0), mask, "bwd", False),
    ]:
        spec = AttentionSpec(scale=1.0, causal=True, window=window, has_mask=mask_ is not None)
        call = tri._prepare(q, q, q, None, mask_, None, None, None, spec, pass_)
        assert call.meta["SPLIT"] is want, (window, pass_)


_RANGE_FIELDS = 4  # lo, hi, full_lo, full_hi


triton = import_triton(True)
tl = triton.language
_KERNELS = tri._kernels(True)


@triton.jit
def _ranges_kernel(Out, KV: tl.constexpr, SEQ_Q: tl.constexpr, SEQ_K: tl.constexpr,
                   BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr,
                   LEFT: tl.constexpr, RIGHT: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    if KV:
        lo, hi, full_lo, full_hi = _KERNELS._kv_blocks(
            pid * BLOCK_Q, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL, LEFT, RIGHT, True, GROUP
        )
    else:
        lo, hi, full_lo, full_hi = _KERNELS._q_blocks(
            pid * BLOCK_K, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL, LEFT, RIGHT, True
        )
    tl.store(Out + pid * 4, lo)
    tl.store(Out + pid * 4 + 1, hi)
    tl.store(Out + pid * 4 + 2, full_lo)
    tl.store(Out + pid * 4 + 3, full_hi)


def _block_ranges(kind, seq_q, seq_k, block_q, block_k, causal, window, row_group=1):
    """What ``_kv_blocks`` (``kind="kv"``: per q block) or ``_q_blocks`` (``"q"``: per key block)
    returns for every block, run in Triton's interpreter: ``[blocks, 4]``."""
    from ejkfn._triton_interpret import launch

    rows = seq_q * row_group
    blocks = -(-(rows if kind == "kv" else seq_k) // (block_q if kind == "kv" else block_k))
    left, right = window if window is not None else (-1, -1)
    (out,) = launch(
        _ranges_kernel, grid=(blocks,), out_shapes=[jax.ShapeDtypeStruct((blocks * 4,), jnp.int32)],
        num_warps=4, num_stages=1, interpret=True, KV=kind == "kv", SEQ_Q=rows, SEQ_K=seq_k,
        BLOCK_Q=block_q, BLOCK_K=block_k, CAUSAL=causal, LEFT=left, RIGHT=right, GROUP=row_group,
    )  # fmt: skip
    return np.asarray(out).reshape(blocks, _RANGE_FIELDS)


@pytest.mark.parametrize(
    ("seq_q", "seq_k", "causal", "window", "row_group"),
    [
        (96, 112, True, None, 1),
        (72, 40, True, None, 1),  # early rows see no key
        (128, 144, False, (56, 40), 1),  # a two-sided window, the last key block ragged
        (120, 136, True, (70, 0), 1),
        (100, 100, True, (5, 0), 1),  # narrower than a block: no whole block
        (4, 160, True, (40, 0), 3),  # decoding, a GQA group's rows folded
        (64, 64, False, (0, 20), 1),
    ],
)
@pytest.mark.parametrize(("block_q", "block_k"), [(16, 32), (32, 16)])
def test_block_ranges_cover_what_is_seen_and_leave_unmasked_only_whole_blocks(
    seq_q, seq_k, causal, window, row_group, block_q, block_k
):
    """The kernels' loops run ``[full_lo, full_hi)`` without the visibility mask and the rest of
    ``[lo, hi)`` with it: against the visibility of every query and key, each range holds every
    key (query) a block sees, and the unmasked one only blocks every real row sees whole, split
    on block bounds (but for the ragged last q block the dK/dV kernel takes unmasked, whose rows
    past the queries load zeros). A window's left edge too, and a GQA group's rows folded."""
    shift = seq_k - seq_q
    query = np.arange(seq_q)[:, None] + shift
    key = np.arange(seq_k)[None, :]
    seen = np.ones((seq_q, seq_k), bool)
    if causal:
        seen &= key <= query
    if window is not None:
        seen &= (key >= query - window[0]) & (key <= query + window[1])
    seen = np.repeat(seen, row_group, axis=0)  # row r is query r // row_group
    rows = seq_q * row_group
    whole = 0
    for kind, block, other in (("kv", block_q, block_k), ("q", block_k, block_q)):
        grid = seen if kind == "kv" else seen.T  # [this side's rows, the other side's]
        if kind == "q" and row_group > 1:
            continue  # the backward does not fold
        ranges = _block_ranges(kind, seq_q, seq_k, block_q, block_k, causal, window, row_group)
        for i, (lo, hi, full_lo, full_hi) in enumerate(ranges):
            mine = grid[i * block : (i + 1) * block]
            if hi <= lo:  # no block: every loop is empty
                assert not mine.any() and full_hi <= full_lo, (kind, i, ranges[i])
                continue
            assert lo <= full_lo <= full_hi <= hi, (kind, i, ranges[i])
            assert lo % other == 0 and full_lo % other in (0, hi % other), (kind, i, ranges[i])
            visible = np.flatnonzero(mine.any(axis=0))
            assert visible.size == 0 or (lo <= visible[0] and visible[-1] < hi), (kind, i)
            for start in range(full_lo, full_hi, other):
                # keys past the last run masked; a ragged last q block's padding rows load zeros
                inside = start + other <= full_hi and start + other <= grid.shape[1]
                assert inside or (kind == "q" and full_hi == seq_q), (kind, i, ranges[i])
                assert mine[:, start : start + other].all(), (kind, i, start, ranges[i])
                whole += 1
    if window is None or min(window) >= 2 * max(block_q, block_k):
        assert whole > 0  # the interior runs unmasked
    del rows


HOPPER_SHARED_BYTES = 227 * 1024  # the most one program may opt into on an H100 or H200


def _compiled_rows(*options: str) -> list[dict]:
    """The rows of ``benchmarks/triton_sass.py`` (compiling for sm_90a, no GPU needed) at
    8x2048x32x64 and 4x4096x16x128 with ``options``."""
    env = child_env()
    env.pop("TRITON_INTERPRET", None)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "sass.json"
        script = str(ROOT / "benchmarks" / "triton_sass.py")
        shapes = "8x2048x32x64,4x4096x16x128"
        done = subprocess.run(
            [sys.executable, script, "--shapes", shapes, *options, "--json", str(report)],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return json.loads(report.read_text())


@pytest.mark.slow
def test_compiled_kernels_keep_their_wgmmas_in_flight():
    """Compiled for sm_90a (benchmarks/triton_sass.py, no GPU needed), no kernel of the heuristic's
    configs has ptxas serialize its wgmmas (warning C7515: a wait after every one), as the D = 64
    causal forward did while its diagonal ran after the interior. Only the causal dK/dV kernels
    spill, 8 and 24 bytes for reading delta early, which made them faster (NOTES.md,
    eighty-fourth round)."""
    rows = _compiled_rows("--masks", "both")
    assert {(r["case"], r["kernel"]) for r in rows} >= {("8x2048x32x64 causal", "fwd")}
    assert len(rows) == 12
    for row in rows:
        bound = 24 if row["kernel"] == "dkdv" and "causal" in row["case"] else 0
        assert row["warnings"] == [] and row["spill_bytes"] <= bound, row
        assert row["loops"], row
        for loop in row["loops"]:
            assert loop["wgmma"] > loop["wgmma_waits"] > 0, row


@pytest.mark.slow
@pytest.mark.parametrize(
    ("feature", "every_kernel"),
    [("segments", True), ("dropout", True), ("window", True), ("soft_cap", False),
     ("bias", False), ("mask", False)],
)  # fmt: skip
def test_compiled_kernels_with_a_feature_neither_spill_nor_serialize(feature, every_kernel):
    """The heuristic's causal blocks with a feature, compiled for sm_90a. At head dim 64 the dK/dV
    kernel on 32 x 128 blocks spilled (segment ids 272 bytes, dropout 164, a soft cap 132, a bias
    332), and at 128 the forward on 64 x 64 blocks had its wgmmas serialized with dropout or a bias
    (C7515): with every feature the forward kernels neither spill nor serialize, and the dK/dV
    kernel at head dim 64 does not spill. With a soft cap, a bias or a mask the other kernels keep
    known faults (C7515 in dQ with a bias, C7513 in dK/dV, 12-28 byte spills at head dim 128;
    benchmarks/NOTES.md). The segments' dK/dV kernel at head dim 128 spills 4 bytes (its loop
    state), which the bound allows."""
    rows = _compiled_rows("--masks", "causal", "--feature", feature)
    assert len(rows) == 6
    for row in rows:
        assert row["shared_bytes"] <= HOPPER_SHARED_BYTES, row
        narrow_dkdv = row["kernel"] == "dkdv" and "x64 " in row["case"]
        # With a window, the dK/dV kernel's masked loop steps over the unmasked q blocks between
        # the window's edges: at head dim 128 causal ptxas spills 20 bytes for it.
        bound = 24 if feature == "window" and row["kernel"] == "dkdv" else 8
        if every_kernel or row["kernel"] == "fwd":
            assert row["warnings"] == [] and row["spill_bytes"] <= bound, row
        elif narrow_dkdv:  # a bias serializes its wgmmas on any blocks (C7513)
            assert row["spill_bytes"] <= 8, row


@pytest.mark.slow
def test_compiled_kernels_fit_shared_memory_with_a_float32_bias():
    """The heuristic's blocks are chosen for a bf16 bias; with a float32 one the mirrored dK/dV
    kernel at head dim 128 asked 241 KiB on 3 stages. Compiled for sm_90a, every kernel now fits
    Hopper's 227 KiB, causal and not, at head dims 64 and 128."""
    rows = _compiled_rows("--masks", "both", "--feature", "bias_f32")
    assert len(rows) == 12
    for row in rows:
        assert 0 < row["shared_bytes"] <= HOPPER_SHARED_BYTES, row


@pytest.mark.slow
@pytest.mark.parametrize("feature", ["none", "mask"])
def test_float32_forwards_keep_their_registers(feature):
    """In float32 the products are FMAs with their operands in registers. At head dim 128 the
    forward on 32 x 64 blocks and 4 warps compiled (without a mask, or with a mask tensor) into
    32 registers and 13 KB of spills a thread, and ran 12x slower than on 8 warps; compiled for
    sm_90a, no heuristic forward falls into that, and none spills more than the 1.2 KB of the
    16-bit blocks kept at head dim 64 causal."""
    rows = _compiled_rows(
        "--masks", "both", "--kernels", "fwd", "--dtype", "float32", "--feature", feature
    )
    assert len(rows) == 4
    for row in rows:
        assert row["registers"] > 64 and row["spill_bytes"] <= 1300, row


def _launched_stages(monkeypatch, bias_dtype, mask: bool) -> dict[str, int]:
    """kernel -> the stages ``tri.fwd`` and ``tri.bwd`` launch it with at 4x4096x16x128 causal on
    the heuristic's blocks, traced abstractly."""
    stages = {}

    def record(kernel, *args, out_shapes, num_stages, **kw):
        stages[kernel.__name__] = num_stages
        return tuple(jnp.zeros(o.shape, o.dtype) for o in out_shapes)

    monkeypatch.setattr(tri, "launch", record)
    spec = AttentionSpec(scale=0.088, causal=True, has_bias=True, has_mask=mask)
    q = jax.ShapeDtypeStruct((4, 4096, 16, 128), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 16, 4096, 4096), bias_dtype)
    attention_mask = jax.ShapeDtypeStruct((1, 1, 4096, 4096), jnp.bool_) if mask else None
    fp, bp = tri.heuristic(AttentionShape.of(q, q, spec))
    lse = jax.ShapeDtypeStruct((4, 16, 4096), jnp.float32)

    def both(q, bias, lse, *mask):
        m = mask[0] if mask else None
        kw = dict(spec=spec, interpret=True)  # the launch is recorded, not run
        tri.fwd(q, q, q, bias, m, None, None, None, params=fp, **kw)
        return tri.bwd(q, q, q, bias, m, None, None, None, q, lse, q, params=bp, **kw)

    jax.eval_shape(both, q, bias, lse, *([attention_mask] if mask else []))
    return stages


@pytest.mark.parametrize("dim", [64, 128])
def test_the_tuner_tries_small_blocks_in_float32_only(dim):
    """float32 products are FMAs with their operands in registers: the tuner also tries blocks
    that compile without spills there, and nothing more in 16 bits."""
    spec = AttentionSpec(scale=0.1, causal=True)
    small_fwd = FwdParams(q_blocksize=32, kv_blocksize=64, num_warps=4, num_stages=2)
    small_bwd = BwdParams(q_blocksize=16, kv_blocksize=32, num_warps=4, num_stages=2)

    def tried(dtype):
        x = jax.ShapeDtypeStruct((4, 4096, 16, dim), dtype)
        cands = tri.candidates(AttentionShape.of(x, x, spec))
        assert len(set(cands)) == len(cands)  # none timed twice
        return {f for f, _ in cands}, {b for _, b in cands}

    fwds, bwds = tried(jnp.float32)
    assert small_fwd in fwds and small_bwd in bwds
    fwds, bwds = tried(jnp.bfloat16)
    assert small_fwd not in fwds and small_bwd not in bwds


@pytest.mark.parametrize(
    ("bias_dtype", "mask", "fwd", "dq", "dkdv"),
    [
        (jnp.bfloat16, False, 3, 3, 3),  # the blocks as timed
        (jnp.bfloat16, True, 3, 3, 3),
        (jnp.float32, False, 3, 3, 2),  # 241 KiB on 3
        (jnp.float32, True, 3, 2, 2),  # dQ 240 KiB on 3
    ],
)
def test_wide_bias_tiles_launch_on_fewer_stages(monkeypatch, bias_dtype, mask, fwd, dq, dkdv):
    """A kernel whose bias and mask tiles would pass Hopper's shared memory on the config's stages
    launches on fewer (the config is chosen without the bias's dtype); 16-bit ones keep them."""
    stages = _launched_stages(monkeypatch, bias_dtype, mask)
    assert stages == {"fwd_kernel": fwd, "bwd_dq_kernel": dq, "bwd_dkdv_kernel": dkdv}


_SPEC_OPTIONS = {
    "soft_cap": dict(soft_cap=30.0),
    "segments": dict(has_segments=True),
    "dropout": dict(dropout_prob=0.1),
    "bias": dict(has_bias=True),
    "mask": dict(has_mask=True),
    "window": dict(window=(256, 0)),
}


@pytest.mark.parametrize("feature", ["none", *_SPEC_OPTIONS])
def test_heuristic_blocks_with_a_feature(feature):
    """Causal, the dK/dV blocks at head dim 64 leave mirrored_wide for 64 x 64 with any feature
    (they spill with one), and the forward at 128 takes 128 x 64 on 8 warps with the features that
    serialize its wgmmas (dropout, a bias) or slow it (a mask); not causal, both keep their
    blocks."""
    options = _SPEC_OPTIONS.get(feature, {})

    def blocks(dim, causal):
        spec = AttentionSpec(scale=0.1, causal=causal, **options)
        shape = AttentionShape(
            batch=8, seq_q=2048, seq_k=2048, heads=32, kv_heads=8, head_dim=dim, dtype="bfloat16",
            spec=spec,
        )  # fmt: skip
        return tri.heuristic(shape)

    bwd_64 = blocks(64, True)[1]
    got = (bwd_64.q_blocksize, bwd_64.kv_blocksize, bwd_64.num_warps, bwd_64.variant)
    assert got == ((32, 128, 4, MIRRORED_WIDE) if feature == "none" else (64, 64, 4, None))
    assert blocks(64, False)[1] == BwdParams(
        q_blocksize=64, kv_blocksize=64, num_warps=4, num_stages=3
    )
    fwd_128 = blocks(128, True)[0]
    wide = feature in ("dropout", "bias", "mask")
    assert (fwd_128.q_blocksize, fwd_128.num_warps) == ((128, 8) if wide else (64, 4))
    assert blocks(128, False)[0].q_blocksize == 64


# Decoding: a few query rows against many keys. Blocks of 16 keys split three ways (9 blocks at
# 130 keys: three a program); where the call allows, the GQA group's heads fold into one head's rows.
DECODING = {
    "one_query_gqa_causal": dict(seq_q=1, seq_k=130, heads=8, kv_heads=2, causal=True),  # folds
    "few_queries_gqa": dict(seq_q=3, seq_k=130, heads=4, kv_heads=2),  # folds
    "few_queries_gqa_causal": dict(seq_q=3, seq_k=130, heads=4, kv_heads=2, causal=True),  # folds
    # folds in groups of 3: row r is query r // 3 for the causal, window and segment limits
    "window_segments_gqa_causal": dict(
        seq_q=5, seq_k=130, heads=6, kv_heads=2, causal=True, window=(20, 0), segments=True
    ),
    "segments_mqa": dict(seq_q=4, seq_k=130, heads=4, kv_heads=1, segments=True),  # folds
    "segments_unmatched": dict(seq_q=4, seq_k=130, segments="unmatched"),  # rows see no key
    "window": dict(seq_q=4, seq_k=160, window=(40, 0), causal=True),  # most programs see no key
    "window_wide": dict(seq_q=4, seq_k=320, window=(150, 0), causal=True),  # whole blocks too
    "soft_cap_mqa": dict(seq_q=1, seq_k=100, heads=4, kv_heads=1, soft_cap=5.0),  # folds
    "bias_mask_dropout_gqa": dict(
        seq_q=2,
        seq_k=96,
        heads=4,
        kv_heads=2,
        bias_shape=(1, 4, 2, 96),
        mask_shape=(2, 1, 2, 96),
        dropout=0.2,
    ),
    "fewer_blocks_than_splits": dict(seq_q=1, seq_k=24, heads=2, kv_heads=1),
}
DECODING_FP = FwdParams(q_blocksize=16, kv_blocksize=16, kv_splits=3)
DECODING_BP = BwdParams(q_blocksize=16, kv_blocksize=16, kv_splits=3)


@pytest.mark.parametrize("feature", sorted(DECODING))
def test_decoding_splits_the_keys(feature):
    """Each program attends to a third of the keys and the partial results merge by their
    log-sum-exps; each dQ program adds a third of the keys' terms: output, lse and the gradients
    (the backward's, on the merged lse) match the reference, empty partials and rows too."""
    args, dout, spec = _case(f"decoding-{feature}", **DECODING[feature])
    _check(args, dout, spec, fp=DECODING_FP, bp=DECODING_BP)


def test_decoding_folds_a_gqa_group_where_nothing_tells_its_heads_apart(monkeypatch):
    """The group's heads become rows of one head, so each key block is read once for the group,
    causal, with a window or segment ids too (their limits follow each row's query); with a bias,
    a mask or dropout, which tell the heads apart, not."""
    launched = []
    forward = tri._fwd
    monkeypatch.setattr(
        tri, "_fwd", lambda q, *rest, **kw: launched.append(q.shape) or forward(q, *rest, **kw)
    )
    for name, kw, heads in (
        ("one_query_gqa_causal", {}, 2),
        ("few_queries_gqa", {}, 2),
        ("few_queries_gqa_causal", {}, 2),
        ("window_segments_gqa_causal", {}, 2),
        ("bias_mask_dropout_gqa", {}, 4),
        ("few_queries_gqa", dict(window=(8, 8)), 2),
    ):
        args, _, spec = _case(f"decoding-{name}", **{**DECODING[name], **kw})
        launched.clear()
        tri.fwd(*args, spec=spec, params=DECODING_FP)
        q = args[0]
        folded = (q.shape[0], q.shape[1] * q.shape[2] // heads, heads, q.shape[3])
        assert launched == [folded], name
    # a group that does not fit one q block stays as it is
    args, _, spec = _case("decoding-few_queries_gqa", **DECODING["few_queries_gqa"])
    launched.clear()
    tri.fwd(*args, spec=spec, params=FwdParams(q_blocksize=16, kv_blocksize=16, kv_splits=1))
    wide = dict(DECODING["few_queries_gqa"], seq_q=9)  # 9 x 2 rows > 16
    args, _, spec = _case("decoding-wide", **wide)
    tri.fwd(*args, spec=spec, params=DECODING_FP)
    assert launched == [(2, 6, 2, 32), (2, 9, 4, 32)]


@pytest.mark.parametrize(
    ("seq_q", "seq_k", "heads", "kv_heads", "window"),
    [(5, 5, 6, 2, None), (8, 8, 8, 2, (2, 0)), (7, 20, 4, 1, (3, 1))],
)
def test_short_causal_gqa_calls_fold_with_each_rows_query(
    seq_q, seq_k, heads, kv_heads, window, monkeypatch
):
    """Outside decoding too, a GQA group whose queries fit one q block folds (here 64 rows, the
    training blocks): causal and window limits follow each folded row's query, in groups that
    are not powers of two as well."""
    launched = []
    forward = tri._fwd
    monkeypatch.setattr(
        tri, "_fwd", lambda q, *rest, **kw: launched.append(q.shape) or forward(q, *rest, **kw)
    )
    args, dout, spec = _case(
        f"fold-{seq_q}-{seq_k}-{heads}", seq_q=seq_q, seq_k=seq_k, heads=heads,
        kv_heads=kv_heads, causal=True, window=window,
    )  # fmt: skip
    _check(args, dout, spec, fp=FwdParams(q_blocksize=64, kv_blocksize=16))
    assert launched == [(2, seq_q * heads // kv_heads, kv_heads, 32)]


def test_decoding_runs_under_vmap_and_tunes_its_splits():
    """The split forward batches under vmap (the merge is XLA's); the tuner tries the decoding
    forward with half and twice the splits, 64-key blocks and fewer stages, and its backward with
    half and twice the dQ splits."""
    args, _, spec = _case("decoding-vmap", **DECODING["one_query_gqa_causal"])
    q, k, v = args[:3]
    stack = lambda x: jnp.stack([x, -0.5 * x])

    def attend(q, k, v):
        return tri.fwd(q, k, v, None, None, None, None, None, spec=spec, params=DECODING_FP)[0]

    out = jax.jit(jax.vmap(attend))(stack(q), stack(k), stack(v))
    reference = jax.jit(lambda q, k, v: reference_attention(q, k, v, spec=spec)[0])
    for i, scale in enumerate((1.0, -0.5)):
        _close(f"vmap[{i}]", out[i], reference(scale * q, scale * k, scale * v), TOL[jnp.float32])
    shape = AttentionShape(
        batch=1, seq_q=1, seq_k=32768, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16",
        spec=spec,
    )  # fmt: skip
    cands = tri.candidates(shape)
    fwds = [fp for fp, _ in cands]
    heur = fwds[0]
    assert len(set(cands)) == len(cands) and heur.kv_splits == 32
    assert {(fp.kv_blocksize, fp.num_stages, fp.kv_splits) for fp in fwds} >= {
        (128, 3, 16), (128, 3, 64), (64, 3, 32), (64, 4, 32), (128, 2, 32)
    }  # fmt: skip
    assert all(fp.q_blocksize == 16 for fp in fwds)
    # and the heuristic's backward with its dQ keys split half and twice as many ways
    heur_b = cands[0][1]
    assert heur_b.kv_splits == 8
    assert {bp.kv_splits for _, bp in cands} == {4, 8, 16}


def test_decoding_heuristic_splits_keys_until_the_gpu_is_full():
    """Decoding calls take one q block a head (the folded group's rows, up to 128; more rows in
    at most 64 tiles of 128) and split the keys into runs of at least four blocks, until about 256
    programs run (128 of 128-row tiles); other calls split nothing."""

    def forward(batch, seq_q, seq_k, heads, kv_heads, dtype="bfloat16", head_dim=128, **spec_kw):
        spec = AttentionSpec(scale=0.1, **spec_kw)
        shape = AttentionShape(
            batch=batch, seq_q=seq_q, seq_k=seq_k, heads=heads, kv_heads=kv_heads,
            head_dim=head_dim, dtype=dtype, spec=spec,
        )  # fmt: skip
        p = tri.heuristic(shape)[0]
        return p.q_blocksize, p.kv_blocksize, p.kv_splits

    assert forward(1, 1, 32768, 32, 8, causal=True) == (16, 128, 32)  # 8 folded heads
    assert forward(1, 1, 2048, 32, 8) == (16, 128, 4)  # four blocks a run at least
    assert forward(4, 16, 16384, 32, 8) == (64, 128, 8)  # 64 folded rows
    assert forward(4, 16, 16384, 32, 8, causal=True) == (64, 128, 8)  # causal folds too
    assert forward(4, 32, 16384, 32, 8, causal=True) == (128, 128, 4)  # 128 rows: 32 tiles
    assert forward(1, 128, 32768, 32, 8, causal=True) == (128, 128, 4)  # 512 rows: per head
    assert forward(2, 65, 8192, 32, 8) == (128, 128, 2)  # 65 rows in a 128-row block
    assert forward(64, 1, 4096, 32, 8) == (16, 128, 1)  # 512 folded heads fill it already
    # float32 in one 16-row block up to head dim 128: 64-key blocks (four a run: 16 runs)
    assert forward(1, 1, 4096, 32, 8, dtype="float32") == (16, 64, 16)
    assert forward(1, 1, 4096, 32, 8, dtype="float32", head_dim=256) == (16, 32, 32)
    assert forward(1, 32, 4096, 32, 8, dtype="float32") == (32, 32, 8)  # 64-row blocks at most
    # float32 at head dim 256: 16-row blocks at most (64 spill 28 KB a thread), so a group of 4
    # folds and one of 8 (32 rows) does not
    assert forward(1, 4, 4096, 16, 4, dtype="float32", head_dim=256) == (16, 32, 32)
    assert forward(1, 4, 4096, 64, 8, dtype="float32", head_dim=256) == (16, 32, 4)
    # head dim 256: 64-row blocks at most, 64-key blocks
    assert forward(8, 1, 8192, 16, 8, head_dim=256) == (16, 64, 4)
    assert forward(2, 128, 16384, 16, 8, head_dim=256) == (64, 64, 4)
    assert forward(2, 4096, 4096, 16, 16)[2] == 1  # not decoding

    def float32_warps(head_dim: int, **spec_kw) -> int:
        shape = AttentionShape(
            batch=1, seq_q=32, seq_k=4096, heads=8, kv_heads=8, head_dim=head_dim,
            dtype="float32", spec=AttentionSpec(scale=0.1, **spec_kw),
        )  # fmt: skip
        return tri.heuristic(shape)[0].num_warps

    # float32 decoding takes the training forward's warps: 8 (4 at head dim 128 causal, and at 256)
    assert [float32_warps(d) for d in (64, 128, 256)] == [8, 8, 4]
    assert [float32_warps(d, causal=True) for d in (64, 128, 256)] == [8, 4, 4]
    one_block = AttentionShape(
        batch=1, seq_q=1, seq_k=4096, heads=8, kv_heads=8, head_dim=64, dtype="float32",
        spec=AttentionSpec(scale=0.1),
    )  # fmt: skip
    assert tri.heuristic(one_block)[0].num_warps == 4  # one 16-row block: 4 warps
    assert forward(1, 128, 512, 4, 4)[2] == 1  # fewer than 8 keys a row
    # more rows than a block, in at most 64 tiles of 128 rows: 128 programs
    assert forward(1, 256, 32768, 32, 8, causal=True) == (128, 128, 2)
    assert forward(1, 129, 65536, 4, 4) == (128, 128, 16)
    assert forward(1, 512, 32768, 32, 8, causal=True)[2] == 1  # 128 tiles: not decoding
    # up to 64 queries the backward keeps 16 rows and streams 64 keys on 4 warps;
    # its dQ kernel splits the keys as the forward does (16 tiles: 16 runs of 8 blocks)
    spec = AttentionSpec(scale=0.1, causal=True, window=(64, 0), has_bias=True, dropout_prob=0.1)
    shape = AttentionShape(
        batch=2, seq_q=2, seq_k=8192, heads=8, kv_heads=8, head_dim=128, dtype="bfloat16",
        spec=spec,
    )  # fmt: skip
    assert tri.heuristic(shape)[1] == BwdParams(
        q_blocksize=16, kv_blocksize=64, num_warps=4, num_stages=2, kv_splits=16
    )
    # more queries keep the training blocks; 32 dQ tiles of 128 rows split 4 ways
    shape = dataclasses.replace(
        shape, seq_q=128, heads=16, kv_heads=16, spec=AttentionSpec(scale=0.1)
    )
    assert tri.heuristic(shape)[1].kv_splits == 4
    assert tri.heuristic(dataclasses.replace(shape, seq_q=4096))[1].kv_splits == 1


def test_heuristic_params_under_vmap():
    """The heuristic's (large) blocks shrink to short sequences; vmap runs the callback per item."""
    args, dout, spec = _case("vmap", causal=True, heads=2, batch=1)
    q, k, v = args[:3]
    fp, bp = tri.heuristic(AttentionShape.of(q, k, spec))
    stack = lambda x: jnp.stack([x, 0.5 * x])

    def attend(q, k, v):
        return tri.fwd(q, k, v, None, None, None, None, None, spec=spec, params=fp)[0]

    out = jax.jit(jax.vmap(attend))(stack(q), stack(k), stack(v))
    reference = jax.jit(lambda q, k, v: reference_attention(q, k, v, spec=spec)[0])
    for i, scale in enumerate((1.0, 0.5)):
        want = reference(scale * q, scale * k, scale * v)
        _close(f"vmap[{i}]", out[i], want, TOL[jnp.float32])
    _check(args, dout, spec, fp=fp, bp=bp)


def test_fully_masked_rows_are_zero_with_finite_grads():
    args, dout, spec = _case("empty_rows", seq_q=48, seq_k=16, causal=True)
    q, k, v = args[:3]
    out, lse = tri.fwd(*args, spec=spec, params=FP)
    np.testing.assert_array_equal(np.asarray(out[:, :32]), 0.0)
    assert np.all(np.isneginf(np.asarray(lse[:, :, :32])))
    grads = tri.bwd(*args, out, lse, dout, spec=spec, params=BP)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads[:3])


def test_dropout_is_deterministic_and_seeded():
    args, _, spec = _case("dropout_seed", dropout=0.5)
    first = tri.fwd(*args, spec=spec, params=FP)[0]
    again = tri.fwd(*args, spec=spec, params=FP)[0]
    other = tri.fwd(*args[:7], args[7] + jnp.uint32(1), spec=spec, params=FP)[0]
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    assert not np.allclose(np.asarray(first), np.asarray(other))


def test_configs_fit_and_cover_the_heuristic():
    for seq, dim, dtype in ((100, 256, "float32"), (2048, 64, "float16"), (4096, 128, "bfloat16")):
        spec = AttentionSpec(scale=0.1, causal=True)
        shape = AttentionShape(
            batch=2, seq_q=seq, seq_k=seq, heads=8, kv_heads=2, head_dim=dim, dtype=dtype, spec=spec
        )
        heur = tri.heuristic(shape)
        cands = tri.candidates(shape)
        assert cands[0] == heur and len(set(cands)) == len(cands) > 1
        for fp, bp in cands[1:]:
            assert tri._fits(shape, fp, backward=False) and tri._fits(shape, bp, backward=True)
            assert fp.q_blocksize <= max(16, 1 << (seq - 1).bit_length())
    # the heuristic's backward with its dQ kernel on 1 and 2 of its 3 stages
    shallower = {bp.dq_num_stages for _, bp in cands if bp.dq_num_stages is not None}
    assert shallower == {1, 2} and heur[1].num_stages == 3
    # a 128 x 128 block pair with 4 stages of 128-wide head dims does not fit in shared memory
    big = FwdParams(q_blocksize=128, kv_blocksize=128, num_warps=8, num_stages=4)
    assert not tri._fits(shape, big, backward=False)


def test_registered_backend():
    backend = backend_for("triton", "triton")
    assert backend is tri.BACKEND and backend.fwd is tri.fwd and backend.bwd is tri.bwd
    assert backend.available()
    backend.check(AttentionSpec(scale=1.0, causal=True, dropout_prob=0.1, window=(1, 1)))


def test_clear_errors():
    args, _, spec = _case("errors", seq_q=16, seq_k=16, batch=1, heads=1)
    with pytest.raises(ValueError, match="power of two"):
        tri.fwd(*args, spec=spec, params=FwdParams(q_blocksize=24, kv_blocksize=16))
    q, k, v = args[:3]
    with pytest.raises(TypeError, match="one dtype"):
        tri.fwd(q, k.astype(jnp.bfloat16), v, *args[3:], spec=spec, params=FP)
    wide = jnp.ones((1, 16, 1, 512), jnp.float32)
    with pytest.raises(NotImplementedError, match="head dims"):
        tri.fwd(wide, wide, wide, *args[3:], spec=spec, params=FP)
    with pytest.raises(ValueError, match="dropout seed"):
        tri.fwd(*args, spec=AttentionSpec(scale=1.0, dropout_prob=0.5), params=FP)
    out, lse = tri.fwd(*args, spec=spec, params=FP)
    with pytest.raises(ValueError, match="kv_splits=0"):
        FwdParams(kv_splits=0)
    with pytest.raises(ValueError, match="variant='mosaic'"):
        tri.bwd(*args, out, lse, q, spec=spec, params=BwdParams(variant="mosaic"))
    # This process interprets; asking for compiled kernels says how to fix it.
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        import_triton(False)
