"""Behaviour across processes: persistence, stable keys, and one config everywhere."""

import json
import socket
import subprocess
import sys
import textwrap

import pytest

from tests._subprocess import child_env


def run_python(code: str, env: dict | None = None, timeout: int = 180) -> str:
    full_env = child_env(**(env or {}))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


TUNE_AND_SAVE = """
    import json, sys, jax.numpy as jnp, ejkfn
    from ejkfn.testing import Scale
    caches = ejkfn.Caches(persistent=ejkfn.PersistentCache(sys.argv[1] if len(sys.argv) > 1 else {path!r}))
    inv = ejkfn.Invocation.of(Scale(), jnp.ones((16, 4)))
    decision, caches = ejkfn.decide(inv, caches, tuner=ejkfn.Tuner(warmup=0, iters=2))
    caches = caches.save()
    print(json.dumps({{"tier": decision.tier, "cfg": ejkfn.to_json(decision.cfg), "key": inv.key}}))
"""


def test_second_process_selects_from_disk_without_autotuning(tmp_path):
    first = json.loads(run_python(TUNE_AND_SAVE.format(path=str(tmp_path))))
    assert first["tier"] == "autotune"
    second = json.loads(run_python(TUNE_AND_SAVE.format(path=str(tmp_path))))
    assert second["tier"] == "persistent"
    assert second["cfg"] == first["cfg"] and second["key"] == first["key"]


def test_keys_equal_across_processes_with_different_hash_seeds():
    code = """
        import jax.numpy as jnp, ejkfn
        from ejkfn.testing import Scale
        print(ejkfn.Invocation.of(Scale(factor=1.5), jnp.ones((3, 5), jnp.bfloat16)).key)
        print(ejkfn.Invocation.of(Scale(), jnp.ones((2, 2)), batch_axes={"vmap": [0, None]}).key)
    """
    # Two seeds suffice: a key that hashed anything would differ between them.
    keys = {run_python(code, env={"PYTHONHASHSEED": seed}) for seed in ("0", "1")}
    assert len(keys) == 1


def test_concurrent_processes_selecting_and_saving_lose_nothing(tmp_path):
    code = f"""
        import sys, jax.numpy as jnp, ejkfn
        from ejkfn.testing import Scale
        rank = int(sys.argv[1])
        caches = ejkfn.Caches(persistent=ejkfn.PersistentCache({str(tmp_path)!r}))
        for rows in range(1, 6):
            inv = ejkfn.Invocation.of(Scale(factor=float(rank)), jnp.ones((rows, 2)))
            _, caches = ejkfn.select(inv, caches, tuner=ejkfn.Tuner(warmup=0, iters=1))
            caches = caches.save()
    """
    env = child_env()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), str(rank)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(4)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    import ejkfn

    assert len(ejkfn.PersistentCache(tmp_path)) == 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_processes_agree_on_one_config(tmp_path):
    """Two processes joined by jax.distributed start with caches that disagree; both end with process 0's."""
    code = """
        import json, sys, jax
        jax.config.update("jax_platforms", "cpu")
        rank, port = int(sys.argv[1]), int(sys.argv[2])
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank,
                                   initialization_timeout=120)
        import jax.numpy as jnp, ejkfn
        from ejkfn.testing import Scale, ScaleCfg
        inv = ejkfn.Invocation.of(Scale(), jnp.ones((8, 4)))
        out = {}
        # from caches: each process remembers a different config
        mine = ScaleCfg(block=1 if rank == 0 else 2)
        d, caches = ejkfn.decide(inv, ejkfn.Caches().remember(inv.key, mine))
        out["cache"] = [d.cfg.block, caches.memory[inv.key].block]
        # from heuristics: rank 1's heuristic is made to differ
        class Skewed(Scale):
            name = "skewed"
            def heuristic_cfg(self, inv):
                return ScaleCfg(block=4 if rank == 0 else 8)
        d, _ = ejkfn.decide(ejkfn.Invocation.of(Skewed(), jnp.ones((8, 4))), ejkfn.Caches(),
                            policy=ejkfn.AutotunePolicy(allow_autotune=False))
        out["heuristics"] = d.cfg.block
        # from autotuning: timings differ between processes, the choice may not
        d, _ = ejkfn.decide(ejkfn.Invocation.of(Scale(factor=5.0), jnp.ones((8, 4))), ejkfn.Caches(),
                            tuner=ejkfn.Tuner(warmup=0, iters=1))
        out["autotune"] = d.cfg.block
        # inside jit: selection at trace time agrees as well
        with ejkfn.use_caches(ejkfn.Caches().remember(inv.key, mine)):
            labels = ejkfn.find_labels_in_lowered(jax.jit(Scale()).lower(jnp.ones((8, 4))))
        out["jit"] = labels[0].call()[1].block
        print(json.dumps(out))
        jax.distributed.shutdown()
    """
    port = _free_port()
    env = child_env()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), str(r), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0] == outs[1]
    assert outs[0]["cache"] == [1, 1]  # process 1 also remembers process 0's choice
    assert outs[0]["heuristics"] == 4
    assert outs[0]["jit"] == 1


def test_import_starts_no_backend():
    # jax.distributed.initialize must come before any backend starts: importing ejkfn may not start one.
    out = run_python(
        """
        import jax._src.xla_bridge as xla_bridge
        import ejkfn, ejkfn.attention
        print(sorted(xla_bridge._backends))
        """
    )
    assert out.strip() == "[]"
