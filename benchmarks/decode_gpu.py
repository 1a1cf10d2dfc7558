"""Attention with few queries against many keys (decoding from a key/value cache), on the GPU.

A decoding step asks for ``seq_q`` new positions (1, or a few for speculative decoding) against
the whole cache of ``seq_k`` keys, every key visible (causal: every key up to its own). The
arithmetic is small; the time is the cache's bytes read once from HBM, so each row's figure of
merit is its rate in GB/s of q, k, v and the output against the copy ceiling
(``../shared/GPU.md``); with more queries (a chunk of a prefill) it is TFLOP/s. For each shape this

1. checks the output of each ejkfn platform on its heuristic config, of ``platform="auto"``, of
   ``jax.nn.dot_product_attention``'s cuDNN and XLA paths, against a float32 reference;
2. times those within ``MAX_ERROR`` interleaved (the forward; with ``--backward`` the forward
   and the gradients, checked too: cross-attention trains on such shapes);
3. prints us, GB/s, TFLOP/s and the ratio to the fastest, and saves the rows under ``--out``.

    python3 benchmarks/decode_gpu.py [--shapes 1x1x32768x32x8x128,...] [--out DIR]
        [--sweep 64x4x3xm2,...] [--chunks 256x1024,...] [--skip xla/chunked,...] [--backward]
        [--dtype float32] [--feature bias|dropout|soft_cap|window[N]]

A shape is ``BATCHxSEQ_QxSEQ_KxHEADSxKV_HEADSxHEAD_DIM``, with a ``c`` after it for causal calls
(the queries are the cache's last positions: speculative decoding, a chunk of a prefill); there
``jax.nn``'s rows get that mask explicitly (its ``is_causal`` aligns the queries with the first
keys).

``--dtype`` sets q, k and v's dtype (and a bias's); ``--feature`` adds a bias (``[1, H, Sq, Sk]``,
one a head), dropout, a logits soft cap or a sliding window (``window``: a quarter of the keys on
either side of each query, ``windowN``: ``N``; the queries sit at the cache's last positions) to
every call (features_gpu.py's); the reference is then the dense float32 one with that feature,
and ``jax.nn``'s rows are left out where it has no such feature.
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
from attention import check_then_time, rel_err, save_rows
from features_gpu import DTYPES, feature_spec, jitted, static_options, window_keys

import ejkfn
from ejkfn import BwdParams, FwdParams
from ejkfn.attention import AttentionConfig, AttentionShape, AttentionSpec, registered_backends
from ejkfn.attention._reference import reference_attention

SHAPES = (
    "1x1x32768x32x8x128,8x1x8192x32x8x128,64x1x4096x32x8x128,"
    "1x1x131072x32x8x128,4x16x16384x32x8x128,16x1x8192x32x32x128,8x1x8192x16x16x64"
)
MAX_ERROR = 2e-2
# Features a decoding call can carry here: each needs at most a [1, H, Sq, Sk] bias or a seed
# (a window, "window" or "windowN", needs neither).
FEATURES = ("none", "bias", "dropout", "soft_cap", "window")


def decode_feature(text: str) -> str:
    """``--feature``'s value, checked: one of ``FEATURES`` or ``windowN``."""
    if text in FEATURES or window_keys(text, 0) is not None:
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not one of {FEATURES} or windowN (N keys)")


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    batch: int
    seq_q: int
    seq_k: int
    heads: int
    kv_heads: int
    dim: int
    causal: bool = False
    dtype: str = "bfloat16"
    feature: str = "none"

    @classmethod
    def parse(cls, text: str) -> DecodeCase:
        causal = text.endswith("c")
        try:
            b, sq, sk, h, kvh, d = (int(x) for x in text.removesuffix("c").split("x"))
        except ValueError:
            raise ValueError(f"shape {text!r} is not BxSQxSKxHxKVHxD[c]") from None
        return cls(b, sq, sk, h, kvh, d, causal)

    @property
    def name(self) -> str:
        gqa = f"({self.kv_heads} kv)" if self.kv_heads != self.heads else ""
        causal = " causal" if self.causal else ""
        dtype = "" if self.dtype == "bfloat16" else f" {self.dtype}"
        feature = "" if self.feature == "none" else f" {self.feature}"
        shape = f"{self.batch}x{self.seq_q}:{self.seq_k}x{self.heads}{gqa}x{self.dim}"
        return f"{shape}{causal}{dtype}{feature}"

    @property
    def spec(self) -> AttentionSpec:
        base = AttentionSpec(scale=self.dim**-0.5, causal=self.causal)
        return feature_spec(base, self.feature, self.seq_k)

    def flops(self, backward: bool) -> float:
        """4 x B x H x (visible pairs) x D forward, 3.5 times that forward and backward."""
        hidden = self.seq_q * (self.seq_q - 1) // 2 if self.causal else 0  # keys past a query
        forward = 4.0 * self.batch * self.heads * (self.seq_q * self.seq_k - hidden) * self.dim
        return 3.5 * forward if backward else forward

    def mask(self) -> jax.Array | None:
        """The causal mask with the queries at the last positions, ``[1, 1, Sq, Sk]``; None if
        not causal."""
        if not self.causal:
            return None
        rows = jnp.arange(self.seq_q)[:, None] + (self.seq_k - self.seq_q)
        return (jnp.arange(self.seq_k)[None, :] <= rows)[None, None]

    def bytes(self) -> float:
        """q and out once each, k and v once each: the least any kernel reads and writes (a
        bias's bytes not counted)."""
        rows = self.batch * (2 * self.seq_q * self.heads + 2 * self.seq_k * self.kv_heads)
        return float(rows * self.dim * jnp.dtype(self.dtype).itemsize)

    def inputs(self, seed: int, backward: bool = False) -> tuple[jax.Array, ...]:
        """q, k, v (and with ``backward`` the output's cotangent) in ``dtype``."""
        kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
        q_shape = (self.batch, self.seq_q, self.heads, self.dim)
        kv_shape = (self.batch, self.seq_k, self.kv_heads, self.dim)
        out = tuple(
            jax.random.normal(key, shape, self.dtype)
            for key, shape in ((kq, q_shape), (kk, kv_shape), (kv, kv_shape))
        )
        return (*out, jax.random.normal(kd, q_shape, self.dtype)) if backward else out

    def arrays(self) -> dict[str, jax.Array]:
        """The arrays the feature adds to a call, as ``flash_attention``'s keyword arguments: a
        bias different for each head, or dropout's seed."""
        if self.feature == "bias":
            shape = (1, self.heads, self.seq_q, self.seq_k)
            return dict(bias=jax.random.normal(jax.random.key(5), shape, self.dtype))
        if self.feature == "dropout":
            return dict(dropout_seed=jnp.uint32(5))
        return {}


