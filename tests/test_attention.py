"""One attention suite for every registered backend that can run here, against a float64 reference.

The backend table is built from the registry when the tests are collected: backends native to this
device run every case; the others run in their interpreter (Pallas ``interpret=True``, Triton's
interpreter) on a reduced set of small cases; a backend that refuses to run here at all (cuDNN on a
CPU) is tested to refuse cleanly. A backend module that lands later joins without changes here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ejkfn
from ejkfn import AttentionConfig, BwdParams, FlashAttention, FwdParams, flash_attention
from ejkfn.attention import _cudnn, _pallas_gpu, _triton, registered_backends
from ejkfn.attention._backend import (
    BAND_BYTES,
    PORTABLE_VARIANTS,
    AttentionBackend,
    AttentionShape,
    band_pairs,
    segment_spans,
)
from ejkfn.attention._reference import reference_attention
from ejkfn.attention._spec import AttentionSpec

from ._lowering import cudnn_forward_results

# The suite compiles many small programs; XLA's backend optimisations cost more compile time than
# they save in run time here (and change no result).
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _jit(f: Any) -> Any:
    return jax.jit(f, compiler_options=_FAST_COMPILE)


# --- the backend table -----------------------------------------------------------------------------


DTYPES = ("float32", "bfloat16", "float16")


def _probe(backend: AttentionBackend, dtype: str, interpret: bool) -> str | None:
    """Why ``backend`` cannot run here in ``dtype`` (natively or in its interpreter), or None.

    Native backends are probed natively: probing Triton in its interpreter would fix the process's
    Triton mode to interpreted on a GPU.
    """
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), dtype)
    spec = AttentionSpec(scale=0.125)
    shape = AttentionShape.of(q, q, spec)
    fp, bp = backend.heuristic(shape)
    args = (q, q, q, None, None, None, None, None)
    try:
        out, lse = jax.eval_shape(
            functools.partial(backend.fwd, spec=spec, params=fp, interpret=interpret), *args
        )
        jax.eval_shape(
            functools.partial(backend.bwd, spec=spec, params=bp, interpret=interpret),
            *args,
            out,
            lse,
            out,
        )
    except NotImplementedError as exc:
        return str(exc)
    return None


def _table() -> tuple[list[Any], list[Any], list[tuple[AttentionBackend, str]], dict[Any, Any]]:
    """Native and interpreted backends (as parameters), refusing ones, and the dtypes each takes."""
    native, interpreted, refusing = [], [], []
    dtypes: dict[tuple[str, str], tuple[str, ...]] = {}
    kind = ejkfn.device_kind()
    for backend in registered_backends():
        name = f"{backend.platform}-{backend.variant}"
        native_here = kind in backend.devices and backend.available()
        reasons = {dtype: _probe(backend, dtype, interpret=not native_here) for dtype in DTYPES}
        ok = tuple(d for d in DTYPES if reasons[d] is None)
        if ok and native_here:
            native.append(pytest.param(backend, id=name))
            dtypes[backend.platform, backend.variant] = ok
            continue
        if ok:
            interpreted.append(pytest.param(backend, id=name, marks=pytest.mark.interpreted))
            dtypes[backend.platform, backend.variant] = ok
        else:
            refusing.append((backend, reasons[DTYPES[0]]))
    return native, interpreted, refusing, dtypes


NATIVE, INTERPRETED, REFUSING, BACKEND_DTYPES = _table()
ALL = NATIVE + INTERPRETED


def _in_dtype(backend: AttentionBackend, case: Case) -> Case:
    """``case`` in a dtype the backend takes (a float32-less backend runs float32 cases in bf16)."""
    ok = BACKEND_DTYPES[backend.platform, backend.variant]
    return case if case.dtype in ok else dataclasses.replace(case, dtype=ok[0])


def _backend_of(param: Any) -> AttentionBackend:
    return param.values[0]


# --- cases -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: shapes, dtype and features."""

    batch: int = 2
    seq_q: int = 32
    seq_k: int = 32
    heads: int = 4
    kv_heads: int = 4
    dim: int = 32
    dtype: str = "float32"
    causal: bool = False
    window: int | tuple[int, int] | None = None
    bias: str | None = None  # a key of BIAS_SHAPES
    mask: bool = False
    segments: bool = False
    soft_cap: float | None = None
    scale: float | None = None
    dropout: float = 0.0

    @property
    def spec(self) -> AttentionSpec:
        window = self.window
        if isinstance(window, int):
            window = (window, window)
        return AttentionSpec(
            scale=self.scale if self.scale is not None else 1.0 / math.sqrt(self.dim),
            causal=self.causal,
            window=window,
            soft_cap=self.soft_cap,
            dropout_prob=self.dropout,
            has_bias=self.bias is not None,
            has_mask=self.mask,
            has_segments=self.segments,
        )


def _bias_shape(case: Case) -> tuple[int, ...]:
    b, h, sq, sk = case.batch, case.heads, case.seq_q, case.seq_k
    return {
        "full": (b, h, sq, sk),
        "heads": (1, h, sq, sk),
        "batch": (b, 1, sq, sk),
        "2d": (sq, sk),
        "rows": (b, h, 1, sk),
    }[case.bias]


# (name, case, run on interpreted backends too)
CASES: list[tuple[str, Case, bool]] = [
    ("plain", Case(), False),
    ("causal", Case(causal=True), False),
    ("gqa_causal", Case(kv_heads=2, causal=True), True),
    ("mqa_window_int", Case(kv_heads=1, window=5), False),
    ("window_segments", Case(window=(6, 2), segments=True), True),
    ("window_causal", Case(window=(4, 3), causal=True, seq_q=24, seq_k=40), False),
    ("segments_causal_gqa", Case(segments=True, causal=True, kv_heads=2), False),
    ("mask_bias_batch", Case(mask=True, bias="batch", kv_heads=2), False),
    ("bias_mask_soft_cap", Case(bias="full", mask=True, soft_cap=3.0), True),
    ("bias_heads_causal", Case(bias="heads", causal=True), False),
    ("bias_2d_scale", Case(bias="2d", scale=0.5), False),
    ("bias_rows", Case(bias="rows"), False),
    ("soft_cap", Case(soft_cap=2.0), False),
    ("dropout", Case(dropout=0.25), True),
    ("dropout_everything", Case(dropout=0.2, causal=True, bias="heads", mask=True,
                                segments=True, soft_cap=4.0, kv_heads=2), False),
    ("longer_q", Case(seq_q=45, seq_k=19, causal=True), True),
    ("longer_k", Case(seq_q=19, seq_k=45, causal=True), False),
    ("odd_lengths", Case(seq_q=37, seq_k=53, window=(9, 0), kv_heads=2), False),
    ("one_query", Case(seq_q=1, seq_k=33, causal=True), False),
    ("dim64", Case(dim=64, seq_q=16, seq_k=16), False),
    ("dim128", Case(dim=128, seq_q=16, seq_k=16, causal=True), False),
    ("dim256", Case(dim=256, seq_q=16, seq_k=16, heads=2, kv_heads=2), False),
    ("dim80", Case(dim=80, causal=True), True),
    ("dim96", Case(dim=96, kv_heads=2), False),
    ("bf16", Case(dtype="bfloat16", causal=True, bias="full"), True),
    ("bf16_mqa_window", Case(dtype="bfloat16", kv_heads=1, window=(3, 3)), False),
    ("f16", Case(dtype="float16", segments=True, kv_heads=2), True),
    ("f16_soft_cap", Case(dtype="float16", soft_cap=5.0, causal=True), False),
]  # fmt: skip

# (atol, rtol) per dtype, forward and gradients; atol is relative to max(1, largest reference value).
TOL = {
    "float32": ((2e-5, 2e-5), (1e-4, 1e-4)),
    "float16": ((4e-3, 4e-3), (1e-2, 1e-2)),
    "bfloat16": ((3e-2, 3e-2), (6e-2, 5e-2)),
}

# Block sizes that make short test sequences span several blocks (and padded tails).
BLOCKS = {
    ("xla", "chunked"): (
        FwdParams(q_blocksize=16, kv_blocksize=8),
        BwdParams(q_blocksize=8, kv_blocksize=16),
    ),
}


def _cfg(backend: AttentionBackend, case: Case) -> AttentionConfig:
    q = jax.ShapeDtypeStruct((case.batch, case.seq_q, case.heads, case.dim), case.dtype)
    k = jax.ShapeDtypeStruct((case.batch, case.seq_k, case.kv_heads, case.dim), case.dtype)
    shape = AttentionShape.of(q, k, case.spec)
    params = BLOCKS.get((backend.platform, backend.variant))
    if params is None:  # the smallest blocks the backend offers: the most block boundaries
        params = min(backend.candidates(shape), key=lambda p: p[0].q_blocksize * p[0].kv_blocksize)
    return AttentionConfig(
        platform=backend.platform, variant=backend.variant, fwd=params[0], bwd=params[1]
    )


def _segments(rng: np.random.Generator, batch: int, seq: int) -> jax.Array:
    """Packed-sequence ids: non-decreasing runs per row."""
    return jnp.asarray(np.cumsum(rng.random((batch, seq)) < 0.15, axis=1, dtype=np.int32))


