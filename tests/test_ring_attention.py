"""Ring attention over 4 and 8 host devices equals attention on one device, forward and gradients."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from ejkfn.attention._api import AttentionConfig
from ejkfn.attention._reference import reference_attention
from ejkfn.attention._ring import ring_attention, ring_attention_sharded, zigzag_order
from ejkfn.attention._spec import AttentionSpec

P = PartitionSpec


def _mesh(n):
    return jax.make_mesh((n,), ("sp",), devices=jax.devices()[:n])


def _inputs(key, seq, heads, kv_heads, dim, mesh):
    kq, kk, kv, kd = jax.random.split(key, 4)
    shape_q, shape_k = (1, seq, heads, dim), (1, seq, kv_heads, dim)
    arrays = (
        jax.random.normal(kq, shape_q, jnp.float32),
        jax.random.normal(kk, shape_k, jnp.float32),
        jax.random.normal(kv, shape_k, jnp.float32),
        jax.random.normal(kd, shape_q, jnp.float32),
    )
    sharding = NamedSharding(mesh, P(None, "sp"))
    return tuple(jax.device_put(x, sharding) for x in arrays)


def _local(*arrays):
    """The arrays gathered onto one device, for the single-device reference."""
    return tuple(jnp.asarray(np.asarray(x)) for x in arrays)


# The single-device reference, jitted: eagerly, each of its operations would compile on its own.
_attend = jax.jit(reference_attention, static_argnames="spec")


@functools.partial(jax.jit, static_argnames="spec")
def _reference(q, k, v, dout, *, spec):
    """The reference's output and its VJP of ``dout``."""
    out, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, spec=spec)[0], q, k, v)
    return out, vjp(dout)


def _close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)


CASES = [
    # (devices, heads, kv_heads, causal, sliding_window)
    (4, 2, 2, False, None),
    (4, 4, 2, True, None),
    (4, 2, 1, False, (20, 7)),
    (8, 2, 2, True, None),
    (8, 4, 2, False, None),
    (8, 2, 2, True, 11),
    (8, 4, 2, False, (3, 13)),
]


@pytest.mark.parametrize(("n", "heads", "kv_heads", "causal", "window"), CASES)
def test_ring_matches_single_device(key, n, heads, kv_heads, causal, window):
    seq, dim = 64, 16
    mesh = _mesh(n)
    q, k, v, dout = _inputs(key, seq, heads, kv_heads, dim, mesh)
    sides = (window, window) if isinstance(window, int) else window
    spec = AttentionSpec(scale=dim**-0.5, causal=causal, window=sides)

    ring = jax.jit(
        functools.partial(
            ring_attention_sharded, mesh=mesh, axis_name="sp", causal=causal, sliding_window=window
        )
    )
    out, vjp = jax.vjp(ring, q, k, v)
    want, want_grads = _reference(*_local(q, k, v, dout), spec=spec)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "sp")), out.ndim)
    _close(out, want)
    for got, expected in zip(vjp(dout), want_grads, strict=True):
        assert got.shape == expected.shape
        _close(got, expected)


def test_window_narrower_than_a_shard(key):
    # Every pair but the diagonal sees nothing and is skipped; partial rows of -inf merge without NaNs.
    mesh = _mesh(4)
    q, k, v, dout = _inputs(key, 32, 2, 2, 16, mesh)
    spec = AttentionSpec(scale=0.25, window=(0, 0))
    ring = jax.jit(
        functools.partial(ring_attention_sharded, mesh=mesh, axis_name="sp", sliding_window=0)
    )
    out, vjp = jax.vjp(ring, q, k, v)
    want, want_grads = _reference(*_local(q, k, v, dout), spec=spec)
    _close(out, want)  # each query sees only its own key: out == v
    _close(out, v)
    for got, expected in zip(vjp(dout), want_grads, strict=True):
        assert np.isfinite(np.asarray(got)).all()
        _close(got, expected)


