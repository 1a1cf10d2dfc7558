"""cuDNN attention through ``jax.nn.dot_product_attention(..., implementation="cudnn")``.

What jax's cuDNN path cannot express is refused with ``NotImplementedError`` at trace time: soft cap
and dropout (cuDNN's dropout uses its own generator, not the shared hash), segment ids (cuDNN wants
packed offsets; a dense mask built from them would defeat the point), float32/float64 inputs, a bias
in another dtype than the inputs' (cuDNN adds it in theirs: a float32 bias would be rounded to 16
bits, where the spec adds it in float32), head dims over 256, causal or window masks with ``seq_q !=
seq_k`` (cuDNN aligns them top-left, the spec bottom-right), and windows that look right of the
diagonal without ``causal``. Head dims that are not multiples of 8 are zero-padded here (the padding
changes neither scores nor outputs).

The log-sum-exp comes from cuDNN's softmax statistics, which jax returns in the input dtype (so it is
only as precise as bfloat16/float16). Calls that nothing differentiates (``infer``) leave them out
where that makes cuDNN's forward faster: it is another cuDNN graph, and asking for the statistics
speeds up the causal forward at head dims 65-128 from 1024 keys (:func:`_statistics_speed_up`).
The backward pass is ``jax.vjp`` of the cuDNN forward: XLA reruns the forward inside it to get
cuDNN's own residuals.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._platform import on_cuda
from .._registry import BwdParams, FwdParams
from ._backend import AttentionBackend, AttentionShape, register_backend
from ._reference import visible
from ._spec import AttentionSpec

__all__ = ["CUDNN", "available", "mask_refusal", "residual_bwd"]

_MAX_HEAD_DIM = 256


_on_cuda = functools.cache(on_cuda)  # asked at every selection's candidate listing


def available() -> bool:
    """Whether cuDNN attention can run here: the default device is a CUDA GPU."""
    return _on_cuda()


def _check(
    q: jax.Array, k: jax.Array, spec: AttentionSpec, interpret: bool, bias: Any = None
) -> None:
    CUDNN.check(spec)
    if bias is not None and np.dtype(bias.dtype) != np.dtype(q.dtype):
        dtype = np.dtype(q.dtype).name
        raise NotImplementedError(
            f"platform 'cudnn' adds the bias in the inputs' dtype ({dtype}), which would round "
            f"a {np.dtype(bias.dtype).name} bias; cast it with bias.astype({dtype!r}) to run on "
            "cuDNN, or take another platform, which adds it in float32"
        )
    if interpret or not _on_cuda():
        raise NotImplementedError(
            "platform 'cudnn' needs a CUDA GPU (cuDNN fused attention has no CPU or interpreter "
            f"path); the default device here is {jax.devices()[0].platform!r}"
        )
    dtype = np.dtype(q.dtype)
    if dtype not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
        raise NotImplementedError(
            f"platform 'cudnn' needs float16 or bfloat16 inputs; got {dtype.name}"
        )
    if q.shape[-1] > _MAX_HEAD_DIM:
        raise NotImplementedError(
            f"platform 'cudnn' supports head dims up to {_MAX_HEAD_DIM}; got {q.shape[-1]}"
        )
    refusal = mask_refusal(spec, q.shape[1], k.shape[1])
    if refusal is not None:
        raise NotImplementedError(refusal)


def mask_refusal(spec: AttentionSpec, seq_q: int, seq_k: int) -> str | None:
    """Why cuDNN cannot mask ``spec`` at these lengths (its causal mask and window align top-left
    and look left only), or None where it can."""
    if seq_q != seq_k and (spec.causal or spec.window is not None):
        return (
            "platform 'cudnn' aligns causal and sliding_window masks top-left; the spec's "
            f"bottom-right alignment needs seq_q == seq_k, got {seq_q=} and {seq_k=}"
        )
    if spec.window is not None and not spec.causal and spec.window[1] != 0:
        return (
            "platform 'cudnn' supports a sliding_window that looks right of the diagonal only "
            f"with causal=True; got sliding_window={spec.window!r}"
        )
    return None


def _causal_window(spec: AttentionSpec) -> tuple[bool, int | None]:
    """cuDNN's causal flag and its window's left side (None: no window) for ``spec``. cuDNN applies
    a sliding window only with its causal mask; a window that stops at the diagonal (all that
    ``_check`` lets through) is exactly causal attention with a left window."""
    if spec.window is None:
        return spec.causal, None
    return True, spec.window[0]


def _pad_head_dim(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """``xs`` with the head dim (last axis) zero-padded to a multiple of 8, as cuDNN needs; zero
    columns change no score."""
    dim = xs[0].shape[-1]
    extra = -(-dim // 8) * 8 - dim
    return tuple(jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, extra),)) if extra else x for x in xs)


def _attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    *,
    spec: AttentionSpec,
    residual: bool = True,
) -> tuple[jax.Array, jax.Array | None]:
    """``(out, lse)`` through cuDNN, or ``(out, None)`` without ``residual`` (cuDNN then leaves
    its softmax statistics out); rows that see no key are zeroed as the spec asks."""
    dim = q.shape[-1]
    q, k, v = _pad_head_dim(q, k, v)
    causal, left = _causal_window(spec)
    result = jax.nn.dot_product_attention(
        q,
        k,
        v,
        bias=bias,
        mask=mask,
        scale=spec.scale,
        is_causal=causal,
        local_window_size=None if left is None else (left, 0),
        implementation="cudnn",
        return_residual=residual,
    )
    out, stats = result if residual else (result, None)
    out = out[..., :dim]
    lse = None if stats is None else jnp.swapaxes(stats, 1, 2).astype(jnp.float32)  # [B, H, Sq]
    if mask is not None:
        # A masked row is a large negative bias to cuDNN, not an empty row: zero it here.
        seen = visible(spec, q.shape[1], k.shape[1], mask).any(-1)  # [B|1, H|1, Sq]
        out = jnp.where(jnp.swapaxes(seen, 1, 2)[..., None], out, 0.0).astype(out.dtype)
        lse = None if lse is None else jnp.where(seen, lse, -jnp.inf)
    return out, lse


def _fwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    seed: jax.Array | None,
    *,
    spec: AttentionSpec,
    params: FwdParams,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    del q_seg, kv_seg, seed, params
    _check(q, k, spec, interpret, bias)
    return _attention(q, k, v, bias, mask, spec=spec)


def _infer(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    seed: jax.Array | None,
    *,
    spec: AttentionSpec,
    params: FwdParams,
    interpret: bool = False,
) -> jax.Array:
    del q_seg, kv_seg, seed, params
    _check(q, k, spec, interpret, bias)
    residual = _statistics_speed_up(spec, q.shape[-1], k.shape[1])
    return _attention(q, k, v, bias, mask, spec=spec, residual=residual)[0]


STATISTICS_MIN_KEYS = 1024  # fewer keys: cuDNN's forward runs slower asked for its statistics


def _statistics_speed_up(spec: AttentionSpec, head_dim: int, seq_k: int) -> bool:
    """Whether cuDNN's forward runs faster asked for its softmax statistics as well: causal (a
    window is causal to cuDNN) at head dims over 64 and up to 128, from ``STATISTICS_MIN_KEYS``
    keys. Measured on an H200 side by side (benchmarks/results/cudnn_paths_NVIDIA_H200_20261202-
    061915.json, -062540.json and -132823.json): with them 1.006-1.025x at ten causal shapes of
    head dims 96 and 128 from 2048 keys, 1.004x at 1024 and 0.933x at 512; without a mask
    0.991-1.004x; at head dim 64 0.974-0.994x; at head dim 256 causal 0.997x."""
    return (
        (spec.causal or spec.window is not None)
        and 64 < head_dim <= 128
        and seq_k >= STATISTICS_MIN_KEYS
    )


def _bwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    seed: jax.Array | None,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    *,
    spec: AttentionSpec,
    params: BwdParams,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    del q_seg, kv_seg, seed, out, lse, params
    _check(q, k, spec, interpret, bias)

    def forward(*xs: Any) -> jax.Array:
        b = xs[3] if bias is not None else None
        return _attention(xs[0], xs[1], xs[2], b, mask, spec=spec)[0]

    primals = (q, k, v) if bias is None else (q, k, v, bias)
    _, pullback = jax.vjp(forward, *primals)
    grads = pullback(dout.astype(q.dtype))
    dbias = grads[3] if bias is not None else None
    return grads[0], grads[1], grads[2], dbias


def residual_bwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    *,
    spec: AttentionSpec,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` from cuDNN's backward kernel, fed another forward's ``out`` and natural-log
    ``lse [B, H, Sq]`` (float32), as cuDNN's own forward would have left them. Only causal, unmasked or
    sliding-window attention (a window as cuDNN's own forward takes it): no bias or mask, every row
    seeing a key (a ``-inf`` lse would make NaNs).

    It binds the primitive under ``jax.nn.dot_product_attention`` (``jax._src.cudnn``; jax is pinned),
    so no forward reruns, unlike :func:`_bwd`'s ``jax.vjp``."""
    if spec.has_bias or spec.has_mask:
        raise NotImplementedError(
            "cuDNN's backward on another forward's residuals takes causal, unmasked or "
            f"sliding-window attention only; got {spec!r}"
        )
    _check(q, k, spec, interpret=False)
    # jax's internals, imported only where this variant runs: a change there breaks it alone.
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    dim = q.shape[-1]
    q, k, v, out, dout = _pad_head_dim(q, k, v, out, dout)  # gradients' extra columns sliced off
    unused = jnp.zeros(0, dtype=q.dtype)
    causal, left = _causal_window(spec)
    sliding = None if left is None else left + 1  # keys a row sees, its own included
    mask_type = cudnn_attention.MaskType.CAUSAL if causal else cudnn_attention.MaskType.NO_MASK
    dq, dk, dv = cudnn_attention._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused, unused, unused, unused, unused, unused, unused,
        lse.astype(jnp.float32), out.astype(q.dtype), dout.astype(q.dtype),
        scale=spec.scale, seed=0, dropout_rate=0.0, variadic_args=(False, False),
        mask_type=mask_type, layout=cudnn_attention.AttentionLayout.BTNH.value,
        sliding_window_length=sliding,
    )  # fmt: skip
    return dq[..., :dim], dk[..., :dim], dv[..., :dim]


def _heuristic(shape: AttentionShape) -> tuple[FwdParams, BwdParams]:
    del shape
    return FwdParams(), BwdParams()  # cuDNN picks its own tiling


def _candidates(shape: AttentionShape) -> list[tuple[FwdParams, BwdParams]]:
    return [_heuristic(shape)]


CUDNN = register_backend(
    AttentionBackend(
        platform="cudnn",
        variant="cudnn",
        devices=("gpu",),
        fwd=_fwd,
        bwd=_bwd,
        infer=_infer,
        unsupported=frozenset({"logits_soft_cap", "dropout", "segment_ids"}),
        heuristic=_heuristic,
        candidates=_candidates,
        bwd_uses_residuals=False,
        available=available,
    )
)
