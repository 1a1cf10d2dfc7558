"""Measuring configs: compile candidates ahead (in threads), then time each on random inputs."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ._invocation import merge_static, split_static

if TYPE_CHECKING:
    from ._invocation import Invocation
    from ._kernel import Kernel

__all__ = ["CandidateResult", "TuneReport", "Tuner", "autotune", "benchmark", "random_like"]


def random_like(tree: Any, key: jax.Array) -> Any:
    """Random arrays shaped like the ``jax.ShapeDtypeStruct`` leaves of ``tree`` (never all zeros).

    Floats are standard normal, integers uniform in ``[1, 8)``, booleans true with probability 3/4.
    Other leaves are kept as they are.
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    keys = jax.random.split(key, max(len(leaves), 1))
    out = []
    for k, leaf in zip(keys, leaves, strict=False):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            out.append(leaf)
            continue
        dtype = np.dtype(leaf.dtype)
        if jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating):
            out.append(jax.random.normal(k, leaf.shape, dtype))
        elif dtype == np.bool_:
            out.append(jax.random.bernoulli(k, 0.75, leaf.shape))
        elif jnp.issubdtype(dtype, jnp.integer):
            out.append(jax.random.randint(k, leaf.shape, 1, 8).astype(dtype))
        else:
            raise TypeError(f"cannot draw random values of dtype {dtype} for shape {leaf.shape}")
    return jax.tree.unflatten(treedef, out)


def _block(tree: Any) -> Any:
    return jax.block_until_ready(tree)


def _median_seconds(fn: Callable[[], Any], warmup: int, iters: int, bound: float | None) -> float:
    for _ in range(warmup):
        t0 = time.perf_counter()
        _block(fn())
        if bound is not None and time.perf_counter() - t0 > bound:
            raise TimeoutError(
                f"one call took {time.perf_counter() - t0:.3g} s, over the bound of {bound} s"
            )
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        _block(fn())
        times.append(time.perf_counter() - t0)
        if bound is not None and times[-1] > bound:
            raise TimeoutError(f"one call took {times[-1]:.3g} s, over the bound of {bound} s")
    return statistics.median(times)