def sweep_params(base: FwdParams, text: str) -> FwdParams:
    """``"[Qx]BKxWxSxN"``: ``base`` (a heuristic's forward) with q_blocksize ``Q`` (if given),
    kv_blocksize ``BK``, ``W`` warps, ``S`` stages and ``N`` key splits, ``N`` either a count or
    ``mF``, ``F`` times ``base``'s."""
    try:
        fields = text.split("x")
        bq = int(fields.pop(0)) if len(fields) == 5 else base.q_blocksize
        bk, warps, stages, splits = fields
        n = (
            max(1, round(base.kv_splits * float(splits[1:])))
            if splits.startswith("m")
            else int(splits)
        )
        return dataclasses.replace(
            base, q_blocksize=bq, kv_blocksize=int(bk), num_warps=int(warps),
            num_stages=int(stages), kv_splits=n,
        )  # fmt: skip
    except ValueError:
        raise ValueError(f"sweep item {text!r} is not [Qx]BKxWxSxN (N a count or mF)") from None


def chunk_params(text: str) -> tuple[FwdParams, BwdParams]:
    """``"QxK"``: XLA's chunked variant on ``Q``-query by ``K``-key tiles, forward and backward."""
    try:
        bq, bk = (int(f) for f in text.split("x"))
    except ValueError:
        raise ValueError(f"chunks item {text!r} is not QxK") from None
    return (
        FwdParams(q_blocksize=bq, kv_blocksize=bk),
        BwdParams(q_blocksize=bq, kv_blocksize=bk),
    )