@pytest.mark.parametrize(("n", "heads", "kv_heads"), [(4, 2, 2), (8, 4, 2)])
def test_zigzag_causal_matches_single_device(key, n, heads, kv_heads):
    seq, dim = 64, 16
    mesh = _mesh(n)
    q, k, v, dout = _inputs(key, seq, heads, kv_heads, dim, mesh)
    spec = AttentionSpec(scale=dim**-0.5, causal=True)
    ring = jax.jit(
        functools.partial(
            ring_attention_sharded, mesh=mesh, axis_name="sp", causal=True, layout="zigzag"
        )
    )
    out, vjp = jax.vjp(ring, q, k, v)
    want, want_grads = _reference(*_local(q, k, v, dout), spec=spec)
    _close(out, want)
    for got, expected in zip(vjp(dout), want_grads, strict=True):
        _close(got, expected)


def test_zigzag_inside_shard_map_on_data_held_in_that_order(key):
    mesh = _mesh(4)
    q, k, v, _ = _inputs(key, 64, 2, 2, 16, mesh)
    order = zigzag_order(64, 4)
    body = functools.partial(ring_attention, axis_name="sp", causal=True, layout="zigzag")
    spec = P(None, "sp")
    mapped = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    )
    sharding = NamedSharding(mesh, spec)
    out = mapped(*(jax.device_put(x[:, order], sharding) for x in _local(q, k, v)))
    want = _attend(*_local(q, k, v), spec=AttentionSpec(scale=0.25, causal=True))[0]
    _close(out, np.asarray(want)[:, order])


def test_zigzag_order():
    order = zigzag_order(12, 3)
    assert order.tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    assert sorted(order.tolist()) == list(range(12))
    with pytest.raises(ValueError, match="seq_len=10, devices=3"):
        zigzag_order(10, 3)


def test_inside_shard_map_with_explicit_cfg_and_scale(key):
    mesh = _mesh(4)
    q, k, v, _ = _inputs(key, 64, 2, 2, 32, mesh)
    cfg = AttentionConfig(platform="xla", variant="chunked")
    body = functools.partial(
        ring_attention, axis_name="sp", causal=True, softmax_scale=0.1, cfg=cfg
    )
    spec = P(None, "sp")
    out = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    )(q, k, v)
    want = _attend(*_local(q, k, v), spec=AttentionSpec(scale=0.1, causal=True))[0]
    _close(out, want)


def test_inference_config_serves_calls_nothing_differentiates(key):
    """The local backend of ``cfg.inference`` (dense XLA: no loop in the program) runs the ring when
    nothing differentiates it; gradients still run ``cfg``'s (chunked XLA, a scan)."""
    mesh = _mesh(4)
    q, k, v, do = _inputs(key, 64, 2, 2, 16, mesh)
    chunked = AttentionConfig(platform="xla", variant="chunked")
    cfg = dataclasses.replace(chunked, inference=AttentionConfig(platform="xla", variant="dense"))
    spec = P(None, "sp")

    def ring(cfg):
        body = functools.partial(ring_attention, axis_name="sp", causal=True, cfg=cfg)
        return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)

    def grad_q(cfg, q):
        return jax.vjp(lambda q: ring(cfg)(q, k, v), q)[1](do)[0]

    def loops(fn, *args):
        return "scan" in str(jax.make_jaxpr(fn)(*args))

    assert not loops(ring(cfg), q, k, v)
    assert loops(ring(chunked), q, k, v)
    assert loops(functools.partial(grad_q, cfg), q)
    want = _attend(*_local(q, k, v), spec=AttentionSpec(scale=16**-0.5, causal=True))
    _close(jax.jit(ring(cfg))(q, k, v), want[0])
    _close(jax.jit(grad_q, static_argnums=0)(cfg, q), jax.jit(grad_q, static_argnums=0)(chunked, q))


def _call(mesh, q, k, v, **kw):
    return ring_attention_sharded(q, k, v, mesh, "sp", **kw)


