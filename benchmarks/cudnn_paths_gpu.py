"""Our ``cudnn`` platform beside ``jax.nn.dot_product_attention(implementation="cudnn")`` on a GPU.

Ways to the same cuDNN kernels, timed side by side in one run (the table's method:
:func:`attention.interleaved_ms`: 0.3 s batches after 0.2 s of settling): ``jax.nn`` as the README's
cuDNN row calls it, ``jax.nn`` asked for its softmax statistics as well (what our backend asks for
where the backward needs the log-sum-exp), and ``ejkfn.flash_attention(platform="cudnn")``, which
leaves the statistics out where nothing differentiates the call. The forward pass also times our
backend's forward with its residuals (``FlashAttention.fwd``), the cuDNN graph that calls nothing
differentiates ran before. For each compiled program it lists the cuDNN custom calls, to show that
our backward's second forward (``jax.vjp`` inside it) is merged with the first.

    python3 benchmarks/cudnn_paths_gpu.py [--passes fwd,fwd+bwd] --out "$OUT"
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention import MASKS, Case, fwd_bwd, inputs, interleaved_ms, parse_shapes, save_rows

import ejkfn
from ejkfn.attention import AttentionConfig, FlashAttention

BASELINE = "jax.nn"
RESIDUALS = "ejkfn cudnn, fwd with residuals"  # a forward only: nothing to differentiate


def paths(causal: bool) -> dict[str, Any]:
    def plain(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

    def with_statistics(q, k, v):
        out, _ = jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn", return_residual=True
        )
        return out

    cfg = AttentionConfig(platform="cudnn", variant="cudnn")

    def ours(q, k, v):
        return ejkfn.flash_attention(q, k, v, causal=causal, cfg=cfg)

    def ours_with_residuals(q, k, v):
        return FlashAttention(platform="cudnn").fwd(q, k, v, cfg=cfg, causal=causal)[0]

    return {
        BASELINE: plain,
        "jax.nn with statistics": with_statistics,
        "ejkfn cudnn": ours,
        RESIDUALS: ours_with_residuals,
    }


def cudnn_calls(compiled_text: str) -> list[str]:
    """The cuDNN custom-call targets of a compiled program, in order."""
    marker = 'custom_call_target="__cudnn'
    return [
        line.split("custom_call_target=")[1].split(",")[0].strip('"')
        for line in compiled_text.splitlines()
        if marker in line
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes",
        default="2x8192x16x128,4x4096x16x128,2x8192x32x128x8,8x2048x32x64",
        help="BxSxHxD or BxSxHxDxKVH, comma-separated",
    )
    parser.add_argument("--masks", choices=tuple(MASKS), default="both")
    parser.add_argument(
        "--passes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd or both"
    )
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="", help="folder for the results' JSON")
    args = parser.parse_args()
    causal_options = MASKS[args.masks]
    passes = args.passes.split(",")
    if set(passes) - {"fwd", "fwd+bwd"}:
        parser.error(f"--passes takes fwd and fwd+bwd, comma-separated; got {args.passes!r}")
    rows: list[dict[str, Any]] = []
    for b, s, h, kvh, d in parse_shapes(args.shapes):
        for causal in causal_options:
            case = Case(b, s, h, kvh, d, causal)
            sets = [inputs(case, seed) for seed in range(2)]
            for backward in [p == "fwd+bwd" for p in passes]:
                arg_sets = [x if backward else x[:3] for x in sets]
                # Compiled once: the programs read for their custom calls are the ones timed.
                fns = {
                    name: jax.jit(fwd_bwd(fn) if backward else fn).lower(*arg_sets[0]).compile()
                    for name, fn in paths(causal).items()
                    if not (backward and name == RESIDUALS)
                }
                custom_calls = {name: cudnn_calls(fn.as_text()) for name, fn in fns.items()}
                for fn in fns.values():  # run once before timing
                    jax.block_until_ready(fn(*arg_sets[0]))
                timed = interleaved_ms(fns, arg_sets, args.calls, args.rounds)
                base = statistics.median(timed[BASELINE])
                for name, ms_list in timed.items():
                    ms = statistics.median(ms_list)
                    rows.append(
                        dict(
                            case=case.name,
                            pass_="fwd+bwd" if backward else "fwd",
                            impl=name,
                            cudnn_calls=custom_calls[name],
                            ms=ms,
                            tflops=case.flops(backward) / ms / 1e9,
                            vs_jax_nn=base / ms,
                            spread=max(ms_list) / min(ms_list),
                        )
                    )
    print(f"\n| case | pass | impl | TFLOP/s | vs {BASELINE} | cuDNN calls |\n|{'---|' * 6}")
    for r in rows:
        print(
            f"| {r['case']} | {r['pass_']} | {r['impl']} | {r['tflops']:.0f} | "
            f"{r['vs_jax_nn']:.3f} | {', '.join(r['cudnn_calls'])} |"
        )
    if args.out:
        save_rows(args.out, "cudnn_paths", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
