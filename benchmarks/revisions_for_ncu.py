"""Forward+backward of the portable kernels of this tree and of earlier revisions, for ``ncu``.

Each revision (this tree's kernels, named ``tree``, then each ``--previous`` folder's, named by the
folder, loaded as ``revision_ab_gpu.py`` loads them) runs its heuristic config once to compile and
then ``--calls`` times, a line ``profile: <shape> <name>`` going to stdout before its timed calls,
so a profiler's kernels match the revisions in launch order. Shapes are ``BxSxHxD[xKVH]``, with a
trailing ``c`` for causal. Nothing is checked or timed: ``revision_ab_gpu.py`` does that under load.

The eighty-fourth round (NOTES.md) ran it two ways on an H200. Time, cycles and instructions of
each revision's kernels alone::

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --kernel-name regex:dkdv \\
        --metrics gpu__time_duration.sum,sm__cycles_elapsed.max,smsp__inst_executed.sum --csv \\
        python3 benchmarks/revisions_for_ncu.py --shapes 8x2048x32x64c --previous DIR

and where a kernel's warps wait, by instruction (``ncu_source.py`` reads the export)::

    ncu --section SourceCounters --section WarpStateStats --kernel-name regex:dkdv \\
        --launch-skip 1 --launch-count 1 -o REPORT python3 benchmarks/revisions_for_ncu.py ...
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > source.csv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention import Case, fwd_bwd, inputs, parse_shapes
from revision_ab_gpu import direct, previous_modules

from ejkfn.attention import _pallas_gpu, _triton

TREE = {"triton": _triton, "pallas": _pallas_gpu}


def parse_case(text: str) -> Case:
    """``"8x2048x32x64c"``: the other scripts' ``BxSxHxD[xKVH]`` (``attention.parse_shapes``),
    causal with a trailing ``c``."""
    try:
        [(b, s, h, kvh, d)] = parse_shapes(text.removesuffix("c"))
    except ValueError:
        raise ValueError(f"--shapes: expected BxSxHxD[xKVH][c]; got {text!r}") from None
    return Case(b, s, h, kvh, d, text.endswith("c"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", required=True, help="BxSxHxD[xKVH][c], comma-separated")
    parser.add_argument("--backend", choices=tuple(TREE), default="triton")
    parser.add_argument("--previous", nargs="*", default=[], help="earlier revisions' folders")
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    try:
        cases = [parse_case(text) for text in args.shapes.split(",")]
    except ValueError as err:
        parser.error(str(err))
    if args.calls < 1:
        parser.error(f"--calls: expected at least 1; got {args.calls}")
    revisions = {"tree": TREE[args.backend]}
    for i, folder in enumerate(args.previous):
        revisions[Path(folder).name] = previous_modules(Path(folder), f"ncu{i}")[args.backend]
    for text, case in zip(args.shapes.split(","), cases, strict=True):
        arrays = inputs(case, 0)
        for name, module in revisions.items():
            step = jax.jit(fwd_bwd(direct(module, case)))
            jax.block_until_ready(step(*arrays))
            print(f"profile: {text} {name}", flush=True)
            for _ in range(args.calls):
                jax.block_until_ready(step(*arrays))
    return 0


if __name__ == "__main__":
    sys.exit(main())