@pytest.mark.parametrize(
    ("shapes", "kw", "match"),
    [
        (((1, 16, 2, 8), (1, 16, 2, 8), (1, 16, 2, 4)), {}, "k and v"),
        (((1, 16, 3, 8), (1, 16, 2, 8), (1, 16, 2, 8)), {}, "kv_heads must divide"),
        (((1, 16, 2, 8), (1, 8, 2, 8), (1, 8, 2, 8)), {}, "local length"),
        (((1, 16, 2), (1, 16, 2, 8), (1, 16, 2, 8)), {}, "q.shape"),
        (((1, 18, 2, 8), (1, 18, 2, 8), (1, 18, 2, 8)), {}, "multiple of the 4 devices"),
        (((1, 16, 2, 8),) * 3, {"sliding_window": -1}, "sliding_window"),
        (((1, 16, 2, 8),) * 3, {"sliding_window": "wide"}, "sliding_window"),
        (((1, 16, 2, 8),) * 3, {"causal": 1}, "causal"),
        (((1, 16, 2, 8),) * 3, {"softmax_scale": float("nan")}, "softmax_scale"),
        (((1, 16, 2, 8),) * 3, {"softmax_scale": "big"}, "softmax_scale"),
        (((1, 16, 2, 8),) * 3, {"cfg": "xla"}, "cfg"),
        (
            ((1, 16, 2, 8),) * 3,
            {"cfg": AttentionConfig(platform="xla", variant="dense")},
            "variant='dense'",
        ),
        (
            ((1, 16, 2, 8),) * 3,
            {"cfg": AttentionConfig(platform="cudnn")},
            "platform='cudnn'",
        ),
        (
            ((1, 16, 2, 8),) * 3,
            {
                "platform": "xla",
                "cfg": AttentionConfig(
                    platform="xla", inference=AttentionConfig(platform="triton")
                ),
            },
            r"cfg\.inference\.platform='triton'",
        ),
        (((1, 16, 2, 8),) * 3, {"layout": "spiral"}, "layout"),
        (((1, 16, 2, 8),) * 3, {"layout": "zigzag"}, "causal=False"),
        (((1, 16, 2, 8),) * 3, {"layout": "zigzag", "causal": True, "sliding_window": 3}, "zigzag"),
        (((1, 12, 2, 8),) * 3, {"layout": "zigzag", "causal": True}, "2 x devices"),
    ],
)
def test_validation(shapes, kw, match):
    mesh = _mesh(4)
    q, k, v = (jnp.zeros(s, jnp.float32) for s in shapes)
    with pytest.raises(ValueError, match=match):
        _call(mesh, q, k, v, **kw)


