"""Tune flash attention for common shapes on this GPU, and install the configs ejkfn ships.

Tuning (on the GPU): for each shape, bf16, causal and not, it records the invocation that
``ejkfn.flash_attention(q, k, v, causal=...)`` makes (platform ``"auto"``), times a pruned candidate set
forward and backward (each native backend's heuristic config, one candidate of each of its other
backward kernels, and up to ``--per-backend`` others drawn from its candidates; those within 3% of the
fastest timed again with twice the calls), and stores
the fastest (one running a cuDNN kernel only where it leads our own kernels by more than
``OWN_KERNELS_MARGIN``, 3%, below ``HYBRID_SCORES`` scores) under the invocation's portable key
(:attr:`ejkfn.Invocation.portable_key`: device model, shapes and kernel version, not driver or library
versions) in the cache folder ``--out``/``shipped_<device>``, with every candidate's time beside it.
It then times each distinct forward of the candidates alone; where another one's forward is the
fastest by more than ``INFERENCE_MARGIN`` (1%), the stored config carries it as its ``inference``
config (calls that nothing differentiates run it).

Installing (anywhere): ``--install FOLDER...`` merges such folders into ``ejkfn/_shipped``, the read-only
layer every user's selection consults after their own caches.

Usage: ``python benchmarks/tune_shipped.py [--out DIR]`` then
``python benchmarks/tune_shipped.py --install DIR/shipped_NVIDIA_H200 ...``.
Where the rules below change, ``--reselect LOG...`` applies them to saved tunes' times.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import random
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from attention import MASKS, MIN_BATCH_MS, parse_shapes

import ejkfn
from ejkfn import BwdParams, FwdParams
from ejkfn.attention import AttentionConfig, AttentionShape, AttentionSpec, registered_backends
from ejkfn.attention._backend import CUDNN_BWD

SHAPES = [  # (batch, seq, heads, kv_heads, dim): the benchmark's shapes and common training ones
    (4, 2048, 16, 16, 128),
    (4, 4096, 16, 16, 128),
    (2, 8192, 16, 16, 128),
    (2, 16384, 16, 16, 128),
    (1, 32768, 16, 16, 128),
    (8, 2048, 32, 32, 64),
    (2, 8192, 32, 32, 64),
    (2, 8192, 32, 8, 128),
    (2, 4096, 32, 8, 128),
]
PACKAGE_LAYER = Path(__file__).resolve().parents[1] / "ejkfn" / "_shipped"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--per-backend", type=int, default=5, help="candidates besides the heuristic")
    p.add_argument("--shapes", default=None, help="BxSxHxD[xKVH],... (default: the built-in list)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds the timed calls split into"
    )
    p.add_argument(
        "--backends",
        default=None,
        help="PLATFORM/VARIANT,... whose candidates to time (default: every native backend); "
        "e.g. cudnn/cudnn,pallas/mosaic where the portable kernels are far behind",
    )
    p.add_argument(
        "--masks",
        choices=tuple(MASKS),
        default="both",
        help="which of each shape's calls to tune: only not causal, only causal, or both",
    )
    p.add_argument(
        "--install", nargs="+", default=None, help="cache folders to merge into the package"
    )
    p.add_argument(
        "--reselect",
        nargs="+",
        default=None,
        help="saved tune logs (tune_shipped_*.json): where the package ships a log's pick, choose "
        "again from its timed candidates by this script's rules and ship that (no GPU)",
    )
    return p.parse_args()


def chosen_backends(text: str | None) -> set[str] | None:
    """``--backends``' names (``platform/variant``), each checked against the registered ones."""
    if text is None:
        return None
    known = {f"{b.platform}/{b.variant}" for b in registered_backends()}
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = sorted(names - known)
    if unknown or not names:
        raise SystemExit(f"--backends {text!r}: unknown {unknown}; registered: {sorted(known)}")
    return names


def other_backward_kernels(
    heuristic: tuple[FwdParams, BwdParams], others: list[tuple[FwdParams, BwdParams]]
) -> list[tuple[FwdParams, BwdParams]]:
    """The first of ``others`` with each backward kernel (``BwdParams.variant``) the heuristic does
    not use, behind the heuristic's forward: a random draw can miss a whole kernel."""
    kinds = {heuristic[1].variant}
    firsts = []
    for fwd, bwd in others:
        if fwd == heuristic[0] and bwd.variant not in kinds:
            kinds.add(bwd.variant)
            firsts.append((fwd, bwd))
    return firsts


