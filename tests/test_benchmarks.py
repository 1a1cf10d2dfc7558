"""The GPU benchmark scripts still run: on the CPU at tiny sizes (the Mosaic ones in Mosaic GPU's
interpreter), so a change to the library or to a shared helper cannot leave them broken until the
next run on the lent GPU."""

import csv
import dataclasses
import importlib
import importlib.metadata
import json
import re
import subprocess
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import pytest

from ejkfn import BwdParams
from ejkfn.attention import registered_backends

from ._lowering import cudnn_forward_results
from ._subprocess import ROOT, child_env


def _completed(script: str, *args: str, returncode: int) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == returncode, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def _run(script: str, *args: str, returncode: int = 0) -> str:
    """Runs ``benchmarks/script`` with ``args``; its stdout."""
    return _completed(script, *args, returncode=returncode).stdout


def _refusal(script: str, *args: str) -> str:
    """What ``benchmarks/script`` writes refusing ``args`` (argparse's exit status, 2)."""
    return _completed(script, *args, returncode=2).stderr


def _benchmark_modules(*names: str) -> list[types.ModuleType]:
    """The modules ``names`` of ``benchmarks/`` (scripts, not a package), imported."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _saved(folder, pattern: str) -> dict:
    [path] = folder.glob(pattern)
    return json.loads(path.read_text())


@pytest.mark.slow
def test_attention_benchmark_checks_then_times(tmp_path):
    _run("attention.py", "--shapes", "1x128x2x64", "--calls", "2", "--rounds", "2", "--min-batch-ms", "20", "--settle-ms", "1", "--order-seed", "5", "--pad", "--out", str(tmp_path))  # fmt: skip
    saved = _saved(tmp_path, "attention_bench_*.json")
    assert saved["timing"] == dict(
        calls=2, rounds=2, min_batch_ms=20.0, settle_ms=1.0, order_seed=5
    )
    versions = saved["device"]["versions"]  # the launcher's and the peers' too, None where absent
    assert versions["jax-triton"] == importlib.metadata.version("jax-triton")
    assert versions["jax"] == jax.__version__ and "tokamax" in versions and "ejkernel" in versions
    results = saved["results"]
    timed = [r for r in results if "fwd_bwd_ms" in r]
    assert {r["impl"] for r in timed} >= {"jax.nn xla", "ejkfn auto"}
    assert all(r["correct"] and r["fwd_ms"] > 0 and r["fwd_bwd_spread"] >= 1 for r in timed)
    assert all(len(r["fwd_rounds_ms"]) == len(r["fwd_bwd_rounds_ms"]) == 2 for r in timed)
    assert any("error" in r for r in results if r["impl"] == "jax.nn cudnn")  # no cuDNN on a CPU
    # --pad: one more jit of our first kernels, listed right after JAX's mha and in no table
    names = [r["impl"] for r in results if r["case"] == "1x128x2x64"]
    assert names[names.index("jax pallas-triton mha") + 1] == "pad beside mha"
    assert any(r["impl"] == "pad beside mha" for r in timed)
    [path] = tmp_path.glob("attention_bench_*.json")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--tabulate", str(path)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr[-2000:]
    auto = next(r for r in timed if r["impl"] == "ejkfn auto")
    row = next(line for line in lines if line.startswith("| 1x128x2x64 |"))
    cells = row.split(" | ")
    assert cells[1] == "-"  # no cuDNN: no ratios either
    assert cells[7] == f"{auto['fwd_tflops']:.0f} / {auto['fwd_bwd_tflops']:.0f}"
    assert any(line.startswith("| shape | best ejkfn fwd / cuDNN") for line in lines)
    assert not any("pad" in line for line in lines)


@pytest.mark.slow
def test_mosaic_variants_benchmark_smoke(tmp_path):
    # Another revision of the forward: this one, its output zeroed. Loading it must not replace
    # the registered backend, whose row stays correct; its own wrong rows make the script exit 1.
    other = tmp_path / "zeroed.py"
    source = (ROOT / "ejkfn" / "attention" / "_pallas_mosaic.py").read_text()
    other.write_text(
        source + "\n\n_kept = _forward\n\n\ndef _forward(*args, **kwargs):\n"
        "    out, lse = _kept(*args, **kwargs)\n    return out * 0, lse\n"
    )
    _run("mosaic_variants_gpu.py", "--cpu-smoke", "--backward", "no", "--other-grid", "--fwd-blocks", "64x2x256", "--other-fwd", str(other), "--out", str(tmp_path), returncode=1)  # fmt: skip
    rows = _saved(tmp_path, "mosaic_variants_*.json")["rows"]
    mosaic = [r for r in rows if r["impl"].startswith("mosaic")]
    # the persistent, one-tile-per-CTA, two-CTA-cluster (on each grid) and the other revision's
    # forwards, causal and not
    assert len(mosaic) == 10 and sum("cluster of 2" in r["impl"] for r in mosaic) == 4
    zeroed = [r for r in mosaic if r["impl"] == "mosaic, zeroed"]
    assert len(zeroed) == 2 and all(r["max_rel_err_vs_cudnn"] > 0.5 for r in zeroed)
    assert all(r["max_rel_err_vs_cudnn"] < 2e-2 for r in mosaic if r not in zeroed)


@pytest.mark.slow
def test_mosaic_variants_profile_runs_the_variants_asked_for():
    stdout = _run("mosaic_variants_gpu.py", "--cpu-smoke", "--profile", "--masks", "causal", "--backward", "no", "--unbalanced")  # fmt: skip
    ran = [line.removeprefix("profile: ") for line in stdout.splitlines() if line.startswith("profile: ")]  # fmt: skip
    # the CPU smoke has no cuDNN: its stand-in is XLA's attention, under the same name
    case = "1x256x2x128 causal fwd"
    assert ran == [f"{case} cudnn", f"{case} mosaic", f"{case} mosaic, all resident CTAs"]


@pytest.mark.slow
def test_mosaic_variants_backward_smoke(tmp_path):
    # Run: the kernels called directly (as every variant below is) give cuDNN's stand-in's
    # gradients, in the order the table reads them.
    _run("mosaic_variants_gpu.py", "--cpu-smoke", "--masks", "causal", "--backward", "only", "--whole-tail", "--out", str(tmp_path / "run"))  # fmt: skip
    rows = _saved(tmp_path / "run", "mosaic_variants_*.json")["rows"]
    checked = {r["impl"]: r["max_rel_err_vs_cudnn"] for r in rows}
    assert set(checked) == {
        "cudnn", "mosaic + split", "mosaic + fused", "mosaic, last round whole + heuristic backward"
    }  # fmt: skip
    assert all(err < 2e-2 for err in checked.values())
    # Traced (the orders themselves run in tests/test_attention_pallas.py): causal at 256 keys
    # without GQA the forward goes along the sequence by default, so its other order is heads
    # fastest; the dK/dV kernel goes heads fastest (in a band of both pairs) and the dQ kernel
    # along the sequence, so the split backward also runs the other three (dK/dV, dQ) pairs, the
    # fused one (no dQ kernel) the other dK/dV order, and the split one its dK/dV kernel
    # persistent along the sequence: each a program of its own.
    _run("mosaic_variants_gpu.py", "--cpu-smoke", "--trace-only", "--masks", "causal", "--tile-order", "--out", str(tmp_path / "traced"))  # fmt: skip
    rows = _saved(tmp_path / "traced", "mosaic_variants_*.json")["rows"]
    programs = {(r["pass_"], r["impl"]): r["program"] for r in rows}
    wanted = [("fwd", "mosaic"), ("fwd", "mosaic, tiles heads fastest")]
    along, heads = "along the sequence", "heads fastest"
    pairs = {"split": [(along, along), (along, heads), (heads, heads)], "fused": [(along, along)]}
    for name, others in pairs.items():
        wanted.append(("fwd+bwd", f"mosaic + {name}"))
        for dkdv, dq in others:
            wanted.append(("fwd+bwd", f"mosaic + {name}, dK/dV tiles {dkdv}, dQ tiles {dq}"))
    wanted.append(("fwd+bwd", "mosaic + split, tiles along the sequence, dK/dV persistent"))
    assert set(wanted) <= set(programs)
    assert len({programs[key] for key in wanted}) == len(wanted)


def test_mosaic_variants_traces_the_backwards_on_other_grids_and_bands(tmp_path):
    # Traced, not run (the kernels' grids and bands run in tests/test_attention_pallas.py, and a
    # direct call through this script in test_mosaic_variants_backward_smoke): the Mosaic
    # forward with the Triton-lowering backward beside the Mosaic backwards' (split and fused,
    # their dK/dV tiles in one band, one CTA a tile and persistent). At head dim 64 the split
    # backward's dK/dV kernel takes the persistent grid and the fused one (no GQA: it feeds
    # itself) one tile a CTA: the split one also runs its other three (dK/dV, dQ) grids and the
    # one-tile forward, the fused one the persistent grid.
    _run("mosaic_variants_gpu.py", "--cpu-smoke", "--trace-only", "--shapes", "1x256x2x64", "--masks", "causal", "--backward", "only", "--dkdv-bands", "2", "--persistent-dkdv", "--portable-bwd", "--other-grid", "--out", str(tmp_path))  # fmt: skip
    rows = _saved(tmp_path, "mosaic_variants_*.json")["rows"]
    programs = {r["impl"]: r["program"] for r in rows}
    banded = [
        f"mosaic + {kernel}, dK/dV {grid} in bands of all kv heads"
        for kernel in ("split", "fused")
        for grid in ("tiles", "persistent")
    ]
    split_grids = [
        f"persistent fwd, dK/dV {dkdv}, dQ {dq}"
        for dkdv, dq in (("pers.", "pers."), ("tiles", "pers."), ("tiles", "tiles"))
    ]
    # (the Triton-lowering backward named by its heuristic's variant at head dim 64)
    assert set(programs) == {
        "cudnn",
        "mosaic + mirrored_wide",
        "mosaic + split",
        "mosaic + fused",
        *banded,
        *split_grids,
        "one tile per CTA everywhere",
        "mosaic + fused, persistent",
    }
    # A band of both (batch, kv head) pairs is the default band, so these name one program twice;
    # every other option changes the program (an option dropped on the way would repeat one).
    same = [
        {"mosaic + split, dK/dV tiles in bands of all kv heads", "persistent fwd, dK/dV tiles, dQ pers."},
        {"mosaic + split, dK/dV persistent in bands of all kv heads", "persistent fwd, dK/dV pers., dQ pers."},
        {"mosaic + fused, dK/dV persistent in bands of all kv heads", "mosaic + fused, persistent"},
    ]  # fmt: skip
    by_program: dict[str, set[str]] = {}
    for impl, program in programs.items():
        by_program.setdefault(program, set()).add(impl)
    repeated = [impls for impls in by_program.values() if len(impls) > 1]
    assert sorted(map(sorted, repeated)) == sorted(map(sorted, same))


def test_tune_shipped_stores_a_config_per_shape(tmp_path):
    _run("tune_shipped.py", "--shapes", "1x64x2x16", "--iters", "1", "--out", str(tmp_path))
    log = _saved(tmp_path, "tune_shipped_*.json")["log"]
    assert [entry["shape"] for entry in log] == ["1x64x2/2x16", "1x64x2/2x16 causal"]
    assert all(entry["seconds"] and entry["fwd_seconds"] for entry in log)


def test_tune_shipped_times_only_the_backends_named():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tune_shipped import chosen_backends, pruned_candidates

    from ejkfn.attention import AttentionShape, AttentionSpec

    assert chosen_backends(None) is None
    assert chosen_backends(" xla/chunked,cudnn/cudnn") == {"xla/chunked", "cudnn/cudnn"}
    with pytest.raises(SystemExit, match="bogus/x"):
        chosen_backends("xla/chunked,bogus/x")
    with pytest.raises(SystemExit, match="registered"):
        chosen_backends(",")
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    shape = AttentionShape.of(q, q, AttentionSpec(scale=0.125))
    everything = pruned_candidates(shape, 1)
    chunked = pruned_candidates(shape, 1, {"xla/chunked"})
    assert chunked and chunked == [c for c in everything if c.platform == "xla"]
    assert pruned_candidates(shape, 1, {"pallas/triton"}) == []  # named, but no GPU here


def test_tune_shipped_times_each_backward_kernel():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tune_shipped import other_backward_kernels

    from ejkfn import BwdParams, FwdParams

    fwd, other_fwd = FwdParams(kv_blocksize=128), FwdParams(kv_blocksize=64)
    split, split_64 = BwdParams(variant="mosaic"), BwdParams(variant="mosaic", kv_blocksize=32)
    fused, cudnn = BwdParams(variant="mosaic_fused"), BwdParams(variant="cudnn")
    triton, triton_128 = BwdParams(), BwdParams(kv_blocksize=128)
    others = [
        (fwd, split_64),
        (other_fwd, cudnn),
        (fwd, fused),
        (fwd, triton),
        (fwd, cudnn),
        (fwd, triton_128),
    ]
    assert other_backward_kernels((fwd, split), others) == [
        (fwd, fused),
        (fwd, triton),
        (fwd, cudnn),
    ]
    assert other_backward_kernels((fwd, split), []) == []


def test_tuned_config_carries_a_faster_forward_as_its_inference_config():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tune_shipped import with_inference

    from ejkfn import FwdParams
    from ejkfn.attention import AttentionConfig

    train = AttentionConfig(platform="cudnn", variant="cudnn")
    mosaic = AttentionConfig(platform="pallas", variant="mosaic", fwd=FwdParams(kv_blocksize=128))
    assert with_inference(train, []) is train
    assert with_inference(train, [(train, 1.0), (mosaic, 1.5)]) is train
    assert with_inference(train, [(train, 1.0), (mosaic, 0.9)]).inference == mosaic
    assert with_inference(train, [(train, 1.0), (mosaic, 0.9)]).platform == "cudnn"
    # a lead within the margin (1%) keeps the training config's own forward; 2% ships the other
    assert with_inference(train, [(train, 1.005), (mosaic, 1.0)]) is train
    assert with_inference(train, [(train, 1.02), (mosaic, 1.0)]).inference == mosaic
    assert with_inference(train, [(train, 1.02), (mosaic, 1.0)], margin=0.03) is train


def test_tuned_config_prefers_our_kernels_within_the_margin():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tune_shipped import preferring_own, runs_cudnn

    from ejkfn import BwdParams
    from ejkfn.attention import AttentionConfig

    cudnn = AttentionConfig(platform="cudnn", variant="cudnn")
    hybrid = AttentionConfig(platform="pallas", variant="mosaic", bwd=BwdParams(variant="cudnn"))
    fused = AttentionConfig(
        platform="pallas", variant="mosaic", bwd=BwdParams(variant="mosaic_fused")
    )
    split = AttentionConfig(platform="pallas", variant="mosaic", bwd=BwdParams(variant="mosaic"))
    assert runs_cudnn(cudnn) and runs_cudnn(hybrid) and not runs_cudnn(fused)
    # cuDNN's backward kernel 2% ahead of our fastest: within 3%, ours ships
    assert preferring_own([(hybrid, 1.0), (split, 1.03), (fused, 1.02)]) == fused
    # 4% ahead: it ships
    assert preferring_own([(hybrid, 1.0), (fused, 1.04), (cudnn, 1.01)]) == hybrid
    assert preferring_own([(cudnn, 1.0), (fused, 1.02)]) == fused
    assert preferring_own([(cudnn, 1.0), (fused, 1.02)], margin=0.01) == cudnn
    # the fastest ours: unchanged; only cuDNN's timed: cuDNN's
    assert preferring_own([(split, 1.0), (hybrid, 0.99)], margin=0.0) == hybrid
    assert preferring_own([(fused, 1.0), (hybrid, 1.01)]) == fused
    assert preferring_own([(cudnn, 1.0)]) == cudnn
    with pytest.raises(ValueError, match="no timed configs"):
        preferring_own([])


def test_no_margin_for_our_own_kernels_from_the_hybrids_scores():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tune_shipped import OWN_KERNELS_MARGIN, chosen_from_log, own_kernels_margin

    from ejkfn import BwdParams
    from ejkfn.attention import AttentionConfig

    # 2x16384x16x128 is 2**33 scores; head dim 64 keeps the margin at any size
    assert own_kernels_margin("2x16384x16/16x128") == 0.0
    assert own_kernels_margin("1x32768x32/8x128 causal") == 0.0
    assert own_kernels_margin("2x16384x16/16x64") == OWN_KERNELS_MARGIN
    assert own_kernels_margin("4x4096x16/16x128 causal") == OWN_KERNELS_MARGIN
    assert own_kernels_margin("1x16384x32/8x128") == OWN_KERNELS_MARGIN  # 2**31
    for name in ("2x16384x16x128", "2x16384x16/16x128 causal ", "x16/16x128"):
        with pytest.raises(ValueError, match="is not BxSxH/KVHxD"):
            own_kernels_margin(name)
    hybrid = AttentionConfig(platform="pallas", variant="mosaic", bwd=BwdParams(variant="cudnn"))
    fused = AttentionConfig(
        platform="pallas", variant="mosaic", bwd=BwdParams(variant="mosaic_fused")
    )
    entry = {"shape": "2x16384x16/16x128", "seconds": {repr(hybrid): 1.0, repr(fused): 1.012}}
    assert chosen_from_log(entry) == fused
    assert chosen_from_log(entry, own_kernels_margin(entry["shape"])) == hybrid


def test_tune_log_reselects_from_its_recorded_times():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tune_shipped import chosen_from_log, config_of

    from ejkfn import BwdParams, FwdParams
    from ejkfn.attention import AttentionConfig

    hybrid = AttentionConfig(
        platform="pallas", variant="mosaic", fwd=FwdParams(kv_blocksize=128),
        bwd=BwdParams(variant="cudnn"),
    )  # fmt: skip
    fused = AttentionConfig(
        platform="pallas", variant="mosaic", fwd=FwdParams(kv_blocksize=64),
        bwd=BwdParams(q_blocksize=64, kv_blocksize=128, variant="mosaic_fused"),
    )  # fmt: skip
    assert config_of(repr(fused)) == fused
    for text in ("__import__('os')", "FwdParams()", "AttentionConfig(1)", "print(1)"):
        with pytest.raises(ValueError):
            config_of(text)
    entry = {  # as tune() logs it: the fused backward 2% behind, its forward 3% behind
        "seconds": {repr(hybrid): 1.0, repr(fused): 1.02},
        "fwd_seconds": {repr(hybrid): 0.30, repr(fused): 0.309},
    }
    chosen = chosen_from_log(entry)
    assert dataclasses.replace(chosen, inference=None) == fused
    assert chosen.inference == hybrid  # the faster forward, for calls nothing differentiates


def test_reselect_rewrites_only_the_configs_its_tune_made(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tune_shipped import reselect

    import ejkfn
    from ejkfn import BwdParams
    from ejkfn.attention import AttentionConfig

    hybrid = AttentionConfig(platform="pallas", variant="mosaic", bwd=BwdParams(variant="cudnn"))
    fused = AttentionConfig(
        platform="pallas", variant="mosaic", bwd=BwdParams(variant="mosaic_fused")
    )
    meta = {"device_kind": "GPU X", "shape": "1x8x1/1x8", "tuned_fwd_bwd_ms": 1.0}
    layer = ejkfn.PersistentCache(tmp_path / "layer").put("a", hybrid, meta=meta)
    layer.put("b", hybrid, meta={**meta, "shape": "2x8x1/1x8"}).save()

    def log(name: str, shape: str, fastest: float) -> str:
        entry = {"shape": shape, "best": repr(hybrid)}
        entry["seconds"] = {repr(hybrid): fastest, repr(fused): fastest * 1.02}
        path = tmp_path / name
        path.write_text(json.dumps({"device": "GPU X", "log": [entry]}))
        return str(path)

    # "a" came from the tune whose fastest took 1 ms; "b"'s from another (2 ms logged here)
    reselect(
        [log("a.json", "1x8x1/1x8", 1e-3), log("b.json", "2x8x1/1x8", 2e-3)], tmp_path / "layer"
    )
    shipped = ejkfn.PersistentCache(tmp_path / "layer", readonly=True)
    assert shipped.get("a") == fused and shipped.record("a")["meta"] == meta
    assert shipped.get("b") == hybrid
    with pytest.raises(SystemExit, match="no shipped config"):
        reselect([log("c.json", "3x8x1/1x8", 1e-3)], tmp_path / "layer")


@pytest.mark.usefixtures("cudnn_lowering")
@pytest.mark.parametrize(("causal", "ours"), [(False, 2), (True, 3)])
def test_cudnn_paths_time_our_forward_with_its_residuals_beside_the_inference_path(causal, ours):
    """The benchmark's ways to cuDNN's forward lower to the graphs it names: ``jax.nn`` plain and
    with statistics, ours with residuals (statistics), ours where nothing differentiates (head dim
    128 and 1024 keys: statistics causal only, where they make it faster)."""
    [paths] = _benchmark_modules("cudnn_paths_gpu")
    q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
    results = {name: cudnn_forward_results(fn, q, q, q) for name, fn in paths.paths(causal).items()}
    want = {
        "jax.nn": {2},
        "jax.nn with statistics": {3},
        "ejkfn cudnn": {ours},
        paths.RESIDUALS: {3},
    }
    assert results == want


def test_cudnn_paths_refuses_a_pass_it_does_not_know():
    refusal = _refusal("cudnn_paths_gpu.py", "--passes", "fwd,bwd")
    assert "--passes takes fwd and fwd+bwd" in refusal, refusal


def test_platform_table_shows_ratios_to_cudnn_where_the_goals_compare():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from attention import platform_table

    def row(impl, fwd, both):
        return dict(case="2x8192x32/8kvx128 causal", impl=impl, fwd_tflops=fwd, fwd_bwd_tflops=both)

    table = platform_table(
        [row("jax.nn cudnn", 500.0, 400.0), row("ejkfn pallas/mosaic", 550.0, 404.0),
         row("ejkfn triton/triton", 450.4, 380.6), {"case": row("", 0, 0)["case"], "impl": "ejkfn auto", "error": "boom"},
         {"case": row("", 0, 0)["case"], "impl": "ejkernel triton", "correct": False}, row("jax.nn xla", 60.2, 70.0)]
    )  # fmt: skip
    header, rule, line = table.splitlines()
    header_cells = [c.strip() for c in header.strip("|").split("|")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert len(cells) == len(header_cells) == rule.count("---") == 14
    assert cells[:5] == ["2x8192x32(8 kv)x128 causal", "500 / 400", "550 (1.10) / 404 (1.01)", "-", "450 / 381"]  # fmt: skip
    assert cells[7] == "-"  # auto failed: no reading
    assert cells[header_cells.index("XLA")] == "60 / 70"
    assert cells[header_cells.index("ejkernel Triton")] == "wrong"  # its check failed: no timing


def test_goals_count_readings_with_the_head_dims_floor():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from attention import goals, summary

    def row(case, impl, fwd, both):
        return dict(case=case, impl=impl, fwd_tflops=fwd, fwd_bwd_tflops=both)

    d128, d64 = "2x8192x16x128", "8x2048x32x64 causal"
    results = [
        row(d128, "jax.nn cudnn", 500.0, 400.0),
        row(d128, "ejkfn pallas/mosaic", 505.0, 396.0),
        row(d128, "ejkfn cudnn/cudnn", 520.0, 420.0),  # our cuDNN backend: not one of our kernels
        row(d128, "ejkfn auto", 520.0, 404.0),
        row(d64, "jax.nn cudnn", 300.0, 300.0),
        row(d64, "ejkfn pallas/mosaic", 285.0, 310.0),  # 0.95x: enough at head dim 64
        row(d64, "ejkfn auto", 280.0, 310.0),
    ]
    lines = {line.split(" | ")[0].strip("| "): line for line in goals(results).splitlines()}
    assert lines["forward >= 1.0x cuDNN (0.9x at head dim <= 64)"].endswith("| 2 of 2 | 0.950 |  |")
    assert lines["forward+backward >= 1.0x cuDNN"].endswith(
        "| 1 of 2 | 0.990 | 2x8192x16x128: 0.990 |"
    )
    # auto against the fastest ejkfn platform, our cuDNN backend included (420)
    assert lines["auto within 3% of the fastest, forward+backward"].endswith(
        "| 1 of 2 | 0.962 | 2x8192x16x128: 0.962 |"
    )
    assert lines["auto >= 1.0x cuDNN, forward+backward"].endswith(
        "| 2 of 2 | 1.010 |  |"
    )  # what a user gets, whichever kernels its config runs
    assert lines["ahead of tokamax, forward"].endswith("| - | - | |")  # tokamax did not run
    assert "| 2x8192x16x128 | 1.01 (pallas/mosaic) | 0.99 (pallas/mosaic) |" in summary(results)


def test_paired_ratio_compares_each_round_with_the_same_round():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from attention import goals, paired_ratio

    def row(impl, fwd_rounds, both_rounds):
        # TFLOP/s from the median round, as the benchmark saves them (1000 / ms here)
        return dict(
            case="2x8192x16x128", impl=impl,
            fwd_tflops=1e3 / sorted(fwd_rounds)[1], fwd_rounds_ms=fwd_rounds,
            fwd_bwd_tflops=1e3 / sorted(both_rounds)[1], fwd_bwd_rounds_ms=both_rounds,
        )  # fmt: skip

    # a slow middle round for both: the medians read 2.2 against 2.35 (0.936x), the rounds'
    # ratios 2.0 / 1.9, 3.0 / 2.85 (both 1.053) and 2.2 / 2.35
    cudnn = row("jax.nn cudnn", [2.0, 3.0, 2.2], [2.0, 2.0, 2.0])
    mosaic = row("ejkfn pallas/mosaic", [1.9, 2.85, 2.35], [2.0, 2.0, 2.0])
    assert paired_ratio(mosaic, cudnn, "fwd") == pytest.approx(2.0 / 1.9)
    assert paired_ratio(mosaic, cudnn, "fwd_bwd") == pytest.approx(1.0)
    assert paired_ratio(mosaic, {}, "fwd") is None  # cuDNN did not run
    assert paired_ratio(mosaic, {"fwd_rounds_ms": [1.0]}, "fwd") is None  # rounds not paired
    lines = {line.split(" | ")[0].strip("| "): line for line in goals([cudnn, mosaic]).splitlines()}
    assert lines["forward >= 1.0x cuDNN (0.9x at head dim <= 64)"].endswith(
        "| 0 of 1 | 0.936 | 2x8192x16x128: 0.936 |"
    )
    assert lines["forward >= 1.0x cuDNN, median of the rounds' ratios (0.9x at head dim <= 64)"].endswith(
        "| 1 of 1 | 1.053 |  |"
    )  # fmt: skip


def test_long_context_compares_each_length_with_16k():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from mosaic_variants_gpu import long_context

    def row(case, impl, ratio):
        return dict(case=case, pass_="fwd+bwd", impl=impl, vs_cudnn=ratio)

    rows = [
        row("2x16384x16x128 causal", "mosaic + fused", 1.005),
        row("1x32768x16x128 causal", "mosaic + fused", 1.010),
        row("1x65536x16x128 causal", "mosaic + fused", 0.990),
        row("4x8192x16x128 causal", "mosaic + fused", 1.2),  # shorter than 16k: not compared
        row("1x32768x16x128", "mosaic + fused", 1.0),  # no 16k reading without a mask
        dict(case="1x65536x16x128 causal", pass_="fwd+bwd", impl="cudnn"),  # the baseline itself
    ]
    header, rule, line = long_context(rows).splitlines()
    assert line == (
        "| 16x128 causal | fwd+bwd | mosaic + fused | 1.005 | 32k 1.010 (holds), 64k 0.990 (below) |"
    )
    assert long_context(rows[3:]) == ""


def test_tune_shipped_times_each_forward_once():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tune_shipped import distinct_forwards, with_inference

    from ejkfn import BwdParams, FwdParams
    from ejkfn.attention import AttentionConfig

    cudnn = AttentionConfig(platform="cudnn", variant="cudnn")
    fused = AttentionConfig(
        platform="pallas", variant="mosaic", fwd=FwdParams(kv_blocksize=128), bwd=BwdParams()
    )
    split = AttentionConfig(  # the same forward as ``fused``: only the backward's blocks differ
        platform="pallas",
        variant="mosaic",
        fwd=FwdParams(kv_blocksize=128),
        bwd=BwdParams(q_blocksize=32),
    )
    small = AttentionConfig(platform="pallas", variant="mosaic", fwd=FwdParams(kv_blocksize=64))
    assert distinct_forwards([cudnn, fused, split, small]) == [cudnn, fused, small]
    # ``split`` trains; its forward was timed as ``fused``'s, and is the fastest: nothing to add
    assert with_inference(split, [(cudnn, 1.1), (fused, 1.0)]) is split
    assert with_inference(cudnn, [(cudnn, 1.1), (fused, 1.0)]).inference == fused


def test_portable_sweep_times_fitting_configs_beside_the_heuristic():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from attention import Case
    from portable_sweep_gpu import BACKENDS, configs, fits

    from ejkfn.attention import AttentionShape, AttentionSpec

    for case in (Case(2, 8192, 16, 16, 128, True), Case(1, 64, 2, 2, 64, False)):
        spec = AttentionSpec(scale=case.dim**-0.5, causal=case.causal)
        q = jax.ShapeDtypeStruct((case.batch, case.seq, case.heads, case.dim), "bfloat16")
        shape = AttentionShape.of(q, q, spec)
        for name, (module, _, _) in BACKENDS.items():
            heur_f, heur_b = module.heuristic(shape)
            for backward in (False, True):
                cfgs = configs(case, name, backward)
                labels = list(cfgs)
                assert labels[0].endswith("(heuristic)") and labels[0].startswith(name)
                assert (cfgs[labels[0]].fwd, cfgs[labels[0]].bwd) == (heur_f, heur_b)
                for cfg in cfgs.values():
                    assert fits(module, shape, cfg.fwd, cfg.bwd)
                    # one pass's blocks vary, the other's stay the heuristic's
                    assert (cfg.fwd if backward else cfg.bwd) == (heur_f if backward else heur_b)
                if case.seq >= 8192:  # long sequences leave room for alternatives
                    assert len(cfgs) > 3
                    # the heuristic's backward with its dQ kernel on other stages
                    dq = [c.bwd for label, c in cfgs.items() if " dq" in label]
                    assert bool(dq) == backward
                    assert all(
                        b == dataclasses.replace(heur_b, dq_num_stages=b.dq_num_stages) for b in dq
                    )


def test_power_and_clock_reads_nvidia_smi_samples(tmp_path, monkeypatch):
    """Parsed from a stand-in ``nvidia-smi`` that prints a line it cannot read, then samples; None
    where there is no nvidia-smi at all."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import jax.numpy as jnp
    from attention import power_and_clock

    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\necho '[N/A], [N/A]'\nwhile true; do echo '650.5, 1605'; sleep 0.02; done\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    x = jnp.ones(8)
    drawn = power_and_clock(lambda a: a + 1, [(x,)], seconds=0.5)
    assert drawn is not None and drawn["samples"] > 0
    assert (drawn["watts"], drawn["sm_mhz"]) == (650.5, 1605.0)
    fake.unlink()
    assert power_and_clock(lambda a: a + 1, [(x,)], seconds=0.1) is None


