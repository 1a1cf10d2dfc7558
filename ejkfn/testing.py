"""Small kernels for examples, tests and the built-in tuning workload."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._invocation import Invocation
from ._kernel import Kernel

__all__ = ["Scale", "ScaleCfg"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ScaleCfg:
    """Rows processed per step of :class:`Scale` (it changes speed, never the result)."""

    block: int

    def __post_init__(self) -> None:
        if self.block < 1:
            raise ValueError(f"{self.block=} must be >= 1")


class Scale(Kernel[ScaleCfg, jax.Array]):
    """``factor * x``, computed in row blocks of ``cfg.block`` (a stand-in for a real tiled kernel).

    ``factor`` is a static field: it is part of the key and of the compiled program.

    >>> import jax.numpy as jnp
    >>> float(Scale(factor=3.0)(jnp.ones((2, 2)))[0, 0])
    3.0
    """

    factor: float = eqx.field(static=True, default=2.0)

    name = "scale"
    version = "1"

    def run(self, x: Float[Array, "rows cols"], *, cfg: ScaleCfg) -> Float[Array, "rows cols"]:
        rows = x.shape[0]
        if rows % cfg.block:
            raise ValueError(f"{cfg.block=} must divide {rows=}")
        blocks = x.reshape(rows // cfg.block, cfg.block, *x.shape[1:])
        out = jax.lax.map(lambda b: b * jnp.asarray(self.factor, x.dtype), blocks)
        return out.reshape(x.shape)

    def heuristic_cfg(self, inv: Invocation) -> ScaleCfg:
        rows = inv.args[0].shape[0]
        return ScaleCfg(block=max(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if rows % b == 0))

    def candidate_cfgs(self, inv: Invocation) -> Sequence[ScaleCfg]:
        rows = inv.args[0].shape[0]
        return [ScaleCfg(block=b) for b in (1, 2, 4, 8, 16, 32, 64, 128) if rows % b == 0]
