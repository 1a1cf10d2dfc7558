"""Identical portable kernels as separate programs, timed side by side: what one run resolves.

Two copies of the same Triton kernels read up to 4% apart in one run, with one sign at every shape,
and the sign flipped in the next run (NOTES.md, eighty-first round). This script times, in one
process, ``--jits`` jits of this tree's backend and ``--copies`` copies of its module (the same files
loaded again under other names, as ``revision_ab_gpu.py`` loads a revision), each through its
heuristic config, beside JAX's ``mha`` unless ``--no-mha`` (it runs only on a GPU). For each case
it prints every program's median, its ratio to the first, and the spread of the medians (the
slowest over the fastest): an A/B in a run like this one means nothing below that spread.
``--copies-first`` loads and compiles the copies before this tree's kernels, to see whether the
order of loading sets which copy is fast, and ``--mha-last`` puts ``mha`` after them. ``--pad``
puts one more jit of this tree's kernels (``pad``, left out of the spread) between ``mha`` and them:
the program listed next to ``mha`` read slowest in most runs (NOTES.md, eighty-second round).
``--reverse-compile`` compiles and runs ``mha`` and then the others in reverse order before the
check, so that the program compiled next to ``mha`` is not the one listed next to it. Each case also
says whether the programs' optimized HLO is the same text (names aside). ``--trace`` times
``--trace-rounds`` more rounds, as timed, under JAX's profiler and prints each program's calls and
its kernels' median device times, to say which kernel of a slow copy is slow.

    python3 benchmarks/copies_gpu.py [--backends triton] [--shapes 4x4096x16x128,...]
        [--masks both] [--passes bwd] [--jits 2] [--copies 2] [--no-mha] [--copies-first]
        [--mha-last] [--pad] [--reverse-compile]
        [--rounds 8] [--calls 5] [--trace] [--trace-rounds 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax
from attention import (
    MASKS,
    Case,
    another_program,
    check_then_time,
    fwd_bwd,
    inputs,
    interleaved_ms,
    parse_cases,
    save_rows,
)
from jax._src.lib import _profile_data
from portable_sweep_gpu import mha
from revision_ab_gpu import direct, previous_modules

from ejkfn.attention import _pallas_gpu, _triton

TREE = {"triton": _triton, "pallas": _pallas_gpu}


def programs(
    case: Case, backward: bool, backend: str, jits: int, copies: list[Any], copies_first: bool
) -> dict[str, Any]:
    """Label -> jitted program: ``jits`` of this tree's module and one of each copy."""
    tree = {f"{backend} tree {i}": TREE[backend] for i in range(jits)}
    copied = {f"{backend} copy {i}": c[backend] for i, c in enumerate(copies)}
    chosen = {**copied, **tree} if copies_first else {**tree, **copied}
    return {
        label: named_jit(fwd_bwd(direct(module, case)) if backward else direct(module, case), label)
        for label, module in chosen.items()
    }


def named_jit(fn: Any, label: str) -> Any:
    """``fn`` jitted as a module named after ``label`` (``jit_<label>``), which the profiler's
    kernel events carry: identical programs are told apart by it."""

    program = another_program(fn)
    program.__name__ = program.__qualname__ = module_name(label)
    return jax.jit(program)


def module_name(label: str) -> str:
    return re.sub(r"\W", "_", label)


def same_hlo(fns: dict[str, Any], args: tuple[Any, ...]) -> list[str]:
    """Where the programs' optimized HLO differs from the first's, names and source metadata
    aside: for each program, its first differing line from a little before where it departs
    (empty where all are the same text)."""
    texts = {}
    for label, fn in fns.items():
        text = fn.lower(*args).compile().as_text().replace(module_name(label), "program")
        text = text.split("\nFileNames")[0]  # the tables of the source lines that traced it
        texts[label] = re.sub(r", metadata=\{[^}]*\}", "", text).splitlines()
    first, *others = texts
    differences = []
    for label in others:
        pairs = zip(texts[first], texts[label], strict=False)
        for number, (mine, theirs) in enumerate(pairs, start=1):
            if mine != theirs:
                chars = zip(mine, theirs, strict=False)
                at = next((i for i, (a, b) in enumerate(chars) if a != b), len(mine))
                shown = slice(max(at - 40, 0), at + 80)
                differences.append(
                    f"{label}, line {number}, column {at}: {mine[shown]!r} against {theirs[shown]!r}"
                )
                break
        else:
            if len(texts[first]) != len(texts[label]):
                differences.append(f"{label}: {len(texts[label])} lines, not {len(texts[first])}")
    return differences