def pruned_candidates(
    shape: AttentionShape, per_backend: int, backends: set[str] | None = None
) -> list[AttentionConfig]:
    """Each native backend's heuristic config, one candidate of each of its other backward kernels,
    then a fixed random draw of its other candidates; only the ``backends`` named
    (``platform/variant``) where given."""
    rng = random.Random(0)
    kind = ejkfn.device_kind()
    cfgs: list[AttentionConfig] = []
    for backend in registered_backends():
        if backends is not None and f"{backend.platform}/{backend.variant}" not in backends:
            continue
        if kind not in backend.devices or not backend.available():
            continue
        if shape.spec.features & backend.unsupported or backend.variant == "dense":
            continue
        try:
            heuristic = backend.heuristic(shape)
            others = [p for p in backend.candidates(shape) if p != heuristic]
        except NotImplementedError:
            continue
        firsts = other_backward_kernels(heuristic, others)
        rest = [p for p in others if p not in firsts]
        draw = firsts + rng.sample(rest, min(per_backend, len(rest)))
        if backend.platform == "xla":
            draw = []  # the chunked XLA path is a fallback, never near the fused kernels on a GPU
        for fwd, bwd in [heuristic, *draw]:
            cfgs.append(
                AttentionConfig(
                    platform=backend.platform, variant=backend.variant, fwd=fwd, bwd=bwd
                )
            )
    return cfgs


# A forward that beats the training config's own by more than this ships as the inference config.
# Switching forwards costs nothing at run time, so the margin only keeps coin flips out. At 3% it
# kept cuDNN's forward at long shapes where tunes read the Mosaic forward 1.4-2.9% ahead and the
# side-by-side runs 3-6% ahead, which left `auto` 4-6% behind (benchmarks/NOTES.md, twenty-second
# round).
INFERENCE_MARGIN = 0.01
# Candidates within this of the fastest are timed again with twice the calls: cuDNN and the Mosaic
# pair were within 1% of each other at several shapes, where one tune's pick read 2-4% behind in the
# next table (benchmarks/NOTES.md, fourteenth round).
RUNOFF = 0.03
# Batches as long as the table's (attention.MIN_BATCH_MS). With 10 ms batches and one settling
# call, the eighteenth round's tune had cuDNN 4-6% ahead of the Mosaic pair at 4x4096 and 2x8192;
# the two tables after it read cuDNN between 2% ahead and 5% behind. With 20 ms batches one program
# read up to 5% apart, with 300 ms within 0.7% (benchmarks/NOTES.md, thirty-fourth round). Before
# each batch the Tuner settles by its default: 0.2 s on a GPU, as the table has since the
# twenty-fourth round.
BATCH_SECONDS = MIN_BATCH_MS / 1e3
# A config that runs one of cuDNN's kernels (its platform, or its backward kernel on the Mosaic
# forward's residuals) ships only where it beats the fastest config of our own kernels by more than
# this. A smaller lead is within the tuner's resolution: at 4x4096x16x128 causal on an H200 a tune
# put cuDNN's backward kernel 1.8% ahead of the fused one, and three side-by-side runs read it 3-5%
# behind (benchmarks/NOTES.md, thirty-third round).
OWN_KERNELS_MARGIN = 0.03


def with_inference(
    train: AttentionConfig,
    forward_seconds: Sequence[tuple[AttentionConfig, float]],
    margin: float = INFERENCE_MARGIN,
) -> AttentionConfig:
    """``train`` (fastest forward and backward), carrying the fastest forward alone as its inference
    config where that runs another backend or other forward blocks and beats ``train``'s own forward
    by more than ``margin``: a smaller lead is within the timing noise, and would only flip a coin."""
    if not forward_seconds:
        return train
    forward, fastest = min(forward_seconds, key=lambda pair: pair[1])
    own = next((t for cfg, t in forward_seconds if forward_of(cfg) == forward_of(train)), None)
    if forward_of(forward) == forward_of(train) or (
        own is not None and own <= fastest * (1 + margin)
    ):
        return train
    return dataclasses.replace(train, inference=forward)


def runs_cudnn(cfg: AttentionConfig) -> bool:
    """Whether ``cfg`` runs one of cuDNN's kernels, forward or backward."""
    return cfg.platform == "cudnn" or (cfg.bwd is not None and cfg.bwd.variant == CUDNN_BWD)


# From this many scores (batch x kv heads x seq_q x seq_k) at head dims over 64, a tune ships its
# fastest config with no margin for our own kernels: there cuDNN's backward kernel behind the Mosaic
# forward led the fused pair in side-by-side runs on an H200 (1.4-1.7% at 2x16384x16x128, where the
# margin had shipped the fused pair; 0.9% at 1x32768x16x128), as the tunes had read it
# (benchmarks/NOTES.md, seventy-eighth round). Below it, side-by-side runs read our pair ahead where
# tunes put that hybrid 2-4% ahead (4x4096x16x128 causal), which is what the margin is for.
HYBRID_SCORES = 2**33


