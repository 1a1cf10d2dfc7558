"""Whether another revision of the Mosaic attention modules lowers to the same GPU kernels as this
tree's: an A/B of a refactor settled on a CPU, without device time.

For each shape and mask, each Mosaic kernel the shape takes (the heuristic's forward; the split and
the fused backward) is lowered for a Hopper GPU (an abstract H100) from this tree's module and from
the other revision's. Mosaic GPU serialises each kernel's MLIR into the lowered program; the script
prints each kernel's MLIR without source locations, drops the dump name Mosaic numbers per process,
and compares. The exit status is 1 where any kernel differs, and the first differing line is shown.

    git show REV:ejkfn/attention/_pallas_mosaic_bwd.py > OLD_BWD.py
    python benchmarks/same_programs.py --other-bwd OLD_BWD.py [--other-fwd OLD_FWD.py]

Equal kernels run the same PTX, so timing them against each other measures only the machine's
noise (benchmarks/NOTES.md, thirty-ninth round).
"""

from __future__ import annotations

import argparse
import difflib
import functools
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.experimental.mosaic.gpu as mosaic_gpu
import jax.numpy as jnp
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention import MASKS, load_module, lower_for_hopper, parse_shapes

from ejkfn.attention import _pallas_mosaic, _pallas_mosaic_bwd
from ejkfn.attention._backend import AttentionShape
from ejkfn.attention._spec import AttentionSpec

# Small shapes that still take every path: GQA and not, both fused kinds (head dims 64 and 128),
# several tiles a CTA. Tile orders and grids that switch at long sequences need --shapes.
SHAPES = "2x1024x4x128,2x1024x4x128x2,2x1024x4x64,2x1024x4x64x2"
_DUMP_NAME = re.compile(r'mosaic_gpu\.dump_basename = "[^"]*"')


def kernels(lowered: Any) -> list[str]:
    """The MLIR of every Mosaic GPU kernel in a lowered program, without locations or dump name."""
    found: list[str] = []

    def walk(op: Any) -> None:
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if child.operation.name == "stablehlo.custom_call":
                        target = ir.StringAttr(child.attributes["call_target_name"]).value
                        if target.startswith("mosaic_gpu"):
                            found.append(_kernel_text(child))
                    walk(child.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    if not found:
        raise SystemExit("found no Mosaic GPU kernel in the lowered program")
    return found


def _kernel_text(call: Any) -> str:
    config = ir.DictAttr(call.attributes["mhlo.backend_config"])
    data = ir.StringAttr(config["module"]).value_bytes
    with jax_mlir.make_ir_context() as context:
        mosaic_gpu.dialect.register_dialect(context)  # its barrier and layout types
        context.allow_unregistered_dialects = True
        text = ir.Module.parse(data).operation.get_asm(enable_debug_info=False)
    return _DUMP_NAME.sub("", text)


def lower(fn: Callable[..., Any], *args: Any) -> list[str]:
    """The kernels of ``fn`` lowered for Hopper; a revision that refuses the shape gives its reason."""
    try:
        return kernels(lower_for_hopper(fn, *args))
    except NotImplementedError as e:
        return [f"refused: {e}"]


def programs(
    fwd_module: ModuleType | None, bwd_module: ModuleType | None, shape: AttentionShape
) -> Iterator[tuple[str, list[str]]]:
    """(name, kernels) of each Mosaic program the shape takes, lowered from these modules (the
    forward's, the backwards' where a module is given)."""
    q = jax.ShapeDtypeStruct((shape.batch, shape.seq_q, shape.heads, shape.head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((shape.batch, shape.seq_k, shape.kv_heads, shape.head_dim), q.dtype)
    lse = jax.ShapeDtypeStruct((shape.batch, shape.heads, shape.seq_q), jnp.float32)
    if fwd_module is not None:
        fp = _pallas_mosaic.heuristic(shape)[0]
        forward = functools.partial(
            fwd_module._forward, spec=shape.spec, params=fp, interpret=False
        )  # fmt: skip
        yield "forward", lower(forward, q, k, k)
    split = _pallas_mosaic._mosaic_bwd(shape)
    for name, bp in (
        ("split", split),
        ("fused", split and _pallas_mosaic._fused_bwd(shape, split)),
    ):
        if bp and bwd_module is not None:
            backward = functools.partial(
                bwd_module.bwd, spec=shape.spec, params=bp, interpret=False
            )  # fmt: skip
            yield f"{name} backward", lower(backward, q, k, k, q, lse, q)


def first_difference(ours: list[str], theirs: list[str]) -> str:
    """Empty where the kernels are equal; else where they first differ."""
    for side, lowered in (("here", ours), ("there", theirs)):
        if lowered[0].startswith("refused:"):
            return f"{side} {lowered[0][:200]}"
    if len(ours) != len(theirs):
        return f"{len(ours)} kernels here, {len(theirs)} there"
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            diff = difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
            changed = [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]
            return f"kernel {i}: " + " | ".join(line[:160] for line in changed[:2])
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other-bwd", help="another revision's _pallas_mosaic_bwd.py")
    parser.add_argument("--other-fwd", help="another revision's _pallas_mosaic.py (its forward)")
    parser.add_argument("--shapes", default=SHAPES, help="BxSxHxD[xKVH],... as attention.py")
    parser.add_argument("--masks", choices=tuple(MASKS), default="both")
    args = parser.parse_args()
    if not (args.other_bwd or args.other_fwd):
        parser.error("name another revision: --other-bwd and/or --other-fwd")
    try:
        other_fwd = load_module(args.other_fwd, "_same_fwd") if args.other_fwd else None
        other_bwd = load_module(args.other_bwd, "_same_bwd") if args.other_bwd else None
    except FileNotFoundError as e:
        parser.error(str(e))
    causals = MASKS[args.masks]
    differ = 0
    print("| shape | program | kernels | same |\n|---|---|---|---|")
    for (b, s, h, kvh, d), causal in (
        (dims, c) for dims in parse_shapes(args.shapes) for c in causals
    ):
        spec = AttentionSpec(scale=d**-0.5, causal=causal)
        shape = AttentionShape(
            batch=b, seq_q=s, seq_k=s, heads=h, kv_heads=kvh, head_dim=d, dtype="bfloat16",
            spec=spec,
        )  # fmt: skip
        name = f"{b}x{s}x{h}/{kvh}x{d}{' causal' if causal else ''}"
        here = programs(
            other_fwd and _pallas_mosaic, other_bwd and _pallas_mosaic_bwd, shape
        )  # fmt: skip
        there = programs(other_fwd, other_bwd, shape)
        for (program, ours), (_, theirs) in zip(here, there, strict=True):
            difference = first_difference(ours, theirs)
            differ += bool(difference)
            print(f"| {name} | {program} | {len(ours)} | {difference or 'yes'} |", flush=True)
    return int(differ > 0)


if __name__ == "__main__":
    sys.exit(main())