def traced_rounds(
    fns: dict[str, Any], sets: list[Any], calls: int, rounds: int
) -> dict[str, dict[str, float]]:
    """``rounds`` interleaved rounds, as timed, under JAX's profiler: for each program its median
    ms a call (``ms``), how many calls its first kernel ran (``calls``), the device's idle µs
    between its kernels a call (``idle_us``) and each kernel's median device µs (on the CPU,
    XLA's thunks stand in for kernels). The program listed first runs fewer calls: its warm-up
    call, the profiler session's first, is slow, and its batches are sized from it."""
    by_module = {f"jit_{module_name(label)}": label for label in fns}
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            readings = interleaved_ms(fns, sets, calls, rounds)
        [path] = Path(folder).rglob("*.xplane.pb")
        data = _profile_data.ProfileData.from_file(str(path))
    device = [p for p in data.planes if p.name.startswith("/device:")] or [
        p for p in data.planes if p.name == "/host:CPU"
    ]
    events: dict[str, list[tuple[str, int, int]]] = defaultdict(list)  # (kernel, start, end)
    for plane in device:
        for line in plane.lines:
            for event in line.events:
                label = by_module.get(str(dict(event.stats).get("hlo_module", "")))
                if label is not None:
                    events[label].append((event.name, event.start_ns, event.end_ns))
    if not events:
        seen = [(e.name, dict(e.stats)) for p in device for ln in p.lines for e in ln.events][:5]
        print(f"no profiled event named a program's module; the first events: {seen}")
    traced = {}
    for label in fns:
        by_kernel: dict[str, list[float]] = defaultdict(list)
        for kernel, start, end in events[label]:
            by_kernel[kernel].append((end - start) / 1e3)
        traced[label] = {
            "ms": statistics.median(readings[label]),
            "calls": len(next(iter(by_kernel.values()), [])),
            "idle_us": idle_per_call([e[1:] for e in events[label]], len(by_kernel)),
            **{kernel: statistics.median(us) for kernel, us in by_kernel.items()},
        }
    return traced


def idle_per_call(spans: list[tuple[int, int]], kernels_a_call: int) -> float:
    """Mean µs a call that the device spent between one program's kernels within its batches (gaps
    under 0.5 ms; longer ones are the turns of other programs)."""
    spans = sorted(spans)
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(spans)]
    calls = len(spans) / max(kernels_a_call, 1)
    return sum(g for g in gaps if 0 <= g < 500_000) / 1e3 / max(calls, 1)


