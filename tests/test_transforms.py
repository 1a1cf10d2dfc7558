"""Transforms: custom VJP, mapping with a shared config, labels, recording, offline tuning, compile."""

import dataclasses
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ejkfn
from ejkfn.testing import Scale, ScaleCfg
from tests._subprocess import ROOT, child_env

FAST = ejkfn.Tuner(warmup=0, iters=1)
HEURISTICS = ejkfn.AutotunePolicy(allow_autotune=False)
X = jnp.arange(32.0).reshape(8, 4)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AffineCfg:
    unroll: int = 1


class Affine(ejkfn.Kernel[AffineCfg, jax.Array]):
    """``tanh(x @ w + b) * mask`` with a hand-written backward; b is a keyword array, mask an int array."""

    name = "affine"
    version = "1"

    def fwd(self, x, w, mask, *, b, cfg, activation="tanh"):
        out = jnp.tanh(x @ w + b) * mask
        return out, (x, w, out, mask)

    def bwd(self, res, g, *, cfg):
        x, w, out, mask = res
        dpre = g * mask * (1 - out**2)
        return {0: dpre @ w.T, 1: x.T @ dpre, "b": dpre.sum(0)}

    def run(self, x, w, mask, *, b, cfg, activation="tanh"):
        return self.fwd(x, w, mask, b=b, cfg=cfg, activation=activation)[0]

    def heuristic_cfg(self, inv):
        return AffineCfg()


def affine_reference(x, w, mask, b):
    return jnp.tanh(x @ w + b) * mask


def affine_inputs(seed=0):
    kx, kw, kb = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (6, 5))
    w = jax.random.normal(kw, (5, 3))
    b = jax.random.normal(kb, (3,))
    mask = jnp.array([1, 0, 1], jnp.int32)
    return x, w, mask, b


# --- custom VJP ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_custom_vjp_gradients_match_autodiff_of_reference(seed):
    x, w, mask, b = affine_inputs(seed)
    k = Affine()

    def loss(f):
        return lambda x, w, b: jnp.sum(f(x, w, mask, b) ** 2)

    ours = jax.jit(jax.grad(loss(lambda x, w, m, b: k(x, w, m, b=b)), argnums=(0, 1, 2)))(x, w, b)
    ref = jax.grad(loss(affine_reference), argnums=(0, 1, 2))(x, w, b)
    for a, r in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5)


