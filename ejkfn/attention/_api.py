"""``flash_attention`` and the kernel behind it, ``FlashAttention``: one call, every platform."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Integer

from .._invocation import Invocation
from .._kernel import Kernel
from .._platform import device_kind
from .._registry import BwdParams, FwdParams, Platform
from . import _backend, _xla
from ._backend import AttentionBackend, AttentionShape, backend_for
from ._spec import AttentionSpec

__all__ = ["AttentionConfig", "FlashAttention", "flash_attention", "registered_backends"]

# Platforms that ``platform="auto"`` tries on each device kind, best first. A platform registered
# later that is native to the device is tried after these. On GPUs the order follows the H200
# measurements in benchmarks/results (bf16, forward+backward): cuDNN led at every shape, then Pallas
# (Mosaic on Hopper), then Triton; calls cuDNN refuses (soft cap, dropout, segments, ...) fall
# through to our kernels (float32 ones to XLA first, below), and the tuner measures them all when
# asked. On Hopper a call with a soft cap, segment ids, a mask, a bias or (causal) dropout takes
# the portable kernel measured fastest with it (``_feature_backends``).
_AUTO_ORDER = {
    "gpu": ("cudnn", "pallas", "triton", "xla"),
    "tpu": ("pallas", "xla"),
    "cpu": ("xla",),
}
# With float32 inputs our kernels' products run as FMAs on the CUDA cores, and XLA's attention
# (full precision too, ``_xla._exact_f32``) ran ahead of them on an H200. Forward+backward on the
# variant auto takes: 2.69x Triton at 4x4096x16x128 causal (chunked), 1.56x at 8x2048x32x64 causal
# and 2.12x Pallas-Triton without a mask (chunked; dense 3.0x), 7.8x Triton decoding
# 8x1:8192x32(8 kv)x128 (dense). Forward: 1.36x, 1.01x at 1x16384x16x128 causal, 1.5-3.8x
# decoding; 0.74x only at 8x2048x32x64 causal (results/decode_NVIDIA_H200_20261129-224926.json to
# -231101.json). So XLA goes first, for decoding calls too; causal calls at head dims up to 64
# and calls with a narrow window infer on Triton (:func:`_float32_cfg`), causal windows of up to
# 512 keys (768 at head dims up to 64) train there too (:func:`_float32_triton_trains`). Of our
# kernels, Pallas-Triton's blocks spill: at 8x2048x32x64 causal it ran forward 0.048x and
# forward+backward 0.23x Triton (results/features_NVIDIA_H200_20261129-111921.json), so Triton
# goes next; on both kernels' float32 blocks since, Pallas-Triton read 0.71-0.75x Triton's forward
# and 0.93-1.02x its forward+backward at that shape and 4x4096x16x128 causal (-114353.json).
_AUTO_ORDER_FLOAT32 = {"gpu": ("xla", "triton", "pallas")}
# Pallas-Triton before Triton where it ran faster on the float32 blocks of both
# (:func:`_float32_pallas_first`).
_AUTO_ORDER_FLOAT32_PALLAS = {"gpu": ("xla", "pallas", "triton")}
# Triton first where it trained faster than XLA on Hopper (:func:`_float32_triton_trains`).
_AUTO_ORDER_FLOAT32_TRITON = {"gpu": ("triton", "xla", "pallas")}
# Decoding (few queries against many keys, ``_backend.decoding_rows``): Triton's forward splits
# the keys among programs and folds a GQA group's heads into one; on an H200 it ran 0.96-2.5x
# cuDNN at twelve decoding shapes, where the Mosaic forward ran 0.09-1.01x
# (results/decode_NVIDIA_H200_20261129-143452.json, -144243.json), and 1.3-2.6x cuDNN and the
# Mosaic forward at 65-128 query rows (-182827.json). At one query of one sequence against up to
# 2^19 keys XLA's dense attention ran 1.2-1.5x it in two runs and 0.87-1.07x in a third: calls of
# 50-120 us, within what the host's launches move from run to run. So it infers there. It trains
# there too up to _TRITON_TRAINS_QUERIES queries, where the queries fit one 16-row block of its
# backward: forward+backward the Triton pair ran 1.15x and 1.46x the Mosaic pair at 16 and 8
# queries, 0.85x at 64, 0.78-0.86x at 32, 65 and 128, and 1.02x at 32 causal (cross-attention;
# -183302.json, -184010.json to -184414.json); above it training keeps the order of other calls.
# With the dQ kernel's keys split since, 1.48x at 16 queries and 1.04x at 128 (-185617.json,
# -185744.json): one reading at 128, not enough to move the rule. Read again with the split:
# 0.86x at 32 queries (1.02x causal), 0.57x at 64 (0.70x causal), 1.47x at 16 causal
# (-205836.json to -210131.json).
_AUTO_ORDER_DECODING = {"gpu": ("triton", "cudnn", "pallas", "xla")}
_TRITON_TRAINS_QUERIES = 16
_CONFIG_PLATFORMS = tuple(p.value for p in Platform if p is not Platform.AUTO)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AttentionConfig:
    """Which attention backend runs a call, and its block sizes.

    Attributes:
        platform: ``"xla"``, ``"pallas"``, ``"triton"`` or ``"cudnn"``.
        variant: the platform's implementation (``"dense"``/``"chunked"`` for XLA; ``"triton"``,
            ``"mosaic"``, ``"tpu"`` for Pallas); ``None`` takes the first registered one that can do
            the call, preferring ones native to the device.
        fwd: block sizes and launch parameters of the forward pass.
        bwd: block sizes and launch parameters of the backward pass.
        inference: the config of calls that nothing differentiates, where another backend's
            forward is faster than this one's (e.g. a forward+backward tuned config runs cuDNN,
            and the Mosaic forward leads on causal shapes); None: this config. Its own
            ``inference`` must be None, and its ``bwd`` is never used.

    >>> AttentionConfig(platform="xla", variant="chunked").fwd.kv_blocksize
    64
    """

    platform: str
    variant: str | None = None
    fwd: FwdParams = FwdParams()
    bwd: BwdParams = BwdParams()
    inference: AttentionConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.platform, str) or self.platform not in _CONFIG_PLATFORMS:
            raise ValueError(
                f"platform must be one of {_CONFIG_PLATFORMS} (a config names a concrete platform, "
                f"not 'auto'); got {self.platform!r}"
            )
        if self.variant is not None and not (isinstance(self.variant, str) and self.variant):
            raise ValueError(f"variant must be None or a non-empty str; got {self.variant!r}")
        if not isinstance(self.fwd, FwdParams):
            raise TypeError(f"fwd must be a FwdParams; got {self.fwd!r}")
        if not isinstance(self.bwd, BwdParams):
            raise TypeError(f"bwd must be a BwdParams; got {self.bwd!r}")
        if self.inference is not None:
            if not isinstance(self.inference, AttentionConfig):
                raise TypeError(
                    f"inference must be None or an AttentionConfig; got {self.inference!r}"
                )
            if self.inference.inference is not None:
                raise ValueError(
                    f"inference={self.inference!r} must not have an inference config of its own"
                )

    def check_platform(self, platform: str) -> None:
        """Raise ``ValueError`` unless ``platform`` is ``"auto"`` or the platform of this config
        and of its ``inference`` config."""
        for name, part in (("cfg", self), ("cfg.inference", self.inference)):
            if part is not None and platform not in ("auto", part.platform):
                raise ValueError(
                    f"platform={platform!r} disagrees with {name}.platform={part.platform!r}"
                )


def registered_backends() -> tuple[AttentionBackend, ...]:
    """Every registered attention backend, in registration order (platform by platform)."""
    return tuple(b for table in _backend._variants.values() for b in table.values())


# --- arguments -------------------------------------------------------------------------------------


def _is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _astype(x: Any, dtype: Any) -> Any:
    if np.dtype(x.dtype) == np.dtype(dtype):
        return x
    if _is_abstract(x):
        return jax.ShapeDtypeStruct(x.shape, dtype)
    return jnp.asarray(x).astype(dtype)


def _array(name: str, x: Any) -> Any:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array; got {type(x).__name__}: {x!r}")
    return x


def _broadcast_4d(name: str, x: Any, target: tuple[int, int, int, int]) -> Any:
    """``x`` as ``[B|1, H|1, Sq, Sk]``, checking it broadcasts to ``target = (B, H, Sq, Sk)``."""
    shape = tuple(x.shape)
    full = (1,) * (4 - len(shape)) + shape
    if len(shape) > 4 or any(g not in (1, w) for g, w in zip(full, target, strict=True)):
        raise ValueError(
            f"{name} must broadcast to [batch, heads, seq_q, seq_k] = {list(target)}; "
            f"got {name}.shape={shape}"
        )
    want = (full[0], full[1], target[2], target[3])
    if shape == want:
        return x
    if _is_abstract(x):
        return jax.ShapeDtypeStruct(want, x.dtype)
    return jnp.broadcast_to(jnp.reshape(x, full), want)


def _window(sliding_window: Any) -> tuple[int, int] | None:
    if sliding_window is None:
        return None
    if isinstance(sliding_window, (int, np.integer)) and not isinstance(sliding_window, bool):
        sides = (int(sliding_window), int(sliding_window))
    elif (
        isinstance(sliding_window, (tuple, list))
        and len(sliding_window) == 2
        and all(
            isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in sliding_window
        )
    ):
        sides = (int(sliding_window[0]), int(sliding_window[1]))
    else:
        raise TypeError(
            f"sliding_window must be None, an int or a (left, right) pair of ints; "
            f"got {sliding_window!r}"
        )
    if sides[0] < 0 or sides[1] < 0:
        raise ValueError(
            f"sliding_window sides must be >= 0; got sliding_window={sliding_window!r}"
        )
    return sides


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a Python number (it is static: part of the compiled program); "
            f"got {type(value).__name__}: {value!r}"
        )
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {name}={value!r}")
    return value


def _options(
    dim: int,
    softmax_scale: Any,
    causal: Any,
    sliding_window: Any,
    logits_soft_cap: Any,
    dropout_prob: Any,
) -> dict[str, Any]:
    """The static options, validated and in one canonical form (so equal calls have equal keys)."""
    default_scale = 1.0 / math.sqrt(dim)
    scale = default_scale if softmax_scale is None else _number("softmax_scale", softmax_scale)
    # ``dim ** -0.5`` differs from ``1 / sqrt(dim)`` in the last bit at head dims 96 and 128, and
    # the kernels round the scale to float32 anyway: it must not miss the configs shipped and tuned
    # for the default (on an H200 it ran 0.95x there; benchmarks/NOTES.md, forty-seventh round).
    if scale != default_scale and np.float32(scale) == np.float32(default_scale):
        scale = default_scale
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}: {causal!r}")
    cap = None
    if logits_soft_cap is not None:
        cap = _number("logits_soft_cap", logits_soft_cap)
        if cap <= 0:
            raise ValueError(f"logits_soft_cap must be > 0; got logits_soft_cap={cap!r}")
    prob = _number("dropout_prob", dropout_prob)
    if not 0.0 <= prob < 1.0:
        raise ValueError(f"dropout_prob must be in [0, 1); got dropout_prob={prob!r}")
    return {
        "softmax_scale": scale,
        "causal": bool(causal),
        "sliding_window": _window(sliding_window),
        "logits_soft_cap": cap,
        "dropout_prob": prob,
    }


def _seed(dropout_seed: Any) -> Any:
    if isinstance(dropout_seed, (int, np.integer)) and not isinstance(dropout_seed, bool):
        return jnp.asarray(np.uint32(int(dropout_seed) % (1 << 32)))
    seed = _array("dropout_seed", dropout_seed)
    if tuple(seed.shape) != ():
        raise ValueError(f"dropout_seed must be a scalar; got dropout_seed.shape={seed.shape}")
    if not jnp.issubdtype(seed.dtype, jnp.integer):
        raise TypeError(f"dropout_seed must be an integer; got dtype {np.dtype(seed.dtype).name}")
    return _astype(seed, jnp.uint32)


def _prepare(
    q: Any,
    k: Any,
    v: Any,
    bias: Any,
    attention_mask: Any,
    q_segment_ids: Any,
    kv_segment_ids: Any,
    dropout_seed: Any,
    options: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _array(name, x)
        if len(x.shape) != 4:
            raise ValueError(
                f"{name} must have rank 4, [batch, seq, heads, head_dim]; got {name}.shape={x.shape}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating point; got dtype {np.dtype(x.dtype).name}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            "q, k and v must have one dtype; got "
            f"{np.dtype(q.dtype).name}, {np.dtype(k.dtype).name}, {np.dtype(v.dtype).name}"
        )
    batch, seq_q, heads, dim = q.shape
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have one shape; got k.shape={k.shape}, v.shape={v.shape}")
    _, seq_k, kv_heads, _ = k.shape
    if k.shape[0] != batch:
        raise ValueError(
            f"k and q must have one batch size; got q.shape={q.shape}, k.shape={k.shape}"
        )
    if k.shape[3] != dim:
        raise ValueError(
            f"k and q must have one head_dim; got q.shape={q.shape}, k.shape={k.shape}"
        )
    if min(seq_q, seq_k, heads, kv_heads, dim) < 1:
        raise ValueError(
            f"sequence lengths, heads and head_dim must be >= 1; got q.shape={q.shape}, "
            f"k.shape={k.shape}"
        )
    if heads % kv_heads:
        raise ValueError(
            f"kv_heads must divide heads (GQA/MQA); got heads={heads}, kv_heads={kv_heads}"
        )
    target = (batch, heads, seq_q, seq_k)
    if bias is not None:
        _array("bias", bias)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"bias must be floating point; got dtype {np.dtype(bias.dtype).name}")
        bias = _broadcast_4d("bias", bias, target)
    if attention_mask is not None:
        _array("attention_mask", attention_mask)
        if np.dtype(attention_mask.dtype) != np.bool_:
            raise TypeError(
                "attention_mask must be boolean (true where a key is visible); got dtype "
                f"{np.dtype(attention_mask.dtype).name}"
            )
        attention_mask = _broadcast_4d("attention_mask", attention_mask, target)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(
            "q_segment_ids and kv_segment_ids must be given together; got "
            f"q_segment_ids={'None' if q_segment_ids is None else 'an array'}, "
            f"kv_segment_ids={'None' if kv_segment_ids is None else 'an array'}"
        )
    if q_segment_ids is not None:
        for name, x, want in (
            ("q_segment_ids", q_segment_ids, (batch, seq_q)),
            ("kv_segment_ids", kv_segment_ids, (batch, seq_k)),
        ):
            _array(name, x)
            if tuple(x.shape) != want:
                raise ValueError(f"{name} must have shape {list(want)}; got {name}.shape={x.shape}")
            if not jnp.issubdtype(x.dtype, jnp.integer):
                raise TypeError(f"{name} must be integers; got dtype {np.dtype(x.dtype).name}")
        q_segment_ids = _astype(q_segment_ids, jnp.int32)
        kv_segment_ids = _astype(kv_segment_ids, jnp.int32)
    if options["dropout_prob"] > 0.0:
        if dropout_seed is None:
            raise ValueError(
                f"dropout_prob={options['dropout_prob']} needs a dropout_seed (an integer scalar); "
                "got dropout_seed=None"
            )
        dropout_seed = _seed(dropout_seed)
    else:
        dropout_seed = None  # unused: keep it out of the program and the key
    kwargs = {
        "attention_mask": attention_mask,
        "q_segment_ids": q_segment_ids,
        "kv_segment_ids": kv_segment_ids,
        "dropout_seed": dropout_seed,
        **options,
    }
    return (q, k, v, bias), kwargs


def _spec(
    bias: Any, attention_mask: Any, q_segment_ids: Any, options: dict[str, Any]
) -> AttentionSpec:
    return AttentionSpec(
        scale=options["softmax_scale"],
        causal=options["causal"],
        window=options["sliding_window"],
        soft_cap=options["logits_soft_cap"],
        dropout_prob=options["dropout_prob"],
        has_bias=bias is not None,
        has_mask=attention_mask is not None,
        has_segments=q_segment_ids is not None,
    )


# --- choosing a backend ----------------------------------------------------------------------------


def _is_hopper() -> bool:
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    return capability.split(".")[0] == "9"


def _variant_order(platform: str, shape: AttentionShape) -> list[AttentionBackend]:
    """The variants of ``platform``, the ones to prefer first."""
    table = _backend._variants.get(platform, {})
    names = list(table)
    first: tuple[str, ...] = ()
    if platform == "xla":
        first = (_xla.preferred_variant(shape),)
    elif platform == "pallas" and device_kind() == "gpu":
        first = ("mosaic", "triton") if _is_hopper() else ("triton",)
    ordered = [n for n in first if n in table] + [n for n in names if n not in first]
    return [table[n] for n in ordered]


# On a Hopper GPU, where ``auto``'s first choice is cuDNN, its heuristic runs the Mosaic forward
# (1.01-1.33x cuDNN's at every shape of the H100 and H200 tables). Training takes the Mosaic
# backward up to ``_own_backward_scores`` scores (B * KVH * Sq * Sk): at six shapes no shipped
# config covers, from 4x512x16x64 to 1x4096x32x128 with 8 kv heads, the Mosaic pair read
# 1.06-2.07x cuDNN's forward+backward on the H100 and 1.04-1.70x on the H200, and led cuDNN's
# backward kernel on the Mosaic forward at each (benchmarks/NOTES.md, twenty-sixth round). Above
# it training takes that hybrid (1x65536x16x128: 1.00-1.01x cuDNN, where the Mosaic backward reads
# 0.92-0.98x). Of the ten shipped shapes above 2^28 scores at head dim 128, the H100's tunes
# picked the hybrid by over 3% at five, and it ships at seven (from 2^33 scores wherever a tune read
# it ahead: benchmarks/tune_shipped.py's HYBRID_SCORES); the H200's at its four from 2^33 alone.
# At five unshipped shapes of 2^31-2^32 the H200 ran the Mosaic pair 0.4-3.1% ahead of the hybrid
# at four (over two runs at two of them; 1.3% behind at 1x16384x32x128 causal with 8 kv heads),
# where one program read up to 3.4% apart from itself in a run (fifty-second round); at 2^33
# (2x16384x16x128) the hybrid led the fused pair by 1.7% and 1.4% causal over 16 rounds side by
# side (seventy-eighth round). At head dim 64 the
# Mosaic backward trains at any size: the tuner picked it at every shipped shape on both GPUs,
# and the hybrid read 0.93-0.97x the Mosaic pair at four larger unshipped shapes on the H200. Where
# Mosaic cannot do the call, cuDNN trains and the Mosaic forward infers if it can. Tuned and
# shipped configs decide per shape; this is the heuristic for shapes they do not cover.
_MOSAIC = ("pallas", "mosaic")
_OWN_BACKWARD_HEAD_DIM = 64


def _own_backward_scores(gpu: str) -> int:
    """The most scores a call at a head dim over ``_OWN_BACKWARD_HEAD_DIM`` trains on the Mosaic
    backward in ``auto``'s Hopper heuristic on the GPU named ``gpu`` (a ``jax.Device``'s
    ``device_kind``): 2^32 on an H200, 2^28 on other Hopper GPUs."""
    return 2**32 if "H200" in gpu else 2**28


def _hopper_cfg(
    training: AttentionBackend, shape: AttentionShape, args: Sequence[Any], kwargs: dict[str, Any]
) -> AttentionConfig | None:
    """``auto``'s heuristic config on Hopper where its first choice is ``training``; None: that
    backend's heuristic config as it is."""
    # A window's backends come from _feature_backends, measured apart.
    if training.platform != "cudnn" or not _is_hopper() or shape.spec.window is not None:
        return None
    mosaic = backend_for(*_MOSAIC)
    if not _native(mosaic):
        return None
    fwd, own = mosaic.heuristic(shape)
    scores = shape.batch * shape.kv_heads * shape.seq_q * shape.seq_k
    gpu = str(jax.devices()[0].device_kind)
    if own.variant is None or own.variant in _backend.PORTABLE_VARIANTS:
        # The Mosaic backward cannot take the call (above head dim 128: its float32 dK and dV
        # live in registers), and the portable backward behind the Mosaic forward ran
        # forward+backward 0.37-0.39x cuDNN's pair at 2x4096x8x256 and 1x8192x16(8 kv)x256,
        # causal and not (results/features_NVIDIA_H200_20261201-003415.json). Causal, cuDNN's
        # backward kernel trains behind the Mosaic forward there (1.02x and 1.00x cuDNN's pair; the
        # forward 1.13x and 1.04x cuDNN's); without a mask cuDNN trains and infers (the Mosaic
        # forward 0.88x its).
        if not shape.spec.causal:
            return None
        bwd = BwdParams(variant=_backend.CUDNN_BWD)
    elif shape.head_dim <= _OWN_BACKWARD_HEAD_DIM or scores <= _own_backward_scores(gpu):
        bwd = own
    else:
        bwd = BwdParams(variant=_backend.CUDNN_BWD)
    if _refusal(mosaic, shape, args, kwargs, (fwd, bwd)) is None:
        return _config(mosaic, (fwd, bwd))
    if bwd != own and _refusal(mosaic, shape, args, kwargs, (fwd, own)) is None:
        return _inferring_on(training, shape, mosaic, (fwd, own))
    return None


