"""The environment for Python child processes started by tests."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child on the CPU with ejkfn importable and one host device."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **extra}
    env.pop("XLA_FLAGS", None)
    return env
