"""The static description of an attention call that every backend implements.

Semantics (identical on every platform, so each is tested against one reference):

- ``s = (q @ k^T) * scale`` in float32; then ``s = cap * tanh(s / cap)`` when ``logits_soft_cap``;
  then ``s = s + bias`` when a bias is given.
- Query row ``i`` sits at position ``i + (seq_k - seq_q)`` (bottom-right alignment, as in
  FlashAttention 2), so with ``seq_q != seq_k`` the last query sees the last key.
- A key ``j`` is visible to query row ``i`` (position ``p``) when all of: ``causal`` -> ``j <= p``;
  a window ``(left, right)`` -> ``p - left <= j <= p + right``; segment ids -> ``q_seg[i] == kv_seg[j]``;
  ``attention_mask[..., i, j]`` is true.
- A row with no visible key outputs zeros, and its log-sum-exp is ``-inf``.
- Dropout drops at ``p`` rounded down to a multiple of 2^-16 with the counter-based hash of
  :mod:`._dropout`, scales kept weights by one over the rate it keeps (``keep_scale``), and is
  applied to the softmax weights (the log-sum-exp is unaffected).
- GQA: query head ``h`` uses key/value head ``h // (heads // kv_heads)``.

Backend contract (each ``_<platform>.py`` module):

``fwd(q, k, v, bias, mask, q_seg, kv_seg, seed, *, spec, params) -> (out, lse)``
  q ``[B, Sq, H, D]``, k/v ``[B, Sk, KVH, D]``, bias ``[B|1, H|1, Sq, Sk]`` or None, mask bool of the same
  broadcastable shape or None, q_seg ``[B, Sq]`` int32 / kv_seg ``[B, Sk]`` int32 or None, seed a uint32
  scalar array or None; out like q, lse ``[B, H, Sq]`` float32.
``bwd(q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse, dout, *, spec, params) -> (dq, dk, dv, dbias)``
  dbias shaped like bias (summed over broadcast dimensions), None without a bias.
``infer(q, k, v, bias, mask, q_seg, kv_seg, seed, *, spec, params) -> out`` (optional)
  ``fwd``'s output alone, for calls that nothing differentiates, where that is cheaper (cuDNN's).
A backend that cannot do a feature raises ``NotImplementedError`` naming it, at trace time.
"""

from __future__ import annotations

import dataclasses
import math

from ._dropout import MIN_RATE

__all__ = ["AttentionSpec"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AttentionSpec:
    """Everything static about an attention call (it decides the compiled program)."""

    scale: float
    causal: bool = False
    window: tuple[int, int] | None = None  # (left, right); None for unlimited
    soft_cap: float | None = None
    dropout_prob: float = 0.0
    has_bias: bool = False
    has_mask: bool = False
    has_segments: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.scale, float) and math.isfinite(self.scale)):
            raise ValueError(f"softmax scale must be a finite float; got {self.scale!r}")
        if self.window is not None:
            left, right = self.window
            if left < 0 or right < 0:
                raise ValueError(f"sliding_window sides must be >= 0; got {self.window!r}")
        if self.soft_cap is not None and not self.soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be > 0; got {self.soft_cap!r}")
        if not 0.0 <= self.dropout_prob < 1.0:
            raise ValueError(f"dropout_prob must be in [0, 1); got {self.dropout_prob!r}")
        if 0.0 < self.dropout_prob < MIN_RATE:
            raise ValueError(
                f"dropout_prob={self.dropout_prob!r} is below 2^-16 ({MIN_RATE:.4g}), the finest "
                "rate dropout's 16-bit decisions resolve, and would drop nothing; pass 0.0 or a "
                "rate of at least 2^-16"
            )

    @property
    def window_keys(self) -> int | None:
        """The keys a window lets each query see besides its own: its left side when causal (the
        right one lies past the diagonal), both sides otherwise; None without a window."""
        if self.window is None:
            return None
        left, right = self.window
        return left + (0 if self.causal else right)

    @property
    def features(self) -> frozenset[str]:
        """Names of the features this call uses (what a backend may have to refuse)."""
        used = {
            "causal": self.causal,
            "sliding_window": self.window is not None,
            "logits_soft_cap": self.soft_cap is not None,
            "dropout": self.dropout_prob > 0.0,
            "bias": self.has_bias,
            "attention_mask": self.has_mask,
            "segment_ids": self.has_segments,
        }
        return frozenset(name for name, on in used.items() if on)
