"""Ring attention: context parallelism over one mesh axis, with a local flash-attention backend.

Each device of the ring keeps its queries; key/value blocks travel one step around the ring
(``lax.ppermute``) per step, and each device runs the local backend on the pair (its queries, the block
it holds), merging partial results through their log-sum-exp. The backward pass is a second ring,
its steps in reverse and its blocks travelling the other way: a block's ``dk``/``dv`` partial sums
travel with it and end where it lives, while ``dq`` accumulates where the queries live. Nothing
quadratic in the sequence is held: per device, memory is linear in the local sequence length (plus
the local backend's own tiles).

Positions: with ``n`` devices and local length ``L``, device ``i`` holds queries and keys
``[i * L, (i + 1) * L)`` of one self-attention sequence. At step ``s`` device ``i`` holds key block
``j = (i - s) mod n``, whose keys sit ``d = (i - j) * L`` positions before its queries; ``d`` is
``s * L`` when ``i >= s`` and ``(s - n) * L`` otherwise, two values known at trace time. For each the
visible keys of query row ``r`` form a band ``r + lo <= c <= r + hi``; the band is expressed through
the backend's own bottom-right aligned causal/window masks on statically sliced queries or keys, so no
mask array is built, and a pair that sees nothing is skipped (``lax.cond`` on the device index).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._platform import device_kind
from .._registry import BwdParams, FwdParams
from ._api import _AUTO_ORDER, AttentionConfig, _number, _refusal, _variant_order, _window
from ._backend import AttentionBackend, AttentionShape, backend_for, merge_partials
from ._mosaic_grid import sparing_sms
from ._spec import AttentionSpec

__all__ = ["ring_attention", "ring_attention_sharded", "zigzag_order"]

_INF = math.inf
# Multiprocessors the local forward's persistent grid leaves to the transfer beside a step where
# nothing masks the call. On two H200s (benchmarks/NOTES.md, sixty-seventh round) the ring's forward
# without a mask took 0.93-0.96x the time with 16 left as with none at 32k keys (four runs) and
# 0.98-0.99x at 64k; 8, the old value, 1.04-1.13x and 1.02-1.08x the time of 16 (NCCL's transfer
# mostly started only as the step before ended); 24, 1.05x and 1.01x. Causal rings, zigzag or
# contiguous, ran fastest with none left: XLA then ran their transfers before the first step, so a
# spared multiprocessor only slowed the steps. With the value block's transfer beside the first step
# (sixty-eighth round) none still led: 4.04-4.06 ms against 4.55-4.62 with 16 at 32k zigzag. The
# last step, beside which nothing travels, keeps them all (seventieth round: the forward without a
# mask 0.95-0.97x the time); with it so, 16 still led at 32k (24: 1.01x the time, 8: 1.09-1.14x),
# and training's forward sparing them too trained 0.98x the time at 32k, 0.997x at 64k (sparing at
# every step, the thirty-first round had found training slower).
TRANSFER_SMS = 16


def _transfer_sms(spec: AttentionSpec) -> int:
    """Multiprocessors a forward step leaves to the block's transfer beside it."""
    return TRANSFER_SMS if not spec.causal and spec.window is None else 0


@dataclasses.dataclass(frozen=True, slots=True)
class _Pair:
    """How to run one (query shard, key shard) pair locally: static slices and a spec, or nothing.

    Queries ``[q_start, q_start + q_len)`` attend to keys ``[k_start, k_start + k_len)`` under
    ``spec``; the other rows see nothing.
    """

    q_len: int
    k_len: int
    spec: AttentionSpec | None  # None: the pair sees nothing
    q_start: int = 0
    k_start: int = 0


def _pair(base: AttentionSpec, length: int, lo: float, hi: float) -> _Pair:
    """The local call for keys ``c`` visible to query ``r`` when ``r + lo <= c <= r + hi``."""
    last = length - 1
    if lo > last or hi < -last or lo > hi:
        return _Pair(0, 0, None)
    lo = -_INF if lo <= -last else lo
    hi = _INF if hi >= last else hi
    # Bottom-right alignment puts the band's reference diagonal at c = r + (k_len - q_len); cut the
    # rows (or keys) that see nothing so that the diagonal lies inside the band.
    off = min(max(0, lo), hi)
    q_len, k_len = (length - int(off), length) if off > 0 else (length, length + int(off))
    left, right = off - lo, hi - off
    causal, window = False, None
    if left == _INF and right == 0:
        causal = True
    elif left != _INF or right != _INF:
        span = q_len + k_len  # wider than any distance inside the pair: "unlimited"
        window = (int(min(left, span)), int(min(right, span)))
    spec = dataclasses.replace(base, causal=causal, window=window)
    return _Pair(q_len, k_len, spec)


