"""Attention calls with a feature on the GPU: each ejkfn platform that takes it, beside ``auto``.

The features are a bias, a boolean mask, segment ids (packed sequences), dropout, a logits soft
cap and a sliding window (:data:`FEATURES`; ``windowN`` is a window ``N`` keys wide on either side
instead of a quarter of the sequence, ``bias_f32`` the bias in float32 instead of bf16). For each
shape, mask and feature this

1. checks the forward (and, when the backward is timed, the gradients of q, k and v) of every
   ejkfn backend that takes the feature (its heuristic config) and of ``platform="auto"`` against
   the float32 reference with the same feature, at batch 1 and at most ``CHECK_SEQ`` positions
   (relative error under 2e-2; NaN never passes); one that fails is not timed;
2. times them interleaved at the full shape (:func:`attention.check_then_time`), forward+backward
   (``--passes fwd,bwd`` adds the forward);
3. prints each one's time, its TFLOP/s counted as for the call without the feature (so a feature
   that skips blocks, a window or segments, reads higher), its ratio to the fastest, and the config
   ``auto`` picks; saves the rows under ``--out``.

    python3 benchmarks/features_gpu.py [--shapes 8x2048x32x64,4x4096x16x128] [--masks causal]
        [--features segments,dropout,...] [--passes bwd] [--dtype bfloat16] [--out DIR]
        [--only triton/triton,auto]

``--only`` keeps the rows of those implementations (``platform/variant`` also keeps its
``--blocks`` rows): each row left out saves its compiles, minutes a program in float32.

``--profile`` runs each program twice, neither checked nor timed, for ``ncu`` wrapped around the
script to time each kernel alone::

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none \\
        --metrics gpu__time_duration.sum --csv python3 benchmarks/features_gpu.py --profile ...

``--dtype`` sets q, k, v's dtype (and a ``bias``'s); backends that refuse it (cuDNN and Mosaic in
float32) print why and are not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from attention import (
    MASKS,
    Case,
    check_then_time,
    fwd_bwd,
    inputs,
    parse_params,
    parse_shapes,
    rel_err,
    save_rows,
)

import ejkfn
from ejkfn import BwdParams, FwdParams
from ejkfn.attention import AttentionConfig, AttentionShape, AttentionSpec, registered_backends
from ejkfn.attention._backend import CUDNN_BWD
from ejkfn.attention._reference import reference_attention

# "none" is the call without a feature, to see what each one costs.
FEATURES = ("none", "bias", "mask", "segments", "dropout", "soft_cap", "window")
DTYPES = ("bfloat16", "float16", "float32")  # of q, k, v (--dtype)
FLOAT32_BIAS = "bias_f32"  # the bias in float32: its tiles are twice as large in shared memory
SOFT_CAP = 50.0  # Gemma 2's attention cap
DROPOUT = 0.1
CHECK_SEQ = 1024  # the float32 reference holds the scores of the check
MAX_ERROR = 2e-2


def window_keys(feature: str, seq: int) -> int | None:
    """The keys on either side of ``feature``'s window: a quarter of ``seq`` for ``"window"``,
    ``N`` for ``"windowN"``; None for any other feature."""
    if feature == "window":
        return seq // 4
    if feature.startswith("window") and feature[len("window") :].isdigit():
        return int(feature[len("window") :])
    return None


def check_feature(feature: str) -> None:
    if feature not in (*FEATURES, FLOAT32_BIAS) and window_keys(feature, 0) is None:
        raise ValueError(
            f"feature {feature!r} is not one of {FEATURES}, {FLOAT32_BIAS} or windowN (N keys)"
        )


def feature_spec(spec: AttentionSpec, feature: str, seq: int) -> AttentionSpec:
    """``spec`` with ``feature`` on (:func:`window_keys` for a window)."""
    check_feature(feature)
    keys = window_keys(feature, seq)
    return dataclasses.replace(
        spec,
        has_bias=feature in ("bias", FLOAT32_BIAS),
        has_mask=feature == "mask",
        has_segments=feature == "segments",
        dropout_prob=DROPOUT if feature == "dropout" else 0.0,
        soft_cap=SOFT_CAP if feature == "soft_cap" else None,
        window=None if keys is None else (keys, keys),
    )


def feature_arrays(
    case: Case, feature: str, seed: int = 0, dtype: Any = jnp.bfloat16
) -> dict[str, Any]:
    """The arrays ``feature`` adds to a call, as ``flash_attention``'s keyword arguments:

    * bias: ``[1, H, S, S]`` in ``dtype``, the inputs' (float32 for ``bias_f32``), a different one
      for each head (as a relative-position bias);
    * mask: ``[B, 1, S, S]``, batch row ``b`` padded: its last ``b + 1`` eighths of keys masked;
    * segments: four packed documents a row, 1/8, 2/8, 2/8 and 3/8 of it long;
    * dropout: a seed (``DROPOUT`` is the probability).
    Everything else a feature needs is static (:func:`feature_spec`)."""
    b, s, h = case.batch, case.seq, case.heads
    if feature in ("bias", FLOAT32_BIAS):
        bias = jax.random.normal(jax.random.key(seed), (1, h, s, s), jnp.float32)
        return dict(bias=bias if feature == FLOAT32_BIAS else bias.astype(dtype))
    if feature == "mask":
        valid = s - (jnp.arange(b) % 7 + 1) * s // 8
        keys = jnp.arange(s)[None, None, None, :] < valid[:, None, None, None]
        return dict(attention_mask=jnp.broadcast_to(keys, (b, 1, s, s)))
    if feature == "segments":
        ids = jnp.searchsorted(jnp.array([s // 8, 3 * s // 8, 5 * s // 8]), jnp.arange(s), "right")
        ids = jnp.broadcast_to(ids.astype(jnp.int32), (b, s))
        return dict(q_segment_ids=ids, kv_segment_ids=ids)
    if feature == "dropout":
        return dict(dropout_seed=jnp.uint32(seed))
    return {}


def case_spec(case: Case, feature: str) -> AttentionSpec:
    """The spec of ``case``'s call with ``feature`` (the default scale)."""
    return feature_spec(AttentionSpec(scale=case.dim**-0.5, causal=case.causal), feature, case.seq)


