"""The Triton attention kernels compiled for a Hopper GPU on any machine, GPU or not: registers,
spills, ptxas's warnings and each loop's instructions, in bf16 (or ``--dtype``), for the configs
the heuristic picks (or the blocks given).

Each kernel is compiled exactly as the Triton backend launches it (grid constants, blocks and
pointer alignment as jax-triton passes them), for sm_90a, by Triton's own compiler and the ptxas it
ships. The loops are read off the SASS (a branch backwards is a loop): their instruction count,
wgmma instructions (``HGMMA``) and waits on them (``WARPGROUP.DEPBAR``). As many waits as wgmmas is
ptxas serializing them, which it warns of as C7515 (NOTES.md, forty-third round).

    python3 benchmarks/triton_sass.py [--shapes 8x2048x32x64,...] [--masks both]
        [--kernels fwd,dq,dkdv] [--fwd 128x64x8x3] [--bwd 32x64x4x3xmirrored[xdq2]]
        [--feature segments] [--dtype float32] [--split always] [--json FILE]

``--feature`` compiles calls that use one (``bias``, ``bias_f32``, ``mask``, ``segments``,
``dropout``, ``soft_cap`` or ``window``, made as ``features_gpu.py`` makes them) on the blocks the
heuristic picks for such a call. Each kernel's row also has the shared memory it asks at launch
(Triton's count; Hopper allows 227 KiB).

``--split always`` (or ``never``) compiles every window's interior unmasked (or masked) whatever
``_triton.splits_window`` would pick, float32 too, to see what its rule costs before timing it.

``--ptx FILE...`` reads PTX built elsewhere the same way: XLA's build of the Pallas-Triton kernels,
kept on a GPU by ``benchmarks/xla_ptxas/ptxas``. Its ``.version`` is lowered to what this ptxas
takes where it is newer. Each loop also counts its async-proxy fences (``FENCE.VIEW.ASYNC``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("triton_sass.py compiles the kernels: unset TRITON_INTERPRET")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention import MASKS, Case, parse_params, parse_shapes
from features_gpu import DTYPES, FEATURES, FLOAT32_BIAS, feature_arrays, feature_spec

from ejkfn import BwdParams, FwdParams
from ejkfn.attention import AttentionShape, AttentionSpec, _triton

KERNELS = {"fwd": "fwd_kernel", "dq": "bwd_dq_kernel", "dkdv": "bwd_dkdv_kernel"}
# Whether a window's interior runs unmasked (``_triton.splits_window``), by ``--split``.
SPLIT_RULES = {
    "rule": _triton.splits_window,
    "always": lambda spec, dtype, pass_: True,
    "never": lambda spec, dtype, pass_: spec.window is None,
}
_POINTEE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "int8": "i8"}
_POINTEE |= {"int32": "i32", "uint32": "u32"}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as the backend makes it: what compiling it needs."""

    kernel: Any
    pointees: tuple[str, ...]  # the Triton element type of each array argument, outputs last
    num_warps: int
    num_stages: int
    constexprs: dict[str, Any]


def _feature_inputs(shape: AttentionShape, feature: str) -> tuple[Any, ...]:
    """(bias, mask, q_seg, kv_seg, seed) as abstract arrays, as ``features_gpu.py`` makes them."""
    case = Case(shape.batch, shape.seq_q, shape.heads, shape.kv_heads, shape.head_dim, False)
    made = jax.eval_shape(lambda: feature_arrays(case, feature, dtype=jnp.dtype(shape.dtype)))
    names = ("bias", "attention_mask", "q_segment_ids", "kv_segment_ids", "dropout_seed")
    return tuple(made.get(name) for name in names)


