"""Block configurations of the portable kernels (Triton, Pallas-Triton) against JAX's Pallas ``mha``.

For each shape, every configuration below that fits is checked against ``mha`` (output and
gradients, relative error) and then timed interleaved with it in one run (:func:`attention.interleaved_ms`):
forward alone for the forward configurations, forward and backward for the backward ones (the
backend's heuristic forward). Prints the ratios to ``mha`` and saves them under ``--out``.

    python3 benchmarks/portable_sweep_gpu.py [--shapes 2x8192x16x128,...] [--masks causal]
        [--passes fwd,bwd] [--backends triton,pallas] [--keep REGEX] [--budget SECONDS] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from typing import Any

import jax
from attention import MASKS, Case, check_then_time, fwd_bwd, inputs, parse_shapes, save_rows

import ejkfn
from ejkfn._registry import BwdParams, FwdParams
from ejkfn.attention import AttentionConfig, AttentionShape, AttentionSpec
from ejkfn.attention import _pallas_gpu as pallas_triton
from ejkfn.attention import _triton as triton
from ejkfn.attention._backend import MIRRORED, MIRRORED_WIDE

SHAPES = "2x8192x16x128,4x4096x16x128,8x2048x32x64"


def _f(bq: int, bk: int, w: int, s: int) -> FwdParams:
    return FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s)


def _b(bq: int, bk: int, w: int, s: int, variant: str | None = None) -> BwdParams:
    return BwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s, variant=variant)


FWDS = [_f(64, 64, 4, 3), _f(128, 64, 8, 3), _f(128, 64, 8, 4), _f(128, 128, 8, 2)]
FWDS += [_f(128, 128, 8, 3), _f(128, 64, 4, 3), _f(128, 128, 4, 3), _f(64, 64, 4, 4)]
# narrower blocks for head dims up to 64
FWDS += [_f(64, 32, 4, 3), _f(32, 64, 4, 3), _f(64, 128, 4, 3), _f(64, 64, 8, 3), _f(64, 64, 4, 2)]
FWDS += [_f(128, 32, 4, 3), _f(64, 128, 8, 3), _f(128, 64, 4, 4)]
BWDS = [_b(64, 64, 4, 2), _b(64, 64, 4, 3), _b(64, 64, 8, 2), _b(32, 64, 4, 2), _b(32, 128, 4, 2)]
BWDS += [_b(32, 128, 8, 2), _b(64, 128, 8, 2), _b(128, 64, 8, 2), _b(64, 128, 4, 2)]
BWDS += [_b(32, 64, 4, 3), _b(64, 32, 4, 3), _b(32, 32, 4, 3), _b(64, 64, 4, 4), _b(64, 64, 8, 3)]
BWDS += [_b(32, 32, 2, 3), _b(64, 64, 2, 3)]
# both backward kernels keep kv_blocksize rows and stream q_blocksize ones
MIRRORED_BWDS = [
    _b(bq, bk, w, st, MIRRORED)
    for bq, bk, w in (
        (32, 128, 4),
        (64, 128, 8),
        (32, 128, 8),
        (128, 128, 8),
        (32, 64, 4),
        (16, 64, 4),
        (32, 64, 2),
        (16, 64, 2),
        (16, 32, 4),
        (32, 64, 8),
    )
    for st in (2, 3, 4)
]
# the dQ kernel keeps kv_blocksize rows on twice the warps and streams twice q_blocksize
MIRRORED_BWDS += [
    _b(bq, bk, w, st, MIRRORED_WIDE)
    for bq, bk, w in ((32, 128, 4), (16, 128, 4), (32, 64, 4), (64, 128, 8))
    for st in (2, 3, 4)
]
BACKENDS = {
    "triton": (triton, FWDS, BWDS + MIRRORED_BWDS),
    "pallas": (pallas_triton, FWDS, BWDS + MIRRORED_BWDS),
}


def fits(module: Any, shape: AttentionShape, fp: FwdParams, bp: BwdParams) -> bool:
    if module is triton:
        return triton._fits(shape, fp, backward=False) and triton._fits(shape, bp, backward=True)
    return pallas_triton._fits(shape, fp, bp)


def mha(case: Case) -> Any:
    from jax.experimental.pallas.ops.gpu import attention as pallas_mha

    return lambda q, k, v: pallas_mha.mha(
        q, k, v, segment_ids=None, causal=case.causal, sm_scale=case.dim**-0.5
    )


def configs(case: Case, name: str, backward: bool, keep: str = "") -> dict[str, AttentionConfig]:
    """label -> config of ``name``'s backend that fits ``case`` (its heuristic first), of those
    whose label matches the regular expression ``keep`` (the heuristic always)."""
    module, fwds, bwds = BACKENDS[name]
    spec = AttentionSpec(scale=case.dim**-0.5, causal=case.causal)
    q = jax.ShapeDtypeStruct((case.batch, case.seq, case.heads, case.dim), "bfloat16")
    k = jax.ShapeDtypeStruct((case.batch, case.seq, case.kv_heads, case.dim), "bfloat16")
    shape = AttentionShape.of(q, k, spec)
    heur_f, heur_b = module.heuristic(shape)
    # the heuristic's backward with its dQ kernel pipelined shallower or deeper than dK/dV's
    dq_deep = [
        dataclasses.replace(heur_b, dq_num_stages=s)
        for s in (heur_b.num_stages - 1, heur_b.num_stages + 1)
        if s >= 1
    ]
    pairs = (
        [(heur_f, b) for b in [heur_b, *bwds, *dq_deep]]
        if backward
        else [(f, heur_b) for f in [heur_f, *fwds]]
    )
    platform, variant = ("triton", "triton") if module is triton else ("pallas", "triton")
    out: dict[str, AttentionConfig] = {}
    for fp, bp in pairs:
        if not fits(module, shape, fp, bp):
            continue
        p = bp if backward else fp
        label = f"{name} {p.q_blocksize}x{p.kv_blocksize} w{p.num_warps} s{p.num_stages}"
        if getattr(p, "variant", None):
            label += f" {p.variant}"
        if getattr(p, "dq_num_stages", None):
            label += f" dq{p.dq_num_stages}"
        if (fp, bp) == (heur_f, heur_b):
            label += " (heuristic)"
        elif not re.search(keep, label):
            continue
        out.setdefault(label, AttentionConfig(platform=platform, variant=variant, fwd=fp, bwd=bp))
    return out


def run_case(case: Case, args: argparse.Namespace, rows: list[dict[str, Any]], t0: float) -> None:
    sets = [inputs(case, seed) for seed in (0, 1)]
    for backward in [p == "bwd" for p in args.passes.split(",")]:
        fns = {"mha": mha(case)}
        for name in args.backends.split(","):
            for label, cfg in configs(case, name, backward, args.keep).items():
                fns[label] = lambda q, k, v, cfg=cfg: ejkfn.flash_attention(
                    q, k, v, causal=case.causal, cfg=cfg
                )
        jitted = {n: jax.jit(fwd_bwd(f) if backward else f) for n, f in fns.items()}
        done = check_then_time(
            case,
            backward,
            jitted,
            "mha",
            sets,
            args.calls,
            args.rounds,
            max_error=2e-2,
            stop=lambda: time.time() - t0 > args.budget,
        )
        for row in done:
            if "ms" not in row:
                print(f"{case.name} {row['pass_']} {row['impl']}: not timed: {row}")
        rows += done
        print(f"{case.name}: {sum('ms' in r for r in done)} timed ({time.time() - t0:.0f} s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--masks", choices=tuple(MASKS), default="both")
    parser.add_argument(
        "--passes", default="fwd,bwd", help="fwd, bwd (forward and backward) or both"
    )
    parser.add_argument("--backends", default="triton,pallas")
    parser.add_argument("--keep", default="", help="regular expression: the labels to time")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=500.0, help="seconds; then stop checking")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    for p in args.passes.split(","):
        if p not in ("fwd", "bwd"):
            parser.error(f"--passes: {p!r} is neither fwd nor bwd")
    for b in args.backends.split(","):
        if b not in BACKENDS:
            parser.error(f"--backends: {b!r} is not one of {sorted(BACKENDS)}")
    shapes = parse_shapes(args.shapes)
    for b, s, h, kvh, d in shapes:
        if kvh != h:
            parser.error(f"--shapes: {b}x{s}x{h}x{d}x{kvh} has GQA, which mha does not take")
    cases = [
        Case(b, s, h, kvh, d, causal) for b, s, h, kvh, d in shapes for causal in MASKS[args.masks]
    ]
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for case in cases:
        run_case(case, args, rows, t0)
    print(f"\n| case | pass | impl | TFLOP/s | vs mha | spread |\n|{'---|' * 6}")

    def vs_mha(r: dict[str, Any]) -> float:
        return 1.0 if r["impl"] == "mha" else r.get("vs_mha", 0.0)

    for r in sorted(rows, key=lambda r: (r["case"], r["pass_"], -vs_mha(r))):
        if "ms" in r:
            print(
                f"| {r['case']} | {r['pass_']} | {r['impl']} | {r['tflops']:.0f} |"
                f" {vs_mha(r):.2f} | {r['spread']:.3f} |"
            )
    print(f"({time.time() - t0:.0f} s)")
    if args.out:
        save_rows(args.out, "portable_sweep", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
