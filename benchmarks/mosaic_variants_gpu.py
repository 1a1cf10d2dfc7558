"""Side-by-side timing of the Mosaic GPU attention kernels' variants on a Hopper GPU, cuDNN beside them.

Forward: the Mosaic forward. Forward+backward: that forward with each Mosaic backward, ``split``
(FlashAttention 3's dK/dV and dQ kernels, 7 matrix products per block pair) and ``fused`` (one
kernel adding dQ by TMA reduce-add, 5 products). Each implementation is checked against cuDNN's
output and gradients on the same inputs first (max relative error), then all are timed in
interleaved rounds (so drifts of the machine's speed fall on all alike): each round times a batch
of calls dispatched back to back, after 0.2 s of untimed calls of the same kernel (the clock
settles on its load), inputs alternating between two random sets, in a new order each round; the
median over rounds is reported, with its spread (slowest over fastest round); ratios are to cuDNN
in this run. Where the shapes reach 16k keys and more, a further table sets each implementation's
ratio at every longer length beside its ratio at 16k (the long-context goal).

    python3 benchmarks/mosaic_variants_gpu.py --out "$OUT"           # the table
    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --metrics ... --csv \
        python3 benchmarks/mosaic_variants_gpu.py --profile --unbalanced   # each kernel twice
    python3 benchmarks/mosaic_variants_gpu.py --backward only --other-bwd OLD.py,EDITED.py

``--other-bwd`` times other revisions of ``_pallas_mosaic_bwd.py`` (``git show
REV:ejkfn/attention/_pallas_mosaic_bwd.py > OLD.py``, or an edited copy) beside this tree's, each
behind this tree's forward: an A/B of backward edits in one run, where separate runs differ by more
than the edits do. ``--other-fwd`` does the same for ``_pallas_mosaic.py``'s forward (behind this
tree's heuristic backward where the run times forward+backward).

``--cpu-smoke`` runs tiny shapes (one unless ``--shapes``) in Mosaic GPU's interpreter (no cuDNN,
no timing), to check the script without a GPU. ``--trace-only`` traces each implementation instead
of running it, and saves a hash of its jaxpr (kernel bodies included): variants whose options took
effect trace to different programs (seconds, where the interpreter takes minutes).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

if "--cpu-smoke" in sys.argv:  # the interpreter needs host threads (see check_mosaic_bwd_gpu.py)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention import (
    MASKS,
    Case,
    check_then_time,
    fwd_bwd,
    inputs,
    load_module,
    parse_cases,
    power_and_clock,
    save_rows,
)
from check_mosaic_bwd_gpu import ours, rel_err

import ejkfn
from ejkfn import BwdParams, FwdParams
from ejkfn.attention import _pallas_gpu, _pallas_mosaic, _pallas_mosaic_bwd
from ejkfn.attention._backend import AttentionShape
from ejkfn.attention._spec import AttentionSpec

SHAPES = "2x8192x16x128,4x4096x16x128,2x16384x16x128,8x2048x32x64,2x8192x32x128x8"


def forward_blocks(text: str) -> list[FwdParams]:
    """``"192x2,128x2x256"`` -> forward params of those key blocks x ring slots [x query rows: 128,
    one CTA a tile (the default), or 256 or 512, a cluster of two or four sharing each key/value
    copy]."""
    out = []
    for item in filter(None, text.split(",")):
        try:
            bk, slots, *rows = (int(n) for n in item.split("x"))
            if len(rows) > 1:
                raise ValueError
        except ValueError:
            raise SystemExit(
                f"--fwd-blocks item {item!r} is not KEYSxSLOTS[xROWS], e.g. 192x2 or 128x2x256"
            ) from None
        q_rows = rows[0] if rows else 128
        out.append(FwdParams(q_blocksize=q_rows, kv_blocksize=bk, num_warps=12, num_stages=slots))
    return out


def other_revisions(paths: str, flag: str) -> dict[str, ModuleType]:
    """Other revisions of one of our modules (``git show REV:ejkfn/attention/...``, or edited
    copies), comma-separated, loaded beside this tree's to be timed against it in one run; each
    named by its file's stem. ``flag`` names the option they came from, for errors."""
    modules = {}
    for path in filter(None, paths.split(",")):
        name = Path(path).stem
        try:
            modules[name] = load_module(path, f"_other_{name}")
        except FileNotFoundError as e:
            raise SystemExit(f"{flag}: {e}") from None
    return modules


