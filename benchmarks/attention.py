"""Flash attention on the GPU: correctness first, then TFLOP/s of every platform and its peers.

For each ejkfn backend that can run on this device (each platform and variant, with its heuristic
config, plus ``platform="auto"``) and the peers (cuDNN and XLA through ``jax.nn.dot_product_attention``,
JAX's Pallas-Triton ``mha``, tokamax's Mosaic GPU and Triton attention and ejkernel's Triton attention
where they import), it

1. checks forward and gradients against an f32 XLA reference on fresh random inputs (bf16 relative
   error must stay under 2e-2; NaN never passes), and skips timing a failing variant;
2. times forward and forward+backward: after warm-up, ``--rounds`` rounds in which each implementation
   in turn (a new order each round, from ``--order-seed``) runs ``--settle-ms`` of untimed calls, so
   the clock follows its power, then a timed batch of ``--calls`` calls back to back (input sets
   rotating; more where they would last under ``--min-batch-ms``), waited on once; the median over
   rounds (drifts of the machine's speed fall on all alike);
3. prints one table with TFLOP/s and the ratio to cuDNN, the goals' ratios per shape and a tally of
   each goal (:data:`GOALS`), and writes the results with device, driver and versions to ``--out``
   (default ``benchmarks/results``). ``--tabulate`` prints the tables of saved runs.

FLOPs: ``4 * B * H * Sq * Sk * D`` forward (half when causal); forward+backward is 3.5 times that.

Usage: ``python benchmarks/attention.py [--quick] [--check-only] [--shapes 2x8192x16x128,...]
[--peers FOLDER]``: FOLDER holds the peer libraries (installed with ``pip install --target``); it goes
last on the import path, so the packages already installed win over its copies.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import logging
import os
import platform as host_platform
import random
import re
import statistics
import subprocess
import sys
import time
import traceback
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import ejkfn
from ejkfn._platform import _version as installed_version
from ejkfn.attention import (
    AttentionConfig,
    AttentionShape,
    AttentionSpec,
    _backend,
    registered_backends,
)

FULL_SHAPES = [  # (batch, seq, heads, kv_heads, dim)
    (4, 4096, 16, 16, 128),
    (2, 8192, 16, 16, 128),
    (8, 2048, 32, 32, 64),
    (2, 8192, 32, 8, 128),
]
QUICK_SHAPES = [(2, 4096, 16, 16, 128)]
# --masks of the scripts here: which of each shape's calls, causal or not, to run
MASKS = {"none": (False,), "causal": (True,), "both": (False, True)}


def parse_shapes(text: str) -> list[tuple[int, int, int, int, int]]:
    """``"BxSxHxD[xKVH],..."`` as ``(batch, seq, heads, kv_heads, dim)`` tuples; ValueError
    naming an item that is not four or five positive sizes."""
    shapes = []
    for item in text.split(","):
        parts = item.split("x")
        if len(parts) not in (4, 5) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"expected BxSxHxD[xKVH] with positive sizes; got {item!r}")
        dims = [int(d) for d in parts]
        b, s, h, d = dims[:4]
        shapes.append((b, s, h, dims[4] if len(dims) > 4 else h, d))
    return shapes


def beside(fns: dict[str, Any], anchor: str, extra: dict[str, Any]) -> dict[str, Any]:
    """``fns`` with ``extra``'s entries listed right after ``anchor``'s (at the end without it)."""
    out: dict[str, Any] = {}
    for name, fn in fns.items():
        out[name] = fn
        if name == anchor:
            out |= extra
    return out if anchor in fns else out | extra


def another_program(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a new function: ``jax.jit`` of it traces and compiles its own executable rather
    than finding ``fn``'s in JAX's caches, which are keyed by the function."""

    def program(*args: Any) -> Any:
        return fn(*args)

    return program


def parse_cases(shapes: str, masks: str) -> list[Case]:
    """``parse_shapes(shapes)``, each with every mask of ``MASKS[masks]``."""
    return [
        Case(b, s, h, kvh, d, causal)
        for b, s, h, kvh, d in parse_shapes(shapes)
        for causal in MASKS[masks]
    ]