def test_revision_ab_control_times_a_second_copy_of_this_tree(tmp_path):
    """``--control`` adds this tree's kernels again as the revision ``control`` and prints this
    tree's ratio to it, the run's floor (with ``--window`` the first folder is the baseline, so
    no GPU-only peer runs)."""
    import shutil

    folder = tmp_path / "_copy"
    folder.mkdir()
    for name in ("_triton.py", "_triton_kernels.py", "_pallas_gpu.py"):
        shutil.copy(ROOT / "ejkfn" / "attention" / name, folder / name)
    out = _run("revision_ab_gpu.py", "--previous", str(folder), "--backends", "pallas", "--shapes", "1x64x2x32", "--masks", "causal", "--passes", "fwd", "--calls", "2", "--rounds", "2", "--window", "8", "--control", "--out", str(tmp_path))  # fmt: skip
    assert "| pallas control |" in out and "| pallas now |" in out
    [floor] = re.findall(r"1x64x2x32 causal fwd pallas now (\d+\.\d+)", out)
    assert float(floor) > 0
    rows = _saved(tmp_path, "revision_ab_*.json")["rows"]
    assert {r["impl"] for r in rows} == {"pallas copy", "pallas control", "pallas now"}
    [ratio] = [r["vs_control"] for r in rows if "vs_control" in r]
    assert abs(ratio - float(floor)) < 1e-3
    clash = _refusal("revision_ab_gpu.py", "--previous", str(tmp_path / "control"), "--control")
    assert "folder names must differ" in clash


