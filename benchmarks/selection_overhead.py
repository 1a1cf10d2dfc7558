"""Selection overhead of an eager call with a cache hit, side by side in one run (CPU).

Rows:
- ``jax.jit directly``: the kernel's ``run`` with its config, jitted by hand and called: the floor.
- ``ejkfn configured``: a kernel with its config baked in, called eagerly.
- ``ejkfn ambient hit``: an unconfigured kernel called eagerly; its config comes from the memory cache.
- ``ejkfn explicit select``: ``select`` on a prepared invocation with a memory hit (no kernel call).
- ``reference Executor hit``: ejkernel's ``Executor`` with a cache hit, measured by the same method in a
  separate environment (it needs jax 0.10); set ``EJKFN_REFERENCE_PYTHON`` to that environment's python.

Also checks that inside ``jax.jit`` a configured kernel's lowered program equals the bare kernel's.

Usage: ``python benchmarks/selection_overhead.py`` (prints a table, writes benchmarks/results/).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import ejkfn
from ejkfn.testing import Scale, ScaleCfg

CALLS = 20000
REPEATS = 7


def per_call_us(fns: dict, calls: int = CALLS, repeats: int = REPEATS) -> dict[str, float]:
    """Per row, the median over ``repeats`` of the mean time of ``calls`` back-to-back calls (us).

    Rows are interleaved within each repeat, so that a busy machine slows them all alike.
    """
    for fn in fns.values():
        for _ in range(1000):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


REFERENCE = """
import time, statistics, dataclasses, jax, jax.numpy as jnp
from ejkernel.ops import Kernel, Executor, ConfigSelectorChain, ConfigCache, AutotunePolicy, Invocation

@dataclasses.dataclass(frozen=True)
class Cfg:
    block: int = 4

class ScaleK(Kernel):
    def __init__(self):
        super().__init__(op_id="scale")
    def run(self, x, *, cfg):
        return x * 2.0
    def heuristic_cfg(self, inv):
        return Cfg()
    def candidate_cfgs(self, inv):
        return [Cfg()]

x = jnp.ones((8, 4))
executor = Executor(ConfigSelectorChain(ConfigCache(), AutotunePolicy(allow_autotune=False)))
k = ScaleK()
executor(k, x)  # first call: selection, then a cache hit every time
direct = jax.jit(lambda x: x * 2.0)
direct(x)
def per_call(fn, calls={calls}, repeats={repeats}):
    for _ in range(1000):
        fn()
    s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        s.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(s)
print(per_call(lambda: executor(k, x)), per_call(lambda: direct(x)))
"""


def reference_row() -> tuple[float, float] | None:
    python = os.environ.get("EJKFN_REFERENCE_PYTHON")
    if not python:
        return None
    code = textwrap.dedent(REFERENCE.format(calls=CALLS // 4, repeats=REPEATS))
    proc = subprocess.run(
        [python, "-c", code],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    if proc.returncode != 0:
        print(f"reference failed: {proc.stderr[-1500:]}", file=sys.stderr)
        return None
    executor_us, direct_us = map(float, proc.stdout.split()[-2:])
    return executor_us, direct_us


def lowered_equal() -> bool:
    x = jnp.ones((8, 4))
    cfg = ScaleCfg(block=4)
    with ejkfn.stamping("none"):
        ours = jax.jit(lambda x: Scale().with_cfg(cfg)(x) + 1).lower(x).as_text()
        bare = jax.jit(lambda x: Scale().run(x, cfg=cfg) + 1).lower(x).as_text()
    return ours == bare


def main() -> None:
    x = jnp.ones((8, 4))
    cfg = ScaleCfg(block=4)
    direct = jax.jit(lambda x: Scale().run(x, cfg=cfg))
    configured = Scale().with_cfg(cfg)
    unconfigured = Scale()
    inv = ejkfn.Invocation.of(unconfigured, x)
    caches = ejkfn.Caches().remember(inv.key, cfg)

    with ejkfn.use_caches(caches):
        unconfigured(x)
        rows = per_call_us(
            {
                "jax.jit directly": lambda: direct(x),
                "ejkfn configured": lambda: configured(x),
                "ejkfn ambient hit": lambda: unconfigured(x),
                "ejkfn explicit select (no call)": lambda: ejkfn.select(inv, caches),
            }
        )
    ref = reference_row()

    floor = rows["jax.jit directly"]
    print(
        f"\nSelection overhead, eager calls with a cache hit ({platform.processor() or 'cpu'}, "
        f"jax {jax.__version__}, median of {REPEATS} x {CALLS} calls)\n"
    )
    print(f"{'path':38} {'us/call':>9} {'overhead us':>12}")
    for name, us in rows.items():
        over = us - floor if "no call" not in name else us
        print(f"{name:38} {us:9.2f} {over:12.2f}")
    if ref is not None:
        executor_us, ref_direct_us = ref
        print(
            f"{'reference Executor hit (jax 0.10)':38} {executor_us:9.2f} {executor_us - ref_direct_us:12.2f}"
        )
        print(f"{'  its own jax.jit directly':38} {ref_direct_us:9.2f}")
    else:
        print(
            "reference Executor: not measured (set EJKFN_REFERENCE_PYTHON to an ejkernel environment)"
        )
    same = lowered_equal()
    print(f"\ninside jax.jit, configured kernel's lowered program equals the bare kernel's: {same}")

    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    result = {
        "benchmark": "selection_overhead",
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": {
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "versions": dict(ejkfn.software_versions()),
        "us_per_call": rows,
        "overhead_us": {k: (v - floor if "no call" not in k else v) for k, v in rows.items()},
        "reference": None
        if ref is None
        else {"executor_us": ref[0], "direct_us": ref[1], "overhead_us": ref[0] - ref[1]},
        "lowered_program_equal": same,
    }
    (out / "selection_overhead.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
