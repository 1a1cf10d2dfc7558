"""The Pallas attention kernels checked directly against the dense reference.

On the CPU the Triton-lowering and Mosaic-TPU kernels run in Pallas's interpreter (small shapes); the
GPU and TPU lowerings are checked by lowering for "cuda"/"tpu" against an abstract device, which runs
the whole Pallas-to-Triton/Mosaic lowering without a chip.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from ejkfn._registry import BwdParams, FwdParams
from ejkfn.attention import _pallas_gpu, _pallas_mosaic, _pallas_mosaic_bwd, _pallas_tpu
from ejkfn.attention._backend import (
    MIRRORED,
    MIRRORED_HALF,
    MIRRORED_WIDE,
    PORTABLE_VARIANTS,
    SPLIT_DKDV,
    TALL_DQ,
    AttentionShape,
    backend_for,
)
from ejkfn.attention._mosaic_grid import Rounds, SplitTail, order_band, split_index
from ejkfn.attention._reference import reference_attention
from ejkfn.attention._spec import AttentionSpec

from ._segments import segment_ids

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)

# The dense reference, jitted: eagerly, each of its operations would compile on its own.
_reference = jax.jit(reference_attention, static_argnames="spec")

# max |got - want| / max |want|, per dtype (inputs are rounded to the dtype before the f32 reference)
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2.5e-2, jnp.float16: 4e-3}


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 1
    seq_q: int = 64
    seq_k: int = 64
    heads: int = 2
    kv_heads: int = 2
    dim: int = 32
    dtype: type = jnp.float32
    causal: bool = False
    window: tuple[int, int] | None = None
    cap: float | None = None
    bias: tuple[int, int] | None = None  # (batch|1, heads|1) of the bias
    mask: tuple[int, int] | None = None
    segments: bool | str = False  # a layout of tests/_segments.py
    dropout: float = 0.0
    scale: float | None = None  # default 1 / sqrt(dim)

    @property
    def spec(self) -> AttentionSpec:
        return AttentionSpec(
            scale=float(self.dim) ** -0.5 if self.scale is None else self.scale,
            causal=self.causal,
            window=self.window,
            soft_cap=self.cap,
            dropout_prob=self.dropout,
            has_bias=self.bias is not None,
            has_mask=self.mask is not None,
            has_segments=bool(self.segments),
        )


def _abstract_inputs(case: Case) -> dict:
    """The shapes and dtypes of ``case``'s inputs (what lowering needs), nothing drawn."""
    b, sq, sk = case.batch, case.seq_q, case.seq_k
    sds = jax.ShapeDtypeStruct
    q = sds((b, sq, case.heads, case.dim), case.dtype)
    kv = sds((b, sk, case.kv_heads, case.dim), case.dtype)
    x = dict(q=q, k=kv, v=kv, dout=q)
    x["bias"] = None if case.bias is None else sds((*case.bias, sq, sk), jnp.float32)
    x["mask"] = None if case.mask is None else sds((*case.mask, sq, sk), jnp.bool_)
    x["q_seg"] = sds((b, sq), jnp.int32) if case.segments else None
    x["kv_seg"] = sds((b, sk), jnp.int32) if case.segments else None
    x["seed"] = sds((), jnp.uint32) if case.dropout else None
    return x


def _inputs(case: Case, seed: int) -> dict:
    """Random inputs for ``case``, drawn with NumPy: eager ``jax.random`` calls compile anew for
    every shape, about a second a case."""
    rng = np.random.default_rng(seed)

    def draw(name, like):
        if like is None:
            return None
        if name == "mask":
            return jnp.asarray(rng.random(like.shape) < 0.75)
        if name == "seed":
            return jnp.uint32(987654321)
        x = rng.standard_normal(like.shape, np.float32).astype(jnp.dtype(case.dtype))
        return jnp.asarray((2.0 * x.astype(np.float32)) if name == "bias" else x)

    drawn = {name: draw(name, like) for name, like in _abstract_inputs(case).items()}
    if case.segments:
        drawn["q_seg"], drawn["kv_seg"] = segment_ids(
            rng, case.segments, case.batch, case.seq_q, case.seq_k
        )
    return drawn


def _err(got, want) -> float:
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    assert got.shape == want.shape
    assert np.all(np.isfinite(got)), "non-finite values"
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))


def _check(module, case: Case, fp, bp, seed: int = 0) -> None:
    x = _inputs(case, seed)
    spec = case.spec
    args = [x[n] for n in ("q", "k", "v", "bias", "mask", "q_seg", "kv_seg", "seed")]
    out, lse = jax.jit(functools.partial(module.fwd, spec=spec, params=fp))(*args)
    assert out.dtype == case.dtype and lse.dtype == jnp.float32
    assert lse.shape == (case.batch, case.heads, case.seq_q)

    @jax.jit
    def ref(q, k, v, bias, dout):
        def f(q, k, v, bias):
            return reference_attention(q, k, v, bias, *args[4:], spec=spec)

        (out, lse), vjp = jax.vjp(f, q, k, v, bias)
        return out, lse, vjp((dout.astype(jnp.float32), jnp.zeros_like(lse)))

    want_out, want_lse, want = ref(*args[:4], x["dout"])
    tol = TOL[case.dtype]
    assert _err(out, want_out) < tol
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], atol=1e-2)

    grads = jax.jit(functools.partial(module.bwd, spec=spec, params=bp))(*args, out, lse, x["dout"])
    names = ("dq", "dk", "dv", "dbias")
    for name, got, exp, like in zip(names, grads, want, args[:4], strict=True):
        if like is None:
            assert got is None
            continue
        assert got.shape == like.shape and got.dtype == like.dtype, name
        assert _err(got, exp) < 2 * tol, name


# ----------------------------------------------------------------------------------------------------
# Triton lowering, run in the interpreter.

SMALL_FWD = FwdParams(q_blocksize=32, kv_blocksize=16)
SMALL_BWD = BwdParams(q_blocksize=16, kv_blocksize=32)

TRITON_CASES = {
    "plain": Case(batch=2),
    "causal_gqa_ragged": Case(seq_q=100, seq_k=100, heads=4, kv_heads=2, causal=True),
    "causal_q_shorter": Case(seq_q=40, seq_k=72, causal=True, heads=3, kv_heads=1),
    "causal_q_longer": Case(seq_q=72, seq_k=40, causal=True),  # early rows see nothing
    "window_causal": Case(seq_q=96, seq_k=96, causal=True, window=(20, 0)),
    "window_two_sided": Case(seq_q=70, seq_k=90, window=(9, 13)),
    "segments_mask": Case(batch=2, segments=True, mask=(2, 1), causal=True),
    # whole blocks skipped by the segments' spans (blocks of 16 and 32 over 160 rows)
    "segments_packed_causal_gqa": Case(segments="packed", causal=True, seq_q=160, seq_k=160,
                                       heads=4, kv_heads=2),
    "segments_packed_ragged": Case(batch=2, segments="packed", seq_q=90, seq_k=150),
    "segments_interleaved": Case(segments="interleaved", seq_q=96, seq_k=80),
    "segments_unmatched_causal": Case(segments="unmatched", causal=True, seq_q=128, seq_k=128),
    "bias_softcap_d80": Case(dim=80, bias=(1, 2), cap=4.0, seq_q=48, seq_k=80),
    "bias_full_gqa": Case(batch=2, heads=4, kv_heads=2, bias=(2, 4), window=(16, 16)),
    "dropout": Case(dropout=0.25, causal=True, heads=4, kv_heads=2, bias=(1, 1)),
    "bf16_causal_d64": Case(dtype=jnp.bfloat16, dim=64, causal=True, seq_q=128, seq_k=128),
    "f16_d128": Case(dtype=jnp.float16, dim=128, seq_q=40, seq_k=56, heads=2, kv_heads=1),
    # the row max of raw products is then the min, and exp2 of the shifted scores overflows
    "scale_negative": Case(scale=-5.0),
    # the forward's grid: 40 (batch, head) pairs in causal bands of 10
    "causal_bands_gqa": Case(batch=2, heads=20, kv_heads=10, dim=16, seq_q=48, seq_k=48,
                             causal=True),
}  # fmt: skip


@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_matches_reference(name):
    _check(_pallas_gpu, TRITON_CASES[name], SMALL_FWD, SMALL_BWD)


@pytest.mark.parametrize(
    "name", ["causal_gqa_ragged", "causal_q_shorter", "segments_mask", "bias_full_gqa", "dropout"]
)
@pytest.mark.parametrize(
    "variant, kv_block",
    [(MIRRORED, 32), (MIRRORED_HALF, 64), (MIRRORED_WIDE, 32), (TALL_DQ, 32), (SPLIT_DKDV, 32)],
)
def test_triton_mirrored_backward_matches_reference(name, variant, kv_block):
    """dQ with the dK/dV kernel's blocks turned around (32 rows kept, 16 streamed; with
    mirrored_half half of the dK/dV kernel's 64; with mirrored_wide 32 streamed; tall_dq keeps
    32 rows of the dK/dV kernel's 16 and streams its 32; split_dkdv as mirrored, with dV and dK
    from programs of their own): ragged lengths pad to other multiples in the two kernels, and
    dbias comes from the dQ kernel's blocks."""
    bp = BwdParams(q_blocksize=16, kv_blocksize=kv_block, variant=variant)
    _check(_pallas_gpu, TRITON_CASES[name], SMALL_FWD, bp)


@pytest.mark.parametrize("name", ["bias_softcap_d80", "bf16_causal_d64", "window_two_sided"])
def test_triton_split_dkdv_backward(name):
    """dV and dK from programs of their own, with a soft cap's derivative, in 16 bits (one
    stacked output in the inputs' dtype) and across a two-sided window's edges."""
    bp = BwdParams(q_blocksize=16, kv_blocksize=32, variant=SPLIT_DKDV)
    _check(_pallas_gpu, TRITON_CASES[name], SMALL_FWD, bp)


