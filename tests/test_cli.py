"""The ``ejkfn`` command line does what its ``--help`` says."""

import json
import subprocess
import sys

import pytest

import ejkfn
from ejkfn._cli import main


def run(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EJKFN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_tune_builtin_workload_saves_configs(cache_dir, capsys):
    code, out, _ = run(["tune", "--warmup", "0", "--iters", "1", "--quiet"], capsys)
    assert code == 0
    assert out.count("chosen:") >= 2 and "time (ms)" in out
    assert f"to {cache_dir}" in out
    assert len(ejkfn.PersistentCache(cache_dir)) == out.count("chosen:")


def test_tune_one_kernel_for_a_shape(cache_dir, capsys):
    code, out, _ = run(
        ["tune", "scale", "--shape", "16,8", "--iters", "1", "--warmup", "0", "--quiet"], capsys
    )
    assert code == 0 and "float32[16, 8]" in out
    key = next(iter(ejkfn.PersistentCache(cache_dir).keys()))
    record = ejkfn.PersistentCache(cache_dir).record(key)
    assert record["meta"]["seconds"] > 0


def test_tune_with_a_runoff(cache_dir, capsys):
    args = ["tune", "scale", "--shape", "16,8", "--iters", "1", "--warmup", "0", "--quiet"]
    code, out, _ = run([*args, "--runoff", "10"], capsys)  # every candidate within 1000%
    assert code == 0 and "note: runoff:" in out


def test_tune_flash_attention(cache_dir, capsys):
    code, out, _ = run(
        [
            "tune",
            "flash_attention",
            "--shape",
            "1,64,2,32",
            "--causal",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--quiet",
            "--platform",
            "xla",
        ],
        capsys,
    )
    assert code == 0, out
    assert "chosen:" in out and "flash_attention" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["tune", "nope"], "unknown kernel 'nope'"),
        (["tune", "scale", "--shape", "1,2,3"], "2-d --shape"),
        (["tune", "--shape", "4,4"], "needs a kernel name"),
        (["tune", "scale", "--dtype", "int4"], "--dtype must be one of"),
        (
            ["tune", "flash_attention", "--shape", "1,64,4,32", "--kv-heads", "3"],
            "must divide heads",
        ),
        (["tune", "scale", "--iters", "0"], "iters must be >= 1"),
        (["tune", "scale", "--runoff", "-0.5"], "runoff must be a fraction >= 0"),
        (["cache", "show", "missing/key"], "no entry"),
        (["cache", "export"], "needs a FILE"),
    ],
)
def test_bad_arguments_exit_non_zero_with_a_clear_error(args, message, cache_dir, capsys):
    code, _, err = run(args, capsys)
    assert code == 2 and message in err


def test_argparse_errors_and_help(capsys):
    # One child process for ``python -m ejkfn._cli`` itself; the rest in this one (a child imports
    # jax anew: seconds each).
    proc = subprocess.run(
        [sys.executable, "-m", "ejkfn._cli", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "usage: ejkfn" in proc.stdout
    for args in (["tune", "--help"], ["cache", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 0 and "usage: ejkfn" in capsys.readouterr().out
    for args, message in (
        (["tune", "scale", "--shape", "3,x"], "--shape must be comma-separated integers"),
        (["cache", "frobnicate"], "invalid choice"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_cache_commands(cache_dir, tmp_path, capsys):
    run(["tune", "scale", "--shape", "8,4", "--iters", "1", "--warmup", "0", "--quiet"], capsys)
    run(["tune", "scale", "--shape", "4,4", "--iters", "1", "--warmup", "0", "--quiet"], capsys)
    code, out, _ = run(["cache", "path"], capsys)
    assert code == 0 and out.strip() == str(cache_dir)
    code, out, err = run(["cache", "ls"], capsys)
    keys = [line.split()[0] for line in out.splitlines()]
    assert code == 0 and len(keys) == 2 and "2 entries" in err
    code, out, _ = run(["cache", "show", keys[0]], capsys)
    assert code == 0 and json.loads(out)["cfg"]["type"] == "ejkfn.testing:ScaleCfg"
    exported = tmp_path / "export.json"
    code, out, _ = run(["cache", "export", str(exported)], capsys)
    assert code == 0 and exported.exists() and "exported 2" in out
    # clear asks first; without a terminal and without --yes it refuses and deletes nothing
    code, _, err = run(["cache", "clear"], capsys)
    assert code == 2 and "--yes" in err and len(ejkfn.PersistentCache(cache_dir)) == 2
    code, out, _ = run(["cache", "clear", "--yes"], capsys)
    assert code == 0 and len(ejkfn.PersistentCache(cache_dir)) == 0
    code, out, _ = run(["cache", "import", str(exported)], capsys)
    assert code == 0 and len(ejkfn.PersistentCache(cache_dir)) == 2
    other = tmp_path / "other"
    code, _, _ = run(["cache", "clear", "--yes", "--kernel", "scale"], capsys)
    assert len(ejkfn.PersistentCache(cache_dir)) == 0
    ejkfn.PersistentCache(other).import_file(exported).save()
    code, out, _ = run(["cache", "merge", str(other)], capsys)
    assert code == 0 and len(ejkfn.PersistentCache(cache_dir)) == 2
    code, _, err = run(["cache", "merge", str(tmp_path / "nowhere")], capsys)
    assert code == 2 and "not one" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run(["cache", "import", str(bad)], capsys)
    assert code == 2 and "bad.json" in err