def test_copies_times_identical_kernels_as_separate_programs(tmp_path):
    """``copies_gpu.py`` times jits of this tree's kernels and copies of its module side by side,
    each checked against the first, and saves the spread of their medians; ``--copies-first``
    builds the copies first; identical programs compile to the same HLO, and ``--trace`` reads
    each one's kernels under the profiler. Bad counts and backends are refused by name."""
    out = _run("copies_gpu.py", "--backends", "pallas", "--shapes", "1x64x2x32", "--masks", "causal", "--passes", "fwd", "--jits", "1", "--copies", "2", "--no-mha", "--copies-first", "--calls", "2", "--rounds", "2", "--trace", "--trace-rounds", "1", "--out", str(tmp_path))  # fmt: skip
    rows = _saved(tmp_path, "copies_*.json")["rows"]
    assert [r["impl"] for r in rows] == ["pallas copy 0", "pallas copy 1", "pallas tree 0"]
    assert all(r["max_rel_err_vs_pallas copy 0"] == 0.0 for r in rows[1:])  # the same kernels
    times = [r["ms"] for r in rows]
    assert all(r["copies_spread"] == pytest.approx(max(times) / min(times)) for r in rows)
    assert "| 1x64x2x32 causal | fwd | pallas tree 0 |" in out
    assert all(r["same_hlo"] for r in rows) and "optimized HLO the same" in out
    # every program ran the same thunks under the profiler, each at least once
    kernels = [set(r["traced"]) - {"ms", "calls", "idle_us"} for r in rows]
    assert kernels[0] and kernels[0] == kernels[1] == kernels[2]
    assert all(r["traced"]["calls"] >= 3 for r in rows)  # a warm-up call, then one a round
    assert all(v > 0 for r in rows for k, v in r["traced"].items() if k != "idle_us")
    assert all(r["traced"]["idle_us"] >= 0 for r in rows)
    assert "| traced rounds | pallas copy 0 | pallas copy 1 | pallas tree 0 |" in out
    assert "got 1, 0" in _refusal("copies_gpu.py", "--jits", "1", "--copies", "0")
    assert "got ['cuda']" in _refusal("copies_gpu.py", "--backends", "cuda")