def _inputs(case: Case, key: jax.Array) -> dict[str, Any]:
    """Random inputs for ``case`` from ``key``, drawn with NumPy: eager ``jax.random`` calls compile
    anew for every shape, which took most of the property tests' time."""
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
    dt = jnp.dtype(case.dtype)
    b, sq, sk, h, kvh, d = case.batch, case.seq_q, case.seq_k, case.heads, case.kv_heads, case.dim

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, np.float32).astype(dt))

    inputs: dict[str, Any] = {
        "q": normal(b, sq, h, d),
        "k": normal(b, sk, kvh, d),
        "v": normal(b, sk, kvh, d),
        "bias": None,
        "mask": None,
        "q_seg": None,
        "kv_seg": None,
        "seed": None,
        "dout": normal(b, sq, h, d),
    }
    if case.bias is not None:
        inputs["bias"] = normal(*_bias_shape(case))
    if case.mask:
        mask = rng.random((b, 1, sq, sk)) < 0.8
        mask[0, :, sq // 2, :] = False  # a row that sees nothing
        inputs["mask"] = jnp.asarray(mask)
    if case.segments:
        q_seg = _segments(rng, b, sq)
        inputs["q_seg"] = q_seg
        inputs["kv_seg"] = _segments(rng, b, sk) if sk != sq else q_seg
    if case.dropout:
        inputs["seed"] = jnp.asarray(rng.integers(0, 2**32, dtype=np.uint32))
    return inputs


def _call(case: Case, cfg: AttentionConfig | None, platform: str = "auto"):
    def attention(q, k, v, bias, mask, q_seg, kv_seg, seed):
        return flash_attention(
            q,
            k,
            v,
            bias,
            attention_mask=mask,
            q_segment_ids=q_seg,
            kv_segment_ids=kv_seg,
            softmax_scale=case.scale,
            causal=case.causal,
            sliding_window=case.window,
            logits_soft_cap=case.soft_cap,
            dropout_prob=case.dropout,
            dropout_seed=seed,
            platform=platform,
            cfg=cfg,
        )

    return attention


def _with_grads(attention):
    """``(out, (dq, dk, dv, dbias))`` for the cotangent ``dout``, in one function to jit."""

    def run(x):
        def f(q, k, v, bias):
            return attention(q, k, v, bias, x["mask"], x["q_seg"], x["kv_seg"], x["seed"])

        out, pullback = jax.vjp(f, x["q"], x["k"], x["v"], x["bias"])
        return out, pullback(x["dout"])

    return run


@functools.cache
def _reference_fn(spec: AttentionSpec) -> Any:
    """A jitted float64 reference ``(out, grads)`` (jitted: eager float64 ops compile one by one)."""

    def run(x: dict[str, Any]) -> Any:
        def f(q, k, v, bias):
            return reference_attention(
                q,
                k,
                v,
                bias,
                x["mask"],
                x["q_seg"],
                x["kv_seg"],
                x["seed"],
                spec=spec,
                dtype=jnp.float64,
            )[0]

        out, pullback = jax.vjp(f, x["q"], x["k"], x["v"], x["bias"])
        return out, pullback(x["dout"])

    return _jit(run)


def _reference(case: Case, x: dict[str, Any]) -> tuple[np.ndarray, tuple[Any, ...]]:
    """Forward and gradients of the dense reference in float64."""
    floats = ("q", "k", "v", "bias", "dout")
    with jax.enable_x64(True):
        x64 = {
            n: None if a is None else jnp.asarray(np.asarray(a, np.float64) if n in floats else a)
            for n, a in x.items()
        }
        out, grads = _reference_fn(case.spec)(x64)
        return np.asarray(out), tuple(None if g is None else np.asarray(g) for g in grads)


def _close(name: str, got: Any, want: Any, tol: tuple[float, float]) -> None:
    got = np.asarray(got).astype(np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(got)), f"{name}: non-finite values"
    atol, rtol = tol
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1.0)  # inputs are O(1)
    err = np.abs(got - want) - rtol * np.abs(want)
    worst = float(np.max(err, initial=0.0)) / scale
    assert worst <= atol, f"{name}: error {worst:.3g} (relative to max {scale:.3g}) > {atol}"


def _check(case: Case, x: dict[str, Any], out: Any, grads: Any) -> None:
    want_out, want_grads = _reference(case, x)
    fwd_tol, grad_tol = TOL[case.dtype]
    _close("out", out, want_out, fwd_tol)
    assert out.dtype == x["q"].dtype
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, want_grads, strict=True):
        if want is None:
            assert got is None, name
        else:
            _close(name, got, want, grad_tol)


def _shape_refusal(backend: AttentionBackend, case: Case) -> str | None:
    """Why a native ``backend`` refuses ``case`` for its shapes (cuDNN's alignment, say), or None."""
    x = _inputs(_in_dtype(backend, case), jax.random.key(0))
    try:
        jax.eval_shape(_with_grads(_call(_in_dtype(backend, case), _cfg(backend, case))), x)
    except NotImplementedError as exc:
        return str(exc)
    return None


# (backend, case) pairs a native backend refuses for their shapes: checked to refuse, not to run.
SHAPE_REFUSALS: list[Any] = []


def _matrix(backends: list[Any]) -> list[Any]:
    """(backend, case) parameters: every case natively, the reduced set in interpreters."""
    params = []
    for bp in backends:
        backend = _backend_of(bp)
        interpreted = bp in INTERPRETED
        for name, case, in_reduced in CASES:
            if interpreted and not in_reduced:
                continue
            if case.spec.features & backend.unsupported:
                continue  # refusals are tested on their own (test_refuses_unsupported_features)
            if not interpreted and backend.platform == "cudnn" and _shape_refusal(backend, case):
                SHAPE_REFUSALS.append(pytest.param(backend, case, id=f"{bp.id}-{name}"))
                continue
            params.append(pytest.param(backend, case, id=f"{bp.id}-{name}", marks=bp.marks))
    return params


# --- forward and gradients against the reference --------------------------------------------------


def _runnable(backend: AttentionBackend, case: Case) -> Case:
    """``case`` as ``backend`` can run it here; skips features it refuses (tested separately)."""
    missing = case.spec.features & backend.unsupported
    if missing:
        pytest.skip(f"{backend.platform}/{backend.variant} refuses {sorted(missing)}")
    return _in_dtype(backend, case)


MATRIX = _matrix(ALL)


@pytest.mark.parametrize(("backend", "case"), MATRIX)
def test_matches_reference(backend: AttentionBackend, case: Case, key: jax.Array) -> None:
    case = _runnable(backend, case)
    x = _inputs(case, key)
    out, grads = _jit(_with_grads(_call(case, _cfg(backend, case))))(x)
    _check(case, x, out, grads)


# Calls that nothing differentiates go through ``FlashAttention.inference``, which a backend may
# serve another way (cuDNN's forward without its statistics); XLA's stand in where there is no cuDNN.
INFERENCE_MATRIX = [p for p in MATRIX if _backend_of(p).platform in ("xla", "cudnn")]


@pytest.mark.parametrize(("backend", "case"), INFERENCE_MATRIX)
def test_inference_matches_reference(backend: AttentionBackend, case: Case, key: jax.Array) -> None:
    case = _runnable(backend, case)
    x = _inputs(case, key)
    attention = _call(case, _cfg(backend, case))
    names = ("q", "k", "v", "bias", "mask", "q_seg", "kv_seg", "seed")
    out = _jit(lambda x: attention(*(x[name] for name in names)))(x)
    _close("out", out, _reference(case, x)[0], TOL[case.dtype][0])
    assert out.dtype == x["q"].dtype


VMAP_CASES = [
    ("causal_gqa_bias", Case(batch=1, seq_q=24, seq_k=40, kv_heads=2, causal=True, bias="full")),
    ("segments_dropout", Case(batch=2, seq_q=16, seq_k=16, segments=True, dropout=0.3)),
]


def _vmap_matrix() -> list[Any]:
    params = []
    for bp in ALL:
        cases = VMAP_CASES[:1] if bp in INTERPRETED else VMAP_CASES
        for name, case in cases:
            backend = _backend_of(bp)
            if case.spec.features & backend.unsupported:
                continue
            if (
                bp not in INTERPRETED
                and backend.platform == "cudnn"
                and _shape_refusal(backend, case)
            ):
                continue
            params.append(pytest.param(_backend_of(bp), case, id=f"{bp.id}-{name}", marks=bp.marks))
    return params


@pytest.mark.parametrize(("backend", "case"), _vmap_matrix())
def test_vmap(backend: AttentionBackend, case: Case, key: jax.Array) -> None:
    case = _runnable(backend, case)
    keys = jax.random.split(key, 2)
    xs = [_inputs(case, k) for k in keys]
    if case.dropout:
        for x in xs:
            x["seed"] = xs[0]["seed"]  # one seed for the mapped calls (it is not mapped)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *xs)
    stacked["seed"] = xs[0]["seed"]
    axes = {n: (None if n == "seed" else 0) for n in stacked}
    run = _with_grads(_call(case, _cfg(backend, case)))
    out, grads = _jit(jax.vmap(run, in_axes=(axes,)))(stacked)
    for i, x in enumerate(xs):
        _check(case, x, out[i], jax.tree.map(lambda g, i=i: g[i], grads))


@pytest.mark.parametrize(
    "backend", [bp for bp in ALL if "dropout" not in _backend_of(bp).unsupported]
)
def test_dropout_is_deterministic(backend: AttentionBackend, key: jax.Array) -> None:
    case = Case(batch=1, seq_q=16, seq_k=16, heads=2, kv_heads=2, dim=16, dropout=0.5)
    case = _runnable(backend, case)
    x = _inputs(case, key)
    f = _jit(_call(case, _cfg(backend, case)))

    def out(seed: int) -> np.ndarray:
        return np.asarray(f(x["q"], x["k"], x["v"], None, None, None, None, jnp.uint32(seed)))

    first, again, other = out(1), out(1), out(2)
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other)
    without = np.asarray(
        _jit(_call(dataclasses.replace(case, dropout=0.0), None))(
            x["q"], x["k"], x["v"], None, None, None, None, None
        )
    )
    assert not np.allclose(first, without)


# --- refusals --------------------------------------------------------------------------------------

FEATURES = {
    "causal": Case(causal=True),
    "sliding_window": Case(window=(4, 0)),
    "logits_soft_cap": Case(soft_cap=5.0),
    "dropout": Case(dropout=0.1),
    "bias": Case(bias="full"),
    "attention_mask": Case(mask=True),
    "segment_ids": Case(segments=True),
}


def _refusals() -> list[Any]:
    params = []
    for backend in [_backend_of(p) for p in ALL] + [b for b, _ in REFUSING]:
        for feature in sorted(backend.unsupported):
            params.append(
                pytest.param(backend, feature, id=f"{backend.platform}-{backend.variant}-{feature}")
            )
    return params