def launches(
    shape: AttentionShape, fp: FwdParams, bp: BwdParams, feature: str = "none"
) -> dict[str, Launch]:
    """name -> the launch of each kernel of a forward and backward at ``shape``, recorded by
    running the backend's own ``fwd`` and ``bwd`` on abstract arrays with a stand-in launcher
    (with ``feature``'s arrays, which ``shape.spec`` must ask for)."""
    made: dict[str, Launch] = {}

    def record(kernel, *args, grid, out_shapes, num_warps, num_stages, interpret, **kw):
        del grid, interpret
        kw.pop("zeroed", None)
        if any(isinstance(a, (bool, int, float)) for a in args):
            raise TypeError(f"{kernel.__name__}: scalar arguments are not handled here")
        types = [np.dtype(a.dtype).name for a in [*args, *out_shapes]]
        name = next(n for n, k in KERNELS.items() if k == kernel.__name__)
        pointees = tuple(_POINTEE[t] for t in types)
        made[name] = Launch(kernel, pointees, num_warps, num_stages, kw)
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shapes)

    b, s, h, kvh, d = shape.batch, shape.seq_q, shape.heads, shape.kv_heads, shape.head_dim
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.dtype(shape.dtype))
    kv = jax.ShapeDtypeStruct((b, shape.seq_k, kvh, d), jnp.dtype(shape.dtype))
    lse = jax.ShapeDtypeStruct((b, h, s), jnp.float32)
    extra = _feature_inputs(shape, feature)
    kw = dict(spec=shape.spec, interpret=False)
    real, _triton.launch = _triton.launch, record
    try:
        jax.eval_shape(
            lambda q, k, v, *extra: _triton.fwd(q, k, v, *extra, params=fp, **kw), q, kv, kv, *extra
        )
        jax.eval_shape(
            lambda q, k, v, o, lse, do, *extra: _triton.bwd(
                q, k, v, *extra, o, lse, do, params=bp, **kw
            ),
            q, kv, kv, q, lse, q, *extra,
        )  # fmt: skip
    finally:
        _triton.launch = real
    return made


def _ptxas() -> Path:
    import triton.backends.nvidia as nvidia

    return Path(nvidia.__file__).parent / "bin" / "ptxas"