def test_same_hlo_points_at_where_identical_programs_differ():
    """``copies_gpu.same_hlo`` sets module names and source metadata aside and reports, for each
    program whose text still differs from the first's, the line and column where it departs."""
    [copies] = _benchmark_modules("copies_gpu")

    class Compiled:  # stands in for jax.jit(...).lower(...).compile()
        def __init__(self, text):
            self.text = text

        def lower(self, *args):
            return self

        def compile(self):
            return self

        def as_text(self):
            return self.text

    def program(label, key, extra=""):
        return Compiled(
            f"HloModule jit_{label}, key={key}\n"
            f'ROOT %r = f32[] add(%p, %q), metadata={{op_name="jit({label})/add"}}{extra}\n'
            f'FileNames\n1 "{label}.py"'
        )

    same = {"t 0": program("t_0", 7), "t 1": program("t_1", 7)}
    assert copies.same_hlo(same, ()) == []
    other = {**same, "copy 0": program("copy_0", 8), "copy 1": program("copy_1", 7, "\nx")}
    [key, length] = copies.same_hlo(other, ())
    assert key.startswith("copy 0, line 1, column 27:") and "key=7" in key and "key=8" in key
    assert length == "copy 1: 3 lines, not 2"


def test_beside_lists_entries_right_after_an_anchor():
    [attention] = _benchmark_modules("attention")
    fns = {"a": 1, "mha": 2, "b": 3}
    assert list(attention.beside(fns, "mha", {"pad": 4})) == ["a", "mha", "pad", "b"]
    assert list(attention.beside(fns, "absent", {"pad": 4})) == ["a", "mha", "b", "pad"]
    assert attention.beside(fns, "mha", {"pad": 4})["pad"] == 4 and list(fns) == ["a", "mha", "b"]


def test_another_program_is_traced_and_compiled_apart_from_its_function():
    # jax.jit of the same function twice finds one trace in JAX's caches: the pad beside mha
    # would time the very executable of the column it copies.
    traces = []

    def double(x):
        traces.append(x)
        return x * 2

    [attention] = _benchmark_modules("attention")
    x = jnp.ones(3)
    jax.jit(double)(x), jax.jit(double)(x)
    assert len(traces) == 1
    out = jax.jit(attention.another_program(double))(x)
    assert len(traces) == 2 and out.tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("flags", [[], ["--pad"], ["--no-pad"]])