def _contiguous_steps(base: AttentionSpec, length: int, n: int) -> tuple[tuple[_Pair, _Pair], ...]:
    """Per step, the pair for devices whose key block lies before theirs and for those that wrapped."""
    return tuple(
        (
            _pair(base, length, *_band(s * length, base.causal, base.window)),
            _pair(base, length, *_band((s - n) * length, base.causal, base.window)),
        )
        for s in range(n)
    )


def _zigzag_steps(base: AttentionSpec, length: int, n: int) -> tuple[tuple[_Pair, _Pair], ...]:
    """Causal pairs when device ``i`` holds chunks ``i`` and ``2n - 1 - i`` of ``2n`` equal chunks.

    Step 0 is plain causal attention (the two local chunks are in order). Later, a device whose key
    block came from an earlier device sees only that block's first chunk, with all its queries; one
    whose block wrapped sees the whole block with its second chunk of queries only. Every device
    does the same work at every step, which the contiguous layout cannot give causal attention.
    """
    half = length // 2
    full = dataclasses.replace(base, causal=False, window=None)
    first = _Pair(length, length, base)
    later = (_Pair(length, half, full), _Pair(half, length, full, q_start=half))
    return (first, first), *((later,) * (n - 1))


def zigzag_order(seq_len: int, devices: int) -> np.ndarray:
    """Positions in the order the zigzag layout holds them (device ``i``: chunks ``i``, ``2n-1-i``).

    ``x[:, zigzag_order(S, n)]`` lays a sequence out for ``ring_attention(..., layout="zigzag")``
    over ``n`` devices; ``np.argsort`` of it undoes that.

    >>> zigzag_order(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    if devices < 1 or seq_len % (2 * devices):
        raise ValueError(
            f"the zigzag layout splits the sequence into 2 x devices equal chunks; got "
            f"seq_len={seq_len}, devices={devices}"
        )
    chunk = seq_len // (2 * devices)
    chunks = [c for i in range(devices) for c in (i, 2 * devices - 1 - i)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks])


def _band(d: int, causal: bool, window: tuple[int, int] | None) -> tuple[float, float]:
    """Visible keys relative to the query row for key positions ``d`` before the queries."""
    lo, hi = -_INF, _INF
    if window is not None:
        lo, hi = float(d - window[0]), float(d + window[1])
    if causal:
        hi = min(hi, float(d))
    return lo, hi


def _pad_rows(x: jax.Array, start: int, size: int, axis: int, value: Any = 0) -> jax.Array:
    """``x`` placed at ``start`` of ``size`` rows along ``axis``, the rest filled with ``value``."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (start, size - start - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