def compile_sm90(launch: Launch) -> tuple[str, str, int]:
    """(ptxas's report of registers, spills and warnings; the SASS; the shared memory bytes the
    kernel asks at launch) of ``launch`` for sm_90a."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = launch.kernel
    pointers = iter(launch.pointees)
    signature = {
        n: "constexpr" if n in launch.constexprs else "*" + next(pointers) for n in fn.arg_names
    }
    constants = {(fn.arg_names.index(n),): v for n, v in launch.constexprs.items()}
    # jax-triton tells Triton that every buffer is 16-byte aligned; without it loads do not vectorise
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if n not in launch.constexprs
    }
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs=constants, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages),
    )
    return (*assemble(compiled.asm["ptx"]), compiled.metadata.shared)


def assemble(ptx_text: str) -> tuple[str, str]:
    """(ptxas's report, the SASS) of PTX for sm_90a, by the ptxas Triton ships."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(ptx_text)
        done = subprocess.run(
            [_ptxas(), "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True, text=True
        )
        newest = re.search(
            r"Unsupported \.version ([\d.]+); current version is '([\d.]+)'", done.stderr
        )
        if newest and newest[1] != newest[2]:  # a newer toolkit's (XLA's): no newer ISA is used
            return assemble(ptx_text.replace(f".version {newest[1]}", f".version {newest[2]}", 1))
        if done.returncode:
            raise RuntimeError(f"ptxas failed: {done.stderr.strip()}")
        sass = subprocess.run(
            [_ptxas().with_name("cuobjdump"), "-sass", cubin],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    return done.stderr, sass


_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")


def loops(sass: str) -> list[dict[str, Any]]:
    """Each loop of ``sass`` (the code between a branch backwards and its target): its instruction
    count, wgmmas, waits on them and the most frequent opcodes."""
    code = [(int(m[1], 16), m[2], m[3]) for m in map(_INSTRUCTION.match, sass.splitlines()) if m]
    out = []
    for at, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target is None or int(target[1], 16) >= at:
            continue
        body = [o for a, o, _ in code if int(target[1], 16) <= a <= at]
        kinds = collections.Counter(o.split(".")[0] for o in body)
        out.append(
            dict(
                instructions=len(body),
                wgmma=kinds["HGMMA"],
                wgmma_waits=sum(o.startswith("WARPGROUP.DEPBAR") for o in body),
                fences=sum(o.startswith("FENCE.VIEW.ASYNC") for o in body),
                common=dict(kinds.most_common(6)),
            )
        )
    return out


def inspect(launch: Launch) -> dict[str, Any]:
    ptxas_output, sass, shared = compile_sm90(launch)
    return report(ptxas_output, sass) | dict(shared_bytes=shared)


def report(ptxas_output: str, sass: str) -> dict[str, Any]:
    """Registers, spills, ptxas's warnings and the loops, from ptxas's output and the SASS."""
    registers = re.search(r"Used (\d+) registers", ptxas_output)
    spills = re.search(r"(\d+) bytes spill stores", ptxas_output)
    return dict(
        registers=int(registers[1]) if registers else None,
        spill_bytes=int(spills[1]) if spills else None,
        warnings=sorted(set(re.findall(r"\((C\d+)\)", ptxas_output))),
        loops=loops(sass),
    )


def _summary(row: dict[str, Any]) -> str:
    shared = f", {row['shared_bytes']} bytes shared" if "shared_bytes" in row else ""
    return (
        f"{row['registers']} registers, {row['spill_bytes']} bytes spilled{shared}, "
        f"warnings {row['warnings'] or 'none'}"
    )


def _print_loops(row: dict[str, Any]) -> None:
    for loop in row["loops"]:
        print(
            f"    loop: {loop['instructions']} instructions, {loop['wgmma']} wgmma, "
            f"{loop['wgmma_waits']} waits, {loop['fences']} fences; {loop['common']}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x2048x32x64,4x4096x16x128")
    parser.add_argument("--masks", choices=tuple(MASKS), default="both")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--fwd", default="", help="forward blocks, else the heuristic's")
    parser.add_argument("--bwd", default="", help="backward blocks, else the heuristic's")
    parser.add_argument("--feature", choices=(*FEATURES, FLOAT32_BIAS), default="none")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--split", choices=tuple(SPLIT_RULES), default="rule")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument("--ptx", nargs="+", default=[], help="read these PTX files instead")
    args = parser.parse_args()
    if args.ptx:
        rows = [
            dict(ptx=Path(path).name, **report(*assemble(Path(path).read_text())))
            for path in args.ptx
        ]
        for row in rows:
            print(f"{row['ptx']}: {_summary(row)}")
            _print_loops(row)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    _triton.splits_window = SPLIT_RULES[args.split]
    wanted = args.kernels.split(",")
    if unknown := set(wanted) - set(KERNELS):
        parser.error(f"--kernels: {sorted(unknown)} not among {list(KERNELS)}")
    rows = []
    for b, s, h, kvh, d in parse_shapes(args.shapes):
        for causal in MASKS[args.masks]:
            spec = AttentionSpec(scale=d**-0.5, causal=causal)
            q = jax.ShapeDtypeStruct((b, s, h, d), jnp.dtype(args.dtype))
            k = jax.ShapeDtypeStruct((b, s, kvh, d), jnp.dtype(args.dtype))
            shape = AttentionShape.of(q, k, feature_spec(spec, args.feature, s))
            fp, bp = _triton.heuristic(shape)
            fp = parse_params(args.fwd, FwdParams) if args.fwd else fp
            bp = parse_params(args.bwd, BwdParams) if args.bwd else bp
            case = f"{b}x{s}x{h}{f'/{kvh}kv' if kvh != h else ''}x{d}{' causal' if causal else ''}"
            case += "" if args.feature == "none" else f" +{args.feature}"
            case += "" if args.dtype == "bfloat16" else f" {args.dtype}"
            case += "" if args.split == "rule" else f" split {args.split}"
            for name, launch in launches(shape, fp, bp, args.feature).items():
                if name not in wanted:
                    continue
                blocks = {k: launch.constexprs[k] for k in ("BLOCK_Q", "BLOCK_K")}
                row = dict(case=case, kernel=name, **blocks, num_warps=launch.num_warps)
                row |= dict(num_stages=launch.num_stages, **inspect(launch))
                rows.append(row)
                print(
                    f"{case:24} {name:5} {blocks['BLOCK_Q']}x{blocks['BLOCK_K']} "
                    f"w{launch.num_warps} s{launch.num_stages}: {_summary(row)}"
                )
                _print_loops(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
