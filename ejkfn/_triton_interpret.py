"""Run ``@triton.jit`` kernels from JAX: compiled through jax-triton on a GPU, or in Triton's
interpreter inside ``jax.pure_callback`` anywhere else (CPU tests).

Triton chooses between compiling and interpreting when a function is decorated, and its own library
functions (``tl.zeros``, ``tl.max``, ...) are decorated when ``triton`` is first imported. So the
mode is a property of the process: :func:`import_triton` sets ``TRITON_INTERPRET=1`` before the first
``import triton`` when interpretation is asked for, and raises a clear error when ``triton`` was
already imported in the other mode. Kernel modules are imported through :func:`load_kernels`, never
at the top of a module, so importing ejkfn does not fix the mode.

The interpreter expects torch-like tensors; :class:`HostArray` gives a numpy array the few methods it
uses. Kernels follow jax-triton's calling convention in both modes: inputs (arrays and Python
scalars) in order, then one pointer per output, then ``tl.constexpr`` keywords.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import jax
import numpy as np

__all__ = [
    "HostArray",
    "default_interpret",
    "import_triton",
    "launch",
    "load_kernels",
]

_ENV = "TRITON_INTERPRET"


def default_interpret(interpret: bool | None) -> bool:
    """``interpret`` itself, or (for None) whether JAX's default backend has no GPU."""
    if interpret is None:
        return jax.default_backend() not in ("gpu", "cuda", "rocm")
    return bool(interpret)


def _is_interpreting(triton: ModuleType) -> bool:
    # What counts is how triton.language's own helpers were decorated at import, not the
    # environment now: a compiled tl.zeros cannot be called from interpreted code.
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton.language.standard.zeros, InterpretedFunction)


def import_triton(interpret: bool) -> ModuleType:
    """Import ``triton`` for compiled (``False``) or interpreted (``True``) kernels.

    Raises:
        RuntimeError: ``triton`` was already imported in the other mode in this process.
    """
    if interpret and "triton" not in sys.modules:
        os.environ[_ENV] = "1"
    import triton

    if _is_interpreting(triton) != interpret:
        if interpret:
            raise RuntimeError(
                "Triton kernels must run in Triton's interpreter here (no GPU), but `triton` was "
                f"imported in this process without {_ENV}=1. Set {_ENV}=1 in the environment "
                "before anything imports triton (for pytest: `os.environ.setdefault("
                f'"{_ENV}", "1")` at the top of conftest.py), or pass interpret=False on a GPU.'
            )
        raise RuntimeError(
            f"Compiled Triton kernels were asked for, but this process imported `triton` with "
            f"{_ENV}=1 (interpreter mode). Unset {_ENV} before triton is imported to run on the GPU."
        )
    if interpret:
        _patch_interpreter()
    return triton


def load_kernels(module: str, interpret: bool) -> ModuleType:
    """Import the kernel module ``module`` (absolute name) after fixing Triton's mode."""
    import_triton(interpret)
    return importlib.import_module(module)


_PATCHED = False


def _patch_interpreter() -> None:
    """Two fixes to Triton 3.6's interpreter (and a speed-up), once, in interpreter mode only.

    - ``range(lo, hi)`` with runtime bounds (causal block skipping depends on ``tl.program_id``): the
      interpreter converts a scalar tensor (a one-element array) with ``int(array)``, which numpy 2.5
      refuses for ``ndim > 0``; ``.item()`` is what was meant.
    - ``tl.dot`` on bfloat16: the interpreter keeps bfloat16 as raw ``uint16`` bits and multiplies
      those; widen them to float32 first (exact: a bfloat16 is the top half of a float32).
    """
    global _PATCHED
    if _PATCHED:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original_patch = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    original_dot = interpreter.InterpreterBuilder.create_dot

    def widen(h: Any) -> Any:
        if h.dtype.scalar != tl.bfloat16:
            return h
        bits = h.data.astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self: Any, a: Any, b: Any, *args: Any) -> Any:
        return original_dot(self, widen(a), widen(b), *args)

    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter.InterpreterBuilder.create_dot = create_dot
    # The overflow sanitizer redoes every integer add/sub/mul in int64 to feed a device_assert that
    # exists only with debug=True; without debug (the interpreter's default) it is a third of the
    # run time for nothing.
    builder = interpreter.interpreter_builder
    if not builder.options.debug:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    _PATCHED = True