# Calls with a feature that the Mosaic kernels refuse, or a window (only the Mosaic forward takes
# it), on Hopper: the backends that train and infer fastest, measured by benchmarks/features_gpu.py
# on an H200 (bf16, causal unless said; D is the head dim; results/features_NVIDIA_H200_20261128-*
# and 20261129-*.json, benchmarks/NOTES.md, forty-eighth and fiftieth rounds). Each ratio is to the
# fastest of the reading:
# - a soft cap: Triton (Pallas-Triton 0.92-0.93x at D = 64 on both kernels' feature blocks,
#   0.82-0.98x before them; forward 0.91x at 4x4096x16x128);
# - segment ids: Triton above D = 64 (Pallas-Triton 0.84-0.87x to train); Pallas-Triton at 64,
#   on its 64 x 64 backward (Triton 0.97-0.98x to train, forward 0.93x), except to train without
#   a mask, where Pallas-Triton keeps its wide blocks (0.91x Triton; forward 1.00x, Triton 0.97x);
# - a mask: to train, Triton above D = 64 (Pallas-Triton 0.83-0.91x, cuDNN 0.83-0.84x at 4x4096
#   and 2x8192 x16x128), Pallas-Triton at 64 (0.99-1.00x; Triton 0.90-0.98x, cuDNN 0.90-0.98x);
#   to infer, Triton above D = 64 causal (Pallas-Triton 0.98x, cuDNN 0.95-0.99x), Pallas-Triton
#   otherwise (0.99-1.00x; Triton 0.85x without a mask);
# - a bias: to train, Pallas-Triton causal or at D = 64 (Triton 0.82-0.96x, cuDNN 0.67-0.97x),
#   Triton otherwise (Pallas-Triton 0.88-0.99x); to infer, Pallas-Triton at D = 64 causal, Triton
#   otherwise (above 64 causal, on its 128 x 64 forward: Pallas-Triton 0.71-0.74x, cuDNN
#   0.81-0.84x; without a mask 0.99-1.00x). A float32 bias beside 16-bit inputs infers on Triton
#   at D = 64 causal too (Pallas-Triton 0.89-0.92x at 8x2048x32x64 in two runs, fifty-second
#   round); cuDNN refuses it (it would round it to 16 bits);
# - above D = 128 with a mask or a bias (2x4096x8x256 and 1x8192x16(8 kv)x256, causal and not):
#   Triton trains, its backward running dV and dK apart (cuDNN's pair 0.79-0.93x it,
#   results/features_NVIDIA_H200_20261201-030342.json, -030857.json; before that backward cuDNN's
#   pair had led, Triton 0.74-0.80x, -004435.json to -005635.json), and infers (cuDNN 0.55-0.69x,
#   Pallas-Triton 0.71-0.91x); the other features there stay as above (segment ids, dropout and a
#   soft cap train on Triton 1.00x, Pallas-Triton 0.82-0.90x);
# - dropout: Triton (causal, Pallas-Triton 0.94-0.97x, forward 0.96-1.00x; not causal 0.92-0.97x,
#   forward 0.81-0.95x at 4x4096x16x128 and 8x2048x32x64);
# - a window (sixty-third to sixty-fifth rounds; 8x2048x32x64, 2x8192x32(8 kv)x64, 4x4096x16x128,
#   2x8192x16x128 and 2x4096x8x256 causal, 4x4096x16x128 not causal; keys seen besides the
#   diagonal). The Mosaic forward takes a window, with the portable backward behind it, and infers
#   at every width (at D = 64 on its narrow-window blocks, 128 keys: Triton 0.93-0.95x at 128 to
#   512 keys, 0.92-0.94x at 1024 and 2048, cuDNN 0.77-0.89x; above D = 64 Triton 0.77-0.95x,
#   0.75-0.82x not causal, cuDNN 0.69-0.92x, 0.89x at D = 256). Up to D = 128 it trains on
#   Pallas-Triton's backward up to _MOSAIC_TRAINS_WINDOW keys (D = 64, to it: Triton 0.95-1.00x,
#   Pallas-Triton 0.97x, cuDNN 0.70-0.96x at 128 to 1024; the same backward as Pallas-Triton's
#   pair, behind a faster forward) or _MOSAIC_TRAINS_WIDE_WINDOW (D = 128: Triton 0.95x, cuDNN
#   0.92x at 256; at 128, on the narrow blocks, Triton 0.99x and cuDNN 0.90x). Wider, cuDNN's
#   backward kernel trains behind it (_MOSAIC_ON_CUDNN): on an H200 1.02-1.06x cuDNN's pair at
#   4x4096x16x128 causal with 512 to 4096 keys and at 2x8192x16x128 with 2048, 1.04x at
#   2x8192x32(8 kv)x64 with 4096 (cuDNN's pair 0.96x). At D = 256 cuDNN's pair trains (the Mosaic
#   forward on cuDNN's backward kernel 1.03x at 1024 keys, 0.98-0.99x at 2048; the portable
#   backward 0.42-0.48x; results/features_NVIDIA_H200_20261130-101720.json, -101912.json,
#   -121445.json to -122329.json). Where cuDNN refuses the window (right of the diagonal) Triton's
#   pair trains: the default order (the Mosaic forward on Pallas-Triton's backward) ran 0.88x it
#   at 2x4096x8x256 with 256 keys a side (-230058.json). At D = 128 the default order trains such
#   windows (Triton 0.94-0.95x at 4x4096x16x128 with 256 and 1024 a side).
# The first feature of the list above that a call has decides; where the inference backend refuses
# the call, the training one infers too, and where every training one refuses it (cuDNN, a window
# right of the diagonal or queries and keys of different lengths), the default order trains.
_TRITON = ("triton", "triton")
_PALLAS_TRITON = ("pallas", "triton")
_CUDNN = ("cudnn", "cudnn")
# A third name: the BwdParams.variant that trains behind the backend's forward.
_MOSAIC_ON_CUDNN = ("pallas", "mosaic", _backend.CUDNN_BWD)
_MOSAIC_TRAINS_WINDOW = 2048
_MOSAIC_TRAINS_WIDE_WINDOW = 256
# Float32 calls with a window on Hopper: the most keys a query may see for Triton's forward, and
# for its forward+backward (causal), to lead XLA's, as (up to head dim, keys) pairs; none above
# the last head dim (measured apart from the bf16 window rule).
_FLOAT32_TRITON_INFERS_KEYS = ((128, 1024), (256, 256))
_FLOAT32_TRITON_TRAINS_KEYS = ((64, 768), (128, 512))


