"""Which small tiles of the Triton attention kernels compute wrong outputs on a GPU, and why.

The fifty-fifth round (benchmarks/NOTES.md) found the dQ kernel wrong on an H200 at 2 and 16
queries of 8192 keys with a window, a bias, a mask and dropout together. This script checks the
Triton kernels against the float32 reference over the tile's warps, stages and sizes, the features
three at a time, the forward's tiles, Pallas-Triton's, and a copy of the kernels whose dropout
hashes pairs of keys at every width (``pair_hash_kernels``: the build that was wrong), so that the
fault's extent is measured rather than guessed. ``--fence`` also runs the faulty launch with an
async-proxy fence added to the dQ kernel's loops (``xla_ptxas/ptxas``'s ``EJKFN_ADD_FENCES``, in a
child process). Run on the lent GPU:

    python3 benchmarks/small_tiles_gpu.py [--out DIR] [--only TEXT] [--fence] [--small]

Prints one line per case (relative error ``max|got - want| / max|want|`` of the output, or of dQ,
dK and dV) and writes ``small_tiles.json`` to ``--out``. ``--small`` is a CPU dry run through the
interpreter.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from unittest import mock

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from check_triton_gpu import operands, rel  # noqa: E402

from ejkfn._registry import BwdParams, FwdParams  # noqa: E402
from ejkfn._triton_interpret import default_interpret  # noqa: E402
from ejkfn.attention import _pallas_gpu as pg  # noqa: E402
from ejkfn.attention import _triton as tri  # noqa: E402
from ejkfn.attention._backend import AttentionShape  # noqa: E402
from ejkfn.attention._reference import reference_attention  # noqa: E402
from ejkfn.attention._spec import AttentionSpec  # noqa: E402

FEATURES = {
    "window": dict(window=(1024, 0)),
    "bias": dict(has_bias=True),
    "mask": dict(has_mask=True),
    "dropout": dict(dropout_prob=0.1),
}
EVERY = tuple(FEATURES)
# Backward tiles (dQ rows, dQ key columns, warps, stages): the plain variant's dQ launch is
# (q_blocksize, kv_blocksize, num_warps, num_stages), its rows clamped to the queries' next power
# of two. Forward tiles (q rows, key columns, warps, stages) likewise.
TILES = [
    (16, 16, 8, 3),  # the faulty launch of stop 62
    (16, 16, 8, 2),
    (16, 16, 4, 3),
    (16, 16, 4, 2),
    (16, 16, 2, 3),
    (16, 32, 8, 3),
    (16, 64, 8, 3),
    (16, 64, 4, 2),  # what decoding calls train on since stop 62
    (32, 16, 8, 3),
    (64, 16, 8, 3),
]
FAULTY = TILES[0]


def pair_hash_kernels():
    """The Triton kernels with ``_keep_tile``'s pair hash at every block width (the
    fifty-fifth round's kernels, the faulty build) instead of a hash a score below 32 keys: a copy, loaded under its own name."""
    tri._kernels(default_interpret(None))  # Triton imported in the mode this machine runs
    source = open(importlib.util.find_spec(tri._KERNELS).origin).read()
    line = "_PAIR_HASH_MIN_KEYS = tl.constexpr(32)"
    assert line in source, "the pair hash's threshold moved; update this probe"
    source = source.replace(line, "_PAIR_HASH_MIN_KEYS = tl.constexpr(16)")
    path = os.path.join(tempfile.mkdtemp(), "_triton_kernels_pair_hash.py")
    with open(path, "w") as f:
        f.write(source)
    name = "ejkfn.attention._triton_kernels_pair_hash"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return name