def test_validation_of_axis_and_mesh():
    mesh = _mesh(4)
    x = jnp.zeros((1, 16, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="axis_name='tp'"):
        ring_attention_sharded(x, x, x, mesh, "tp")
    with pytest.raises(ValueError, match="mesh"):
        ring_attention_sharded(x, x, x, "mesh", "sp")
    with pytest.raises(ValueError, match="axis_name='sp' is not a mapped axis"):
        ring_attention(x, x, x, axis_name="sp")


def test_sparing_sms_shrinks_persistent_grids_while_tracing():
    """Grids planned inside ``sparing_sms`` leave multiprocessors free, and only there."""
    from ejkfn.attention import _mosaic_grid

    full = _mosaic_grid.resident_ctas(False)
    with _mosaic_grid.sparing_sms(8):
        assert _mosaic_grid.resident_ctas(False) == full - 8
        # The interpreter's few CTAs stand for the rounds; they stay as they are.
        assert _mosaic_grid.resident_ctas(True) == _mosaic_grid._INTERPRETER_CTAS
    assert _mosaic_grid.resident_ctas(False) == full
    with pytest.raises(ValueError, match="got -1"):
        with _mosaic_grid.sparing_sms(-1):
            pass


def test_sparing_sms_keeps_the_long_causal_forward_persistent():
    """Causal from ONE_TILE_CAUSAL_KEYS keys the Mosaic forward runs one CTA a tile, which would
    take the multiprocessors a ring step leaves to its transfer: there it keeps its persistent
    grid."""
    from ejkfn.attention import _mosaic_grid, _pallas_mosaic

    keys = _pallas_mosaic.ONE_TILE_CAUSAL_KEYS
    assert not _pallas_mosaic.forward_persistent(True, keys)
    with _mosaic_grid.sparing_sms(8):
        assert _pallas_mosaic.forward_persistent(True, keys)
    with _mosaic_grid.sparing_sms(0):
        assert not _pallas_mosaic.forward_persistent(True, keys)


def _xla_ring_jaxprs(key, n=4, dtype=jnp.float32, **kwargs):
    """``(forward, training)``: functions tracing an XLA-chunked ring over ``n`` host devices
    (``kwargs`` to :func:`ring_attention`) into its forward's and its VJP's jaxprs."""
    mesh = _mesh(n)
    q, k, v, do = (x.astype(dtype) for x in _inputs(key, 64, 2, 2, 16, mesh))
    cfg = AttentionConfig(platform="xla", variant="chunked")
    body = functools.partial(ring_attention, axis_name="sp", cfg=cfg, **kwargs)
    spec = P(None, "sp")
    ring = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    return (
        lambda: jax.make_jaxpr(ring)(q, k, v),
        lambda: jax.make_jaxpr(lambda q: jax.vjp(lambda q: ring(q, k, v), q)[1](do))(q),
    )


@pytest.mark.parametrize("causal", [False, True])
def test_only_unmasked_rings_spare_multiprocessors_beside_their_transfers(key, monkeypatch, causal):
    """A forward nothing masks, in training too, leaves ``TRANSFER_SMS`` to the ring's transfers
    beside every step but the last, which no transfer runs beside (measured faster there); a causal
    one keeps every multiprocessor (measured slower otherwise)."""
    from ejkfn.attention import _ring

    spared = []
    real = _ring.sparing_sms

    def recording(count):
        spared.append(count)
        return real(count)

    monkeypatch.setattr(_ring, "sparing_sms", recording)
    n = 4
    assert _ring.TRANSFER_SMS > 0
    for trace in _xla_ring_jaxprs(key, n, causal=causal):  # the forward, then training
        trace()
        if causal:
            assert spared and set(spared) == {0}
        else:  # one local forward call a step, in order
            assert spared == [_ring.TRANSFER_SMS] * (n - 1) + [0]
        spared.clear()
    alone, _ = _xla_ring_jaxprs(key, 1, causal=causal)  # one device: nothing travels
    alone()
    assert spared == [0]


def _nested(eqn):
    """The jaxprs nested in ``eqn``'s parameters (a cond's branches, a scan's body...)."""
    for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
            sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's
            if hasattr(sub, "eqns"):
                yield sub


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it, each with its own jaxpr's."""
    for eqn in jaxpr.eqns:
        yield eqn, jaxpr
        for sub in _nested(eqn):
            yield from _eqns(sub)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_each_forward_step_meets_its_arriving_block_at_a_barrier(key, layout):
    """Each forward step's key/value transfer and the step before meet at an optimization barrier:
    without it XLA scheduled a causal ring's transfers before its first step instead of beside it
    (benchmarks/NOTES.md, sixty-eighth round). The backward has none (one there cost 2-3%)."""
    n = 4
    forward, training = _xla_ring_jaxprs(key, n=n, causal=True, layout=layout)

    def barriers(jaxpr):
        found = []
        for eqn, where in _eqns(jaxpr):
            if eqn.primitive.name == "optimization_barrier":
                sent = {
                    id(out)
                    for e in where.eqns
                    if e.primitive.name == "ppermute"
                    for out in e.outvars
                }
                found.append(sum(id(x) in sent for x in eqn.invars))
            if eqn.primitive.name == "ppermute":
                assert len(eqn.invars) == 1  # one block an equation (what the count below needs)
        return found

    # out and lse of the step before, then the arriving key and value blocks.
    assert barriers(forward().jaxpr) == [2] * (n - 1)
    assert barriers(training().jaxpr) == [2] * (n - 1)  # the forward's only


def _computes(eqn):
    """Whether ``eqn`` (or a jaxpr nested in it) multiplies matrices: a local step's."""
    return eqn.primitive.name == "dot_general" or any(
        e.primitive.name == "dot_general" for sub in _nested(eqn) for e, _ in _eqns(sub)
    )


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_backward_ends_each_block_where_it_lives(key, layout):
    """The backward visits blocks in the forward's reverse order, sending them the other way
    round, so each device's last step is on its own block and nothing it computes is sent (the old
    trip home of dk/dv waited for every kernel; NOTES, sixty-ninth round). dk and dv travel stacked,
    one transfer a step, and the blocks' keys and values n - 1 times, as in the forward."""
    n = 4
    _, training = _xla_ring_jaxprs(key, n=n, dtype=jnp.bfloat16, causal=True, layout=layout)
    maps = [e for e in training().jaxpr.eqns if e.primitive.name == "shard_map"]
    backward = maps[-1].params["jaxpr"]
    eqns = backward.eqns
    sends = [i for i, e in enumerate(eqns) if e.primitive.name == "ppermute"]
    back = tuple((i, (i - 1) % n) for i in range(n))
    assert {eqns[i].params["perm"] for i in sends} == {back}
    stacked = [i for i in sends if eqns[i].invars[0].aval.shape[0] == 2]
    assert len(stacked) == n - 1
    assert len(sends) - len(stacked) == 2 * (n - 1)
    # The first holds one step's dk/dv, bf16 like the keys; later ones float32 sums.
    sent = [eqns[i].invars[0].aval.dtype for i in stacked]
    assert sent == [jnp.bfloat16] + [jnp.float32] * (n - 2)
    # Nothing the last step computes is sent anywhere.
    last = max(i for i, e in enumerate(eqns) if _computes(e))
    after = {id(v) for v in eqns[last].outvars}
    for e in eqns[last + 1 :]:
        if any(id(v) in after for v in e.invars):
            assert e.primitive.name != "ppermute"
            after |= {id(v) for v in e.outvars}
    assert len(after) > len(eqns[last].outvars)  # the walk did follow the step's outputs


def test_steps_hand_on_their_outputs_in_the_inputs_dtype(key):
    """Each step's ``lax.cond`` returns the backend's outputs in their own dtypes (16-bit out, dq,
    dk and dv; float32 lse): float32 copies there cost a pass each on the GPU (NOTES, sixty-ninth
    round); the merges and sums convert as they read."""
    forward, training = _xla_ring_jaxprs(key, dtype=jnp.bfloat16, causal=True)

    def cond_outputs(jaxpr):
        return [
            [str(v.aval.dtype) for v in e.outvars]
            for e, _ in _eqns(jaxpr)
            if e.primitive.name == "cond"
        ]

    fwd = cond_outputs(forward().jaxpr)
    assert fwd and all(kinds == ["bfloat16", "float32"] for kinds in fwd)
    maps = [e for e in training().jaxpr.eqns if e.primitive.name == "shard_map"]
    bwd = cond_outputs(maps[-1].params["jaxpr"])
    assert bwd and all(kinds == ["bfloat16"] * 3 for kinds in bwd)


@pytest.mark.parametrize(("causal", "window"), [(True, (150, 0)), (False, (70, 90))])
def test_ring_pairs_of_a_window_run_in_the_mosaic_forward(causal, window):
    """A ring given a Mosaic config runs its local pairs, a window's too, in the Mosaic forward.
    Mosaic GPU's interpreter cannot run on several host devices at once, so each pair of a 4-device
    ring runs here on one: its out and lse against the reference masked by global positions."""
    from ejkfn import FwdParams
    from ejkfn.attention import _pallas_mosaic, _ring
    from ejkfn.attention._backend import AttentionShape, backend_for

    n, length, heads, dim = 4, 128, 2, 64
    base = AttentionSpec(scale=dim**-0.5, causal=causal, window=window)
    local = _ring._Local(
        backend_for("pallas", "mosaic"),
        FwdParams(q_blocksize=128, kv_blocksize=64, num_stages=2),
        _pallas_mosaic.heuristic(
            AttentionShape(
                batch=1, seq_q=length, seq_k=length, heads=heads, kv_heads=1, head_dim=dim,
                dtype="bfloat16", spec=base,
            )
        )[1],
        interpret=True,
    )  # fmt: skip
    rng = np.random.default_rng(3)
    q, k, v = (
        jnp.asarray(rng.standard_normal((1, n * length, h, dim)), jnp.bfloat16)
        for h in (heads, 1, 1)
    )
    rows = np.arange(n * length)
    visible = np.ones((n * length, n * length), bool)
    if causal:
        visible &= rows[None, :] <= rows[:, None]
    visible &= rows[None, :] >= rows[:, None] - window[0]
    visible &= rows[None, :] <= rows[:, None] + window[1]
    device = n - 1  # its key blocks lie before it: every contiguous step's first pair
    mine = slice(device * length, (device + 1) * length)
    seen = 0
    for step, (before, _) in enumerate(_ring._contiguous_steps(base, length, n)):
        keys = slice((device - step) * length, (device - step + 1) * length)
        out, lse = local.fwd(before, q[:, mine], k[:, keys], v[:, keys])
        mask = jnp.asarray(visible[mine, keys])[None, None]
        spec = dataclasses.replace(base, causal=False, window=None, has_mask=True)
        want, want_lse = reference_attention(
            *(x.astype(jnp.float32) for x in (q[:, mine], k[:, keys], v[:, keys])),
            None, mask, spec=spec,
        )  # fmt: skip
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=3e-2)
        finite = np.isfinite(np.asarray(want_lse))
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
        np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], atol=2e-2)
        seen += before.spec is not None
    assert seen >= 2  # the window reaches past the device's own block


