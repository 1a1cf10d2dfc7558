"""How far each attention candidate's outputs sit from the tuner's reference, against its tolerance.

The tuner checks every candidate's outputs and gradients against the XLA platform before timing it
(``Tuner(check_outputs=True)``) and fails those off by more than its tolerance (0.1 of the largest
value for bf16 outputs, 0.02 for float32). A tolerance that fails a right kernel would cost users
their fastest config, so this measures the margin: it tunes ``platform="auto"`` with a tolerance
of 1e-12, which fails every candidate with its error in the reason, over up to ``--per-backend``
candidates of each backend, forward and backward, and prints the largest error of each backend
beside the default tolerance. Nothing is timed.

    python3 benchmarks/tune_check_gpu.py [--only TEXT] [--per-backend 6] [--overhead] [--out DIR]

``--overhead`` also times three tunes of the same candidates, unchecked, checked and unchecked
again: what the check adds. ``--cpu-smoke`` runs tiny shapes (XLA's variants only on a CPU).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ejkfn
from ejkfn import _tune
from ejkfn.attention import FlashAttention

# batch x seq x heads(/kv heads) x head dim, dtype, call options
CASES = {
    "2x4096x16x128 causal": ("2x4096x16x128", "bfloat16", dict(causal=True)),
    "8x2048x32x64": ("8x2048x32x64", "bfloat16", {}),
    "2x4096x32/8x128 causal": ("2x4096x32/8x128", "bfloat16", dict(causal=True)),
    "2x2048x16x128 bias mask dropout": (
        "2x2048x16x128",
        "bfloat16",
        dict(bias=True, mask=True, dropout_prob=0.1),
    ),
    "1x2048x16x128 f32 causal": ("1x2048x16x128", "float32", dict(causal=True)),
}
SMOKE = {"1x64x2x16 causal": ("1x64x2x16", "float32", dict(causal=True))}
ERROR = re.compile(r"by ([0-9.e+-]+|nan|inf) at output (\d+)")


def operands(shape: str, dtype: str, options: dict) -> tuple[tuple, dict]:
    b, s, heads, d = shape.split("x")
    h, kvh = (int(x) for x in heads.split("/")) if "/" in heads else (int(heads),) * 2
    b, s, d = int(b), int(s), int(d)
    keys = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(keys[0], (b, s, h, d), dtype)
    k = jax.random.normal(keys[1], (b, s, kvh, d), dtype)
    v = jax.random.normal(keys[2], (b, s, kvh, d), dtype)
    bias = jax.random.normal(keys[3], (1, h, s, s), dtype) if options.get("bias") else None
    call = {n: x for n, x in options.items() if n not in ("bias", "mask")}
    if options.get("mask"):
        call["attention_mask"] = jax.random.bernoulli(keys[4], 0.9, (b, 1, s, s))
    if options.get("dropout_prob"):
        call["dropout_seed"] = jnp.uint32(7)
    return (q, k, v, bias), call


def sampled(shape: str, dtype: str, options: dict, per_backend: int) -> tuple[Any, list[Any]]:
    """The ``auto`` call's invocation and the first ``per_backend`` candidates of each backend."""
    kernel = FlashAttention()
    args, call = operands(shape, dtype, options)
    inv = ejkfn.Invocation.of(kernel, *args, **call)
    by_backend = collections.defaultdict(list)
    for cfg in kernel.candidate_cfgs(inv):
        by_backend[(cfg.platform, cfg.variant)].append(cfg)
    return inv, [c for cfgs in by_backend.values() for c in cfgs[:per_backend]]


def margins(name: str, shape: str, dtype: str, options: dict, per_backend: int) -> dict:
    inv, chosen = sampled(shape, dtype, options, per_backend)
    tuner = ejkfn.Tuner(warmup=0, iters=1, progress=False, check_tolerance=1e-12)
    t0 = time.perf_counter()
    report = tuner.tune(inv, chosen, validate_backward=True)
    tolerance = _tune._default_tolerance(inv.args[0])
    worst: dict[str, float] = {}
    other: list[str] = []
    for r in report.results:
        found = ERROR.search(r.error or "") if r.phase == "check" else None
        backend = f"{r.cfg.platform}/{r.cfg.variant}"
        if found or r.ok:  # ok: within 1e-12 of the reference (its own config)
            worst[backend] = max(worst.get(backend, 0.0), float(found[1]) if found else 0.0)
        else:
            other.append(f"{backend}: {r.phase} {r.error}"[:300])
    print(f"{name}: {len(chosen)} candidates checked against {report.reference!r} "
          f"in {time.perf_counter() - t0:.0f} s; tolerance {tolerance:g}", flush=True)  # fmt: skip
    for backend, error in sorted(worst.items()):
        mark = "ok" if error <= tolerance else "OVER"
        margin = f"{tolerance / error:.0f}x margin" if error else "the reference's own"
        print(f"  {backend:<18} largest error {error:.2e}  ({margin}) {mark}")
    for line in other:
        print(f"  not checked: {line}")
    return dict(
        name=name, tolerance=tolerance, worst=worst, not_checked=other,
        reference=repr(report.reference), notes=list(report.notes),
    )  # fmt: skip


def overhead(shape: str, dtype: str, options: dict, per_backend: int) -> dict:
    """Seconds of one tune (forward and backward timed) of the first candidates of each backend,
    without the output check, with it, and without it again: what the check adds to a tune."""
    inv, chosen = sampled(shape, dtype, options, per_backend)
    seconds = {}
    for run, checked in (("unchecked", False), ("checked", True), ("unchecked again", False)):
        tuner = ejkfn.Tuner(warmup=1, iters=5, progress=False, check_outputs=checked)
        report = tuner.tune(inv, chosen, validate_backward=True)
        seconds[run] = report.seconds
        print(f"  {len(chosen)} candidates, {run}: {report.seconds:.1f} s "
              f"(best {report.best.platform}/{report.best.variant})", flush=True)  # fmt: skip
    return dict(shape=shape, candidates=len(chosen), seconds=seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="cases whose name has this")
    parser.add_argument("--per-backend", type=int, default=6)
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument(
        "--overhead", action="store_true", help="also time tunes with and without the check"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args()
    cases = SMOKE if a.cpu_smoke else CASES
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    rows = [margins(name, *case, a.per_backend) for name, case in cases.items() if a.only in name]
    costs = []
    if a.overhead:
        for name, case in cases.items():
            if a.only in name:
                print(f"{name}: tune seconds", flush=True)
                costs.append(overhead(*case, a.per_backend))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tune_check.json"), "w") as f:
        result = dict(device=jax.devices()[0].device_kind, cases=rows, overhead=costs)
        json.dump(result, f, indent=1)
    over = [r["name"] for r in rows if any(e > r["tolerance"] for e in r["worst"].values())]
    print(f"over the tolerance: {over or 'none'}", flush=True)


if __name__ == "__main__":
    main()
