"""Check the Triton attention kernels on a GPU against the XLA float32 reference, then time them.

Run on the lent GPU (one call does everything; see ../shared/GPU.md for the wheels it needs):

    python3 benchmarks/check_triton_gpu.py [--budget SECONDS] [--out DIR]

Prints one line per check (relative error ``max|got - want| / max|want|`` of out, lse and the
gradients against ``jax.vjp`` of the reference), then timings (median of 20 calls) of the forward and
forward-plus-backward next to cuDNN and XLA through ``jax.nn.dot_product_attention``, then a sweep of
block configurations. Sections are skipped when the time budget runs out. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import zlib

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ejkfn._registry import BwdParams, FwdParams

try:
    from ejkfn.attention import _triton as tri
except Exception as exc:  # another backend's import broke the package: load this one alone
    import types

    import ejkfn

    print(f"ejkfn.attention did not import ({exc!r}); loading the Triton backend alone")
    for _name in [n for n in sys.modules if n.startswith("ejkfn.attention")]:
        del sys.modules[_name]
    _pkg = types.ModuleType("ejkfn.attention")
    _pkg.__path__ = [os.path.join(os.path.dirname(ejkfn.__file__), "attention")]
    sys.modules["ejkfn.attention"] = _pkg
    from ejkfn.attention import _triton as tri

from ejkfn.attention._backend import AttentionShape
from ejkfn.attention._reference import reference_attention
from ejkfn.attention._spec import AttentionSpec

T0 = time.time()
SMALL = 1  # sizes are divided by this (a CPU dry run through the interpreter uses --small)
RESULTS: dict = {"checks": [], "timings": [], "sweep": []}


def elapsed() -> float:
    return time.time() - T0


def operands(seed, batch, seq_q, seq_k, heads, kv_heads, dim, dtype, bias=None, mask=False,
             segments=False, dropout=0.0):  # fmt: skip
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)

    q = normal(batch, seq_q, heads, dim)
    k = normal(batch, seq_k, kv_heads, dim)
    v = normal(batch, seq_k, kv_heads, dim)
    dout = normal(batch, seq_q, heads, dim)
    b = normal(*bias, seq_q, seq_k) if bias else None
    m = jnp.asarray(rng.random((batch, 1, seq_q, seq_k)) < 0.9) if mask else None
    qs = ks = None
    if segments:
        qs = jnp.asarray(np.sort(rng.integers(0, 4, (batch, seq_q)), axis=1), jnp.int32)
        ks = jnp.asarray(np.sort(rng.integers(0, 4, (batch, seq_k)), axis=1), jnp.int32)
    seed_arr = jnp.asarray(rng.integers(0, 2**32, dtype=np.uint32)) if dropout else None
    return (q, k, v, b, m, qs, ks, seed_arr), dout


def rel(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    if np.isnan(got).any():
        return float("nan")
    return float(np.max(np.abs(got - want)) / max(1e-6, float(np.max(np.abs(want)))))


def check(name, *, batch=2, seq_q=2048, seq_k=None, heads=8, kv_heads=None, dim=128,
          dtype=jnp.bfloat16, bias=None, mask=False, segments=False, dropout=0.0, **spec_kw):  # fmt: skip
    seq_k = (seq_k or seq_q) // SMALL
    seq_q = max(1, seq_q // SMALL)
    kv_heads = kv_heads or heads
    args, dout = operands(zlib.crc32(name.encode()), batch, seq_q, seq_k, heads, kv_heads, dim, dtype,
                          bias, mask, segments, dropout)  # fmt: skip
    spec = AttentionSpec(
        scale=dim**-0.5,
        dropout_prob=dropout,
        has_bias=bias is not None,
        has_mask=mask,
        has_segments=segments,
        **spec_kw,
    )
    q, k, v, b, m, qs, ks, seed = args
    fp, bp = tri.heuristic(AttentionShape.of(q, k, spec))

    @jax.jit
    def run(q, k, v, b, dout):
        out, lse = tri.fwd(q, k, v, b, m, qs, ks, seed, spec=spec, params=fp)
        return out, lse, tri.bwd(q, k, v, b, m, qs, ks, seed, out, lse, dout, spec=spec, params=bp)

    @jax.jit
    def ref(q, k, v, b, dout):
        f = lambda q, k, v, b: reference_attention(q, k, v, b, m, qs, ks, seed, spec=spec)
        (o, lse), vjp = jax.vjp(f, q, k, v, b)
        return o, lse, vjp((dout.astype(jnp.float32), jnp.zeros_like(lse)))

    t = time.time()
    out, lse, (dq, dk, dv, db) = jax.block_until_ready(run(q, k, v, b, dout))
    t_run = time.time() - t
    ro, rl, (rq, rk, rv, rb) = ref(q, k, v, b, dout)
    fin = np.isfinite(np.asarray(rl))
    lse_ok = bool((np.isfinite(np.asarray(lse)) == fin).all())
    errs = {
        "out": rel(out, ro),
        "lse": rel(jnp.where(fin, lse, 0), jnp.where(fin, rl, 0)) if lse_ok else float("nan"),
        "dq": rel(dq, rq),
        "dk": rel(dk, rk),
        "dv": rel(dv, rv),
    }
    if b is not None:
        errs["dbias"] = rel(db, rb)
    limit = {jnp.float32: 2e-3, jnp.float16: 1e-2, jnp.bfloat16: 4e-2}[dtype]
    ok = all(e <= limit for e in errs.values())  # NaN fails
    row = dict(name=name, ok=ok, limit=limit, compile_and_run_s=round(t_run, 1), **errs)
    RESULTS["checks"].append(row)
    cols = " ".join(f"{k}={v:.1e}" for k, v in errs.items())
    print(f"{'PASS' if ok else 'FAIL'} {name:<34} {cols}  ({t_run:.1f}s)", flush=True)


def bench(fn, *args, iters=20):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def triton_attention(spec, fp, bp):
    @jax.custom_vjp
    def attend(q, k, v):
        return tri.fwd(q, k, v, None, None, None, None, None, spec=spec, params=fp)[0]

    def attend_fwd(q, k, v):
        out, lse = tri.fwd(q, k, v, None, None, None, None, None, spec=spec, params=fp)
        return out, (q, k, v, out, lse)

    def attend_bwd(res, dout):
        q, k, v, out, lse = res
        dq, dk, dv, _ = tri.bwd(
            q, k, v, None, None, None, None, None, out, lse, dout, spec=spec, params=bp
        )
        return dq, dk, dv

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def fwd_bwd(attend):
    def loss(q, k, v, dout):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def timings(batch=2, seq=4096, heads=16, dim=128, dtype=jnp.bfloat16):
    args, dout = operands(0, batch, seq, seq, heads, heads, dim, dtype)
    q, k, v = args[:3]
    for causal in (False, True):
        flops = 4 * batch * heads * seq * seq * dim / (2 if causal else 1)
        spec = AttentionSpec(scale=dim**-0.5, causal=causal)
        fp, bp = tri.heuristic(AttentionShape.of(q, k, spec))
        impls = {"triton": triton_attention(spec, fp, bp)}
        for impl in ("cudnn", "xla"):
            impls[impl] = lambda q, k, v, impl=impl, causal=causal: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation=impl
            )
        for name, attend in impls.items():
            try:
                t_f = bench(jax.jit(attend), q, k, v)
                t_fb = bench(fwd_bwd(attend), q, k, v, dout)
            except Exception as exc:
                print(f"  {name} causal={causal}: failed: {exc!r}"[:300], flush=True)
                continue
            row = dict(
                impl=name,
                shape=[batch, seq, heads, dim],
                causal=causal,
                fwd_ms=t_f * 1e3,
                fwd_bwd_ms=t_fb * 1e3,
                fwd_tflops=flops / t_f / 1e12,
                fwd_bwd_tflops=3.5 * flops / t_fb / 1e12,
            )
            RESULTS["timings"].append(row)
            print(
                f"  {batch}x{seq}x{heads}x{dim} {name:<7} causal={causal!s:<5} fwd {t_f * 1e3:7.2f} ms {row['fwd_tflops']:6.1f} "
                f"TFLOP/s | fwd+bwd {t_fb * 1e3:7.2f} ms {row['fwd_bwd_tflops']:6.1f} TFLOP/s",
                flush=True,
            )


def sweep(budget, fwds, bwds, batch=2, seq=4096, heads=16, dim=128, dtype=jnp.bfloat16,
          causal=False):  # fmt: skip
    """Time each (q_block, kv_block, warps, stages) forward config, then each backward config."""
    args, dout = operands(1, batch, seq, seq, heads, heads, dim, dtype)
    q, k, v = args[:3]
    spec = AttentionSpec(scale=dim**-0.5, causal=causal)
    flops = 4 * batch * heads * seq * seq * dim / (2 if causal else 1)
    shape = [batch, seq, heads, dim]
    print(f"sweep {shape} causal={causal} (cfg = q_block kv_block warps stages):", flush=True)
    out, lse = tri.fwd(q, k, v, None, None, None, None, None, spec=spec, params=FwdParams())
    for bq, bk, w, s in fwds:
        if elapsed() > budget:
            print("  (sweep stopped: time budget)", flush=True)
            return
        fp = FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s)
        f = jax.jit(lambda q, k, v, fp=fp: tri.fwd(q, k, v, None, None, None, None, None,
                                                   spec=spec, params=fp))  # fmt: skip
        try:
            t = bench(f, q, k, v, iters=10)
            msg = f"{t * 1e3:7.2f} ms {flops / t / 1e12:6.1f} TFLOP/s"
        except Exception as exc:
            t, msg = None, f"failed: {exc!r}"[:200]
        RESULTS["sweep"].append(
            dict(kind="fwd", shape=shape, causal=causal, cfg=[bq, bk, w, s], ms=t and t * 1e3)
        )
        print(f"  fwd {bq:>3} {bk:>3} w{w} s{s}: {msg}", flush=True)
    for bq, bk, w, s in bwds:
        if elapsed() > budget:
            print("  (sweep stopped: time budget)", flush=True)
            return
        bp = BwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s)
        f = jax.jit(lambda q, k, v, o, lse_, d, bp=bp: tri.bwd(
            q, k, v, None, None, None, None, None, o, lse_, d, spec=spec, params=bp)[:3])  # fmt: skip
        try:
            t = bench(f, q, k, v, out, lse, dout, iters=10)
            msg = f"{t * 1e3:7.2f} ms {2.5 * flops / t / 1e12:6.1f} TFLOP/s (bwd only)"
        except Exception as exc:
            t, msg = None, f"failed: {exc!r}"[:200]
        RESULTS["sweep"].append(
            dict(kind="bwd", shape=shape, causal=causal, cfg=[bq, bk, w, s], ms=t and t * 1e3)
        )
        print(f"  bwd {bq:>3} {bk:>3} w{w} s{s}: {msg}", flush=True)


# (shape and causality, forward configs, backward configs): what the first H200 run left open
SWEEPS = [
    (dict(), [(128, 64, 8, 4), (128, 64, 8, 3), (64, 64, 4, 4), (64, 64, 4, 3), (128, 128, 8, 3),
              (64, 128, 4, 3)],
     [(64, 64, 4, 2), (64, 64, 4, 1), (64, 64, 4, 3), (32, 32, 4, 2), (64, 32, 4, 2)]),
    (dict(causal=True), [(128, 64, 8, 4), (128, 64, 8, 3), (64, 64, 4, 4), (128, 128, 8, 3)],
     [(64, 64, 4, 2)]),
    (dict(batch=8, seq=2048, heads=32, dim=64),
     [(128, 64, 4, 4), (128, 64, 4, 3), (128, 64, 8, 4), (64, 64, 4, 4), (128, 128, 8, 3),
      (128, 32, 4, 4)],
     [(64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 64, 4, 2), (64, 64, 4, 3)]),
]  # fmt: skip

CHECKS = [
    ("bf16 2x2048x8x128", {}),
    ("bf16 causal", dict(causal=True)),
    ("bf16 GQA 8/2 causal", dict(kv_heads=2, causal=True)),
    ("bf16 MQA 8/1", dict(kv_heads=1)),
    ("bf16 q1024 k2048 causal", dict(seq_q=1024, causal=True)),
    ("bf16 q2048 k1024 causal (empty rows)", dict(seq_k=1024, causal=True)),
    ("bf16 window (256,0) causal", dict(window=(256, 0), causal=True)),
    ("bf16 window (128,128) GQA", dict(window=(128, 128), kv_heads=4)),
    # windows whose edges fall inside blocks, with whole blocks between them
    ("bf16 window (1000,0) causal D64", dict(window=(1000, 0), causal=True, dim=64)),
    ("bf16 window (700,300) S1000/1536", dict(window=(700, 300), seq_q=1000, seq_k=1536)),
    (
        "bf16 window (600,0) causal GQA 8/2 D256",
        dict(window=(600, 0), causal=True, kv_heads=2, dim=256),
    ),
    (
        "bf16 window (500,500) segments dropout",
        dict(window=(500, 500), segments=True, dropout=0.1),
    ),
    ("bf16 window (400,0) causal bias + dbias", dict(window=(400, 0), causal=True, bias=(1, 8))),
    ("f32 window (300,0) causal", dict(dtype=jnp.float32, window=(300, 0), causal=True)),
    ("f32 window (512,512) D64", dict(dtype=jnp.float32, window=(512, 512), dim=64)),
    ("bf16 bias [1,H] causal + dbias", dict(bias=(1, 8), causal=True)),
    ("bf16 segments + mask", dict(segments=True, mask=True)),
    ("bf16 soft cap 30 causal", dict(soft_cap=30.0, causal=True)),
    ("bf16 dropout 0.1 causal", dict(dropout=0.1, causal=True)),
    ("bf16 D64 S1000/1536 ragged causal", dict(dim=64, seq_q=1000, seq_k=1536, causal=True)),
    ("bf16 D80 causal", dict(dim=80, seq_q=1024, causal=True)),
    ("bf16 D96 GQA", dict(dim=96, seq_q=1024, kv_heads=2)),
    ("bf16 D256 causal", dict(dim=256, seq_q=1024, causal=True)),
    ("f16 causal", dict(dtype=jnp.float16, causal=True)),
    ("f32 causal S1024", dict(dtype=jnp.float32, seq_q=1024, causal=True)),
    # decoding: the heuristic splits the keys among programs, folding GQA groups where it can
    (
        "decode GQA 32/8 q1 k32768 causal",
        dict(batch=4, seq_q=1, seq_k=32768, heads=32, kv_heads=8, causal=True),
    ),
    ("decode GQA 32/8 q16 k16384", dict(seq_q=16, seq_k=16384, heads=32, kv_heads=8)),
    ("decode q16 k16384 causal", dict(seq_q=16, seq_k=16384, causal=True)),
    (
        "decode GQA q4 k8192 segments soft cap",
        dict(seq_q=4, seq_k=8192, kv_heads=2, segments=True, soft_cap=30.0),
    ),
    (
        "decode q2 k8192 window bias mask dropout",
        dict(
            seq_q=2, seq_k=8192, causal=True, window=(1024, 0), bias=(1, 8), mask=True, dropout=0.1
        ),
    ),
    ("decode f32 MQA q1 k8192", dict(dtype=jnp.float32, seq_q=1, seq_k=8192, kv_heads=1)),
    ("decode D64 MQA q1 k65536", dict(dim=64, batch=1, seq_q=1, seq_k=65536, kv_heads=1)),
    ("decode D256 GQA q3 k16384", dict(dim=256, seq_q=3, seq_k=16384, kv_heads=2)),
    (
        "decode f16 GQA q1 k16384 causal",
        dict(dtype=jnp.float16, seq_q=1, seq_k=16384, kv_heads=2, causal=True),
    ),
    # folded causal rows: row r of a group of G is query r // G for the causal and window limits
    (
        "decode GQA 32/8 q32 k16384 causal window segments",
        dict(
            seq_q=32,
            seq_k=16384,
            heads=32,
            kv_heads=8,
            causal=True,
            window=(4096, 0),
            segments=True,
        ),
    ),
    (
        "decode GQA 24/8 q40 k8192 causal",
        dict(seq_q=40, seq_k=8192, heads=24, kv_heads=8, causal=True),
    ),
    ("decode q128 k32768 causal", dict(batch=1, seq_q=128, seq_k=32768, causal=True)),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=380.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--small", action="store_true", help="tiny sizes (a CPU dry run)")
    parser.add_argument("--skip", nargs="*", default=[], help="skip checks whose name has these")
    parser.add_argument(
        "--only", nargs="*", default=[], help="run only checks whose name has these"
    )
    parser.add_argument(
        "--split-every-window",
        action="store_true",
        help="run every 16-bit window's interior unmasked, however narrow (WINDOW_SPLIT_KEYS 0)",
    )
    a = parser.parse_args()
    if a.split_every_window:
        tri.WINDOW_SPLIT_KEYS = {"fwd": 0, "bwd": 0}
    RESULTS["window_split_keys"] = dict(tri.WINDOW_SPLIT_KEYS)
    global SMALL
    SMALL = 16 if a.small else 1
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}; jax {jax.__version__}", flush=True)
    RESULTS["device"] = dev.device_kind
    for i, (name, kw) in enumerate(CHECKS):
        if any(word in name for word in a.skip) or (
            a.only and not any(word in name for word in a.only)
        ):
            continue
        # Checks asked for by name may take the whole budget; otherwise leave most to the timings.
        if i >= 3 and elapsed() > a.budget * (1.0 if a.only else 0.45):
            print(f"SKIP {name} (time budget)", flush=True)
            continue
        try:
            check(name, **kw)
        except Exception:
            print(f"ERROR {name}\n{traceback.format_exc()[-1500:]}", flush=True)
            RESULTS["checks"].append(dict(name=name, ok=False, error=traceback.format_exc()[-600:]))
    print("timings (bf16, median of 20):", flush=True)
    for batch, seq, heads, dim in ((2, 4096, 16, 128), (8, 2048, 32, 64)):
        try:
            timings(batch, seq // SMALL, max(1, heads // SMALL), dim)
        except Exception:
            print(traceback.format_exc()[-1500:], flush=True)
    if not a.no_sweep:
        for kw, fwds, bwds in SWEEPS:
            kw = dict(kw)
            kw["seq"] = kw.get("seq", 4096) // SMALL
            kw["heads"] = max(1, kw.get("heads", 16) // SMALL)
            if elapsed() < a.budget:
                sweep(a.budget, fwds, bwds, **kw)
    n_ok = sum(bool(c.get("ok")) for c in RESULTS["checks"])
    print(f"checks passed: {n_ok}/{len(RESULTS['checks'])}; total {elapsed():.0f}s", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "triton_gpu.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