def case(name, *, backend, what, seq_q, seq_k, features, tile, small):
    rows, cols, warps, stages = tile
    spec_kw = {}
    for f in features:
        spec_kw.update(FEATURES[f])
    spec = AttentionSpec(scale=128**-0.5, causal=True, **spec_kw)
    bias = (1, 8) if "bias" in features else None
    args, dout = operands(7, 2, seq_q, seq_k // small, 8, 8, 128, jnp.bfloat16, bias,
                          "mask" in features, False, spec.dropout_prob)  # fmt: skip
    q, k, v, b, m, qs, ks, seed = args
    mod = pg if backend == "pallas" else tri
    blocks = dict(q_blocksize=rows, kv_blocksize=cols, num_warps=warps, num_stages=stages)
    forward = (
        FwdParams(**blocks) if what == "fwd" else tri.heuristic(AttentionShape.of(q, k, spec))[0]
    )
    backward = BwdParams(**blocks)

    @jax.jit
    def run(q, k, v, b, dout):
        out, lse = mod.fwd(q, k, v, b, m, qs, ks, seed, spec=spec, params=forward)
        if what == "fwd":
            return (out,)
        return mod.bwd(q, k, v, b, m, qs, ks, seed, out, lse, dout, spec=spec, params=backward)[:3]

    @jax.jit
    def ref(q, k, v, b, dout):
        f = lambda q, k, v: reference_attention(q, k, v, b, m, qs, ks, seed, spec=spec)
        (o, lse), vjp = jax.vjp(f, q, k, v)
        if what == "fwd":
            return (o,)
        return vjp((dout.astype(jnp.float32), jnp.zeros_like(lse)))

    got = jax.block_until_ready(run(q, k, v, b, dout))
    want = ref(q, k, v, b, dout)
    names = ("out",) if what == "fwd" else ("dq", "dk", "dv")
    errs = {n: rel(g, w) for n, g, w in zip(names, got, want, strict=True)}
    ok = all(e <= 4e-2 for e in errs.values())  # NaN fails
    row = dict(name=name, backend=backend, what=what, seq_q=seq_q, seq_k=seq_k,
               features=list(features), tile=list(tile), ok=ok, **errs)  # fmt: skip
    cols_text = " ".join(f"{n}={e:.1e}" for n, e in errs.items())
    print(f"{'PASS' if ok else 'FAIL'} {name:<60} {cols_text}", flush=True)
    return row


def cases(fenced):
    """(name, keywords of ``case``) of every check; ``fenced``: only the faulty launch's."""
    seq_k = 8192
    plain = dict(backend="triton", what="bwd", seq_k=seq_k)
    if fenced:
        for seq_q in (2, 16, 128):
            yield f"q{seq_q} all four, dQ {FAULTY}", dict(plain, seq_q=seq_q, features=EVERY,
                                                           tile=FAULTY)  # fmt: skip
        return
    for seq_q in (2, 16):
        for tile in TILES:
            yield f"q{seq_q} all four, dQ {tile}", dict(plain, seq_q=seq_q, features=EVERY,
                                                         tile=tile)  # fmt: skip
    for left_out in EVERY:
        features = tuple(f for f in EVERY if f != left_out)
        yield f"q16 without {left_out}, dQ {FAULTY}", dict(plain, seq_q=16, features=features,
                                                            tile=FAULTY)  # fmt: skip
    yield f"q16 no feature, dQ {FAULTY}", dict(plain, seq_q=16, features=(), tile=FAULTY)
    for seq_q in (128, 2048):
        yield f"q{seq_q} all four, dQ {FAULTY}", dict(plain, seq_q=seq_q, features=EVERY,
                                                       tile=FAULTY)  # fmt: skip
        yield (
            f"q{seq_q} mask dropout, dQ (64, 16, 4, 2)",
            dict(plain, seq_q=seq_q, features=("mask", "dropout"), tile=(64, 16, 4, 2)),
        )
    for seq_q in (16, 128):
        for tile in ((16, 16, 4, 2), (64, 16, 4, 2), (16, 32, 4, 2)):
            yield f"forward q{seq_q} all four, {tile}", dict(plain, what="fwd", seq_q=seq_q,
                                                              features=EVERY, tile=tile)  # fmt: skip
    for seq_q in (16, 128):
        yield (
            f"pair hash q{seq_q} all four, dQ {FAULTY}",
            dict(plain, backend="pair-hash", seq_q=seq_q, features=EVERY, tile=FAULTY),
        )
        yield f"pair hash forward q{seq_q} all four, (16, 16, 4, 2)", dict(
            plain, backend="pair-hash", what="fwd", seq_q=seq_q, features=EVERY,
            tile=(16, 16, 4, 2),
        )  # fmt: skip
    for seq_q in (16, 128):
        yield (
            f"Pallas-Triton q{seq_q} all four, dQ (16, 16, 4, 2)",
            dict(plain, backend="pallas", seq_q=seq_q, features=EVERY, tile=(16, 16, 4, 2)),
        )
        yield (
            f"Pallas-Triton forward q{seq_q} all four, (16, 16, 4, 2)",
            dict(
                plain,
                backend="pallas",
                what="fwd",
                seq_q=seq_q,
                features=EVERY,
                tile=(16, 16, 4, 2),
            ),
        )