def test_triton_default_params_and_custom_vjp():
    """Heuristic params, and jax.grad through a custom_vjp made of fwd/bwd."""
    case = Case(seq_q=64, seq_k=64, causal=True, heads=2, kv_heads=1)
    x = _inputs(case, 1)
    spec = case.spec
    fp, bp = _pallas_gpu.heuristic(AttentionShape.of(x["q"], x["k"], spec))

    @jax.custom_vjp
    def attn(q, k, v):
        return _pallas_gpu.fwd(q, k, v, spec=spec, params=fp)[0]

    def attn_fwd(q, k, v):
        out, lse = _pallas_gpu.fwd(q, k, v, spec=spec, params=fp)
        return out, (q, k, v, out, lse)

    def attn_bwd(res, dout):
        q, k, v, out, lse = res
        dq, dk, dv, _ = _pallas_gpu.bwd(
            q, k, v, None, None, None, None, None, out, lse, dout, spec=spec, params=bp
        )
        return dq, dk, dv

    attn.defvjp(attn_fwd, attn_bwd)

    def loss(f, q, k, v):
        return jnp.sum(f(q, k, v) * x["dout"])

    got = jax.jit(jax.grad(functools.partial(loss, attn), argnums=(0, 1, 2)))(
        x["q"], x["k"], x["v"]
    )
    ref = functools.partial(lambda q, k, v: reference_attention(q, k, v, spec=spec)[0])
    want = jax.jit(jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2)))(
        x["q"], x["k"], x["v"]
    )
    for a, b in zip(got, want, strict=True):
        assert _err(a, b) < 4e-5


def test_triton_vmap():
    case = Case(seq_q=32, seq_k=48, causal=True)
    xs = [_inputs(case, s) for s in (3, 4)]
    q, k, v = (jnp.stack([x[n] for x in xs]) for n in ("q", "k", "v"))
    f = functools.partial(_pallas_gpu.fwd, spec=case.spec, params=SMALL_FWD)
    out, lse = jax.jit(jax.vmap(f))(q, k, v)
    for i in range(2):
        want, want_lse = _reference(xs[i]["q"], xs[i]["k"], xs[i]["v"], spec=case.spec)
        assert _err(out[i], want) < 2e-5
        assert _err(lse[i], want_lse) < 2e-5


# ----------------------------------------------------------------------------------------------------
# Lowering for real chips, without one.

H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
TPU_V5E = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")


def _lower(
    module, case: Case, device, platform: str, fp=None, bp=None, fwd=True, bwd=True
) -> str | None:
    """Lower fwd and bwd of ``module`` for ``platform`` (or one of them: a lowering takes seconds);
    returns the fwd module text."""
    x = _abstract_inputs(case)
    args = [x[n] for n in ("q", "k", "v", "bias", "mask", "q_seg", "kv_seg", "seed")]
    spec = case.spec
    f = functools.partial(module.fwd, spec=spec, params=fp, interpret=False)
    b = functools.partial(module.bwd, spec=spec, params=bp, interpret=False)
    mesh = AbstractMesh((1,), ("x",), abstract_device=device)
    text = None
    with use_abstract_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if fwd:
            text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        if bwd:
            out = x["q"]
            lse = jax.ShapeDtypeStruct((case.batch, case.heads, case.seq_q), jnp.float32)
            jax.jit(b).trace(*args, out, lse, out).lower(lowering_platforms=(platform,))
    return text


ALL_FEATURES = dict(
    causal=True,
    window=(256, 8),
    cap=30.0,
    bias=(2, 1),
    mask=(1, 8),
    segments=True,
    dropout=0.1,
)
LOWER_CASES = {
    "bf16_d128_causal": Case(batch=2, seq_q=2048, seq_k=2048, heads=8, kv_heads=8, dim=128,
                             dtype=jnp.bfloat16, causal=True),
    "bf16_d128_all_features_gqa": Case(batch=2, seq_q=1000, seq_k=1100, heads=8, kv_heads=2,
                                       dim=128, dtype=jnp.bfloat16, **ALL_FEATURES),
    "f16_d256": Case(seq_q=512, seq_k=512, heads=4, kv_heads=4, dim=256, dtype=jnp.float16),
    "f32_d96_window": Case(seq_q=300, seq_k=300, heads=4, kv_heads=1, dim=96, window=(32, 32)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LOWER_CASES))
def test_triton_lowers_for_cuda(name):
    case = LOWER_CASES[name]
    fp, bp = _pallas_gpu.heuristic(AttentionShape.of(
        jax.ShapeDtypeStruct((case.batch, case.seq_q, case.heads, case.dim), case.dtype),
        jax.ShapeDtypeStruct((case.batch, case.seq_k, case.kv_heads, case.dim), case.dtype),
        case.spec,
    ))  # fmt: skip
    text = _lower(_pallas_gpu, case, H100, "cuda", fp, bp)
    assert "__gpu$xla.gpu.triton" in text


def test_triton_exp2_is_ptx_only_when_compiled_for_nvidia(monkeypatch):
    # jnp.exp2 lowers to libdevice's exp2f, which ran the kernels 4-10% slower than PTX's own
    # ex2.approx; the interpreter (and a GPU that is not NVIDIA's) has no PTX, so keeps jnp.exp2.
    case = LOWER_CASES["bf16_d128_causal"]
    for nvidia in (False, True):
        monkeypatch.setattr(_pallas_gpu, "_on_nvidia_gpu", lambda nvidia=nvidia: nvidia)
        text = _lower(_pallas_gpu, case, H100, "cuda", bwd=False)
        assert ("ex2.approx.ftz.f32" in text) == nvidia
    x = jnp.zeros((1, 64, 1, 32))
    spec = AttentionSpec(scale=0.1, causal=True)
    assert not _pallas_gpu._geom(x, x, None, None, spec, 64, 64, interpret=True).ptx_exp2


def test_triton_exponent_fuses_its_multiply_add_in_ptx(monkeypatch):
    # XLA's build left a multiply and an add where Triton's fuses them; one PTX fma fixes that
    # where it measured faster: the forward at head dims up to 64 (and the backward everywhere)
    for dim, fused in ((64, True), (128, False)):
        case = dataclasses.replace(LOWER_CASES["bf16_d128_causal"], dim=dim)
        for nvidia in (False, True):
            monkeypatch.setattr(_pallas_gpu, "_on_nvidia_gpu", lambda nvidia=nvidia: nvidia)
            text = _lower(_pallas_gpu, case, H100, "cuda", bwd=False)
            assert ("fma.rn.f32" in text) == (nvidia and fused), (dim, nvidia)


def test_triton_configs_fit():
    spec = AttentionSpec(scale=0.1, causal=True)
    # float32 at D=128: the heuristic's 16-bit blocks shrink until they fit
    cases = ((4096, 128, "bfloat16"), (40, 64, "float16"), (2048, 256, "float32"))
    for s, d, dtype in (*cases, (8192, 128, "float32")):
        shape = AttentionShape(
            batch=2, seq_q=s, seq_k=s, heads=8, kv_heads=8, head_dim=d, dtype=dtype, spec=spec
        )
        cands = _pallas_gpu.candidates(shape)
        assert cands and cands[0] == _pallas_gpu.heuristic(shape)
        assert len(set(cands)) == len(cands)
        for fp, bp in cands:
            assert _pallas_gpu._fits(shape, fp, bp)
            for p in (fp, bp):
                assert p.q_blocksize <= max(16, 1 << (s - 1).bit_length())
    # bias and mask tiles are pipelined too: the 16-bit heuristic's backward at D=128 asked for
    # 257 KiB of shared memory with a float32 bias on an H200 (227 KiB there)
    plain = AttentionShape(
        batch=2, seq_q=1024, seq_k=1024, heads=8, kv_heads=4, head_dim=128, dtype="bfloat16",
        spec=spec,
    )  # fmt: skip
    biased = dataclasses.replace(plain, spec=dataclasses.replace(spec, has_bias=True))
    bp = _pallas_gpu.heuristic(plain)[1]
    assert (bp.q_blocksize, bp.kv_blocksize, bp.num_stages, bp.variant) == (64, 128, 3, MIRRORED)
    assert not _pallas_gpu._fits_pass(biased, bp, backward=True)
    # where they would keep one stage, smaller blocks keep three (1.15-1.21x them on an H200)
    bp = _pallas_gpu.heuristic(biased)[1]
    assert (bp.q_blocksize, bp.kv_blocksize, bp.num_stages, bp.variant) == (64, 64, 3, None)
    assert _pallas_gpu._fits_pass(biased, bp, backward=True)
    small = AttentionShape(
        batch=1, seq_q=20, seq_k=20, heads=1, kv_heads=1, head_dim=64, dtype="bfloat16", spec=spec
    )
    assert all(p.kv_blocksize <= 32 for c in _pallas_gpu.candidates(small) for p in c)
    with pytest.raises(ValueError, match="power of two"):
        x = jnp.zeros((1, 64, 1, 32))
        _pallas_gpu.fwd(x, x, x, spec=spec, params=FwdParams(q_blocksize=48))


@pytest.mark.parametrize(
    ("options", "wide"),
    [
        ({}, True),
        (dict(has_mask=True), True),  # without causal 0.98x the 64 x 64 blocks
        (dict(has_mask=True, causal=True), False),
        (dict(has_segments=True), True),  # not measured without causal
        (dict(has_segments=True, causal=True), False),
        (dict(dropout_prob=0.1, causal=True), False),
        (dict(has_bias=True), False),
        (dict(soft_cap=30.0, causal=True), False),
        (dict(window=(256, 256)), False),
    ],
)
def test_head_dim_64_backward_blocks_with_a_feature(options, wide):
    """At head dim 64 the backward keeps mirrored_wide blocks, but takes 64 x 64 on 4 warps with
    the features that ran faster on them (a bias, a soft cap, a window; when causal also a mask,
    segment ids or dropout)."""
    spec = AttentionSpec(scale=0.125, **options)
    shape = AttentionShape(
        batch=8, seq_q=2048, seq_k=2048, heads=32, kv_heads=8, head_dim=64, dtype="bfloat16",
        spec=spec,
    )  # fmt: skip
    bp = _pallas_gpu.heuristic(shape)[1]
    got = (bp.q_blocksize, bp.kv_blocksize, bp.num_warps, bp.num_stages, bp.variant)
    assert got == ((32, 128, 4, 3, MIRRORED_WIDE) if wide else (64, 64, 4, 3, None))


