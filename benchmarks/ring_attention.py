"""Ring attention over several GPUs, one process per GPU: correctness against one GPU, then throughput.

The launcher starts ``--processes`` workers of this script, joined by ``jax.distributed.initialize``
(one local GPU each). For every sequence length and mask, each worker

1. builds the same random bf16 ``q, k, v, do`` of the whole sequence on its own GPU (same seed in
   every process) and keeps its shard of the sequence: contiguous slices, or the zigzag layout for
   causal attention (:func:`ejkfn.zigzag_order`);
2. runs :func:`ejkfn.ring_attention` inside ``jax.shard_map`` over the global mesh, forward and
   forward+backward, and compares its shard of the output and gradients with the single-GPU
   :func:`ejkfn.flash_attention` of the whole sequence (same local backend and config);
3. times the ring and, on its own GPU alone, the same kernel at the per-device sequence length;
   also the ring's communication alone (the key/value blocks sent around the ring, no compute).
   All of them take turns in interleaved rounds, each turn a batch of calls back to back, and each
   reads the median over the rounds: timed call by call, the same program had read up to 9% apart
   within one run (benchmarks/NOTES.md, thirty-first round).

Per-GPU throughput of the ring is its FLOPs divided by the time and by the number of GPUs; the ratio
is that over the single-GPU kernel's TFLOP/s at the per-device length. Process 0 prints the table and
writes JSON to ``--out``.

Usage: ``python benchmarks/ring_attention.py [--processes 2] [--seqs 32768,65536] [--out DIR]``;
``--processes 1`` drives every local GPU from one process instead.
On a CPU, ``--cpu-smoke`` runs one process over two host devices at a small size (a check of the
script, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if "--cpu-smoke" in sys.argv:  # two host devices; must be set before jax starts
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax
import jax.numpy as jnp
import numpy as np
from attention import device_info, fwd_bwd, interleaved_ms, rel_err
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import ejkfn
from ejkfn.attention import (
    AttentionConfig,
    AttentionShape,
    AttentionSpec,
    _ring,
    registered_backends,
)
from ejkfn.attention._mosaic_grid import sparing_sms

AXIS = "sp"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--processes",
        type=int,
        default=2,
        help="one per GPU; 1: this process drives every local GPU (the setting of XLA's "
        "--xla_gpu_use_memcpy_local_p2p, which on jax 0.11.2 still ran NCCL's kernels)",
    )
    p.add_argument("--seqs", default="32768,65536", help="whole-sequence lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: heads")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--causal", default="false,true", help="which masks to run")
    p.add_argument(
        "--platform",
        default="auto",
        help="the local backend's platform; auto: the ring's own choice, as a call without a "
        "config gets it",
    )
    p.add_argument(
        "--variant", default=None, help="its variant (default: the first registered one)"
    )
    p.add_argument(
        "--layout",
        choices=("auto", "contiguous"),
        default="auto",
        help="how the sequence is sharded; auto: zigzag where causal, else contiguous",
    )
    p.add_argument("--iters", type=int, default=20, help="timed calls of each")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds they split into")
    p.add_argument(
        "--transfer-sms",
        default="",
        help="also the ring whose forward leaves this many multiprocessors to the transfer "
        "beside each step but the last (comma-separated; the library leaves "
        "_ring._transfer_sms's count), and the single-GPU forward on as many fewer",
    )
    p.add_argument(
        "--no-comm",
        action="store_true",
        help="also the ring with its transfers left out (each device keeps its own blocks): the "
        "same local work and merges, to tell the transfers' share of the ring's time",
    )
    p.add_argument("--hlo", action="store_true", help="save the ring's compiled HLO")
    p.add_argument(
        "--compiler-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also the ring compiled with this XLA option (repeatable; e.g. "
        "xla_gpu_collective_permute_combine_threshold_bytes=1073741824, one transfer for the key "
        "and value blocks), as a user passes it to jax.jit(compiler_options=...)",
    )
    p.add_argument(
        "--pgle",
        action="store_true",
        help="also the ring compiled again with its kernels' measured times (XLA's profile-guided "
        "latency estimation, process 0's profile in every process), for XLA's scheduler to place "
        "its transfers by",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also profile a few calls of each ring program (forward and training) and report, "
        "from the GPU's kernel timeline, how long its transfers ran beside its local kernels",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace) -> int:
    port = free_port()
    env = dict(os.environ)  # with NVLink multicast off (set above)
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, *sys.argv[1:], "--worker", str(i), "--port", str(port)],
            env=env,
        )
        for i in range(args.processes)
    ]
    codes = [w.wait() for w in workers]
    if any(codes):
        print(f"workers exited with {codes}", file=sys.stderr)
        return 1
    return 0


# --- one worker ----------------------------------------------------------------------------------


def flops(batch: int, heads: int, seq: int, dim: int, causal: bool, backward: bool) -> float:
    f = 4.0 * batch * heads * seq * seq * dim / (2 if causal else 1)
    return f * 3.5 if backward else f


def local_cfg(args: argparse.Namespace, seq_local: int, causal: bool) -> AttentionConfig:
    """The config both the ring and the single-GPU baseline run: with ``--platform auto`` the one
    the ring picks for itself, else the named backend's heuristic one."""
    kv_heads = args.kv_heads or args.heads
    q = jax.ShapeDtypeStruct((args.batch, seq_local, args.heads, args.dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((args.batch, seq_local, kv_heads, args.dim), jnp.bfloat16)
    spec = AttentionSpec(scale=args.dim**-0.5, causal=causal)
    shape = AttentionShape.of(q, k, spec)
    if args.platform == "auto":
        local = _ring._choose("auto", None, spec, shape)
        b = local.backend
        return AttentionConfig(
            platform=b.platform, variant=b.variant, fwd=local.fwd_params, bwd=local.bwd_params
        )
    matches = [
        b
        for b in registered_backends()
        if b.platform == args.platform and (args.variant in (None, b.variant)) and b.available()
    ]
    matches = [b for b in matches if ejkfn.device_kind() in b.devices and b.bwd_uses_residuals]
    if not matches:
        raise SystemExit(
            f"no usable backend for --platform {args.platform} --variant {args.variant}"
        )
    backend = matches[0]
    fwd, bwd = backend.heuristic(shape)
    return AttentionConfig(platform=backend.platform, variant=backend.variant, fwd=fwd, bwd=bwd)


@contextlib.contextmanager
def transfers_left_out() -> Any:
    """Rings traced in here skip their transfers: each device keeps the blocks it holds, so the
    local steps and merges are the ring's and only the ``ppermute`` calls are gone (the results
    are wrong; only their time is read)."""
    kept = _ring.lax
    names = {name: getattr(kept, name) for name in dir(kept) if not name.startswith("__")}
    _ring.lax = types.SimpleNamespace(**{**names, "ppermute": lambda x, axis_name, perm: x})
    try:
        yield
    finally:
        _ring.lax = kept


def worker(args: argparse.Namespace) -> None:
    if not args.cpu_smoke and args.processes > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=args.processes,
            process_id=args.worker,
            local_device_ids=[args.worker],
        )
    devices = jax.devices()
    n = len(devices)
    mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    local_device = devices[mine[0]]
    mesh = Mesh(np.array(devices), (AXIS,))
    seq_spec = PartitionSpec(None, AXIS)
    sharding = NamedSharding(mesh, seq_spec)
    kv_heads = args.kv_heads or args.heads
    rows: list[dict[str, Any]] = []
    for seq in [int(s) for s in args.seqs.split(",")]:
        for causal in [c.strip() == "true" for c in args.causal.split(",")]:
            rows.append(
                one_case(args, seq, causal, n, mine, local_device, mesh, sharding, kv_heads)
            )
            if jax.process_index() == 0:
                print(json.dumps(rows[-1]), flush=True)
    agreed = agreement(args, local_device)
    if jax.process_index() == 0:
        print(json.dumps({"agreement": agreed}), flush=True)
        report(args, rows, n, agreed)


def agreement(args: argparse.Namespace, local_device: Any) -> dict[str, Any]:
    """One config everywhere: each process remembers a different config for the same call; inside
    ``jax.jit`` every process must use process 0's (exchanged through JAX's distributed runtime)."""
    with jax.default_device(local_device):
        q = jnp.zeros((1, 4096, args.heads, args.dim), jnp.bfloat16)
        (inv,) = ejkfn.record(lambda q, k, v: ejkfn.flash_attention(q, k, v), q, q, q)
        block = 64 if jax.process_index() == 0 else 128
        mine = AttentionConfig(
            platform="triton", fwd=ejkfn.FwdParams(q_blocksize=block, kv_blocksize=64)
        )
        with ejkfn.use_caches(ejkfn.Caches().remember(inv.key, mine)):
            lowered = jax.jit(lambda q, k, v: ejkfn.flash_attention(q, k, v)).lower(q, q, q)
        used = ejkfn.find_labels_in_lowered(lowered)[0].call()[1]
    remembered = multihost_utils.process_allgather(np.array([block]))
    used_blocks = multihost_utils.process_allgather(np.array([used.fwd.q_blocksize]))
    return {
        "remembered_q_blocks": np.ravel(remembered).tolist(),
        "used_q_blocks": np.ravel(used_blocks).tolist(),
        "one_config": bool(np.all(np.ravel(used_blocks) == 64)),
    }


@contextlib.contextmanager
def transfer_sms(count: int) -> Any:
    """Rings traced in here leave ``count`` multiprocessors to the transfer beside each forward step
    but the last, masked or not (instead of ``_ring._transfer_sms``'s choice); single-GPU kernels
    leave as many."""
    kept = _ring._transfer_sms
    _ring._transfer_sms = lambda spec: count
    try:
        with sparing_sms(count):
            yield
    finally:
        _ring._transfer_sms = kept


def process0s(blob: bytes) -> bytes:
    """Process 0's ``blob`` in every process (collectives need one schedule everywhere)."""
    if jax.process_count() == 1:
        return blob
    longest = int(np.max(multihost_utils.process_allgather(np.array([len(blob)]))))
    padded = np.zeros(longest + 8, np.uint8)  # its length first, then the bytes
    padded[:8] = np.frombuffer(np.int64(len(blob)).tobytes(), np.uint8)
    padded[8 : 8 + len(blob)] = np.frombuffer(blob, np.uint8)
    chosen = np.asarray(multihost_utils.broadcast_one_to_all(padded))
    size = int(np.frombuffer(chosen[:8].tobytes(), np.int64)[0])
    return chosen[8 : 8 + size].tobytes()


@contextlib.contextmanager
def profiled(fn: Any, operands: tuple[jax.Array, ...], calls: int, pause_s: float = 0.0) -> Any:
    """The profile directory (``plugins/profile/<run>``) of ``calls`` calls of ``fn``, after one
    unprofiled call, with ``pause_s`` after each; removed on leaving."""
    jax.block_until_ready(fn(*operands))
    where = Path(tempfile.mkdtemp(prefix="ring_profile_"))
    try:
        with jax.profiler.trace(str(where)):
            for _ in range(calls):
                jax.block_until_ready(fn(*operands))
                time.sleep(pause_s)
        (run_dir,) = (d for d in where.glob("plugins/profile/*") if d.is_dir())
        yield run_dir
    finally:
        shutil.rmtree(where, ignore_errors=True)


def profile_guided(fn: Any, operands: tuple[jax.Array, ...], *, calls: int = 3) -> Any:
    """``fn`` (a ``jax.jit``) compiled again with the times its instructions took in a profile
    of ``calls`` calls (``fdo_profile``: XLA's latency-hiding scheduler then orders the program by
    measured kernel and transfer times instead of its cost model)."""
    from jax.experimental import profiler as exp_profiler

    lowered = fn.lower(*operands)
    with profiled(lowered.compile(), operands, calls) as run_dir:
        profile = process0s(exp_profiler.get_profiled_instructions_proto(str(run_dir)))
    if not profile:
        raise RuntimeError("the profile recorded no instruction times (not an NVIDIA GPU?)")
    return lowered.compile(compiler_options={"fdo_profile": profile})


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as ``intervals``."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in union(intervals))


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time covered by both ``a`` and ``b``."""
    return covered(a) + covered(b) - covered(a + b)


def timeline(fn: Any, operands: tuple[jax.Array, ...], *, calls: int = 3) -> dict[str, Any]:
    """Where one call's time goes on this process's GPU, from a profile of ``calls`` calls: the
    call's span, the time the transfers' (NCCL) kernels and the local kernels each ran, the time
    both ran at once, and one call's kernels in order (stream, name, start and length in µs).

    Calls are run apart (a sleep between them) so that each one's kernels form one cluster."""
    from jax.profiler import ProfileData

    with profiled(fn, operands, calls, pause_s=0.02) as run_dir:
        (path,) = run_dir.glob("*.xplane.pb")
        xspace = path.read_bytes()
    planes = list(ProfileData.from_serialized_xspace(xspace).planes)
    kernels = []  # (start µs, end µs, stream, kernel name)
    lines = []
    for plane in planes:
        lines += [f"{plane.name} {line.name}" for line in plane.lines]
    # The first GPU's kernels only: one process driving every GPU profiles them all.
    gpus = sorted((p for p in planes if p.name.startswith("/device:GPU")), key=lambda p: p.name)
    for plane in gpus[:1]:
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue  # the derived lines (XLA ops, modules) repeat the streams' kernels
            for e in line.events:
                start = e.start_ns / 1e3
                kernels.append((start, start + e.duration_ns / 1e3, line.name, e.name))
    return {**summarize(kernels), "profile_lines": lines}


def summarize(kernels: list[tuple[float, float, str, str]]) -> dict[str, Any]:
    """:func:`timeline`'s figures from ``(start µs, end µs, stream, kernel name)`` of calls run
    apart: kernels less than 5 ms after the last one ended belong to the same call."""
    kernels = sorted(kernels)
    clusters: list[list[tuple[float, float, str, str]]] = []
    for k in kernels:
        if clusters and k[0] - max(c[1] for c in clusters[-1]) < 5000:
            clusters[-1].append(k)
        else:
            clusters.append([k])
    per_call = []
    for cluster in clusters:
        comm = [(s, e) for s, e, _, n in cluster if "nccl" in n.lower()]
        local = [(s, e) for s, e, _, n in cluster if "nccl" not in n.lower()]
        per_call.append(
            {
                "span_us": max(e for _, e, _, _ in cluster) - cluster[0][0],
                "local_us": covered(local),
                "transfers_us": covered(comm),
                "both_us": overlap(local, comm),
                "kernels": len(cluster),
            }
        )
    last = clusters[-1] if clusters else []
    return {
        "calls": per_call,
        "one_call": [
            (stream, kernel[:60], round(s - last[0][0], 1), round(e - s, 1))
            for s, e, stream, kernel in last
        ],
    }


def interleaved_medians(
    calls: dict[str, tuple[Any, tuple[jax.Array, ...]]], iters: int, rounds: int
) -> dict[str, float]:
    """Milliseconds per call of each ``name: (fn, operands)``: the median over ``rounds`` rounds of
    :func:`attention.interleaved_ms`, with no batch or settling sized by time, so that every
    process makes the same calls in the same order, as its collectives require."""
    fns = {name: functools.partial(fn, *operands) for name, (fn, operands) in calls.items()}
    per_round = max(1, iters // rounds)
    times = interleaved_ms(fns, [()], per_round, rounds, min_batch_ms=0.0, settle_ms=0.0)
    return {name: float(np.median(readings)) for name, readings in times.items()}


def one_case(args, seq, causal, n, mine, local_device, mesh, sharding, kv_heads) -> dict[str, Any]:
    seq_local = seq // n
    layout = "zigzag" if causal and args.layout == "auto" else "contiguous"
    order = ejkfn.zigzag_order(seq, n) if layout == "zigzag" else np.arange(seq)
    cfg = local_cfg(args, seq_local, causal)
    b, h, d = args.batch, args.heads, args.dim
    with jax.default_device(local_device):
        keys = jax.random.split(jax.random.key(seq + causal), 4)
        whole = (
            jax.random.normal(keys[0], (b, seq, h, d), jnp.bfloat16),
            jax.random.normal(keys[1], (b, seq, kv_heads, d), jnp.bfloat16),
            jax.random.normal(keys[2], (b, seq, kv_heads, d), jnp.bfloat16),
            jax.random.normal(keys[3], (b, seq, h, d), jnp.bfloat16),
        )
        shard_rows = {i: jnp.asarray(order[i * seq_local : (i + 1) * seq_local]) for i in mine}

        def shards(x: jax.Array) -> jax.Array:
            pieces = [jax.device_put(x[:, shard_rows[i]], mesh.devices[i]) for i in mine]
            return jax.make_array_from_single_device_arrays(x.shape, sharding, pieces)

        q, k, v, do = (shards(x) for x in whole)

        # With --platform auto the ring picks its backend itself, as a call without a config does.
        ring_cfg = None if args.platform == "auto" else cfg

        # Each program below traces a function object of its own: JAX reuses a function's trace
        # for equal arguments, and the variants differ only in what is set while they trace.
        def make_single() -> Any:
            return functools.partial(ejkfn.flash_attention, causal=causal, cfg=cfg)

        def make_ring() -> Any:
            return jax.shard_map(
                functools.partial(
                    ejkfn.ring_attention, axis_name=AXIS, causal=causal, cfg=ring_cfg, layout=layout
                ),
                mesh=mesh,
                in_specs=(PartitionSpec(None, AXIS),) * 3,
                out_specs=PartitionSpec(None, AXIS),
                check_vma=False,
            )

        single, ring = make_single(), make_ring()
        ring_fwd, ring_both = jax.jit(ring), jax.jit(fwd_bwd(ring))

        # Correctness: this process's shard of the ring against the single-GPU call of the whole.
        got = [np.asarray(x.addressable_shards[0].data) for x in ring_both(q, k, v, do)]
        want = jax.jit(fwd_bwd(single))(*whole)
        rows0 = np.asarray(shard_rows[mine[0]])
        errors = {
            name: rel_err(g, np.asarray(w)[:, rows0])
            for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True)
        }
        del want

        # The ring's communication alone: the same blocks travel n - 1 steps.
        def shift_only(k: jax.Array, v: jax.Array) -> jax.Array:
            perm = [(i, (i + 1) % n) for i in range(n)]
            acc = jnp.zeros((), jnp.float32)
            for _ in range(n - 1):
                k, v = jax.lax.ppermute(k, AXIS, perm), jax.lax.ppermute(v, AXIS, perm)
                acc = acc + k[0, 0, 0, 0].astype(jnp.float32) + v[0, 0, 0, 0].astype(jnp.float32)
            return acc[None]

        comm = jax.jit(
            jax.shard_map(
                shift_only,
                mesh=mesh,
                in_specs=(PartitionSpec(None, AXIS),) * 2,
                out_specs=PartitionSpec(AXIS),
                check_vma=False,
            )
        )
        local = [x[:, :seq_local] for x in whole]
        calls: dict[str, tuple[Any, tuple[jax.Array, ...]]] = {
            "ring_fwd_ms": (ring_fwd, (q, k, v)),
            "ring_fwd_bwd_ms": (ring_both, (q, k, v, do)),
            "ring_comm_ms": (comm, (k, v)),
            "single_fwd_ms": (jax.jit(single), tuple(local[:3])),
            "single_fwd_bwd_ms": (jax.jit(fwd_bwd(single)), tuple(local)),
        }
        for spared in [int(r) for r in args.transfer_sms.split(",") if r]:
            # Compiled in here, where the kernels are planned. Forward only: the training ring
            # keeps every multiprocessor, and a training ring compiled here would spare them in the
            # backward's grids, which the library never does.
            with transfer_sms(spared):
                calls[f"ring_fwd_ms_spared{spared}"] = (
                    jax.jit(make_ring()).lower(q, k, v).compile(),
                    (q, k, v),
                )
                calls[f"single_fwd_ms_spared{spared}"] = (
                    jax.jit(make_single()).lower(*local[:3]).compile(),
                    tuple(local[:3]),
                )

        def ring_programs(suffix: str, compile_: Any) -> None:
            """The ring's forward and training programs, each a fresh trace compiled by
            ``compile_(jitted, operands)``, timed as ``ring_{fwd,fwd_bwd}_ms_{suffix}``."""
            for part, fn, operands in (
                ("fwd", make_ring(), (q, k, v)),
                ("fwd_bwd", fwd_bwd(make_ring()), (q, k, v, do)),
            ):
                calls[f"ring_{part}_ms_{suffix}"] = (compile_(jax.jit(fn), operands), operands)

        if args.no_comm:
            with transfers_left_out():  # compiled in here, where the ring is traced
                ring_programs("no_comm", lambda fn, operands: fn.lower(*operands).compile())
        if args.compiler_option:
            options = dict(o.split("=", 1) for o in args.compiler_option)
            ring_programs("options", lambda fn, operands: fn.lower(*operands).compile(options))
        if args.pgle:
            ring_programs("pgle", profile_guided)
        if args.hlo and jax.process_index() == 0:
            out_dir = Path(args.out)
            out_dir.mkdir(parents=True, exist_ok=True)
            mask = "causal" if causal else "full"
            programs = {
                "fwd": ring_fwd.lower(q, k, v).compile(),
                "fwd_bwd": ring_both.lower(q, k, v, do).compile(),
            }
            if args.no_comm:
                programs["fwd_no_comm"] = calls["ring_fwd_ms_no_comm"][0]
            if args.pgle:
                programs["fwd_pgle"] = calls["ring_fwd_ms_pgle"][0]
                programs["fwd_bwd_pgle"] = calls["ring_fwd_bwd_ms_pgle"][0]
            for part, compiled in programs.items():
                (out_dir / f"ring_{part}_hlo_{seq}_{mask}.txt").write_text(compiled.as_text())
        timings = interleaved_medians(calls, args.iters, args.rounds)
        timelines = {}
        if args.timeline:
            for name in sorted(n for n in calls if n.startswith("ring_fwd")):
                timelines[name] = timeline(*calls[name])
        # Every process's own readings: a ring runs at its slowest device's pace.
        names = sorted(timings)
        mine_ms = np.array([timings[name] for name in names])
        every = np.asarray(multihost_utils.process_allgather(mine_ms)).reshape(-1, len(names))
        per_process = {name: every[:, i].tolist() for i, name in enumerate(names)}
    row: dict[str, Any] = {
        "seq": seq,
        "seq_local": seq_local,
        "devices": n,
        "batch": b,
        "heads": h,
        "kv_heads": kv_heads,
        "dim": d,
        "causal": causal,
        "layout": layout,
        "cfg": repr(cfg),
        "ring_platform": args.platform,  # auto: the ring chose cfg itself
        "rel_err": errors,
        **timings,
        "ms_by_process": per_process,
    }
    if timelines:
        row["timeline"] = timelines
    for part, backward in (("fwd", False), ("fwd_bwd", True)):
        ring_tf = flops(b, h, seq, d, causal, backward) / (row[f"ring_{part}_ms"] * 1e-3) / 1e12
        single_tf = flops(b, h, seq_local, d, causal, backward) / (row[f"single_{part}_ms"] * 1e-3)
        row[f"ring_{part}_tflops_per_gpu"] = ring_tf / n
        row[f"single_{part}_tflops"] = single_tf / 1e12
        row[f"ratio_{part}"] = row[f"ring_{part}_tflops_per_gpu"] / row[f"single_{part}_tflops"]
    return row


def report(
    args: argparse.Namespace, rows: list[dict[str, Any]], n: int, agreed: dict[str, Any]
) -> None:
    info = device_info()
    print(f"\nring attention over {n} x {info.get('device_kind')} ({info.get('nvidia_smi', '')})")
    header = (
        "| seq (per GPU) | mask | max rel err | fwd TFLOP/s/GPU ring / single (ratio) "
        "| fwd+bwd ring / single (ratio) | ring comm alone ms / ring fwd ms |"
    )
    print(header)
    print("|" + "---|" * 6)
    for r in rows:
        mask = f"causal ({r['layout']})" if r["causal"] else "none"
        err = max(r["rel_err"].values())
        print(
            f"| {r['seq']} ({r['seq_local']}) | {mask} | {err:.1e} "
            f"| {r['ring_fwd_tflops_per_gpu']:.0f} / {r['single_fwd_tflops']:.0f} "
            f"({r['ratio_fwd']:.2f}) "
            f"| {r['ring_fwd_bwd_tflops_per_gpu']:.0f} / {r['single_fwd_bwd_tflops']:.0f} "
            f"({r['ratio_fwd_bwd']:.2f}) "
            f"| {r['ring_comm_ms']:.2f} / {r['ring_fwd_ms']:.2f} |"
        )
    for r in rows:
        for name, readings in sorted(r["ms_by_process"].items()):
            print(f"{r['seq']} causal={r['causal']}: {name} by process "
                  + " / ".join(f"{ms:.2f}" for ms in readings))  # fmt: skip
        for part in ("fwd", "fwd_bwd"):
            if f"ring_{part}_ms_no_comm" in r:
                print(f"{r['seq']} causal={r['causal']}: ring {part} {r[f'ring_{part}_ms']:.2f} ms, "
                      f"without its transfers {r[f'ring_{part}_ms_no_comm']:.2f}, single GPU x "
                      f"{r['devices']} steps {r['devices'] * r[f'single_{part}_ms']:.2f}")  # fmt: skip
        for name, seen in sorted(r.get("timeline", {}).items()):
            for i, c in enumerate(seen["calls"]):
                print(f"{r['seq']} causal={r['causal']}: {name} call {i}: span {c['span_us']:.0f} "
                      f"us, local kernels {c['local_us']:.0f}, transfers {c['transfers_us']:.0f}, "
                      f"both at once {c['both_us']:.0f} ({c['kernels']} kernels)")  # fmt: skip
            for stream, kernel, start, length in seen["one_call"]:
                print(f"    {stream[:24]:24} {start:9.1f} {length:8.1f}  {kernel}")
        for part in ("fwd", "fwd_bwd"):
            if f"ring_{part}_ms_options" in r:
                print(f"{r['seq']} causal={r['causal']}: ring {part} {r[f'ring_{part}_ms']:.2f} ms, "
                      f"with {args.compiler_option} {r[f'ring_{part}_ms_options']:.2f}")  # fmt: skip
            if f"ring_{part}_ms_pgle" in r:
                print(f"{r['seq']} causal={r['causal']}: ring {part} {r[f'ring_{part}_ms']:.2f} ms, "
                      f"scheduled by its measured times {r[f'ring_{part}_ms_pgle']:.2f}")  # fmt: skip
        for key in sorted(k for k in r if "_spared" in k):
            print(f"{r['seq']} causal={r['causal']}: {key} {r[key]:.2f} "
                  f"(as the library runs it: {r[key.split('_spared')[0]]:.2f})")  # fmt: skip
    print(
        f"one config everywhere: processes remembered q blocks {agreed['remembered_q_blocks']}, "
        f"used {agreed['used_q_blocks']} inside jit ({'agreed' if agreed['one_config'] else 'DISAGREED'})"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind = str(info.get("device_kind", "device")).replace(" ", "_")
    settings = {k: v for k, v in vars(args).items() if k != "out"}  # not where it was written
    path = out / f"ring_attention_{n}x{kind}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    # What else shapes the transfers (NCCL's channels, XLA's collective flags) travels with them.
    environment = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "XLA_FLAGS"))}
    saved = {"device": info, "args": settings, "environment": environment, "rows": rows}
    path.write_text(json.dumps({**saved, "agreement": agreed}, indent=1))
    print(f"saved {path}")


def main() -> int:
    args = parse_args()
    if args.worker is None and not args.cpu_smoke and args.processes > 1:
        return launch(args)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