def implementations(
    case: Case,
    backward: bool,
    fwds: Sequence[FwdParams] = (),
    other_grid: bool = False,
    other_order: bool = False,
    unbalanced: bool = False,
    others: dict[str, ModuleType] | None = None,
    whole_tail: bool = False,
    four_memory_warps: bool = False,
    other_fwds: dict[str, ModuleType] | None = None,
    auto: bool = False,
    cudnn_bwd: bool = False,
    dkdv_bands: Sequence[int] = (),
    persistent_dkdv: bool = False,
    portable_bwd: bool = False,
) -> dict[str, Any]:
    """name -> jitted (q, k, v) -> out, or with ``backward`` (q, k, v, do) -> (out, dq, dk, dv):
    cuDNN, and the Mosaic forward alone (the heuristic's blocks, then each of ``fwds``) or with
    each Mosaic backward that takes the shape; with ``auto``, also ``ejkfn.flash_attention`` as a
    user calls it (``platform="auto"``: the shipped config for this GPU and shape); with
    ``cudnn_bwd``, also the Mosaic forward with cuDNN's backward kernel on its residuals; with
    ``portable_bwd``, also with the Triton-lowering backward (its heuristic blocks), which the
    heuristic takes only where no Mosaic backward takes the head dim."""

    def cudnn(q, k, v):
        impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
        return jax.nn.dot_product_attention(q, k, v, is_causal=case.causal, implementation=impl)

    def selected(q, k, v):
        return ejkfn.flash_attention(q, k, v, causal=case.causal)

    spec = AttentionSpec(scale=case.dim**-0.5, causal=case.causal)
    q = jax.ShapeDtypeStruct((case.batch, case.seq, case.heads, case.dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((case.batch, case.seq, case.kv_heads, case.dim), jnp.bfloat16)
    shape = AttentionShape.of(q, k, spec)
    heuristic = _pallas_mosaic.heuristic(shape)[1]
    split = _pallas_mosaic._mosaic_bwd(shape)  # None where the head dim is too large
    # The tile orders the kernels do not take by default for this shape (_mosaic_grid.split_index).
    other_fwd = not _pallas_mosaic.FWD_ALONG_SEQUENCE
    default_bwd = _pallas_mosaic_bwd._along_sequence(case.causal, case.seq, case.seq)
    # Heads fastest by default goes in bands (_dkdv_band): other than over all pairs where a band
    # holds fewer than all of them.
    pairs = case.batch * case.kv_heads
    banded = not default_bwd[0] and _pallas_mosaic_bwd._dkdv_band(pairs) < pairs

    def order(along_sequence: bool | tuple[bool, bool]) -> str:
        if isinstance(along_sequence, tuple):  # the backward's (dK/dV, dQ)
            dkdv, dq = (order(o).removeprefix("tiles ") for o in along_sequence)
            return f"dK/dV tiles {dkdv}, dQ tiles {dq}"
        return "tiles along the sequence" if along_sequence else "tiles heads fastest"

    if not backward:
        impls = {"cudnn": jax.jit(cudnn), "mosaic": jax.jit(ours(case.causal, heuristic, q, k))}
        if auto:
            impls["auto"] = jax.jit(selected)

        def blocks_name(fp: FwdParams) -> str:
            ctas = fp.q_blocksize // _pallas_mosaic.CTA_ROWS
            cluster = f" cluster of {ctas}" if ctas > 1 else ""
            return f"mosaic {fp.kv_blocksize}x{fp.num_stages}{cluster}"

        for fp in fwds:
            impls[blocks_name(fp)] = jax.jit(ours(case.causal, heuristic, q, k, fp))

        def forward(
            module: ModuleType = _pallas_mosaic, params: FwdParams | None = None, **options: Any
        ) -> Any:
            """The Mosaic forward (of ``module``, a revision of ``_pallas_mosaic``; ``params``,
            else the heuristic's) with the kernel's private ``options``."""

            def run(q, k, v):
                out, _ = module._forward(
                    q, k, v, spec=spec, params=params, interpret=None, **options
                )
                return out

            return jax.jit(run)

        for other, module in (other_fwds or {}).items():
            impls[f"mosaic, {other}"] = forward(module)

        if other_grid:  # persistent or one CTA a tile, whichever the shape does not take
            persistent = not _pallas_mosaic.forward_persistent(case.causal, case.seq)
            grid = "persistent" if persistent else "one tile per CTA"
            impls[f"mosaic {grid}"] = forward(persistent=persistent)
            for fp in fwds:
                impls[f"{blocks_name(fp)} {grid}"] = forward(params=fp, persistent=persistent)
        if other_order:
            impls[f"mosaic, {order(other_fwd)}"] = forward(along_sequence=other_fwd)
        if unbalanced:  # the persistent grid on every resident CTA, as before Rounds.balanced
            impls["mosaic, all resident CTAs"] = forward(balanced=False)
        if whole_tail:  # the last round's tiles whole, as before SplitTail
            impls["mosaic, last round whole"] = forward(split_tail=False)
        if four_memory_warps:  # every warp of the memory warpgroup runs its loop, as before
            impls["mosaic, four memory warps"] = forward(one_memory_warp=False)
        return impls
    on_gpu = jax.default_backend() == "gpu"

    def direct(
        bp: BwdParams,
        fwd_persistent: bool | None = None,
        bwd_persistent: tuple[bool, bool] | None = None,
        along_sequence: bool | tuple[bool, bool] | None = None,
        balanced: bool = True,
        module: ModuleType = _pallas_mosaic_bwd,
        split_tail: bool = True,
        fwd_module: ModuleType = _pallas_mosaic,
        **options: Any,
    ):
        """The Mosaic forward (of ``fwd_module``) and backward (of ``module``) called directly,
        with the kernels' private options (``along_sequence``: the backward's tile orders; the
        forward keeps its own)."""

        def both(q, k, v, do):
            out, lse = fwd_module._forward(
                q,
                k,
                v,
                spec=spec,
                params=None,
                interpret=None,
                persistent=fwd_persistent,
                balanced=balanced,
                split_tail=split_tail,
            )
            grads = module.bwd(
                q, k, v, out, lse, do, spec=spec, params=bp, interpret=not on_gpu,
                persistent=bwd_persistent,
                along_sequence=along_sequence,
                balanced=balanced, **options,
            )  # fmt: skip
            return out, *grads

        return jax.jit(both)

    impls = {"cudnn": jax.jit(fwd_bwd(cudnn))}
    if auto:
        impls["auto"] = jax.jit(fwd_bwd(selected))
    if backward and cudnn_bwd and on_gpu:  # the Mosaic forward, cuDNN's backward on its residuals
        cudnn_params = BwdParams(variant=_pallas_mosaic.CUDNN_BWD)
        impls["mosaic + cudnn"] = jax.jit(fwd_bwd(ours(case.causal, cudnn_params, q, k)))
    fused = split and _pallas_mosaic._fused_bwd(shape, split)
    if portable_bwd or heuristic not in (split, fused):  # the Triton-lowering backward
        portable = _pallas_gpu.heuristic(shape)[1]
        impls[f"mosaic + {portable.variant}"] = jax.jit(fwd_bwd(ours(case.causal, portable, q, k)))
    for name, bp in {"split": split, "fused": fused}.items():
        if bp and _pallas_mosaic_bwd.supports(case.dim, bp):
            impls[f"mosaic + {name}"] = jax.jit(fwd_bwd(ours(case.causal, bp, q, k)))
            if other_order:  # every other pair of orders (the fused one has no dQ kernel)
                dq_orders = (default_bwd[1],) if name == "fused" else (True, False)
                for pair in ((a, b) for a in (True, False) for b in dq_orders):
                    if pair != default_bwd or banded:
                        impls[f"mosaic + {name}, {order(pair)}"] = direct(bp, along_sequence=pair)
    if (
        other_order
        and not default_bwd[0]
        and split
        and _pallas_mosaic_bwd.supports(case.dim, split)
    ):
        # Causal tiles along the sequence with the dK/dV kernel on the persistent grid, whose rounds
        # alternate direction (as the forward's do) to even out the tiles' unequal work.
        name = "mosaic + split, tiles along the sequence, dK/dV persistent"
        impls[name] = direct(split, bwd_persistent=(True, case.dim <= 64), along_sequence=True)
    for name, bp in {"split": split, "fused": fused}.items():
        if not (bp and _pallas_mosaic_bwd.supports(case.dim, bp)):
            continue
        for other, module in (others or {}).items():
            impls[f"mosaic + {name}, {other}"] = direct(bp, module=module)
    for (name, bp), band in itertools.product({"split": split, "fused": fused}.items(), dkdv_bands):
        # the dK/dV tiles in bands of (batch, kv head) pairs, one CTA a tile (the dQ kernel on
        # its own default grid)
        if bp and _pallas_mosaic_bwd.supports(case.dim, bp) and pairs % band == 0:
            label = "all" if band == pairs else band
            _, dq_persistent = _pallas_mosaic_bwd.backward_persistent(
                case.causal, case.dim, name == "fused", case.heads // case.kv_heads
            )
            impls[f"mosaic + {name}, dK/dV tiles in bands of {label} kv heads"] = direct(
                bp, bwd_persistent=(False, dq_persistent), dkdv_band=band
            )
            if persistent_dkdv:  # the band's tiles dealt to resident CTAs, rounds alternating
                impls[f"mosaic + {name}, dK/dV persistent in bands of {label} kv heads"] = direct(
                    bp, bwd_persistent=(True, dq_persistent), dkdv_band=band
                )
    if _pallas_mosaic_bwd.supports(case.dim, heuristic):  # other forwards, the heuristic's backward
        for other, module in (other_fwds or {}).items():
            impls[f"mosaic, {other} + heuristic backward"] = direct(heuristic, fwd_module=module)
    if whole_tail and _pallas_mosaic_bwd.supports(case.dim, heuristic):
        impls["mosaic, last round whole + heuristic backward"] = direct(heuristic, split_tail=False)
    if unbalanced and _pallas_mosaic_bwd.supports(case.dim, heuristic):
        impls["mosaic, all resident CTAs + heuristic backward"] = direct(heuristic, balanced=False)
    if other_grid and split and _pallas_mosaic_bwd.supports(case.dim, split):
        # (dK/dV, dQ) grids of the split backward behind the persistent forward; the old grids.
        for dkdv, dq in ((True, True), (False, True), (False, False)):
            name = f"persistent fwd, dK/dV {'pers.' if dkdv else 'tiles'}, dQ {'pers.' if dq else 'tiles'}"
            impls[name] = direct(split, True, (dkdv, dq))
        impls["one tile per CTA everywhere"] = direct(split, False, (False, False))
    if other_grid and fused and _pallas_mosaic_bwd.supports(case.dim, fused):
        # the fused backward's one kernel on the grid it does not take
        dkdv, dq = _pallas_mosaic_bwd.backward_persistent(
            case.causal, case.dim, True, case.heads // case.kv_heads
        )
        grid = "one tile per CTA" if dkdv else "persistent"
        impls[f"mosaic + fused, {grid}"] = direct(fused, bwd_persistent=(not dkdv, dq))
    return impls


def selected_implementations(
    case: Case, backward: bool, args: argparse.Namespace
) -> dict[str, Any]:
    """:func:`implementations` with the variants the command line asks for."""
    return implementations(
        case,
        backward,
        forward_blocks(args.fwd_blocks),
        args.other_grid,
        args.tile_order,
        args.unbalanced,
        other_revisions(args.other_bwd, "--other-bwd"),
        args.whole_tail,
        args.four_memory_warps,
        other_revisions(args.other_fwd, "--other-fwd"),
        args.auto,
        args.cudnn_bwd,
        [int(n) for n in args.dkdv_bands.split(",") if n],
        args.persistent_dkdv,
        args.portable_bwd,
    )


# the passes each --backward choice times: forward (False), forward+backward (True)
BACKWARD_PASSES = {"yes": (False, True), "no": (False,), "only": (True,)}


def traced_programs(
    case: Case, backward: bool, impls: dict[str, Any], args: tuple[Any, ...]
) -> list[dict[str, Any]]:
    """One row per implementation: a hash of its traced program, or the error tracing it raised."""
    pass_ = "fwd+bwd" if backward else "fwd"
    rows = []
    for name, fn in impls.items():
        row = dict(case=case.name, pass_=pass_, impl=name)
        try:
            # The jaxpr, not the lowered module: in the interpreter a kernel's body runs from a
            # host callback, outside the lowered module; the jaxpr holds it.
            text = str(jax.make_jaxpr(fn)(*args))
            row["program"] = hashlib.sha256(text.encode()).hexdigest()[:16]
        except Exception as exc:  # report and go on, as a run does
            row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        rows.append(row)
    return rows


def run_case(case: Case, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Check every implementation against cuDNN, then time them in interleaved rounds (so that
    drifts of the machine's speed fall on all alike); medians over the rounds. With
    ``--trace-only``, trace each instead (:func:`traced_programs`)."""
    sets = [inputs(case, seed) for seed in (0, 1)]
    for backward in BACKWARD_PASSES[args.backward]:
        impls = selected_implementations(case, backward, args)
        if args.trace_only:
            rows.extend(traced_programs(case, backward, impls, sets[0][: 4 if backward else 3]))
            continue
        for row in check_then_time(
            case,
            backward,
            impls,
            "cudnn",
            sets,
            max(1, args.iters // args.rounds),
            args.rounds,
            warmup=args.warmup,
            error=rel_err,
            timing=not args.cpu_smoke,
        ):
            if args.power and "ms" in row:  # energy per FLOP beside time: the card is power-capped
                arity = 4 if backward else 3
                drawn = power_and_clock(impls[row["impl"]], [s[:arity] for s in sets])
                if drawn:
                    row.update(watts=drawn["watts"], sm_mhz=drawn["sm_mhz"])
                    row["joules_per_pflop"] = drawn["watts"] / (row["tflops"] / 1e3)
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
                  flush=True)  # fmt: skip


def profile(cases: list[Case], args: argparse.Namespace) -> None:
    """Each kernel (cuDNN's and the Mosaic variants the command line asks for) twice after
    compiling, for a profiler wrapped around this process (with ``XLA_PYTHON_CLIENT_PREALLOCATE=
    false``: ncu's replays otherwise save and restore JAX's whole memory pool each kernel). Each
    implementation's name goes to stdout before its calls, to match the profiler's kernels."""
    for case in cases:
        data = inputs(case, 0)
        for backward in BACKWARD_PASSES[args.backward]:
            for name, fn in selected_implementations(case, backward, args).items():
                print(f"profile: {case.name} {'fwd+bwd' if backward else 'fwd'} {name}", flush=True)
                for _ in range(2):
                    jax.block_until_ready(fn(*data[: 4 if backward else 3]))


LONG_CONTEXT_BASE = 16384  # the goal: longer sequences at no lower a ratio to cuDNN than this


def long_context(rows: list[dict[str, Any]]) -> str:
    """Each implementation's ratio to cuDNN at every sequence length from ``LONG_CONTEXT_BASE`` on,
    against its ratio at that length, per head layout, mask and pass (the long-context goal); empty
    where the run has no such lengths."""
    series: dict[tuple[str, str, str], dict[int, float]] = {}
    for r in rows:
        if "vs_cudnn" not in r:
            continue
        case = Case.of_name(r["case"])
        if case.seq >= LONG_CONTEXT_BASE:
            series.setdefault((case.layout, r["pass_"], r["impl"]), {})[case.seq] = r["vs_cudnn"]
    lines = []
    for (layout, pass_, impl), by_seq in series.items():
        base = by_seq.get(LONG_CONTEXT_BASE)
        if base is None or len(by_seq) < 2:
            continue
        cells = []
        for seq, ratio in sorted(by_seq.items())[1:]:
            verdict = "holds" if ratio >= base else "below"
            cells.append(f"{seq // 1024}k {ratio:.3f} ({verdict})")
        lines.append(f"| {layout} | {pass_} | {impl} | {base:.3f} | {', '.join(cells)} |")
    if not lines:
        return ""
    header = f"| heads x dim | pass | impl | at {LONG_CONTEXT_BASE // 1024}k | longer |"
    return "\n".join([header, "|---|---|---|---|---|", *lines])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        default=None,
        help="BxSxHxD[xKVH],... as attention.py (--cpu-smoke: 1x256x2x128)",
    )
    parser.add_argument("--iters", type=int, default=48, help="timed calls per implementation")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds they split into")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument(
        "--fwd-blocks", default="", help="further forwards to time: KEYSxSLOTS,... e.g. 192x2"
    )
    parser.add_argument(
        "--backward", choices=tuple(BACKWARD_PASSES), default="yes", help="only: forward+backward"
    )
    parser.add_argument(
        "--other-grid",
        action="store_true",
        help="also the forwards (the heuristic's, each of --fwd-blocks) on the grid the shape does "
        "not take (_pallas_mosaic.forward_persistent), the split backward's other grids and the "
        "fused one's other grid",
    )
    parser.add_argument(
        "--tile-order",
        action="store_true",
        help="also the kernels with the tile orders they do not take by default for the shape "
        "(the backward's: every other (dK/dV, dQ) pair)",
    )
    parser.add_argument(
        "--unbalanced",
        action="store_true",
        help="also the persistent grids (forward, dQ) on every resident CTA (no Rounds.balanced)",
    )
    parser.add_argument(
        "--whole-tail",
        action="store_true",
        help="also the forward with its last round's tiles whole (no SplitTail)",
    )
    parser.add_argument(
        "--four-memory-warps",
        action="store_true",
        help="also the forward with every warp of its memory warpgroup running the copy loop",
    )
    parser.add_argument(
        "--other-bwd",
        default="",
        help="other revisions' _pallas_mosaic_bwd.py, comma-separated, to time beside this one's",
    )
    parser.add_argument(
        "--other-fwd",
        default="",
        help="other revisions' _pallas_mosaic.py, comma-separated, whose forwards to time beside "
        "this one's",
    )
    parser.add_argument(
        "--auto", action="store_true", help="also ejkfn.flash_attention as shipped (platform auto)"
    )
    parser.add_argument(
        "--portable-bwd",
        action="store_true",
        help="also the Mosaic forward with the Triton-lowering backward (its heuristic blocks)",
    )
    parser.add_argument(
        "--cudnn-bwd",
        action="store_true",
        help="also the Mosaic forward with cuDNN's backward kernel on its residuals (GPU only)",
    )
    parser.add_argument(
        "--dkdv-bands",
        default="",
        help="also the split and fused backwards with their dK/dV tiles in bands of this many "
        "(batch, kv head) pairs (comma-separated; all of them: heads fastest), heads fastest "
        "within a band",
    )
    parser.add_argument(
        "--persistent-dkdv",
        action="store_true",
        help="with --dkdv-bands, also those backwards with the dK/dV kernel on the persistent grid",
    )
    parser.add_argument("--masks", choices=tuple(MASKS), default="both")
    parser.add_argument("--profile", action="store_true", help="run each kernel twice, no table")
    parser.add_argument(
        "--power", action="store_true", help="also board power and SM clock of each"
    )
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument(
        "--trace-only",
        action="store_true",
        help="trace each implementation and save its program's hash instead of running it",
    )
    args = parser.parse_args()
    if args.trace_only and not (args.cpu_smoke and not args.profile):
        raise SystemExit("--trace-only needs --cpu-smoke and no --profile (it runs nothing)")
    shapes = args.shapes or ("1x256x2x128" if args.cpu_smoke else SHAPES)
    cases = parse_cases(shapes, args.masks)
    if args.profile:
        profile(cases, args)
        return 0
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for case in cases:
        run_case(case, args, rows)
    if args.trace_only:
        for r in rows:
            print(
                f"| {r['case']} | {r['pass_']} | {r['impl']} | {r.get('program', r.get('error'))} |"
            )
        if args.out:
            save_rows(args.out, "mosaic_variants", rows)
        return 1 if any("error" in r for r in rows) else 0
    print(f"\n| case | pass | impl | TFLOP/s | vs cuDNN | max rel err |\n|{'---|' * 6}")
    for r in rows:
        tf = f"{r['tflops']:.0f}" if "tflops" in r else r.get("error", "-")[:60]
        ratio = f"{r['vs_cudnn']:.2f}" if "vs_cudnn" in r else "-"
        err = r.get("max_rel_err_vs_cudnn", float("nan"))
        print(f"| {r['case']} | {r['pass_']} | {r['impl']} | {tf} | {ratio} | {err:.1e} |")
    if table := long_context(rows):
        print(f"\nLong context, ratio to cuDNN against {LONG_CONTEXT_BASE // 1024}k:\n{table}")
    print(f"({time.time() - t0:.0f} s)")
    if args.out:
        save_rows(args.out, "mosaic_variants", rows)
    failed = [r for r in rows if "error" in r or not r.get("max_rel_err_vs_cudnn", 1) < 5e-2]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
