"""Flash attention on arrays sharded over a mesh equals the unsharded call; configs are per shard."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ejkfn

HEURISTICS = ejkfn.AutotunePolicy(allow_autotune=False)


def qkv(key, batch=4, seq=64, heads=4, kv_heads=2, dim=16):
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, seq, heads, dim))
    k = jax.random.normal(kk, (batch, seq, kv_heads, dim))
    v = jax.random.normal(kv, (batch, seq, kv_heads, dim))
    return q, k, v


@pytest.mark.parametrize("axis", ["batch", "heads"])
def test_shard_map_with_config_equals_unsharded(axis):
    mesh = jax.make_mesh((2,), ("x",))
    spec = P("x") if axis == "batch" else P(None, None, "x")
    q, k, v = qkv(jax.random.key(0))
    want = ejkfn.flash_attention(q, k, v, causal=True, platform="xla")
    f = ejkfn.shard_map_with_config(
        ejkfn.FlashAttention(platform="xla"),
        mesh,
        in_specs=(spec, spec, spec),
        out_specs=spec,
        policy=HEURISTICS,
    )
    inv = f.invocation(q, k, v, causal=True)
    per_shard = (2, 64, 4, 16) if axis == "batch" else (4, 64, 2, 16)
    assert (
        inv.args[0].shape == per_shard
    )  # the config is chosen for the shard, not the global array
    with jax.set_mesh(mesh):  # jax 0.11 meshes have explicit axes: jit runs inside the mesh
        got = jax.jit(lambda q, k, v: f(q, k, v, causal=True))(q, k, v)
        grads = jax.jit(jax.grad(lambda q: f(q, k, v, causal=True).sum()))(q)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    want_grads = jax.grad(
        lambda q: ejkfn.flash_attention(q, k, v, causal=True, platform="xla").sum()
    )(q)
    np.testing.assert_allclose(grads, want_grads, rtol=1e-4, atol=1e-4)


def test_flash_attention_on_sharded_arrays_inside_jit():
    mesh = jax.make_mesh((4,), ("x",))
    q, k, v = qkv(jax.random.key(1))
    place = lambda a: jax.device_put(a, NamedSharding(mesh, P("x")))
    want = ejkfn.flash_attention(q, k, v, platform="xla")
    got = jax.jit(lambda q, k, v: ejkfn.flash_attention(q, k, v, platform="xla"))(
        place(q), place(k), place(v)
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got.sharding.spec[0] == "x"  # batch sharding needs no communication and is kept