def tune_both_builds(small, pair_hash):
    """The tuner on the faulty tile and a right one, with the faulty build and with this one, at
    16 queries of 8192 keys with all four features, forward and backward timed: the faulty
    candidate must fail its output check. Also the tune's seconds without the check."""
    import ejkfn
    from ejkfn.attention import AttentionConfig, FlashAttention

    args, _ = operands(7, 2, 16, 8192 // small, 8, 8, 128, jnp.bfloat16, (1, 8), True, False, 0.1)
    q, k, v, b, m, _, _, seed = args
    kernel = FlashAttention(platform="triton")
    call = dict(attention_mask=m, dropout_seed=seed, dropout_prob=0.1, causal=True,
                sliding_window=(1024, 0))  # fmt: skip
    inv = ejkfn.Invocation.of(kernel, q, k, v, b, **call)
    forward = kernel.heuristic_cfg(inv).fwd
    candidates = [
        AttentionConfig(platform="triton", fwd=forward, bwd=BwdParams(**dict(zip(
            ("q_blocksize", "kv_blocksize", "num_warps", "num_stages"), tile, strict=True))))
        for tile in (FAULTY, (16, 64, 4, 2))
    ]  # fmt: skip
    rows = []
    for build, checked in (("pair hash", True), ("this tree", True), ("this tree", False)):
        tuner = ejkfn.Tuner(warmup=1, iters=6, progress=False, check_outputs=checked)
        modules = pair_hash if build == "pair hash" else tri._KERNELS
        with mock.patch.object(tri, "_KERNELS", modules):
            report = tuner.tune(inv, candidates, validate_backward=True)
        print(f"tune, {build}, outputs checked={checked}: {report.seconds:.1f} s", flush=True)
        print(report.table(), flush=True)
        rows.append(dict(build=build, checked=checked, seconds=report.seconds,
                         table=report.table()))  # fmt: skip
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--small", action="store_true", help="short key sequences (a CPU dry run)")
    parser.add_argument("--only", default="", help="run only cases whose name has this")
    parser.add_argument("--fence", action="store_true", help="also the faulty launch, fenced")
    parser.add_argument("--fenced", action="store_true", help="only the faulty launch (the child)")
    parser.add_argument(
        "--tune", action="store_true", help="also tune the faulty tile and a right one"
    )
    a = parser.parse_args()
    small = 16 if a.small else 1
    t0 = time.time()
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    rows = []
    pair_hash = None
    for name, kw in [c for c in cases(a.fenced) if a.only in c[0]]:
        if kw["backend"] == "pair-hash":
            pair_hash = pair_hash or pair_hash_kernels()
        try:
            if kw["backend"] == "pair-hash":
                with mock.patch.object(tri, "_KERNELS", pair_hash):
                    rows.append(case(name, small=small, **kw))
            else:
                rows.append(case(name, small=small, **kw))
        except Exception as exc:
            print(f"ERROR {name}: {exc!r}"[:400], flush=True)
            rows.append(dict(name=name, ok=False, error=repr(exc)[:400]))
    result = dict(device=jax.devices()[0].device_kind, fenced=a.fenced, cases=rows)
    if a.tune:
        result["tunes"] = tune_both_builds(small, pair_hash or pair_hash_kernels())
    if a.fence and jax.default_backend() == "gpu":
        # The same faulty launch with one async-proxy fence a pass in the dQ kernel's loops.
        env = dict(os.environ, EJKFN_ADD_FENCES="bwd_dq_kernel",
                   PATH=os.path.join(HERE, "xla_ptxas") + os.pathsep + os.environ["PATH"])  # fmt: skip
        print("with a fence in the dQ loops:", flush=True)
        child = subprocess.run(
            [sys.executable, __file__, "--fenced", "--out", os.path.join(a.out, "fenced")],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        print(child.stdout[-4000:], child.stderr[-2000:], flush=True)
        result["fenced_output"] = child.stdout[-4000:]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "small_tiles.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} pass; {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
