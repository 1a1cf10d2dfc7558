"""Measuring configs: compile candidates ahead (in threads), then time each on random inputs."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ._invocation import merge_static, split_static

if TYPE_CHECKING:
    from ._invocation import Invocation
    from ._kernel import Kernel

__all__ = [
    "CandidateResult",
    "TuneReport",
    "Tuner",
    "autotune",
    "benchmark",
    "interleaved_seconds",
    "random_like",
]


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


# Unfinished calls at most while calls run back to back. Each holds its outputs and scratch from
# dispatch until the device has run it, and a host dispatching ahead of a 1.5 ms backward ran an
# H200's 141 GB out (the allocator then retries without end: the timing hung). With this many
# queued, the host waits on the older half once every half: the device never runs dry, and a wait
# (tens of microseconds of Python for a tree of outputs) is paid once in eight calls
# (benchmarks/NOTES.md, fifty-eighth round).
MAX_IN_FLIGHT = 16


def _back_to_back(fn: Callable[[], Any], calls: int) -> None:
    """``calls`` calls of ``fn`` dispatched back to back, at most ``MAX_IN_FLIGHT`` unfinished:
    once that many are, it waits for the older half (a device runs one stream in order, so the
    newest of them finishing means all have). Returns once every call has finished."""
    half = MAX_IN_FLIGHT // 2
    in_flight: collections.deque[Any] = collections.deque()
    for _ in range(calls):
        in_flight.append(fn())
        if len(in_flight) == MAX_IN_FLIGHT:
            _block(in_flight[half - 1])
            for _ in range(half):
                in_flight.popleft()
    _block(list(in_flight))


def _seconds_per_call(fn: Callable[[], Any], calls: int, bound: float | None) -> float:
    """``calls`` calls of ``fn`` back to back (:func:`_back_to_back`), in seconds per call."""
    t0 = time.perf_counter()
    _back_to_back(fn, calls)
    seconds = (time.perf_counter() - t0) / calls
    if bound is not None and seconds > bound:
        what = "one call took" if calls == 1 else f"{calls} calls took on average"
        raise TimeoutError(f"{what} {seconds:.3g} s, over the bound of {bound} s")
    return seconds


# A GPU's clock follows the power drawn with a lag of about 0.1 s: on an H200 a kernel read 10-13%
# fast 20 ms after an idle GPU, 5-11% after a lighter kernel, and within the noise after 0.1-0.4 s
# (benchmarks/NOTES.md, twenty-fourth round). A Tuner on a GPU settles each candidate this long
# unless told otherwise.
GPU_SETTLE_SECONDS = 0.2

MAX_BATCH_CALLS = 10_000  # the most calls ``min_batch_seconds`` adds to one timed batch


def _calls_lasting(seconds: float, per_call: float) -> int:
    """Calls of ``per_call`` seconds that last ``seconds`` (at least 1, at most
    ``MAX_BATCH_CALLS``; 1 where ``per_call`` is unknown, i.e. 0)."""
    wanted = math.ceil(seconds / per_call) if per_call > 0 else 1
    return min(max(wanted, 1), MAX_BATCH_CALLS)


def interleaved_seconds[K](
    fns: Mapping[K, Callable[[], Any]],
    *,
    warmup: int = 2,
    calls: int = 10,
    rounds: int = 3,
    settle: int = 1,
    bound: float | None = None,
    seed: int = 0,
    min_batch_seconds: float = 0.0,
    settle_seconds: float = 0.0,
) -> dict[K, list[float] | Exception]:
    """Seconds per call of each of ``fns``, one reading a round, or the exception it raised.

    After ``warmup`` calls of each (one at a time, each waited on), the ``calls`` timed calls of each
    are split over ``rounds`` rounds. In a round the functions take turns in a new (seeded) order,
    the orders such that each function follows every other equally often
    (:func:`_carryover_balanced_orders`); a turn runs ``settle`` untimed calls, then its share of
    the timed calls back to back (at most ``MAX_IN_FLIGHT`` unfinished at once), and reads the time
    per call. Drifts of the machine's speed then fall on all alike, and so does what is left of the
    wake of the function before: a GPU's clock follows the power drawn, so a kernel timed right
    after a light one reads fast. A function that raises, or whose call takes more than ``bound``
    seconds, drops out with that exception. Where a function's share of a round would last less
    than ``min_batch_seconds`` (judged by its fastest warm-up call; none without warm-up), its
    turns run that many seconds' worth of calls instead (at most ``MAX_BATCH_CALLS``): a few
    sub-millisecond calls read launch latency and clock transients more than the kernel.
    ``settle_seconds`` lengthens the untimed calls before each turn the same way, dispatched back
    to back: a GPU's clock left high or low by the previous function takes about 0.1 s to follow
    this one (:data:`GPU_SETTLE_SECONDS`).

    >>> import jax.numpy as jnp
    >>> x = jnp.ones(64)
    >>> times = interleaved_seconds({"sin": lambda: jnp.sin(x), "cos": lambda: jnp.cos(x)}, calls=4)
    >>> {name: len(readings) for name, readings in times.items()}
    {'sin': 3, 'cos': 3}
    """
    if (
        warmup < 0
        or settle < 0
        or calls < 1
        or rounds < 1
        or not min_batch_seconds >= 0
        or not settle_seconds >= 0
    ):
        raise ValueError(
            f"need warmup >= 0, settle >= 0, calls >= 1, rounds >= 1, min_batch_seconds >= 0 and "
            f"settle_seconds >= 0; got {warmup=}, {settle=}, {calls=}, {rounds=}, "
            f"{min_batch_seconds=}, {settle_seconds=}"
        )
    rounds = min(rounds, calls)
    readings: dict[K, list[float]] = {}
    failed: dict[K, Exception] = {}
    least_calls: dict[K, int] = {}
    settle_calls: dict[K, int] = {}
    for key, fn in fns.items():
        try:
            fastest = min((_seconds_per_call(fn, 1, bound) for _ in range(warmup)), default=0.0)
            readings[key] = []
        except Exception as exc:  # this one drops out; the others are still timed
            failed[key] = exc
            continue
        least_calls[key] = _calls_lasting(min_batch_seconds, fastest)
        settle_calls[key] = (
            max(settle, _calls_lasting(settle_seconds, fastest)) if settle_seconds else settle
        )
    timed = list(readings)  # the design balances the functions that warmed up, not the dropped
    for r, order in enumerate(_carryover_balanced_orders(len(timed), rounds, random.Random(seed))):
        share = calls // rounds + (r < calls % rounds)
        for key in [timed[i] for i in order if timed[i] not in failed]:
            try:
                _back_to_back(fns[key], settle_calls[key])  # untimed
                batch = max(share, least_calls[key])
                readings[key].append(_seconds_per_call(fns[key], batch, bound))
            except Exception as exc:
                failed[key] = exc
    return {key: failed[key] if key in failed else readings[key] for key in fns}


def _carryover_balanced_orders(n: int, rounds: int, rng: random.Random) -> list[list[int]]:
    """``rounds`` orders of ``range(n)`` in which each index follows every other equally often.

    A timed function can run faster or slower for what ran just before it, even after settling (a
    GPU's clock and temperature after a light kernel). Orders shuffled at random leave that to
    chance: in one 12-round run on an H200 one copy of an attention program followed the lightest
    program timed twice as often as its twin did (benchmarks/NOTES.md, eighty-first round). The
    rounds here come in blocks, each a Williams design (a Latin square whose rows hold every
    ordered pair of neighbours once: ``n`` rows for even ``n``, ``2n`` with each pair twice for odd
    ``n``), its rows shuffled and its indices relabelled at random, so that within a block no
    function's predecessors differ from another's. Only across the rounds' seams (the last of one
    round, the first of the next) and in a partial last block is the balance not exact.

    >>> orders = _carryover_balanced_orders(4, 4, random.Random(0))
    >>> sorted((a[i], a[i + 1]) for a in orders for i in range(3)) == [
    ...     (x, y) for x in range(4) for y in range(4) if x != y]
    True
    """
    if n < 0 or rounds < 1:
        raise ValueError(f"need n >= 0 and rounds >= 1; got {n=}, {rounds=}")
    if n == 0:
        return [[] for _ in range(rounds)]
    # 0, 1, n-1, 2, n-2, ...: for even n its neighbours' differences mod n are 1..n-1, once each
    base = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    rows = [[(b + i) % n for b in base] for i in range(n)]
    if n % 2:  # an odd n needs the mirrored square as well for every pair
        rows += [row[::-1] for row in rows]
    orders: list[list[int]] = []
    while len(orders) < rounds:
        label = rng.sample(range(n), n)
        orders += [[label[i] for i in row] for row in rng.sample(rows, len(rows))]
    return orders[:rounds]


@dataclasses.dataclass(frozen=True, slots=True)
class CandidateResult:
    """One candidate's outcome: its median time in seconds, or why it failed (and in which phase)."""

    cfg: Any
    seconds: float | None = None
    error: str | None = None
    phase: str | None = None  # "compile", "check" (wrong outputs) or "run" when it failed

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass(frozen=True, slots=True)
class TuneReport:
    """What a tune measured. ``best`` is ``None`` when every candidate failed. ``reference`` is the
    config whose outputs every candidate's were checked against (``None``: not checked; the notes
    say why)."""

    best: Any
    results: tuple[CandidateResult, ...]
    backward: bool
    seconds: float
    notes: tuple[str, ...] = ()
    reference: Any = None

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
        if self.reference is not None:
            lines.append(f"outputs checked against {self.reference!r}")
        return "\n".join(lines)


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _default_tolerance(outputs: Any) -> float:
    """0.1 where any floating output has 16 bits or fewer, else 0.02 (:attr:`Tuner.check_tolerance`)."""
    widths = [np.dtype(o.dtype).itemsize for o in jax.tree.leaves(outputs) if _inexact(o)]
    return 0.1 if widths and min(widths) <= 2 else 0.02


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


