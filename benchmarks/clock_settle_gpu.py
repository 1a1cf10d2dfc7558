"""How long a kernel's reading depends on the kernel that ran before it (the GPU's clock follows the
power drawn, with a lag), and so how long the untimed batch before each timed one must be.

For each target implementation, each predecessor (every implementation, and an idle GPU) and each
settle time: the predecessor runs ``--lead-ms`` of calls, then the target runs untimed for the settle
time, then a timed batch of ``--batch-ms``. Trials run in a shuffled order, ``--reps`` times each.
The table gives each target's median time after each predecessor relative to its steady time (the
median of its readings with the longest settle): where a row's spread stays above the noise at a
settle time, a benchmark settling that long reads each kernel by what ran before it.

Usage: ``python benchmarks/clock_settle_gpu.py [--shape 2x8192x32x128x8] [--causal]
[--impls "ejkfn pallas/mosaic,ejkfn pallas/triton,jax.nn cudnn"] [--settle-ms 0,20,100,400]``
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attention
import jax

from ejkfn._tune import _back_to_back, _calls_lasting, _seconds_per_call

IDLE = "(idle)"


def run_for(fn: Callable[[], Any], seconds: float, per_call: float) -> None:
    """Untimed calls of ``fn`` back to back for about ``seconds`` (none for 0), as the tuner settles."""
    if seconds > 0:
        _back_to_back(fn, _calls_lasting(seconds, per_call))  # untimed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2x8192x32x128x8", help="BxSxHxD[xKVH]")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true", help="time forward+backward")
    parser.add_argument(
        "--impls",
        default="ejkfn pallas/mosaic,ejkfn pallas/triton,jax.nn cudnn",
        help="comma-separated names as attention.py prints them",
    )
    parser.add_argument("--settle-ms", default="0,20,100,400")
    parser.add_argument("--lead-ms", type=float, default=300.0)
    parser.add_argument("--batch-ms", type=float, default=20.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    settles = [float(s) for s in args.settle_ms.split(",")]
    if not settles or min(settles) < 0:
        parser.error(f"--settle-ms must be non-negative numbers; got {args.settle_ms!r}")
    (b, s, h, kvh, d) = attention.parse_shapes(args.shape)[0]
    case = attention.Case(b, s, h, kvh, d, args.causal)
    known = {**attention.peer_impls(case), **attention.ejkfn_impls(case)}
    wanted = [n.strip() for n in args.impls.split(",")]
    missing = [n for n in wanted if n not in known]
    if missing:
        parser.error(f"unknown --impls {missing}; this device has {sorted(known)}")
    wrap = attention.fwd_bwd if args.backward else (lambda fn: fn)
    fns = {n: jax.jit(wrap(known[n])) for n in wanted}
    q, k, v, do = attention.inputs(case, 1)
    call_args = (q, k, v, do) if args.backward else (q, k, v)
    calls = {name: functools.partial(fn, *call_args) for name, fn in fns.items()}
    per_call = {}  # seconds
    for name, call in calls.items():
        jax.block_until_ready(call())
        per_call[name] = _seconds_per_call(call, 10, None)

    trials = [
        (target, pred, settle)
        for target in wanted
        for pred in [*wanted, IDLE]
        for settle in settles
    ] * args.reps
    random.Random(time.time_ns()).shuffle(trials)
    readings: dict[tuple[str, str, float], list[float]] = {}
    for target, pred, settle in trials:
        if pred == IDLE:
            time.sleep(args.lead_ms / 1e3)
        else:
            run_for(calls[pred], args.lead_ms / 1e3, per_call[pred])
        run_for(calls[target], settle / 1e3, per_call[target])
        batch = _calls_lasting(args.batch_ms / 1e3, per_call[target])
        seconds = _seconds_per_call(calls[target], batch, None)
        readings.setdefault((target, pred, settle), []).append(seconds * 1e3)

    passes = "forward+backward" if args.backward else "forward"
    print(
        f"\n{case.name}, {passes}: median time after each predecessor over the median of all the "
        f"target's readings with {max(settles):g} ms of settling (above 1: slower); spread: the "
        "slowest cell of a row over its fastest\n"
    )
    preds = [*wanted, IDLE]
    header = " ".join(f"{p[-14:]:>14}" for p in preds)
    print(f"{'target':24} {'settle ms':>9} {header} {'spread':>7}")
    for target in wanted:
        steady = [ms for p in preds for ms in readings[(target, p, max(settles))]]
        base = statistics.median(steady)
        for settle in settles:
            cells = [statistics.median(readings[(target, p, settle)]) / base for p in preds]
            row = " ".join(f"{c:14.3f}" for c in cells)
            print(f"{target[-24:]:24} {settle:9g} {row} {max(cells) / min(cells):7.3f}")
    info = attention.device_info()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = out / f"clock_settle_{info['device_kind'].replace(' ', '_')}_{stamp}.json"
    path.write_text(
        json.dumps(
            {
                "device": info,
                "case": case.name,
                "pass": passes,
                "lead_ms": args.lead_ms,
                "batch_ms": args.batch_ms,
                "readings_ms": [
                    {"target": t, "predecessor": p, "settle_ms": s, "ms": ms}
                    for (t, p, s), ms in readings.items()
                ],
            },
            indent=1,
        )
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