def test_revision_ab_pad_takes_the_place_next_to_mha(tmp_path, monkeypatch, flags):
    """The pad, on unless ``--no-pad``, times one more copy of this tree's kernels right after
    ``mha`` (here XLA's attention stands in for it, which needs a GPU), compared with no
    revision."""
    import shutil

    [ab] = _benchmark_modules("revision_ab_gpu")
    monkeypatch.setattr(
        ab,
        "mha",
        lambda case: (
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=case.causal, scale=case.dim**-0.5
            )
        ),
    )
    folder = tmp_path / "before"
    folder.mkdir()
    for name in ("_triton.py", "_triton_kernels.py", "_pallas_gpu.py"):
        shutil.copy(ROOT / "ejkfn" / "attention" / name, folder / name)
    argv = ["revision_ab_gpu.py", "--previous", str(folder), "--backends", "pallas", "--shapes", "1x64x2x32", "--masks", "causal", "--passes", "fwd", "--calls", "2", "--rounds", "2", *flags, "--out", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its neighbours
    try:
        assert ab.main() == 0
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rows = _saved(tmp_path, "revision_ab_*.json")["rows"]
    if flags == ["--no-pad"]:
        assert [r["impl"] for r in rows] == ["mha", "pallas before", "pallas now"]
        return
    assert [r["impl"] for r in rows] == ["mha", "pad", "pallas before", "pallas now"]
    by_impl = {r["impl"]: r for r in rows}
    assert "vs_previous" not in by_impl["pad"] and "vs_previous" in by_impl["pallas now"]
    assert by_impl["pad"]["max_rel_err_vs_mha"] < 2e-2 and by_impl["pad"]["ms"] > 0


def test_revision_ab_loads_an_earlier_revision_beside_this_one(tmp_path):
    """A copy of this tree's portable backends, loaded as an earlier revision, computes what this
    tree does and leaves the registered backends alone; a folder missing a module is refused."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import shutil

    import numpy as np
    from attention import Case, fwd_bwd, inputs
    from revision_ab_gpu import (
        direct,
        parse_split_keys,
        previous_modules,
        with_band_bytes,
        with_value,
    )

    from ejkfn.attention import _backend, _pallas_gpu, _triton
    from ejkfn.attention._backend import backend_for

    folder = tmp_path / "_copy"
    folder.mkdir()
    for name in ("_triton.py", "_triton_kernels.py", "_pallas_gpu.py"):
        shutil.copy(ROOT / "ejkfn" / "attention" / name, folder / name)
    before = backend_for("triton")
    earlier = previous_modules(folder, "copy")
    assert backend_for("triton") is before
    assert earlier["triton"]._KERNELS.endswith("_copy_triton_kernels")
    case = Case(1, 48, 2, 2, 32, True)
    x = inputs(case, 0)
    for name, module in (("triton", _triton), ("pallas", _pallas_gpu)):
        want = jax.jit(fwd_bwd(direct(module, case)))(*x)
        got = jax.jit(fwd_bwd(direct(earlier[name], case)))(*x)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    # --window reaches the kernels: the copy agrees with this tree, and not with the call without it
    x32 = inputs(case, 0, "float32")[:3]
    windowed = jax.jit(direct(_triton, case, window=8, dtype="float32"))(*x32)
    np.testing.assert_array_equal(
        jax.jit(direct(earlier["triton"], case, window=8, dtype="float32"))(*x32), windowed
    )
    unlimited = jax.jit(direct(_triton, case, dtype="float32"))(*x32)
    assert windowed.dtype == np.float32 and not np.allclose(windowed, unlimited, atol=1e-3)

    refusal = _refusal("revision_ab_gpu.py", "--previous", str(folder), "--window", "-4")
    assert "--window must be >= 0 keys; got -4" in refusal

    seen = []
    with_band_bytes(lambda: seen.append(_backend.BAND_BYTES), 3 << 20)()
    assert seen == [3 << 20] and _backend.BAND_BYTES != 3 << 20
    limits = parse_split_keys("256x512,0x0")
    assert limits == [{"fwd": 256, "bwd": 512}, {"fwd": 0, "bwd": 0}]
    with_value(lambda: seen.append(_triton.WINDOW_SPLIT_KEYS), _triton, "WINDOW_SPLIT_KEYS", limits[0])()  # fmt: skip
    assert seen[-1] == limits[0] and _triton.WINDOW_SPLIT_KEYS != limits[0]
    with pytest.raises(ValueError, match=r"FWDxBWD key counts; got '256'"):
        parse_split_keys("256x512,256")
    (folder / "_pallas_gpu.py").unlink()
    with pytest.raises(FileNotFoundError, match=r"_pallas_gpu\.py"):
        previous_modules(folder, "copy2")


@pytest.mark.slow
def test_clock_settle_times_each_target_after_each_predecessor(tmp_path):
    _run("clock_settle_gpu.py", "--shape", "1x64x2x16", "--impls", "jax.nn xla,ejkfn auto", "--settle-ms", "0,2", "--lead-ms", "1", "--batch-ms", "1", "--reps", "2", "--out", str(tmp_path))  # fmt: skip
    saved = _saved(tmp_path, "clock_settle_*.json")
    assert saved["case"] == "1x64x2x16" and saved["pass"] == "forward"
    trials = {(r["target"], r["predecessor"], r["settle_ms"]) for r in saved["readings_ms"]}
    impls = ("jax.nn xla", "ejkfn auto")
    assert trials == {(t, p, s) for t in impls for p in (*impls, "(idle)") for s in (0.0, 2.0)}
    assert all(len(r["ms"]) == 2 and min(r["ms"]) > 0 for r in saved["readings_ms"])
    _run("clock_settle_gpu.py", "--impls", "no such kernel", "--out", str(tmp_path), returncode=2)


def test_ring_timeline_tells_transfers_beside_local_kernels():
    (ring,) = _benchmark_modules("ring_attention")
    kernels = [  # two calls 20 ms apart; a transfer half under a local kernel, then alone
        (0.0, 100.0, "Stream #1", "flash_fwd"),
        (50.0, 130.0, "Stream #2", "ncclDevKernel_SendRecv"),
        (140.0, 160.0, "Stream #1", "merge"),
        (20000.0, 20100.0, "Stream #1", "flash_fwd"),
        (20050.0, 20130.0, "Stream #2", "ncclDevKernel_SendRecv"),
    ]
    seen = ring.summarize(kernels)
    assert seen["calls"][0] == {
        "span_us": 160.0,
        "local_us": 120.0,
        "transfers_us": 80.0,
        "both_us": 50.0,
        "kernels": 3,
    }
    assert seen["calls"][1]["span_us"] == 130.0 and seen["calls"][1]["kernels"] == 2
    assert [k[2] for k in seen["one_call"]] == [0.0, 50.0]


def test_ring_schedule_lists_each_programs_work_in_order(tmp_path):
    _run("ring_schedule.py", "--cpu-smoke", "--seqs", "256", "--heads", "2", "--dim", "32", "--out", str(tmp_path))  # fmt: skip
    saved = _saved(tmp_path, "ring_schedule_2xcpu_*.json")
    programs = {(p["part"], p["causal"]): p["schedule"] for p in saved["programs"]}
    assert sorted(programs) == [
        ("fwd", False),
        ("fwd", True),
        ("fwd_bwd", False),
        ("fwd_bwd", True),
    ]
    for (part, causal), order in programs.items():
        opcodes = [opcode for _, opcode in order]
        assert not {"parameter", "constant", "tuple"} & set(opcodes)
        # Two devices: K and V travel once (training reuses the forward's transfer); dK and dV
        # once, stacked, to where their block lives (the backward ends on each device's own).
        transfers = sum(op.startswith("collective-permute") and op != "collective-permute-done" for op in opcodes)  # fmt: skip
        assert transfers == (2 if part == "fwd" else 3), (part, causal, opcodes)
        assert ("conditional" in opcodes) == causal  # the zigzag's second step picks its pair


@pytest.mark.slow
def test_ring_attention_benchmark_smoke(tmp_path):
    _run("ring_attention.py", "--cpu-smoke", "--seqs", "256", "--heads", "2", "--dim", "32", "--iters", "2", "--rounds", "2", "--transfer-sms", "0", "--no-comm", "--hlo", "--timeline", "--compiler-option", "xla_gpu_collective_permute_combine_threshold_bytes=1073741824", "--out", str(tmp_path))  # fmt: skip
    saved = _saved(tmp_path, "ring_attention_2xcpu_*.json")
    assert saved["agreement"]["one_config"]
    assert saved["environment"]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert [r["causal"] for r in saved["rows"]] == [False, True]
    for row in saved["rows"]:
        # On a CPU the ring picks XLA's chunked attention itself; the baseline runs the same.
        assert row["ring_platform"] == "auto"
        assert "platform='xla', variant='chunked'" in row["cfg"]
        assert max(row["rel_err"].values()) < 1e-2
        timed = [k for k in row if k.endswith(("_ms", "_ms_options")) or "_ms_spared" in k or "_no_comm" in k]  # fmt: skip
        assert len(timed) == 11 and all(row[k] > 0 for k in timed)
        assert {"ring_fwd_ms_options", "ring_fwd_bwd_ms_options"} <= set(timed)
        assert sorted(row["ms_by_process"]) == sorted(timed)
        # Every ring program profiled (a CPU has no GPU kernels to count, only the profile).
        assert sorted(row["timeline"]) == [
            "ring_fwd_bwd_ms",
            "ring_fwd_bwd_ms_no_comm",
            "ring_fwd_bwd_ms_options",
            "ring_fwd_ms",
            "ring_fwd_ms_no_comm",
            "ring_fwd_ms_options",
            "ring_fwd_ms_spared0",
        ]
        assert all(seen["profile_lines"] for seen in row["timeline"].values())
    hlo = sorted(p.name for p in tmp_path.glob("ring_*_hlo_*.txt"))
    parts = ("fwd", "fwd_bwd", "fwd_no_comm")
    assert hlo == sorted(f"ring_{p}_hlo_256_{m}.txt" for p in parts for m in ("causal", "full"))
    # Each variant is a program of its own: only the one without transfers lacks them.
    for name in hlo:
        assert ("collective-permute" in (tmp_path / name).read_text()) != ("no_comm" in name)


@pytest.mark.slow
def test_tuner_harness_times_one_pair_every_way(tmp_path):
    _run("tuner_harness_gpu.py", "--cpu-smoke", "--masks", "both", "--calls", "2", "--rounds", "2", "--min-batch-ms", "1", "--settle-ms", "0", "--out", str(tmp_path))  # fmt: skip
    rows = _saved(tmp_path, "tuner_harness_*.json")["rows"]
    harnesses = [f"{h}, {s}" for h in ("vjp", "weighted loss") for s in ("rotating", "one set")]
    assert [r["harness"] for r in rows] == 2 * [*harnesses, "Tuner"]
    assert [r["case"] for r in rows] == 5 * ["1x256x2x64"] + 5 * ["1x256x2x64 causal"]
    for row in rows:
        assert set(row["ms"]) == {"dense", "chunked"} and min(row["ms"].values()) > 0
        assert row["ratio"] == row["ms"]["chunked"] / row["ms"]["dense"]


def test_same_programs_tells_equal_kernels_from_changed_ones(tmp_path):
    # this tree's backward against a copy of itself: every kernel equal
    source = (ROOT / "ejkfn" / "attention" / "_pallas_mosaic_bwd.py").read_text()
    copy = tmp_path / "copy_bwd.py"
    copy.write_text(source)
    shape = ("--shapes", "1x512x2x128x1", "--masks", "none")
    same = _run("same_programs.py", "--other-bwd", str(copy), *shape)
    assert same.count("| yes |") == 2  # the split's two kernels and the fused one
    # a memory warpgroup with more registers changes the GQA kernels' programs
    edited = tmp_path / "edited_bwd.py"
    assert "_MEMORY_REGISTERS = 24" in source
    edited.write_text(source.replace("_MEMORY_REGISTERS = 24", "_MEMORY_REGISTERS = 32"))
    changed = _run("same_programs.py", "--other-bwd", str(edited), *shape, returncode=1)
    assert "| split backward | 2 | kernel 0: " in changed


_PTX_WITH_LOOPS = """\
.version 9.0
.visible .entry {name}(
)
{{
\tst.shared.b32 [%r1], %r2;
$L__BB0_1:
\tcp.async.wait_group 1;
\tfence.proxy.async.shared::cta;
\twgmma.fence.sync.aligned;
\tfence.proxy.async.shared::cta;
\t@%p1 bra $L__BB0_1;
$L__BB0_2:
\tst.shared.b32 [%r3], %r4;
\tfence.proxy.async.shared::cta;
\t@%p2 bra $L__BB0_2;
$L__BB0_3:
\tcp.async.wait_group 1;
\tbar.sync 0;
\twgmma.fence.sync.aligned;
\twgmma.fence.sync.aligned;
\t@%p3 bra $L__BB0_3;
\tret;
}}
"""


def test_xla_ptxas_keeps_the_ptx_and_hoists_fences_out_of_loops_that_store_nothing(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "ptxas").write_text(
        f'#!/bin/sh\n[ -f "$1" ] && cp "$1" {tmp_path}/assembled.ptx\necho ptxas-ran "$@"\n'
    )
    (real / "ptxas").chmod(0o755)
    wrapper = ROOT / "benchmarks" / "xla_ptxas"
    env = child_env() | {"PATH": f"{wrapper}:{real}:/usr/bin:/bin"}
    env |= {"EJKFN_PTX_DIR": str(tmp_path / "kept"), "EJKFN_HOIST_FENCES": "_nf"}
    for name in ("kernel_nf", "kernel"):
        source = tmp_path / f"{name}.in"
        source.write_text(_PTX_WITH_LOOPS.format(name=name))
        done = subprocess.run(
            [str(wrapper / "ptxas"), str(source), "-o", "x.cubin"], env=env, capture_output=True,
            text=True, check=True,
        )  # fmt: skip
        assert "ptxas-ran" in done.stdout and "-o x.cubin" in done.stdout
        assembled = (tmp_path / "assembled.ptx").read_text()
        assert (tmp_path / "kept" / f"{name}.ptx").read_text() == assembled
        first, second = assembled.split("$L__BB0_2:")
        if name == "kernel":  # not named for it: untouched
            assert assembled == source.read_text()
            continue
        # the first loop stores nothing: its two fences become one before it
        assert first.count("fence.proxy.async") == 1
        assert "\tfence.proxy.async.shared::cta;\n$L__BB0_1:" in first
        assert second.count("fence.proxy.async") == 1  # the second stores: its fence stays
    assert not list(tmp_path.glob("*.edited"))  # the edited copy goes once assembled
    fences = (tmp_path / "kept" / "fences.txt").read_text()
    assert fences == "kernel_nf: hoist 2 fences in 1 loops\n"
    # without a file to assemble, it is the real ptxas
    version = subprocess.run(
        [str(wrapper / "ptxas"), "--version"], env=env, capture_output=True, text=True, check=True
    )
    assert version.stdout.strip() == "ptxas-ran --version"


@pytest.mark.parametrize(
    "mode, fences_per_loop",
    [("hoist", [0, 1, 0]), ("first", [1, 1, 0]), ("add", [2, 1, 1])],
)
def test_xla_ptxas_keeps_one_fence_a_loop_or_adds_one(mode, fences_per_loop):
    from importlib.machinery import SourceFileLoader
    from importlib.util import module_from_spec, spec_from_loader

    loader = SourceFileLoader("xla_ptxas", str(ROOT / "benchmarks" / "xla_ptxas" / "ptxas"))
    module = module_from_spec(spec_from_loader("xla_ptxas", loader))
    loader.exec_module(module)
    lines = _PTX_WITH_LOOPS.format(name="k").split("\n")
    edited = "\n".join(module.edit_fences(lines, mode)[0])
    loops = [edited.split(f"$L__BB0_{n}:")[1].split(f"bra $L__BB0_{n};")[0] for n in (1, 2, 3)]
    assert [body.count("fence.proxy.async") for body in loops] == fences_per_loop
    if mode == "add":  # the fence goes where the loop's wgmmas start, after its copies landed
        assert "bar.sync 0;\n\tfence.proxy.async.shared::cta;\n\twgmma.fence" in loops[2]
    if mode == "first":  # the one kept follows the loop's wait for its copies
        assert loops[0].index("wait_group") < loops[0].index("fence.proxy.async")


def test_triton_sass_reads_ptx_from_a_newer_toolkit(tmp_path):
    ptx = tmp_path / "tiny_loop.ptx"
    ptx.write_text(
        ".version 9.0\n.target sm_90a\n.address_size 64\n"
        ".visible .entry tiny_loop(.param .u32 tiny_loop_param_0)\n{\n"
        "\t.reg .pred %p<2>;\n\t.reg .b32 %r<4>;\n"
        "\tld.param.u32 %r2, [tiny_loop_param_0];\n\tmov.u32 %r1, 0;\n"
        "$L__BB0_1:\n\tfence.proxy.async.shared::cta;\n\tadd.s32 %r1, %r1, 1;\n"
        "\tsetp.lt.s32 %p1, %r1, %r2;\n\t@%p1 bra $L__BB0_1;\n\tret;\n}\n"
    )
    env = child_env()
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "triton_sass.py"), "--ptx", str(ptx), "--json", str(tmp_path / "rows.json")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    [row] = json.loads((tmp_path / "rows.json").read_text())
    assert row["ptx"] == "tiny_loop.ptx" and row["spill_bytes"] == 0
    [loop] = row["loops"]  # the fence stays in the loop, once per unrolled copy
    assert loop["fences"] >= 1 and loop["wgmma"] == 0


@pytest.mark.slow
def test_triton_sass_compiles_a_windows_interior_masked_or_not_as_asked(tmp_path):
    """``--split always`` compiles a float32 window (which the rule keeps masked) with its interior
    loop beside the masked one; ``--split never`` with the masked loop alone."""
    env = child_env()
    env.pop("TRITON_INTERPRET", None)
    loops = {}
    for split in ("always", "never"):
        out = tmp_path / f"{split}.json"
        done = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "triton_sass.py"), "--shapes", "1x512x2x64", "--masks", "causal", "--kernels", "dq", "--feature", "window", "--dtype", "float32", "--split", split, "--json", str(out)],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        [row] = json.loads(out.read_text())
        assert row["case"].endswith(f"split {split}")
        loops[split] = len(row["loops"])
    assert loops == {"always": 2, "never": 1}


def test_pallas_ttir_tells_a_changed_kernel_from_an_unchanged_one(tmp_path):
    """Mirrored and split_dkdv backwards share their dQ kernel's launch: its IR hashes the same,
    their dK/dV kernels' do not; ``--out`` writes the IR the hashes are of."""
    digests = {}
    for variant in ("mirrored", "split_dkdv"):
        out = _run("pallas_ttir.py", "--shapes", "1x256x2x64", "--masks", "causal", "--bwd", f"16x32x4x2x{variant}", "--out", str(tmp_path / variant))  # fmt: skip
        rows = [line.split() for line in out.splitlines()]
        digests[variant] = {row[1]: row[2] for row in rows}
        assert set(digests[variant]) == {
            "ejkfn_flash_fwd", "ejkfn_flash_bwd_dq", "ejkfn_flash_bwd_dkdv",
        }  # fmt: skip
        written = sorted(p.name for p in (tmp_path / variant).iterdir())
        assert written == sorted(f"1x256x2x64-causal-none-{k}.mlir" for k in digests[variant])
    mirrored, split = digests["mirrored"], digests["split_dkdv"]
    assert mirrored["ejkfn_flash_bwd_dq"] == split["ejkfn_flash_bwd_dq"]
    assert mirrored["ejkfn_flash_bwd_dkdv"] != split["ejkfn_flash_bwd_dkdv"]
    ir = (tmp_path / "split_dkdv" / "1x256x2x64-causal-none-ejkfn_flash_bwd_dkdv.mlir").read_text()
    assert "tt.func" in ir and "loc(" not in ir


@pytest.mark.slow
def test_features_benchmark_checks_each_feature_against_the_reference(tmp_path):
    """On the CPU only ``auto`` (the XLA kernel) runs; each feature's arrays must reach it, or its
    output would match the reference without them, which the check would catch."""
    _run("features_gpu.py", "--shapes", "1x256x2x64", "--features", "segments,window,mask", "--passes", "fwd,bwd", "--calls", "1", "--rounds", "1", "--out", str(tmp_path))  # fmt: skip
    rows = _saved(tmp_path, "features_*.json")["rows"]
    assert {(r["feature"], r["pass_"]) for r in rows} == {
        (f, p) for f in ("segments", "window", "mask") for p in ("fwd", "fwd+bwd")
    }
    for r in rows:
        assert r["impl"] == "auto" and r["auto_picks"] == "xla/dense"
        assert r["max_rel_err_vs_reference"] < 2e-2 and r["ms"] > 0


def test_features_differ_from_the_plain_call():
    """Each feature's arrays and spec change what attention computes (else the benchmark would
    time the plain call under another name)."""
    features_gpu, attention = _benchmark_modules("features_gpu", "attention")
    Case, inputs = attention.Case, attention.inputs
    case = Case(1, 256, 2, 2, 64, True)
    q, k, v, _ = inputs(case, 3)
    plain = features_gpu.impls(case, "none")["auto"](q, k, v)
    for feature in features_gpu.FEATURES[1:]:
        arrays = features_gpu.feature_arrays(case, feature)
        got = features_gpu.jitted(features_gpu.impls(case, feature)["auto"], arrays, False)(q, k, v)
        assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - plain))) > 1e-3, feature