def static_options(spec: AttentionSpec) -> dict[str, Any]:
    """``flash_attention``'s static keyword arguments for ``spec``."""
    return dict(
        softmax_scale=spec.scale,
        causal=spec.causal,
        sliding_window=spec.window,
        logits_soft_cap=spec.soft_cap,
        dropout_prob=spec.dropout_prob,
    )


def call_shape(case: Case, spec: AttentionSpec, dtype: Any = jnp.bfloat16) -> AttentionShape:
    q = jax.ShapeDtypeStruct((case.batch, case.seq, case.heads, case.dim), dtype)
    k = jax.ShapeDtypeStruct((case.batch, case.seq, case.kv_heads, case.dim), dtype)
    return AttentionShape.of(q, k, spec)


def impls(
    case: Case,
    feature: str,
    blocks: tuple[str, ...] = (),
    dtype: Any = jnp.bfloat16,
    only: frozenset[str] = frozenset(),
) -> dict[str, Callable[..., jax.Array]]:
    """name -> ``(q, k, v, **arrays) -> out``, ``arrays`` being ``feature``'s
    (:func:`feature_arrays`): each native backend that takes the feature on its heuristic config
    (XLA's left out), ``auto``, and for each ``"target:fwd|bwd:BQxBKxWxS[xvariant][xdqN]"`` in
    ``blocks`` the heuristic config of each backend ``target`` names (a platform, or one
    ``platform/variant``: Mosaic's 12 warps are no Pallas-Triton block) with that pass's blocks
    replaced. With ``only``, those whose name, or whose name's ``platform/variant``, is in it."""
    spec = case_spec(case, feature)
    shape, static = call_shape(case, spec, dtype), static_options(spec)
    kind = ejkfn.device_kind()
    out: dict[str, Callable[..., jax.Array]] = {}
    for backend in registered_backends():
        if backend.platform == "xla" or kind not in backend.devices or not backend.available():
            continue
        if spec.features & backend.unsupported:
            continue
        try:
            fp, bp = backend.heuristic(shape)
        except NotImplementedError:
            continue
        cfgs = {f"{backend.platform}/{backend.variant}": (fp, bp)}
        for item in blocks:
            target, which, text = item.split(":")
            if target in (backend.platform, f"{backend.platform}/{backend.variant}"):
                name = f"{backend.platform}/{backend.variant} {which} {text}"
                cfgs[name] = (
                    (parse_params(text, FwdParams), bp)
                    if which == "fwd"
                    else (fp, parse_params(text, BwdParams))
                )
        for name, (fwd, bwd) in cfgs.items():
            cfg = AttentionConfig(
                platform=backend.platform, variant=backend.variant, fwd=fwd, bwd=bwd
            )
            out[name] = lambda q, k, v, cfg=cfg, **arrays: ejkfn.flash_attention(
                q, k, v, **arrays, **static, cfg=cfg
            )
    out["auto"] = lambda q, k, v, **arrays: ejkfn.flash_attention(q, k, v, **arrays, **static)
    if only:
        out = {n: fn for n, fn in out.items() if n in only or n.split(" ")[0] in only}
    return out