@pytest.mark.parametrize(("backend", "feature"), _refusals())
def test_refused_feature_names_it(backend: AttentionBackend, feature: str, key: jax.Array) -> None:
    case = dataclasses.replace(FEATURES[feature], batch=1, seq_q=16, seq_k=16, dtype="bfloat16")
    x = _inputs(case, key)
    cfg = AttentionConfig(platform=backend.platform, variant=backend.variant)
    args = (x["q"], x["k"], x["v"], x["bias"], x["mask"], x["q_seg"], x["kv_seg"], x["seed"])
    with pytest.raises(NotImplementedError, match=feature):
        jax.jit(_call(case, cfg)).trace(*args)


# --- cuDNN -----------------------------------------------------------------------------------------

ON_CPU = ejkfn.device_kind() == "cpu"


@pytest.mark.skipif(not ON_CPU, reason="checks how cuDNN refuses on a machine without a GPU")
def test_cudnn_refuses_without_gpu(key: jax.Array) -> None:
    assert not _cudnn.available()
    case = Case(batch=1, seq_q=16, seq_k=16, dtype="bfloat16", causal=True)
    x = _inputs(case, key)
    args = (x["q"], x["k"], x["v"], None, None, None, None, None)
    with pytest.raises(NotImplementedError, match="needs a CUDA GPU"):
        _call(case, None, platform="cudnn")(*args)
    with pytest.raises(NotImplementedError, match="needs a CUDA GPU"):
        jax.jit(_call(case, AttentionConfig(platform="cudnn"))).trace(*args)
    # "auto" never offers it here.
    inv = ejkfn.Invocation.of(FlashAttention(), x["q"], x["k"], x["v"], causal=True)
    assert all(c.platform != "cudnn" for c in FlashAttention().candidate_cfgs(inv))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (Case(dtype="float32"), "float16 or bfloat16"),
        (Case(dtype="bfloat16", seq_q=16, seq_k=32, causal=True), "seq_q == seq_k"),
        (Case(dtype="bfloat16", window=(3, 2)), "right of the diagonal"),
        (Case(dtype="bfloat16", dim=288, seq_q=8, seq_k=8, heads=1, kv_heads=1), "up to 256"),
    ],
    ids=["float32", "causal_unaligned", "right_window", "dim288"],
)
def test_cudnn_refuses_what_it_cannot_do(
    case: Case, message: str, key: jax.Array, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cudnn, "_on_cuda", lambda: True)  # get past the device check
    x = _inputs(case, key)
    args = (x["q"], x["k"], x["v"], None, None, None, None, None)
    with pytest.raises(NotImplementedError, match=message):
        jax.eval_shape(
            functools.partial(
                _cudnn.CUDNN.fwd, spec=case.spec, params=FwdParams(), interpret=False
            ),
            *args,
        )