@pytest.mark.parametrize(
    "options",
    [{}, dict(has_mask=True), dict(has_mask=True, causal=True), dict(has_bias=True, causal=True)],
)
def test_head_dim_128_keeps_three_stages_with_a_bias_or_mask(options):
    """At head dim 128 in bf16 the mirrored backward keeps 3 stages with a mask, and the forward
    with a bias: their tiles take 2 buffers on 3 stages, as Triton pipelines them, which fits
    (counted at 3 the heuristic fell to 2 stages, which ran 0.82-0.91x)."""
    spec = AttentionSpec(scale=0.088, **options)
    shape = AttentionShape(
        batch=4, seq_q=4096, seq_k=4096, heads=16, kv_heads=16, head_dim=128, dtype="bfloat16",
        spec=spec,
    )  # fmt: skip
    fp, bp = _pallas_gpu.heuristic(shape)
    assert fp.num_stages == 3
    assert bp.num_stages == 3 and bp.dq_num_stages is None
    assert bp.variant == (None if spec.has_bias else MIRRORED)


# ----------------------------------------------------------------------------------------------------
# Mosaic TPU, run in the interpreter (kv blocks are lane-sized: 128).

TPU_FWD = FwdParams(q_blocksize=64, kv_blocksize=128)
TPU_BWD = BwdParams(q_blocksize=32, kv_blocksize=128)

TPU_CASES = {
    "causal_gqa_ragged": Case(seq_q=300, seq_k=270, heads=4, kv_heads=2, causal=True),
    "window_bias_softcap": Case(batch=2, seq_q=200, seq_k=300, heads=2, kv_heads=1, causal=True,
                                window=(40, 7), bias=(2, 1), cap=3.0),
    "segments_mask_dropout": Case(batch=2, segments=True, mask=(1, 2), dropout=0.2),
    "q_longer_bf16": Case(seq_q=160, seq_k=96, causal=True, dtype=jnp.bfloat16, dim=64),
    # whole blocks skipped by the segments' spans (kv blocks of 128 over 384 keys)
    "segments_packed_causal_gqa": Case(segments="packed", causal=True, seq_q=384, seq_k=384,
                                       heads=4, kv_heads=2),
    "segments_packed_ragged_bias": Case(batch=2, segments="packed", seq_q=200, seq_k=330,
                                        bias=(2, 1)),
    "segments_interleaved": Case(segments="interleaved", seq_q=192, seq_k=256),
    "segments_unmatched_causal": Case(segments="unmatched", causal=True, seq_q=256, seq_k=256),
}  # fmt: skip


@pytest.mark.parametrize("name", list(TPU_CASES))
def test_tpu_matches_reference(name):
    _check(_pallas_tpu, TPU_CASES[name], TPU_FWD, TPU_BWD)


def test_tpu_lowers_for_tpu():
    case = LOWER_CASES["bf16_d128_all_features_gqa"]
    text = _lower(_pallas_tpu, case, TPU_V5E, "tpu")
    assert "tpu_custom_call" in text
    _lower(_pallas_tpu, LOWER_CASES["bf16_d128_causal"], TPU_V5E, "tpu")


def test_tpu_block_rules():
    spec = AttentionSpec(scale=0.1)
    x = jnp.zeros((1, 300, 1, 32))
    with pytest.raises(ValueError, match="multiple of 128"):
        _pallas_tpu.fwd(x, x, x, spec=spec, params=FwdParams(q_blocksize=64, kv_blocksize=64))
    shape = AttentionShape.of(jnp.zeros((1, 4096, 8, 128)), jnp.zeros((1, 4096, 8, 128)), spec)
    for fp, bp in _pallas_tpu.candidates(shape):
        for p in (fp, bp):
            assert p.q_blocksize % 8 == 0 and p.kv_blocksize % 128 == 0


# ----------------------------------------------------------------------------------------------------
# Mosaic GPU (Hopper): forward and backward in Mosaic GPU's interpreter, lowering for CUDA, refusals.

MOSAIC_CASES = {
    "bf16_d128_causal_gqa": Case(batch=2, seq_q=1024, seq_k=1024, heads=8, kv_heads=2, dim=128,
                                 dtype=jnp.bfloat16, causal=True),
    "f16_d64": Case(batch=1, seq_q=512, seq_k=512, heads=4, kv_heads=4, dim=64,
                    dtype=jnp.float16),
}  # fmt: skip


@pytest.mark.parametrize(
    "case, q_rows",
    [
        (Case(seq_q=128, seq_k=192, heads=2, kv_heads=1, dim=64, dtype=jnp.float16, causal=True),
         128),
        (Case(seq_q=200, seq_k=100, dim=80, dtype=jnp.bfloat16, causal=True), 128),  # empty rows
        (Case(seq_q=128, seq_k=128, dim=64, dtype=jnp.bfloat16, scale=-20.0), 128),  # max turns
        # 256 query rows: two CTAs in a cluster, each key/value block multicast to both
        (Case(seq_q=256, seq_k=192, heads=2, kv_heads=1, dim=64, dtype=jnp.float16, causal=True),
         256),
        (Case(seq_q=200, seq_k=256, dim=64, dtype=jnp.bfloat16), 256),  # the second CTA: padding
        # 512: four CTAs; the causal union spans all four's diagonals, keys shorter than queries
        (Case(seq_q=512, seq_k=448, heads=2, kv_heads=1, dim=64, dtype=jnp.float16, causal=True),
         512),
        # Windows: a left edge, unmasked blocks between, the diagonal; narrower than a block
        # (both edges in one); both sides; rows that see no key (queries past the keys' reach)
        (Case(seq_q=448, seq_k=448, heads=2, kv_heads=1, dim=64, dtype=jnp.float16, causal=True,
              window=(150, 0)), 128),
        (Case(seq_q=320, seq_k=384, dim=64, dtype=jnp.bfloat16, causal=True, window=(40, 7)), 128),
        (Case(seq_q=384, seq_k=384, dim=80, dtype=jnp.bfloat16, window=(70, 130)), 128),
        (Case(seq_q=384, seq_k=200, dim=64, dtype=jnp.float16, window=(20, 0)), 128),
        (Case(seq_q=512, seq_k=512, heads=2, kv_heads=1, dim=64, dtype=jnp.float16, causal=True,
              window=(200, 0)), 256),
    ],
    ids=[
        "f16_causal_gqa", "bf16_d80_q_longer", "bf16_negative_scale", "cluster_f16_causal_gqa",
        "cluster_bf16_q_shorter", "cluster4_f16_causal_gqa", "window_causal_gqa",
        "window_narrow_q_shorter", "window_both_sides_d80", "window_empty_rows",
        "cluster_window_causal_gqa",
    ],
)  # fmt: skip
def test_mosaic_forward_in_gpu_interpreter(case, q_rows):
    """Mosaic GPU's interpreter simulates the warpgroups, barriers and TMA copies (slow: tiny)."""
    x = _inputs(case, 2)
    params = FwdParams(q_blocksize=q_rows, kv_blocksize=64, num_stages=2)
    out, lse = _pallas_mosaic.fwd(x["q"], x["k"], x["v"], spec=case.spec, params=params)
    want, want_lse = _reference(x["q"], x["k"], x["v"], spec=case.spec)
    assert _err(out, want) < TOL[case.dtype]
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], atol=1e-3)