def jitted(
    fn: Callable[..., jax.Array], arrays: dict[str, Any], backward: bool
) -> Callable[..., Any]:
    """``fn`` (of :func:`impls`) with ``arrays`` as a program's arguments: ``(q, k, v) -> out``, or
    with ``backward`` ``(q, k, v, do) -> (out, dq, dk, dv)``. Closed over, the arrays became
    constants of the program: a 2 GiB bias (2x8192x16x128) then took about 60 s a compile."""

    def run(q, k, v, *do, arrays):
        call = lambda q, k, v: fn(q, k, v, **arrays)
        return fwd_bwd(call)(q, k, v, *do) if backward else call(q, k, v)

    program = jax.jit(run)
    return lambda *sets: program(*sets, arrays=arrays)


def auto_pick(case: Case, feature: str, dtype: Any = jnp.bfloat16) -> str:
    """The backends ``auto``'s heuristic runs for this call: ``platform/variant`` for training
    (saying where its backward is cuDNN's kernel), and the one for inference after a ``+`` where
    it differs."""
    spec = case_spec(case, feature)
    q, k, v, _ = inputs(dataclasses.replace(case, batch=1), 0, dtype)
    cfg, _ = ejkfn.choose_config(
        ejkfn.FlashAttention(platform="auto"),
        q, k, v,
        caches=ejkfn.default_caches(),
        policy=ejkfn.AutotunePolicy(allow_autotune=False),
        **feature_arrays(dataclasses.replace(case, batch=1), feature, dtype=dtype),
        **static_options(spec),
    )  # fmt: skip
    name = f"{cfg.platform}/{cfg.variant}"
    if cfg.platform != "cudnn" and cfg.bwd.variant == CUDNN_BWD:
        name += " (cuDNN's backward kernel)"
    if cfg.inference is not None and cfg.inference != cfg:
        name += f" + {cfg.inference.platform}/{cfg.inference.variant}"
    return name