@pytest.mark.parametrize("hopper", [True, False])
@pytest.mark.parametrize(
    ("causal", "window", "dtype"),
    [
        (False, None, "bfloat16"),
        (True, None, "bfloat16"),
        (True, (512, 0), "bfloat16"),
        (True, None, "float32"),
    ],
)
def test_auto_rings_run_the_mosaic_kernels_on_hopper(monkeypatch, hopper, causal, window, dtype):
    """On a Hopper GPU the ring's local pairs run the Mosaic kernels (on two H200s that ring trained
    1.27-1.29x as fast as the Pallas-Triton one); a window trains on the portable backward behind
    them. Elsewhere on a GPU, and for float32 inputs (which the Mosaic kernels refuse), the
    Pallas-Triton kernels run them."""
    from ejkfn.attention import _api, _backend, _ring
    from ejkfn.attention._backend import AttentionShape

    monkeypatch.setattr(_ring, "device_kind", lambda: "gpu")
    monkeypatch.setattr(_api, "device_kind", lambda: "gpu")
    monkeypatch.setattr(_api, "_is_hopper", lambda: hopper)
    mosaic = _backend._variants["pallas"]["mosaic"]
    monkeypatch.setitem(
        _backend._variants["pallas"],
        "mosaic",
        dataclasses.replace(mosaic, available=lambda: hopper),
    )
    triton = _backend._variants["pallas"]["triton"]
    monkeypatch.setitem(
        _backend._variants["pallas"], "triton", dataclasses.replace(triton, available=lambda: True)
    )
    base = AttentionSpec(scale=0.125, causal=causal, window=window)
    shape = AttentionShape(
        batch=1, seq_q=16384, seq_k=16384, heads=16, kv_heads=16, head_dim=128,
        dtype=dtype, spec=base,
    )  # fmt: skip
    mosaic_runs = hopper and dtype != "float32"
    for platform in ("auto", "pallas"):
        local = _ring._choose(platform, None, base, shape)
        assert (local.backend.platform, local.backend.variant) == (
            "pallas",
            "mosaic" if mosaic_runs else "triton",
        ), platform
        assert not local.interpret
        mosaic_bwd = local.bwd_params.variant in ("mosaic", "mosaic_fused")
        assert mosaic_bwd == (mosaic_runs and window is None)