def test_features_benchmark_starts_no_case_past_its_seconds(tmp_path):
    """A run the device would cut off keeps what it measured: past ``--seconds`` no case starts."""
    out = _run("features_gpu.py", "--shapes", "1x256x2x64", "--features", "mask", "--seconds", "1e-9", "--out", str(tmp_path))  # fmt: skip
    assert "1x256x2x64 causal mask not run: past --seconds" in out
    assert _saved(tmp_path, "features_*.json")["rows"] == []


def test_features_profile_names_each_program_before_its_calls(tmp_path):
    """``--profile`` runs each program (each pass, each feature) for a profiler, checking and
    timing nothing: no results file is written."""
    out = _run("features_gpu.py", "--shapes", "1x128x2x64", "--features", "none,soft_cap", "--passes", "fwd,bwd", "--profile", "--out", str(tmp_path))  # fmt: skip
    named = [line for line in out.splitlines() if line.startswith("profile: ")]
    assert named == [
        f"profile: 1x128x2x64 causal {feature} {label} auto"
        for feature in ("none", "soft_cap")
        for label in ("fwd", "fwd+bwd")
    ]
    assert not list(tmp_path.glob("features_*.json"))


def test_blocks_on_the_command_line_take_a_variant_and_the_dq_kernels_stages():
    (attention,) = _benchmark_modules("attention")
    parse = attention.parse_params
    assert parse("64x128x8x3", BwdParams) == BwdParams(
        q_blocksize=64, kv_blocksize=128, num_warps=8, num_stages=3
    )
    assert parse("64x128x8x3xmirroredxdq2", BwdParams) == BwdParams(
        q_blocksize=64, kv_blocksize=128, num_warps=8, num_stages=3, variant="mirrored",
        dq_num_stages=2,
    )  # fmt: skip
    assert parse("64x128x8x3xdq1", BwdParams).dq_num_stages == 1
    with pytest.raises(ValueError, match="more than one variant"):
        parse("64x128x8x3xmirroredxwide", BwdParams)