def check(
    case: Case,
    feature: str,
    blocks: tuple[str, ...] = (),
    dtype: Any = jnp.bfloat16,
    only: frozenset[str] = frozenset(),
    backward: bool = True,
) -> dict[str, float]:
    """name -> largest relative error of the output (with ``backward`` also q, k, v's
    gradients) against the float32 reference of each of :func:`impls`, at batch 1 and at most
    ``CHECK_SEQ`` positions."""
    small = dataclasses.replace(case, batch=1, seq=min(case.seq, CHECK_SEQ))
    spec = case_spec(small, feature)
    arrays = feature_arrays(small, feature, dtype=dtype)
    positional = [
        arrays.get(name)
        for name in ("bias", "attention_mask", "q_segment_ids", "kv_segment_ids", "dropout_seed")
    ]

    def want(q, k, v):
        return reference_attention(q, k, v, *positional, spec=spec)[0]

    sets = inputs(small, 7, dtype)[: 4 if backward else 3]  # (q, k, v, dout)
    exact = jax.jit(fwd_bwd(want) if backward else want)(*(x.astype(jnp.float32) for x in sets))
    expected = exact if backward else (exact,)
    errors = {}
    for name, fn in impls(small, feature, blocks, dtype, only).items():
        try:
            got = jitted(fn, arrays, backward)(*sets)
            got = got if backward else (got,)
            errors[name] = max(rel_err(g, w) for g, w in zip(got, expected, strict=True))
        except Exception as exc:  # report and go on: one backend failing must not end the run
            print(f"{case.name} {feature} {name}: {type(exc).__name__}: {str(exc)[:300]}")
            errors[name] = float("nan")
    return errors