def print_traced(traced: dict[str, dict[str, float]]) -> None:
    """One row a quantity (ms a call, calls, each kernel's µs), one column a program, with its
    ratio to the first program's."""
    labels = list(traced)
    first = traced[labels[0]]
    kernels = {k for t in traced.values() for k in t} - {"ms", "calls", "idle_us"}
    keys = ["ms", "calls", "idle_us", *sorted(kernels, key=lambda k: -first.get(k, 0))]
    print(f"\n| traced rounds | {' | '.join(labels)} |")
    print(f"|{'---|' * (len(labels) + 1)}")
    for key in keys:
        cells = []
        for label in labels:
            value = traced[label].get(key)
            ratio = f" ({value / first[key]:.3f})" if value and first.get(key) else ""
            cells.append("-" if value is None else f"{value:.4g}{ratio}")
        print(f"| {key[:60]} | {' | '.join(cells)} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="triton")
    parser.add_argument("--shapes", default="4x4096x16x128")
    parser.add_argument("--masks", choices=tuple(MASKS), default="both")
    parser.add_argument("--passes", default="bwd")
    parser.add_argument("--jits", type=int, default=2, help="jits of this tree's module")
    parser.add_argument("--copies", type=int, default=2, help="copies of the module, loaded anew")
    parser.add_argument("--no-mha", action="store_true", help="leave JAX's mha out (CPU runs)")
    parser.add_argument("--copies-first", action="store_true")
    parser.add_argument("--mha-last", action="store_true", help="mha compiled and warmed last")
    parser.add_argument(
        "--pad", action="store_true", help="a copy of the tree's kernels beside mha"
    )
    parser.add_argument(
        "--reverse-compile", action="store_true", help="compile mha, then the others last first"
    )
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--trace", action="store_true", help="kernel times under the profiler")
    parser.add_argument("--trace-rounds", type=int, default=2)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    backends = args.backends.split(",")
    if unknown := [b for b in backends if b not in TREE]:
        parser.error(f"--backends: expected names among {sorted(TREE)}; got {unknown}")
    if args.jits < 1 or args.copies < 0 or args.jits + args.copies < 2:
        parser.error(
            f"need --jits >= 1, --copies >= 0 and two programs; got {args.jits}, {args.copies}"
        )
    folder = Path(_triton.__file__).parent
    copies = [previous_modules(folder, f"copy{i}") for i in range(args.copies)]
    cases = parse_cases(args.shapes, args.masks)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for case in cases:
        sets = [inputs(case, seed) for seed in (0, 1)]
        for backward in [p == "bwd" for p in args.passes.split(",")]:
            fns = {}
            for backend in backends:
                fns |= programs(case, backward, backend, args.jits, copies, args.copies_first)
            if not args.no_mha:
                peer = {"mha": jax.jit(fwd_bwd(mha(case)) if backward else mha(case))}
                if args.pad:  # one more copy of the tree's first backend, beside mha
                    fn = direct(TREE[backends[0]], case)
                    pad = {"pad": named_jit(fwd_bwd(fn) if backward else fn, "pad")}
                    peer = pad | peer if args.mha_last else peer | pad
                fns = fns | peer if args.mha_last else peer | fns
            baseline = next(label for label in fns if label not in ("mha", "pad"))
            passed = [s[: 4 if backward else 3] for s in sets]
            if args.reverse_compile:  # so that the program compiled next to mha is listed last
                first_calls = [k for k in fns if k == "mha"] + [
                    k for k in reversed(fns) if k != "mha"
                ]
                for label in first_calls:
                    jax.block_until_ready(fns[label](*passed[0]))
            done = check_then_time(
                case, backward, fns, baseline, sets, args.calls, args.rounds, max_error=2e-2
            )
            for backend in backends:
                ours = [r for r in done if r["impl"].startswith(backend) and "ms" in r]
                if ours:
                    spread = max(r["ms"] for r in ours) / min(r["ms"] for r in ours)
                    for r in ours:
                        r["copies_spread"] = spread
            compared = {k: f for k, f in fns.items() if k not in ("mha", "pad")}
            differences = same_hlo(compared, passed[0])
            for r in done:
                r["same_hlo"] = not differences
            if args.trace:
                traced = traced_rounds(fns, passed, args.calls, args.trace_rounds)
                print_traced(traced)
                for r in done:
                    r["traced"] = traced.get(r["impl"], {})
            rows += done
            print(
                f"{case.name} {'fwd+bwd' if backward else 'fwd'}: the programs' optimized HLO"
                f" {'differs' if differences else 'the same'} ({time.time() - t0:.0f} s)",
                *differences,
                sep="\n  ",
            )
    print(f"\n| case | pass | impl | ms | vs first | spread of the {', '.join(backends)} medians |")
    print(f"|{'---|' * 6}")
    for r in rows:
        if "ms" not in r:
            print(f"| {r['case']} | {r['pass_']} | {r['impl']} | not timed: {r} |")
            continue
        ratio = next((v for k, v in r.items() if k.startswith("vs_")), 1.0)
        print(
            f"| {r['case']} | {r['pass_']} | {r['impl']} | {r['ms']:.4f} | {ratio:.4f} |"
            f" {r.get('copies_spread', float('nan')):.4f} |"
        )
    if args.out:
        save_rows(args.out, "copies", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