@dataclasses.dataclass(frozen=True, slots=True)
class _Local:
    """The local backend and its static parameters."""

    backend: AttentionBackend
    fwd_params: FwdParams
    bwd_params: BwdParams
    interpret: bool

    def fwd(
        self, pair: _Pair, q: jax.Array, k: jax.Array, v: jax.Array, spared_sms: int = 0
    ) -> Any:
        """``(out, lse)`` of ``q`` against the pair's keys, padded back to all rows: ``out`` in
        ``q``'s dtype, as the backend gives it (a float32 copy out of a ``lax.cond`` cost a pass
        over it), ``lse`` in float32. ``spared_sms``: multiprocessors its persistent grid leaves
        free (``mosaic_grid.sparing_sms``) for the block travelling beside this step."""
        batch, length, heads, dim = q.shape
        if pair.spec is None:
            return (
                jnp.zeros((batch, length, heads, dim), q.dtype),
                jnp.full((batch, heads, length), -jnp.inf, jnp.float32),
            )
        qs, ks = pair.q_start, pair.k_start
        with sparing_sms(spared_sms):
            out, lse = self.backend.fwd(
                q[:, qs : qs + pair.q_len], k[:, ks : ks + pair.k_len], v[:, ks : ks + pair.k_len],
                None, None, None, None, None,
                spec=pair.spec, params=self.fwd_params, interpret=self.interpret,
            )  # fmt: skip
        out = _pad_rows(out.astype(q.dtype), qs, length, 1)
        lse = _pad_rows(lse.astype(jnp.float32), qs, length, 2, -jnp.inf)
        return out, lse

    def bwd(
        self,
        pair: _Pair,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        out: jax.Array,
        lse: jax.Array,
        dout: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(dq, dk, dv)`` of the pair in the inputs' dtypes, given the global ``out`` and ``lse``
        of ``q``."""
        if pair.spec is None:
            return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
        rows = slice(pair.q_start, pair.q_start + pair.q_len)
        keys = slice(pair.k_start, pair.k_start + pair.k_len)
        dq, dk, dv, _ = self.backend.bwd(
            q[:, rows], k[:, keys], v[:, keys],
            None, None, None, None, None,
            out[:, rows], lse[:, :, rows], dout[:, rows],
            spec=pair.spec, params=self.bwd_params, interpret=self.interpret,
        )  # fmt: skip
        length = q.shape[1]
        return (
            _pad_rows(dq.astype(q.dtype), pair.q_start, length, 1),
            _pad_rows(dk.astype(k.dtype), pair.k_start, length, 1),
            _pad_rows(dv.astype(v.dtype), pair.k_start, length, 1),
        )


def _choose(
    platform: str,
    cfg: AttentionConfig | None,
    base: AttentionSpec,
    shape: AttentionShape,
    *,
    differentiated: bool = True,
) -> _Local:
    """The local backend: ``cfg``'s, else the platform's (``auto``: the device's best) non-dense one.
    One that only serves calls nothing differentiates (``differentiated=False``) runs forwards only,
    so its backward need not use the saved out and lse."""
    needed = _needed(base)
    if cfg is not None:
        backend = backend_for(cfg.platform, cfg.variant or _default_variant(cfg.platform))
        params = (cfg.fwd, cfg.bwd)
    else:
        backend, params = _backend_for_platform(platform, needed, shape)
    if differentiated and not backend.bwd_uses_residuals:
        # Its backward normalises with its own row sums, not the whole sequence's out and lse that
        # a ring passes in; on xla the chunked variant computes the same numbers blockwise.
        raise ValueError(
            "ring_attention needs a backend whose backward uses the saved out and lse; got "
            f"platform={backend.platform!r} variant={backend.variant!r} (on xla use 'chunked')"
        )
    backend.check(needed, *params)
    interpret = device_kind() not in backend.devices
    return _Local(backend, params[0], params[1], interpret)


def _default_variant(platform: str) -> str | None:
    return "chunked" if platform == "xla" else None


def _needed(base: AttentionSpec) -> AttentionSpec:
    """What the local backend must support: pairs need causal or window masks the call may lack."""
    return dataclasses.replace(base, causal=True, window=(1, 1) if base.window else None)


def _backend_for_platform(
    platform: str, needed: AttentionSpec, shape: AttentionShape
) -> tuple[AttentionBackend, tuple[FwdParams, BwdParams]]:
    """``platform``'s first variant, in ``auto``'s order of variants (the Mosaic kernels first on a
    Hopper GPU), that runs here, uses the saved residuals and can do the pairs (``needed``, at
    ``shape``'s sizes and dtype, both passes traced abstractly: the Mosaic kernels refuse float32),
    with its heuristic's params for ``shape``; ``auto`` tries its platforms in order, down to XLA's
    chunked variant. An explicit platform none of whose variants qualifies keeps its default one,
    for :func:`_choose` to refuse by name."""
    kind = device_kind()
    pairs = dataclasses.replace(shape, spec=needed)
    q = jax.ShapeDtypeStruct((shape.batch, shape.seq_q, shape.heads, shape.head_dim), shape.dtype)
    k = jax.ShapeDtypeStruct(
        (shape.batch, shape.seq_k, shape.kv_heads, shape.head_dim), shape.dtype
    )
    none = dict.fromkeys(("attention_mask", "q_segment_ids", "kv_segment_ids", "dropout_seed"))
    for name in _AUTO_ORDER.get(kind, ()) if platform == "auto" else (platform,):
        for backend in _variant_order(name, shape):
            if not (backend.bwd_uses_residuals and kind in backend.devices and backend.available()):
                continue
            params = backend.heuristic(shape)
            if _refusal(backend, pairs, (q, k, k, None), none, params) is None:
                return backend, params
    if platform == "auto":
        fallback = backend_for("xla", "chunked")
    else:
        fallback = backend_for(platform, _default_variant(platform))
    return fallback, fallback.heuristic(shape)


def _check(name: str, x: Any) -> None:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array; got {type(x).__name__}")
    if len(x.shape) != 4:
        raise ValueError(
            f"{name} must be [batch, seq_local, heads, dim]; got {name}.shape={tuple(x.shape)}"
        )


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: Any,
    causal: Any = False,
    sliding_window: Any = None,
    softmax_scale: Any = None,
    platform: Any = "auto",
    cfg: Any = None,
    layout: Any = "contiguous",
) -> jax.Array:
    """Self-attention over a sequence sharded along ``axis_name``, computed around a ring of devices.

    Call it inside ``jax.shard_map(..., check_vma=False)`` (the local backends' loops do not track
    varying manual axes) or :func:`ejkfn.shard_map_with_config`, with ``q``, ``k`` and ``v`` split along the sequence over ``axis_name``, in mesh order: device ``i`` holds positions
    ``[i * seq_local, (i + 1) * seq_local)``. The result equals :func:`ejkfn.flash_attention` of the
    whole sequence, sharded the same way; gradients flow to ``q``, ``k`` and ``v`` (a second ring).

    Args:
        q: ``[batch, seq_local, heads, dim]``, this device's queries.
        k, v: ``[batch, seq_local, kv_heads, dim]``; ``kv_heads`` divides ``heads`` (GQA/MQA).
        axis_name: the mesh axis the sequence is split over (static).
        causal: each query sees keys at or before its global position (static).
        sliding_window: an int or ``(left, right)``: keys within that distance of the query's global
            position (static).
        softmax_scale: defaults to ``1 / sqrt(dim)`` (static).
        platform: the local backend's platform, ``"auto"`` (the device's best that supports the
            call) or a registered one; its variants are tried in ``auto``'s order (on a Hopper
            GPU the Mosaic kernels first), XLA's chunked one where XLA runs.
        cfg: an explicit :class:`ejkfn.attention.AttentionConfig` for the local backend (static);
            its ``inference`` config, where set, computes the calls that nothing differentiates.
        layout: ``"contiguous"`` (device ``i`` holds the ``i``-th of ``n`` equal slices) or, for causal
            attention without a window, ``"zigzag"``: the sequence is cut into ``2n`` chunks and
            device ``i`` holds chunks ``i`` then ``2n - 1 - i`` (lay data out with
            :func:`zigzag_order`). Contiguous causal attention leaves the first device nearly idle;
            zigzag gives every device the same work at every step.

    Returns:
        ``[batch, seq_local, heads, dim]``, like ``q``.

    On GPUs XLA keeps one transfer in flight, so the key block's travels alone before the first
    step. A program jitted with this compiler option sends both blocks at once beside it (on two
    H200s the causal forward ran 1.02-1.05x as fast, training 1.00-1.02x; benchmarks/NOTES.md,
    sixty-eighth round)::

        jax.jit(step, compiler_options={"xla_gpu_collective_permute_combine_threshold_bytes": 2**30})

    Arguments are annotated loosely on purpose: every check below raises a ``ValueError`` that names
    the bad value, also in test runs with a runtime type checker.

    >>> from functools import partial
    >>> mesh = jax.make_mesh((1,), ("sp",), devices=jax.devices()[:1])
    >>> seq = PartitionSpec(None, "sp")
    >>> f = jax.shard_map(partial(ring_attention, axis_name="sp", causal=True), mesh=mesh,
    ...     in_specs=(seq, seq, seq), out_specs=seq, check_vma=False)
    >>> x = jax.device_put(jnp.ones((1, 8, 2, 16)), NamedSharding(mesh, seq))
    >>> f(x, x, x).shape
    (1, 8, 2, 16)
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check(name, x)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have one shape; got k.shape={k.shape}, v.shape={v.shape}")
    batch, length, heads, dim = q.shape
    if k.shape[0] != batch or k.shape[3] != dim:
        raise ValueError(
            f"k must have q's batch and dim; got q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}"
        )
    if k.shape[1] != length:
        raise ValueError(
            "ring attention is self-attention: q and k need one local length; "
            f"got q.shape[1]={length}, k.shape[1]={k.shape[1]}"
        )
    kv_heads = k.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"kv_heads must divide heads; got {heads=}, {kv_heads=}")
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"axis_name must be a mesh axis name (a str); got {axis_name!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal must be a bool; got causal={causal!r}")
    if not isinstance(platform, str):
        raise ValueError(f"platform must be a str; got platform={platform!r}")
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"layout must be 'contiguous' or 'zigzag'; got layout={layout!r}")
    if cfg is not None:
        if not isinstance(cfg, AttentionConfig):
            raise ValueError(f"cfg must be an AttentionConfig or None; got cfg={cfg!r}")
        cfg.check_platform(platform)
    try:
        window = _window(sliding_window)
        scale = (
            1.0 / math.sqrt(dim)
            if softmax_scale is None
            else _number("softmax_scale", softmax_scale)
        )
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    try:
        n = lax.axis_size(axis_name)
    except NameError as exc:
        raise ValueError(
            f"axis_name={axis_name!r} is not a mapped axis here; call ring_attention inside "
            "jax.shard_map over that mesh axis"
        ) from exc
    if layout == "zigzag" and (not causal or window is not None or length % 2):
        raise ValueError(
            "layout='zigzag' balances causal attention without a sliding window over an even local "
            f"length; got causal={causal!r}, sliding_window={sliding_window!r}, seq_local={length}"
        )
    base = AttentionSpec(scale=scale, causal=bool(causal), window=window)
    shape = AttentionShape.of(q, k, base)
    local = serving = _choose(platform, cfg, base, shape)
    if cfg is not None and cfg.inference is not None:
        serving = _choose(platform, cfg.inference, base, shape, differentiated=False)
    if layout == "zigzag":
        steps = _zigzag_steps(base, length, n)
    else:
        steps = _contiguous_steps(base, length, n)
    return _ring(
        q, k, v, axis_name=axis_name, n=n, steps=steps, local=local, serving=serving,
        spared_sms=_transfer_sms(base),
    )  # fmt: skip


