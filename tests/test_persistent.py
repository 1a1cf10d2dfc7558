"""Tests for the directory-backed persistent config cache."""

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import warnings

import filelock
import pytest

from ejkfn import _persistent
from ejkfn._persistent import (
    SCHEMA,
    CacheCorruptionWarning,
    PersistentCache,
    default_cache_dir,
)
from ejkfn._serialize import cfg_to_dict
from tests._cfgs import BlockCfg, NestedCfg

REPO = pathlib.Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    """Environment for a child Python that imports ejkfn and tests from this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EJKFN_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _python(code: str, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextlib.contextmanager
def _no_corruption_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheCorruptionWarning)
        yield


def _load_clean(path: pathlib.Path, **kwargs) -> PersistentCache:
    with _no_corruption_warnings():
        return PersistentCache(path, **kwargs)


def _record(cfg, schema: int = 1) -> dict:
    return {
        "cfg": cfg_to_dict(cfg),
        "meta": {},
        "written_at": "2025-01-01T00:00:00.000+00:00",
        "ejkfn_schema": schema,
    }


def _write_doc(file: pathlib.Path, entries: dict) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({"schema": SCHEMA, "entries": entries}))


def _temps(directory: pathlib.Path) -> list[pathlib.Path]:
    return [p for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]


def test_round_trip(tmp_path):
    cfg = NestedCfg(inner=BlockCfg(block_q=32), stages=(3, 4, 5))
    cache = PersistentCache(tmp_path).put("flash_attn/ab12", cfg, meta={"ms": 1.5, "dev": ("a",)})
    assert cache.get("flash_attn/ab12") is cfg
    saved = cache.save()
    assert saved.get("flash_attn/ab12") == cfg
    fresh = _load_clean(tmp_path)
    assert fresh.get("flash_attn/ab12") == cfg
    assert fresh.get("flash_attn/missing") is None
    record = fresh.record("flash_attn/ab12")
    assert record["cfg"] == cfg_to_dict(cfg)
    assert record["meta"] == {"ms": 1.5, "dev": ["a"]}
    assert record["ejkfn_schema"] == 1
    assert record["written_at"].endswith("+00:00")
    text = (tmp_path / "flash_attn.json").read_text()
    assert text.startswith('{\n "entries": {\n')  # indented, sorted keys
    assert json.loads(text)["schema"] == SCHEMA
    assert list(fresh.keys()) == ["flash_attn/ab12"]
    assert dict(fresh.items()) == {"flash_attn/ab12": cfg}
    assert "flash_attn/ab12" in fresh and len(fresh) == 1 and list(fresh) == ["flash_attn/ab12"]


def test_kernel_names_are_sanitised_into_shards(tmp_path):
    cache = PersistentCache(tmp_path)
    cache = cache.put("my kernel:v2/aa", BlockCfg()).put(".hidden/bb", BlockCfg()).save()
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != ".lock")
    assert names == ["_.hidden.json", "my_kernel_v2.json"]
    assert _load_clean(tmp_path).get("my kernel:v2/aa") == BlockCfg()


def test_immutability(tmp_path):
    c0 = PersistentCache(tmp_path)
    c1 = c0.put("k/1", BlockCfg(block_q=1))
    assert c0.get("k/1") is None and len(c0) == 0 and not c0.pending
    assert set(c1.pending) == {"k/1"}
    c2 = c1.save()
    assert set(c1.pending) == {"k/1"} and c1.get("k/1") == BlockCfg(block_q=1)
    assert not c2.pending and c2.get("k/1") == BlockCfg(block_q=1)
    assert c0.get("k/1") is None and len(c0) == 0
    c3 = c2.put("k/1", BlockCfg(block_q=2))
    assert c2.get("k/1") == BlockCfg(block_q=1) and c3.get("k/1") == BlockCfg(block_q=2)
    with pytest.raises(AttributeError):
        c2._loaded = {}
    with pytest.raises(TypeError):
        c1.pending["k/2"] = {}  # a read-only view
    c1.record("k/1")["meta"]["x"] = 1  # a copy
    assert c1.record("k/1")["meta"] == {}


def test_nothing_on_disk_until_save(tmp_path):
    path = tmp_path / "never"
    cache = PersistentCache(path)
    assert cache.save() is cache  # nothing pending: no-op
    cache.put("k/1", BlockCfg())
    assert not path.exists()


def test_get_decodes_once(tmp_path):
    PersistentCache(tmp_path).put("k/1", BlockCfg()).save()
    cache = _load_clean(tmp_path)
    assert cache.get("k/1") is cache.get("k/1")
    # The memo survives a put and a reload of an unchanged record.
    assert cache.put("k/2", BlockCfg()).get("k/1") is cache.get("k/1")
    assert cache.reload().get("k/1") is cache.get("k/1")


def test_reload_keeps_pending(tmp_path):
    mine = PersistentCache(tmp_path).put("a/1", BlockCfg(block_q=1))
    PersistentCache(tmp_path).put("b/2", BlockCfg(block_q=2)).save()
    assert "b/2" not in mine
    reloaded = mine.reload()
    assert reloaded.get("b/2") == BlockCfg(block_q=2)
    assert set(reloaded.pending) == {"a/1"}
    assert "b/2" not in mine
    assert set(reloaded.save().keys()) == {"a/1", "b/2"}


def test_save_merges_with_other_writers(tmp_path):
    a = PersistentCache(tmp_path)
    b = PersistentCache(tmp_path)
    a.put("attn/1", BlockCfg(block_q=1)).save()
    merged = b.put("attn/2", BlockCfg(block_q=2)).save()
    assert set(merged.keys()) == {"attn/1", "attn/2"}
    assert set(_load_clean(tmp_path).keys()) == {"attn/1", "attn/2"}


def test_read_by_a_fresh_process(tmp_path):
    cfg = NestedCfg(inner=BlockCfg(block_k=16), stages=(7,))
    PersistentCache(tmp_path).put("attn/xyz", cfg).save()
    code = (
        "import sys, warnings\n"
        "warnings.simplefilter('error')\n"
        "from ejkfn._persistent import PersistentCache\n"
        "print(repr(PersistentCache(sys.argv[1]).get('attn/xyz')))\n"
    )
    out, err = _python(code, str(tmp_path)).communicate(timeout=60)
    assert out.strip() == repr(cfg), err


_WRITER = """
import pathlib, sys, time
from ejkfn._persistent import PersistentCache
from tests._cfgs import BlockCfg
directory, worker, n, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
while not pathlib.Path(go).exists():
    time.sleep(0.001)