def _window_limit(limits: tuple[tuple[int, int], ...], head_dim: int) -> int:
    """The keys ``limits`` (``(up to head dim, keys)`` pairs, narrowest first) allow a window at
    ``head_dim``; -1 above the widest."""
    return next((keys for dim, keys in limits if head_dim <= dim), -1)


def _feature_backends(
    shape: AttentionShape, wide_bias: bool
) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]] | None:
    """(training, inference) backends ``auto`` takes first on Hopper for this call, whose bias (if
    any) is ``wide_bias``: in a wider dtype than the inputs; training as the backends to try in
    order; None: the default order."""
    spec, wide, widest = shape.spec, shape.head_dim > 64, shape.head_dim > 128
    if spec.soft_cap is not None:
        return (_TRITON,), _TRITON
    if spec.has_segments:
        if wide:
            return (_TRITON,), _TRITON
        return (_PALLAS_TRITON if spec.causal else _TRITON,), _PALLAS_TRITON
    if spec.has_mask:
        return (_TRITON if wide else _PALLAS_TRITON,), (
            _TRITON if wide and (spec.causal or widest) else _PALLAS_TRITON
        )
    if spec.has_bias:
        training = _PALLAS_TRITON if (spec.causal and not widest) or not wide else _TRITON
        narrow_causal = spec.causal and not wide and not wide_bias
        return (training,), (_PALLAS_TRITON if narrow_causal else _TRITON)
    if spec.dropout_prob > 0.0:
        return (_TRITON,), _TRITON
    seen = spec.window_keys
    if seen is None:
        return None
    if widest:
        return (_CUDNN, _TRITON), _MOSAIC
    portable = _MOSAIC_TRAINS_WIDE_WINDOW if wide else _MOSAIC_TRAINS_WINDOW
    return (_MOSAIC if seen <= portable else _MOSAIC_ON_CUDNN,), _MOSAIC


