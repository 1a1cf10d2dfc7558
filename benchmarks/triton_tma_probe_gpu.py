"""Probe: a Triton forward with tensor descriptors (TMA loads), launched through jax-triton 0.3.1.

jax-triton launches Triton kernels with a null global scratch buffer, where device-side tensor
descriptors live, and with the config's warps, where Hopper's warp specialisation adds a producer
warpgroup. In this process only, the probe gives each kernel a scratch output of its own (the PTX's
scratch parameter pointed at that output) and launches the warps the compiler asked for. It times
the descriptor forward (``CONFIGS``: blocks, warps, stages, warp specialised or not; causal masks
written against the query rows, as a constant triangle against one offset, or the first with a
bound that does not depend on the program) against this tree's Triton forward and JAX's Pallas
``mha``, after checking each against ``mha`` (benchmarks/NOTES.md, tenth round).

    python3 benchmarks/triton_tma_probe_gpu.py [--shapes ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import triton
import triton.language as tl
from attention import Case, check_then_time, inputs, parse_shapes, save_rows
from portable_sweep_gpu import mha
from revision_ab_gpu import direct

from ejkfn.attention import _triton

SCRATCH_BYTES = 1024  # per program; checked against what the compiler asks for
_PATCHED: set[str] = set()
_ASKED: dict[str, int] = {}
_WARPS: dict[str, int] = {}  # warps a kernel launches with, where warp specialisation added some


def install_scratch_patch() -> None:
    """Kernels named in ``_PATCHED`` read their global scratch from their last output."""
    import jax_triton.triton_lib as jtl
    import triton.backends.nvidia.compiler as nv

    make_ptx = nv.CUDABackend.make_ptx

    def recording(self, src, metadata, options, capability):
        out = make_ptx(self, src, metadata, options, capability)
        _ASKED[metadata["name"]] = int(metadata.get("global_scratch_size", 0))
        if "num_warps" in metadata:
            _WARPS[metadata["name"]] = int(metadata["num_warps"])
        return out

    nv.CUDABackend.make_ptx = recording
    compile_ptx = jtl.compile_ttir_to_ptx_inplace

    def patched(*args, **kwargs):
        result = compile_ptx(*args, **kwargs)
        if result.name not in _PATCHED:
            return result
        if _ASKED.get(result.name, 0) > SCRATCH_BYTES:
            raise ValueError(f"{result.name} needs {_ASKED[result.name]} scratch bytes a program")
        count = len(set(re.findall(rf"\.param[^\n]*?{result.name}_param_(\d+)", result.binary)))
        scratch, last_output = count - 2, count - 3  # Triton appends global, then profile scratch
        ptx = result.binary.replace(
            f"[{result.name}_param_{scratch}]", f"[{result.name}_param_{last_output}]"
        )
        return jtl.CompilationResult(
            binary=ptx, name=result.name, shared_mem_bytes=result.shared_mem_bytes,
            ttgir=result.ttgir, llir=result.llir,
        )  # fmt: skip

    jtl.compile_ttir_to_ptx_inplace = patched
    calls = jtl.triton_kernel_call_lib

    class Calls:
        # jax-triton launches num_warps from the config; a warp-specialised kernel needs more.
        def __getattr__(self, name: str) -> Any:
            return getattr(calls, name)

        @staticmethod
        def TritonKernel(name, num_warps, *rest):
            return calls.TritonKernel(name, _WARPS.get(name, num_warps), *rest)

    jtl.triton_kernel_call_lib = Calls()


_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _step(
    acc, l_i, m_i, q, k_desc, v_desc, n0, rows, C: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, SEQ_K: tl.constexpr, BLOCK_K: tl.constexpr, MASK_MODE: tl.constexpr = 0,
    m0=0, BLOCK_Q: tl.constexpr = 0,
):  # fmt: skip
    k = k_desc.load([n0, 0])
    qk = tl.dot(q, k.T)
    if MASKED:
        cols = n0 + tl.arange(0, BLOCK_K)
        ok = cols[None, :] < SEQ_K
        if CAUSAL:
            if MASK_MODE == 1:  # a constant triangle against one scalar offset
                tri = tl.arange(0, BLOCK_K)[None, :] - tl.arange(0, BLOCK_Q)[:, None]
                ok = ok & (tri <= m0 - n0)
            else:
                ok = ok & (cols[None, :] <= rows[:, None])
        s = tl.where(ok, qk * C, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * C)
        p = tl.exp2(qk * C - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v_desc.load([n0, 0])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def tma_fwd_kernel(
    Q, K, V, Out, Lse, Scratch,
    HEADS: tl.constexpr, GROUP: tl.constexpr, SEQ_Q: tl.constexpr, SEQ_K: tl.constexpr,
    SQB: tl.constexpr, SQS: tl.constexpr, SKB: tl.constexpr, SKS: tl.constexpr,
    SCALE: tl.constexpr, CAUSAL: tl.constexpr, BAND: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, WS: tl.constexpr,
    MASK_MODE: tl.constexpr,
):  # fmt: skip
    blocks: tl.constexpr = (SEQ_Q + BLOCK_Q - 1) // BLOCK_Q
    pid = tl.program_id(0)
    per_band = BAND * blocks
    r = pid % per_band
    pid_m = r // BAND
    if CAUSAL:
        pid_m = blocks - 1 - pid_m
    bh = pid // per_band * BAND + r % BAND
    b = bh // HEADS
    h = bh % HEADS
    kvh = h // GROUP
    b64 = b.to(tl.int64)
    m0 = pid_m * BLOCK_Q
    q_desc = tl.make_tensor_descriptor(
        Q + b64 * SQB + h * BLOCK_D, shape=[SEQ_Q, BLOCK_D], strides=[SQS, 1],
        block_shape=[BLOCK_Q, BLOCK_D],
    )  # fmt: skip
    k_desc = tl.make_tensor_descriptor(
        K + b64 * SKB + kvh * BLOCK_D, shape=[SEQ_K, BLOCK_D], strides=[SKS, 1],
        block_shape=[BLOCK_K, BLOCK_D],
    )  # fmt: skip
    v_desc = tl.make_tensor_descriptor(
        V + b64 * SKB + kvh * BLOCK_D, shape=[SEQ_K, BLOCK_D], strides=[SKS, 1],
        block_shape=[BLOCK_K, BLOCK_D],
    )  # fmt: skip
    q = q_desc.load([m0, 0])
    rows = m0 + tl.arange(0, BLOCK_Q)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q], -1e30, dtype=tl.float32)
    C: tl.constexpr = SCALE * _LOG2E
    full = SEQ_K // BLOCK_K * BLOCK_K
    hi = SEQ_K
    if CAUSAL:
        full = tl.minimum(full, (m0 + 1) // BLOCK_K * BLOCK_K)
        hi = tl.minimum(hi, m0 + BLOCK_Q)
    if MASK_MODE == 2:  # diagnostic: a bound that does not depend on the program
        hi = SEQ_K
    if WS:  # one loop: Triton 3.6's warp specialisation fails on a second loop after it
        for n0 in tl.range(0, hi, BLOCK_K, warp_specialize=True):
            acc, l_i, m_i = _step(
                acc, l_i, m_i, q, k_desc, v_desc, n0, rows, C,
                CAUSAL or SEQ_K % BLOCK_K != 0, CAUSAL, SEQ_K, BLOCK_K, MASK_MODE, m0, BLOCK_Q,
            )  # fmt: skip
    else:
        for n0 in range(0, full, BLOCK_K):
            acc, l_i, m_i = _step(
                acc, l_i, m_i, q, k_desc, v_desc, n0, rows, C, False, CAUSAL, SEQ_K, BLOCK_K
            )
        for n0 in range(full, hi, BLOCK_K):
            acc, l_i, m_i = _step(
                acc, l_i, m_i, q, k_desc, v_desc, n0, rows, C, True, CAUSAL, SEQ_K, BLOCK_K
            )
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o_desc = tl.make_tensor_descriptor(
        Out + b64 * SQB + h * BLOCK_D, shape=[SEQ_Q, BLOCK_D], strides=[SQS, 1],
        block_shape=[BLOCK_Q, BLOCK_D],
    )  # fmt: skip
    o_desc.store([m0, 0], (acc / l_safe[:, None]).to(Out.dtype.element_ty))
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
    tl.store(Lse + bh.to(tl.int64) * SEQ_Q + rows, lse, mask=rows < SEQ_Q)


_PATCHED.add("tma_fwd_kernel")


def tma_forward(
    case: Case, block_q: int, block_k: int, warps: int, stages: int, ws: bool, band: int,
    mask_mode: int = 0,
) -> Any:  # fmt: skip
    import jax_triton

    b, s, h, kvh, d = case.batch, case.seq, case.heads, case.kv_heads, case.dim
    programs = -(-s // block_q) * b * h

    def run(q, k, v):
        out, _, _ = jax_triton.triton_call(
            q, k, v,
            kernel=tma_fwd_kernel,
            out_shape=(
                jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, h, s), jnp.float32),
                jax.ShapeDtypeStruct((programs * SCRATCH_BYTES,), jnp.uint8),
            ),
            grid=(programs,),
            num_warps=warps, num_stages=stages,
            HEADS=h, GROUP=h // kvh, SEQ_Q=s, SEQ_K=s, SQB=s * h * d, SQS=h * d,
            SKB=s * kvh * d, SKS=kvh * d, SCALE=d**-0.5, CAUSAL=case.causal,
            BAND=band if case.causal else 1,
            BLOCK_Q=block_q, BLOCK_K=block_k, BLOCK_D=d, WS=ws, MASK_MODE=mask_mode,
        )  # fmt: skip
        return out

    return run


CONFIGS = [  # block_q, block_k, warps, stages, warp specialised
    (128, 128, 4, 2, True),
    (128, 64, 4, 2, True),
    (256, 64, 4, 2, True),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4x4096x16x128,2x8192x16x128")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    install_scratch_patch()
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for b, s, h, kvh, d in parse_shapes(args.shapes):
        for causal in (False, True):
            case = Case(b, s, h, kvh, d, causal)
            sets = [inputs(case, seed) for seed in (0, 1)]
            fns = {"mha": mha(case), "triton now": direct(_triton, case)}
            for bq, bk, w, st, ws in CONFIGS:
                name = f"tma {bq}x{bk} w{w} s{st}{' ws' if ws else ''}"
                fns[name] = tma_forward(case, bq, bk, w, st, ws, 4)
                if causal and ws and bk == 128:
                    for mode in (1, 2):
                        fns[f"{name} mask{mode}"] = tma_forward(case, bq, bk, w, st, ws, 4, mode)
            jitted = {n: jax.jit(f) for n, f in fns.items()}
            rows += check_then_time(
                case, False, jitted, "mha", sets, args.calls, args.rounds, max_error=2e-2
            )
            print(f"{case.name} ({time.time() - t0:.0f} s)", flush=True)
    print(f"scratch asked: {_ASKED}")
    print(f"\n| case | impl | TFLOP/s | vs mha | err |\n|{'---|' * 5}")
    for r in rows:
        err = r.get("max_rel_err_vs_mha", float("nan"))
        if "ms" in r:
            print(
                f"| {r['case']} | {r['impl']} | {r['tflops']:.0f} | {r.get('vs_mha', 1):.2f} | {err:.1e} |"
            )
        else:
            print(f"| {r['case']} | {r['impl']} | not timed: {str(r)[:300]} |")
    if args.out:
        save_rows(args.out, "triton_tma_probe", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