def parse_params(text: str, cls: type) -> Any:
    """``"128x64x8x3[xmirrored][xdq2]"`` as ``cls(q_blocksize, kv_blocksize, num_warps,
    num_stages, variant, dq_num_stages)``: a block config on the command line (``FwdParams`` or
    ``BwdParams``; ``dqN``, the dQ kernel's stages, is a backward's)."""
    bq, bk, warps, stages, *rest = text.split("x")
    extra: dict[str, Any] = {}
    for item in rest:
        if item.startswith("dq") and item[2:].isdigit():
            extra["dq_num_stages"] = int(item[2:])
        elif "variant" not in extra:
            extra["variant"] = item
        else:
            raise ValueError(f"{text!r}: more than one variant ({extra['variant']!r}, {item!r})")
    return cls(
        q_blocksize=int(bq), kv_blocksize=int(bk), num_warps=int(warps), num_stages=int(stages),
        **extra,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    seq: int
    heads: int
    kv_heads: int
    dim: int
    causal: bool

    @property
    def layout(self) -> str:
        """Heads, head dim and mask: what a case's name says besides batch and length."""
        gqa = f"/{self.kv_heads}kv" if self.kv_heads != self.heads else ""
        return f"{self.heads}{gqa}x{self.dim}{' causal' if self.causal else ''}"

    @property
    def name(self) -> str:
        return f"{self.batch}x{self.seq}x{self.layout}"

    @classmethod
    def of_name(cls, name: str) -> Case:
        """The case a saved result's ``name`` stands for."""
        shape, _, mask = name.partition(" ")
        batch, seq, heads, dim = shape.split("x")
        heads, _, kv_heads = heads.partition("/")
        kv_heads = kv_heads.removesuffix("kv") or heads
        return cls(int(batch), int(seq), int(heads), int(kv_heads), int(dim), mask == "causal")

    def flops(self, backward: bool) -> float:
        f = 4.0 * self.batch * self.heads * self.seq * self.seq * self.dim
        if self.causal:
            f /= 2
        return f * 3.5 if backward else f


def inputs(case: Case, seed: int, dtype: Any = jnp.bfloat16) -> tuple[jax.Array, ...]:
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (case.batch, case.seq, case.heads, case.dim), dtype)
    k = jax.random.normal(kk, (case.batch, case.seq, case.kv_heads, case.dim), dtype)
    v = jax.random.normal(kv, (case.batch, case.seq, case.kv_heads, case.dim), dtype)
    do = jax.random.normal(kd, q.shape, dtype)
    return q, k, v, do


# --- the implementations -------------------------------------------------------------------------


def ejkfn_impls(case: Case) -> dict[str, Callable[..., jax.Array]]:
    """name -> attention(q, k, v) for every ejkfn backend that runs natively here, plus auto."""
    spec = AttentionSpec(scale=case.dim**-0.5, causal=case.causal)
    q_shape = jax.ShapeDtypeStruct((case.batch, case.seq, case.heads, case.dim), jnp.bfloat16)
    k_shape = jax.ShapeDtypeStruct((case.batch, case.seq, case.kv_heads, case.dim), jnp.bfloat16)
    shape = AttentionShape.of(q_shape, k_shape, spec)
    kind = ejkfn.device_kind()
    impls: dict[str, Callable[..., jax.Array]] = {}
    for backend in registered_backends():
        if kind not in backend.devices or not backend.available():
            continue
        if backend.variant == "dense" and case.batch * case.heads * case.seq**2 > 2**31:
            continue  # its score matrix would not fit
        try:
            params = backend.heuristic(shape)
        except NotImplementedError:
            continue
        cfg = AttentionConfig(
            platform=backend.platform, variant=backend.variant, fwd=params[0], bwd=params[1]
        )
        impls[f"ejkfn {backend.platform}/{backend.variant}"] = lambda q, k, v, cfg=cfg: (
            ejkfn.flash_attention(q, k, v, causal=case.causal, cfg=cfg)
        )
    impls["ejkfn auto"] = lambda q, k, v: ejkfn.flash_attention(q, k, v, causal=case.causal)
    return impls


MHA = "jax pallas-triton mha"
# One more jit of our Triton kernels (or our first), listed right after mha and compared with
# nothing: the program listed next to mha read up to 4.5% slow (benchmarks/NOTES.md,
# eighty-second and eighty-third rounds).
PAD = "pad beside mha"


def peer_impls(case: Case) -> dict[str, Callable[..., jax.Array]]:
    impls: dict[str, Callable[..., jax.Array]] = {}
    for implementation in ("cudnn", "xla"):
        if implementation == "xla" and case.batch * case.heads * case.seq**2 > 2**31:
            continue  # the score matrix would not fit
        impls[f"jax.nn {implementation}"] = lambda q, k, v, implementation=implementation: (
            jax.nn.dot_product_attention(
                q, k, v, is_causal=case.causal, implementation=implementation
            )
        )
    try:
        from jax.experimental.pallas.ops.gpu import attention as pallas_mha

        if case.heads == case.kv_heads:

            def mha(q, k, v):
                return pallas_mha.mha(
                    q, k, v, segment_ids=None, causal=case.causal, sm_scale=case.dim**-0.5
                )

            impls[MHA] = mha
    except Exception as exc:  # a peer that does not import is reported, not fatal
        print(f"peer jax pallas mha unavailable: {type(exc).__name__}: {exc}")
    impls.update(library_peers(case))
    return impls


def _stand_in_profiler() -> None:
    """tokamax imports the xprof profiler at start; we time with our own clock, so where xprof is
    not installed empty modules stand in for the three it imports."""
    try:
        import xprof.cli.tools  # noqa: F401
    except ImportError:
        for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
            sys.modules.setdefault(name, types.ModuleType(name))
        sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None  # type: ignore[attr-defined]