def _float32_pallas_first(shape: AttentionShape) -> bool:
    """Whether Pallas-Triton leads Triton for this float32 call on a GPU. At head dims up to 64
    without a mask or a feature its forward on 128 x 64 blocks ran 1.09x Triton's best and
    forward+backward 1.02x (results/features_NVIDIA_H200_20261129-130441.json, 8x2048x32x64); at
    head dim 128 with a mask tensor forward 1.06x and forward+backward 1.06x (-131011.json,
    -132503.json, 4x4096x16x128 causal). Elsewhere Triton led or they ran even (NOTES.md,
    fifty-third and fifty-fourth rounds)."""
    features = shape.spec.features
    if shape.head_dim <= 64:
        return not features
    return shape.head_dim <= 128 and "attention_mask" in features


def _float32_triton_infers(shape: AttentionShape) -> bool:
    """Whether Triton's forward leads XLA's for this float32 call on Hopper (not decoding, which
    was measured apart). On an H200 it ran 1.19-1.49x XLA's dense forward and 1.13-1.54x the
    chunked one (on its heuristic's tiles) causal at head dim 64 (16x1024x16, 8x2048x32,
    4x4096x16, 2x8192x16; results/decode_NVIDIA_H200_20261130-004133.json, -005716.json). With a
    sliding window it leads while each query sees at most 1024 keys: 1.16-2.71x XLA's fastest
    tile at 256-1024 keys (causal at head dims 64 and 128, not causal at 128), 0.70-0.99x at
    2048-4096 (-025847.json to -030830.json); 2.23x its heuristic's at 8x2048x32x64 with 128 keys
    a side (-032612.json). At head dim 256, 1.24x with 256 keys causal (2x4096x8x256, -055451.json;
    wider not measured)."""
    spec = shape.spec
    if _backend.decoding_rows(shape) is not None:
        return False
    if spec.features == {"causal"}:
        return shape.head_dim <= 64
    if spec.window is None or not spec.features <= {"causal", "sliding_window"}:
        return False
    return spec.window_keys <= _window_limit(_FLOAT32_TRITON_INFERS_KEYS, shape.head_dim)