class HostArray:
    """A numpy array as the Triton interpreter wants a tensor: ``data_ptr()``, ``dtype`` and the
    storage methods it calls to copy device tensors to the host (here all no-ops: the data is
    already on the host, and the kernel writes outputs in place)."""

    def __init__(self, array: np.ndarray):
        if not array.flags.c_contiguous:
            raise ValueError("HostArray needs a C-contiguous array")
        self.array = array
        self.dtype = array.dtype.name  # triton maps "float32", "bfloat16", ... by name

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> HostArray:
        return self

    def cpu(self) -> HostArray:
        return self

    def new_empty(self, *args: Any, **kwargs: Any) -> HostArray:
        return self

    def set_(self, *args: Any) -> HostArray:
        return self

    def copy_(self, other: Any) -> HostArray:
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)


Grid = tuple[int, ...]


def launch(
    kernel: Any,
    *args: jax.Array | int | float | bool,
    grid: Grid,
    out_shapes: Sequence[jax.ShapeDtypeStruct],
    num_warps: int,
    num_stages: int,
    interpret: bool,
    zeroed: Sequence[int] = (),
    **constexprs: Any,
) -> tuple[jax.Array, ...]:
    """Call ``kernel[grid](*args, *outputs, **constexprs)`` on JAX arrays; returns the outputs.

    The outputs numbered in ``zeroed`` start as zeros (for kernels that leave parts unwritten, e.g.
    score-gradient tiles that causal block skipping never visits); the others start undefined on a
    GPU (the interpreter zeroes all).

    On a GPU this is ``jax_triton.triton_call`` (imported here: it fails to import without a GPU
    plugin). With ``interpret`` it is a ``jax.pure_callback`` that runs the kernel in Triton's
    interpreter on host copies, so it works under ``jit`` and ``vmap`` (one call per batch element).
    """
    out_shapes = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shapes)
    is_array = [not isinstance(a, (bool, int, float)) for a in args]
    arrays = [a for a, arr in zip(args, is_array, strict=True) if arr]
    if not interpret:
        import jax_triton

        # triton_call has no batching rule; under vmap the kernel runs once per mapped element.
        @jax.custom_batching.sequential_vmap
        def compiled(*device_arrays: jax.Array) -> tuple[jax.Array, ...]:
            it = iter(device_arrays)
            call = [next(it) if arr else a for a, arr in zip(args, is_array, strict=True)]
            outs = jax_triton.triton_call(
                *call,
                kernel=kernel,
                out_shape=out_shapes,
                grid=grid,
                num_warps=num_warps,
                num_stages=num_stages,
                zeroed_outputs=tuple(zeroed),
                **constexprs,
            )
            return tuple(outs)

        return tuple(compiled(*arrays))

    def host(*host_arrays: Any) -> tuple[np.ndarray, ...]:
        it = iter(host_arrays)
        call = [
            HostArray(np.ascontiguousarray(next(it))) if arr else a
            for a, arr in zip(args, is_array, strict=True)
        ]
        outs = [np.zeros(s.shape, s.dtype) for s in out_shapes]
        # Masked lanes (exp of -inf, 0/0 that a where discards) are normal in these kernels.
        with np.errstate(all="ignore"):
            kernel[grid](*call, *(HostArray(o) for o in outs), **constexprs)
        return tuple(outs)

    return tuple(jax.pure_callback(host, out_shapes, *arrays, vmap_method="sequential"))