def _ring(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: str,
    n: int,
    steps: tuple[tuple[_Pair, _Pair], ...],
    local: _Local,
    serving: _Local,
    spared_sms: int,
) -> jax.Array:
    """The ring's custom VJP: ``local`` computes differentiated calls, ``serving`` the rest; each
    forward step a block travels beside leaves ``spared_sms`` multiprocessors to its transfer."""
    ahead = [(i, (i + 1) % n) for i in range(n)]  # the forward's direction
    back = [(i, (i - 1) % n) for i in range(n)]  # the backward's

    def shift(perm: list[tuple[int, int]], *xs: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(lax.ppermute(x, axis_name, perm) for x in xs)

    def at_step(s: int, run: Any) -> Any:
        """``run(pair)`` on this device's pair at step ``s``: the one for devices holding an
        earlier block, or the one for devices whose block wrapped round."""
        pair_b, pair_w = steps[s]
        if pair_b == pair_w:
            return run(pair_b)
        index = lax.axis_index(axis_name)
        return lax.cond(index >= s, lambda: run(pair_b), lambda: run(pair_w))

    def forward(
        q: jax.Array, k: jax.Array, v: jax.Array, by: _Local
    ) -> tuple[jax.Array, jax.Array]:
        def spared_at(s: int) -> int:
            """A block travels beside every step but the last, which keeps every multiprocessor."""
            return spared_sms if s < n - 1 else 0

        out, lse = by.fwd(steps[0][0], q, k, v, spared_sms=spared_at(0))
        kb, vb = k, v
        for s in range(1, n):
            # The block arriving and the step before meet here, so XLA's scheduler runs that step
            # while the block travels (it had run the transfers first; NOTES, sixty-eighth round).
            out, lse, kb, vb = lax.optimization_barrier((out, lse, *shift(ahead, kb, vb)))
            step = functools.partial(by.fwd, q=q, k=kb, v=vb, spared_sms=spared_at(s))
            out_s, lse_s = at_step(s, step)
            out, lse = merge_partials(jnp.stack((out, out_s)), jnp.stack((lse, lse_s)))
        return out.astype(q.dtype), lse

    @jax.custom_vjp
    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return forward(q, k, v, serving)[0]

    def attend_fwd(q: jax.Array, k: jax.Array, v: jax.Array) -> Any:
        out, lse = forward(q, k, v, local)
        return out, (q, k, v, out, lse)

    def attend_bwd(res: Any, dout: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        # The forward's steps in reverse, blocks travelling the other way round: device i starts on
        # block i + 1 (the forward's last, whose transfer XLA shares with the forward's where the
        # permutations are equal: two devices) and ends on its own, so each block's dk/dv partial
        # sum, travelling with it, ends where the block lives; no transfer follows the last step.
        q, k, v, out, lse = res
        dq = jnp.zeros(q.shape, jnp.float32)
        dkv = None  # dk and dv stacked: one transfer a step (XLA runs one at a time beside a step)
        kb, vb = k, v
        for s in reversed(range(n)):
            # The last step is on the device's own block, already here.
            kb, vb = (k, v) if s == 0 else shift(back, kb, vb)
            dq_s, dk_s, dv_s = at_step(
                s, functools.partial(local.bwd, q=q, k=kb, v=vb, out=out, lse=lse, dout=dout)
            )
            dq = dq + dq_s.astype(jnp.float32)
            dkv_s = jnp.stack((dk_s, dv_s))
            if dkv is None:
                # One step's partial is the backend's dk/dv, in k's dtype (the VJP's contract):
                # sent in it, exactly, at half float32's bytes for 16-bit keys.
                dkv = dkv_s
            else:
                (dkv,) = shift(back, dkv)
                dkv = dkv.astype(jnp.float32) + dkv_s.astype(jnp.float32)
        return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q, k, v)


def _zigzag_moves(n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Where device ``i``'s contiguous chunks ``2i`` and ``2i + 1`` live in the zigzag layout."""

    def home(chunk: int) -> int:
        return chunk if chunk < n else 2 * n - 1 - chunk

    return [(i, home(2 * i)) for i in range(n)], [(i, home(2 * i + 1)) for i in range(n)]


def _to_zigzag(x: jax.Array, axis_name: str, n: int) -> jax.Array:
    """Local slices of the contiguous layout to the zigzag layout (inside ``shard_map``)."""
    half = x.shape[1] // 2
    evens, odds = _zigzag_moves(n)
    got_even = lax.ppermute(x[:, :half], axis_name, evens)
    got_odd = lax.ppermute(x[:, half:], axis_name, odds)
    # Device j holds chunks j and 2n - 1 - j: one even, one odd, the even one first when j is even.
    even_first = lax.rem(lax.axis_index(axis_name), 2) == 0
    first = jnp.where(even_first, got_even, got_odd)
    second = jnp.where(even_first, got_odd, got_even)
    return jnp.concatenate([first, second], axis=1)


def _from_zigzag(x: jax.Array, axis_name: str, n: int) -> jax.Array:
    """The inverse of :func:`_to_zigzag`."""
    half = x.shape[1] // 2
    evens, odds = _zigzag_moves(n)
    even_first = lax.rem(lax.axis_index(axis_name), 2) == 0
    first, second = x[:, :half], x[:, half:]
    even = jnp.where(even_first, first, second)
    odd = jnp.where(even_first, second, first)
    back = [(dst, src) for src, dst in evens], [(dst, src) for src, dst in odds]
    even = lax.ppermute(even, axis_name, back[0])
    odd = lax.ppermute(odd, axis_name, back[1])
    return jnp.concatenate([even, odd], axis=1)


def ring_attention_sharded(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mesh: Any,
    axis_name: Any,
    **kwargs: Any,
) -> jax.Array:
    """:func:`ring_attention` on arrays of the global shape: shards the sequence over ``axis_name``.

    ``kwargs`` go to :func:`ring_attention`. Inputs are placed with ``PartitionSpec(None, axis_name)``
    (a no-op when they already are); the output is sharded the same way. With ``layout="zigzag"``
    the sequence is moved into that layout first and the output back (two ``ppermute`` steps each;
    callers that keep their data in zigzag order call :func:`ring_attention` directly).
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh; got mesh={mesh!r}")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    n = mesh.shape[axis_name]
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check(name, x)
        if x.shape[1] % n:
            raise ValueError(
                f"{name}.shape[1]={x.shape[1]} must be a multiple of the {n} devices on {axis_name!r}"
            )
    if kwargs.get("layout") == "zigzag":
        zigzag_order(q.shape[1], n)  # raises if the sequence does not split into 2n chunks
    spec = PartitionSpec(None, axis_name)

    def body(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        if kwargs.get("layout") != "zigzag":
            return ring_attention(q, k, v, axis_name=axis_name, **kwargs)
        q, k, v = (_to_zigzag(x, axis_name, n) for x in (q, k, v))
        out = ring_attention(q, k, v, axis_name=axis_name, **kwargs)
        return _from_zigzag(out, axis_name, n)

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False
    )
    sharding = NamedSharding(mesh, spec)
    q, k, v = (jax.device_put(x, sharding) for x in (q, k, v))
    return mapped(q, k, v)
