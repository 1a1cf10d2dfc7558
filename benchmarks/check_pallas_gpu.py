"""Check the Pallas GPU attention kernels on a real Hopper GPU, then time them beside cuDNN.

One run does everything and prints a short table last (device time is scarce):

1. correctness at B=2, S=2048, H=8, D=128 bf16, causal and not, forward and gradients, for the
   Triton-lowering kernels and the Mosaic-GPU forward (its backward is the Triton one), against the
   float32 XLA reference;
2. features on the GPU (GQA, window, bias, segments, soft cap, dropout, ragged lengths, odd head dims,
   float16/float32) through the Triton-lowering kernels;
3. median time of forward and forward+backward over 20 calls at 2x4096x16x128 bf16, causal and not,
   beside ``jax.nn.dot_product_attention(implementation="cudnn")`` and XLA.

Each item is guarded: a failure is reported and the run goes on. Results also go to ``$OUT`` (when set)
as JSON. Run from the repository root: ``python3 benchmarks/check_pallas_gpu.py [--checks-only]``
(``--checks-only``: items 1 and 2, and the Mosaic forward's windows, without the timing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Load only the modules this script needs, without the packages' __init__ files (they import every
# backend and the whole library, which this check does not depend on).
for _name, _dir in (("ejkfn", ROOT / "ejkfn"), ("ejkfn.attention", ROOT / "ejkfn" / "attention")):
    _pkg = types.ModuleType(_name)
    _pkg.__path__ = [str(_dir)]
    sys.modules[_name] = _pkg

from ejkfn._registry import BwdParams, FwdParams  # noqa: E402
from ejkfn.attention import _pallas_gpu, _pallas_mosaic  # noqa: E402
from ejkfn.attention._backend import AttentionShape  # noqa: E402
from ejkfn.attention._reference import reference_attention  # noqa: E402
from ejkfn.attention._spec import AttentionSpec  # noqa: E402

T0 = time.time()
# A dry run on a CPU (interpreters) shrinks every size; on the GPU the sizes are as documented.
SMALL = jax.default_backend() == "cpu"
BUDGET_S = float(os.environ.get("CHECK_BUDGET_S", "360"))
ROWS: list[dict] = []


def log(*a: object) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def guarded(name: str):
    def wrap(fn):
        @functools.wraps(fn)
        def run(*a, **k):
            if time.time() - T0 > BUDGET_S:
                log(f"SKIP {name}: time budget spent")
                ROWS.append(dict(item=name, status="skipped"))
                return None
            try:
                return fn(*a, **k)
            except Exception as e:  # report and go on
                msg = "".join(traceback.format_exception_only(type(e), e)).strip()
                log(f"FAIL {name}: {msg[:1500]}")
                traceback.print_exc(limit=6)
                ROWS.append(dict(item=name, status="error", error=msg[:300]))
                return None

        return run

    return wrap


def inputs(b, sq, sk, h, kvh, d, dtype, seed=0, bias=None, mask=None, segments=False):
    ks = jax.random.split(jax.random.key(seed), 8)
    q = jax.random.normal(ks[0], (b, sq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, sk, kvh, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, sk, kvh, d), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, sq, h, d), jnp.float32).astype(dtype)
    bi = None if bias is None else jax.random.normal(ks[4], (*bias, sq, sk), jnp.float32)
    ma = None if mask is None else jax.random.bernoulli(ks[5], 0.8, (*mask, sq, sk))
    qs = ksg = None
    if segments:
        qs = jnp.sort(jax.random.randint(ks[6], (b, sq), 0, 4), axis=1)
        ksg = jnp.sort(jax.random.randint(ks[7], (b, sk), 0, 4), axis=1)
    return q, k, v, do, bi, ma, qs, ksg


def rel_err(got, want) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    if not np.all(np.isfinite(got)):
        return float("nan")
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))


def check(name, fwd, bwd, spec, args, do, fp, bp, with_bwd=True):
    """Forward (and backward) of one backend against the f32 reference; appends a row."""
    q, k, v, bias, mask, qs, ksg, seed = args
    out, lse = jax.jit(functools.partial(fwd, spec=spec, params=fp))(*args)
    out.block_until_ready()

    @jax.jit
    def ref(q, k, v, bias, do):
        def f(q, k, v, bias):
            return reference_attention(q, k, v, bias, mask, qs, ksg, seed, spec=spec)

        (o, lse), vjp = jax.vjp(f, q, k, v, bias)
        return o, lse, vjp((do.astype(jnp.float32), jnp.zeros_like(lse)))

    ro, rl, rg = ref(q, k, v, bias, do)
    fin = np.isfinite(np.asarray(rl))
    lse_ok = bool(np.array_equal(np.isfinite(np.asarray(lse)), fin))
    lse_err = (
        float(np.max(np.abs(np.asarray(lse)[fin] - np.asarray(rl)[fin]))) if fin.any() else 0.0
    )
    row = dict(item=name, status="ok", out=rel_err(out, ro), lse=lse_err, lse_inf_ok=lse_ok)
    if with_bwd:
        grads = jax.jit(functools.partial(bwd, spec=spec, params=bp))(*args, out, lse, do)
        for gname, got, want in zip(("dq", "dk", "dv", "dbias"), grads, rg, strict=True):
            if got is not None:
                row[gname] = rel_err(got, want)
    ROWS.append(row)
    log(name, {k_: (round(v_, 5) if isinstance(v_, float) else v_) for k_, v_ in row.items()})


def params_for(q, k, spec):
    return _pallas_gpu.heuristic(AttentionShape.of(q, k, spec))


# ----------------------------------------------------------------------------------------------------


@guarded("core")
def core(variant: str, causal: bool):
    b, s, h, d = (1, 256, 2, 128) if SMALL else (2, 2048, 8, 128)
    q, k, v, do, *_ = inputs(b, s, s, h, h, d, jnp.bfloat16, seed=1)
    spec = AttentionSpec(scale=d**-0.5, causal=causal)
    args = (q, k, v, None, None, None, None, None)
    if variant == "triton":
        fp, bp = params_for(q, k, spec)
        check(f"triton {'causal' if causal else 'full'} {b}x{s}x{h}x{d} bf16", _pallas_gpu.fwd,
              _pallas_gpu.bwd, spec, args, do, fp, bp)  # fmt: skip
    else:
        fp, bp = _pallas_mosaic.heuristic(AttentionShape.of(q, k, spec))
        check(f"mosaic {'causal' if causal else 'full'} {b}x{s}x{h}x{d} bf16", _pallas_mosaic.fwd,
              _pallas_mosaic.bwd, spec, args, do, fp, bp)  # fmt: skip


@guarded("features")
def feature(name, b, sq, sk, h, kvh, d, dtype, variant="triton", **kw):
    extra = {n: kw.pop(n) for n in ("bias", "mask", "segments") if n in kw}
    if SMALL:
        sq, sk, h, kvh = max(sq // 8, 1), max(sk // 8, 1), min(h, 2), min(kvh, 2)
        extra = {n: (min(x[0], b), min(x[1], h)) if isinstance(x, tuple) else x
                 for n, x in extra.items()}  # fmt: skip
    q, k, v, do, bias, mask, qs, ksg = inputs(b, sq, sk, h, kvh, d, dtype, seed=2, **extra)
    dropout = kw.pop("dropout", 0.0)
    spec = AttentionSpec(
        scale=d**-0.5,
        dropout_prob=dropout,
        has_bias=bias is not None,
        has_mask=mask is not None,
        has_segments=qs is not None,
        **kw,
    )
    seed = jnp.uint32(7) if dropout else None
    args = (q, k, v, bias, mask, qs, ksg, seed)
    module = _pallas_gpu if variant == "triton" else _pallas_mosaic
    fp, bp = module.heuristic(AttentionShape.of(q, k, spec))
    check(f"{variant} {name}", module.fwd, module.bwd, spec, args, do, fp, bp)


# ----------------------------------------------------------------------------------------------------
# Timing.


def median_time(f, *args, n=1 if SMALL else 20) -> float:
    jax.block_until_ready(f(*args))
    for _ in range(0 if SMALL else 3):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def with_vjp(fwd, bwd, spec, fp, bp):
    @jax.custom_vjp
    def attn(q, k, v):
        return fwd(q, k, v, spec=spec, params=fp)[0]

    def f(q, k, v):
        out, lse = fwd(q, k, v, spec=spec, params=fp)
        return out, (q, k, v, out, lse)

    def b(res, do):
        q, k, v, out, lse = res
        dq, dk, dv, _ = bwd(
            q, k, v, None, None, None, None, None, out, lse, do, spec=spec, params=bp
        )
        return dq, dk, dv

    attn.defvjp(f, b)
    return attn


_CUDNN: dict = {}  # (shape, causal) -> cuDNN's output and gradients, to check each timed config


@guarded("timing")
def timing(impl, causal, fp=None, bp=None, *, shape=(2, 4096, 16, 128), label="", parts="fb"):
    """Median times of forward ('f') and forward+backward ('b'), checked against cuDNN's results."""
    b, s, h, d = (1, 256, 1, 128) if SMALL else shape
    q, k, v, do, *_ = inputs(b, s, s, h, h, d, jnp.bfloat16, seed=3)
    spec = AttentionSpec(scale=d**-0.5, causal=causal)
    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    if impl in ("cudnn", "xla"):
        if SMALL and impl == "cudnn":
            return

        def attn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
    else:
        if impl == "triton":
            module, fwd = _pallas_gpu, _pallas_gpu.fwd
        else:
            module = _pallas_mosaic
            fwd = functools.partial(_pallas_mosaic._forward, interpret=None,
                                    pingpong=impl != "mosaic-nopingpong")  # fmt: skip
        hf, hb = module.heuristic(AttentionShape.of(q, k, spec))
        fp, bp = fp or hf, bp or hb
        attn = with_vjp(fwd, module.bwd, spec, fp, bp)
        label = label or (
            f"{impl} f({fp.q_blocksize},{fp.kv_blocksize},{fp.num_warps}w,{fp.num_stages}s)"
            f" b({bp.q_blocksize},{bp.kv_blocksize},{bp.num_warps}w,{bp.num_stages}s)"
        )

    fwd_f = jax.jit(attn)

    @jax.jit
    def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(do)

    row = dict(item=f"time {label or impl} {b}x{s}x{h}x{d} {'causal' if causal else 'full'}",
               status="ok")  # fmt: skip
    key = (b, s, h, d, causal)
    if impl == "cudnn":
        _CUDNN[key] = fwd_bwd(q, k, v, do)
    elif key in _CUDNN:
        out, grads = fwd_bwd(q, k, v, do)
        want_out, want_grads = _CUDNN[key]
        row["err_out"] = rel_err(out, want_out)
        row["err_grads"] = max(rel_err(a, w) for a, w in zip(grads, want_grads, strict=True))
    if "f" in parts:
        t = median_time(fwd_f, q, k, v)
        row.update(fwd_ms=t * 1e3, fwd_tflops=flops / t / 1e12)
    if "b" in parts:
        t = median_time(fwd_bwd, q, k, v, do)
        row.update(fwdbwd_ms=t * 1e3, fwdbwd_tflops=3.5 * flops / t / 1e12)
    ROWS.append(row)
    log(row)