@dataclasses.dataclass(frozen=True, slots=True)
class CandidateResult:
    """One candidate's outcome: its median time in seconds, or why it failed (and in which phase)."""

    cfg: Any
    seconds: float | None = None
    error: str | None = None
    phase: str | None = None  # "compile" or "run" when it failed

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass(frozen=True, slots=True)
class TuneReport:
    """What a tune measured. ``best`` is ``None`` when every candidate failed."""

    best: Any
    results: tuple[CandidateResult, ...]
    backward: bool
    seconds: float
    notes: tuple[str, ...] = ()

    @property
    def failures(self) -> tuple[CandidateResult, ...]:
        return tuple(r for r in self.results if not r.ok)

    def table(self) -> str:
        """A plain-text table of the candidates, fastest first, failures last."""
        rows = sorted(self.results, key=lambda r: (r.seconds is None, r.seconds or 0.0))
        lines = [f"{'time (ms)':>10}  config"]
        for r in rows:
            mark = "*" if r.cfg == self.best and r.ok else " "
            t = f"{r.seconds * 1e3:10.4f}" if r.ok else f"{'failed':>10}"
            why = "" if r.ok else f"  ({r.phase}: {r.error})"
            lines.append(f"{t}{mark} {r.cfg!r}{why}")
        return "\n".join(lines)


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Tuner:
    """Benchmarks candidate configs of a kernel call.

    Attributes:
        warmup: untimed calls before timing each candidate.
        iters: timed calls; the median is kept.
        max_seconds_per_call: a candidate whose single call exceeds this is dropped (``None``: no bound).
        compile_threads: threads compiling candidates ahead of timing (``None``: up to the CPU count).
        progress: show a progress bar; ``None`` shows one only on tunes that take more than 2 s.
        seed: for the random inputs.

    >>> Tuner(warmup=1, iters=3).iters
    3
    """

    warmup: int = 2
    iters: int = 10
    max_seconds_per_call: float | None = None
    compile_threads: int | None = None
    progress: bool | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0; got {self.warmup=}")
        if self.iters < 1:
            raise ValueError(f"iters must be >= 1; got {self.iters=}")

    def measure(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
        """Median seconds of ``fn(*args, **kwargs)`` after warm-up (``fn`` is called as given)."""
        return _median_seconds(
            lambda: fn(*args, **kwargs), self.warmup, self.iters, self.max_seconds_per_call
        )

    def tune(
        self, inv: Invocation, candidates: Sequence[Any], *, validate_backward: bool = False
    ) -> TuneReport:
        """Compile and time every candidate for ``inv``; the fastest working one is ``best``."""
        start = time.perf_counter()
        candidates = list(dict.fromkeys(candidates))  # configs are hashable; keep first occurrence
        if not candidates:
            raise ValueError(f"no candidate configs to tune for {inv!r}")
        kernel = inv.kernel
        args, kwargs = kernel.sample_inputs(inv, jax.random.key(self.seed))
        dynamic, static = split_static((tuple(args), dict(kwargs)))
        notes: list[str] = []

        backward = validate_backward
        if backward:
            try:
                jax.jit(_loss_and_grad(kernel, candidates[0], static)).lower(dynamic)
            except Exception as exc:  # not differentiable: time the forward alone
                backward = False
                notes.append(f"backward not timed, forward only ({_short(exc)})")

        def build(cfg: Any) -> Callable[[list[Any]], Any]:
            fn = _loss_and_grad(kernel, cfg, static) if backward else _forward(kernel, cfg, static)
            return jax.jit(fn).lower(dynamic).compile()

        from tqdm import tqdm  # the terminal bar: tqdm.auto warns in notebooks without widgets

        bar = tqdm(
            total=2 * len(candidates),
            desc=f"tuning {kernel.name}",
            delay=0.0 if self.progress else 2.0,
            disable=self.progress is False,
            leave=False,
        )
        compiled: dict[int, Any] = {}
        results: dict[int, CandidateResult] = {}
        threads = self.compile_threads or min(len(candidates), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(threads, 1)) as pool:
            futures = {pool.submit(build, cfg): i for i, cfg in enumerate(candidates)}
            for fut in concurrent.futures.as_completed(futures):
                i = futures[fut]
                try:
                    compiled[i] = fut.result()
                except Exception as exc:
                    results[i] = CandidateResult(candidates[i], error=_short(exc), phase="compile")
                bar.update(1)
        for i, cfg in enumerate(candidates):
            if i in compiled:
                exe = compiled[i]
                try:
                    seconds = _median_seconds(
                        lambda exe=exe: exe(dynamic),
                        self.warmup,
                        self.iters,
                        self.max_seconds_per_call,
                    )
                    results[i] = CandidateResult(cfg, seconds=seconds)
                except Exception as exc:
                    results[i] = CandidateResult(cfg, error=_short(exc), phase="run")
            bar.update(1)
        bar.close()
        ordered = tuple(results[i] for i in range(len(candidates)))
        ok = [r for r in ordered if r.ok]
        best = min(ok, key=lambda r: r.seconds).cfg if ok else None
        return TuneReport(best, ordered, backward, time.perf_counter() - start, tuple(notes))


def _forward(kernel: Kernel, cfg: Any, static: Any) -> Callable[[list[Any]], Any]:
    configured = kernel.with_cfg(cfg)

    def forward(dynamic: list[Any]) -> Any:
        args, kwargs = merge_static(dynamic, static)
        return configured.execute(cfg, args, kwargs)

    return forward


def _loss_and_grad(kernel: Kernel, cfg: Any, static: Any) -> Callable[[list[Any]], Any]:
    forward = _forward(kernel, cfg, static)

    def loss(dynamic: list[Any]) -> jax.Array:
        out = forward(dynamic)
        return sum(
            jnp.sum(o.astype(jnp.float32))
            for o in jax.tree.leaves(out)
            if jnp.issubdtype(o.dtype, jnp.inexact)
        )

    def value_and_grad(dynamic: list[Any]) -> Any:
        # Differentiate with respect to floating arrays only; the rest ride along as constants.
        is_float = [jnp.issubdtype(x.dtype, jnp.inexact) for x in dynamic]
        floats = [x for x, f in zip(dynamic, is_float, strict=True) if f]

        def of_floats(fl: list[Any]) -> jax.Array:
            it = iter(fl)
            return loss([next(it) if f else x for x, f in zip(dynamic, is_float, strict=True)])

        return jax.value_and_grad(of_floats)(floats)

    return value_and_grad


def autotune(
    kernel: Kernel,
    *args: Any,
    candidates: Sequence[Any] | None = None,
    tuner: Tuner | None = None,
    validate_backward: bool = False,
    **kwargs: Any,
) -> Any:
    """The fastest config of ``kernel`` for this call (``candidates`` default to the kernel's own).

    Raises ``RuntimeError`` listing every failure when no candidate works. For the full measurements
    use ``Tuner.tune``.

    >>> import jax.numpy as jnp, ejkfn
    >>> from ejkfn.testing import Scale, ScaleCfg
    >>> cfg = ejkfn.autotune(Scale(), jnp.ones((4, 8)), candidates=[ScaleCfg(block=1), ScaleCfg(block=2)],
    ...                      tuner=ejkfn.Tuner(warmup=0, iters=1))
    >>> cfg in (ScaleCfg(block=1), ScaleCfg(block=2))
    True
    """
    from ._invocation import Invocation

    inv = Invocation.of(kernel, *args, **kwargs)
    if candidates is None:
        candidates = kernel.candidate_cfgs(inv)
    report = (tuner or Tuner()).tune(inv, candidates, validate_backward=validate_backward)
    if report.best is None:
        raise RuntimeError(f"every candidate failed for {inv!r}:\n{report.table()}")
    return report.best


def benchmark(
    fn: Callable[..., Any],
    *args: Any,
    warmup: int = 2,
    iters: int = 10,
    jit: bool = True,
    **kwargs: Any,
) -> float:
    """Median seconds of ``fn(*args, **kwargs)`` (jitted unless ``jit=False``), after warm-up.

    >>> import jax.numpy as jnp
    >>> benchmark(jnp.sin, jnp.ones(8), iters=3) > 0
    True
    """
    call = jax.jit(fn) if jit else fn
    return Tuner(warmup=warmup, iters=iters).measure(call, *args, **kwargs)
