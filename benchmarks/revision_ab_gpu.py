"""The portable kernels (Triton, Pallas-Triton) of this tree against an earlier revision's, in one run.

``--previous DIR`` holds that revision's ``_triton.py``, ``_triton_kernels.py`` and
``_pallas_gpu.py`` (``git show REV:ejkfn/attention/_triton.py > DIR/_triton.py``, and so on); several
folders, comma-separated, compare several revisions (or edited copies), each named by its folder.
All revisions run their own heuristic config through one custom VJP each (forward alone, then forward
and backward), are checked against JAX's Pallas ``mha`` and timed interleaved with it
(:func:`attention.check_then_time`). Prints each one's ratio to ``mha`` and to the other revision,
and saves the rows under ``--out``. ``--band-mib`` adds this tree's kernels with other L2 budgets
for the causal grids' bands (``_backend.BAND_BYTES``; 0: one pair a band).

``--window N`` gives every call a sliding window of ``N`` keys on either side, which ``mha`` does
not take: the first folder's kernels are then the check and the ratio's denominator instead.
``--split-keys 256x256,...`` adds this tree's Triton kernels with other ``WINDOW_SPLIT_KEYS`` (the
keys a window spans before its interior runs unmasked, forward x backward).
A pad, one more copy of this tree's kernels compared with nothing, stands between ``mha`` and the
revisions: the program listed next to ``mha`` read slowest in most runs (NOTES.md, eighty-second
and eighty-third rounds), and without it (``--no-pad``) that is the first folder's. ``--dtype``
sets q, k and v's dtype. ``--control`` adds a second copy of this tree's kernels (as a revision
named ``control``) and prints this tree's ratio to it: two copies of the same Triton kernels read
up to 4% apart in one run, with one sign at every shape (NOTES.md, eighty-first round), so a
revision's ratio means little unless it clears that.

    python3 benchmarks/revision_ab_gpu.py --previous DIR [--shapes 4x4096x16x128,...]
        [--masks both] [--passes fwd,bwd] [--band-mib 0,16] [--window 256]
        [--split-keys 256x256] [--dtype float32] [--control] [--no-pad] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
from attention import (
    MASKS,
    Case,
    check_then_time,
    fwd_bwd,
    inputs,
    load_module,
    parse_cases,
    save_rows,
)
from portable_sweep_gpu import mha

from ejkfn.attention import AttentionShape, AttentionSpec, _pallas_gpu, _triton
from ejkfn.attention import _backend as backend_module

SHAPES = "4x4096x16x128,2x8192x16x128,8x2048x32x64"


def previous_modules(folder: Path, tag: str) -> dict[str, ModuleType]:
    """An earlier revision's backends, loaded beside this tree's without registering them."""
    for name in ("_triton.py", "_triton_kernels.py", "_pallas_gpu.py"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"--previous {folder} has no {name}")
    kernels = load_module(folder / "_triton_kernels.py", f"_{tag}_triton_kernels")
    triton = load_module(folder / "_triton.py", f"_{tag}_triton")
    pallas = load_module(folder / "_pallas_gpu.py", f"_{tag}_pallas_gpu")
    triton._KERNELS = kernels.__name__
    return {"triton": triton, "pallas": pallas}


def direct(
    module: ModuleType, case: Case, window: int | None = None, dtype: str = "bfloat16"
) -> Any:
    """``(q, k, v) -> out`` through ``module``'s fwd and bwd with its heuristic config (``window``:
    that many keys on either side of each query)."""
    spec = AttentionSpec(
        scale=case.dim**-0.5,
        causal=case.causal,
        window=None if window is None else (window, window),
    )
    q = jax.ShapeDtypeStruct((case.batch, case.seq, case.heads, case.dim), dtype)
    k = jax.ShapeDtypeStruct((case.batch, case.seq, case.kv_heads, case.dim), dtype)
    fp, bp = module.heuristic(AttentionShape.of(q, k, spec))
    none = (None,) * 5  # bias, mask, q_seg, kv_seg, seed

    def forward(q, k, v):
        return module.fwd(q, k, v, *none, spec=spec, params=fp)

    @jax.custom_vjp
    def attend(q, k, v):
        return forward(q, k, v)[0]

    def attend_fwd(q, k, v):
        out, lse = forward(q, k, v)
        return out, (q, k, v, out, lse)

    def attend_bwd(res, do):
        q, k, v, out, lse = res
        dq, dk, dv, _ = module.bwd(q, k, v, *none, out, lse, do, spec=spec, params=bp)
        return dq, dk, dv

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def with_value(fn: Any, module: ModuleType, name: str, value: Any) -> Any:
    """``fn`` traced with ``module.name = value`` (jit it after wrapping)."""

    def run(*args):
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn(*args)
        finally:
            setattr(module, name, saved)

    return run


def with_band_bytes(fn: Any, budget: int) -> Any:
    """``fn`` traced with ``_backend.BAND_BYTES = budget`` (jit it after wrapping)."""
    return with_value(fn, backend_module, "BAND_BYTES", budget)


def parse_split_keys(text: str) -> list[dict[str, int]]:
    """``"256x512,..."`` as ``_triton.WINDOW_SPLIT_KEYS`` values (forward x backward keys)."""
    limits = []
    for item in text.split(","):
        parts = item.split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--split-keys: expected FWDxBWD key counts; got {item!r}")
        limits.append({"fwd": int(parts[0]), "bwd": int(parts[1])})
    return limits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--previous", required=True, help="folders, comma-separated")
    parser.add_argument("--backends", default="triton,pallas")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--masks", choices=tuple(MASKS), default="both")
    parser.add_argument("--passes", default="fwd,bwd")
    parser.add_argument("--band-mib", default="", help="comma-separated L2 budgets to add (MiB)")
    parser.add_argument("--window", type=int, default=None, help="keys on either side")
    parser.add_argument(
        "--split-keys",
        default="",
        help="with --window, this tree's Triton kernels again with these WINDOW_SPLIT_KEYS "
        "(FWDxBWD, comma-separated)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="also time a second copy of this tree's kernels, whose ratio to this tree's is the "
        "run's floor: identical Triton kernels read up to 4%% apart in one run (NOTES.md, "
        "eighty-first round)",
    )
    parser.add_argument(
        "--pad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time one more copy of this tree's kernels right after mha, compared with nothing "
        "(on unless --no-pad): the program listed there read up to 4.5%% slow (NOTES.md, "
        "eighty-second and eighty-third rounds)",
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    if args.window is not None and args.window < 0:
        parser.error(f"--window must be >= 0 keys; got {args.window}")
    folders = [Path(f) for f in args.previous.split(",")]
    tags = [f.name.strip("_") or "previous" for f in folders]
    if args.control:
        folders.append(Path(_triton.__file__).parent)
        tags.append("control")
    if len(set(tags)) != len(tags):
        parser.error(f"--previous: folder names must differ; got {tags}")
    previous = {t: previous_modules(f, t) for f, t in zip(folders, tags, strict=True)}
    current = {
        name: module
        for name, module in {"triton": _triton, "pallas": _pallas_gpu}.items()
        if name in args.backends.split(",")
    }
    budgets = [int(m) for m in args.band_mib.split(",") if m]
    try:
        split_keys = parse_split_keys(args.split_keys) if args.split_keys else []
    except ValueError as bad:
        parser.error(str(bad))
    # mha takes no window: the first folder's kernels check the others then
    baseline = "mha" if args.window is None else f"{next(iter(current))} {tags[0]}"
    cases = parse_cases(args.shapes, args.masks)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for case in cases:
        sets = [inputs(case, seed, args.dtype) for seed in (0, 1)]
        for backward in [p == "bwd" for p in args.passes.split(",")]:
            fns = {"mha": mha(case)} if args.window is None else {}
            if args.pad and fns:  # the place next to mha, taken by a program nobody compares
                fns["pad"] = direct(next(iter(current.values())), case, None, args.dtype)
            for name in current:
                for tag, modules in previous.items():
                    fns[f"{name} {tag}"] = direct(modules[name], case, args.window, args.dtype)
                fns[f"{name} now"] = direct(current[name], case, args.window, args.dtype)
            passes = {n: fwd_bwd(f) if backward else f for n, f in fns.items()}
            for mib in budgets:
                for name in current:
                    now = passes[f"{name} now"]
                    passes[f"{name} now, bands {mib} MiB"] = with_band_bytes(now, mib << 20)
            for limits in split_keys if "triton" in current else []:
                label = f"triton now, split {limits['fwd']}x{limits['bwd']}"
                passes[label] = with_value(
                    passes["triton now"], _triton, "WINDOW_SPLIT_KEYS", limits
                )
            jitted = {n: jax.jit(f) for n, f in passes.items()}
            done = check_then_time(
                case, backward, jitted, baseline, sets, args.calls, args.rounds, max_error=2e-2
            )
            by_impl = {r["impl"]: r for r in done}
            for name in current:  # each revision against the first folder's
                before = by_impl[f"{name} {tags[0]}"]
                for impl, row in by_impl.items():
                    if impl.startswith(name) and impl != before["impl"] and "ms" in row:
                        row["vs_previous"] = before.get("ms", float("nan")) / row["ms"]
                control = by_impl.get(f"{name} control", {})
                if "ms" in control and "ms" in by_impl[f"{name} now"]:
                    by_impl[f"{name} now"]["vs_control"] = (
                        control["ms"] / by_impl[f"{name} now"]["ms"]
                    )
            rows += done
            print(f"{case.name} {'fwd+bwd' if backward else 'fwd'} ({time.time() - t0:.0f} s)")
    window = "" if args.window is None else f", window {args.window}"
    print(f"\n{args.dtype}{window}\n| case | pass | impl | ms | vs {baseline} | vs {tags[0]} |")
    print(f"|{'---|' * 6}")
    for r in rows:
        if "ms" in r:
            print(
                f"| {r['case']} | {r['pass_']} | {r['impl']} | {r['ms']:.3f} |"
                f" {r.get('vs_' + baseline, 1.0):.2f} | {r.get('vs_previous', float('nan')):.3f} |"
            )
        else:
            print(f"| {r['case']} | {r['pass_']} | {r['impl']} | not timed: {r} |")
    if args.control:  # identical kernels: what the ratios above resolve in this run
        floor = [
            f"{r['case']} {r['pass_']} {r['impl']} {r['vs_control']:.3f}"
            for r in rows
            if "vs_control" in r
        ]
        print("\nthis tree's kernels against their control copy:\n" + "\n".join(floor))
    if args.out:
        save_rows(args.out, "revision_ab", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