def _float32_triton_trains(shape: AttentionShape) -> bool:
    """Whether Triton's forward+backward leads XLA's for this float32 call on Hopper: causal with
    a window of at most 512 keys (768 at head dims up to 64) and nothing else, not decoding. On an
    H200 it ran 1.68x XLA's at 256 keys, 1.12x at 512 and 0.98x at 768 (2x8192x8x128); 1.95x at
    256 and 1.10x at 768 (2x8192x16x64), 1.74x at 512 (1x16384x16x64); XLA led 1.26x at 1024 keys,
    and 1.40x without the causal mask at 256 keys a side (4x4096x16x128;
    results/decode_NVIDIA_H200_20261130-030202.json, -031308.json to -032516.json, -055200.json).
    At head dim 256 XLA led 1.55x at 256 keys (2x4096x8x256, -055529.json)."""
    spec = shape.spec
    if spec.window is None or spec.features != {"causal", "sliding_window"}:
        return False
    if _backend.decoding_rows(shape) is not None:
        return False
    return spec.window_keys <= _window_limit(_FLOAT32_TRITON_TRAINS_KEYS, shape.head_dim)


def _float32_cfg(
    training: AttentionBackend,
    shape: AttentionShape,
    args: Sequence[Any],
    kwargs: dict[str, Any],
) -> AttentionConfig | None:
    """``auto``'s heuristic config on Hopper for a float32 call that trains on XLA (first for
    float32) where Triton's forward leads (:func:`_float32_triton_infers`): its forward on
    Triton. XLA trained 1.56x faster causal at 8x2048x32x64 (NOTES.md, fifty-ninth round) and
    1.26x with a causal window of 1024 keys at 2x8192x8x128 (-030202.json). None elsewhere."""
    if training.platform != "xla" or shape.dtype != "float32" or not _is_hopper():
        return None
    if not _float32_triton_infers(shape):
        return None
    triton = backend_for(*_TRITON)
    params = triton.heuristic(shape)
    if not _native(triton) or _refusal(triton, shape, args, kwargs, params) is not None:
        return None
    return _inferring_on(training, shape, triton, params)