cache = PersistentCache(directory)
for i in range(n):
    kernel = "attn" if i % 2 else "matmul"  # two shards, both shared by every worker
    cfg = BlockCfg(block_q=i + 1, block_k=worker + 1)
    cache = cache.put(f"{kernel}/{worker:02d}{i:03d}", cfg, meta={"worker": worker}).save()
print(len(cache))
"""


def test_concurrent_writers_lose_nothing(tmp_path):
    directory, go = tmp_path / "cache", tmp_path / "go"
    workers, n = 5, 25
    procs = [_python(_WRITER, str(directory), str(w), str(n), str(go)) for w in range(workers)]
    go.touch()
    # Readers take no lock: while the writers run, every load must see whole files.
    while any(p.poll() is None for p in procs):
        _load_clean(directory)
        time.sleep(0.005)
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    cache = _load_clean(directory)
    expected = {
        f"{'attn' if i % 2 else 'matmul'}/{w:02d}{i:03d}": BlockCfg(block_q=i + 1, block_k=w + 1)
        for w in range(workers)
        for i in range(n)
    }
    assert dict(cache.items()) == expected
    assert not _temps(directory)


_KILLED_SAVER = """
import sys
from ejkfn._persistent import PersistentCache
from tests._cfgs import BlockCfg
PersistentCache(sys.argv[1]).put("attn/new", BlockCfg(block_q=2)).save()
"""


def test_killed_inside_save_leaves_readable_cache(tmp_path):
    PersistentCache(tmp_path).put("attn/old", BlockCfg(block_q=1)).save()
    proc = _python(_KILLED_SAVER, str(tmp_path), EJKFN_TEST_SAVE_PAUSE="60")
    deadline = time.monotonic() + 30
    while not _temps(tmp_path):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the saver never wrote its temp file"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    [temp] = _temps(tmp_path)
    cache = _load_clean(tmp_path)  # the temp file is ignored
    assert cache.get("attn/old") == BlockCfg(block_q=1)
    assert "attn/new" not in cache
    # The dead process's lock is gone, so saving works at once; a young temp file is kept.
    cache = cache.put("attn/later", BlockCfg(block_q=3)).save()
    assert set(_load_clean(tmp_path).keys()) == {"attn/old", "attn/later"}
    assert temp.exists()
    # Once older than a minute it is cleaned up by the next save.
    old = time.time() - 120
    os.utime(temp, (old, old))
    cache.put("attn/last", BlockCfg()).save()
    assert not temp.exists()


def _corruptions(good: bytes) -> dict[str, bytes]:
    return {
        "truncated": good[: len(good) // 2],
        "empty": b"",
        "garbage": b"\x00\xff\xfe\x80 not json",
        "not_utf8_json": b'{"schema": "\xff"}',
        "wrong_schema": json.dumps({"schema": "other.cache/9", "entries": {}}).encode(),
        "top_level_list": b"[1, 2, 3]",
        "entries_not_object": json.dumps({"schema": SCHEMA, "entries": [1]}).encode(),
    }


_KINDS = list(_corruptions(b"{}"))


@pytest.mark.parametrize("kind", _KINDS)
def test_corrupt_file_is_moved_aside_at_load(tmp_path, kind):
    PersistentCache(tmp_path).put("attn/a", BlockCfg()).put("mm/b", BlockCfg()).save()
    shard = tmp_path / "attn.json"
    shard.write_bytes(_corruptions(shard.read_bytes())[kind])
    with pytest.warns(CacheCorruptionWarning, match=r"attn\.json"):
        cache = PersistentCache(tmp_path)
    assert cache.get("attn/a") is None and "attn/a" not in cache
    assert cache.get("mm/b") == BlockCfg()
    assert not shard.exists()
    assert len(list(tmp_path.glob("attn.json.corrupt-*"))) == 1
    cache = cache.put("attn/c", BlockCfg(block_q=9)).save()
    assert set(_load_clean(tmp_path).keys()) == {"mm/b", "attn/c"}


@pytest.mark.parametrize("kind", _KINDS)
def test_corrupt_file_is_moved_aside_when_saving_over_it(tmp_path, kind):
    writer = PersistentCache(tmp_path).put("attn/a", BlockCfg()).save()
    shard = tmp_path / "attn.json"
    shard.write_bytes(_corruptions(shard.read_bytes())[kind])
    with pytest.warns(CacheCorruptionWarning, match=r"attn\.json.*ignoring"):
        readonly = PersistentCache(tmp_path, readonly=True)
    assert shard.exists() and len(readonly) == 0  # read-only: left where it is
    with pytest.warns(CacheCorruptionWarning, match=r"attn\.json"):
        saved = writer.put("attn/b", BlockCfg(block_q=5)).save()
    assert set(saved.keys()) == {"attn/b"}
    assert len(list(tmp_path.glob("attn.json.corrupt-*"))) == 1
    assert _load_clean(tmp_path).get("attn/b") == BlockCfg(block_q=5)


def test_bad_record_is_skipped(tmp_path):
    _write_doc(
        tmp_path / "attn.json",
        {
            "attn/good": _record(BlockCfg(block_q=7)),
            "attn/no_cfg": {"meta": {}, "ejkfn_schema": 1},
            "attn/not_object": [1, 2],
            "attn/bad_fields": {**_record(BlockCfg()), "cfg": {"type": "x:Y", "fields": 3}},
        },
    )
    with pytest.warns(CacheCorruptionWarning) as caught:
        cache = PersistentCache(tmp_path)
    messages = " ".join(str(w.message) for w in caught)
    for key in ("attn/no_cfg", "attn/not_object", "attn/bad_fields"):
        assert key in messages
    assert "attn.json" in messages
    assert list(cache.keys()) == ["attn/good"]
    assert cache.get("attn/good") == BlockCfg(block_q=7)
    # Rewriting the shard drops the bad records and keeps the good one.
    with pytest.warns(CacheCorruptionWarning):
        cache.put("attn/new", BlockCfg()).save()
    assert set(_load_clean(tmp_path).keys()) == {"attn/good", "attn/new"}


def test_unimportable_cfg_type_is_unusable(tmp_path):
    bad = _record(BlockCfg())
    bad["cfg"]["type"] = "tests._no_such_module:Cfg"
    _write_doc(tmp_path / "attn.json", {"attn/bad": bad, "attn/ok": _record(BlockCfg())})
    cache = _load_clean(tmp_path)  # decoding is lazy
    with pytest.warns(CacheCorruptionWarning, match=r"attn\.json.*attn/bad"):
        assert cache.get("attn/bad") is None
    with _no_corruption_warnings():
        assert cache.get("attn/bad") is None  # memoised: warned once
        assert dict(cache.items()) == {"attn/ok": BlockCfg()}
    # The record stays on disk: another program may be able to import its type.
    with _no_corruption_warnings():
        cache.put("attn/more", BlockCfg()).save()
    assert "attn/bad" in json.loads((tmp_path / "attn.json").read_text())["entries"]


def test_other_record_schema_is_not_used_but_kept(tmp_path):
    _write_doc(
        tmp_path / "attn.json",
        {"attn/future": _record(BlockCfg(), schema=2), "attn/now": _record(BlockCfg())},
    )
    cache = _load_clean(tmp_path)
    assert cache.get("attn/future") is None and "attn/future" not in cache
    assert cache.get("attn/now") == BlockCfg()
    with _no_corruption_warnings():
        cache.put("attn/more", BlockCfg()).save()
    entries = json.loads((tmp_path / "attn.json").read_text())["entries"]
    assert set(entries) == {"attn/future", "attn/now", "attn/more"}


def test_readonly_refuses_writes(tmp_path):
    PersistentCache(tmp_path).put("k/1", BlockCfg()).save()
    cache = PersistentCache(tmp_path, readonly=True)
    assert cache.readonly and cache.get("k/1") == BlockCfg()
    with pytest.raises(ValueError, match="read-only"):
        cache.put("k/2", BlockCfg())
    with pytest.raises(ValueError, match="read-only"):
        cache.remove(["k/1"])
    with pytest.raises(ValueError, match="read-only"):
        cache.clear()
    with pytest.raises(ValueError, match="read-only"):
        cache.import_file(tmp_path / "k.json")
    assert cache.save() is cache


def test_put_validates(tmp_path):
    cache = PersistentCache(tmp_path)
    with pytest.raises(ValueError, match="non-empty"):
        cache.put("", BlockCfg())
    with pytest.raises(TypeError):
        cache.put("k/1", {"block_q": 1})
    with pytest.raises(TypeError):
        cache.put("k/1", BlockCfg(), meta={"x": object()})


def test_remove_and_clear(tmp_path):
    cache = PersistentCache(tmp_path)
    cache = cache.put("a/1", BlockCfg()).put("a/2", BlockCfg()).put("b/1", BlockCfg()).save()
    cache = cache.put("c/1", BlockCfg())
    removed = cache.remove(["a/1", "b/1", "c/1", "z/9"])
    assert set(removed.keys()) == {"a/2"} and not removed.pending
    assert set(_load_clean(tmp_path).keys()) == {"a/2"}
    assert not (tmp_path / "b.json").exists()  # emptied shards are deleted
    assert set(cache.keys()) == {"a/1", "a/2", "b/1", "c/1"}  # the old value is untouched
    cleared = removed.put("d/1", BlockCfg()).clear()
    assert len(cleared) == 0
    assert len(_load_clean(tmp_path)) == 0
    assert not list(tmp_path.glob("*.json"))


def test_lock_timeout_is_clear(tmp_path, monkeypatch):
    monkeypatch.setattr(_persistent, "_LOCK_TIMEOUT_S", 0.05)
    tmp_path.mkdir(exist_ok=True)
    with filelock.FileLock(str(tmp_path / ".lock")):
        with pytest.raises(TimeoutError, match="could not lock the persistent cache"):
            PersistentCache(tmp_path).put("k/1", BlockCfg()).save()


def test_shipped_layer():
    shipped = PersistentCache.shipped()
    assert shipped.readonly
    assert shipped.path.name == "_shipped"
    with pytest.raises(ValueError, match="read-only"):
        shipped.put("k/1", BlockCfg())
    with _no_corruption_warnings():
        for key in shipped.keys():
            shipped.get(key)


def test_export_import_round_trip(tmp_path):
    src = PersistentCache(tmp_path / "src").put("a/1", BlockCfg(block_q=1)).save()
    src = src.put("b/2", NestedCfg(stages=(9,)), meta={"note": "pending"})
    out = tmp_path / "export" / "all.json"
    assert src.export(out) == 2
    assert json.loads(out.read_text())["schema"] == SCHEMA
    dst = PersistentCache(tmp_path / "dst").import_file(out)
    assert set(dst.pending) == {"a/1", "b/2"}
    assert not (tmp_path / "dst").exists()  # import is pending until save
    dst.save()
    fresh = _load_clean(tmp_path / "dst")
    assert dict(fresh.items()) == {"a/1": BlockCfg(block_q=1), "b/2": NestedCfg(stages=(9,))}
    assert fresh.record("b/2") == src.record("b/2")


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        json.dumps({"schema": "nope", "entries": {}}).encode(),
        json.dumps({"schema": SCHEMA, "entries": {"a/1": {"ejkfn_schema": 1}}}).encode(),
        None,
    ],
    ids=["garbage", "wrong_schema", "bad_record", "missing"],
)
def test_import_bad_file_raises(tmp_path, content):
    file = tmp_path / "bad_export.json"
    if content is not None:
        file.write_bytes(content)
    with pytest.raises(ValueError, match=r"bad_export\.json"):
        PersistentCache(tmp_path / "c").import_file(file)


def test_default_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EJKFN_CACHE_DIR", str(tmp_path / "env_dir"))
    assert default_cache_dir() == tmp_path / "env_dir"
    assert PersistentCache().path == tmp_path / "env_dir"
    monkeypatch.delenv("EJKFN_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "ejkfn"