def own_kernels_margin(shape_name: str) -> float:
    """The lead a config with a cuDNN kernel needs to ship at ``shape_name`` (as :func:`tune` names
    shapes: ``BxSxH/KVHxD[ causal]``): :data:`OWN_KERNELS_MARGIN`, or none from
    :data:`HYBRID_SCORES` scores at head dims over 64."""
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)/(\d+)x(\d+)( causal)?", shape_name)
    if match is None:
        raise ValueError(f"shape name {shape_name!r} is not BxSxH/KVHxD[ causal]")
    batch, seq, _, kv_heads, dim = (int(n) for n in match.groups()[:5])
    if dim > 64 and batch * kv_heads * seq * seq >= HYBRID_SCORES:
        return 0.0
    return OWN_KERNELS_MARGIN


def preferring_own(
    seconds: Sequence[tuple[AttentionConfig, float]], margin: float = OWN_KERNELS_MARGIN
) -> AttentionConfig:
    """The fastest of ``seconds`` (each config's forward+backward time), unless it runs a cuDNN
    kernel and the fastest config of our own kernels is within ``margin`` of it: then that one."""
    if not seconds:
        raise ValueError("no timed configs to choose from")
    fastest, best = min(seconds, key=lambda pair: pair[1])
    ours = [(cfg, t) for cfg, t in seconds if not runs_cudnn(cfg)]
    if not runs_cudnn(fastest) or not ours:
        return fastest
    own, own_seconds = min(ours, key=lambda pair: pair[1])
    return own if own_seconds <= best * (1 + margin) else fastest


def shipped_choice(
    seconds: Sequence[tuple[AttentionConfig, float]],
    forward_seconds: Sequence[tuple[AttentionConfig, float]],
    margin: float = OWN_KERNELS_MARGIN,
) -> AttentionConfig:
    """What a tune ships from its times: :func:`preferring_own` of the forward+backward times
    (``margin``: :func:`own_kernels_margin`), carrying the fastest forward as its inference config
    where :func:`with_inference` says."""
    return with_inference(preferring_own(seconds, margin), forward_seconds)


def forward_of(cfg: AttentionConfig) -> tuple[Any, ...]:
    """What decides the forward a config runs (its backward's blocks do not)."""
    return cfg.platform, cfg.variant, cfg.fwd


def distinct_forwards(cfgs: Sequence[AttentionConfig]) -> list[AttentionConfig]:
    """The first of ``cfgs`` for each forward they run. Configs that differ only in their backward
    run one forward; timed once for each of them, its copies read up to 4% apart in one tune
    (benchmarks/NOTES.md, twenty-second round)."""
    first: dict[tuple[Any, ...], AttentionConfig] = {}
    for cfg in cfgs:
        first.setdefault(forward_of(cfg), cfg)
    return list(first.values())


def tune(args: argparse.Namespace) -> None:
    kind = str(jax.devices()[0].device_kind)
    folder = Path(args.out) / f"shipped_{kind.replace(' ', '_')}"
    store = ejkfn.PersistentCache(folder)
    tuner = ejkfn.Tuner(
        warmup=2,
        iters=args.iters,
        rounds=args.rounds,
        progress=False,
        runoff=RUNOFF,
        min_batch_seconds=BATCH_SECONDS,
    )
    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    backends = chosen_backends(args.backends)
    log: list[dict[str, Any]] = []
    for batch, seq, heads, kv_heads, dim in shapes:
        for causal in MASKS[args.masks]:
            q = jnp.zeros((batch, seq, heads, dim), jnp.bfloat16)
            k = jnp.zeros((batch, seq, kv_heads, dim), jnp.bfloat16)
            (inv,) = ejkfn.record(
                lambda q, k, v, causal=causal: ejkfn.flash_attention(q, k, v, causal=causal),
                q,
                k,
                k,
            )
            spec = AttentionSpec(scale=dim**-0.5, causal=causal)
            cfgs = pruned_candidates(AttentionShape.of(q, k, spec), args.per_backend, backends)
            start = time.perf_counter()
            report = tuner.tune(inv, cfgs, validate_backward=True)
            name = f"{batch}x{seq}x{heads}/{kv_heads}x{dim}{' causal' if causal else ''}"
            print(f"\n{name}: {len(cfgs)} candidates, {time.perf_counter() - start:.0f} s")
            print(report.table())
            if report.best is None:
                continue
            times = {repr(r.cfg): r.seconds for r in report.results if r.ok}
            forward = tuner.tune(inv, distinct_forwards(cfgs), validate_backward=False)
            print(forward.table())
            forward_times = {repr(r.cfg): r.seconds for r in forward.results if r.ok}
            best = shipped_choice(
                [(r.cfg, r.seconds) for r in report.results if r.ok],
                [(r.cfg, r.seconds) for r in forward.results if r.ok],
                own_kernels_margin(name),
            )
            meta = {
                "shape": name,
                "device_kind": kind,
                "tuned_fwd_bwd_ms": min(times.values()) * 1e3,
                "tuned_fwd_ms": min(forward_times.values(), default=float("nan")) * 1e3,
            }
            store = store.put(inv.portable_key, best, meta=meta)
            log.append(
                {"shape": name, "best": repr(best), "seconds": times, "fwd_seconds": forward_times}
            )
            # After every shape: a run cut off by its time limit keeps what it tuned.
            store = store.save()
            (folder / ".lock").unlink(missing_ok=True)
            Path(args.out, f"tune_shipped_{kind.replace(' ', '_')}.json").write_text(
                json.dumps(
                    {"device": kind, "versions": dict(ejkfn.software_versions()), "log": log},
                    indent=1,
                )
            )
    print(f"\n{len(store)} configs in {folder.name} (under --out)")