def _feature_cfg(
    shape: AttentionShape,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    default: AttentionBackend,
) -> AttentionConfig | None:
    """``auto``'s heuristic config on Hopper for a call with a feature (:func:`_feature_backends`);
    None where no preference applies or no preferred backend can do the call. Where every training
    one refuses it (cuDNN, a window right of the diagonal), ``default`` trains."""
    if not _is_hopper() or shape.dtype == "float32":  # measured with 16-bit inputs
        return None
    if _backend.decoding_rows(shape) is not None:  # measured on longer queries
        return None
    bias = args[3]
    wide_bias = bias is not None and np.dtype(bias.dtype).itemsize > np.dtype(shape.dtype).itemsize
    preferred = _feature_backends(shape, wide_bias)
    if preferred is None:
        return None

    def taking(platform: str, variant: str, *bwd_variant: str) -> AttentionConfig | None:
        """The backend's heuristic config, if it runs here and takes the call."""
        backend = backend_for(platform, variant)
        params = backend.heuristic(shape)
        if bwd_variant:  # another backward kernel behind the backend's forward
            params = (params[0], BwdParams(variant=bwd_variant[0]))
        if not _native(backend) or _refusal(backend, shape, args, kwargs, params) is not None:
            return None
        return _config(backend, params)

    trainers, inferring = preferred
    training = next(filter(None, (taking(*names) for names in trainers)), None)
    inference = taking(*inferring)
    if training is None and inference is None:
        return None
    if training is None:
        training = _config(default, default.heuristic(shape))
    if inference is None or _same_forward(inference, training):
        return training
    return dataclasses.replace(training, inference=inference)


def _same_forward(a: AttentionConfig, b: AttentionConfig) -> bool:
    """Whether two configs run the same forward (whatever trains behind it)."""
    return (a.platform, a.variant, a.fwd) == (b.platform, b.variant, b.fwd)


def _native(backend: AttentionBackend) -> bool:
    return device_kind() in backend.devices and backend.available()


def _interpret(backend: AttentionBackend) -> bool:
    return device_kind() not in backend.devices


def _refusal(
    backend: AttentionBackend,
    shape: AttentionShape,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    params: tuple[FwdParams, BwdParams],
) -> str | None:
    """Why ``backend`` cannot do this call (tracing both passes abstractly), or None if it can."""
    spec = shape.spec
    try:
        backend.check(spec, *params)
        q, k, v, bias = args
        arrays = (
            q,
            k,
            v,
            bias,
            kwargs["attention_mask"],
            kwargs["q_segment_ids"],
            kwargs["kv_segment_ids"],
            kwargs["dropout_seed"],
        )
        interpret = _interpret(backend)
        fwd = functools.partial(backend.fwd, spec=spec, params=params[0], interpret=interpret)
        out, lse = jax.eval_shape(fwd, *arrays)
        bwd = functools.partial(backend.bwd, spec=spec, params=params[1], interpret=interpret)
        jax.eval_shape(bwd, *arrays, out, lse, out)
    except NotImplementedError as exc:
        return f"{backend.platform}/{backend.variant}: {exc}"
    return None


def _config(backend: AttentionBackend, params: tuple[FwdParams, BwdParams]) -> AttentionConfig:
    return AttentionConfig(
        platform=backend.platform, variant=backend.variant, fwd=params[0], bwd=params[1]
    )


def _inferring_on(
    training: AttentionBackend,
    shape: AttentionShape,
    inference: AttentionBackend,
    params: tuple[FwdParams, BwdParams],
) -> AttentionConfig:
    """``training``'s heuristic config whose forward outside of training runs ``inference``."""
    trains = _config(training, training.heuristic(shape))
    return dataclasses.replace(trains, inference=_config(inference, params))


def _resolve(cfg: AttentionConfig, spec: AttentionSpec, shape: AttentionShape) -> AttentionBackend:
    """The backend a config names; refuses (NotImplementedError) features it lacks."""
    if cfg.variant is not None:
        backend = backend_for(cfg.platform, cfg.variant)
    else:
        backend_for(cfg.platform)  # a clear error for unknown platforms
        order = _variant_order(cfg.platform, shape)
        order.sort(key=lambda b: not _native(b))  # stable: native ones first
        backend = next((b for b in order if not spec.features & b.unsupported), order[0])
    backend.check(spec, cfg.fwd, cfg.bwd)
    return backend


# --- the kernel ------------------------------------------------------------------------------------


class _Saved(eqx.Module):
    """Residuals of the forward pass: the arrays the backward needs and, as static data, the spec."""

    arrays: tuple[Any, ...]
    spec: AttentionSpec = eqx.field(static=True)
    platform: str = eqx.field(static=True)
    variant: str = eqx.field(static=True)
    interpret: bool = eqx.field(static=True)