def test_custom_vjp_is_used_not_autodiff():
    class Lying(Affine):
        name = "lying"

        def bwd(self, res, g, *, cfg):
            x, w, out, mask = res
            return {0: jnp.full_like(x, 7.0), 1: None, "b": None}

    x, w, mask, b = affine_inputs()
    dx, dw = jax.grad(lambda x, w: Lying()(x, w, mask, b=b).sum(), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(dx, 7.0)
    np.testing.assert_allclose(dw, 0.0)  # None means no gradient


def test_custom_vjp_under_vmap_and_non_array_args_static():
    x, w, mask, b = affine_inputs()
    xs = jnp.stack([x, x + 1])
    k = Affine()
    f = lambda x: k(x, w, mask, b=b, activation="tanh").sum()
    got = jax.vmap(jax.grad(f))(xs)
    want = jax.vmap(jax.grad(lambda x: affine_reference(x, w, mask, b).sum()))(xs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_custom_vjp_transform_on_functions():
    cube = ejkfn.custom_vjp(lambda x, n: (x**n, x), lambda x, g: (g * 3 * x**2, None))
    assert float(jax.grad(cube)(2.0, 3)) == 12.0
    bad = ejkfn.custom_vjp(lambda x, y: (x * y, (x, y)), lambda r, g: (g,))
    with pytest.raises(TypeError, match="one gradient per positional argument"):
        jax.grad(bad)(1.0, 2.0)


def test_custom_vjp_primal_serves_undifferentiated_calls():
    """``primal`` computes calls that nothing differentiates; ``fwd`` and ``bwd`` the rest."""
    traced = []

    def fwd(x):
        traced.append("fwd")
        return jnp.sin(x), x

    def primal(x):
        traced.append("primal")
        return jnp.sin(x)

    f = ejkfn.custom_vjp(fwd, lambda x, g: (g * jnp.cos(x),), primal=primal)
    x = jnp.linspace(0.0, 1.0, 5)
    np.testing.assert_allclose(jax.jit(f)(x), jnp.sin(x), rtol=1e-6)
    assert traced == ["primal"]
    traced.clear()
    np.testing.assert_allclose(jax.grad(lambda x: f(x).sum())(x), jnp.cos(x), rtol=1e-6)
    assert traced == ["fwd"]


# --- mapping with a shared config ------------------------------------------------------------------


def test_vmap_with_config_selects_once_for_per_example_shape():
    xs = jnp.ones((5, 8, 4))
    f = ejkfn.vmap_with_config(Scale(), tuner=FAST)
    inv = f.invocation(xs)
    assert inv.args[0].shape == (8, 4)
    assert inv.batch_axes["size"] == 5
    assert inv.key != ejkfn.Invocation.of(Scale(), jnp.ones((8, 4))).key  # batch axes in the key
    events = []
    with ejkfn.use_caches(ejkfn.Caches(), policy=HEURISTICS):
        out = jax.jit(f)(xs)
        mapped, caches = f.configure(xs, caches=ejkfn.Caches())
        ejkfn.decide(inv, caches, on_event=events.append)
    np.testing.assert_allclose(out, 2 * xs)
    np.testing.assert_allclose(jax.jit(mapped)(xs), 2 * xs)
    assert events[0].tier == "memory"  # selected once, by configure, for the per-example shape
    labels = ejkfn.find_labels_in_lowered(jax.jit(mapped).lower(xs))
    assert len(labels) == 1 and labels[0].call()[0].batch_axes == inv.batch_axes


def test_vmap_with_config_in_axes_and_tuner():
    xs = jnp.ones((4, 3, 2)).transpose(1, 0, 2)  # batch on axis 1
    f = ejkfn.vmap_with_config(Scale(), in_axes=1, out_axes=1, tuner=FAST)
    mapped, caches = f.configure(xs, caches=ejkfn.Caches())
    assert xs.shape == (3, 4, 2) and f.invocation(xs).args[0].shape == (3, 2)
    np.testing.assert_allclose(jax.jit(mapped)(xs), 2 * xs)
    assert len(caches.memory) == 1


def test_pmap_with_config_on_host_devices():
    n = jax.device_count()
    assert n >= 4
    xs = jnp.ones((n, 8, 4))
    f = ejkfn.pmap_with_config(Scale(), axis_name="d", policy=HEURISTICS)
    mapped, caches = f.configure(xs, caches=ejkfn.Caches())
    np.testing.assert_allclose(mapped(xs), 2 * xs)
    assert f.invocation(xs).args[0].shape == (8, 4)


def test_shard_map_with_config_per_shard_shape():
    mesh = jax.make_mesh((4,), ("x",))
    x = jax.device_put(
        jnp.arange(16 * 4.0).reshape(16, 4), jax.sharding.NamedSharding(mesh, P("x", None))
    )
    f = ejkfn.shard_map_with_config(
        Scale(), mesh, in_specs=(P("x", None),), out_specs=P("x", None), policy=HEURISTICS
    )
    inv = f.invocation(x)
    assert inv.args[0].shape == (4, 4)
    assert inv.batch_axes["mesh"] == {"x": 4}
    mapped, caches = f.configure(x, caches=ejkfn.Caches())
    np.testing.assert_allclose(jax.jit(mapped)(x), 2 * x)
    labels = ejkfn.find_labels_in_lowered(jax.jit(mapped).lower(x))
    assert labels[0].call()[1] == ScaleCfg(block=4)  # heuristic for 4 rows per shard, not 16
    with pytest.raises(ValueError, match="not divisible"):
        f.invocation(jnp.ones((6, 4)))


# --- labels ----------------------------------------------------------------------------------------


def two_kernel_program(x, y):
    return Scale()(x).sum() + Scale(factor=3.0)(y).sum()


@pytest.fixture(params=["hash", "json"])
def stamp(request):
    with ejkfn.stamping(request.param):
        yield request.param


def test_labels_in_lowered_and_compiled_programs(stamp):
    x, y = jnp.ones((8, 4)), jnp.ones((16, 4))
    lowered = jax.jit(two_kernel_program).lower(x, y)
    labels = ejkfn.find_labels_in_lowered(lowered)
    assert len(labels) == 2 and {lab.form for lab in labels} == {stamp[0]}
    compiled_text = lowered.compile().as_text()
    compiled_labels = ejkfn.extract_labels_from_hlo_text(compiled_text)
    assert {lab.name for lab in compiled_labels} == {lab.name for lab in labels}
    assert all('op_name="' in line for line in compiled_text.splitlines() if labels[0].name in line)
    configs = ejkfn.labels_to_configs(labels)
    assert sorted(c.block for c in configs.values()) == [8, 16]


@pytest.mark.parametrize("where", ["jit", "vmap", "scan", "grad"])
def test_labels_survive_nesting(where, stamp):
    k = Scale()
    x = jnp.ones((3, 8, 4))
    fns = {
        "jit": lambda x: jax.jit(lambda y: k(y))(x[0]).sum(),
        "vmap": lambda x: jax.vmap(k)(x).sum(),
        "scan": lambda x: jax.lax.scan(lambda c, xi: (c + k(xi).sum(), None), 0.0, x)[0],
        "grad": lambda x: jax.grad(lambda y: (k(y) ** 2).sum())(x[0]).sum(),
    }
    lowered = jax.jit(fns[where]).lower(x)
    labels = ejkfn.find_labels_in_lowered(lowered)
    assert labels and all(lab.kernel == "scale" for lab in labels)
    assert ejkfn.extract_labels_from_hlo_text(lowered.compile().as_text())
    inv, cfg = labels[0].call()
    assert inv.kernel.name == "scale" and cfg == ScaleCfg(block=8)


def test_stamp_none_and_label_decorator(monkeypatch):
    x = jnp.ones((8, 4))
    with ejkfn.stamping("none"):
        assert ejkfn.find_labels_in_lowered(jax.jit(Scale()).lower(x)) == []
    assert ejkfn.find_labels_in_lowered(jax.jit(Scale()).lower(x))  # default: hash

    @ejkfn.label("my_block")
    def block(x):
        return Scale()(x) + 1

    labels = ejkfn.find_labels_in_lowered(jax.jit(block).lower(x))
    assert "ejkfn.my_block.f" in [lab.name for lab in labels] and len(labels) == 2
    monkeypatch.setenv("EJKFN_OPS_STAMP", "loud")
    with pytest.raises(ValueError, match="EJKFN_OPS_STAMP"):
        jax.jit(lambda x: Scale()(x)).lower(x)
    with pytest.raises(ValueError, match="stamp mode"):
        ejkfn.stamping("loud").__enter__()


def test_configured_kernel_adds_nothing_of_selection_to_the_program():
    x = jnp.ones((8, 4))
    cfg = ScaleCfg(block=4)
    with ejkfn.stamping("none"):
        ours = jax.jit(lambda x: Scale().with_cfg(cfg)(x) + 1).lower(x).as_text()
        bare = jax.jit(lambda x: Scale().run(x, cfg=cfg) + 1).lower(x).as_text()
    assert ours.replace("jit__lambda", "") == bare.replace("jit__lambda", "")
    labelled = jax.jit(lambda x: Scale().with_cfg(cfg)(x) + 1).lower(x).compile().as_text()
    bare_ops = [
        line.split("=")[1].split("(")[0].strip()
        for line in jax.jit(lambda x: Scale().run(x, cfg=cfg) + 1)
        .lower(x)
        .compile()
        .as_text()
        .splitlines()
        if " = " in line and "ENTRY" not in line
    ]
    ours_ops = [
        line.split("=")[1].split("(")[0].strip()
        for line in labelled.splitlines()
        if " = " in line and "ENTRY" not in line
    ]
    assert sorted(ours_ops) == sorted(bare_ops)  # the label is metadata only once compiled


# --- recording and offline tuning ------------------------------------------------------------------


def test_record_returns_invocations_without_running():
    ran = []

    class Spy(Scale):
        name = "spy"

        def run(self, x, *, cfg):
            ran.append(type(x))
            return x

    invs = ejkfn.record(
        lambda x, y: Spy()(x) + Spy()(y).sum() + Spy()(x), jnp.ones((8, 4)), jnp.ones((2, 4))
    )
    assert [inv.args[0].shape for inv in invs] == [(8, 4), (2, 4)]
    assert all(t is not jax.Array and issubclass(t, jax.core.Tracer) for t in ran)


def test_record_env_sugar(monkeypatch):
    ejkfn.clear_recorded()
    monkeypatch.setenv("EJKFN_OPS_RECORD", "1")
    jax.jit(lambda x: Scale(factor=9.0)(x)).lower(jnp.ones((8, 4)))
    assert [inv.kernel.factor for inv in ejkfn.get_invocations()] == [9.0]
    ejkfn.clear_recorded()
    assert ejkfn.get_invocations() == []


def test_autotune_recorded():
    invs = ejkfn.record(two_kernel_program, jnp.ones((8, 4)), jnp.ones((16, 4)))
    result, caches = ejkfn.autotune_recorded(invs, ejkfn.Caches(), tuner=FAST)
    assert set(result) == {inv.key for inv in invs}
    assert all(d.tier == "autotune" for d in result.decisions.values())
    again, _ = ejkfn.autotune_recorded(invs, caches, tuner=FAST)
    assert all(d.tier == "memory" for d in again.decisions.values())


def test_autotune_lowered_then_rejit_uses_tuned_configs():
    x, y = jnp.ones((8, 4)), jnp.ones((16, 4))
    lowered = jax.jit(two_kernel_program).lower(x, y)

    class Slowest(ejkfn.Tuner):
        pass

    # a result whose choices differ from the heuristics, to see them take effect
    result, caches = ejkfn.autotune_lowered(lowered, ejkfn.Caches(), tuner=FAST)
    assert len(result) == 2 and not result.unmatched
    forced = ejkfn.AutotuningResult(
        {key: dataclasses.replace(d, cfg=ScaleCfg(block=1)) for key, d in result.decisions.items()}
    )
    with forced:
        relowered = jax.jit(two_kernel_program).lower(x, y)
    assert [lab.call()[1] for lab in ejkfn.find_labels_in_lowered(relowered)] == [
        ScaleCfg(block=1)
    ] * 2
    # explicit form: the result as an overlay
    invs = ejkfn.record(two_kernel_program, x, y)
    for inv in invs:
        assert ejkfn.select(inv, caches.with_overlay(forced))[0] == ScaleCfg(block=1)
    # outside the block the heuristics are back
    after = jax.jit(two_kernel_program).lower(x, y)
    assert [lab.call()[1].block for lab in ejkfn.find_labels_in_lowered(after)] == [8, 16]


def test_autotune_lowered_with_given_invocations_and_unmatched():
    x, y = jnp.ones((8, 4)), jnp.ones((16, 4))
    lowered = jax.jit(two_kernel_program).lower(x, y)
    only_first = [ejkfn.Invocation.of(Scale(), x)]
    result, _ = ejkfn.autotune_lowered(
        lowered, ejkfn.Caches(), invocations=only_first, tuner=FAST, policy=ejkfn.AutotunePolicy()
    )
    assert list(result) == [only_first[0].key]
    assert len(result.unmatched) == 1


def test_autotune_lowered_offline_from_json_labels_in_another_process(tmp_path):
    """A program lowered in one process is tuned in another that recorded nothing."""
    text_file = tmp_path / "program.txt"
    env = child_env(EJKFN_OPS_STAMP="json")
    lower = f"""
        import jax, jax.numpy as jnp
        from tests.test_transforms import two_kernel_program
        open({str(text_file)!r}, "w").write(
            jax.jit(two_kernel_program).lower(jnp.ones((8, 4)), jnp.ones((16, 4))).as_text())
    """
    tune = f"""
        import ejkfn
        text = open({str(text_file)!r}).read()
        result, _ = ejkfn.autotune_lowered(text, ejkfn.Caches(), tuner=ejkfn.Tuner(warmup=0, iters=1))
        print(len(result), len(result.unmatched), sorted(d.tier for d in result.decisions.values()))
    """
    for code in (lower, tune):
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[:2] == ["2", "0"]
    assert "autotune" in proc.stdout


# --- compile and configure_tree --------------------------------------------------------------------


def test_compile_selects_once():
    events = []
    x = jnp.ones((8, 4))
    fn, caches = ejkfn.compile(Scale(), x, caches=ejkfn.Caches(), tuner=FAST)
    np.testing.assert_allclose(fn(x), 2 * x)
    fn(x + 1)
    assert fn._cache_size() == 1
    ejkfn.decide(ejkfn.Invocation.of(Scale(), x), caches, on_event=events.append)
    assert events[0].tier == "memory"


class Block(eqx.Module):
    attn_a: Scale
    attn_b: Scale
    w: jax.Array

    def __call__(self, x, y):
        return self.attn_a(x * self.w[0]).sum() + self.attn_b(y).sum()


def test_configure_tree_gives_each_layer_its_config():
    model = Block(Scale(), Scale(), jnp.ones(3))
    x, y = jnp.ones((8, 4)), jnp.ones((4, 4))
    configured, caches = ejkfn.configure_tree(
        lambda m, x, y: m(x, y), model, x, y, caches=ejkfn.Caches(), policy=HEURISTICS
    )
    assert configured.attn_a.cfg == ScaleCfg(block=8)
    assert configured.attn_b.cfg == ScaleCfg(block=4)
    assert configured.w is model.w and model.attn_a.cfg is None
    assert len(caches.memory) == 0  # heuristic answers are not cached
    # with the tuner, too
    tuned, caches = ejkfn.configure_tree(
        lambda m, x, y: m(x, y), model, x, y, caches=ejkfn.Caches(), tuner=FAST
    )
    assert tuned.attn_a.cfg is not None and tuned.attn_b.cfg is not None
    assert len(caches.memory) == 2
    np.testing.assert_allclose(jax.jit(lambda m: m(x, y))(configured), 2 * 32 + 2 * 16)


def test_every_selecting_function_takes_policy_and_tuner():
    import inspect

    for fn in (
        ejkfn.select,
        ejkfn.configure,
        ejkfn.choose_config,
        ejkfn.compile,
        ejkfn.configure_tree,
        ejkfn.autotune_lowered,
        ejkfn.autotune_recorded,
        ejkfn.vmap_with_config,
        ejkfn.pmap_with_config,
        ejkfn.shard_map_with_config,
    ):
        params = inspect.signature(fn).parameters
        assert "policy" in params and "tuner" in params, fn.__name__


def test_mapping_transforms_bind_keyword_arguments():
    x, w, mask, b = affine_inputs()
    xs = jnp.stack([x, x + 1.0, x - 1.0, 2 * x])
    want = jax.vmap(lambda x: affine_reference(x, w, mask, b))(xs)
    f = ejkfn.vmap_with_config(Affine(), in_axes=(0, None, None), policy=HEURISTICS)
    np.testing.assert_allclose(
        jax.jit(lambda xs: f(xs, w, mask, b=b, activation="tanh"))(xs), want, rtol=1e-5, atol=1e-5
    )
    mesh = jax.make_mesh((4,), ("x",))
    g = ejkfn.shard_map_with_config(
        Affine(), mesh, in_specs=(P("x"), P(), P()), out_specs=P("x"), policy=HEURISTICS
    )
    flat = xs.reshape(-1, 5)  # unplaced input: the transform places it
    got = g(flat, w, mask, b=b)
    np.testing.assert_allclose(got, affine_reference(flat, w, mask, b), rtol=1e-5, atol=1e-5)
    assert "activation='tanh'" in repr(
        ejkfn.Invocation.of(Affine(), x, w, mask, b=b, activation="tanh")
    )


def test_tuple_gradients_with_a_floating_keyword_array_is_an_error():
    class PositionalOnly(Affine):
        name = "positional_only"

        def bwd(self, res, g, *, cfg):
            x, w, out, mask = res
            dpre = g * mask * (1 - out**2)
            return (dpre @ w.T, x.T @ dpre, None)

    x, w, mask, b = affine_inputs()
    with pytest.raises(TypeError, match="keyword argument 'b'"):
        jax.grad(lambda x: PositionalOnly()(x, w, mask, b=b).sum())(x)


def test_eager_calls_with_tuple_options_hit_the_fast_path():
    class Windowed(Scale):
        name = "windowed"

        def run(self, x, *, cfg, window=(1, 1)):
            return x * (window[0] + window[1])

    k = Windowed()
    k(X, window=(1, 2))
    memo = ejkfn.current_session().memo
    size = len(memo)
    np.testing.assert_allclose(k(X, window=(1, 2)), 3 * X)
    assert len(memo) == size  # the second call reused the jitted function
