"""Does the tuner time what training runs? One pair of configs, four timing harnesses and the Tuner.

For each shape (causal by default) it times two configs that differ only in their backward, the Mosaic
forward with our own backward kernel and with cuDNN's (on the CPU, ``--cpu-smoke``: XLA's dense and
chunked attention), side by side (:func:`attention.interleaved_ms`):

- ``vjp``: outputs and ``jax.vjp`` on a bf16 cotangent passed in, as the table times and training runs;
- ``weighted loss``: the gradient of ``sum(out.astype(f32) * w)``, f32 weights passed in, which the
  tuner timed until the thirty-fourth round (benchmarks/NOTES.md);

each on two input sets in turn (``rotating``) and on one (``one set``), then the pair through
``ejkfn.Tuner.tune(..., validate_backward=True)`` with the same batch length. Prints each harness's
times and the ratio ``second / first`` (above 1: the first config is faster), and saves them.

Usage: ``python benchmarks/tuner_harness_gpu.py [--shapes 4x4096x16x128,8x2048x32x64] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention import (
    MASKS,
    MIN_BATCH_MS,
    SETTLE_MS,
    Case,
    fwd_bwd,
    inputs,
    interleaved_ms,
    parse_shapes,
    save_rows,
)

import ejkfn
from ejkfn import BwdParams, FwdParams
from ejkfn.attention import AttentionConfig
from ejkfn.attention._backend import CUDNN_BWD


def gpu_pair(head_dim: int) -> dict[str, AttentionConfig]:
    """The Mosaic forward with the backward the tune ranked first among ours when this harness was
    written (the fused kernel at head dim 128, Pallas-Triton's at 64; since the thirty-sixth round
    the split leads at 64), and with cuDNN's backward kernel on its residuals."""
    fwd = FwdParams(q_blocksize=128, kv_blocksize=128 if head_dim > 64 else 256, num_warps=12)
    own = (
        BwdParams(q_blocksize=64, kv_blocksize=128, num_warps=12, variant="mosaic_fused")
        if head_dim > 64
        else BwdParams(
            q_blocksize=32, kv_blocksize=128, num_warps=4, num_stages=3, variant="mirrored"
        )
    )
    cudnn = BwdParams(variant=CUDNN_BWD)
    return {
        name: AttentionConfig(platform="pallas", variant="mosaic", fwd=fwd, bwd=bwd)
        for name, bwd in (("own", own), ("cudnn bwd", cudnn))
    }


def cpu_pair() -> dict[str, AttentionConfig]:
    return {v: AttentionConfig(platform="xla", variant=v) for v in ("dense", "chunked")}


def attention(cfg: AttentionConfig, causal: bool) -> Callable[..., jax.Array]:
    return lambda q, k, v: ejkfn.flash_attention(q, k, v, causal=causal, cfg=cfg)


def weighted_loss(fn: Callable[..., jax.Array]) -> Callable[..., Any]:
    def run(q, k, v, w):
        def loss(q, k, v):
            return jnp.sum(fn(q, k, v).astype(jnp.float32) * w)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", default=None, help="BxSxHxD[xKVH],... (--cpu-smoke: 1x256x2x64)"
    )
    parser.add_argument("--masks", choices=tuple(MASKS), default="causal")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--min-batch-ms", type=float, default=MIN_BATCH_MS)
    parser.add_argument("--settle-ms", type=float, default=SETTLE_MS)
    parser.add_argument("--cpu-smoke", action="store_true", help="XLA's two variants, tiny shapes")
    parser.add_argument("--out", default="", help="folder for the results' JSON")
    args = parser.parse_args()
    shapes = args.shapes or ("1x256x2x64" if args.cpu_smoke else "4x4096x16x128,8x2048x32x64")
    timing = dict(calls=args.calls, rounds=args.rounds, min_batch_ms=args.min_batch_ms)
    rows: list[dict[str, Any]] = []
    for b, s, h, kvh, d in parse_shapes(shapes):
        for causal in MASKS[args.masks]:
            case = Case(b, s, h, kvh, d, causal)
            cfgs = cpu_pair() if args.cpu_smoke else gpu_pair(d)
            first, second = cfgs

            sets = [inputs(case, seed) for seed in (1, 2)]
            weights = [
                jax.random.normal(jax.random.key(9 + i), s[0].shape) for i, s in enumerate(sets)
            ]
            loss_sets = [(q, k, v, w) for (q, k, v, _), w in zip(sets, weights, strict=True)]
            harnesses = {
                "vjp": (fwd_bwd, sets),
                "weighted loss": (weighted_loss, loss_sets),
            }
            times: dict[str, dict[str, float]] = {}
            for label, (wrap, arg_sets) in harnesses.items():
                fns = {name: jax.jit(wrap(attention(cfg, causal))) for name, cfg in cfgs.items()}
                for fn in fns.values():
                    for a in arg_sets:
                        jax.block_until_ready(fn(*a))
                for suffix, used in (("rotating", arg_sets), ("one set", arg_sets[:1])):
                    ms = interleaved_ms(
                        fns, used, args.calls, args.rounds, args.min_batch_ms, args.settle_ms
                    )
                    times[f"{label}, {suffix}"] = {n: statistics.median(t) for n, t in ms.items()}
            q, k, v, _ = sets[0]
            (inv,) = ejkfn.record(
                lambda q, k, v, causal=causal: ejkfn.flash_attention(q, k, v, causal=causal),
                q,
                k,
                v,
            )
            tuner = ejkfn.Tuner(
                warmup=2,
                iters=args.calls * 2,
                rounds=max(args.rounds // 2, 1),
                progress=False,
                min_batch_seconds=args.min_batch_ms / 1e3,
            )
            report = tuner.tune(inv, list(cfgs.values()), validate_backward=True)
            times["Tuner"] = {
                name: r.seconds * 1e3 for name, r in zip(cfgs, report.results, strict=True) if r.ok
            }
            for harness, ms in times.items():
                ratio = ms[second] / ms[first] if first in ms and second in ms else None
                rows.append(dict(case=case.name, harness=harness, ms=ms, ratio=ratio, **timing))
    print(f"\n| case | harness | {first} ms | {second} ms | {second} / {first} |\n|{'---|' * 5}")
    for r in rows:
        ms = r["ms"]
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
        print(
            f"| {r['case']} | {r['harness']} | {ms.get(first, float('nan')):.4f} | "
            f"{ms.get(second, float('nan')):.4f} | {ratio} |"
        )
    if args.out:
        save_rows(args.out, "tuner_harness", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