def impls(
    case: DecodeCase,
    sweep: tuple[str, ...] = (),
    skip: frozenset[str] = frozenset(),
    chunks: tuple[str, ...] = (),
) -> dict[str, Callable[..., jax.Array]]:
    """name -> ``(q, k, v, **case.arrays()) -> out``: every native ejkfn backend that takes the
    case's feature on its heuristic config (the Triton forward also with each of ``sweep``'s
    changes, :func:`sweep_params`; XLA's chunked variant also on each of ``chunks``' tiles,
    :func:`chunk_params`), ``auto``, and ``jax.nn.dot_product_attention``'s cuDNN and XLA
    paths (GQA by its own broadcast) where it has the feature; none whose name ends with one in
    ``skip``."""
    q, k, _ = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in case.inputs(0))
    spec = case.spec
    shape = AttentionShape.of(q, k, spec)
    options = static_options(spec)
    kind = ejkfn.device_kind()
    out: dict[str, Callable[..., jax.Array]] = {}
    for backend in registered_backends():
        if kind not in backend.devices or not backend.available():
            continue
        if spec.features & backend.unsupported:
            continue
        try:
            fp, bp = backend.heuristic(shape)
        except NotImplementedError:
            continue
        name = f"ejkfn {backend.platform}/{backend.variant}"
        cfgs = {name: (fp, bp)}
        if backend.splits_keys:
            cfgs |= {f"{name} {item}": (sweep_params(fp, item), bp) for item in sweep}
        if (backend.platform, backend.variant) == ("xla", "chunked"):
            cfgs |= {f"{name} {item}": chunk_params(item) for item in chunks}
        for label, (fwd, bwd) in cfgs.items():
            cfg = AttentionConfig(
                platform=backend.platform, variant=backend.variant, fwd=fwd, bwd=bwd
            )
            out[label] = lambda q, k, v, cfg=cfg, **arrays: ejkfn.flash_attention(
                q, k, v, **arrays, **options, cfg=cfg
            )
    out["ejkfn auto"] = lambda q, k, v, **arrays: ejkfn.flash_attention(
        q, k, v, **arrays, **options
    )
    mask = case.mask()
    for implementation in ("cudnn", "xla") if case.feature in ("none", "bias") else ():
        out[f"jax.nn {implementation}"] = lambda q, k, v, implementation=implementation, **arrays: (
            jax.nn.dot_product_attention(
                q, k, v, **arrays, mask=mask, implementation=implementation
            )
        )
    return {n: fn for n, fn in out.items() if not any(n.endswith(x) for x in skip)}


def reference(case: DecodeCase) -> Callable[..., jax.Array]:
    """``(q, k, v, **case.arrays()) -> out``: the dense float32 attention of ``case``'s call, its
    products in full precision (by default a GPU multiplies float32 in TF32: 4e-4 off)."""

    def run(q, k, v, bias=None, dropout_seed=None):
        with jax.default_matmul_precision("highest"):
            return reference_attention(q, k, v, bias, seed=dropout_seed, spec=case.spec)[0]

    return run


REFERENCE = "float32 reference"


