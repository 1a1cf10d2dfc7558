"""Config dataclasses for tests, importable (as ``tests._cfgs``) by test subprocesses too."""

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BlockCfg:
    """A small kernel config."""

    block_q: int = 128
    block_k: int = 64
    num_warps: int = 4


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NestedCfg:
    """A config with a tuple and a nested config field."""

    inner: BlockCfg = BlockCfg()
    stages: tuple[int, ...] = (1, 2)
    name: str = "fwd"