def test_features_benchmark_adds_the_blocks_asked_for(monkeypatch):
    """``--blocks triton:bwd:...`` (or ``:fwd:``) adds a Triton row on those blocks beside the
    heuristic's; no other platform gains a row."""
    features_gpu, attention = _benchmark_modules("features_gpu", "attention")
    Case = attention.Case
    monkeypatch.setattr(features_gpu.ejkfn, "device_kind", lambda: "gpu")
    blocks = ("triton:bwd:32x64x4x3", "triton:fwd:64x32x4x3")
    names = features_gpu.impls(Case(1, 256, 2, 2, 64, True), "segments", blocks)
    assert {"triton/triton", "triton/triton bwd 32x64x4x3", "triton/triton fwd 64x32x4x3"} <= set(
        names
    )
    assert not any(n.startswith("pallas/triton ") for n in names)


def test_features_benchmark_gives_blocks_to_the_variant_named(monkeypatch):
    """``--blocks pallas/mosaic:fwd:...`` adds a row to Mosaic's backend alone: Pallas-Triton's
    kernels take no 12-warp block."""
    features_gpu, attention = _benchmark_modules("features_gpu", "attention")
    monkeypatch.setattr(features_gpu.ejkfn, "device_kind", lambda: "gpu")
    backends = [dataclasses.replace(b, available=lambda: True) for b in registered_backends()]
    monkeypatch.setattr(features_gpu, "registered_backends", lambda: backends)
    case = attention.Case(1, 256, 2, 2, 64, True)
    names = features_gpu.impls(case, "window128", ("pallas/mosaic:fwd:128x128x12x2",))
    assert "pallas/mosaic fwd 128x128x12x2" in names
    assert not any(n.startswith("pallas/triton ") for n in names)


def test_features_benchmark_keeps_only_the_rows_asked_for(monkeypatch):
    """``--only triton/triton`` keeps Triton's heuristic row and its ``--blocks`` rows, nothing
    else; an exact block row's name keeps that row alone."""
    features_gpu, attention = _benchmark_modules("features_gpu", "attention")
    monkeypatch.setattr(features_gpu.ejkfn, "device_kind", lambda: "gpu")
    case, blocks = attention.Case(1, 256, 2, 2, 64, True), ("triton:bwd:32x64x4x3",)
    names = features_gpu.impls(case, "none", blocks, only=frozenset({"triton/triton"}))
    assert set(names) == {"triton/triton", "triton/triton bwd 32x64x4x3"}
    only = frozenset({"triton/triton bwd 32x64x4x3", "auto"})
    assert set(features_gpu.impls(case, "none", blocks, only=only)) == only


def test_features_benchmark_names_an_unknown_only_row():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "features_gpu.py"), "--only", "auto,tritn/triton"],
        capture_output=True, text=True, env=child_env(), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "['tritn/triton'] not among" in proc.stderr


def test_features_benchmark_checks_the_forward_alone_when_only_it_is_timed(monkeypatch):
    """With ``--passes fwd`` each row's forward is checked without compiling its backward (minutes
    a program in float32); a wrong forward still fails the check."""
    features_gpu, attention = _benchmark_modules("features_gpu", "attention")
    case, impls = attention.Case(1, 256, 2, 2, 64, True), features_gpu.impls

    def with_a_wrong_one(*args, **kwargs):
        return impls(*args, **kwargs) | {"wrong": lambda q, k, v, **arrays: v}

    monkeypatch.setattr(features_gpu, "impls", with_a_wrong_one)
    monkeypatch.setattr(features_gpu, "fwd_bwd", lambda fn: pytest.fail("a backward compiled"))
    errors = features_gpu.check(case, "mask", backward=False)
    assert errors["auto"] < 2e-2 < errors["wrong"]


def test_features_benchmark_names_a_malformed_block():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "features_gpu.py"), "--blocks", "triton:bwd:32x64"],
        capture_output=True, text=True, cwd=ROOT / "benchmarks",
    )  # fmt: skip
    assert proc.returncode == 2
    assert "'triton:bwd:32x64' is not PLATFORM[/VARIANT]:fwd|bwd:BQxBKxWxS" in proc.stderr


def test_features_benchmark_takes_a_window_width_and_names_an_unknown_feature():
    """``windowN`` is a window N keys wide on either side (``window``: a quarter of the sequence),
    ``bias_f32`` a bias in float32; a feature it does not know is an error naming it."""
    features_gpu, attention = _benchmark_modules("features_gpu", "attention")
    case = attention.Case(1, 2048, 2, 2, 64, True)
    assert features_gpu.case_spec(case, "window").window == (512, 512)
    assert features_gpu.case_spec(case, "window100").window == (100, 100)
    assert features_gpu.case_spec(case, "none").window is None
    assert features_gpu.case_spec(case, "bias_f32").has_bias
    assert features_gpu.feature_arrays(case, "bias_f32")["bias"].dtype == jnp.float32
    assert features_gpu.feature_arrays(case, "bias")["bias"].dtype == jnp.bfloat16
    for bad in ("window-3", "windows", "bias2"):
        with pytest.raises(ValueError, match=repr(bad)):
            features_gpu.case_spec(case, bad)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "features_gpu.py"), "--features", "mask,windowx"],
        capture_output=True, text=True, cwd=ROOT / "benchmarks",
    )  # fmt: skip
    assert proc.returncode == 2 and "'windowx' is not one of" in proc.stderr


def test_features_benchmark_passes_a_features_arrays_as_arguments():
    """A bias closed over became a constant of the program (a 2 GiB one took a minute a compile);
    :func:`features_gpu.jitted` passes the arrays in, so lowering captures no constant of note."""
    features_gpu, attention = _benchmark_modules("features_gpu", "attention")
    Case, inputs = attention.Case, attention.inputs
    case = Case(1, 256, 2, 2, 64, False)
    q, k, v, do = inputs(case, 3)
    arrays = features_gpu.feature_arrays(case, "bias")  # 256 KiB
    fn = features_gpu.impls(case, "bias")["auto"]
    before = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", 64 * 1024)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            features_gpu.jitted(fn, arrays, backward=True)(q, k, v, do)
            with pytest.raises(UserWarning, match="constants were captured"):  # it can fail
                jax.jit(lambda q, k, v: fn(q, k, v, **arrays))(q, k, v)
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", before)


