"""Check the Mosaic GPU attention backward on a Hopper GPU, then time it beside cuDNN and today's path.

One run (under 4 minutes on an H200) does, each configuration guarded so a failure is reported and the
run goes on:

1. correctness: dq, dk, dv of the Pallas Mosaic forward + Mosaic backward (``BwdParams.variant =
   "mosaic"``, and ``"mosaic_fused"``, whose dK/dV kernel adds dQ by TMA reduce-add) against a
   float32 XLA reference, at small and medium bf16 shapes (causal and not, GQA 32/8 heads, head dims
   64 and 128, ragged lengths), with the Triton-lowering backward's errors on the same inputs beside
   them; max relative error (max |got - want| / max |want|) and PASS/FAIL;
2. timing: median of 15 forward+backward calls (after warm-up) at 2x8192x16x128 causal and not,
   4x4096x16x128, 8x2048x32x64 and GQA 2x8192x32/8x128 causal, for cuDNN
   (``jax.nn.dot_product_attention(implementation="cudnn")``), the Mosaic forward + Triton-lowering
   backward (the default before), the Mosaic forward + Mosaic backward with its heuristic blocks, the
   Mosaic forward + fused Mosaic backward right after it, and, while time lasts, the other blocks
   the tuner tries (fused ones first); TFLOP/s (forward+backward = 3.5 x 4*B*H*S*S*D, halved for
   causal), the ratio to cuDNN and the gradients' error against cuDNN's;
3. results as JSON in ``--out`` (default ``$OUT``), rewritten after every row.

Run from the repository root on the GPU machine::

    python3 benchmarks/check_mosaic_bwd_gpu.py --out "$OUT"

``--cpu-smoke`` runs the same code at tiny shapes in Mosaic GPU's interpreter (no cuDNN), to check the
script itself without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

if "--cpu-smoke" in sys.argv:
    # Mosaic GPU's interpreter blocks host threads in barrier waits; with the CPU client's default
    # thread pool on a small machine (2 cores) a warpgroup can starve and the run hang. Several host
    # devices (as the tests' conftest sets) give it threads enough. Must precede importing JAX.
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ejkfn
from ejkfn import AttentionConfig, BwdParams, FwdParams
from ejkfn.attention import _pallas_gpu, _pallas_mosaic
from ejkfn.attention._backend import AttentionShape
from ejkfn.attention._reference import reference_attention
from ejkfn.attention._spec import AttentionSpec

T0 = time.time()
ROWS: list[dict] = []
GRAD_TOL = (
    4e-2  # bf16 inputs and dO, f32 accumulation: the Triton-lowering backward stays near 1e-2
)


@dataclasses.dataclass(frozen=True)
class Run:
    smoke: bool
    budget_s: float
    out: Path | None
    iters: int


def log(*a: object) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def save(run: Run) -> None:
    if run.out is None:
        return
    dev = jax.devices()[0]
    run.out.mkdir(parents=True, exist_ok=True)
    (run.out / "check_mosaic_bwd_gpu.json").write_text(
        json.dumps(
            dict(device=dev.device_kind, jax=jax.__version__, smoke=run.smoke, rows=ROWS), indent=1
        )
    )


def guarded(run: Run, name: str, fn, *args, **kwargs) -> None:
    """Run one configuration; report a failure briefly (compile errors can be long) and go on."""
    if time.time() - T0 > run.budget_s:
        log(f"SKIP {name}: time budget spent")
        ROWS.append(dict(item=name, status="skipped"))
        return
    try:
        fn(run, name, *args, **kwargs)
    except Exception as e:  # report and go on
        msg = "".join(traceback.format_exception_only(type(e), e)).strip()
        lines = msg.splitlines()
        if len(lines) > 18:  # a compile error's head and tail say what failed
            lines = [*lines[:12], "...", *lines[-6:]]
        short = "\n".join(lines)
        log(f"FAIL {name}: {short[:2500]}")
        ROWS.append(dict(item=name, status="error", error=short[:600]))
    save(run)


def inputs(b, sq, sk, h, kvh, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, sq, h, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, sk, kvh, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, sk, kvh, d), jnp.float32).astype(jnp.bfloat16)
    do = jax.random.normal(ks[3], (b, sq, h, d), jnp.float32).astype(jnp.bfloat16)
    return q, k, v, do


def rel_err(got, want) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    if not np.all(np.isfinite(got)):
        return float("nan")
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))


def ours(causal: bool, bp: BwdParams, q, k, fp: FwdParams | None = None):
    """Attention through the library with the Mosaic forward (``fp``, else the heuristic's) and
    backward params ``bp``."""
    spec = AttentionSpec(scale=q.shape[-1] ** -0.5, causal=causal)
    fp = fp or _pallas_mosaic.heuristic(AttentionShape.of(q, k, spec))[0]
    cfg = AttentionConfig(platform="pallas", variant="mosaic", fwd=fp, bwd=bp)
    return functools.partial(ejkfn.flash_attention, causal=causal, platform="pallas", cfg=cfg)


def triton_bwd(q, k, causal: bool) -> BwdParams:
    """The backward the Mosaic backend ran before the Mosaic backward (Triton-lowering kernels)."""
    spec = AttentionSpec(scale=q.shape[-1] ** -0.5, causal=causal)
    return _pallas_gpu.heuristic(AttentionShape.of(q, k, spec))[1]


def mosaic_bwds(q, k, causal: bool, variant: str = "mosaic") -> list[BwdParams]:
    """The heuristic's Mosaic backward first (if of ``variant``), then the other blocks of
    ``variant`` the tuner tries."""
    shape = AttentionShape.of(q, k, AttentionSpec(scale=0.1, causal=causal))
    heur = _pallas_mosaic.heuristic(shape)[1]
    out = [heur] if heur.variant == variant else []
    for _, bp in _pallas_mosaic.candidates(shape):
        if bp.variant == variant and bp not in out:
            out.append(bp)
    return out


def grads_of(attn):
    @jax.jit
    def run(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(do)

    return run


def blocks(bp: BwdParams) -> str:
    kind = bp.variant or "triton"
    return f"{kind}({bp.q_blocksize},{bp.kv_blocksize},{bp.num_stages}s)"


# ----------------------------------------------------------------------------------------------------
# 1. Correctness against the float32 reference.


def correctness(run: Run, name: str, shape, causal: bool, bwds: list[BwdParams]) -> None:
    b, sq, sk, h, kvh, d = shape
    q, k, v, do = inputs(b, sq, sk, h, kvh, d, seed=1)
    spec = AttentionSpec(scale=d**-0.5, causal=causal)

    @jax.jit
    def reference(q, k, v, do):
        def f(q, k, v):
            return reference_attention(q, k, v, spec=spec)[0]

        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return jax.vjp(f, *f32)[1](do.astype(jnp.float32))

    want = reference(q, k, v, do)
    for bp in bwds:
        _, got = grads_of(ours(causal, bp, q, k))(q, k, v, do)
        errs = {n: rel_err(g, w) for n, g, w in zip(("dq", "dk", "dv"), got, want, strict=True)}
        worst = max(errs.values())
        ok = worst < GRAD_TOL  # NaN fails too
        row = dict(item=f"{name} {blocks(bp)}", status="PASS" if ok else "FAIL", **errs)
        ROWS.append(row)
        log(row["status"], row["item"], {n: f"{e:.2e}" for n, e in errs.items()})


# ----------------------------------------------------------------------------------------------------
# 2. Timing.


def median_time(run: Run, f, *args) -> float:
    jax.block_until_ready(f(*args))  # compile
    for _ in range(0 if run.smoke else 2):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(run.iters):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


_CUDNN: dict = {}  # shape -> (median seconds, gradients)


def timing(run: Run, name: str, shape, causal: bool, impl: str, bp: BwdParams | None = None):
    b, s, h, kvh, d = shape
    q, k, v, do = inputs(b, s, s, h, kvh, d, seed=3)
    flops = 3.5 * 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    if impl == "cudnn":

        def attn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    else:
        attn = ours(causal, bp, q, k)
    f = grads_of(attn)
    row = dict(item=name, status="ok")
    _, grads = f(q, k, v, do)
    t = median_time(run, f, q, k, v, do)
    row.update(ms=t * 1e3, tflops=flops / t / 1e12)
    key = (shape, causal)
    if impl == "cudnn":
        _CUDNN[key] = (t, grads)
    elif key in _CUDNN:
        ref_t, ref_grads = _CUDNN[key]
        row["vs_cudnn"] = ref_t / t
        row["err_vs_cudnn"] = max(rel_err(a, w) for a, w in zip(grads, ref_grads, strict=True))
    ROWS.append(row)
    nums = {k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}
    log(nums)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON results")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes, interpreter, no cuDNN"
    )
    parser.add_argument("--budget-s", type=float, default=200.0, help="stop starting new items")
    args = parser.parse_args()
    smoke = args.cpu_smoke
    run = Run(
        smoke=smoke,
        budget_s=args.budget_s,
        out=Path(args.out) if args.out else None,
        iters=1 if smoke else 15,
    )
    dev = jax.devices()[0]
    log("device", dev.device_kind, getattr(dev, "compute_capability", "?"), "jax", jax.__version__)
    log("mosaic available():", _pallas_mosaic.available())
    if not smoke and not _pallas_mosaic.available():
        log("WARNING: no Hopper GPU here; the Mosaic kernels will fail (try --cpu-smoke)")

    # (name, (B, Sq, Sk, H, KVH, D), causal); small ones first: they fail fastest
    checks = [
        ("full 2x1024x8x128", (2, 1024, 1024, 8, 8, 128), False),
        ("causal 2x1024x8x128", (2, 1024, 1024, 8, 8, 128), True),
        ("causal gqa 1x1024x32/8x128", (1, 1024, 1024, 32, 8, 128), True),
        ("full d64 2x1024x8x64", (2, 1024, 1024, 8, 8, 64), False),
        ("causal ragged 1x1000x900x8/2x64", (1, 1000, 900, 8, 2, 64), True),
        ("causal ragged q longer 1x700x500x4x128", (1, 700, 500, 4, 4, 128), True),
        ("full ragged 1x200x328x4/1x128", (1, 200, 328, 4, 1, 128), False),
    ]
    if smoke:
        checks = [
            ("full 1x128x2x64", (1, 128, 128, 2, 2, 64), False),
            ("causal gqa ragged 1x200x4/2x64", (1, 200, 200, 4, 2, 64), True),
            ("causal ragged 1x136x100x2x128", (1, 136, 100, 2, 2, 128), True),
        ]
    for i, (name, shape, causal) in enumerate(checks):
        b, sq, sk, h, kvh, d = shape
        q = jax.ShapeDtypeStruct((b, sq, h, d), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((b, sk, kvh, d), jnp.bfloat16)
        bwds, fused = mosaic_bwds(q, k, causal), mosaic_bwds(q, k, causal, "mosaic_fused")
        # every block config at one GQA shape, the first of each variant elsewhere; Triton's beside
        every = i == 2 or (smoke and i == 1)
        bwds = bwds + fused if every else bwds[:1] + fused[:1]
        bwds.append(triton_bwd(q, k, causal))
        guarded(run, f"check {name}", correctness, shape, causal, bwds)

    # (label, (B, S, H, KVH, D), causal), the most important first: the budget may cut the tail
    shapes = [
        ("2x8192x16x128 causal", (2, 8192, 16, 16, 128), True),
        ("2x8192x16x128 full", (2, 8192, 16, 16, 128), False),
        ("4x4096x16x128 full", (4, 4096, 16, 16, 128), False),
        ("8x2048x32x64 full", (8, 2048, 32, 32, 64), False),
        ("gqa 2x8192x32/8x128 causal", (2, 8192, 32, 8, 128), True),
        ("4x4096x16x128 causal", (4, 4096, 16, 16, 128), True),
    ]
    if smoke:
        shapes = [("1x256x2x64 causal", (1, 256, 2, 2, 64), True)]
    extra: list[tuple] = []
    extra_fused: list[tuple] = []
    for label, shape, causal in shapes:
        b, s, h, kvh, d = shape
        q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((b, s, kvh, d), jnp.bfloat16)
        if not smoke:
            guarded(run, f"time cudnn {label}", timing, shape, causal, "cudnn")
        tb = triton_bwd(q, k, causal)
        guarded(run, f"time mosaic+{blocks(tb)} {label}", timing, shape, causal, "ours", tb)
        first, *rest = mosaic_bwds(q, k, causal)
        guarded(run, f"time mosaic+{blocks(first)} {label}", timing, shape, causal, "ours", first)
        extra += [(label, shape, causal, bp) for bp in rest]
        fused_first, *fused_rest = mosaic_bwds(q, k, causal, "mosaic_fused")
        name = f"time mosaic+{blocks(fused_first)} {label}"
        guarded(run, name, timing, shape, causal, "ours", fused_first)
        extra_fused += [(label, shape, causal, bp) for bp in fused_rest]
    extra = extra_fused + extra
    for label, shape, causal, bp in extra[: 1 if smoke else None]:
        guarded(run, f"time mosaic+{blocks(bp)} {label}", timing, shape, causal, "ours", bp)

    print("\n| item | status | numbers |\n|---|---|---|")
    for r in ROWS:
        nums = {
            k: (f"{v:.4g}" if isinstance(v, float) else v)
            for k, v in r.items()
            if k not in ("item", "status")
        }
        print(f"| {r['item']} | {r['status']} | {nums} |")
    failed = [r["item"] for r in ROWS if r["status"] in ("FAIL", "error")]
    log(f"done: {len(ROWS)} rows, {len(failed)} failed" + (f": {failed}" if failed else ""))
    save(run)


if __name__ == "__main__":
    main()
