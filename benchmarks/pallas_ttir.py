"""The Pallas-Triton attention kernels lowered for a Hopper GPU on any machine, GPU or not: each
kernel's Triton IR as JAX hands it to XLA, without source locations, and a short hash of it.

Two checkouts' hashes are equal exactly when a change left a kernel's IR as it was, which is what a
refactor of the kernels should show before a GPU times it (NOTES.md, seventy-second round). The
calls are made as ``features_gpu.py`` makes them; the blocks are the heuristic's or the ones given.

    python3 benchmarks/pallas_ttir.py [--shapes 4x4096x16x128,...] [--masks both]
        [--feature soft_cap] [--fwd 128x64x8x3] [--bwd 64x128x8x3xmirrored] [--out DIR]

``--out`` also writes each kernel's IR as ``DIR/<shape>[-causal]-<feature>-<kernel>.mlir``, to
diff.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention import MASKS, Case, lower_for_hopper, parse_params, parse_shapes
from features_gpu import FEATURES, FLOAT32_BIAS, case_spec, feature_arrays
from jax._src.lib.mlir import ir
from jax._src.pallas.triton.lowering import _new_ir_context

from ejkfn import BwdParams, FwdParams
from ejkfn.attention import AttentionShape, _pallas_gpu

# A Triton kernel in the lowered module: its IR (MLIR bytecode, escaped) and its name.
_KERNEL = re.compile(r'ir = "(.*?)", name = "([^"]*)"')
_ESCAPED = {"\\": 0x5C, '"': 0x22, "n": 0x0A, "t": 0x09}


def unescape(text: str) -> bytes:
    """The bytes of an MLIR string attribute as the module's text prints it (``\\XX`` in hex)."""
    out, i = bytearray(), 0
    while i < len(text):
        if text[i] != "\\":
            out += text[i].encode()
            i += 1
        elif text[i + 1] in _ESCAPED:
            out.append(_ESCAPED[text[i + 1]])
            i += 2
        else:
            out.append(int(text[i + 1 : i + 3], 16))
            i += 3
    return bytes(out)


def kernels(module_text: str) -> dict[str, str]:
    """name -> each Triton kernel's IR in ``module_text``, printed without source locations."""
    out = {}
    for escaped, name in _KERNEL.findall(module_text):
        with _new_ir_context(), ir.Location.unknown():
            module = ir.Module.parse(unescape(escaped))
            out[name] = module.operation.get_asm(enable_debug_info=False)
    return out


def lowered(case: Case, feature: str, fp: Any, bp: Any) -> dict[str, str]:
    """The kernels of a forward and a backward of ``case`` with ``feature``, lowered for Hopper."""
    spec = case_spec(case, feature)
    dtype = jnp.bfloat16
    q = jax.ShapeDtypeStruct((case.batch, case.seq, case.heads, case.dim), dtype)
    kv = jax.ShapeDtypeStruct((case.batch, case.seq, case.kv_heads, case.dim), dtype)
    lse = jax.ShapeDtypeStruct((case.batch, case.heads, case.seq), jnp.float32)
    made = jax.eval_shape(lambda: feature_arrays(case, feature, dtype=dtype))
    names = ("bias", "attention_mask", "q_segment_ids", "kv_segment_ids", "dropout_seed")
    extra = [made.get(name) for name in names]
    kw = dict(spec=spec, interpret=False)

    def fwd(q, k, v, *extra):
        return _pallas_gpu.fwd(q, k, v, *extra, params=fp, **kw)

    def bwd(q, k, v, o, lse, do, *extra):
        return _pallas_gpu.bwd(q, k, v, *extra, o, lse, do, params=bp, **kw)

    out = {}
    for fn, args in ((fwd, (q, kv, kv, *extra)), (bwd, (q, kv, kv, q, lse, q, *extra))):
        out |= kernels(lower_for_hopper(fn, *args).as_text())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4x4096x16x128")
    parser.add_argument("--masks", choices=tuple(MASKS), default="both")
    parser.add_argument("--feature", choices=(*FEATURES, FLOAT32_BIAS), default="none")
    parser.add_argument("--fwd", default="", help="forward blocks, else the heuristic's")
    parser.add_argument("--bwd", default="", help="backward blocks, else the heuristic's")
    parser.add_argument("--out", default="", help="also write each kernel's IR into this folder")
    args = parser.parse_args()
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    shapes = parse_shapes(args.shapes)
    for case in (Case(b, s, h, kvh, d, c) for b, s, h, kvh, d in shapes for c in MASKS[args.masks]):
        spec = case_spec(case, args.feature)
        q = jax.ShapeDtypeStruct((case.batch, case.seq, case.heads, case.dim), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((case.batch, case.seq, case.kv_heads, case.dim), jnp.bfloat16)
        fp, bp = _pallas_gpu.heuristic(AttentionShape.of(q, k, spec))
        fp = parse_params(args.fwd, FwdParams) if args.fwd else fp
        bp = parse_params(args.bwd, BwdParams) if args.bwd else bp
        label = f"{case.name}-{args.feature}".replace(" ", "-").replace("/", "_")
        for name, text in lowered(case, args.feature, fp, bp).items():
            digest = hashlib.sha256(text.encode()).hexdigest()[:12]
            print(f"{label:40} {name:24} {digest}  ({text.count(chr(10))} lines)")
            if out is not None:
                (out / f"{label}-{name}.mlir").write_text(text)


if __name__ == "__main__":
    main()