def mosaic_windows() -> None:
    """The Mosaic forward's sliding windows (with the portable backward behind it): left edges,
    unmasked blocks between, the diagonal; a window narrower than a key block; both sides; ragged
    and unequal lengths; GQA; one cluster a tile (causal from ONE_TILE_CAUSAL_KEYS keys); narrow
    windows on the heuristic's narrower key blocks."""
    bf16, f16 = jnp.bfloat16, jnp.float16
    long = _pallas_mosaic.ONE_TILE_CAUSAL_KEYS
    for name, shape, dtype, kw in [
        ("causal gqa 2x4096x8(2)x128", (2, 4096, 4096, 8, 2, 128), bf16, dict(window=(1000, 0))),
        ("causal narrow 2x2048x8x128", (2, 2048, 2048, 8, 8, 128), bf16, dict(window=(40, 0))),
        ("both sides 1x2048x4x128", (1, 2048, 2048, 4, 4, 128), bf16, dict(window=(300, 200))),
        ("causal gqa ragged 2x3000x8(2)x64", (2, 3000, 3000, 8, 2, 64), f16,
         dict(window=(777, 0))),
        ("causal q shorter 1x1000:1500x4x128", (1, 1000, 1500, 4, 4, 128), bf16,
         dict(window=(500, 0))),
        ("q longer 1x1500:1000x4x128", (1, 1500, 1000, 4, 4, 128), bf16, dict(window=(100, 0))),
        (f"causal clusters 1x{long}x4x128", (1, long, long, 4, 4, 128), bf16,
         dict(window=(3000, 0))),
        ("causal 1x2048x4x256", (1, 2048, 2048, 4, 4, 256), f16, dict(window=(1000, 0))),
        # narrow windows, on NARROW_WINDOW_BLOCKS' key blocks (so are 40 keys and 100 a side above)
        ("both sides ragged 1x1900x4(1)x64", (1, 1900, 1900, 4, 1, 64), f16,
         dict(window=(300, 200))),
        ("causal q shorter 1x1000:1500x4x64", (1, 1000, 1500, 4, 4, 64), bf16,
         dict(window=(100, 0))),
        ("causal gqa 2x4096x8(2)x128 at the limit", (2, 4096, 4096, 8, 2, 128), bf16,
         dict(window=(256, 0))),
        (f"causal clusters narrow 1x{long}x4(2)x64", (1, long, long, 4, 2, 64), bf16,
         dict(window=(1000, 0))),
        (f"causal clusters narrow 1x{long}x4x128", (1, long, long, 4, 4, 128), f16,
         dict(window=(200, 0))),
    ]:  # fmt: skip
        causal = "causal" in name
        feature(
            f"window {kw['window']} {name}", *shape, dtype, variant="mosaic", causal=causal, **kw
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks-only", action="store_true", help="no timing")
    checks_only = parser.parse_args().checks_only
    dev = jax.devices()[0]
    log("device", dev.device_kind, getattr(dev, "compute_capability", "?"), "jax", jax.__version__)
    log("mosaic available():", _pallas_mosaic.available())
    for causal in (False, True):
        core("triton", causal)
        core("mosaic", causal)
    feature("gqa causal ragged 1000x900 d64 bf16", 2, 1000, 900, 8, 2, 64, jnp.bfloat16,
            variant="mosaic", causal=True)  # fmt: skip
    feature("q longer 700x500 d256 f16", 1, 700, 500, 4, 1, 256, jnp.float16,
            variant="mosaic", causal=True)  # fmt: skip
    feature(
        "gqa causal ragged 1000x1100 d80 f16", 2, 1000, 1100, 8, 2, 80, jnp.float16, causal=True
    )
    feature("window+bias+segments+softcap 1024 d128 bf16", 2, 1024, 1024, 8, 4, 128, jnp.bfloat16,
            window=(128, 16), causal=True, bias=(2, 1), segments=True, soft_cap=20.0)  # fmt: skip
    feature("mask+dropout 512 d64 bf16", 2, 512, 640, 4, 4, 64, jnp.bfloat16,
            mask=(1, 4), dropout=0.1)  # fmt: skip
    feature("f32 d64 causal 512", 1, 512, 512, 4, 4, 64, jnp.float32, causal=True)
    mosaic_windows()
    if checks_only:
        report(dev)
        return

    F, B = FwdParams, BwdParams
    fwd_cfgs = [F(q_blocksize=128, kv_blocksize=128, num_warps=8, num_stages=s) for s in (2, 3)]
    fwd_cfgs += [F(q_blocksize=128, kv_blocksize=64, num_warps=4, num_stages=3),
                 F(q_blocksize=64, kv_blocksize=64, num_warps=4, num_stages=3)]  # fmt: skip
    bwd_cfgs = [B(q_blocksize=64, kv_blocksize=128, num_warps=8, num_stages=2),
                B(q_blocksize=128, kv_blocksize=64, num_warps=8, num_stages=2),
                B(q_blocksize=64, kv_blocksize=64, num_warps=4, num_stages=3),
                B(q_blocksize=128, kv_blocksize=128, num_warps=8, num_stages=2)]  # fmt: skip
    mosaic_cfgs = [F(q_blocksize=128, kv_blocksize=64, num_warps=12, num_stages=4),
                   F(q_blocksize=128, kv_blocksize=128, num_warps=12, num_stages=3)]  # fmt: skip
    for causal in (False, True):
        for impl in ("cudnn", "triton", "mosaic", "mosaic-nopingpong", "xla"):
            timing(impl, causal)
        for fp in mosaic_cfgs:
            timing("mosaic", causal, fp, parts="f")
        for fp in fwd_cfgs:
            timing("triton", causal, fp, parts="f")
        for bp in bwd_cfgs:
            timing("triton", causal, None, bp, parts="b")
    small_d = (8, 2048, 32, 64)
    for impl in ("cudnn", "triton", "mosaic"):
        timing(impl, False, shape=small_d)
    timing("triton", False, F(q_blocksize=128, kv_blocksize=128, num_warps=4, num_stages=3),
           shape=small_d, parts="f")  # fmt: skip

    report(dev)


def report(dev: jax.Device) -> None:
    print("\n| item | status | numbers |\n|---|---|---|")
    for r in ROWS:
        nums = {
            k: (f"{v:.4g}" if isinstance(v, float) else v)
            for k, v in r.items()
            if k not in ("item", "status")
        }
        print(f"| {r['item']} | {r['status']} | {nums} |")
    out = os.environ.get("OUT")
    if out:
        Path(out, "check_pallas_gpu.json").write_text(
            json.dumps(dict(device=dev.device_kind, jax=jax.__version__, rows=ROWS), indent=1)
        )


if __name__ == "__main__":
    main()