class FlashAttention(Kernel[AttentionConfig, jax.Array]):
    """Flash attention as a kernel module; :func:`flash_attention` is the function form.

    Call it as ``FlashAttention()(q, k, v, bias=None, *, attention_mask=None, q_segment_ids=None,
    kv_segment_ids=None, softmax_scale=None, causal=False, sliding_window=None,
    logits_soft_cap=None, dropout_prob=0.0, dropout_seed=None)`` (see :func:`flash_attention`).

    ``platform`` (static) is ``"auto"`` or a registered platform: with ``"auto"``, selection chooses
    among the backends native to the device that can do the call (GPU: cuDNN, then Pallas with Mosaic
    GPU first on Hopper, then Triton, then XLA; on Hopper, where the pick is cuDNN, the Mosaic forward
    with the Mosaic backward for small calls and cuDNN's backward kernel for large ones, and with a
    soft cap, segment ids, a mask, a bias, causal dropout or (at head dim 64) a window up to 1024
    keys wide the backends measured fastest with it; CPU: XLA dense for short sequences, chunked
    for long);
    with a platform, among that platform's variants (ones not native to the device run in their
    interpreter: that is how the CPU tests run them). ``cfg`` (static) is an :class:`AttentionConfig`;
    a config whose backend cannot do the call's features raises ``NotImplementedError`` at trace
    time. ``q``, ``k``, ``v`` and ``bias`` are differentiable; masks, segment ids and the seed are not.

    >>> import jax.numpy as jnp
    >>> attn = FlashAttention(platform="xla")
    >>> attn(jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 1, 8)), jnp.ones((1, 4, 1, 8))).shape
    (1, 4, 2, 8)
    """

    platform: str = eqx.field(static=True, default="auto")

    name = "flash_attention"
    version = "1"

    def __check_init__(self) -> None:
        known = _backend.platforms()
        if self.platform != "auto" and self.platform not in known:
            raise ValueError(
                f"platform must be 'auto' or a registered attention platform {known}; "
                f"got platform={self.platform!r}"
            )

    # --- arguments ---

    def prepare(
        self,
        q: Any,
        k: Any,
        v: Any,
        bias: Any = None,
        *,
        attention_mask: Any = None,
        q_segment_ids: Any = None,
        kv_segment_ids: Any = None,
        dropout_seed: Any = None,
        softmax_scale: Any = None,
        causal: Any = False,
        sliding_window: Any = None,
        logits_soft_cap: Any = None,
        dropout_prob: Any = 0.0,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Validate the call and put it in canonical form (errors name the offending value).

        Returns ``(q, k, v, bias)`` with ``bias`` as ``[B|1, H|1, Sq, Sk]``, and keywords with every
        option present: arrays (mask broadcast like the bias, int32 segment ids, a uint32 seed or
        None when there is no dropout) and static options (the default scale filled in, a window as
        a ``(left, right)`` pair).
        """
        if not hasattr(q, "shape") or len(q.shape) < 1:
            _array("q", q)
            raise ValueError(f"q must have rank 4, [batch, seq, heads, head_dim]; got {q.shape}")
        options = _options(
            q.shape[-1], softmax_scale, causal, sliding_window, logits_soft_cap, dropout_prob
        )
        return _prepare(
            q, k, v, bias, attention_mask, q_segment_ids, kv_segment_ids, dropout_seed, options
        )

    # --- computing ---

    def fwd(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        bias: jax.Array | None = None,
        *,
        cfg: AttentionConfig,
        attention_mask: jax.Array | None = None,
        q_segment_ids: jax.Array | None = None,
        kv_segment_ids: jax.Array | None = None,
        dropout_seed: jax.Array | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        sliding_window: int | tuple[int, int] | None = None,
        logits_soft_cap: float | None = None,
        dropout_prob: float = 0.0,
        residuals: bool = True,
    ) -> tuple[jax.Array, _Saved]:
        """The output and the residuals of the backward pass, on the backend ``cfg`` names.
        ``residuals=False`` (calls that nothing differentiates) runs the backend's forward
        without its log-sum-exp where it has one (cuDNN's); the residuals are then empty."""
        if not isinstance(cfg, AttentionConfig):
            raise TypeError(f"cfg must be an AttentionConfig; got {type(cfg).__name__}: {cfg!r}")
        options = _options(
            q.shape[-1], softmax_scale, causal, sliding_window, logits_soft_cap, dropout_prob
        )
        spec = _spec(bias, attention_mask, q_segment_ids, options)
        backend = _resolve(cfg, spec, AttentionShape.of(q, k, spec))
        interpret = _interpret(backend)
        arrays = (q, k, v, bias, attention_mask, q_segment_ids, kv_segment_ids, dropout_seed)
        if not residuals and backend.infer is not None:
            out = backend.infer(*arrays, spec=spec, params=cfg.fwd, interpret=interpret)
            return out, _Saved((), spec, backend.platform, backend.variant, interpret)
        out, lse = backend.fwd(*arrays, spec=spec, params=cfg.fwd, interpret=interpret)
        saved = _Saved((*arrays, out, lse), spec, backend.platform, backend.variant, interpret)
        return out, saved

    def bwd(self, saved: _Saved, dout: jax.Array, *, cfg: AttentionConfig) -> dict[int, Any]:
        """Gradients of ``q``, ``k``, ``v`` and ``bias`` (positions 0 to 3)."""
        if not saved.arrays:
            raise ValueError(
                "these residuals come from fwd(..., residuals=False), which keeps none; call fwd "
                "with residuals=True for a backward"
            )
        backend = backend_for(saved.platform, saved.variant)
        dq, dk, dv, dbias = backend.bwd(
            *saved.arrays, dout, spec=saved.spec, params=cfg.bwd, interpret=saved.interpret
        )
        return {0: dq, 1: dk, 2: dv, 3: dbias}

    def inference(self, *args: Any, cfg: AttentionConfig, **kwargs: Any) -> jax.Array:
        """The output of a call that nothing differentiates: on ``cfg.inference`` where set."""
        return self.fwd(*args, cfg=cfg.inference or cfg, residuals=False, **kwargs)[0]

    def run(self, *args: Any, cfg: AttentionConfig, **kwargs: Any) -> jax.Array:
        return self.inference(*args, cfg=cfg, **kwargs)

    # --- configs ---

    def _call_of(self, inv: Invocation) -> tuple[AttentionShape, tuple[Any, ...], dict[str, Any]]:
        args = tuple(inv.args) + (None,) * (4 - len(inv.args))
        kwargs = dict(inv.kwargs)
        options = {
            name: kwargs.get(name, default)
            for name, default in (
                ("softmax_scale", None),
                ("causal", False),
                ("sliding_window", None),
                ("logits_soft_cap", None),
                ("dropout_prob", 0.0),
            )
        }
        options = _options(args[0].shape[-1], **options)
        for name in ("attention_mask", "q_segment_ids", "kv_segment_ids", "dropout_seed"):
            kwargs.setdefault(name, None)
        spec = _spec(args[3], kwargs["attention_mask"], kwargs["q_segment_ids"], options)
        return AttentionShape.of(args[0], args[1], spec), args, kwargs

    def _auto_backends(
        self,
        shape: AttentionShape,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        first: bool = False,
        decoding: bool = True,
    ) -> tuple[list[AttentionBackend], list[str]]:
        """Native backends that can do the call, best first (``first``: the best alone); and why
        not. ``decoding``: in decoding's order where the call decodes (the best forward there)."""
        kind = device_kind()
        order = list(_AUTO_ORDER.get(kind, ()))
        if shape.dtype == "float32":
            if _float32_triton_trains(shape) and _is_hopper():
                table = _AUTO_ORDER_FLOAT32_TRITON
            elif _float32_pallas_first(shape):
                table = _AUTO_ORDER_FLOAT32_PALLAS
            else:
                table = _AUTO_ORDER_FLOAT32
            order = list(table.get(kind, order))
        elif decoding and _backend.decoding_rows(shape) is not None:  # float32 decodes on XLA too
            order = list(_AUTO_ORDER_DECODING.get(kind, order))
        order += [p for p in _backend.platforms() if p not in order]
        chosen: list[AttentionBackend] = []
        reasons: list[str] = []
        for platform in order:
            for backend in _variant_order(platform, shape):
                if not _native(backend):
                    continue
                why = _refusal(backend, shape, args, kwargs, backend.heuristic(shape))
                if why is None:
                    chosen.append(backend)
                    if first:
                        return chosen, reasons
                else:
                    reasons.append(why)
        return chosen, reasons

    def _platform_backends(self, shape: AttentionShape) -> list[AttentionBackend]:
        """The variants of the kernel's platform, those that can do the features (and native) first."""
        order = _variant_order(self.platform, shape)
        order.sort(key=lambda b: (bool(shape.spec.features & b.unsupported), not _native(b)))
        return order

    def heuristic_cfg(self, inv: Invocation) -> AttentionConfig:
        """A config without measuring: the best backend for the device (see the class doc)."""
        shape, args, kwargs = self._call_of(inv)
        if self.platform == "auto":
            # A decoding call infers on decoding's best, and trains there too if its queries are
            # few; other calls train and infer in their own order.
            decodes = _backend.decoding_rows(shape) is not None
            trains_decoding = decodes and shape.seq_q <= _TRITON_TRAINS_QUERIES
            chosen, reasons = self._auto_backends(
                shape, args, kwargs, first=True, decoding=trains_decoding
            )
            if not chosen:
                raise NotImplementedError(
                    f"no attention backend on {device_kind()!r} can do this call: "
                    + "; ".join(reasons)
                )
            backend = chosen[0]
            preferred = (
                _feature_cfg(shape, args, kwargs, backend)
                or _hopper_cfg(backend, shape, args, kwargs)
                or _float32_cfg(backend, shape, args, kwargs)
            )
            cfg = preferred or _config(backend, backend.heuristic(shape))
            if not decodes or trains_decoding:
                return cfg
            (decoder,), _ = self._auto_backends(shape, args, kwargs, first=True)
            if decoder == backend_for(cfg.platform, cfg.variant):
                return cfg
            return dataclasses.replace(cfg, inference=_config(decoder, decoder.heuristic(shape)))
        backend = self._platform_backends(shape)[0]
        return _config(backend, backend.heuristic(shape))

    def reference_kernel(self, inv: Invocation) -> FlashAttention:
        """The XLA platform on its heuristic config (dense, or chunked where the scores would not
        fit): the tuner checks every candidate's outputs and gradients against it."""
        xla = _kernel("xla")
        return self.with_cfg(xla.heuristic_cfg(inv))

    def candidate_cfgs(self, inv: Invocation) -> Sequence[AttentionConfig]:
        """Configs to tune: every candidate of every backend that can do the call."""
        shape, args, kwargs = self._call_of(inv)
        if self.platform == "auto":
            backends, reasons = self._auto_backends(shape, args, kwargs)
            if not backends:
                raise NotImplementedError(
                    f"no attention backend on {device_kind()!r} can do this call: "
                    + "; ".join(reasons)
                )
        else:
            backends = self._platform_backends(shape)
            supporting = [b for b in backends if not shape.spec.features & b.unsupported]
            backends = supporting or backends[:1]
        cfgs: list[AttentionConfig] = []
        for backend in backends:
            for params in backend.candidates(shape):
                cfg = _config(backend, params)
                if cfg not in cfgs:
                    cfgs.append(cfg)
        return cfgs


@functools.cache
def _kernel(platform: str) -> FlashAttention:
    # One module per platform, so that eager calls hit the framework's per-kernel memo.
    return FlashAttention(platform=platform)


def flash_attention(
    q: Float[Array, "batch seq_q heads head_dim"],
    k: Float[Array, "_batch _seq_k _kv_heads _head_dim"],
    v: Float[Array, "_batch _seq_k _kv_heads _head_dim"],
    bias: Float[Array, "*_bias"] | None = None,
    *,
    attention_mask: Bool[Array, "*_mask"] | None = None,
    q_segment_ids: Integer[Array, "_batch _seq_q"] | None = None,
    kv_segment_ids: Integer[Array, "_batch _seq_k"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: Integer[Array, ""] | int | None = None,
    platform: str = "auto",
    cfg: AttentionConfig | None = None,
) -> Float[Array, "batch seq_q heads head_dim"]:
    """Attention, ``softmax(q k^T * scale + bias) v``, without the full score matrix where it can.

    Semantics (identical on every platform): see ``ejkfn.attention._spec``. In short: a soft cap
    ``cap * tanh(s / cap)`` applies to the scaled scores before the bias; query row ``i`` sits at
    position ``i + seq_k - seq_q`` (bottom-right alignment); a row that sees no key outputs zeros.

    Args:
        q: queries ``[batch, seq_q, heads, head_dim]``.
        k, v: keys and values ``[batch, seq_k, kv_heads, head_dim]``; ``kv_heads`` must divide
            ``heads`` (GQA; MQA with one kv head): query head ``h`` uses kv head
            ``h // (heads // kv_heads)``.
        bias: added to the scores; any shape that broadcasts to ``[batch, heads, seq_q, seq_k]``.
            Differentiable.
        attention_mask: boolean, true where a key is visible; broadcasts like ``bias``.
        q_segment_ids, kv_segment_ids: integer ``[batch, seq_q]`` and ``[batch, seq_k]``, given
            together: a query sees only keys of its own segment (packed sequences).
        softmax_scale: multiplies ``q k^T``; default ``1 / sqrt(head_dim)``.
        causal: a query sees no key after its own position.
        sliding_window: ``(left, right)``: a query at position ``p`` sees keys in
            ``[p - left, p + right]``; an int ``w`` means ``(w, w)`` (as in
            ``jax.nn.dot_product_attention``'s ``local_window_size``).
        logits_soft_cap: ``cap > 0``: scores become ``cap * tanh(s / cap)``.
        dropout_prob: probability of dropping an attention weight, 0 or in ``[2^-16, 1)``
            (rounded down to a multiple of 2^-16); kept weights are scaled by one over the rate
            kept. Needs ``dropout_seed``.
        dropout_seed: integer scalar; the same seed drops the same weights on every platform (a
            counter-based hash, recomputed in the backward pass).
        platform: ``"auto"`` (selection chooses per device and shape) or ``"xla"``, ``"pallas"``,
            ``"triton"``, ``"cudnn"``.
        cfg: an explicit :class:`AttentionConfig` (it wins over selection; its platform must agree
            with ``platform`` unless that is ``"auto"``).

    Every option other than the arrays is static: it is part of the cache key and of the compiled
    program. A platform that cannot do a requested feature raises ``NotImplementedError`` at trace
    time; ``"auto"`` skips it. Head dims that a backend's tiles need rounded up (e.g. 80 or 96 for
    power-of-two tiles) are padded by that backend, not here; XLA needs no padding.

    Returns:
        ``[batch, seq_q, heads, head_dim]`` in the dtype of ``q``.

    >>> import jax, jax.numpy as jnp, ejkfn
    >>> q = jax.random.normal(jax.random.key(0), (1, 16, 4, 32))
    >>> kv = jax.random.normal(jax.random.key(1), (1, 16, 2, 32))
    >>> ejkfn.flash_attention(q, kv, kv, causal=True).shape
    (1, 16, 4, 32)
    >>> loss = lambda q: ejkfn.flash_attention(q, kv, kv, sliding_window=(4, 0)).sum()
    >>> jax.grad(loss)(q).shape
    (1, 16, 4, 32)
    """
    if cfg is not None:
        if not isinstance(cfg, AttentionConfig):
            raise TypeError(f"cfg must be an AttentionConfig; got {type(cfg).__name__}: {cfg!r}")
        cfg.check_platform(platform)
    if not isinstance(platform, str):
        raise TypeError(f"platform must be a str; got {platform!r}")
    if isinstance(dropout_seed, (int, np.integer)) and not isinstance(dropout_seed, bool):
        dropout_seed = _seed(dropout_seed)  # an array: eager calls then do not compile per seed
    return _kernel(platform)(
        q,
        k,
        v,
        bias,
        attention_mask=attention_mask,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        softmax_scale=softmax_scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        dropout_prob=dropout_prob,
        dropout_seed=dropout_seed,
        cfg=cfg,
    )
