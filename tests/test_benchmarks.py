"""The GPU benchmark scripts still run: on the CPU at tiny sizes (the Mosaic ones in Mosaic GPU's
interpreter), so a change to the library or to a shared helper cannot leave them broken until the
next run on the lent GPU."""

import json
import subprocess
import sys

import pytest

from ._subprocess import ROOT, child_env


def _run(script: str, *args: str, out) -> list[dict]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args, "--out", str(out)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [saved] = list(out.glob("*.json"))
    data = json.loads(saved.read_text())
    return data["results"] if "results" in data else data["rows"]


@pytest.mark.slow
def test_attention_benchmark_checks_then_times(tmp_path):
    results = _run(
        "attention.py", "--shapes", "1x128x2x64", "--calls", "2", "--rounds", "2", out=tmp_path
    )
    timed = [r for r in results if "fwd_bwd_ms" in r]
    assert {r["impl"] for r in timed} >= {"jax.nn xla", "ejkfn auto"}
    assert all(r["correct"] and r["fwd_ms"] > 0 and r["fwd_bwd_spread"] >= 1 for r in timed)
    assert any("error" in r for r in results if r["impl"] == "jax.nn cudnn")  # no cuDNN on a CPU


@pytest.mark.slow
def test_mosaic_variants_benchmark_smoke(tmp_path):
    rows = _run(
        "mosaic_variants_gpu.py", "--cpu-smoke", "--backward", "no", "--fma-exp2", "32",
        out=tmp_path,
    )  # fmt: skip
    mosaic = [r for r in rows if r["impl"].startswith("mosaic")]
    assert len(mosaic) == 4  # the default and the FMA-exp2 forward, causal and not
    assert all(r["max_rel_err_vs_cudnn"] < 2e-2 for r in mosaic)