def measure(
    case: Case,
    feature: str,
    passes: list[str],
    sets: list[tuple[jax.Array, ...]],
    calls: int,
    rounds: int,
    blocks: tuple[str, ...] = (),
    dtype: Any = jnp.bfloat16,
    only: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """The rows of one case and feature: every implementation checked (its backward only where
    that is timed), those that pass timed."""
    fns = impls(case, feature, blocks, dtype, only)
    arrays = feature_arrays(case, feature, dtype=dtype)
    errors = check(case, feature, blocks, dtype, only, backward="bwd" in passes)
    picked = auto_pick(case, feature, dtype)
    passing = [n for n, e in errors.items() if e < MAX_ERROR]
    rows: list[dict[str, Any]] = []
    for backward in [p == "bwd" for p in passes]:
        label = "fwd+bwd" if backward else "fwd"
        programs = {n: jitted(fns[n], arrays, backward) for n in passing}
        baseline = "auto" if "auto" in programs else next(iter(programs), None)
        done = (
            check_then_time(case, backward, programs, baseline, sets, calls, rounds)
            if baseline
            else []
        )
        done += [dict(case=case.name, pass_=label, impl=n) for n in errors if n not in passing]
        fastest = min((r["ms"] for r in done if "ms" in r), default=float("nan"))
        for r in done:
            r.update(feature=feature, auto_picks=picked, dtype=jnp.dtype(dtype).name)
            r["max_rel_err_vs_reference"] = errors[r["impl"]]
            if "ms" in r:
                r["vs_fastest"] = fastest / r["ms"]
        rows += done
        # as each pass ends: a run the device's time limit stops still shows its first pass
        print("\n".join(table_line(r) for r in done), flush=True)
    print(f"{case.name} {feature}: auto runs {picked}")
    return rows


def profile(
    case: Case,
    feature: str,
    passes: list[str],
    data: tuple[jax.Array, ...],
    blocks: tuple[str, ...] = (),
    dtype: Any = jnp.bfloat16,
    only: frozenset[str] = frozenset(),
) -> None:
    """Each implementation's program twice after its compiling call, unchecked and untimed, for a
    profiler wrapped around this process (``ncu``, with ``XLA_PYTHON_CLIENT_PREALLOCATE=false``:
    its replays otherwise save and restore JAX's whole memory pool each kernel). Each one's name
    goes to stdout before its two calls, to match the profiler's kernels in launch order."""
    fns = impls(case, feature, blocks, dtype, only)
    arrays = feature_arrays(case, feature, dtype=dtype)
    for backward in [p == "bwd" for p in passes]:
        args = data[: 4 if backward else 3]
        for name, fn in fns.items():
            program = jitted(fn, arrays, backward)
            jax.block_until_ready(program(*args))
            label = "fwd+bwd" if backward else "fwd"
            print(f"profile: {case.name} {feature} {label} {name}", flush=True)
            for _ in range(2):
                jax.block_until_ready(program(*args))


TABLE_HEADER = (
    f"| case | feature | pass | impl | ms | TFLOP/s | vs fastest | error |\n|{'---|' * 8}"
)


def table_line(r: dict[str, Any]) -> str:
    timing = (
        f"{r['ms']:.3f} | {r['tflops']:.0f} | {r['vs_fastest']:.3f}"
        if "ms" in r
        else "not timed | | "
    )
    return (
        f"| {r['case']} | {r['feature']} | {r['pass_']} | {r['impl']} | {timing} |"
        f" {r['max_rel_err_vs_reference']:.1e} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x2048x32x64,4x4096x16x128")
    parser.add_argument("--masks", choices=tuple(MASKS), default="causal")
    parser.add_argument("--features", default=",".join(FEATURES[1:]))
    parser.add_argument("--passes", default="bwd", help="fwd, bwd or both (comma-separated)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument(
        "--blocks",
        default="",
        help="more blocks to time, comma-separated PLATFORM[/VARIANT]:fwd|bwd:BQxBKxWxS[xVARIANT][xdqN]",
    )
    parser.add_argument(
        "--seconds", type=float, default=0.0, help="start no case past this many (0: no limit)"
    )
    parser.add_argument(
        "--only", default="", help="rows to keep, comma-separated (auto, PLATFORM/VARIANT, ...)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run each program twice for a profiler (ncu) instead of checking and timing",
    )
    args = parser.parse_args()
    features = args.features.split(",")
    for feature in features:
        try:
            check_feature(feature)
        except ValueError as exc:
            parser.error(f"--features: {exc}")
    passes = args.passes.split(",")
    if unknown := sorted(set(passes) - {"fwd", "bwd"}):
        parser.error(f"--passes: {unknown} not among ['fwd', 'bwd']")
    blocks = tuple(filter(None, args.blocks.split(",")))
    only = frozenset(filter(None, args.only.split(",")))
    known = {"auto", *(f"{b.platform}/{b.variant}" for b in registered_backends())}
    if unknown := sorted(n for n in only if n.split(" ")[0] not in known):
        parser.error(f"--only: {unknown} not among {sorted(known)}")
    for item in blocks:
        parts = item.split(":")
        try:  # impls parses them again; parsing here fails a typo before any compile
            if (
                len(parts) != 3
                or parts[1] not in ("fwd", "bwd")
                or not any(parts[0] in (n, n.split("/")[0]) for n in known - {"auto"})
            ):
                raise ValueError(parts)
            parse_params(parts[2], FwdParams if parts[1] == "fwd" else BwdParams)
        except (ValueError, TypeError):
            parser.error(
                f"--blocks: {item!r} is not PLATFORM[/VARIANT]:fwd|bwd:BQxBKxWxS[xVARIANT][xdqN]"
            )
    dtype = jnp.dtype(args.dtype)
    rows: list[dict[str, Any]] = []
    t0, stamp = time.time(), time.strftime("%Y%m%d-%H%M%S")
    for b, s, h, kvh, d in parse_shapes(args.shapes):
        for causal in MASKS[args.masks]:
            case = Case(b, s, h, kvh, d, causal)
            sets = [inputs(case, seed, dtype) for seed in (0, 1)]
            for feature in features:
                if args.profile:  # nothing timed: no table, no results file
                    profile(case, feature, passes, sets[0], blocks, dtype, only)
                    continue
                if args.seconds and time.time() - t0 > args.seconds:
                    print(f"{case.name} {feature} not run: past --seconds {args.seconds:.0f}")
                    continue
                done = measure(
                    case, feature, passes, sets, args.calls, args.rounds, blocks, dtype, only
                )
                print(f"{case.name} {feature} done ({time.time() - t0:.0f} s)", flush=True)
                rows += done
                if args.out:  # as it goes: the device's time limit may end the run
                    save_rows(args.out, "features", rows, stamp)
    if args.profile:
        return 0
    print(f"\n{TABLE_HEADER}")
    print("\n".join(table_line(r) for r in rows))
    if args.out:
        save_rows(args.out, "features", rows, stamp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