def _assert_forward_option_changes_nothing(case: Case, q_rows: int, seed: int, option: str) -> None:
    """The Mosaic forward in the interpreter gives the same numbers with its private ``option`` on
    and off, and they match the reference."""
    x = _inputs(case, seed)
    params = FwdParams(q_blocksize=q_rows, kv_blocksize=64, num_stages=2)
    on, off = (
        _pallas_mosaic._forward(
            x["q"], x["k"], x["v"], spec=case.spec, params=params, interpret=True, **{option: value}
        )
        for value in (True, False)
    )
    for a, b in zip(on, off, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want, _ = _reference(x["q"], x["k"], x["v"], spec=case.spec)
    assert _err(on[0], want) < TOL[case.dtype]


def test_mosaic_cluster_forward_one_cluster_a_tile():
    """Clusters of two CTAs (the heuristic's forward causal from ONE_TILE_CAUSAL_KEYS keys) on the
    grid of one cluster a tile give what they give on the persistent grid, several tiles a
    cluster in the interpreter."""
    case = Case(seq_q=768, seq_k=768, heads=2, kv_heads=1, dim=64, dtype=jnp.float16, causal=True)
    _assert_forward_option_changes_nothing(case, 256, 4, "persistent")


def test_mosaic_forward_grid_and_cluster_choice():
    """Causal from ONE_TILE_CAUSAL_KEYS keys the forward runs one cluster of two CTAs a tile; else
    the persistent grid, one CTA a tile of it. The tuner sees both tile heights."""
    keys = _pallas_mosaic.ONE_TILE_CAUSAL_KEYS

    def shape(seq, causal, d=128):
        return AttentionShape(
            batch=1, seq_q=seq, seq_k=seq, heads=16, kv_heads=16, head_dim=d, dtype="bfloat16",
            spec=AttentionSpec(scale=0.1, causal=causal),
        )  # fmt: skip

    for seq, causal, one_tile in (
        (keys, True, True), (4 * keys, True, True), (keys // 2, True, False), (keys, False, False),
    ):  # fmt: skip
        assert _pallas_mosaic.forward_persistent(causal, seq) is not one_tile
        for d in (64, 128):
            fp = _pallas_mosaic.heuristic(shape(seq, causal, d))[0]
            assert fp.q_blocksize == (256 if one_tile else 128)
            cands = _pallas_mosaic.candidates(shape(seq, causal, d))
            assert {f.q_blocksize for f, _ in cands} == {128, 256}
            assert len(cands) == len(set(cands))


def test_mosaic_forward_takes_narrower_key_blocks_for_a_narrow_window():
    """A window of at most NARROW_WINDOW_BLOCKS' keys runs on its key blocks and ring (fewer keys
    in masked edge blocks); a wider window, no window, or a head dim without an entry keeps the
    plain blocks."""

    def blocks(d, window, causal=True):
        spec = AttentionSpec(scale=0.1, causal=causal, window=window)
        shape = AttentionShape(
            batch=1, seq_q=8192, seq_k=8192, heads=4, kv_heads=4, head_dim=d, dtype="bfloat16",
            spec=spec,
        )  # fmt: skip
        fp = _pallas_mosaic.heuristic(shape)[0]
        return fp.kv_blocksize, fp.num_stages

    assert blocks(64, None) == (256, 2) == blocks(64, (2049, 0)) == blocks(64, (1100, 1100), False)
    assert blocks(64, (2048, 0)) == (128, 2) == blocks(64, (100, 40), False)
    assert blocks(128, None) == (128, 2) == blocks(128, (257, 0)) == blocks(128, (128, 129), False)
    assert blocks(128, (256, 0)) == (64, 4) == blocks(128, (128, 128), False)
    assert blocks(256, (64, 0)) == blocks(256, None)
    for d, (_, bk, slots) in _pallas_mosaic.NARROW_WINDOW_BLOCKS.items():
        assert _pallas_mosaic._smem_bytes(d, bk, slots) <= _pallas_mosaic._SMEM_LIMIT


def test_mosaic_forward_copy_loop_on_one_warp_or_four():
    """The ring's copy loop run by one warp of the memory warpgroup (the default) or by all four
    gives the same numbers (in the interpreter, which runs both paths of the copies' arrivals)."""
    case = Case(seq_q=128, seq_k=192, heads=2, kv_heads=1, dim=64, dtype=jnp.float16, causal=True)
    _assert_forward_option_changes_nothing(case, 128, 3, "one_memory_warp")


@pytest.mark.parametrize("name", list(MOSAIC_CASES))
def test_mosaic_lowers_for_cuda(name):
    """The forward lowers for a Hopper GPU, its ping-pong turns on hardware barriers of both
    compute warpgroups (the interpreter, which the other tests run, takes mbarriers instead)."""
    text = _lower(_pallas_mosaic, MOSAIC_CASES[name], H100, "cuda")
    assert "mosaic_gpu" in text
    assert "bar.arrive $0, 256;" in text and "bar.sync $0, 256;" in text


def test_mosaic_forward_with_cudnn_backward(monkeypatch):
    """``BwdParams(variant="cudnn")``: cuDNN's backward kernel on the Mosaic forward's residuals.
    It lowers for CUDA to cuDNN's backward call alone (no forward rerun); the interpreter, a CPU,
    masks and mismatched causal lengths are refused by name; the tuner gets it only where cuDNN runs."""
    from ejkfn.attention import _cudnn

    case = MOSAIC_CASES["bf16_d128_causal_gqa"]
    x = _abstract_inputs(case)
    q, k, v = x["q"], x["k"], x["v"]
    lse = jax.ShapeDtypeStruct((case.batch, case.heads, case.seq_q), jnp.float32)
    cudnn_bwd = BwdParams(variant=_pallas_mosaic.CUDNN_BWD)
    nothing = (None,) * 5  # bias, mask, segment ids, seed

    def bwd(q, k, v, out, lse, do, spec=case.spec, interpret=False):
        return _pallas_mosaic.bwd(
            q, k, v, *nothing, out, lse, do, spec=spec, params=cudnn_bwd, interpret=interpret
        )

    with pytest.raises(NotImplementedError, match="interpreter"):
        jax.eval_shape(functools.partial(bwd, interpret=True), q, k, v, q, lse, q)
    with pytest.raises(NotImplementedError, match="CUDA GPU"):
        jax.eval_shape(bwd, q, k, v, q, lse, q)
    monkeypatch.setattr(_cudnn, "_on_cuda", lambda: True)
    text = jax.jit(bwd).trace(q, k, v, q, lse, q).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "cudnn$" in line]
    assert len(calls) == 1 and "Backward" in calls[0], calls
    # A window rides on cuDNN's causal mask, as its own forward takes it: keys seen, own included
    for window in ((100, 0), (100, 20)):
        windowed = dataclasses.replace(case.spec, window=window)
        text = (
            jax.jit(functools.partial(bwd, spec=windowed))
            .trace(q, k, v, q, lse, q)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        assert "\\22sliding_window_length\\22: 101" in text and "CAUSAL" in text.upper(), window
    looks_right = dataclasses.replace(case.spec, causal=False, window=(100, 20))
    with pytest.raises(NotImplementedError, match="right of the diagonal"):
        jax.eval_shape(functools.partial(_cudnn.residual_bwd, spec=looks_right), q, k, v, q, lse, q)
    masked = dataclasses.replace(case.spec, has_mask=True)
    with pytest.raises(NotImplementedError, match="causal, unmasked or sliding-window"):
        jax.eval_shape(functools.partial(_cudnn.residual_bwd, spec=masked), q, k, v, q, lse, q)
    shorter = jax.ShapeDtypeStruct((case.batch, case.seq_q // 2, case.heads, case.dim), q.dtype)
    with pytest.raises(NotImplementedError, match="needs seq_q == seq_k"):
        jax.eval_shape(
            functools.partial(_cudnn.residual_bwd, spec=case.spec),
            shorter, k, v, shorter, lse, shorter,
        )  # fmt: skip

    def cudnn_candidates(seq_q: int, available: bool) -> list[BwdParams]:
        monkeypatch.setattr(_cudnn, "available", lambda: available)
        q = jax.ShapeDtypeStruct((1, seq_q, 4, 128), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
        shape = AttentionShape.of(q, k, case.spec)
        return [bp for _, bp in _pallas_mosaic.candidates(shape) if bp == cudnn_bwd]

    assert cudnn_candidates(1024, True) == [cudnn_bwd]
    assert cudnn_candidates(512, True) == []  # causal: cuDNN aligns the diagonal top-left
    assert cudnn_candidates(1024, False) == []


def test_mosaic_cluster_forward_lowers_for_cuda():
    def lowered(q_rows: int) -> str:
        fp = FwdParams(q_blocksize=q_rows, kv_blocksize=128, num_stages=2)
        case = MOSAIC_CASES["bf16_d128_causal_gqa"]
        return _lower(_pallas_mosaic, case, H100, "cuda", fp=fp, bwd=False)

    assert "gpu.cluster_block_id" in lowered(256)
    assert "gpu.cluster_block_id" in lowered(512)  # four CTAs
    assert "gpu.cluster_block_id" not in lowered(128)


@pytest.mark.parametrize("q_rows", [192, 384, 1024])  # not one CTA, nor a cluster of 2 or 4
def test_mosaic_forward_refuses_other_query_rows(q_rows):
    case = MOSAIC_CASES["f16_d64"]
    x = _abstract_inputs(case)
    params = FwdParams(q_blocksize=q_rows, kv_blocksize=128, num_stages=2)
    with pytest.raises(ValueError, match=f"q_blocksize={q_rows}"):
        jax.eval_shape(
            functools.partial(_pallas_mosaic.fwd, spec=case.spec, params=params, interpret=False),
            x["q"], x["k"], x["v"],
        )  # fmt: skip


@pytest.mark.parametrize(
    "case, match",
    [
        (Case(dtype=jnp.bfloat16, dim=64, cap=3.0), "logits_soft_cap"),
        (Case(dtype=jnp.bfloat16, dim=64, segments=True), "segment_ids"),
        (Case(dtype=jnp.float32, dim=64), "float32"),
        (Case(dtype=jnp.bfloat16, dim=320), "head dim"),
    ],
)
def test_mosaic_refuses(case, match):
    x = _abstract_inputs(case)
    args = [x[n] for n in ("q", "k", "v", "bias", "mask", "q_seg", "kv_seg", "seed")]
    with pytest.raises(NotImplementedError, match=match):
        backend = backend_for("pallas", "mosaic")
        backend.check(case.spec)
        jax.eval_shape(functools.partial(_pallas_mosaic.fwd, spec=case.spec), *args)
    assert not _pallas_mosaic.available()  # no Hopper GPU in CI


MOSAIC_FWD = FwdParams(q_blocksize=128, kv_blocksize=64, num_stages=2)


def test_mosaic_window_forward_trains_on_the_portable_or_cudnn_backward():
    """A window runs in the Mosaic forward; behind it trains the portable backward (the
    heuristic's; the tuner's candidates, with cuDNN's where it runs), and the Mosaic backward
    kernels refuse it by name, in ``check`` and when called."""
    case = Case(seq_q=256, seq_k=256, heads=2, kv_heads=1, dim=64, dtype=jnp.bfloat16,
                causal=True, window=(90, 0))  # fmt: skip
    _check(_pallas_mosaic, case, MOSAIC_FWD, BwdParams(q_blocksize=32, kv_blocksize=32))
    x = _abstract_inputs(case)
    shape = AttentionShape.of(x["q"], x["k"], case.spec)
    assert _pallas_mosaic.heuristic(shape)[1] == _pallas_gpu.heuristic(shape)[1]
    bwds = {bp.variant for _, bp in _pallas_mosaic.candidates(shape)}
    assert bwds and bwds <= {None, *PORTABLE_VARIANTS}
    plain = dataclasses.replace(case, window=None)
    plain_shape = AttentionShape.of(x["q"], x["k"], plain.spec)
    assert _pallas_mosaic.heuristic(plain_shape)[1].variant in _pallas_mosaic_bwd.VARIANTS
    backend = backend_for("pallas", "mosaic")
    args = [x[n] for n in ("q", "k", "v", "bias", "mask", "q_seg", "kv_seg", "seed")]
    lse = jax.ShapeDtypeStruct((case.batch, case.heads, case.seq_q), jnp.float32)
    backend.check(case.spec, bwd=BwdParams(variant=_pallas_mosaic.CUDNN_BWD))
    for variant in _pallas_mosaic_bwd.VARIANTS:
        bp = BwdParams(variant=variant)
        backend.check(plain.spec, bwd=bp)
        with pytest.raises(NotImplementedError, match=f"variant {variant!r}.*sliding_window"):
            backend.check(case.spec, bwd=bp)
        with pytest.raises(NotImplementedError, match=f"variant {variant!r}.*sliding_window"):
            jax.eval_shape(
                functools.partial(_pallas_mosaic.bwd, spec=case.spec, params=bp, interpret=False),
                *args, x["q"], lse, x["q"],
            )  # fmt: skip


def test_mosaic_window_lowers_for_cuda():
    """A window's forward lowers for a Hopper GPU with its portable backward, on the persistent
    grid and on one cluster a tile (causal from ``ONE_TILE_CAUSAL_KEYS`` keys)."""
    case = dataclasses.replace(MOSAIC_CASES["bf16_d128_causal_gqa"], window=(300, 0))
    assert "mosaic_gpu" in _lower(_pallas_mosaic, case, H100, "cuda")
    keys = _pallas_mosaic.ONE_TILE_CAUSAL_KEYS
    long = dataclasses.replace(case, batch=1, seq_q=keys, seq_k=keys, heads=2, kv_heads=1)
    fp = FwdParams(q_blocksize=256, kv_blocksize=128, num_stages=2)
    assert "gpu.cluster_block_id" in _lower(_pallas_mosaic, long, H100, "cuda", fp=fp, bwd=False)


def _mosaic_bwd(
    q_blocksize: int = 64, kv_blocksize: int = 64, stages: int = 2, variant: str = "mosaic"
) -> BwdParams:
    return BwdParams(
        q_blocksize=q_blocksize, kv_blocksize=kv_blocksize, num_stages=stages, variant=variant
    )


def _fused_bwd(q_blocksize: int = 64, kv_blocksize: int = 64, stages: int = 2) -> BwdParams:
    return _mosaic_bwd(q_blocksize, kv_blocksize, stages, variant="mosaic_fused")


# Small shapes (the interpreter is slow) that still span several blocks, ragged tails and diagonals.
MOSAIC_BWD_CASES = {
    "causal_gqa_ragged_d64": (
        Case(seq_q=200, seq_k=200, heads=4, kv_heads=2, dim=64, dtype=jnp.bfloat16, causal=True),
        _mosaic_bwd(64, 128),
    ),
    "gqa_d128_q128_ragged": (
        Case(seq_q=136, seq_k=200, heads=2, kv_heads=1, dim=128, dtype=jnp.float16),
        _mosaic_bwd(128, 64, stages=3),
    ),
    "causal_q_longer_d80": (  # padded head dim; early rows see no key (lse = -inf)
        Case(seq_q=190, seq_k=100, dim=80, dtype=jnp.bfloat16, causal=True),
        _mosaic_bwd(64, 64),
    ),
    "causal_k_longer_batch2": (
        Case(batch=2, seq_q=100, seq_k=256, dim=64, dtype=jnp.float16, causal=True),
        _mosaic_bwd(128, 128, stages=3),
    ),
    "triton_backward": (  # variant None: the Triton-lowering kernels behind the Mosaic forward
        Case(seq_q=100, seq_k=100, heads=2, kv_heads=1, dim=64, dtype=jnp.bfloat16, causal=True),
        BwdParams(q_blocksize=32, kv_blocksize=32),
    ),
}


@pytest.mark.parametrize("name", list(MOSAIC_BWD_CASES))
def test_mosaic_backward_in_gpu_interpreter(name):
    case, bp = MOSAIC_BWD_CASES[name]
    _check(_pallas_mosaic, case, MOSAIC_FWD, bp)


def test_mosaic_backward_cases_cover_both_dv_orders():
    """The cases above run the dK/dV step both ways: dV's product issued before dS^T is formed (64-row
    blocks) and with dK's (128-row blocks at head dim 64 and 128, where registers are short)."""
    orders = {}
    for name, (case, bp) in MOSAIC_BWD_CASES.items():
        if bp.variant is None:
            continue
        x = _abstract_inputs(case)
        orders[name] = _pallas_mosaic_bwd._geom(x["q"], x["k"], case.spec, bp, True, None).early_dv
    assert orders == {
        "causal_gqa_ragged_d64": True,
        "gqa_d128_q128_ragged": False,
        "causal_q_longer_d80": True,
        "causal_k_longer_batch2": False,
    }


# The fused backward (each warpgroup adds its half of every dQ block into a float32 accumulator; in
# the interpreter by read-modify-write, on the GPU by TMA reduce-add): both halves over both
# warpgroups' keys, several key tiles and GQA heads adding into one accumulator, causal blocks one
# warpgroup cannot see, ragged tails. Its shapes: 128 keys by 64 query rows at head dim 128 (padded),
# by 128 at 64.
MOSAIC_FUSED_CASES = {
    "causal_gqa_ragged": (
        Case(seq_q=200, seq_k=200, heads=4, kv_heads=2, dim=128, dtype=jnp.bfloat16, causal=True),
        _fused_bwd(64, 128),
    ),
    "gqa_ragged": (
        Case(seq_q=136, seq_k=200, heads=2, kv_heads=1, dim=128, dtype=jnp.float16),
        _fused_bwd(64, 128),
    ),
    "causal_q_longer_d80": (  # padded head dim; early rows see no key (lse = -inf)
        Case(seq_q=190, seq_k=100, dim=80, dtype=jnp.bfloat16, causal=True),
        _fused_bwd(64, 128),
    ),
    "causal_k_longer_batch2_d96": (
        Case(batch=2, seq_q=100, seq_k=256, dim=96, dtype=jnp.float16, causal=True),
        _fused_bwd(64, 128, stages=3),
    ),
    # Without GQA the compute warpgroups feed the ring themselves (_Geom.self_fed; so do the
    # two causal cases above).
    "self_fed_ragged_batch2": (
        Case(batch=2, seq_q=136, seq_k=200, dim=128, dtype=jnp.bfloat16),
        _fused_bwd(64, 128),
    ),
    # Head dims up to 64: 128-row query blocks in two parts, each warpgroup adding the dQ of its
    # 64 query rows.
    "d64_causal_ragged": (
        Case(seq_q=200, seq_k=200, heads=2, kv_heads=2, dim=64, dtype=jnp.bfloat16, causal=True),
        _fused_bwd(128, 128),
    ),
    "d40_gqa_k_longer": (  # padded head dim, a memory warpgroup, a partial last query block
        Case(seq_q=136, seq_k=256, heads=4, kv_heads=2, dim=40, dtype=jnp.float16, causal=True),
        _fused_bwd(128, 128),
    ),
    "d64_q_longer": (
        Case(batch=2, seq_q=190, seq_k=100, dim=64, dtype=jnp.bfloat16),
        _fused_bwd(128, 128),
    ),
    # The diagonal on 64-row bounds but off 0 (64 and 128 keys past the first query row): a masked
    # block's 64 x 64 parts wholly hidden, wholly seen and cut.
    "d64_causal_k_longer_by_64": (
        Case(seq_q=136, seq_k=200, dim=64, dtype=jnp.bfloat16, causal=True),
        _fused_bwd(128, 128),
    ),
    "causal_k_longer_by_128_gqa": (
        Case(seq_q=72, seq_k=200, heads=2, kv_heads=1, dim=128, dtype=jnp.float16, causal=True),
        _fused_bwd(64, 128),
    ),
}


def test_mosaic_fused_backward_feeds_itself_only_without_gqa():
    """The fused cases above cover both ways of filling the ring: by a memory warpgroup (GQA) and
    by the compute warpgroups themselves (with and without a mask), on either grid."""
    fed = {}
    for name, (case, bp) in MOSAIC_FUSED_CASES.items():
        x = _abstract_inputs(case)
        g = _pallas_mosaic_bwd._geom(x["q"], x["k"], case.spec, bp, True, None)
        fed[name] = g.self_fed
        persistent = _pallas_mosaic_bwd._geom(x["q"], x["k"], case.spec, bp, True, (True, True))
        assert persistent.self_fed == g.self_fed, name
    assert fed == {
        "causal_gqa_ragged": False,
        "gqa_ragged": False,
        "causal_q_longer_d80": True,
        "causal_k_longer_batch2_d96": True,
        "self_fed_ragged_batch2": True,
        "d64_causal_ragged": True,
        "d40_gqa_k_longer": False,
        "d64_q_longer": True,
        "d64_causal_k_longer_by_64": True,
        "causal_k_longer_by_128_gqa": False,
    }


@pytest.mark.parametrize("name", list(MOSAIC_FUSED_CASES))
def test_mosaic_fused_backward_in_gpu_interpreter(name):
    case, bp = MOSAIC_FUSED_CASES[name]
    _check(_pallas_mosaic, case, MOSAIC_FWD, bp)


def _mosaic_fwd_bwd(
    case: Case,
    bp: BwdParams,
    x: dict,
    persistent: bool = True,
    along_sequence: tuple[bool | None, bool | None] = (None, None),
) -> list[np.ndarray]:
    """out, lse, dq, dk and dv of the Mosaic kernels in the interpreter, with their grid options
    (``along_sequence``: the forward's and the backward's tile orders)."""
    out, lse = _pallas_mosaic._forward(
        x["q"], x["k"], x["v"], spec=case.spec, params=MOSAIC_FWD, interpret=True,
        persistent=persistent, along_sequence=along_sequence[0],
    )  # fmt: skip
    grads = _pallas_mosaic_bwd.bwd(
        x["q"], x["k"], x["v"], out, lse, x["dout"], spec=case.spec, params=bp, interpret=True,
        persistent=(persistent, persistent), along_sequence=along_sequence[1],
    )  # fmt: skip
    return [np.asarray(a, np.float32) for a in (out, lse, *grads)]


def _assert_same_results(got: list, want: list, fused: bool) -> None:
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        if fused and name == "dq":  # the fused dQ adds tiles in another order
            np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize(
    "name, bwd_name, other_orders",
    [
        ("causal_gqa_ragged_d64", None, True),
        ("causal_gqa_ragged", "fused", False),
        ("self_fed_ragged_batch2", "fused", False),
        ("causal_k_longer_batch2_d96", "fused", False),
    ],
)
def test_mosaic_persistent_grid_matches_one_tile_per_cta(name, bwd_name, other_orders):
    """The persistent grids (three CTAs in the interpreter: several tiles each, rounds walked both
    ways, rings and barrier phases carried from tile to tile) give what one CTA per tile gives.
    With ``other_orders``, also what they give with the tiles of each kernel in the order it does
    not take by default (as test_mosaic_tile_orders_give_the_same_results, sharing the run in the
    default orders: each run takes seconds in the interpreter)."""
    case, bp = (MOSAIC_FUSED_CASES if bwd_name else MOSAIC_BWD_CASES)[name]
    x = _inputs(case, 3)
    g = _pallas_mosaic_bwd._geom(x["q"], x["k"], case.spec, bp, True, None)
    # several tiles per CTA
    assert (g.dkdv_rounds if g.fused else g.dq_rounds).tiles > 3
    persistent, one_tile = (
        _mosaic_fwd_bwd(case, bp, x, persistent) for persistent in (True, False)
    )
    _assert_same_results(persistent, one_tile, fused=bwd_name == "fused")
    if other_orders:
        orders = (not _pallas_mosaic.FWD_ALONG_SEQUENCE, tuple(not o for o in g.along_sequence))
        other = _mosaic_fwd_bwd(case, bp, x, along_sequence=orders)
        _assert_same_results(other, persistent, fused=bwd_name == "fused")


def test_mosaic_tile_orders_cover_every_tile_once():
    """Both orders number every (batch, head, rank) exactly once; along the sequence a head's
    ranks are consecutive (CTAs at work together share its keys and values), heads fastest a
    round's tiles share a rank (equal causal work)."""
    batch, heads, ranks = 2, 3, 4
    index = jnp.arange(batch * heads * ranks, dtype=jnp.int32)
    for along_sequence in (True, False):
        band = order_band(along_sequence, batch * heads)
        b, h, r = (np.asarray(a) for a in split_index(index, heads, batch, ranks, band))
        triples = set(zip(b.tolist(), h.tolist(), r.tolist(), strict=True))
        assert len(triples) == batch * heads * ranks
        assert b.max() == batch - 1 and h.max() == heads - 1 and r.max() == ranks - 1
        if along_sequence:
            assert (r == np.tile(np.arange(ranks), batch * heads)).all()
            assert (b * heads + h == np.arange(batch * heads).repeat(ranks)).all()
        else:
            assert (r == np.arange(ranks).repeat(batch * heads)).all()
    for band in (2, 3):  # bands of pairs, heads fastest within a band
        b, h, r = (np.asarray(a) for a in split_index(index, heads, batch, ranks, band))
        assert len(set(zip(b.tolist(), h.tolist(), r.tolist(), strict=True))) == index.size
        pair = (b * heads + h).reshape(-1, band * ranks)
        assert (pair // band == np.arange(batch * heads // band)[:, None]).all()
        assert (r.reshape(-1, band * ranks) == np.arange(ranks).repeat(band)).all()
    for band in (4, 0):
        with pytest.raises(ValueError, match=f"band={band} must be a positive divisor of the 6"):
            split_index(index, heads, batch, ranks, band)


def test_mosaic_rounds_owners_invert_index():
    for tiles, ctas in ((10, 3), (12, 4), (4096, 132), (4096, 128)):
        rounds = Rounds(tiles, ctas)
        owners = rounds.owners()
        for cta in range(ctas):
            mine = [int(rounds.index(cta, t)) for t in range(int(rounds.tiles_of(cta)))]
            assert (owners[mine] == cta).all()
        assert np.bincount(owners, minlength=ctas).sum() == tiles


@pytest.mark.parametrize(
    "tiles, ctas, blocks",
    [(2048, 132, 64), (2048, 132, 32), (4096, 132, 64), (4096, 132, 8), (5, 3, 12), (4, 3, 32)],
)
def test_mosaic_split_tail_covers_the_last_round_once(tiles, ctas, blocks):
    """Each key block of each tile after the whole rounds is in exactly one piece; a CTA runs at
    most two pieces, at most ``piece`` blocks in all; the kernel's (jnp) plan is the host's."""
    tail = SplitTail.plan(tiles, ctas, blocks, _pallas_mosaic.MIN_TAIL_PIECE)
    assert tail is not None and tail.whole == tiles // ctas * ctas
    seen = np.zeros((tiles - tail.whole, blocks), np.int32)
    in_kernel = jax.jit(lambda c, p: (tail.pieces_of(c), *tail.piece_of(c, p)))
    for cta in range(ctas):
        count = int(tail.pieces_of(np.int64(cta)))
        assert count <= 2
        for p in range(count):
            item, first, stop = (int(a) for a in tail.piece_of(np.int64(cta), p))
            assert 0 <= first < stop <= blocks
            seen[item - tail.whole, first:stop] += 1
            traced = in_kernel(jnp.int32(cta), jnp.int32(p))
            assert [int(a) for a in traced] == [count, item, first, stop]
    np.testing.assert_array_equal(seen, 1)
    slots, valid = tail.table()
    assert slots.shape[0] == tiles - tail.whole and valid.sum() == len(set(slots[valid].tolist()))


def test_mosaic_merge_runs_follow_a_heads_rows():
    b, h = np.array([0, 0, 0, 0, 1, 1]), np.array([3, 3, 3, 4, 0, 0])
    rows = np.array([0, 128, 384, 0, 0, 128])  # a gap at 256, then two new heads
    assert _pallas_mosaic._runs(b, h, rows) == [(0, 2), (2, 3), (3, 4), (4, 6)]


def test_mosaic_split_tail_only_where_a_round_is_partial():
    assert SplitTail.plan(2048, 128, 64, 4) is None  # 16 whole rounds
    assert SplitTail.plan(100, 132, 64, 4) is None  # less than one round
    assert SplitTail.plan(5, 3, 4, 4) is None  # pieces as long as tiles: no tile is split
    causal = _mosaic_fwd_geom(2, 8192, causal=True)
    assert causal.tail is None and causal.rounds.tiles == 2048  # causal: Rounds.balanced
    no_mask = _mosaic_fwd_geom(2, 8192, causal=False)
    assert no_mask.tail is not None and no_mask.rounds == Rounds(1980, 132)
    assert dataclasses.replace(no_mask, split_tail=False).tail is None
    short_tiles = _mosaic_fwd_geom(4, 4096, causal=False)  # 32 key blocks a tile
    assert short_tiles.tail is None and short_tiles.rounds.tiles == 2048
    assert dataclasses.replace(no_mask, dpad=64).tail is None  # ptxas spilled at head dim 64


@pytest.mark.parametrize(
    "case, pieces, scatter",
    [
        # 5 tiles on 3 CTAs, a tile of 6 key blocks (the last ragged) in pieces of 4: the middle
        # CTA ends one tile and starts the next; merged by one scatter
        (Case(seq_q=128, seq_k=356, heads=5, kv_heads=5, dim=64, dtype=jnp.bfloat16), 2, True),
        # 4 tiles: the last one's 11 key blocks (the last ragged) in three pieces, one a CTA;
        # merged as slices (short tiles: the interpreter's time goes with the key blocks)
        (Case(seq_q=128, seq_k=700, heads=4, kv_heads=2, dim=96, dtype=jnp.float16), 3, False),
    ],
    ids=["bf16_ragged_d64", "f16_gqa_d96"],
)
def test_mosaic_forward_split_tail_in_gpu_interpreter(case, pieces, scatter, monkeypatch):
    """The last round's tiles split into pieces on several CTAs and merged give what the whole
    tiles give (to float32 rounding), and the reference."""
    merged = []

    def merge(*args, g):
        merged.append(g.tail)
        return merge_tail(*args, g=g)

    merge_tail = _pallas_mosaic._merge_tail
    monkeypatch.setattr(_pallas_mosaic, "_merge_tail", merge)
    # On a GPU only long tiles at head dims from 128 split (MIN_SPLIT_*): here any, to stay small.
    monkeypatch.setattr(_pallas_mosaic, "MIN_SPLIT_BLOCKS", 1)
    monkeypatch.setattr(_pallas_mosaic, "MIN_SPLIT_HEAD_DIM", 1)
    if scatter:
        monkeypatch.setattr(_pallas_mosaic, "_MAX_MERGE_RUNS", 0)
    x = _inputs(case, 5)
    split, whole = (
        _pallas_mosaic._forward(
            x["q"],
            x["k"],
            x["v"],
            spec=case.spec,
            params=MOSAIC_FWD,
            interpret=True,
            split_tail=split_tail,
        )
        for split_tail in (True, False)
    )
    (tail,) = merged  # only the split forward merged pieces
    assert tail.ctas == 3 and tail.table()[0].shape[1] == pieces
    want, want_lse = _reference(x["q"], x["k"], x["v"], spec=case.spec)
    assert _err(split[0], want) < TOL[case.dtype]
    np.testing.assert_allclose(np.asarray(split[1]), np.asarray(want_lse), atol=1e-3)
    np.testing.assert_allclose(
        np.asarray(split[0], np.float32), np.asarray(whole[0], np.float32), atol=4e-3
    )
    np.testing.assert_allclose(np.asarray(split[1]), np.asarray(whole[1]), atol=1e-5)


def _mosaic_fwd_geom(batch: int, seq: int, causal: bool, resident: int = 132):
    return _pallas_mosaic._Geom(
        causal=causal, scale=0.1, seq_q=seq, seq_k=seq, group=1, dpad=128, bk=128, slots=2,
        heads=16, batch=batch, resident=resident, persistent=True, along_sequence=True,
    )  # fmt: skip


def test_mosaic_forward_rounds_balance_causal_work():
    """At 1x32768 causal a head's 256 tiles straddle 132-CTA rounds so that the busiest CTA got
    1.5x the mean; 128 CTAs pair every heavy tile with a light one."""
    for batch, seq, ctas, before in ((1, 32768, 128, 1.5), (3, 8192, 128, 1.19), (2, 8192, 132, 0)):
        g = _mosaic_fwd_geom(batch, seq, causal=True)
        work = g.tile_work()
        mean = work.sum() / 132
        assert g.rounds.ctas == ctas
        assert g.rounds.busiest(work) < 1.04 * mean
        assert Rounds.of(len(work), 132, True).busiest(work) > before * mean
        unbalanced = dataclasses.replace(g, balanced=False)
        assert unbalanced.rounds.ctas == 132
    no_mask = _mosaic_fwd_geom(2, 8192, causal=False)
    assert no_mask.rounds.ctas == 132 and (no_mask.tile_work() == 8192 // 128 + 1).all()


def test_mosaic_dq_rounds_balance_causal_work():
    """The backward's persistent dQ grid (head dims up to 64, causal) takes the same choice."""
    spec = AttentionSpec(scale=0.1, causal=True)
    q = jax.ShapeDtypeStruct((1, 32768, 16, 64), jnp.bfloat16)
    g = _pallas_mosaic_bwd._geom(q, q, spec, _mosaic_bwd(128, 128), False, (False, True))
    assert g.resident == 132 and g.dq_rounds.ctas == 128


def test_mosaic_dkdv_rounds_balance_causal_work():
    """A persistent causal dK/dV grid in bands of 8 heads: at 4x4096x32x64, 132 CTAs' alternating
    rounds put the heavy tiles of every band on the same CTAs (busiest 1.47x the mean); 128 CTAs
    pair each heavy tile with a light one. Without a mask or persistence nothing is balanced."""
    spec = AttentionSpec(scale=0.1, causal=True)
    q = jax.ShapeDtypeStruct((4, 4096, 32, 64), jnp.bfloat16)
    g = _pallas_mosaic_bwd._geom(q, q, spec, _mosaic_bwd(128, 128), False, (True, False))
    work = g.dkdv_tile_work()
    mean = work.sum() / 132
    assert g.resident == 132 and g.dkdv_band == 8 and g.dkdv_rounds.ctas == 128
    assert g.dkdv_rounds.busiest(work) < 1.04 * mean
    assert Rounds.of(len(work), 132, True).busiest(work) > 1.4 * mean
    assert sorted(set(work)) == [n + 1.0 for n in range(1, 33)]  # 32 query blocks down to 1
    one_tile = dataclasses.replace(g, persistent=(False, False))
    no_mask = _pallas_mosaic_bwd._geom(
        q, q, AttentionSpec(scale=0.1, causal=False), _mosaic_bwd(128, 128), False, (True, False)
    )
    assert one_tile.dkdv_rounds.ctas == len(work) and no_mask.dkdv_rounds.ctas == 132
    assert (no_mask.dkdv_tile_work() == 32 + 1).all()


def test_mosaic_backward_persistent_rule():
    """By default both backward kernels run on the persistent grid at head dims up to 64; at 128
    the dK/dV kernel takes one CTA a tile, and the dQ kernel too where causal."""
    for dim, causal, want in (
        (64, False, (True, True)),
        (64, True, (True, True)),
        (128, False, (False, True)),
        (128, True, (False, False)),
    ):
        q = jax.ShapeDtypeStruct((2, 2048, 8, dim), jnp.bfloat16)
        spec = AttentionSpec(scale=0.1, causal=causal)
        g = _pallas_mosaic_bwd._geom(q, q, spec, _mosaic_bwd(128, 128), False, None)
        assert g.persistent == want, (dim, causal)


def test_mosaic_tile_order_rule():
    """The forward goes along the sequence; the backward's dQ kernel too, and its dK/dV kernel
    except causal below 16k keys (there heads fastest, in bands)."""
    assert _pallas_mosaic.FWD_ALONG_SEQUENCE
    rule = _pallas_mosaic_bwd._along_sequence
    assert rule(False, 2048, 2048) == rule(False, 128, 128) == (True, True)
    assert rule(True, 16384, 16384) == rule(True, 128, 65536) == (True, True)
    assert rule(True, 8192, 8192) == rule(True, 128, 128) == (False, True)
    for name, want in (
        ("causal_gqa_ragged_d64", (False, True)),
        ("gqa_d128_q128_ragged", (True, True)),
    ):
        case, bp = MOSAIC_BWD_CASES[name]
        x = _abstract_inputs(case)
        g = _pallas_mosaic_bwd._geom(x["q"], x["k"], case.spec, bp, True, None)
        assert g.along_sequence == want
    # a single order given applies to both kernels
    case, bp = MOSAIC_BWD_CASES["causal_gqa_ragged_d64"]
    x = _abstract_inputs(case)
    g = _pallas_mosaic_bwd._geom(x["q"], x["k"], case.spec, bp, True, None, along_sequence=False)
    assert g.along_sequence == (False, False) and g.dkdv_band == 0  # heads fastest over all pairs


def test_mosaic_dkdv_band_rule():
    """dK/dV tiles heads fastest by default (causal below 16k keys, with or without GQA) go in
    bands of the largest divisor of the (batch, kv head) pairs up to DKDV_BAND; along the sequence
    they take no band."""
    band = _pallas_mosaic_bwd._dkdv_band
    assert _pallas_mosaic_bwd.DKDV_BAND == 8
    assert [band(p) for p in (1, 4, 6, 8, 12, 16, 64, 7, 13)] == [1, 4, 6, 8, 6, 8, 8, 7, 1]
    for name, want in (("causal_gqa_ragged_d64", True), ("gqa_d128_q128_ragged", False)):
        case, bp = MOSAIC_BWD_CASES[name]
        x = _abstract_inputs(case)
        g = _pallas_mosaic_bwd._geom(x["q"], x["k"], case.spec, bp, True, None)
        assert g.dkdv_band == (band(case.batch * case.kv_heads) if want else 0)


# The split backward's case, causal_gqa_ragged_d64, runs in
# test_mosaic_persistent_grid_matches_one_tile_per_cta.
@pytest.mark.parametrize("name, bwd_name", [("gqa_ragged", "fused")])
def test_mosaic_tile_orders_give_the_same_results(name, bwd_name):
    """On the persistent grid (several tiles a CTA), the order of the tiles changes nothing but
    the fused dQ's order of float32 sums."""
    case, bp = (MOSAIC_FUSED_CASES if bwd_name else MOSAIC_BWD_CASES)[name]
    x = _inputs(case, 4)
    along, heads_fastest = (
        _mosaic_fwd_bwd(case, bp, x, along_sequence=(along_sequence, along_sequence))
        for along_sequence in (True, False)
    )
    _assert_same_results(along, heads_fastest, fused=bwd_name == "fused")


def test_mosaic_register_splits_fit_what_setmaxnreg_can_move():
    """setmaxnreg only moves registers between a CTA's warpgroups, which start with the register
    file shared out evenly (168 a thread for three warpgroups, 256 for two): asking for more than
    that pool hangs the kernel on the GPU."""
    fwd = _pallas_mosaic
    assert fwd.COMPUTE_WGS * fwd.COMPUTE_REGISTERS + fwd.MEMORY_REGISTERS <= 3 * 168
    bwd = _pallas_mosaic_bwd
    for compute_wgs, pool in ((1, 2 * 256), (2, 3 * 168)):
        registers = bwd._compute_registers(compute_wgs)
        assert registers % 8 == 0 and registers <= 256
        assert compute_wgs * registers + bwd._MEMORY_REGISTERS <= pool


def test_mosaic_backward_choice():
    """The heuristic takes the Mosaic backward up to head dim 128; the tuner sees both kinds."""
    spec = AttentionSpec(scale=0.1, causal=True)

    def shape(d):
        return AttentionShape(
            batch=2, seq_q=4096, seq_k=4096, heads=16, kv_heads=4, head_dim=d, dtype="bfloat16",
            spec=spec,
        )  # fmt: skip

    for d in (64, 96, 128):
        _, bp = _pallas_mosaic.heuristic(shape(d))
        # GQA: the split one, but the fused one from 2048 keys at head dim 64
        assert bp.variant == ("mosaic_fused" if d == 64 else "mosaic")
        for seq, fused_leads in ((1024, False), (2048, d == 64)):
            short = dataclasses.replace(shape(d), seq_q=seq, seq_k=seq)
            assert _pallas_mosaic.heuristic(short)[1].variant == (
                "mosaic_fused" if fused_leads else "mosaic"
            )
        long = dataclasses.replace(shape(d), seq_q=16384, seq_k=16384)
        assert _pallas_mosaic.heuristic(long)[1].variant == (
            "mosaic_fused" if d == 64 else "mosaic"
        )
        for seq, fused_leads in ((1024, False), (2048, d == 64), (4096, True), (16384, True)):
            no_gqa = dataclasses.replace(shape(d), seq_q=seq, seq_k=seq, kv_heads=16)
            assert _pallas_mosaic.heuristic(no_gqa)[1].variant == (
                "mosaic_fused" if fused_leads else "mosaic"
            )
        full = dataclasses.replace(shape(d), spec=AttentionSpec(scale=0.1))
        fused_heuristic = _pallas_mosaic.heuristic(full)[1]
        assert fused_heuristic.variant == "mosaic_fused"
        assert _pallas_mosaic_bwd.supports(d, fused_heuristic)
        cands = [bp for _, bp in _pallas_mosaic.candidates(shape(d))]
        # and the Triton-lowering backward's, its mirrored and wide blocks among them
        variants = {"mosaic", "mosaic_fused", None, MIRRORED, MIRRORED_WIDE}
        assert {bp.variant for bp in cands} == variants

        def blocks(variant, cands=cands):
            return {(bp.kv_blocksize, bp.num_stages) for bp in cands if bp.variant == variant}

        assert blocks("mosaic") == {(64, 2), (64, 3), (128, 2), (128, 3)}
        assert blocks("mosaic_fused") == {(128, 2)}
        for bp in cands:
            if bp.variant == "mosaic_fused":  # 64 query rows at head dim 128 (96 padded), 128 at 64
                assert bp.q_blocksize == (128 if d == 64 else 64)
    # above head dim 128 no Mosaic backward: the Triton-lowering one
    assert _pallas_mosaic.heuristic(shape(256))[1] == _pallas_gpu.heuristic(shape(256))[1]
    portable = {None, *PORTABLE_VARIANTS}
    assert all(bp.variant in portable for _, bp in _pallas_mosaic.candidates(shape(256)))
    short = dataclasses.replace(shape(64), seq_q=40, seq_k=40)
    own = [bp for _, bp in _pallas_mosaic.candidates(short) if bp.variant == "mosaic"]
    assert own and all(bp.kv_blocksize == 64 for bp in own)
    # no whole 128-row block of queries or keys: no fused backward
    assert all(bp.variant != "mosaic_fused" for _, bp in _pallas_mosaic.candidates(short))


def test_mosaic_backward_refuses():
    case = Case(dtype=jnp.bfloat16, dim=256)
    x = _abstract_inputs(case)
    args = [x[n] for n in ("q", "k", "v", "bias", "mask", "q_seg", "kv_seg", "seed")]
    lse = jax.ShapeDtypeStruct((case.batch, case.heads, case.seq_q), jnp.float32)

    def bwd(bp, case=case):
        f = functools.partial(_pallas_mosaic.bwd, spec=case.spec, params=bp)
        return jax.eval_shape(f, *args, x["q"], lse, x["q"])

    with pytest.raises(NotImplementedError, match="head_dim=256"):
        bwd(_mosaic_bwd())
    bwd(BwdParams(q_blocksize=32, kv_blocksize=32))  # the Triton-lowering backward takes it
    bwd(BwdParams(q_blocksize=16, kv_blocksize=32, variant=MIRRORED))  # and its mirrored dQ
    with pytest.raises(ValueError, match="variant"):
        bwd(BwdParams(variant="cuda"))
    # The fused backward's shapes: 128 key rows by 64 query rows at head dim 128 (padded), 128 at 64.
    for dim, fused_blocks, match in (
        (128, (128, 128), "q_blocksize=128"),
        (128, (64, 64), "kv_blocksize=64"),
        (64, (64, 128), "head_dim=64"),
    ):
        with pytest.raises(NotImplementedError, match=match):
            other = Case(dtype=jnp.bfloat16, dim=dim, seq_q=128, seq_k=128)
            z = _abstract_inputs(other)
            f = functools.partial(
                _pallas_mosaic.bwd, spec=other.spec, params=_fused_bwd(*fused_blocks)
            )
            lse128 = jax.ShapeDtypeStruct((other.batch, other.heads, other.seq_q), jnp.float32)
            jax.eval_shape(f, z["q"], z["k"], z["v"], *args[3:], z["q"], lse128, z["q"])
    with pytest.raises(ValueError, match="kv_blocksize=256"):
        small = Case(dtype=jnp.bfloat16, dim=64)
        y = _abstract_inputs(small)
        f = functools.partial(_pallas_mosaic.bwd, spec=small.spec, params=_mosaic_bwd(64, 256))
        jax.eval_shape(f, y["q"], y["k"], y["v"], *args[3:], y["q"], lse, y["q"])


def test_mosaic_backward_candidates_lower_for_cuda():
    """Every Mosaic backward the tuner may try lowers for a Hopper GPU (registers as wgmma operands,
    the path the interpreter cannot take)."""
    case = MOSAIC_CASES["bf16_d128_causal_gqa"]
    q = jax.ShapeDtypeStruct((case.batch, case.seq_q, case.heads, case.dim), case.dtype)
    k = jax.ShapeDtypeStruct((case.batch, case.seq_k, case.kv_heads, case.dim), case.dtype)
    bwds = {
        bp
        for _, bp in _pallas_mosaic.candidates(AttentionShape.of(q, k, case.spec))
        if bp.variant == "mosaic"
    }
    assert len(bwds) == 4
    # (The forwards lower in test_mosaic_lowers_for_cuda.)
    for bp in sorted(bwds, key=repr):
        _lower(_pallas_mosaic, case, H100, "cuda", bp=bp, fwd=False)
    f16 = MOSAIC_CASES["f16_d64"]
    _lower(_pallas_mosaic, f16, H100, "cuda", bp=_mosaic_bwd(128, 128, 3), fwd=False)
    assert _pallas_mosaic_bwd.MAX_HEAD_DIM == 128


@pytest.mark.parametrize("name", list(MOSAIC_CASES))
def test_mosaic_fused_backward_lowers_for_cuda(name):
    """Every fused backward the tuner may try lowers for a Hopper GPU to one kernel whose dQ goes out
    by TMA reduce-add into an accumulator aliased in place (the path the interpreter cannot take)."""
    case = MOSAIC_CASES[name]
    x = _abstract_inputs(case)
    args = [x[n] for n in ("q", "k", "v", "bias", "mask", "q_seg", "kv_seg", "seed")]
    lse = jax.ShapeDtypeStruct((case.batch, case.heads, case.seq_q), jnp.float32)
    shape = AttentionShape.of(x["q"], x["k"], case.spec)
    bwds = {bp for _, bp in _pallas_mosaic.candidates(shape) if bp.variant == "mosaic_fused"}
    assert len(bwds) == 1
    mesh = AbstractMesh((1,), ("x",), abstract_device=H100)
    for bp in bwds:
        b = functools.partial(_pallas_mosaic.bwd, spec=case.spec, params=bp, interpret=False)
        with use_abstract_mesh(mesh):
            lowered = jax.jit(b).trace(*args, x["q"], lse, x["q"])
            text = lowered.lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("mosaic_gpu") and text.count("@mosaic_gpu_v2(") == 1, bp
        assert "cp.reduce.async.bulk.tensor" in text and ".add." in text, bp
        assert "output_operand_aliases" in text, bp


@pytest.mark.parametrize("kv_heads, causal", [(2, False), (2, True), (1, False)])
def test_mosaic_self_fed_backward_lowers_for_cuda(kv_heads, causal):
    """Without GQA the fused backward lowers without a memory warpgroup, so no registers move
    between warpgroups (no ``setmaxnreg``), and with hardware barriers between its two; with GQA
    the memory warpgroup and the mbarriers stay."""
    case = Case(batch=2, seq_q=1024, seq_k=1024, heads=2, kv_heads=kv_heads, dim=128,
                dtype=jnp.bfloat16, causal=causal)  # fmt: skip
    x = _abstract_inputs(case)
    lse = jax.ShapeDtypeStruct((case.batch, case.heads, case.seq_q), jnp.float32)
    bp = _fused_bwd(64, 128)
    assert _pallas_mosaic_bwd._geom(x["q"], x["k"], case.spec, bp, False, None).self_fed == (
        kv_heads == 2
    )
    b = functools.partial(_pallas_mosaic_bwd.bwd, spec=case.spec, params=bp, interpret=False)
    with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=H100)):
        lowered = jax.jit(b).trace(x["q"], x["k"], x["v"], x["q"], lse, x["q"])
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "cp.reduce.async.bulk.tensor" in text
    assert ("setmaxnreg" in text) == (kv_heads == 1)
    # The self-fed kernel's handshakes go through hardware barriers; GQA's keep mbarriers.
    assert ("bar.sync $0, 256;" in text) == (kv_heads == 2)


def test_registered():
    for variant, module in (
        ("triton", _pallas_gpu),
        ("tpu", _pallas_tpu),
        ("mosaic", _pallas_mosaic),
    ):
        backend = backend_for("pallas", variant)
        assert backend.fwd is module.fwd and backend.bwd is module.bwd


def test_tpu_block_spans_cover_exactly_the_documents_of_each_block():
    """Packed documents of 128 and 256 rows: the first block of 128 queries reaches key block 0
    alone, the others key blocks 1 and 2; padding rows reach nothing."""
    ids = jnp.asarray([[0] * 128 + [1] * 256], jnp.int32)
    q_span, _ = _pallas_tpu._spans(ids, ids)
    spans = _pallas_tpu._block_spans(q_span[:, 0], q_span[:, 1], 512, 128)
    every = (0, 0, 0, 4)  # key blocks [0, 4), all masked
    bands = [_pallas_tpu._segment_band(every, spans, 0, i, 4, 128)[:2] for i in range(4)]
    assert [int(x) for band in bands for x in band] == [0, 1, 1, 3, 1, 3, 0, 0]