def install(folders: list[str]) -> None:
    layer = ejkfn.PersistentCache(PACKAGE_LAYER)
    for folder in folders:
        source = ejkfn.PersistentCache(folder, readonly=True)
        for key in source.keys():
            layer = layer.put(key, source.get(key), meta=source.record(key).get("meta"))
        print(f"{len(source)} configs from {folder}")
    layer.save()
    (PACKAGE_LAYER / ".lock").unlink(missing_ok=True)
    print(f"{len(layer)} configs in {PACKAGE_LAYER.name}")


def config_of(text: str) -> AttentionConfig:
    """The config a tune log names by its repr (only these constructors and literals are read)."""
    constructors = {
        "AttentionConfig": AttentionConfig,
        "FwdParams": FwdParams,
        "BwdParams": BwdParams,
    }

    def build(node: ast.expr) -> Any:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id not in constructors or node.args:
                raise ValueError(f"not a config: {text!r}")
            return constructors[node.func.id](**{kw.arg: build(kw.value) for kw in node.keywords})
        return ast.literal_eval(node)

    cfg = build(ast.parse(text, mode="eval").body)
    if not isinstance(cfg, AttentionConfig):
        raise ValueError(f"not an AttentionConfig: {text!r}")
    return cfg


def chosen_from_log(entry: dict[str, Any], margin: float = OWN_KERNELS_MARGIN) -> AttentionConfig:
    """The config :func:`tune` would ship from a log entry's times (``seconds``, ``fwd_seconds``),
    ``margin`` being :func:`own_kernels_margin` of its shape."""
    seconds = [(config_of(text), t) for text, t in entry["seconds"].items()]
    forwards = [(config_of(text), t) for text, t in entry.get("fwd_seconds", {}).items()]
    return shipped_choice(seconds, forwards, margin)


def reselect(logs: list[str], folder: Path = PACKAGE_LAYER) -> None:
    """Ship :func:`chosen_from_log` for each entry of ``logs`` from the tune that made the shipped
    config: the one whose fastest time its ``meta`` records (a later tune of the shape replaced the
    others' picks; a reselection keeps the meta). ``folder``: the cache folder to rewrite."""
    layer = ejkfn.PersistentCache(folder)
    shipped_by_shape = {}  # (device, shape) -> (key, meta); a reselection keeps both
    for key in layer.keys():
        meta = (layer.record(key) or {}).get("meta") or {}
        shipped_by_shape[meta.get("device_kind"), meta.get("shape")] = key, meta
    for path in logs:
        saved = json.loads(Path(path).read_text())
        for entry in saved["log"]:
            if (saved["device"], entry["shape"]) not in shipped_by_shape:
                raise SystemExit(
                    f"{path}: no shipped config for {saved['device']} {entry['shape']}"
                )
            key, meta = shipped_by_shape[saved["device"], entry["shape"]]
            if meta.get("tuned_fwd_bwd_ms") != min(entry["seconds"].values()) * 1e3:
                continue  # not the tune whose pick ships
            margin = own_kernels_margin(entry["shape"])
            chosen, shipped = chosen_from_log(entry, margin), layer.get(key)
            if chosen != shipped:
                print(f"{saved['device']} {entry['shape']}:\n  {shipped!r}\n  -> {chosen!r}")
                layer = layer.put(key, chosen, meta=meta)
    layer.save()
    (folder / ".lock").unlink(missing_ok=True)


def main() -> int:
    args = parse_args()
    if args.install:
        install(args.install)
    elif args.reselect:
        reselect(args.reselect)
    else:
        tune(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