@jax.jit
def _leaf_errors(got: list[jax.Array], want: list[jax.Array]) -> jax.Array:
    """``max |got - want| / max |want|`` of each pair of floating leaves (NaN where a NaN appears
    in one but not the other); a pair of other leaves: 0 where equal, else infinity."""
    errors = []
    for g, w in zip(got, want, strict=True):
        if not _inexact(w):
            errors.append(jnp.where(jnp.array_equal(g, w), 0.0, jnp.inf))
            continue
        g, w = g.astype(jnp.float32), w.astype(jnp.float32)
        nan_apart = jnp.any(jnp.isnan(g) != jnp.isnan(w))
        both = ~(jnp.isnan(g) | jnp.isnan(w))
        diff = jnp.max(jnp.where(both, jnp.abs(g - w), 0.0), initial=0.0)
        scale = jnp.maximum(jnp.max(jnp.where(both, jnp.abs(w), 0.0), initial=0.0), 1e-30)
        errors.append(jnp.where(nan_apart, jnp.nan, diff / scale))
    return jnp.stack(errors) if errors else jnp.zeros((0,))


def _relative_error(got: Any, want: Any) -> tuple[float, int]:
    """The largest of :func:`_leaf_errors` over the outputs, and the index of its leaf."""
    got_leaves, got_tree = jax.tree.flatten(got)
    want_leaves, want_tree = jax.tree.flatten(want)
    if got_tree != want_tree or any(
        g.shape != w.shape for g, w in zip(got_leaves, want_leaves, strict=True)
    ):
        raise ValueError(
            f"outputs shaped {jax.tree.map(jnp.shape, got)} where the reference's are "
            f"{jax.tree.map(jnp.shape, want)}"
        )
    errors = np.asarray(_leaf_errors(got_leaves, want_leaves))
    if not errors.size:
        return 0.0, -1
    worst = int(np.argmax(np.where(np.isnan(errors), np.inf, errors)))
    return float(errors[worst]), worst


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Tuner:
    """Benchmarks candidate configs of a kernel call.

    Candidates are timed in interleaved rounds (:func:`interleaved_seconds`): each round times every
    candidate in a new order, after one untimed call of it (or ``settle_seconds`` of them), so that
    drifts of the machine's speed fall on all alike, and the orders have each candidate follow every
    other equally often; a candidate's time is the median of its rounds.

    Attributes:
        warmup: untimed calls of each candidate before the rounds.
        iters: timed calls of each candidate, split over the rounds and run back to back there.
        rounds: interleaved rounds (at most ``iters``).
        min_batch_seconds: a candidate's timed batch runs at least this long (more calls than its
            share of ``iters`` where its calls are short; needs ``warmup >= 1``). Longer batches
            resolve closer candidates at a cost in time: on an H200 one attention program read up
            to 5% apart between 20 ms batches and within 0.7% between 0.3 s ones, which the
            shipped configs are tuned with (benchmarks/NOTES.md, thirty-fourth round).
        settle_seconds: the untimed calls before each timed batch run at least this long, so a GPU's
            clock has followed this candidate's power before it is timed (0: one call; needs
            ``warmup >= 1``; ``None``: :data:`GPU_SETTLE_SECONDS` where JAX's default backend is a
            GPU, else 0). A GPU's clock takes about 0.1 s to follow a new load: 20 ms after an
            idle GPU, one read 10-13% fast (benchmarks/NOTES.md, twenty-fourth round).
        max_seconds_per_call: a candidate whose single call exceeds this is dropped (``None``: no bound).
        runoff: candidates within this fraction of the fastest (0.03: 3%) are timed again, among
            themselves, with ``runoff_iters`` calls each, and chosen on those times: where two are
            within a reading's noise of each other, more calls decide (0: no runoff).
        runoff_iters: timed calls of each runoff candidate (``None``: twice ``iters``).
        check_outputs: before timing, run each candidate once on the tuning inputs and compare its
            outputs (and gradients, when the backward is timed) with the kernel's reference
            (:meth:`Kernel.reference_kernel`); one that differs by more than ``check_tolerance``
            fails in phase ``"check"`` and is not timed. A fast config that computes garbage must
            never win a tune: on an H200 one Triton attention tile computed wrong gradients only in
            its compiled form (benchmarks/NOTES.md, fifty-sixth round).
        check_tolerance: the largest ``max |got - want| / max |want|`` of any output allowed
            (``None``: 0.1 where the reference has a 16-bit float output, else 0.02; generous
            enough for two correct kernels' rounding, far below a wrong one's error of order 1).
        compile_threads: threads compiling candidates ahead of timing (``None``: up to the CPU count).
        progress: show a progress bar; ``None`` shows one only on tunes that take more than 2 s.
        seed: for the random inputs.

    >>> Tuner(warmup=1, iters=3).iters
    3
    """

    warmup: int = 2
    iters: int = 10
    rounds: int = 3
    min_batch_seconds: float = 0.01
    settle_seconds: float | None = None
    max_seconds_per_call: float | None = None
    runoff: float = 0.0
    runoff_iters: int | None = None
    check_outputs: bool = True
    check_tolerance: float | None = None
    compile_threads: int | None = None
    progress: bool | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0; got {self.warmup=}")
        if self.iters < 1:
            raise ValueError(f"iters must be >= 1; got {self.iters=}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1; got {self.rounds=}")
        if not self.min_batch_seconds >= 0:
            raise ValueError(f"min_batch_seconds must be >= 0; got {self.min_batch_seconds=}")
        if self.settle_seconds is not None and not self.settle_seconds >= 0:
            raise ValueError(f"settle_seconds must be >= 0; got {self.settle_seconds=}")
        if not 0 <= self.runoff < float("inf"):
            raise ValueError(f"runoff must be a fraction >= 0; got {self.runoff=}")
        if self.runoff_iters is not None and self.runoff_iters < 1:
            raise ValueError(f"runoff_iters must be >= 1 or None; got {self.runoff_iters=}")
        if self.check_tolerance is not None and not 0 < self.check_tolerance < float("inf"):
            raise ValueError(f"check_tolerance must be > 0 or None; got {self.check_tolerance=}")

    @property
    def settling_seconds(self) -> float:
        """``settle_seconds``, with ``None`` resolved for the default backend."""
        if self.settle_seconds is not None:
            return self.settle_seconds
        return GPU_SETTLE_SECONDS if jax.default_backend() == "gpu" else 0.0

    def timings[K](
        self, fns: Mapping[K, Callable[[], Any]], *, calls: int | None = None
    ) -> dict[K, float | Exception]:
        """Median seconds per call of each of ``fns`` over the interleaved rounds (``calls`` timed
        calls each, by default ``iters``), or the exception it raised."""
        readings = interleaved_seconds(
            fns,
            warmup=self.warmup,
            calls=self.iters if calls is None else calls,
            rounds=self.rounds,
            bound=self.max_seconds_per_call,
            seed=self.seed,
            min_batch_seconds=self.min_batch_seconds,
            settle_seconds=self.settling_seconds,
        )
        return {
            key: r if isinstance(r, Exception) else statistics.median(r)
            for key, r in readings.items()
        }

    def runoff_timings[K](
        self, fns: Mapping[K, Callable[[], Any]], seconds: Mapping[K, float | Exception]
    ) -> dict[K, float | Exception]:
        """The runoff (see ``runoff``): new times of those of ``fns`` whose ``seconds`` are within
        ``runoff`` of the fastest, timed among themselves; empty where fewer than two are."""
        ok = {k: s for k, s in seconds.items() if not isinstance(s, Exception)}
        if self.runoff <= 0 or len(ok) < 2:
            return {}
        fastest = min(ok.values())
        close = [k for k, s in ok.items() if s <= fastest * (1 + self.runoff)]
        if len(close) < 2:
            return {}
        calls = self.runoff_iters if self.runoff_iters is not None else 2 * self.iters
        return self.timings({k: fns[k] for k in close}, calls=calls)

    def measure(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
        """Median seconds of ``fn(*args, **kwargs)`` after warm-up (``fn`` is called as given)."""
        seconds = self.timings({0: lambda: fn(*args, **kwargs)})[0]
        if isinstance(seconds, Exception):
            raise seconds
        return seconds

    def _reference_kernel(self, inv: Invocation, notes: list[str]) -> Kernel | None:
        """The configured kernel whose outputs candidates are checked against, or None (noted)."""
        if not self.check_outputs:
            return None
        try:
            reference = inv.kernel.reference_kernel(inv)
        except Exception as exc:
            notes.append(f"outputs not checked: no reference ({_short(exc)})")
            return None
        if reference is None:
            notes.append(f"outputs not checked: {inv.kernel.name} has no reference")
        return reference

    def _check_outputs(
        self,
        checking: concurrent.futures.Future[Any],
        reference: Kernel,
        timed_args: tuple[Any, ...],
        candidates: list[Any],
        compiled: dict[int, Any],
        results: dict[int, CandidateResult],
        notes: list[str],
    ) -> bool:
        """Run the reference and each compiled candidate once; drop (from ``compiled``, into
        ``results``) those that raise or whose outputs differ from the reference's. Whether the
        reference ran (else nothing was checked, as ``notes`` says)."""
        try:
            want = _block(checking.result()(*timed_args))
        except Exception as exc:
            notes.append(
                f"outputs not checked: the reference {reference.cfg!r} failed ({_short(exc)})"
            )
            return False
        tolerance = self.check_tolerance or _default_tolerance(want)
        for i in sorted(compiled):
            try:
                error, leaf = _relative_error(_block(compiled[i](*timed_args)), want)
            except Exception as exc:
                results[i] = CandidateResult(candidates[i], error=_short(exc), phase="run")
                del compiled[i]
                continue
            if not error <= tolerance:  # NaN fails
                why = (
                    f"outputs differ from the reference's ({reference.cfg!r}) by {error:.3g} at "
                    f"output {leaf} (max |got - want| / max |want|; tolerance {tolerance:g})"
                )
                results[i] = CandidateResult(candidates[i], error=why, phase="check")
                del compiled[i]
        return True

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
        timed_args: tuple[Any, ...] = (dynamic,)
        if backward:
            try:
                cotangents = _cotangents(kernel, candidates[0], static, dynamic, self.seed)
                jax.jit(_forward_and_backward(kernel, candidates[0], static)).lower(
                    dynamic, cotangents
                )
                timed_args = (dynamic, cotangents)
            except Exception as exc:  # not differentiable: time the forward alone
                backward = False
                notes.append(f"backward not timed, forward only ({_short(exc)})")

        def build(owner: Kernel, cfg: Any) -> Callable[..., Any]:
            program = _forward_and_backward if backward else _forward
            return jax.jit(program(owner, cfg, static)).lower(*timed_args).compile()

        reference = self._reference_kernel(inv, notes)

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
            futures = {pool.submit(build, kernel, cfg): i for i, cfg in enumerate(candidates)}
            checking = (
                pool.submit(build, reference, reference.cfg) if reference is not None else None
            )
            for fut in concurrent.futures.as_completed(futures):
                i = futures[fut]
                try:
                    compiled[i] = fut.result()
                except Exception as exc:
                    results[i] = CandidateResult(candidates[i], error=_short(exc), phase="compile")
                bar.update(1)
            checked = checking is not None and self._check_outputs(
                checking, reference, timed_args, candidates, compiled, results, notes
            )
        fns = {i: functools.partial(compiled[i], *timed_args) for i in sorted(compiled)}
        timed = self.timings(fns)
        runoff = self.runoff_timings(fns, timed)
        if runoff:
            notes.append(
                f"runoff: {len(runoff)} candidates within {self.runoff:.0%} of the fastest timed "
                "again among themselves; their times are the runoff's"
            )
        timed.update(runoff)
        for i, seconds in timed.items():
            if isinstance(seconds, Exception):
                results[i] = CandidateResult(candidates[i], error=_short(seconds), phase="run")
            else:
                results[i] = CandidateResult(candidates[i], seconds=seconds)
        bar.update(len(candidates))
        bar.close()
        ordered = tuple(results[i] for i in range(len(candidates)))
        ok = [r for r in ordered if r.ok]
        best = min(ok, key=lambda r: r.seconds).cfg if ok else None
        seconds = time.perf_counter() - start
        reference_cfg = reference.cfg if checked and reference is not None else None
        return TuneReport(best, ordered, backward, seconds, tuple(notes), reference_cfg)


def _forward(kernel: Kernel, cfg: Any, static: Any) -> Callable[[list[Any]], Any]:
    configured = kernel.with_cfg(cfg)

    def forward(dynamic: list[Any]) -> Any:
        args, kwargs = merge_static(dynamic, static)
        return configured.execute(cfg, args, kwargs)

    return forward


def _float_outputs(out: Any) -> list[Any]:
    return [o for o in jax.tree.leaves(out) if _inexact(o)]


def _cotangents(
    kernel: Kernel, cfg: Any, static: Any, dynamic: list[Any], seed: int
) -> list[jax.Array]:
    """Random cotangents, one per floating output, in that output's dtype: what training hands a
    backward (the next layer's gradient), passed into the timed program.

    Ones (a plain ``sum``) let XLA fold a constant cotangent into the backward's first fusions, and
    on a power-capped GPU a kernel's clock follows the power its data draws. Cotangents built inside
    the timed program (a weighted loss's f32 weights, cast) timed our attention backwards 3-7%
    slower against cuDNN's than training runs them (benchmarks/NOTES.md, thirty-fourth round).
    """
    shapes = _float_outputs(jax.eval_shape(_forward(kernel, cfg, static), dynamic))
    if not shapes:
        raise TypeError(f"{kernel.name} has no floating outputs to differentiate")
    keys = jax.random.split(jax.random.key(seed + 1), len(shapes))
    return [jax.random.normal(k, o.shape, o.dtype) for k, o in zip(keys, shapes, strict=True)]


def _forward_and_backward(kernel: Kernel, cfg: Any, static: Any) -> Callable[..., Any]:
    """``(dynamic, cotangents) -> (float outputs, their vjp onto the floating inputs)``: one
    training step's work for the kernel, every result returned (nothing left for XLA to drop)."""
    forward = _forward(kernel, cfg, static)

    def run(dynamic: list[Any], cotangents: list[jax.Array]) -> Any:
        # Differentiate with respect to floating arrays only; the rest ride along as constants.
        is_float = [_inexact(x) for x in dynamic]
        floats = [x for x, f in zip(dynamic, is_float, strict=True) if f]

        def of_floats(fl: list[Any]) -> list[Any]:
            it = iter(fl)
            merged = [next(it) if f else x for x, f in zip(dynamic, is_float, strict=True)]
            return _float_outputs(forward(merged))

        outs, vjp = jax.vjp(of_floats, floats)
        return outs, vjp(cotangents)

    return run


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