def test_decode_benchmark_checks_times_and_saves(tmp_path):
    """decode_gpu.py on the CPU: the backends native there (XLA's) and ``auto``, checked against
    the reference (causal with the queries last, jax.nn's rows given that mask), timed and saved;
    a bad shape, sweep or chunks item is refused naming it."""
    out = _run("decode_gpu.py", "--shapes", "2x1x256x4x2x32,2x3x256x4x2x32c", "--calls", "1", "--rounds", "1", "--skip", "jax.nn cudnn", "--chunks", "16x64", "--out", str(tmp_path))  # fmt: skip
    rows = _saved(tmp_path, "decode_*.json")["rows"]
    assert {r["impl"] for r in rows} >= {
        "ejkfn xla/dense", "ejkfn xla/chunked 16x64", "ejkfn auto", "jax.nn xla"
    }  # fmt: skip
    assert all(r["error"] < 2e-2 and r["gb_per_s"] > 0 for r in rows), rows
    assert "| 2x1:256x4(2 kv)x32 | ejkfn auto |" in out
    assert "| 2x3:256x4(2 kv)x32 causal | jax.nn xla |" in out
    # --backward: the output and the three gradients, each against the float32 reference's
    _run("decode_gpu.py", "--shapes", "2x3x256x4x2x32c", "--calls", "1", "--rounds", "1", "--skip", "jax.nn cudnn,xla/chunked", "--backward", "--out", str(tmp_path / "bwd"))  # fmt: skip
    rows = _saved(tmp_path / "bwd", "decode_*.json")["rows"]
    assert {r["impl"] for r in rows} == {"ejkfn xla/dense", "ejkfn auto", "jax.nn xla"}
    assert all(r["pass_"] == "fwd+bwd" and r["error"] < 2e-2 for r in rows), rows
    # a feature and a dtype: checked against the dense reference with that feature
    _run("decode_gpu.py", "--shapes", "2x3x256x4x2x32c", "--calls", "1", "--rounds", "1", "--skip", "jax.nn cudnn,xla/chunked", "--dtype", "float32", "--feature", "bias", "--out", str(tmp_path / "bias"))  # fmt: skip
    rows = _saved(tmp_path / "bias", "decode_*.json")["rows"]
    assert {r["impl"] for r in rows} == {"ejkfn xla/dense", "ejkfn auto", "jax.nn xla"}
    assert all(r["case"] == "2x3:256x4(2 kv)x32 causal float32 bias" for r in rows), rows
    assert all(r["error"] < 1e-5 for r in rows), rows  # float32 throughout
    _run("decode_gpu.py", "--shapes", "2x3x256x4x2x32c", "--calls", "1", "--rounds", "1", "--skip", "jax.nn cudnn,xla/chunked", "--feature", "dropout", "--backward", "--out", str(tmp_path / "dropout"))  # fmt: skip
    rows = _saved(tmp_path / "dropout", "decode_*.json")["rows"]
    assert {r["impl"] for r in rows} == {"ejkfn xla/dense", "ejkfn auto"}  # jax.nn: no dropout
    assert all(r["error"] < 2e-2 for r in rows), rows
    # a window of 64 keys behind each query: the chunked variant skips the blocks it hides
    _run("decode_gpu.py", "--shapes", "1x256x256x4x2x32c", "--calls", "1", "--rounds", "1", "--skip", "jax.nn cudnn", "--feature", "window64", "--chunks", "32x64", "--out", str(tmp_path / "window"))  # fmt: skip
    rows = _saved(tmp_path / "window", "decode_*.json")["rows"]
    assert {r["impl"] for r in rows} == {
        "ejkfn xla/dense", "ejkfn xla/chunked", "ejkfn xla/chunked 32x64", "ejkfn auto"
    }  # fmt: skip
    assert all(r["case"] == "1x256:256x4(2 kv)x32 causal window64" for r in rows), rows
    assert all(r["error"] < 2e-2 for r in rows), rows
    _run("decode_gpu.py", "--shapes", "2x1x256x4", returncode=2)
    _run("decode_gpu.py", "--feature", "windowx", returncode=2)
    (decode_gpu,) = _benchmark_modules("decode_gpu")
    # the bias travels as an argument of each program, one per head
    case = decode_gpu.DecodeCase.parse("2x3x256x4x2x32c")
    biased = decode_gpu.dataclasses.replace(case, feature="bias")
    assert biased.arrays()["bias"].shape == (1, 4, 3, 256)
    from ejkfn import FwdParams

    base = FwdParams(q_blocksize=16, kv_blocksize=128, kv_splits=8)
    assert decode_gpu.sweep_params(base, "64x4x3xm0.5") == FwdParams(
        q_blocksize=16, kv_blocksize=64, num_warps=4, num_stages=3, kv_splits=4
    )
    assert decode_gpu.sweep_params(base, "128x8x2x3").kv_splits == 3
    assert decode_gpu.sweep_params(base, "64x128x8x2x3").q_blocksize == 64
    # causal: 3 * 256 - 3 visible pairs a head
    assert decode_gpu.DecodeCase.parse("2x3x256x4x2x32c").flops(False) == 4 * 2 * 4 * 765 * 32
    with pytest.raises(ValueError, match="64x4"):
        decode_gpu.sweep_params(base, "64x4")
    fwd, bwd = decode_gpu.chunk_params("256x1024")
    assert (fwd.q_blocksize, fwd.kv_blocksize, bwd.q_blocksize, bwd.kv_blocksize) == (
        256, 1024, 256, 1024
    )  # fmt: skip
    with pytest.raises(ValueError, match="'256'"):
        decode_gpu.chunk_params("256")


def test_small_tiles_checks_the_fixed_kernels_beside_the_faulty_build(tmp_path):
    """In the interpreter both builds are right (the fault is the compiled kernel's); the copy
    with the pair hash at every width loads under its own name and runs, and so does Pallas-Triton."""
    out = _run(
        "small_tiles_gpu.py", "--small", "--only", "forward q16 all four, (16, 16", "--out",
        str(tmp_path),
    )  # fmt: skip
    assert "PASS forward q16 all four, (16, 16, 4, 2)" in out
    assert "PASS pair hash forward q16 all four, (16, 16, 4, 2)" in out
    cases = _saved(tmp_path, "small_tiles.json")["cases"]
    assert [c["backend"] for c in cases] == ["triton", "pair-hash", "pallas"]


def test_tune_check_reports_each_backends_largest_error(tmp_path):
    out = _run("tune_check_gpu.py", "--cpu-smoke", "--overhead", "--out", str(tmp_path))
    assert "xla/dense          largest error 0.00e+00  (the reference's own) ok" in out
    saved = _saved(tmp_path, "tune_check.json")
    [case] = saved["cases"]
    assert 0 < case["worst"]["xla/chunked"] < case["tolerance"] and not case["not_checked"]
    [cost] = saved["overhead"]
    assert set(cost["seconds"]) == {"unchecked", "checked", "unchecked again"}


def test_revisions_for_ncu_marks_each_revision_before_its_calls(tmp_path):
    """This tree's kernels, then each earlier revision's, each announced before its timed calls;
    a malformed shape is refused naming it."""
    import shutil

    folder = tmp_path / "before"
    folder.mkdir()
    for name in ("_triton.py", "_triton_kernels.py", "_pallas_gpu.py"):
        shutil.copy(ROOT / "ejkfn" / "attention" / name, folder / name)
    out = _run("revisions_for_ncu.py", "--shapes", "1x64x1x32c", "--previous", str(folder), "--calls", "1")  # fmt: skip
    marks = [line for line in out.splitlines() if line.startswith("profile: ")]
    assert marks == ["profile: 1x64x1x32c tree", "profile: 1x64x1x32c before"]
    assert "'1x64x32c'" in _refusal("revisions_for_ncu.py", "--shapes", "1x64x32c")


def test_ncu_source_sums_stall_samples_by_reason_opcode_and_instruction(tmp_path):
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_long_sb",
              "stall_wait", "stall_long_sb (Not Issued)"]  # fmt: skip
    rows = [
        ["0x1", "FENCE.VIEW.ASYNC.S", "30", "25", "5", "99"],
        ["0x2", "@!P0 LDGSTS.E.BYPASS.128 [R1]", "10", "0", "10", "0"],
        ["0x3", "FADD R1, R2, -R3", "60", "50", "10", "0"],
    ]
    report = tmp_path / "source.csv"
    with report.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Kernel Name", "bwd_dkdv_kernel"])
        writer.writerow(header)
        writer.writerows(rows)
    out = _run("ncu_source.py", str(report), "--top", "2")
    lines = out.splitlines()
    assert lines[0] == "== bwd_dkdv_kernel: 3 instructions, 100 samples"
    assert lines[1] == "  reasons: long_sb 75.0%, wait 25.0%"  # "Not Issued" columns left out
    assert lines[2] == "  opcodes: FADD 60.0%, FENCE 30.0%, LDGSTS 10.0%"
    assert lines[3].split()[:2] == ["0x3", "60.00%"] and "long_sb 50, wait 10" in lines[3]
    assert len(lines) == 5  # two instructions listed
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    assert "not ncu's source page" in _refusal("ncu_source.py", str(tmp_path / "other.csv"))