def library_peers(case: Case) -> dict[str, Callable[..., jax.Array]]:
    """tokamax's Mosaic GPU and Triton attention and ejkernel's Triton attention, each on its own
    default config, where the library imports (``--peers`` adds a folder of them to the path)."""
    impls: dict[str, Callable[..., jax.Array]] = {}
    scale = case.dim**-0.5
    try:
        _stand_in_profiler()
        import tokamax

        logging.getLogger("absl").setLevel(logging.ERROR)  # a warning per autotuning-cache miss

        for implementation in ("mosaic_gpu", "triton"):
            impls[f"tokamax {implementation}"] = lambda q, k, v, implementation=implementation: (
                tokamax.dot_product_attention(
                    q, k, v, scale=scale, is_causal=case.causal, implementation=implementation
                )
            )
    except Exception as exc:
        print(f"peer tokamax unavailable: {type(exc).__name__}: {exc}")
    try:
        from ejkernel.kernels._triton import flash_attention as ejkernel_triton

        impls["ejkernel triton"] = lambda q, k, v: ejkernel_triton(
            q, k, v, softmax_scale=scale, causal=case.causal
        )
    except Exception as exc:
        print(f"peer ejkernel unavailable: {type(exc).__name__}: {exc}")
    return impls


def reference(q, k, v, causal):
    group = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    return jax.nn.dot_product_attention(
        q.astype(jnp.float32),
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        is_causal=causal,
        implementation="xla",
    )


def rel_err(a: jax.Array, b: jax.Array) -> float:
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def fwd_bwd(fn: Callable[..., jax.Array]) -> Callable[..., Any]:
    """``(q, k, v) -> out`` as ``(q, k, v, do) -> (out, dq, dk, dv)`` (``do`` cast to the output's
    dtype: a float32 reference takes the same cotangents as the kernels)."""

    def run(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, *vjp(do.astype(out.dtype))

    return run


@dataclasses.dataclass(frozen=True)
class Expected:
    """A case's check: inputs at a length the f32 reference fits, and that reference's outputs and
    gradients, computed once and shared by every implementation checked on the case."""

    inputs: tuple[jax.Array, ...]
    outputs: tuple[jax.Array, ...]

    @classmethod
    def of(cls, case: Case, seed: int = 7) -> Expected:
        # The f32 reference materialises the scores: check at a length it fits (same heads, dim, mask).
        small = dataclasses.replace(case, batch=1, seq=min(case.seq, 4096))
        q, k, v, do = inputs(small, seed)
        want = jax.jit(fwd_bwd(lambda q, k, v: reference(q, k, v, case.causal)))(
            *(x.astype(jnp.float32) for x in (q, k, v, do))
        )
        return cls((q, k, v, do), tuple(want))


def check(fn: Callable[..., jax.Array], expected: Expected) -> dict[str, float]:
    got = jax.jit(fwd_bwd(fn))(*expected.inputs)
    return {
        name: rel_err(g, w)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, expected.outputs, strict=True)
    }


