"""Programs lowered for CUDA on a machine without a GPU, read as text."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax

_CUDNN_FORWARD = re.compile(r"%\S+?:(\d+) = stablehlo.custom_call @__cudnn\$fmhaSoftmax\(")


def cudnn_forward_results(fn: Callable[..., Any], *args: Any) -> set[int]:
    """How many results each cuDNN attention forward in ``fn``'s program has, lowered for CUDA:
    2 (the output and a workspace) or 3 (the softmax statistics too). Needs the
    ``cudnn_lowering`` fixture."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return {int(n) for n in _CUDNN_FORWARD.findall(text)}