def test_cudnn_refuses_a_bias_it_would_round(
    key: jax.Array, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuDNN adds the bias in the inputs' dtype: a float32 one is refused, not rounded to 16 bits
    (the spec adds it in float32); one in the inputs' dtype runs."""
    monkeypatch.setattr(_cudnn, "_on_cuda", lambda: True)  # get past the device check
    case = Case(dtype="bfloat16", bias="full")
    x = _inputs(case, key)
    fwd = functools.partial(_cudnn.CUDNN.fwd, spec=case.spec, params=FwdParams(), interpret=False)
    wide = x["bias"].astype(jnp.float32)
    with pytest.raises(NotImplementedError, match=r"bias.astype\('bfloat16'\)"):
        jax.eval_shape(fwd, x["q"], x["k"], x["v"], wide, None, None, None, None)
    _cudnn._check(x["q"], x["k"], case.spec, interpret=False, bias=x["bias"])


@pytest.mark.usefixtures("cudnn_lowering")
def test_cudnn_lowers_for_cuda() -> None:
    """Forward and backward lower for "cuda" on this machine."""
    case = Case(
        batch=1,
        seq_q=128,
        seq_k=128,
        dim=60,
        dtype="bfloat16",
        causal=True,
        bias="full",
        mask=True,
        window=(32, 0),
    )
    spec = case.spec
    fwd = functools.partial(_cudnn.CUDNN.fwd, spec=spec, params=FwdParams(), interpret=False)
    bwd = functools.partial(_cudnn.CUDNN.bwd, spec=spec, params=BwdParams(), interpret=False)

    def both(q, k, v, bias, mask, dout):
        out, lse = fwd(q, k, v, bias, mask, None, None, None)
        return out, lse, bwd(q, k, v, bias, mask, None, None, None, out, lse, dout)

    sds = jax.ShapeDtypeStruct
    q = sds((1, 128, 4, 60), jnp.bfloat16)
    bias = sds((1, 4, 128, 128), jnp.bfloat16)
    mask = sds((1, 1, 128, 128), jnp.bool_)
    lowered = jax.jit(both).trace(q, q, q, bias, mask, q).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "__cudnn$fmha" in text and "Backward" in text


@pytest.mark.usefixtures("cudnn_lowering")
@pytest.mark.parametrize(
    ("dim", "seq", "causal", "window", "statistics"),
    [
        (64, 1024, True, None, False),
        (128, 1024, False, None, False),
        (128, 1024, True, None, True),
        (128, 512, True, None, False),
        (128, 1024, False, (32, 0), True),
        (96, 1024, False, None, False),
        (96, 2048, True, None, True),
        (256, 1024, True, None, False),
    ],
)
def test_cudnn_asks_for_its_statistics_where_they_make_it_faster(
    dim: int, seq: int, causal: bool, window: Any, statistics: bool
) -> None:
    """A call nothing differentiates asks cuDNN's forward for the output alone (its custom call
    returns the output and a workspace) unless the statistics speed it up (causal or a window, head
    dims 65 to 128, from 1024 keys); a differentiated call always asks for them."""
    attention = FlashAttention(platform="cudnn")
    masks = dict(causal=causal, sliding_window=window)

    def infer(q, k, v):
        return attention(q, k, v, **masks)

    def train(q, k, v):
        out, pullback = jax.vjp(lambda *x: attention(*x, **masks), q, k, v)
        return out, pullback(out)

    q = jax.ShapeDtypeStruct((1, seq, 4, dim), jnp.bfloat16)
    assert cudnn_forward_results(infer, q, q, q) == {3 if statistics else 2}
    assert cudnn_forward_results(train, q, q, q) == {3}  # the forward, and the one its vjp reruns


@pytest.mark.usefixtures("cudnn_lowering")
def test_a_forward_without_residuals_refuses_a_backward() -> None:
    attention = FlashAttention(platform="cudnn")
    cfg = AttentionConfig(platform="cudnn", variant="cudnn")
    q = jnp.zeros((1, 128, 4, 64), jnp.bfloat16)
    _, saved = jax.eval_shape(lambda x: attention.fwd(x, x, x, cfg=cfg, residuals=False), q)
    with pytest.raises(ValueError, match="residuals=False"):
        attention.bwd(saved, q, cfg=cfg)


# --- selection and the kernel module ---------------------------------------------------------------


def _small(key: jax.Array, seq: int = 32) -> tuple[jax.Array, jax.Array, jax.Array]:
    kq, kk, kv = jax.random.split(key, 3)
    return (
        jax.random.normal(kq, (1, seq, 4, 16)),
        jax.random.normal(kk, (1, seq, 2, 16)),
        jax.random.normal(kv, (1, seq, 2, 16)),
    )


@pytest.mark.skipif(not ON_CPU, reason="what 'auto' picks on a CPU")
def test_auto_on_cpu_picks_xla(key: jax.Array) -> None:
    q, k, v = _small(key)
    heuristics = ejkfn.AutotunePolicy(allow_autotune=False)
    inv = ejkfn.Invocation.of(FlashAttention(), q, k, v, causal=True)
    cfg, _ = ejkfn.select(inv, ejkfn.Caches(), policy=heuristics)
    assert (cfg.platform, cfg.variant) == ("xla", "dense")
    long = jax.ShapeDtypeStruct((2, 8192, 8, 64), jnp.bfloat16)
    inv = ejkfn.Invocation.of(FlashAttention(), long, long, long, causal=True)
    cfg, _ = ejkfn.select(inv, ejkfn.Caches(), policy=heuristics)
    assert (cfg.platform, cfg.variant) == ("xla", "chunked")
    case = Case(batch=1, seq_q=32, seq_k=32, heads=4, kv_heads=2, dim=16, causal=True)
    x = {**_inputs(case, key), "q": q, "k": k, "v": v}
    out, grads = _jit(_with_grads(_call(case, None)))(x)
    _check(case, x, out, grads)


def test_auto_on_hopper_runs_the_mosaic_forward(
    key: jax.Array, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Hopper, where the heuristic's first choice is cuDNN, it runs the Mosaic forward: with the
    Mosaic backward for small calls and for any call at head dim 64, cuDNN's backward kernel for
    large ones with wider heads; where that refuses, cuDNN trains and the Mosaic forward infers.
    Above head dim 128, cuDNN's backward kernel causal and cuDNN's pair otherwise; where Mosaic
    refuses, and on other GPUs, cuDNN."""
    from ejkfn.attention import _api, _pallas_mosaic, _pallas_mosaic_bwd

    refusal = _api._refusal
    monkeypatch.setattr(_api, "device_kind", lambda: "gpu")
    monkeypatch.setattr(_api, "_native", lambda b: b.platform in ("cudnn", "pallas"))
    hybrid_runs = [True]

    def on_cuda(backend, shape, args, kwargs, params):
        # cuDNN's kernels cannot trace off a CUDA GPU; Mosaic's own refusals stand.
        if backend.platform == "cudnn":
            return None
        if params[1].variant == _pallas_mosaic.CUDNN_BWD:
            return None if hybrid_runs[0] else "cuDNN's backward refuses"
        return refusal(backend, shape, args, kwargs, params)

    monkeypatch.setattr(_api, "_refusal", on_cuda)
    kernel = FlashAttention()

    def heuristic(
        x: Any, hopper: bool = True, causal: bool = True, **options: Any
    ) -> AttentionConfig:
        monkeypatch.setattr(_api, "_is_hopper", lambda: hopper)
        return kernel.heuristic_cfg(ejkfn.Invocation.of(kernel, x, x, x, causal=causal, **options))

    def mosaic(x: Any) -> tuple[FwdParams, BwdParams]:
        shape = AttentionShape.of(x, x, AttentionSpec(scale=x.shape[-1] ** -0.5, causal=True))
        return _pallas_mosaic.heuristic(shape)

    small = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)  # 2**19 scores
    fp, bp = mosaic(small)
    assert heuristic(small) == AttentionConfig(platform="pallas", variant="mosaic", fwd=fp, bwd=bp)
    narrow = jax.ShapeDtypeStruct((1, 16384, 2, 64), jnp.bfloat16)  # 2**29 scores
    assert heuristic(narrow) == AttentionConfig(
        platform="pallas", variant="mosaic", fwd=mosaic(narrow)[0], bwd=mosaic(narrow)[1]
    )
    large = jax.ShapeDtypeStruct((1, 16384, 2, 128), jnp.bfloat16)  # 2**29 scores
    fp_large, bp_large = mosaic(large)
    # An H200 trains on the Mosaic backward up to 2**32 scores at every head dim.
    own_scores = _api._own_backward_scores
    assert (own_scores("NVIDIA H200"), own_scores("NVIDIA H100")) == (2**32, 2**28)
    # (an H100's limit, whatever machine runs this: an H200's is above this shape)
    monkeypatch.setattr(_api, "_own_backward_scores", lambda gpu: 2**28)
    cfg = heuristic(large)
    assert (cfg.platform, cfg.variant, cfg.fwd) == ("pallas", "mosaic", fp_large)
    assert cfg.bwd == BwdParams(variant=_pallas_mosaic.CUDNN_BWD)
    monkeypatch.setattr(_api, "_own_backward_scores", lambda gpu: 2**33)
    assert heuristic(large).bwd == bp_large
    monkeypatch.setattr(_api, "_own_backward_scores", lambda gpu: 2**28)
    hybrid_runs[0] = False
    fallback = heuristic(large)
    assert (fallback.platform, fallback.variant) == ("cudnn", "cudnn")
    assert fallback.inference == AttentionConfig(
        platform="pallas", variant="mosaic", fwd=fp_large, bwd=bp_large
    )
    # Above head dim 128, where the Mosaic heuristic names the portable backward (the Mosaic one's
    # widest is 128), causal calls train on cuDNN's backward kernel behind the Mosaic forward at
    # any size; the others on cuDNN's pair, which infers too.
    hybrid_runs[0] = True
    gemma = jax.ShapeDtypeStruct((1, 512, 2, 256), jnp.bfloat16)  # 2**19 scores
    assert _pallas_mosaic_bwd.MAX_HEAD_DIM < 256 and mosaic(gemma)[1].variant in (
        None,
        *PORTABLE_VARIANTS,
    )
    cfg = heuristic(gemma)
    assert (cfg.platform, cfg.variant, cfg.fwd) == ("pallas", "mosaic", mosaic(gemma)[0])
    assert (cfg.bwd, cfg.inference) == (BwdParams(variant=_pallas_mosaic.CUDNN_BWD), None)
    full = heuristic(gemma, causal=False)
    assert (full.platform, full.variant, full.inference) == ("cudnn", "cudnn", None)
    # A window follows the feature rule (the next test): at head dim 64 and 256 keys the Mosaic
    # forward, on its narrow-window key blocks, trains and infers
    window = heuristic(small, sliding_window=256)
    assert (window.platform, window.variant, window.inference) == ("pallas", "mosaic", None)
    assert window.fwd.kv_blocksize == _pallas_mosaic.NARROW_WINDOW_BLOCKS[64][1] < fp.kv_blocksize
    elsewhere = heuristic(small, hopper=False)
    assert (elsewhere.platform, elsewhere.inference) == ("cudnn", None)


_PT, _TRI, _CUDNN = ("pallas", "triton"), ("triton", "triton"), ("cudnn", "cudnn")
_MOS = ("pallas", "mosaic")
_MOS_CUDNN = ("pallas", "mosaic", "cudnn")  # the Mosaic forward on cuDNN's backward kernel


@pytest.mark.parametrize(
    ("dim", "causal", "feature", "training", "inference"),
    [
        (64, True, "soft_cap", _TRI, _TRI),
        (128, False, "soft_cap+mask", _TRI, _TRI),  # the soft cap decides
        (64, True, "segments", _PT, _PT),
        (64, True, "segments+dropout", _PT, _PT),  # the segments decide
        (128, True, "segments", _TRI, _TRI),
        (64, False, "mask", _PT, _PT),
        (128, False, "mask", _TRI, _PT),
        (128, True, "mask", _TRI, _TRI),
        (64, True, "bias", _PT, _PT),
        (64, False, "bias", _PT, _TRI),
        (64, True, "bias_f32", _PT, _TRI),  # a float32 bias infers on Triton at D = 64 causal
        (128, False, "bias_f32", _TRI, _TRI),
        (128, True, "bias", _PT, _TRI),
        (128, False, "bias", _TRI, _TRI),
        # above head dim 128 Triton (dV and dK apart) trains and infers with a mask or a bias
        (256, True, "mask", _TRI, _TRI),
        (256, False, "mask", _TRI, _TRI),
        (256, True, "bias", _TRI, _TRI),
        (256, False, "bias", _TRI, _TRI),
        (256, True, "bias_f32", _TRI, _TRI),
        (256, True, "soft_cap", _TRI, _TRI),
        (64, True, "dropout", _TRI, _TRI),
        (128, True, "dropout", _TRI, _TRI),
        (64, False, "dropout", _TRI, _TRI),
        (128, False, "dropout", _TRI, _TRI),
        (64, False, "segments", _TRI, _PT),
        (128, False, "segments", _TRI, _TRI),
        (64, True, "window", _MOS, _MOS),
        (64, False, "window", _MOS, _MOS),  # 128 keys seen, both sides
        (64, True, "window_512", _MOS, _MOS),
        (64, True, "wide_window", _MOS, _MOS),  # the Mosaic pair trains up to 2048 keys
        # cuDNN's pair is faster from 2049 keys; the Mosaic forward on cuDNN's backward kernel more
        (64, True, "wider_window", _MOS_CUDNN, _MOS),
        (128, True, "window", _MOS, _MOS),
        (128, True, "window_512", _MOS_CUDNN, _MOS),  # Mosaic's pair trains up to 256 keys
        # cuDNN, which would train, refuses a window right of the diagonal: the default order
        # trains, the Mosaic forward on the portable backward
        (128, False, "window_256_a_side", _MOS, _MOS),
        (64, False, "window_1024_a_side", _MOS, _MOS),
        (128, False, "window_512_a_side", _MOS, _MOS),
        (128, True, "window_1024", _MOS_CUDNN, _MOS),
        (256, True, "window", _CUDNN, _MOS),  # even on cuDNN's backward kernel
        # cuDNN refuses it: Triton's pair trains (the default order's 0.88x there)
        (256, False, "window_256_a_side", _TRI, _MOS),
    ],
)
def test_auto_on_hopper_orders_backends_by_feature(
    dim: int,
    causal: bool,
    feature: str,
    training: tuple[str, str],
    inference: tuple[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Calls with a feature take the backends measured fastest with it
    (``_api._feature_backends``); on other GPUs, cuDNN where it can."""
    from ejkfn.attention import _api

    refusal = _api._refusal
    monkeypatch.setattr(_api, "device_kind", lambda: "gpu")
    monkeypatch.setattr(_api, "_native", lambda b: b.platform in ("cudnn", "pallas", "triton"))

    def on_cuda(backend, shape, args, kwargs, params):
        # cuDNN's and Triton's kernels cannot trace off a CUDA GPU: their checks stand.
        if backend.platform == "cudnn":
            q, k, _, bias = (None if x is None else jnp.zeros(x.shape, x.dtype) for x in args[:4])
            try:
                _cudnn._check(q, k, shape.spec, interpret=False, bias=bias)
            except NotImplementedError as refused:
                return str(refused)
            return None
        if backend.platform == "triton":
            features = shape.spec.features & backend.unsupported
            return f"refuses {sorted(features)}" if features else None
        return refusal(backend, shape, args, kwargs, params)

    monkeypatch.setattr(_cudnn, "_on_cuda", lambda: True)
    monkeypatch.setattr(_api, "_refusal", on_cuda)
    x = jax.ShapeDtypeStruct((1, 256, 4, dim), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    arrays = {
        "soft_cap": dict(logits_soft_cap=30.0),
        "segments": dict(q_segment_ids=ids, kv_segment_ids=ids),
        "mask": dict(attention_mask=jax.ShapeDtypeStruct((1, 1, 256, 256), jnp.bool_)),
        "bias": dict(bias=jax.ShapeDtypeStruct((1, 4, 256, 256), jnp.bfloat16)),
        "bias_f32": dict(bias=jax.ShapeDtypeStruct((1, 4, 256, 256), jnp.float32)),
        "dropout": dict(dropout_prob=0.1, dropout_seed=jax.ShapeDtypeStruct((), jnp.uint32)),
        "window": dict(sliding_window=64),
        "window_512": dict(sliding_window=(512, 0)),
        "window_256_a_side": dict(sliding_window=256),
        "window_512_a_side": dict(sliding_window=512),
        "window_1024_a_side": dict(sliding_window=1024),
        "window_1024": dict(sliding_window=(1024, 0)),
        "wide_window": dict(sliding_window=(2048, 0)),
        "wider_window": dict(sliding_window=(2049, 0)),
    }
    options = {k: v for name in feature.split("+") for k, v in arrays[name].items()}
    kernel = FlashAttention()
    inv = ejkfn.Invocation.of(kernel, x, x, x, causal=causal, **options)
    monkeypatch.setattr(_api, "_is_hopper", lambda: True)
    cfg = kernel.heuristic_cfg(inv)
    assert (cfg.platform, cfg.variant) == training[:2]
    assert (cfg.bwd.variant == "cudnn") == (training == _MOS_CUDNN)
    infers = cfg.inference or cfg
    assert (infers.platform, infers.variant) == inference
    monkeypatch.setattr(_api, "_is_hopper", lambda: False)
    elsewhere = kernel.heuristic_cfg(inv)
    refused = {"dropout", "soft_cap", "segments", "bias_f32"} & set(feature.split("+"))  # by cuDNN
    looks_right = not causal and feature.startswith("window")  # cuDNN's windows look left only
    assert elsewhere.platform == ("pallas" if refused or looks_right else "cudnn")


@pytest.mark.parametrize("hopper", [True, False])
@pytest.mark.parametrize(
    ("dim", "causal", "feature", "platform"),
    [
        (64, True, {}, "triton"),
        (64, True, {"logits_soft_cap": 30.0}, "triton"),
        (64, False, {"logits_soft_cap": 30.0}, "triton"),
        (64, False, {}, "pallas"),
        (128, False, {}, "triton"),
        (128, True, {"attention_mask": True}, "pallas"),
        (64, True, {"attention_mask": True}, "triton"),
    ],
)
def test_auto_orders_float32_inputs_on_gpus(
    hopper: bool,
    dim: int,
    causal: bool,
    feature: dict[str, Any],
    platform: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Of our kernels (XLA, first for float32, not native here), float32 products spill
    Pallas-Triton's 16-bit blocks: ``auto`` takes Triton next for float32 inputs on any GPU, and
    Pallas-Triton (on its own float32 blocks) where that ran faster: at head dim 64 without a mask
    or a feature, at 128 with a mask tensor. Triton's backward takes blocks that do not spill."""
    from ejkfn.attention import _api

    monkeypatch.setattr(_api, "device_kind", lambda: "gpu")
    monkeypatch.setattr(_api, "_is_hopper", lambda: hopper)
    monkeypatch.setattr(_api, "_native", lambda b: b.platform in ("pallas", "triton"))
    refusal = _api._refusal
    monkeypatch.setattr(  # compiled Triton cannot trace off a CUDA GPU
        _api, "_refusal", lambda b, *call: None if b.platform == "triton" else refusal(b, *call)
    )
    kernel = FlashAttention()
    x = jax.ShapeDtypeStruct((1, 256, 4, dim), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, 1, 256, 256), jnp.bool_)
    options = {k: mask if k == "attention_mask" else v for k, v in feature.items()}
    cfg = kernel.heuristic_cfg(ejkfn.Invocation.of(kernel, x, x, x, causal=causal, **options))
    assert (cfg.platform, cfg.inference) == (platform, None)
    x = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.float32)
    f32 = AttentionShape.of(x, x, AttentionSpec(scale=0.125, causal=True))
    shape = dataclasses.replace(f32, dtype="bfloat16")
    assert _triton.heuristic(f32)[1] == BwdParams(
        q_blocksize=32, kv_blocksize=32, num_warps=4, num_stages=2
    )
    assert _triton.heuristic(shape)[1] != _triton.heuristic(f32)[1]
    # above head dim 128, 16 rows (32 spill there)
    wide = dataclasses.replace(f32, head_dim=256)
    assert [(p.q_blocksize, p.kv_blocksize) for p in _triton.heuristic(wide)] == [(16, 32)] * 2
    # in 16 bits there, 128-row forward blocks; every call trains with dV and dK in programs of
    # their own, each keeping 128 keys on 8 warps, dQ mirrored
    wide = dataclasses.replace(shape, head_dim=256)
    capped = dataclasses.replace(wide, spec=dataclasses.replace(wide.spec, soft_cap=50.0))
    (fwd, plain), (_, other) = _triton.heuristic(wide), _triton.heuristic(capped)
    assert (fwd.q_blocksize, fwd.kv_blocksize, fwd.num_warps) == (128, 64, 8)
    for bwd in (plain, other):
        assert (bwd.q_blocksize, bwd.kv_blocksize, bwd.num_warps, bwd.variant) == (
            32, 128, 8, _triton.SPLIT_DKDV,
        )  # fmt: skip
    assert _triton.dq_launch(plain).rows == 128
    # one float32 accumulator a program: the same blocks keeping both do not fit the registers
    assert not _triton._fits(wide, dataclasses.replace(plain, variant=_triton.MIRRORED), True)
    # Pallas-Triton's forward takes the same 128-row blocks there on 2 stages; with a bias, whose
    # float32 tiles would leave them 1, its blocks before
    biased = dataclasses.replace(wide, spec=dataclasses.replace(wide.spec, has_bias=True))
    fwd, other = _pallas_gpu.heuristic(wide)[0], _pallas_gpu.heuristic(biased)[0]
    assert (fwd.q_blocksize, fwd.kv_blocksize, fwd.num_warps, fwd.num_stages) == (128, 64, 8, 2)
    assert (other.q_blocksize, other.kv_blocksize, other.num_stages) == (64, 32, 2)
    # its backward takes Triton's split blocks, the bias's float32 tiles leaving them 1 stage
    plain, other = _pallas_gpu.heuristic(wide)[1], _pallas_gpu.heuristic(biased)[1]
    assert (plain.q_blocksize, plain.kv_blocksize, plain.num_stages, plain.variant) == (
        32, 128, 2, _pallas_gpu.SPLIT_DKDV,
    )  # fmt: skip
    assert (other.kv_blocksize, other.num_stages, other.variant) == (128, 1, _pallas_gpu.SPLIT_DKDV)


@pytest.fixture
def hopper_without_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` on a Hopper GPU where XLA, Pallas and Triton are native and Triton takes the call
    (compiled Triton cannot trace off a CUDA GPU)."""
    from ejkfn.attention import _api

    monkeypatch.setattr(_api, "device_kind", lambda: "gpu")
    monkeypatch.setattr(_api, "_is_hopper", lambda: True)
    monkeypatch.setattr(_api, "_native", lambda b: b.platform in ("xla", "pallas", "triton"))
    refusal = _api._refusal
    monkeypatch.setattr(
        _api, "_refusal", lambda b, *call: None if b.platform == "triton" else refusal(b, *call)
    )


@pytest.mark.parametrize(
    ("q_len", "k_len", "dtype", "platform", "variant"),
    [
        (4096, 4096, jnp.float32, "xla", "chunked"),  # the scores would be large
        (1024, 1024, jnp.float32, "xla", "dense"),
        (1, 32768, jnp.float32, "xla", "dense"),  # decoding, and training there
        (1, 32768, jnp.bfloat16, "triton", "triton"),  # 16-bit decoding keeps its order
    ],
)
@pytest.mark.usefixtures("hopper_without_cudnn")
def test_auto_takes_xla_first_for_float32_on_gpus(
    q_len: int, k_len: int, dtype: Any, platform: str, variant: str
) -> None:
    """XLA's full-precision attention ran ahead of our FMA kernels with float32 inputs (2.3-7.8x
    forward+backward on an H200): ``auto`` trains and infers there, dense or chunked by the size of
    the scores, for decoding calls too."""
    kernel = FlashAttention()
    q = jax.ShapeDtypeStruct((4, q_len, 16, 128), dtype)
    kv = jax.ShapeDtypeStruct((4, k_len, 8, 128), dtype)
    cfg = kernel.heuristic_cfg(ejkfn.Invocation.of(kernel, q, kv, kv, causal=True))
    assert (cfg.platform, cfg.variant, cfg.inference) == (platform, variant, None)


@pytest.mark.usefixtures("hopper_without_cudnn")
def test_auto_infers_a_float32_causal_call_at_head_dim_64_on_triton() -> None:
    """There Triton's forward ran 1.2-1.7x XLA's on an H200 while XLA trained faster: ``auto``
    trains on XLA and infers on Triton. Not at head dim 128, without the causal mask, with another
    feature, or decoding (XLA read faster or it was not measured)."""
    from ejkfn.attention import _api

    kernel = FlashAttention()

    def cfg_of(seq_q: int = 2048, dim: int = 64, **options: Any) -> AttentionConfig:
        q = jax.ShapeDtypeStruct((2, seq_q, 8, dim), jnp.float32)
        kv = jax.ShapeDtypeStruct((2, 2048, 8, dim), jnp.float32)
        return kernel.heuristic_cfg(ejkfn.Invocation.of(kernel, q, kv, kv, **options))

    cfg = cfg_of(causal=True)
    assert (cfg.platform, cfg.inference.platform, cfg.inference.variant) == (
        "xla", "triton", "triton"
    )  # fmt: skip
    assert (
        cfg.inference.fwd
        == _api.backend_for("triton", "triton").heuristic(
            AttentionShape.of(
                jax.ShapeDtypeStruct((2, 2048, 8, 64), jnp.float32),
                jax.ShapeDtypeStruct((2, 2048, 8, 64), jnp.float32),
                AttentionSpec(scale=0.125, causal=True),
            )
        )[0]
    )
    for other in (
        cfg_of(dim=128, causal=True),
        cfg_of(),
        cfg_of(causal=True, logits_soft_cap=20.0),
        cfg_of(seq_q=1, causal=True),
    ):
        assert (other.platform, other.inference) == ("xla", None), other


def test_window_keys_count_the_right_side_only_without_the_causal_mask() -> None:
    """The keys a window lets a query see besides its own, which every window rule compares."""
    assert AttentionSpec(scale=1.0, causal=True).window_keys is None
    assert AttentionSpec(scale=1.0, causal=True, window=(256, 4096)).window_keys == 256
    assert AttentionSpec(scale=1.0, window=(256, 100)).window_keys == 356


@pytest.mark.usefixtures("hopper_without_cudnn")
@pytest.mark.parametrize(
    ("window", "causal", "dim", "trains", "infers"),
    [
        ((256, 256), True, 128, "triton", None),  # Triton trained 1.68x XLA
        ((512, 512), True, 64, "triton", None),  # 1.74x at 1x16384x16x64
        ((768, 0), True, 64, "triton", None),  # 1.10x at 2x8192x16x64
        ((768, 0), True, 128, "xla", "triton"),  # Triton trained 0.98x XLA
        ((512, 0), True, 96, "triton", None),  # 1.12x at head dim 128
        ((1024, 1024), True, 128, "xla", "triton"),  # XLA trained 1.26x; Triton inferred 1.36x
        ((1024, 1024), True, 64, "xla", "triton"),
        ((256, 256), False, 128, "xla", "triton"),  # 512 keys seen: XLA trained 1.40x, Triton
        # inferred 1.16x
        ((1024, 1024), False, 128, "xla", None),  # 2048 seen: XLA 1.42x Triton's forward
        ((4096, 4096), True, 128, "xla", None),  # 4096 seen: XLA 1.41x
        ((256, 256), True, 256, "xla", "triton"),  # Triton inferred 1.24x, XLA trained 1.55x
        ((512, 0), True, 256, "xla", None),  # not measured
    ],
)
def test_auto_runs_a_float32_call_with_a_narrow_window_on_triton(
    window: tuple[int, int], causal: bool, dim: int, trains: str, infers: str | None
) -> None:
    """With a sliding window Triton's float32 forward led XLA's on an H200 while each query saw at
    most 1024 keys, its forward+backward causal up to 512 keys (768 at head dim 64): ``auto``
    trains on XLA first for float32 but on Triton there, and infers on Triton where only its
    forward led."""
    kernel = FlashAttention()
    x = jax.ShapeDtypeStruct((2, 8192, 8, dim), jnp.float32)
    call = ejkfn.Invocation.of(kernel, x, x, x, causal=causal, sliding_window=window)
    cfg = kernel.heuristic_cfg(call)
    assert cfg.platform == trains
    assert (cfg.inference and cfg.inference.platform) == infers, cfg
    with_soft_cap = ejkfn.Invocation.of(
        kernel, x, x, x, causal=causal, sliding_window=window, logits_soft_cap=20.0
    )
    other = kernel.heuristic_cfg(with_soft_cap)  # another feature: not measured
    assert (other.platform, other.inference) == ("xla", None)


def test_auto_on_hopper_infers_on_the_training_backend_where_the_other_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A causal bias at head dim 128 trains on Pallas-Triton and infers on Triton; where Triton
    refuses the call, Pallas-Triton infers too (the default order would have put cuDNN first)."""
    from ejkfn.attention import _api

    refusal = _api._refusal
    triton_refuses = [False]
    monkeypatch.setattr(_api, "device_kind", lambda: "gpu")
    monkeypatch.setattr(_api, "_is_hopper", lambda: True)
    monkeypatch.setattr(_api, "_native", lambda b: b.platform in ("cudnn", "pallas", "triton"))

    def on_cuda(backend, shape, args, kwargs, params):
        if backend.platform == "triton":
            return "refused for the test" if triton_refuses[0] else None
        return (
            None if backend.platform == "cudnn" else refusal(backend, shape, args, kwargs, params)
        )

    monkeypatch.setattr(_api, "_refusal", on_cuda)
    x = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 4, 256, 256), jnp.bfloat16)
    kernel = FlashAttention()
    inv = ejkfn.Invocation.of(kernel, x, x, x, bias, causal=True)
    cfg = kernel.heuristic_cfg(inv)
    assert (cfg.platform, cfg.variant, cfg.inference.platform) == ("pallas", "triton", "triton")
    triton_refuses[0] = True
    cfg = kernel.heuristic_cfg(inv)
    assert (cfg.platform, cfg.variant, cfg.inference) == ("pallas", "triton", None)


def test_explicit_platform_heuristics(key: jax.Array) -> None:
    q, k, v = _small(key)
    for backend in [_backend_of(p) for p in ALL]:
        kernel = FlashAttention(platform=backend.platform)
        inv = ejkfn.Invocation.of(kernel, q, k, v, causal=True)
        cfg = kernel.heuristic_cfg(inv)
        assert cfg.platform == backend.platform
        assert {c.platform for c in kernel.candidate_cfgs(inv)} == {backend.platform}


def test_select_with_tuner_picks_a_candidate(key: jax.Array) -> None:
    q, k, v = _small(key, seq=64)
    kernel = FlashAttention()
    inv = ejkfn.Invocation.of(kernel, q, k, v, causal=True)
    candidates = list(kernel.candidate_cfgs(inv))
    assert len(candidates) >= 2
    assert {c.variant for c in candidates if c.platform == "xla"} == {"dense", "chunked"}
    before = ejkfn.Caches()
    policy = ejkfn.AutotunePolicy(persist_autotune=False)
    decision, after = ejkfn.decide(
        inv, before, policy=policy, tuner=ejkfn.Tuner(warmup=1, iters=2, progress=False)
    )
    assert decision.tier == "autotune"
    assert decision.cfg in candidates
    assert len(decision.tune.results) == len(candidates)
    assert decision.tune.reference.platform == "xla" and not decision.tune.failures
    assert before.lookup(inv.key) is None  # the input caches are unchanged
    assert after.lookup(inv.key) == ("memory", decision.cfg)
    out = _jit(functools.partial(kernel.with_cfg(decision.cfg), causal=True))(q, k, v)
    case = Case(batch=1, seq_q=64, seq_k=64, heads=4, kv_heads=2, dim=16, causal=True)
    _close(
        "out",
        out,
        _reference(case, {**_inputs(case, key), "q": q, "k": k, "v": v})[0],
        TOL["float32"][0],
    )


def test_configured_module_in_jit_does_not_retrace(key: jax.Array) -> None:
    q, k, v = _small(key)
    cfg = AttentionConfig(
        platform="xla", variant="chunked", fwd=FwdParams(q_blocksize=16, kv_blocksize=16)
    )
    traces: list[int] = []

    @jax.jit
    def loss(attn: FlashAttention, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        traces.append(1)
        return attn(q, k, v, causal=True, sliding_window=(8, 0)).sum()

    attn = FlashAttention(platform="xla").with_cfg(cfg)
    first = loss(attn, q, k, v)
    second = loss(attn, q * 2, k, v)
    third = loss(FlashAttention(platform="xla", cfg=cfg), q, k, v)  # an equal module
    assert len(traces) == 1
    assert float(first) == float(third) and float(first) != float(second)
    grad = jax.jit(jax.grad(loss, argnums=1))
    grad(attn, q, k, v)
    traced = len(traces)
    grad(attn, q * 3, k, v)
    assert len(traces) == traced
    other = AttentionConfig(platform="xla", variant="dense")
    loss(attn.with_cfg(other), q, k, v)  # a different config is a different program
    assert len(traces) == traced + 1


def test_module_hashes_and_compares() -> None:
    cfg = AttentionConfig(platform="xla", variant="dense")
    a = FlashAttention(platform="xla").with_cfg(cfg)
    b = FlashAttention(platform="xla", cfg=cfg)
    assert a == b and hash(a) == hash(b)
    assert a != FlashAttention(platform="auto", cfg=cfg)
    assert FlashAttention().cfg is None


# --- validation ------------------------------------------------------------------------------------

Q = (2, 8, 4, 16)
KV = (2, 8, 2, 16)


def _arrays(q=Q, k=KV, v=None, dtype=jnp.float32):
    v = k if v is None else v
    return (jnp.ones(q, dtype), jnp.ones(k, dtype), jnp.ones(v, dtype))


BAD = [
    ("q_rank", dict(arrays=_arrays(q=(2, 8, 16))), ValueError, r"q must have rank 4.*\(2, 8, 16\)"),
    ("k_rank", dict(arrays=_arrays(k=(2, 8, 2, 16, 1))), ValueError, "k must have rank 4"),
    ("batch", dict(arrays=_arrays(k=(3, 8, 2, 16))), ValueError, r"batch size.*\(3, 8, 2, 16\)"),
    ("head_dim", dict(arrays=_arrays(k=(2, 8, 2, 8))), ValueError, r"head_dim.*\(2, 8, 2, 8\)"),
    ("kv_shapes", dict(arrays=_arrays(v=(2, 9, 2, 16))), ValueError, r"v.shape=\(2, 9, 2, 16\)"),
    ("kv_heads", dict(arrays=_arrays(k=(2, 8, 3, 16))), ValueError, "kv_heads=3"),
    ("dtype", dict(arrays=_arrays(dtype=jnp.int32)), TypeError, "q must be floating point"),
    (
        "mixed_dtypes",
        dict(arrays=(jnp.ones(Q), jnp.ones(KV, jnp.bfloat16), jnp.ones(KV))),
        TypeError,
        "bfloat16",
    ),
    ("window_negative", dict(sliding_window=-1), ValueError, "sliding_window=-1"),
    ("window_side", dict(sliding_window=(2, -3)), ValueError, r"\(2, -3\)"),
    ("window_type", dict(sliding_window="wide"), TypeError, "wide"),
    ("window_triple", dict(sliding_window=(1, 2, 3)), TypeError, r"\(1, 2, 3\)"),
    ("soft_cap_zero", dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap=0.0"),
    ("soft_cap_negative", dict(logits_soft_cap=-2.0), ValueError, "logits_soft_cap=-2.0"),
    ("scale_nan", dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("scale_array", dict(softmax_scale=jnp.float32(0.5)), TypeError, "softmax_scale"),
    ("causal_type", dict(causal="yes"), TypeError, "causal"),
    ("segments_alone", dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32)), ValueError, "together"),
    (
        "segments_shape",
        dict(
            q_segment_ids=jnp.zeros((2, 7), jnp.int32), kv_segment_ids=jnp.zeros((2, 8), jnp.int32)
        ),
        ValueError,
        r"q_segment_ids.shape=\(2, 7\)",
    ),
    (
        "kv_segments_shape",
        dict(
            q_segment_ids=jnp.zeros((2, 8), jnp.int32), kv_segment_ids=jnp.zeros((1, 8), jnp.int32)
        ),
        ValueError,
        r"kv_segment_ids.shape=\(1, 8\)",
    ),
    (
        "segments_dtype",
        dict(q_segment_ids=jnp.zeros((2, 8)), kv_segment_ids=jnp.zeros((2, 8))),
        TypeError,
        "q_segment_ids must be integers",
    ),
    (
        "mask_shape",
        dict(attention_mask=jnp.ones((2, 4, 8, 7), bool)),
        ValueError,
        r"attention_mask.shape=\(2, 4, 8, 7\)",
    ),
    ("mask_dtype", dict(attention_mask=jnp.ones((8, 8))), TypeError, "attention_mask must be"),
    ("bias_shape", dict(bias=jnp.ones((3, 1, 8, 8))), ValueError, r"bias.shape=\(3, 1, 8, 8\)"),
    ("bias_rank", dict(bias=jnp.ones((1, 2, 4, 8, 8))), ValueError, "bias.shape"),
    ("dropout_no_seed", dict(dropout_prob=0.1), ValueError, "dropout_seed"),
    ("dropout_one", dict(dropout_prob=1.0, dropout_seed=0), ValueError, "dropout_prob=1.0"),
    (
        "seed_shape",
        dict(dropout_prob=0.1, dropout_seed=jnp.zeros((2,), jnp.uint32)),
        ValueError,
        r"dropout_seed.shape=\(2,\)",
    ),
]


@pytest.mark.parametrize(("case", "error", "match"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_invalid_calls_name_the_value(case: dict[str, Any], error: type, match: str) -> None:
    case = dict(case)
    arrays = case.pop("arrays", _arrays())
    bias = case.pop("bias", None)
    with pytest.raises(error, match=match):
        FlashAttention()(*arrays, bias, **case)


BAD_PUBLIC = [
    ("platform", dict(platform="nope"), ValueError, "platform='nope'"),
    (
        "cfg_conflict",
        dict(platform="xla", cfg=AttentionConfig(platform="cudnn")),
        ValueError,
        "disagrees",
    ),
    ("variant", dict(cfg=AttentionConfig(platform="xla", variant="nope")), ValueError, "'nope'"),
    ("kv_heads", dict(arrays=_arrays(k=(2, 8, 3, 16))), ValueError, "kv_heads=3"),
    ("segments_alone", dict(kv_segment_ids=jnp.zeros((2, 8), jnp.int32)), ValueError, "together"),
    ("dropout_no_seed", dict(dropout_prob=0.5), ValueError, "dropout_seed"),
    ("window_negative", dict(sliding_window=(-1, 0)), ValueError, r"\(-1, 0\)"),
]


@pytest.mark.parametrize(
    ("case", "error", "match"), [b[1:] for b in BAD_PUBLIC], ids=[b[0] for b in BAD_PUBLIC]
)
def test_invalid_public_calls(case: dict[str, Any], error: type, match: str) -> None:
    case = dict(case)
    arrays = case.pop("arrays", _arrays())
    with pytest.raises(error, match=match):
        flash_attention(*arrays, **case)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="'auto'"):
        AttentionConfig(platform="auto")
    with pytest.raises(ValueError, match="'tpu'"):
        AttentionConfig(platform="tpu")
    with pytest.raises(TypeError, match="FwdParams"):
        AttentionConfig(platform="xla", fwd=BwdParams())
    with pytest.raises(ValueError, match="variant"):
        AttentionConfig(platform="xla", variant="")
    with pytest.raises(ValueError, match="platform='gpu'"):
        FlashAttention(platform="gpu")
    cfg = AttentionConfig(platform="xla", variant="chunked", fwd=FwdParams(q_blocksize=32))
    assert ejkfn.from_json(ejkfn.to_json(cfg)) == cfg
    both = AttentionConfig(platform="xla", variant="dense", inference=cfg)
    assert ejkfn.from_json(ejkfn.to_json(both)) == both
    with pytest.raises(TypeError, match="inference must be None or an AttentionConfig"):
        AttentionConfig(platform="xla", inference=FwdParams())
    with pytest.raises(ValueError, match="must not have an inference config of its own"):
        AttentionConfig(platform="xla", inference=both)
    mixed = AttentionConfig(platform="xla", inference=AttentionConfig(platform="triton"))
    q = jnp.ones((1, 8, 1, 8))
    with pytest.raises(ValueError, match=r"cfg\.inference\.platform='triton'"):
        flash_attention(q, q, q, platform="xla", cfg=mixed)


def test_inference_config_serves_calls_nothing_differentiates(key: jax.Array) -> None:
    """A config's ``inference`` runs calls that are not differentiated (here chunked XLA, whose
    scan marks it in the program), the config itself those that are (dense XLA)."""
    q, k, v = (jax.random.normal(kk, (1, 96, 2, 16)) for kk in jax.random.split(key, 3))
    dense = AttentionConfig(platform="xla", variant="dense")
    cfg = dataclasses.replace(dense, inference=AttentionConfig(platform="xla", variant="chunked"))

    def attend(q, cfg):
        return ejkfn.flash_attention(q, k, v, causal=True, cfg=cfg)

    def loops(fn, *args):
        text = str(jax.make_jaxpr(fn)(*args))
        return "scan" in text or "while" in text

    assert loops(functools.partial(attend, cfg=cfg), q)
    assert not loops(functools.partial(attend, cfg=dense), q)
    assert not loops(jax.grad(lambda q: attend(q, cfg).sum()), q)
    np.testing.assert_allclose(attend(q, cfg), attend(q, dense), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        jax.grad(lambda q: attend(q, cfg).sum())(q),
        jax.grad(lambda q: attend(q, dense).sum())(q),
        rtol=1e-5,
        atol=1e-5,
    )


# --- properties --------------------------------------------------------------------------------------


@st.composite
def _cases(draw: st.DrawFn) -> tuple[Case, tuple[int, int, int, int]]:
    kv_heads = draw(st.sampled_from([1, 2]))
    window = draw(st.none() | st.integers(0, 6) | st.tuples(st.integers(0, 10), st.integers(0, 10)))
    case = Case(
        batch=draw(st.integers(1, 2)),
        seq_q=draw(st.integers(1, 24)),
        seq_k=draw(st.integers(1, 24)),
        heads=kv_heads * draw(st.sampled_from([1, 2])),
        kv_heads=kv_heads,
        dim=draw(st.sampled_from([4, 8, 12])),
        causal=draw(st.booleans()),
        window=window,
        bias=draw(st.sampled_from([None, "full", "heads", "2d", "rows"])),
        mask=draw(st.booleans()),
        segments=draw(st.booleans()),
        soft_cap=draw(st.none() | st.floats(1.0, 20.0)),
        scale=draw(st.none() | st.floats(0.05, 1.0)),
        dropout=draw(st.sampled_from([0.0, 0.0, 0.3])),
    )
    blocks = tuple(draw(st.sampled_from([4, 8, 16, 64])) for _ in range(4))
    return case, blocks


@pytest.mark.parametrize("variant", ["dense", "chunked"])  # two tests: xdist runs them in parallel
@settings(max_examples=8, deadline=None, derandomize=True)
@given(drawn=_cases(), seed=st.integers(0, 2**30))
def test_property_xla_matches_reference(
    variant: str, drawn: tuple[Case, tuple[int, ...]], seed: int
) -> None:
    case, (fq, fk, bq, bk) = drawn
    cfg = AttentionConfig(
        platform="xla",
        variant=variant,
        fwd=FwdParams(q_blocksize=fq, kv_blocksize=fk),
        bwd=BwdParams(q_blocksize=bq, kv_blocksize=bk),
    )
    x = _inputs(case, jax.random.key(seed))
    out, grads = _jit(_with_grads(_call(case, cfg)))(x)
    _check(case, x, out, grads)


if SHAPE_REFUSALS:  # only where a native backend refuses some shapes (cuDNN on a GPU)

    @pytest.mark.parametrize(("backend", "case"), SHAPE_REFUSALS)
    def test_shape_dependent_refusals_name_the_platform(
        backend: AttentionBackend, case: Case
    ) -> None:
        x = _inputs(_in_dtype(backend, case), jax.random.key(1))
        with pytest.raises(NotImplementedError, match=backend.platform):
            jax.jit(_with_grads(_call(_in_dtype(backend, case), _cfg(backend, case))))(x)


@pytest.mark.parametrize(
    ("pairs", "blocks", "stream"),
    [(64, 64, 1 << 20), (40, 2, 1 << 10), (7, 32, 1 << 10), (256, 8, 1 << 20), (2, 512, 1 << 10),
     (64, 64, 4 << 20), (64, 8, 64 << 20)],
)  # fmt: skip
def test_causal_bands_divide_the_pairs_and_hold_enough_tiles(
    pairs: int, blocks: int, stream: int
) -> None:
    band = band_pairs(pairs, blocks, True, stream)
    allowed = [d for d in range(1, 17) if pairs % d == 0 and (d == 1 or d * stream <= BAND_BYTES)]
    assert band in allowed
    # The fewest pairs that reach 1024 tiles, else as many as the L2 budget allows.
    smaller = [d for d in allowed if d < band]
    assert all(d * blocks < 1024 for d in smaller)
    assert band * blocks >= 1024 or band == max(allowed)
    assert band_pairs(pairs, blocks, False, stream) == 1


# One compile a shape instead of one per operation and shape: eagerly this test took 30 s.
_segment_spans = jax.jit(segment_spans)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    batch=st.integers(1, 3),
    seq_q=st.integers(1, 40),
    seq_k=st.integers(1, 40),
    ids=st.integers(1, 6),
    sorted_ids=st.booleans(),
    seed=st.integers(0, 2**30),
)
def test_segment_spans_bound_every_match(
    batch: int, seq_q: int, seq_k: int, ids: int, sorted_ids: bool, seed: int
) -> None:
    """Each row's span runs from the first to past the last row of the other side with its id
    ((other length, 0) where none has it), so a block may skip whatever lies outside its spans."""
    rng = np.random.default_rng(seed)
    q_seg, kv_seg = (rng.integers(0, ids, (batch, n)) for n in (seq_q, seq_k))
    if sorted_ids:
        q_seg, kv_seg = np.sort(q_seg, axis=1), np.sort(kv_seg, axis=1)
    q_side, kv_side = (
        np.asarray(x) for x in _segment_spans(jnp.asarray(q_seg), jnp.asarray(kv_seg))
    )
    for side, mine, other in ((q_side, q_seg, kv_seg), (kv_side, kv_seg, q_seg)):
        assert side.dtype == np.int32 and side.shape == (batch, 3, mine.shape[1])
        np.testing.assert_array_equal(side[:, 0], mine)
        for b in range(batch):
            for i, id_ in enumerate(mine[b]):
                at = np.flatnonzero(other[b] == id_)
                want = (at[0], at[-1] + 1) if at.size else (other.shape[1], 0)
                assert tuple(side[b, 1:, i]) == want, (b, i)


@pytest.mark.parametrize("dim", [64, 96, 128])
def test_default_scale_written_out_selects_like_the_default(dim: int) -> None:
    """``dim ** -0.5`` and ``1 / sqrt(dim)`` differ in the last bit at some head dims; a call that
    writes the default out must find the configs keyed for the call that leaves it out."""
    q = jnp.zeros((1, 16, 2, dim), jnp.bfloat16)
    kernel = FlashAttention()
    plain = ejkfn.Invocation.of(kernel, q, q, q, causal=True)
    for scale in (dim**-0.5, 1 / math.sqrt(dim), float(np.float32(dim**-0.5))):
        written = ejkfn.Invocation.of(kernel, q, q, q, causal=True, softmax_scale=scale)
        assert written.key == plain.key, scale
    other = ejkfn.Invocation.of(kernel, q, q, q, causal=True, softmax_scale=1.01 * dim**-0.5)
    assert other.key != plain.key


def test_only_the_triton_platform_splits_the_keys() -> None:
    """``FwdParams.kv_splits`` is Triton's (flash decoding); a config asking another platform for
    it is refused naming it, where ignoring it would run another program than the one asked for."""
    x = jnp.ones((1, 1, 2, 32), jnp.float32)
    keys = jnp.ones((1, 64, 2, 32), jnp.float32)
    split = FwdParams(q_blocksize=16, kv_blocksize=16, kv_splits=2)
    chunked = AttentionConfig(platform="xla", variant="chunked", fwd=split)
    with pytest.raises(NotImplementedError, match=r"'xla' \(chunked\).*kv_splits=2"):
        flash_attention(x, keys, keys, cfg=chunked)
    on_triton = dataclasses.replace(chunked, platform="triton", variant="triton")
    want = flash_attention(x, keys, keys, platform="xla")
    np.testing.assert_allclose(flash_attention(x, keys, keys, cfg=on_triton), want, atol=1e-6)
    # the backward's dQ split too, before anything runs
    dq_split = AttentionConfig(platform="xla", variant="dense", bwd=BwdParams(kv_splits=3))
    with pytest.raises(NotImplementedError, match=r"'xla' \(dense\).*bwd.kv_splits=3"):
        flash_attention(x, keys, keys, cfg=dq_split)
    with pytest.raises(ValueError, match="kv_splits=0"):
        BwdParams(kv_splits=0)


@pytest.mark.parametrize(
    ("batch", "seq_q", "heads", "kv_heads", "causal", "platform"),
    [
        (2, 1, 32, 8, True, "triton"),  # one query: its GQA group of 4 folds to 4 rows
        (1, 1, 32, 8, False, "triton"),
        (2, 16, 32, 8, False, "triton"),  # 64 rows folded
        (2, 16, 32, 8, True, "triton"),  # causal: folded too
        (2, 32, 32, 8, False, "triton"),  # 128 rows folded
        (2, 65, 32, 8, False, "triton"),  # 260 rows folded: 65 a head
        (2, 128, 16, 16, True, "triton"),
        (2, 256, 16, 16, True, "triton"),  # 64 tiles of 128 rows
        (4, 129, 16, 16, True, "pallas"),  # 128 tiles of 128 rows
        (1, 2048, 4, 4, True, "pallas"),  # fewer than 8 keys a row
    ],
)
def test_auto_decodes_on_triton_on_gpus(
    batch: int,
    seq_q: int,
    heads: int,
    kv_heads: int,
    causal: bool,
    platform: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call with few queries against many keys infers on Triton's key-splitting forward on a
    GPU (on an H200 it ran 0.96-2.6x cuDNN there, the Mosaic forward 0.09-1.01x), and trains on
    Triton's pair up to 16 queries (1.15-1.48x the Mosaic pair), as other calls do above (the
    Mosaic pair 0.98-1.28x the Triton pair at 32-128); others keep cuDNN (on Hopper the Mosaic
    forward) first."""
    from ejkfn.attention import _api

    monkeypatch.setattr(_api, "device_kind", lambda: "gpu")
    monkeypatch.setattr(_api, "_is_hopper", lambda: True)
    monkeypatch.setattr(_api, "_native", lambda b: b.platform != "cpu")
    refusal = _api._refusal
    monkeypatch.setattr(  # neither compiled Triton nor cuDNN traces off a CUDA GPU
        _api,
        "_refusal",
        lambda b, *call: None if b.platform in ("triton", "cudnn") else refusal(b, *call),
    )
    kernel = FlashAttention()
    q = jax.ShapeDtypeStruct((batch, seq_q, heads, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((batch, 8192, kv_heads, 128), jnp.bfloat16)
    cfg = kernel.heuristic_cfg(ejkfn.Invocation.of(kernel, q, k, k, causal=causal))
    infers = cfg.inference or cfg
    assert infers.platform == platform
    assert (infers.fwd.kv_splits > 1) == (platform == "triton")
    # trains there up to 16 queries, as other calls do above
    trains = "triton" if platform == "triton" and seq_q <= 16 else "pallas"
    assert cfg.platform == trains and (cfg.inference is None) == (trains == platform)
    # platform="xla" decodes on its dense variant: the chunked scan ran 18x slower there
    xla = FlashAttention(platform="xla")
    assert xla.heuristic_cfg(ejkfn.Invocation.of(xla, q, k, k)).variant == (
        "dense" if platform == "triton" else "chunked"
    )


def test_chunked_tiles_follow_a_causal_windows_left_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """A causal window's right side is hidden by the mask: (128, 4096) is the call (128, 0) is, and
    gets its tiles, not those of a window 4096 keys wide."""
    from ejkfn.attention import _xla

    x = jax.ShapeDtypeStruct((2, 8192, 8, 128), jnp.float32)
    monkeypatch.setattr(_xla, "device_kind", lambda: "gpu")

    def tiles(window, causal=True):
        spec = AttentionSpec(scale=0.125, causal=causal, window=window)
        return _xla.CHUNKED.heuristic(AttentionShape.of(x, x, spec))

    assert tiles((128, 4096)) == tiles((128, 0))
    assert tiles((128, 4096))[0].kv_blocksize == 512
    assert tiles((128, 4096), causal=False)[0].kv_blocksize == 2048  # not causal: the wider side


@pytest.mark.parametrize(
    ("shape", "mask", "fwd", "bwd"),
    [
        ((1, 16384, 16, 128), "causal", (1024, 2048), (1024, 2048)),  # an eighth of the keys
        ((8, 2048, 32, 64), "causal", (256, 512), (256, 512)),  # at least 512 keys
        ((1, 16384, 16, 128), "window128", (256, 512), (256, 512)),  # at least 512 keys
        ((2, 8192, 8, 128), "window1024", (512, 1024), (512, 1024)),  # the window's wider side
        ((2, 8192, 8, 128), "window4096", (1024, 2048), (1024, 2048)),  # at most 2048 keys
        ((2, 4096, 8, 256), None, (1024, 4096), (1024, 2048)),  # no mask: long keys
        ((8, 2048, 32, 64), None, (128, 2048), (128, 2048)),  # queries halved to fit
        ((2, 100, 4, 32), None, (100, 100), (100, 100)),  # one tile for a short sequence
    ],
)
def test_chunked_tiles_on_a_gpu_are_long_along_the_keys_within_the_dense_limit(
    shape: tuple[int, ...],
    mask: str | None,
    fwd: tuple[int, int],
    bwd: tuple[int, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """XLA's chunked tiles on a GPU: as long along the keys as the masks allow (an eighth of the
    keys, by half as many queries, under a causal mask; with a window keys as many as its wider
    side, 512 to 2048, by half as many queries), queries then keys halved until the tiles of all
    batches and heads hold no more scores than the dense variant may. Elsewhere (the CPU ran long
    tiles 1.2-2.5x slower) at most 256 x 512."""
    from ejkfn.attention import _xla

    batch, seq, heads, dim = shape
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    window = (int(mask.removeprefix("window")),) * 2 if mask and "window" in mask else None
    spec = AttentionSpec(scale=dim**-0.5, causal=mask == "causal", window=window)
    call = AttentionShape.of(x, x, spec)
    monkeypatch.setattr(_xla, "device_kind", lambda: "gpu")
    fp, bp = _xla.CHUNKED.heuristic(call)
    assert (fp.q_blocksize, fp.kv_blocksize) == fwd
    assert (bp.q_blocksize, bp.kv_blocksize) == bwd
    for q_block, kv_block in (fwd, bwd):
        assert batch * heads * q_block * kv_block <= _xla._DENSE_LIMIT
    monkeypatch.setattr(_xla, "device_kind", lambda: "cpu")
    for params in _xla.CHUNKED.heuristic(call):
        assert params.q_blocksize <= min(256, seq) and params.kv_blocksize <= min(512, seq)
        assert batch * heads * params.q_blocksize * params.kv_blocksize <= 1 << 24