def median_ms(
    fn: Callable[..., Any], arg_sets: list[tuple[Any, ...]], warmup: int, iters: int
) -> float:
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    times = []
    for i in range(iters):
        args = arg_sets[i % len(arg_sets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# The untimed calls before each timed batch: the clock lags the power drawn by about 0.1 s. After
# 20 ms of settling on an H200, a kernel read 10-13% fast after an idle GPU and 5-11% after a lighter
# kernel, and Pallas-Triton's forward 6-8% slow after a heavy one; after 0.1-0.4 s, within the
# noise (clock_settle_gpu.py; NOTES.md, twenty-fourth round).
SETTLE_MS = 200.0
# Each timed batch lasts at least this long. With 20 ms batches two columns running the same program
# read up to 5% apart in one table; with 300 ms their forward+backward readings agreed within 0.7% in
# every round, and the medians within 0.1% (NOTES.md, thirty-fourth round).
MIN_BATCH_MS = 300.0


def interleaved_ms(
    fns: dict[str, Callable[..., Any]],
    arg_sets: list[tuple[Any, ...]],
    calls: int,
    rounds: int,
    min_batch_ms: float = MIN_BATCH_MS,
    settle_ms: float = SETTLE_MS,
    seed: int = 0,
) -> dict[str, list[float]]:
    """Milliseconds per call of each of ``fns`` (already warm), one reading a round: in each round,
    in a new order (from ``seed``), ``settle_ms`` of untimed calls then a timed batch of ``calls``
    calls, back to back, the input sets rotating (:func:`ejkfn.interleaved_seconds`; the untimed
    calls let the clock follow this kernel's load, see ``SETTLE_MS``). A timed batch shorter than
    ``min_batch_ms`` (judged by one call) takes that long instead: a short batch reads the clock's
    transients more than the kernel (``MIN_BATCH_MS``)."""

    def rotating(fn: Callable[..., Any]) -> Callable[[], Any]:
        sets = itertools.cycle(arg_sets)
        return lambda: fn(*next(sets))

    readings = ejkfn.interleaved_seconds(
        {name: rotating(fn) for name, fn in fns.items()},
        warmup=int(min_batch_ms > 0),
        calls=calls * rounds,
        rounds=rounds,
        settle=1,
        seed=seed,
        min_batch_seconds=min_batch_ms / 1e3,
        settle_seconds=settle_ms / 1e3,
    )
    times: dict[str, list[float]] = {}
    for name, seconds in readings.items():
        if isinstance(seconds, Exception):
            raise seconds
        times[name] = [t * 1e3 for t in seconds]
    return times


def check_then_time(
    case: Case,
    backward: bool,
    impls: dict[str, Callable[..., Any]],
    baseline: str,
    sets: list[tuple[Any, ...]],
    calls: int,
    rounds: int,
    *,
    warmup: int = 2,
    error: Callable[[Any, Any], float] = rel_err,
    max_error: float = float("inf"),
    timing: bool = True,
    stop: Callable[[], bool] = lambda: False,
) -> list[dict[str, Any]]:
    """One row per implementation of ``impls`` (jitted; ``(q, k, v)`` -> out, or with ``backward``
    ``(q, k, v, do)`` -> (out, dq, dk, dv)): its largest ``error`` against ``impls[baseline]`` on the
    first input set, then, for those under ``max_error``, ``warmup`` calls and the median over
    :func:`interleaved_ms` rounds of ``calls`` calls (ms, TFLOP/s, spread, ``vs_<baseline>``; each
    round's reading as ``rounds_ms``). An implementation that raises gets an ``error`` entry; none
    is checked once ``stop()`` says so."""
    arity = 4 if backward else 3
    sets = [s[:arity] for s in sets]
    want = impls[baseline](*sets[0])
    want = want if backward else (want,)
    rows: dict[str, dict[str, Any]] = {}
    warm: list[str] = []
    for name, fn in impls.items():
        if stop():
            print(f"stopped: {case.name} from {name} on not run")
            break
        row = rows[name] = dict(case=case.name, pass_="fwd+bwd" if backward else "fwd", impl=name)
        try:
            got = fn(*sets[0])
            got = got if backward else (got,)
            err = max(error(g, w) for g, w in zip(got, want, strict=True))
            row[f"max_rel_err_vs_{baseline}"] = err
            if timing and err < max_error:
                for i in range(warmup):
                    jax.block_until_ready(fn(*sets[i % len(sets)]))
                warm.append(name)
        except Exception as exc:  # report and go on: one variant failing must not end the run
            row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    timed = interleaved_ms({name: impls[name] for name in warm}, sets, calls, rounds)
    base = statistics.median(timed[baseline]) if baseline in timed else None
    flops = case.flops(backward)
    for name, ms_list in timed.items():
        ms = statistics.median(ms_list)
        rows[name].update(
            ms=ms,
            tflops=flops / ms / 1e9,
            spread=max(ms_list) / min(ms_list),
            rounds_ms=[round(t, 5) for t in ms_list],  # in the rounds' order
        )
        if base and name != baseline:
            rows[name][f"vs_{baseline}"] = base / ms
    return list(rows.values())


def power_and_clock(
    fn: Callable[..., Any], arg_sets: list[tuple[Any, ...]], seconds: float = 1.5
) -> dict[str, float] | None:
    """Median board power (W) and SM clock (MHz) while ``fn`` runs back to back for ``seconds``
    (input sets rotating), sampled by ``nvidia-smi`` every 20 ms; the first third of the samples
    is dropped (nvidia-smi starts late and the clock settles). None where nvidia-smi is missing or
    reports nothing. With both, energy per FLOP compares kernels that throttle differently."""
    query = ["nvidia-smi", "--query-gpu=power.draw,clocks.sm", "--format=csv,noheader,nounits"]
    try:
        sampler = subprocess.Popen([*query, "-lms", "20"], stdout=subprocess.PIPE, text=True)
    except OSError:
        return None
    try:
        sets = itertools.cycle(arg_sets)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            jax.block_until_ready([fn(*next(sets)) for _ in range(4)])
    finally:
        sampler.terminate()
        text, _ = sampler.communicate(timeout=30)
    samples = []
    for line in text.splitlines():
        try:
            watts, mhz = (float(x) for x in line.split(","))
        except ValueError:  # "[N/A]" or a partial line
            continue
        samples.append((watts, mhz))
    samples = samples[len(samples) // 3 :]
    if not samples:
        return None
    return {
        "watts": statistics.median(w for w, _ in samples),
        "sm_mhz": statistics.median(m for _, m in samples),
        "samples": len(samples),
    }


# Lowering for a GPU needs one to describe, not one to run on.
HOPPER = jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"
)


def lower_for_hopper(fn: Callable[..., Any], *args: Any) -> Any:
    """``jax.jit(fn)`` lowered for an abstract Hopper GPU (``args`` may be abstract), on any
    machine: the kernels' IR without a GPU."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=HOPPER)
    with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def load_module(path: str | Path, name: str) -> types.ModuleType:
    """The module in file ``path`` (another revision of one of ours), loaded as
    ``ejkfn.attention.<name>`` so that its relative imports resolve to this tree's package. A backend
    it defines is not registered: ``platform=...`` keeps running this tree's."""
    spec = importlib.util.spec_from_file_location(f"ejkfn.attention.{name}", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no Python module at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    register = _backend.register_backend
    _backend.register_backend = lambda backend: backend
    try:
        spec.loader.exec_module(module)
    finally:
        _backend.register_backend = register
    return module


def save_rows(
    folder: str | Path, prefix: str, rows: list[dict[str, Any]], stamp: str | None = None
) -> Path:
    """``rows`` with the device's description as ``folder/<prefix>_<device>_<stamp>.json``, the
    stamp the time now unless given (a run that saves as it goes rewrites one file)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    kind = jax.devices()[0].device_kind.replace(" ", "_")
    path = out / f"{prefix}_{kind}_{stamp or time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(dict(device=device_info(), rows=rows), indent=1))
    print("saved", path.name)
    return path


LAUNCHER_AND_PEERS = ("jax-triton", "tokamax", "ejkernel")


def launcher_and_peer_versions() -> dict[str, str | None]:
    """The versions of jax-triton (our Triton kernels' launcher) and of the peer libraries timed
    beside ours; None where one is not installed (``--peers`` adds its folder to the path first)."""
    return {dist: installed_version(dist) for dist in LAUNCHER_AND_PEERS}


def device_info() -> dict[str, Any]:
    dev = jax.devices()[0]
    info: dict[str, Any] = {
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "platform_version": str(getattr(dev.client, "platform_version", "")),
        "host": host_platform.node(),
        "versions": {**ejkfn.software_versions(), **launcher_and_peer_versions()},
    }
    try:
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def timed_by_case(results: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """case -> implementation -> result, of the results that were timed."""
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        if "fwd_tflops" in r:
            by_case.setdefault(r["case"], {})[r["impl"]] = r
    return by_case


PASSES = ("fwd", "fwd_bwd")  # the timed passes, as results name them

# The README's columns: (header, implementation, ratio to cuDNN shown).
COLUMNS = [
    ("cuDNN", "jax.nn cudnn", False),
    ("Mosaic", "ejkfn pallas/mosaic", True),
    ("tokamax Mosaic GPU", "tokamax mosaic_gpu", True),
    ("Triton", "ejkfn triton/triton", False),
    ("Pallas-Triton", "ejkfn pallas/triton", False),
    ("ejkfn `cudnn`", "ejkfn cudnn/cudnn", False),
    ("`auto`", "ejkfn auto", True),
    ("JAX Pallas `mha`", MHA, False),
    ("XLA", "jax.nn xla", False),
    ("ejkfn XLA dense", "ejkfn xla/dense", False),
    ("ejkfn XLA chunked", "ejkfn xla/chunked", False),
    ("tokamax Triton", "tokamax triton", False),
    ("ejkernel Triton", "ejkernel triton", False),
]


def platform_table(results: list[dict[str, Any]]) -> str:
    """The README's table: forward / forward+backward TFLOP/s of each column, with the ratio to cuDNN
    in brackets where the goals compare it; ``wrong`` where its check failed, ``-`` where it did not
    run."""
    lines = [
        "| B x S x H x D | " + " | ".join(header for header, _, _ in COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 1) + "|",
    ]
    checked = {(r["case"], r["impl"]): r for r in results}  # timed or not (a failed check)
    for case, impls in timed_by_case(results).items():
        cudnn = impls.get("jax.nn cudnn", {})
        cells = [re.sub(r"/(\d+)kvx", r"(\1 kv)x", case)]  # 2x8192x32/8kvx128: 2x8192x32(8 kv)x128
        for _, name, with_ratio in COLUMNS:
            r = checked.get((case, name), {})
            if r.get("correct") is False:
                cells.append("wrong")
                continue
            if not r.get("fwd_tflops"):
                cells.append("-")
                continue
            parts = []
            for key in (f"{p}_tflops" for p in PASSES):
                value, base = r.get(key), cudnn.get(key)
                text = f"{value:.0f}" if value else "-"
                parts.append(
                    f"{text} ({value / base:.2f})" if with_ratio and value and base else text
                )
            cells.append(" / ".join(parts))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def paired_ratio(row: dict[str, Any], base: dict[str, Any], pass_: str) -> float | None:
    """The median over rounds of ``row``'s speed against ``base``'s in the same round (``pass_``'s
    ``*_rounds_ms``, in round order for every implementation of a run); None without both. Each
    round's pair shares the machine's state at that time. Measured on identical kernels this
    resolves little more than a ratio of the two medians (benchmarks/NOTES.md, seventy-sixth
    round): more rounds are what resolve close rows."""
    mine, theirs = row.get(f"{pass_}_rounds_ms"), base.get(f"{pass_}_rounds_ms")
    if not mine or not theirs or len(mine) != len(theirs):
        return None
    return statistics.median(b / a for a, b in zip(mine, theirs, strict=True))


@dataclasses.dataclass(frozen=True)
class CaseRatios:
    """One case's ratios that the goals compare, per pass ("fwd", "fwd_bwd"); None where a side
    did not run. "Best" is the fastest of our own kernels (not our cuDNN backend); ``auto`` is
    compared with the fastest of every ejkfn platform, and ``auto_cudnn`` with cuDNN (what a user
    gets, cuDNN's backward kernel included where a shipped config trains on it)."""

    head_dim: int
    best: dict[str, tuple[float | None, str]]  # (best / cuDNN, its platform)
    paired: dict[str, float | None]  # the best of our kernels by :func:`paired_ratio` to cuDNN
    auto: dict[str, float | None]
    auto_cudnn: dict[str, float | None]
    triton: dict[str, float | None]  # our Triton / JAX's mha
    pallas_triton: dict[str, float | None]  # our Pallas-Triton / JAX's mha
    tokamax: dict[str, float | None]  # best / tokamax's best

    @classmethod
    def of(cls, case: str, impls: dict[str, dict[str, Any]]) -> CaseRatios:
        cudnn = impls.get("jax.nn cudnn", {})
        mha = impls.get(MHA, {})
        auto = impls.get("ejkfn auto", {})
        own = {n: r for n, r in impls.items() if n.startswith("ejkfn ") and n != "ejkfn auto"}
        kernels = {n: r for n, r in own.items() if not n.startswith("ejkfn cudnn")}
        tokamax = [r for n, r in impls.items() if n.startswith("tokamax ")]

        def fastest(rows: Any, key: str) -> float:
            return max((r.get(key) or 0 for r in rows), default=0)

        best, paired = {}, {}
        for p in PASSES:
            key = f"{p}_tflops"
            name, row = max(kernels.items(), key=lambda kv: kv[1].get(key) or 0, default=("", {}))
            best[p] = (_ratio(row.get(key), cudnn.get(key)), name.removeprefix("ejkfn "))
            in_rounds = [paired_ratio(r, cudnn, p) for r in kernels.values()]
            paired[p] = max((v for v in in_rounds if v is not None), default=None)

        def versus_mha(name: str) -> dict[str, float | None]:
            row = impls.get(name, {})
            return {p: _ratio(row.get(f"{p}_tflops"), mha.get(f"{p}_tflops")) for p in PASSES}

        return cls(
            head_dim=Case.of_name(case).dim,
            best=best,
            paired=paired,
            auto={
                p: _ratio(auto.get(f"{p}_tflops"), fastest(own.values(), f"{p}_tflops"))
                for p in PASSES
            },
            auto_cudnn={
                p: _ratio(auto.get(f"{p}_tflops"), cudnn.get(f"{p}_tflops")) for p in PASSES
            },
            triton=versus_mha("ejkfn triton/triton"),
            pallas_triton=versus_mha("ejkfn pallas/triton"),
            tokamax={
                p: _ratio(fastest(kernels.values(), f"{p}_tflops"), fastest(tokamax, f"{p}_tflops"))
                for p in PASSES
            },
        )


def ratios_by_case(results: list[dict[str, Any]]) -> dict[str, CaseRatios]:
    return {case: CaseRatios.of(case, impls) for case, impls in timed_by_case(results).items()}


def summary(results: list[dict[str, Any]]) -> str:
    """The goals' view, as a markdown table: ratios measured side by side in this run."""
    lines = [
        "| shape | best ejkfn fwd / cuDNN | best ejkfn fwd+bwd / cuDNN | auto / fastest ejkfn (fwd, "
        "fwd+bwd) | Triton / mha (fwd, fwd+bwd) | Pallas-Triton / mha (fwd, fwd+bwd) | best ejkfn / "
        "best tokamax (fwd, fwd+bwd) |",
        "|---|---|---|---|---|---|---|",
    ]

    def text(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for case, r in ratios_by_case(results).items():
        cells = [case]
        for p in PASSES:
            value, name = r.best[p]
            cells.append("-" if value is None else f"{text(value)} ({name})")
        for pair in (r.auto, r.triton, r.pallas_triton, r.tokamax):
            cells.append(", ".join(text(pair[p]) for p in PASSES))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The goals: (what, the ratio of a case and pass, the least it may be at head dims above 64
# and up to 64).
GOALS: list[tuple[str, Callable[[CaseRatios], float | None], float, float]] = [
    ("forward >= 1.0x cuDNN (0.9x at head dim <= 64)", lambda r: r.best["fwd"][0], 1.0, 0.9),
    ("forward+backward >= 1.0x cuDNN", lambda r: r.best["fwd_bwd"][0], 1.0, 1.0),
    (
        "forward >= 1.0x cuDNN, median of the rounds' ratios (0.9x at head dim <= 64)",
        lambda r: r.paired["fwd"],
        1.0,
        0.9,
    ),
    (
        "forward+backward >= 1.0x cuDNN, median of the rounds' ratios",
        lambda r: r.paired["fwd_bwd"],
        1.0,
        1.0,
    ),
    ("ahead of tokamax, forward", lambda r: r.tokamax["fwd"], 1.0, 1.0),
    ("ahead of tokamax, forward+backward", lambda r: r.tokamax["fwd_bwd"], 1.0, 1.0),
    ("Triton >= 1.5x mha, forward", lambda r: r.triton["fwd"], 1.5, 1.5),
    ("Triton >= 2.5x mha, forward+backward", lambda r: r.triton["fwd_bwd"], 2.5, 2.5),
    ("Pallas-Triton >= 1.5x mha, forward", lambda r: r.pallas_triton["fwd"], 1.5, 1.5),
    ("Pallas-Triton >= 2.5x mha, forward+backward", lambda r: r.pallas_triton["fwd_bwd"], 2.5, 2.5),
    ("auto within 3% of the fastest, forward", lambda r: r.auto["fwd"], 0.97, 0.97),
    ("auto within 3% of the fastest, forward+backward", lambda r: r.auto["fwd_bwd"], 0.97, 0.97),
    (
        "auto >= 1.0x cuDNN, forward (0.9x at head dim <= 64)",
        lambda r: r.auto_cudnn["fwd"],
        1.0,
        0.9,
    ),
    ("auto >= 1.0x cuDNN, forward+backward", lambda r: r.auto_cudnn["fwd_bwd"], 1.0, 1.0),
]


def goals(results: list[dict[str, Any]]) -> str:
    """Where each goal stands over the results' cases, as a markdown table: the readings that meet
    it, the lowest ratio, and every miss to three decimals."""
    lines = ["| goal | met | lowest | below |", "|---|---|---|---|"]
    by_case = ratios_by_case(results)
    for what, reading, least, least_d64 in GOALS:
        values = {case: reading(r) for case, r in by_case.items()}
        values = {case: v for case, v in values.items() if v is not None}
        if not values:
            lines.append(f"| {what} | - | - | |")
            continue
        floor = {case: least if by_case[case].head_dim > 64 else least_d64 for case in values}
        misses = [f"{case}: {v:.3f}" for case, v in values.items() if v < floor[case]]
        met = len(values) - len(misses)
        lowest = min(values.values())
        lines.append(f"| {what} | {met} of {len(values)} | {lowest:.3f} | {'; '.join(misses)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one shape, causal and not")
    parser.add_argument("--check-only", action="store_true", help="correctness only, no timing")
    parser.add_argument("--shapes", help="BxSxHxD[xKVH] list, comma-separated")
    parser.add_argument("--calls", type=int, default=8, help="calls per batch, back to back")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds of batches")
    parser.add_argument(
        "--min-batch-ms",
        type=float,
        default=MIN_BATCH_MS,
        help="each timed batch runs at least this long (more calls for short kernels)",
    )
    parser.add_argument(
        "--settle-ms",
        type=float,
        default=SETTLE_MS,
        help="untimed calls of a kernel before each of its timed batches, so the clock follows it",
    )
    parser.add_argument(
        "--order-seed",
        type=int,
        default=None,
        help="seed of the rounds' orders (default: drawn, and saved with the results)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        help="leave out implementations whose name contains this text (repeatable)",
    )
    parser.add_argument("--peers", help="folder of peer libraries, appended to the import path")
    parser.add_argument(
        "--pad",
        action="store_true",
        help=f"time '{PAD}', a second jit of our Triton kernels, right after JAX's mha, in the "
        "place whose program read slow (NOTES.md, eighty-second round); no table shows it",
    )
    parser.add_argument(
        "--tabulate",
        nargs="+",
        metavar="RESULTS",
        help="print the tables of saved results (runs of the same code, e.g. a table split over "
        "several runs by --shapes) and exit; measures nothing",
    )
    parser.add_argument(
        "--power", action="store_true", help="also board power and SM clock under each (nvidia-smi)"
    )
    parser.add_argument(
        "--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results")
    )
    args = parser.parse_args()
    if not args.min_batch_ms >= 0:
        parser.error(f"--min-batch-ms must be 0 or more, got {args.min_batch_ms}")
    if not args.settle_ms >= 0:
        parser.error(f"--settle-ms must be 0 or more, got {args.settle_ms}")
    if args.tabulate:
        saved = [json.loads(Path(path).read_text()) for path in args.tabulate]
        results = [r for run in saved for r in run["results"]]
        print(platform_table(results), summary(results), goals(results), sep="\n\n")
        return 0
    if args.order_seed is None:
        args.order_seed = random.SystemRandom().randrange(2**31)
    if args.peers:
        sys.path.append(str(Path(args.peers).resolve()))

    if args.shapes:
        shapes = parse_shapes(args.shapes)
    else:
        shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    cases = [
        Case(b, s, h, kvh, d, causal) for (b, s, h, kvh, d) in shapes for causal in (False, True)
    ]

    info = device_info()
    print(json.dumps(info))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = info["device_kind"].replace(" ", "_")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = out / f"attention_{'check' if args.check_only else 'bench'}_{tag}_{stamp}.json"

    def save(results: list[dict[str, Any]]) -> None:
        # After every measurement: a run cut off by its time limit keeps what it measured.
        timing = {k: getattr(args, k) for k in ("calls", "rounds", "min_batch_ms", "settle_ms")}
        timing["order_seed"] = args.order_seed
        path.write_text(
            json.dumps(
                {"device": info, "date": stamp, "timing": timing, "results": results}, indent=1
            )
        )

    results: list[dict[str, Any]] = []
    rows: list[tuple[str, str, float | None, float | None, str]] = []
    for case in cases:
        impls = {**peer_impls(case), **ejkfn_impls(case)}
        impls = {n: fn for n, fn in impls.items() if not any(text in n for text in args.skip)}
        if args.pad and MHA in impls:  # our Triton kernels as the pad, else our first
            candidates = ("ejkfn triton/triton", *impls)
            mine = next((n for n in candidates if n.startswith("ejkfn ") and n in impls), None)
            if mine is not None:
                impls = beside(impls, MHA, {PAD: another_program(impls[mine])})
        arg_sets = [inputs(case, seed) for seed in (1, 2)]
        expected = Expected.of(case)
        entries: dict[str, dict[str, Any]] = {}
        passes: dict[str, dict[str, Callable[..., Any]]] = {"fwd": {}, "fwd_bwd": {}}
        for name, fn in impls.items():  # correctness first; compile and warm what passes
            entry = entries[name] = {"case": case.name, "impl": name}
            try:
                errors = check(fn, expected)
                entry["rel_err"] = errors
                worst = max(errors.values())
                entry["correct"] = worst == worst and worst < 2e-2  # NaN fails
                entry["note"] = (
                    f"max rel err {worst:.1e}" if entry["correct"] else f"WRONG {errors}"
                )
                if entry["correct"] and not args.check_only:
                    fwd = jax.jit(fn)
                    median_ms(fwd, [a[:3] for a in arg_sets], args.warmup, 1)
                    passes["fwd"][name] = fwd
                    if not args.no_backward:
                        both = jax.jit(fwd_bwd(fn))
                        median_ms(both, arg_sets, args.warmup, 1)
                        passes["fwd_bwd"][name] = both
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                entry["note"] = entry["error"][:80]
                traceback.print_exc(limit=3)
                for fns in passes.values():
                    fns.pop(name, None)
        for key, fns in passes.items():
            sets = arg_sets if key == "fwd_bwd" else [a[:3] for a in arg_sets]
            times = interleaved_ms(
                fns,
                sets,
                args.calls,
                args.rounds,
                args.min_batch_ms,
                args.settle_ms,
                seed=args.order_seed + len(results),
            )
            for name, ms in times.items():
                entry = entries[name]
                entry[f"{key}_ms"] = statistics.median(ms)
                entry[f"{key}_tflops"] = case.flops(key == "fwd_bwd") / entry[f"{key}_ms"] / 1e9
                entry[f"{key}_spread"] = max(ms) / min(ms)
                entry[f"{key}_rounds_ms"] = ms  # per round; the saved seed replays their orders
                if args.power:
                    drawn = power_and_clock(fns[name], sets)
                    if drawn:
                        entry[f"{key}_watts"], entry[f"{key}_sm_mhz"] = (
                            drawn["watts"],
                            drawn["sm_mhz"],
                        )
                        entry[f"{key}_joules_per_pflop"] = drawn["watts"] / (
                            entry[f"{key}_tflops"] / 1e3
                        )
        for name, entry in entries.items():
            note = entry.pop("note")
            if "fwd_watts" in entry or "fwd_bwd_watts" in entry:
                note += " | " + ", ".join(
                    f"{key} {entry[key + '_watts']:.0f} W {entry[key + '_sm_mhz']:.0f} MHz"
                    for key in ("fwd", "fwd_bwd")
                    if key + "_watts" in entry
                )
            rows.append(
                (case.name, name, entry.get("fwd_tflops"), entry.get("fwd_bwd_tflops"), note)
            )
            results.append(entry)
            print(
                f"  {case.name:28} {name:28} {rows[-1][2] or '-'} {rows[-1][3] or '-'} {note}",
                flush=True,
            )
        save(results)

    # ratios to cuDNN, per case
    cudnn = {r["case"]: r for r in results if r["impl"] == "jax.nn cudnn"}
    print(
        f"\n{info.get('device_kind')} | jax {jax.__version__} | bf16 | TFLOP/s (ratio to cuDNN)\n"
    )
    print(f"{'case':30} {'implementation':30} {'fwd':>16} {'fwd+bwd':>16}  note")
    for case_name, name, f, fb, note in rows:
        base = cudnn.get(case_name, {})

        def cell(v, key, base=base):
            if v is None:
                return f"{'-':>16}"
            ref = base.get(key)
            return f"{v:7.1f} ({v / ref:4.2f}x)" if ref else f"{v:7.1f}        "

        print(
            f"{case_name:30} {name:30} {cell(f, 'fwd_tflops')} {cell(fb, 'fwd_bwd_tflops')}  {note}"
        )

    print(summary(results), goals(results), sep="\n\n")
    save(results)
    print(f"\nwrote {path}")
    return 0 if all(r.get("correct", False) for r in results if "error" not in r) else 1


if __name__ == "__main__":
    sys.exit(main())