def measure(
    case: DecodeCase,
    calls: int,
    rounds: int,
    sweep: tuple[str, ...] = (),
    skip: frozenset[str] = frozenset(),
    backward: bool = False,
    chunks: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Rows of every implementation at ``case``: forward, or with ``backward`` the output and
    the three gradients (cross-attention trains on such shapes), each checked against the float32
    reference's."""
    sets = [case.inputs(seed, backward) for seed in (0, 1)]
    arrays = case.arrays()  # arguments of each program, not constants (features_gpu.jitted)
    fns = {n: jitted(fn, arrays, backward) for n, fn in impls(case, sweep, skip, chunks).items()}
    if backward:
        # The reference is the baseline: each gradient is compared with its own (it runs first,
        # outside check_then_time's guard, and never raises); its row is dropped below.
        fns = {REFERENCE: jitted(reference(case), arrays, backward), **fns}
        first, error = REFERENCE, rel_err
    else:
        want = jitted(reference(case), arrays, backward)(*sets[0])
        # check_then_time runs this one first, outside its guard: auto, which takes any call.
        # Each output is compared with the reference, not with this one's.
        first = "ejkfn auto" if "ejkfn auto" in fns else next(iter(fns))
        error = lambda got, _: rel_err(got, want)
    rows = check_then_time(
        case, backward, fns, first, sets, calls, rounds, warmup=2, error=error,
        max_error=MAX_ERROR,
    )  # fmt: skip
    rows = [r for r in rows if r["impl"] != REFERENCE]
    fastest = min((r["ms"] for r in rows if "ms" in r), default=float("nan"))
    for r in rows:
        r["error"] = r.pop(f"max_rel_err_vs_{first}", r.get("error"))
        r.pop(f"vs_{first}", None)
        if "ms" in r:
            r["gb_per_s"] = case.bytes() / r["ms"] / 1e6
            r["vs_fastest"] = fastest / r["ms"]
    return rows


def line(r: dict[str, Any]) -> str:
    if "ms" not in r:
        return f"| {r['case']} | {r['impl']} | not timed: {str(r.get('error'))[:120]} | | | |"
    return (
        f"| {r['case']} | {r['impl']} | {r['ms'] * 1e3:.1f} | {r['gb_per_s']:.0f} |"
        f" {r['tflops']:.0f} | {r['vs_fastest']:.3f} | {r['error']:.1e} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument(
        "--sweep",
        default="",
        help="Triton forwards to add, comma-separated [Qx]BKxWxSxN (N: splits)",
    )
    parser.add_argument(
        "--chunks", default="", help="XLA chunked tiles to add, comma-separated QxK"
    )
    parser.add_argument("--skip", default="", help="rows to leave out, comma-separated names")
    parser.add_argument(
        "--backward", action="store_true", help="time forward and backward (cross-attention)"
    )
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--feature", type=decode_feature, default="none")
    args = parser.parse_args()
    try:
        cases = [
            dataclasses.replace(DecodeCase.parse(s), dtype=args.dtype, feature=args.feature)
            for s in args.shapes.split(",")
        ]
    except ValueError as exc:
        parser.error(f"--shapes: {exc}")
    sweep = tuple(filter(None, args.sweep.split(",")))
    for item in sweep:
        try:
            sweep_params(FwdParams(), item)
        except ValueError as exc:
            parser.error(f"--sweep: {exc}")
    chunks = tuple(filter(None, args.chunks.split(",")))
    for item in chunks:
        try:
            chunk_params(item)
        except ValueError as exc:
            parser.error(f"--chunks: {exc}")
    skip = frozenset(filter(None, args.skip.split(",")))
    rows: list[dict[str, Any]] = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    print(
        "| case | impl | us | GB/s | TFLOP/s | vs fastest | error |\n|---|---|---|---|---|---|---|"
    )
    for case in cases:
        done = measure(case, args.calls, args.rounds, sweep, skip, args.backward, chunks)
        print("\n".join(line(r) for r in done), flush=True)
        rows += done
        if args.out:
            save_rows(args.out, "decode", rows, stamp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
