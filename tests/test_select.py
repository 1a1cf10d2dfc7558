"""Kernels, invocations and the selection order: each tier answers when it should and only then."""

import collections
import dataclasses
import pickle
import random
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkfn
from ejkfn import _tune
from ejkfn.testing import Scale, ScaleCfg

FAST = ejkfn.Tuner(warmup=0, iters=1)
X = jnp.arange(32.0).reshape(8, 4)


def inv_of(kernel=None, x=X, **kw):
    return ejkfn.Invocation.of(kernel or Scale(), x, **kw)


# --- kernels ---------------------------------------------------------------------------------------


def test_kernel_eager_jit_vmap_grad():
    k = Scale(factor=3.0)
    np.testing.assert_allclose(k(X), 3 * X)
    np.testing.assert_allclose(jax.jit(k)(X), 3 * X)
    np.testing.assert_allclose(jax.vmap(k)(jnp.stack([X, X])), 3 * jnp.stack([X, X]))
    np.testing.assert_allclose(jax.grad(lambda x: k(x).sum())(X), jnp.full_like(X, 3.0))


def test_configured_kernel_is_a_hashable_pytree_with_static_cfg():
    k = Scale().with_cfg(ScaleCfg(block=2))
    assert jax.tree.leaves(k) == []  # cfg and factor are static
    assert hash(k) == hash(Scale().with_cfg(ScaleCfg(block=2)))
    assert k == Scale().with_cfg(ScaleCfg(block=2))
    assert k != Scale().with_cfg(ScaleCfg(block=4))
    assert Scale().cfg is None  # with_cfg returned a new value
    # eqx.tree_at cannot touch static fields; with_cfg is the way.
    assert eqx.tree_equal(k.with_cfg(None), Scale())


def test_kernel_crosses_jit_boundary_and_does_not_recompile():
    traces = []

    @jax.jit
    def f(kernel, x):
        traces.append(1)
        return kernel(x)

    k = Scale().with_cfg(ScaleCfg(block=4))
    f(k, X)
    f(k, X + 1)
    f(Scale().with_cfg(ScaleCfg(block=4)), X)  # equal value: same compiled program
    assert len(traces) == 1
    f(Scale().with_cfg(ScaleCfg(block=2)), X)  # another config is another program
    assert len(traces) == 2


def test_jitted_configured_kernel_does_not_recompile():
    fn = jax.jit(Scale().with_cfg(ScaleCfg(block=4)))
    fn(X)
    before = fn._cache_size()
    fn(X + 1.0)
    assert fn._cache_size() == before == 1


def test_config_space_is_accepted_as_reference_name():
    class Old(Scale):
        name = "old"

        def config_space(self, inv):
            return [ScaleCfg(block=1), ScaleCfg(block=2)]

    class New(Scale):
        name = "new"

        def candidate_cfgs(self, inv):
            return [ScaleCfg(block=2)]

    Old.candidate_cfgs = ejkfn.Kernel.candidate_cfgs  # only config_space is defined
    assert list(Old().candidate_cfgs(inv_of(Old()))) == [ScaleCfg(block=1), ScaleCfg(block=2)]
    assert list(New().config_space(inv_of(New()))) == [ScaleCfg(block=2)]


def test_platform_methods_dispatch_by_device():
    class PerPlatform(ejkfn.Kernel):
        name = "per_platform"

        def run_cpu(self, x, *, cfg):
            return x + 1

        def run_gpu(self, x, *, cfg):
            return x + 2

        def heuristic_cfg(self, inv):
            return ScaleCfg(block=1)

    np.testing.assert_allclose(PerPlatform()(X), X + 1)


def test_missing_run_is_a_clear_error():
    class NoRun(ejkfn.Kernel):
        name = "norun"

        def heuristic_cfg(self, inv):
            return ScaleCfg(block=1)

    with pytest.raises(NotImplementedError, match="norun"):
        NoRun()(X)


# --- invocations and keys --------------------------------------------------------------------------


def test_invocation_is_abstract():
    inv = inv_of()
    assert inv.args == (jax.ShapeDtypeStruct((8, 4), jnp.float32),)
    assert not any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(inv.args))

    seen = []

    @jax.jit
    def f(x):
        seen.append(ejkfn.Invocation.of(Scale(), x))
        return x

    f(X)
    assert not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(seen[0].args))
    assert seen[0].key == inv.key


def test_key_holds_what_changes_the_best_config():
    base = inv_of()
    payload = base.payload
    assert payload["kernel"] == "scale" and payload["version"] == "1"
    assert {"device_kind", "platform", "platform_version"} <= set(payload["device"])
    assert {"jax", "jaxlib", "triton", "ejkfn"} <= set(payload["software"])
    assert base.key.startswith("scale/")
    different = [
        inv_of(x=jnp.ones((16, 4))),
        inv_of(x=X.astype(jnp.bfloat16)),
        inv_of(Scale(factor=3.0)),
        inv_of(batch_axes={"vmap": 0, "size": 4}),
    ]
    assert len({base.key, *(i.key for i in different)}) == 5
    # the config is never part of the key
    assert inv_of(Scale().with_cfg(ScaleCfg(block=2))).key == base.key
    assert inv_of(cfg=ScaleCfg(block=2)).key == base.key


def test_key_changes_with_kernel_version():
    class Scale2(Scale):
        version = "2"

    assert inv_of(Scale2()).payload["version"] == "2"
    assert inv_of(Scale2()).key != inv_of().key


def test_static_kwargs_are_part_of_key_and_must_be_hashable():
    class WithKw(Scale):
        name = "withkw"

        def run(self, x, *, cfg, mode="a"):
            return x

    assert inv_of(WithKw(), mode="a").key != inv_of(WithKw(), mode="b").key
    with pytest.raises(TypeError, match="hashable"):
        WithKw()(X, mode={"a"})


# --- the selection order ---------------------------------------------------------------------------


def tiers(inv, caches, **kw):
    decision, new = ejkfn.decide(inv, caches, tuner=FAST, **kw)
    return decision, new


def test_heuristics_when_autotune_not_allowed():
    d, _ = tiers(inv_of(), ejkfn.Caches(), policy=ejkfn.AutotunePolicy(allow_autotune=False))
    assert (d.tier, d.cfg) == ("heuristics", ScaleCfg(block=8))
    assert "autotune not allowed" in " ".join(d.notes)


def test_autotune_on_miss_then_memory():
    inv = inv_of()
    d, caches = tiers(inv, ejkfn.Caches())
    assert d.tier == "autotune"
    assert d.tune is not None and len(d.tune.results) == 4  # blocks 1, 2, 4, 8 divide 8 rows
    assert all(r.seconds > 0 for r in d.tune.results)
    d2, caches2 = tiers(inv, caches)
    assert (d2.tier, d2.cfg) == ("memory", d.cfg)
    assert caches2.memory is caches.memory  # a hit changes nothing


def test_cache_miss_fallback_heuristics_goes_first():
    policy = ejkfn.AutotunePolicy(cache_miss_fallback="heuristics")
    d, _ = tiers(inv_of(), ejkfn.Caches(), policy=policy)
    assert d.tier == "heuristics"


def test_autotune_when_heuristics_missing_even_with_heuristics_first():
    class NoHeuristic(Scale):
        name = "nohe"

        def heuristic_cfg(self, inv):
            raise NotImplementedError("none")

        def candidate_cfgs(self, inv):
            return [ScaleCfg(block=1), ScaleCfg(block=2)]

    policy = ejkfn.AutotunePolicy(cache_miss_fallback="heuristics")
    d, _ = tiers(inv_of(NoHeuristic()), ejkfn.Caches(), policy=policy)
    assert d.tier == "autotune"


def test_error_when_nothing_allowed():
    policy = ejkfn.AutotunePolicy(allow_autotune=False, allow_heuristics=False)
    with pytest.raises(ejkfn.NoConfigError, match="heuristics not allowed"):
        ejkfn.select(inv_of(), ejkfn.Caches(), policy=policy)


def test_overlays_win_over_memory_and_innermost_first():
    inv = inv_of()
    caches = ejkfn.Caches().remember(inv.key, ScaleCfg(block=1))
    outer = {inv.key: ScaleCfg(block=2)}
    inner = {inv.key: ScaleCfg(block=4)}
    d, _ = tiers(inv, caches.with_overlay(outer))
    assert (d.tier, d.cfg) == ("overlay", ScaleCfg(block=2))
    d, _ = tiers(inv, caches.with_overlay(outer).with_overlay(inner))
    assert (d.tier, d.cfg) == ("overlay", ScaleCfg(block=4))
    d, _ = tiers(inv, caches)
    assert (d.tier, d.cfg) == ("memory", ScaleCfg(block=1))


def test_persistent_then_memory(tmp_path):
    inv = inv_of()
    store = ejkfn.PersistentCache(tmp_path).put(inv.key, ScaleCfg(block=2)).save()
    caches = ejkfn.Caches(persistent=ejkfn.PersistentCache(tmp_path))
    d, caches2 = tiers(inv, caches)
    assert (d.tier, d.cfg) == ("persistent", ScaleCfg(block=2))
    d, _ = tiers(inv, caches2)
    assert d.tier == "memory"
    # memory beats persistent
    d, _ = tiers(inv, caches.remember(inv.key, ScaleCfg(block=4)))
    assert (d.tier, d.cfg) == ("memory", ScaleCfg(block=4))
    assert len(store) == 1


def test_shipped_layer_sits_behind_the_user_cache(tmp_path, monkeypatch):
    from ejkfn import _cache

    inv = inv_of()
    shipped = ejkfn.PersistentCache(tmp_path / "shipped")
    shipped = shipped.put(inv.portable_key, ScaleCfg(block=1)).save()
    monkeypatch.setattr(_cache, "_shipped_layer", lambda: shipped)
    d, _ = tiers(inv, ejkfn.Caches())
    assert (d.tier, d.cfg) == ("shipped", ScaleCfg(block=1))
    user = ejkfn.PersistentCache(tmp_path / "user").put(inv.key, ScaleCfg(block=2))
    d, _ = tiers(inv, ejkfn.Caches(persistent=user))
    assert (d.tier, d.cfg) == ("persistent", ScaleCfg(block=2))
    d, _ = tiers(inv, ejkfn.Caches(shipped=False))
    assert d.tier == "autotune"


def test_shipped_configs_survive_driver_and_library_upgrades(tmp_path, monkeypatch):
    from ejkfn import _cache, _invocation

    inv = inv_of()
    shipped = ejkfn.PersistentCache(tmp_path).put(inv.portable_key, ScaleCfg(block=1)).save()
    monkeypatch.setattr(_cache, "_shipped_layer", lambda: shipped)
    newer_driver = inv.replace(device={**inv.device, "platform_version": "a later driver"})
    monkeypatch.setattr(
        _invocation, "software_versions", lambda: {"ejkfn": "9", "jax": "9", "jaxlib": "9"}
    )
    upgraded = newer_driver.replace()  # recomputes the key with the patched versions
    assert upgraded.key != inv.key
    assert upgraded.portable_key == inv.portable_key
    d, _ = tiers(upgraded, ejkfn.Caches())
    assert (d.tier, d.cfg) == ("shipped", ScaleCfg(block=1))
    # another device model, or another kernel version, is not served the shipped config
    other_gpu = upgraded.replace(device={**inv.device, "device_kind": "another model"})
    assert tiers(other_gpu, ejkfn.Caches())[0].tier == "autotune"
    bumped = upgraded.replace(kernel=Scale2())
    assert bumped.portable_key != inv.portable_key


class Scale2(Scale):
    version = 2


POLICIES = [
    ejkfn.AutotunePolicy(),
    ejkfn.AutotunePolicy(allow_autotune=False),
    ejkfn.AutotunePolicy(cache_miss_fallback="heuristics"),
    ejkfn.AutotunePolicy(allow_autotune=False, allow_heuristics=False),
    ejkfn.AutotunePolicy(validate_backward=True, forbid_reautotune=False, persist_autotune=False),
]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("how", ["argument", "kernel"])
def test_explicit_override_wins_under_every_policy(policy, how):
    inv = inv_of()
    caches = (
        ejkfn.Caches()
        .remember(inv.key, ScaleCfg(block=1))
        .with_overlay({inv.key: ScaleCfg(block=2)})
    )
    override = ScaleCfg(block=4)
    inv2 = inv.replace(cfg=override) if how == "argument" else inv_of(Scale().with_cfg(override))
    if how == "kernel":
        inv2 = inv2.replace(kernel=Scale().with_cfg(override))
    d, _ = tiers(inv2, caches, policy=policy)
    assert (d.tier, d.cfg) == ("override", override)


def test_select_is_pure():
    inv = inv_of()
    caches = ejkfn.Caches(persistent=None).with_overlay({"other": ScaleCfg(block=1)})
    snapshot = (dict(caches.memory), caches.overlays, caches.failed)
    cfg1, new1 = ejkfn.select(inv, caches, tuner=FAST)
    assert (dict(caches.memory), caches.overlays, caches.failed) == snapshot
    assert inv.key in new1.memory and inv.key not in caches.memory
    # same inputs, same outputs (heuristics are deterministic; autotune timing is not, so use them)
    policy = ejkfn.AutotunePolicy(allow_autotune=False)
    a = ejkfn.select(inv, caches, policy=policy)
    b = ejkfn.select(inv, caches, policy=policy)
    assert a[0] == b[0] and dict(a[1].memory) == dict(b[1].memory)


def test_persist_autotune_puts_pending_entry_only(tmp_path):
    inv = inv_of()
    caches = ejkfn.Caches(persistent=ejkfn.PersistentCache(tmp_path))
    _, new = ejkfn.select(inv, caches, tuner=FAST)
    assert inv.key in new.persistent.pending
    assert not list(tmp_path.glob("*.json"))  # nothing on disk until save()
    assert caches.persistent.pending == {}
    saved = new.save()
    assert saved.persistent.pending == {} and inv.key in ejkfn.PersistentCache(tmp_path)
    _, not_persisted = ejkfn.select(
        inv, caches, tuner=FAST, policy=ejkfn.AutotunePolicy(persist_autotune=False)
    )
    assert inv.key not in not_persisted.persistent.pending


class Broken(Scale):
    name = "broken"

    def run(self, x, *, cfg):
        if cfg.block != 2:
            raise RuntimeError(f"cannot compile block {cfg.block}")
        return x * 2


def test_failing_candidates_are_skipped_with_reason():
    d, _ = tiers(inv_of(Broken()), ejkfn.Caches())
    assert (d.tier, d.cfg) == ("autotune", ScaleCfg(block=2))
    failures = d.tune.failures
    assert len(failures) == 3 and all("cannot compile block" in f.error for f in failures)
    assert {f.phase for f in failures} == {"compile"}
    assert "failed" in d.tune.table()


class AllBroken(Scale):
    name = "allbroken"

    def run(self, x, *, cfg):
        raise RuntimeError("never works")

    def heuristic_cfg(self, inv):
        return ScaleCfg(block=1)


def test_all_failed_falls_back_to_heuristics_and_is_not_retried():
    events = []
    d, caches = tiers(inv_of(AllBroken()), ejkfn.Caches(), on_event=events.append)
    assert d.tier == "heuristics" and "failed" in " ".join(d.notes)
    assert events == [d]
    d2, _ = tiers(inv_of(AllBroken()), caches)
    assert "forbid_reautotune" in " ".join(d2.notes) and d2.tune is None
    d3, _ = tiers(inv_of(AllBroken()), caches, policy=ejkfn.AutotunePolicy(forbid_reautotune=False))
    assert d3.tune is not None


def test_all_failed_without_heuristics_is_an_error_listing_failures():
    policy = ejkfn.AutotunePolicy(allow_heuristics=False)
    with pytest.raises(ejkfn.NoConfigError, match="never works"):
        ejkfn.select(inv_of(AllBroken()), ejkfn.Caches(), policy=policy, tuner=FAST)


def test_policy_is_frozen_and_validated():
    p = ejkfn.AutotunePolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.allow_autotune = False
    assert p.replace(validate_backward=True).validate_backward
    with pytest.raises((ValueError, TypeError), match="cache_miss_fallback"):
        ejkfn.AutotunePolicy(cache_miss_fallback="guess")
    with pytest.raises(TypeError, match="allow_autotune"):
        ejkfn.AutotunePolicy(allow_autotune="yes")
    assert {f.name for f in dataclasses.fields(p)} == {
        "allow_autotune",
        "allow_heuristics",
        "cache_miss_fallback",
        "validate_backward",
        "persist_autotune",
        "forbid_reautotune",
    }


def test_config_cache_is_immutable():
    c = ejkfn.ConfigCache()
    c2 = c.put("a", 1)
    c3 = c2.merge({"b": 2})
    assert (len(c), len(c2), len(c3)) == (0, 1, 2)
    with pytest.raises(TypeError):
        c2["x"] = 1
    with pytest.raises(TypeError, match="key"):
        c.put(3, 1)
    assert pickle.loads(pickle.dumps(ScaleCfg(block=2))) == ScaleCfg(block=2)


def test_choose_config_and_configure():
    policy = ejkfn.AutotunePolicy(allow_autotune=False)
    cfg, caches = ejkfn.choose_config(Scale(), X, caches=ejkfn.Caches(), policy=policy)
    assert cfg == ScaleCfg(block=8)
    cfg, _ = ejkfn.choose_config(Scale(), X, caches=caches, cfg=ScaleCfg(block=1), policy=policy)
    assert cfg == ScaleCfg(block=1)
    k, _ = ejkfn.configure(Scale(), X, caches=ejkfn.Caches(), tuner=FAST)
    assert k.cfg in Scale().candidate_cfgs(inv_of())
    np.testing.assert_allclose(jax.jit(k)(X), 2 * X)


def test_logging_reports_tier(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="ejkfn"):
        ejkfn.select(inv_of(), ejkfn.Caches(), policy=ejkfn.AutotunePolicy(allow_autotune=False))
    assert "heuristics answered" in caplog.text


def test_ambient_session_sugar():
    k = Scale()
    inv = inv_of()
    with ejkfn.use_caches(ejkfn.Caches(), policy=ejkfn.AutotunePolicy(), tuner=FAST) as session:
        k(X)
    assert session.caches.memory.get(inv.key) is not None
    with ejkfn.overlay_cache({inv.key: ScaleCfg(block=1)}):
        traced = []
        jax.eval_shape(lambda x: traced.append(ejkfn.decide(inv, ejkfn.default_caches())[0]), X)
        assert traced[0].tier == "overlay"
    with ejkfn.policy_override(allow_heuristics=False):
        assert ejkfn.current_session().policy.allow_heuristics is False
    assert ejkfn.current_session().policy.allow_heuristics is True


class WrongAtBlockOne(Scale):
    """Block 1 runs without the row loop, so it is the fastest, and computes ``3 x``."""

    name = "wrong_at_block_one"

    def run(self, x, *, cfg):
        return x * 3 if cfg.block == 1 else super().run(x, cfg=cfg)


def test_a_candidate_with_wrong_outputs_fails_its_check_and_is_not_timed():
    report = FAST.tune(inv_of(WrongAtBlockOne()), [ScaleCfg(block=1), ScaleCfg(block=2)])
    assert report.best == ScaleCfg(block=2) and report.reference == ScaleCfg(block=8)
    [failure] = report.failures
    assert failure.cfg == ScaleCfg(block=1) and failure.phase == "check"
    assert "by 0.5 at output 0" in failure.error  # |3x - 2x| / |2x|
    assert "outputs checked against ScaleCfg(block=8)" in report.table()


def test_unchecked_tunes_time_every_candidate_and_say_so():
    inv = inv_of(WrongAtBlockOne())
    unchecked = ejkfn.Tuner(warmup=0, iters=1, check_outputs=False)
    report = unchecked.tune(inv, [ScaleCfg(block=1), ScaleCfg(block=2)])
    assert report.reference is None and not report.failures
    # a tolerance above the error lets it through; a kernel whose reference fails is not checked
    loose = ejkfn.Tuner(warmup=0, iters=1, check_tolerance=0.6)
    assert not loose.tune(inv, [ScaleCfg(block=1)]).failures
    report = FAST.tune(inv_of(Broken()), [ScaleCfg(block=2)])
    assert report.reference is None and report.best == ScaleCfg(block=2)
    assert any(
        "outputs not checked: the reference ScaleCfg(block=8) failed" in n for n in report.notes
    )
    with pytest.raises(ValueError, match=r"check_tolerance=-1\.0"):
        ejkfn.Tuner(check_tolerance=-1.0)


class WrongGradientAtBlockOne(Scale):
    """Block 1's gradient is zero; every block's output is right."""

    name = "wrong_gradient_at_block_one"

    def run(self, x, *, cfg):
        if cfg.block != 1:
            return super().run(x, cfg=cfg)

        @jax.custom_vjp
        def scaled(x):
            return x * self.factor

        scaled.defvjp(lambda x: (x * self.factor, None), lambda _, g: (jnp.zeros_like(g),))
        return scaled(x)


def test_a_wrong_gradient_fails_the_check_where_the_backward_is_timed():
    inv = inv_of(WrongGradientAtBlockOne())
    candidates = [ScaleCfg(block=1), ScaleCfg(block=2)]
    assert not FAST.tune(inv, candidates).failures  # the forward alone is right
    [failure] = FAST.tune(inv, candidates, validate_backward=True).failures
    assert failure.cfg == ScaleCfg(block=1) and failure.phase == "check"
    assert "by 1 at output 1" in failure.error  # the gradient: |0 - 2| / 2


def test_output_errors_tell_nans_and_integers_apart():
    nan = jnp.asarray([1.0, jnp.nan])
    assert _tune._relative_error([nan], [nan]) == (0.0, 0)  # NaN where the reference has it
    error, _ = _tune._relative_error([jnp.asarray([1.0, 2.0])], [nan])
    assert np.isnan(error)
    assert _tune._relative_error([jnp.arange(3)], [jnp.arange(3)]) == (0.0, 0)
    assert _tune._relative_error(
        [jnp.ones(2), jnp.arange(3)], [jnp.ones(2), jnp.zeros(3, int)]
    ) == (
        float("inf"),
        1,
    )
    with pytest.raises(ValueError, match="reference's are"):
        _tune._relative_error([jnp.ones(2)], [jnp.ones(3)])
    assert _tune._default_tolerance([jnp.ones(2, jnp.bfloat16), jnp.ones(2)]) == 0.1
    assert _tune._default_tolerance([jnp.ones(2), jnp.arange(2)]) == 0.02


def test_validate_backward_times_forward_and_backward():
    d, _ = tiers(inv_of(), ejkfn.Caches(), policy=ejkfn.AutotunePolicy(validate_backward=True))
    assert d.tune.backward is True and d.tune.notes == ()


def _spy_on_cotangents(seen: list[np.ndarray]) -> Scale:
    @jax.custom_vjp
    def spied(x):
        return x

    def spied_bwd(_, g):
        jax.debug.callback(lambda a: seen.append(np.asarray(a)), g)
        return (g,)

    spied.defvjp(lambda x: (x, None), spied_bwd)

    class Spy(Scale):
        name = "spy_cotangent"

        def run(self, x, *, cfg):
            return spied(x)

    return Spy()


def test_tuner_times_the_backward_on_a_random_cotangent():
    # Training never hands the backward the ones of a plain sum; the tuner must not either.
    seen = []
    report = FAST.tune(
        inv_of(_spy_on_cotangents(seen)), [ScaleCfg(block=1)], validate_backward=True
    )
    assert report.backward and seen
    assert all(a.shape == X.shape and len(np.unique(a)) == a.size for a in seen)


def test_timed_backward_takes_its_cotangent_as_an_input_in_the_outputs_dtype():
    # As training does: the next layer's gradient arrives ready, and nothing in the timed program
    # computes it (a cast of f32 loss weights there slowed attention backwards by 3-7%).
    seen = []
    kernel = _spy_on_cotangents(seen)
    x = X.astype(jnp.bfloat16)
    args, kwargs = kernel.sample_inputs(inv_of(kernel, x=x), jax.random.key(0))
    dynamic, static = _tune.split_static((tuple(args), dict(kwargs)))
    cotangents = _tune._cotangents(kernel, ScaleCfg(block=1), static, dynamic, seed=0)
    assert [c.dtype for c in cotangents] == [jnp.bfloat16]
    run = jax.jit(_tune._forward_and_backward(kernel, ScaleCfg(block=1), static))
    outs, (grads,) = run(dynamic, cotangents)
    assert np.array_equal(seen[-1], np.asarray(cotangents[0]))
    assert np.array_equal(np.asarray(grads[0]), np.asarray(cotangents[0]))
    assert np.array_equal(np.asarray(outs[0]), np.asarray(dynamic[0]))


class NotDifferentiable(Scale):
    name = "not_differentiable"

    def run(self, x, *, cfg):
        # A host callback has no derivative rule: only the forward can be timed.
        return jax.pure_callback(lambda a: a * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def test_validate_backward_falls_back_to_forward_when_not_differentiable():
    d, _ = tiers(
        inv_of(NotDifferentiable()),
        ejkfn.Caches(),
        policy=ejkfn.AutotunePolicy(validate_backward=True),
    )
    assert d.tier == "autotune" and d.tune.backward is False
    assert "forward only" in d.tune.notes[0]


def test_tuner_inputs_are_random_never_zeros():
    seen = []

    class Spy(Scale):
        name = "spy_inputs"

        def run(self, x, *, cfg):
            jax.debug.callback(lambda a: seen.append(np.asarray(a)), x)
            return x

    tiers(inv_of(Spy()), ejkfn.Caches())
    assert seen and all(np.count_nonzero(a) == a.size for a in seen)
    assert len({a.tobytes() for a in seen}) == 1  # the same inputs for every candidate


def test_tuner_bounds_one_call():
    class Slow(Scale):
        name = "slow"

        def run(self, x, *, cfg):
            def wait(a):
                time.sleep(0.05 * cfg.block)
                return a

            return jax.pure_callback(wait, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    tuner = ejkfn.Tuner(warmup=1, iters=1, max_seconds_per_call=0.15)
    report = tuner.tune(inv_of(Slow()), [ScaleCfg(block=1), ScaleCfg(block=8)])
    assert report.best == ScaleCfg(block=1)
    assert report.failures[0].cfg == ScaleCfg(block=8) and "bound" in report.failures[0].error


def _scripted_timings(monkeypatch, *passes):
    """Replaces the interleaved timing with scripted seconds, one dict a pass; logs what each pass
    timed: (keys, calls)."""
    log = []
    readings = iter(passes)

    def timed(fns, *, calls, **_):
        log.append((sorted(fns), calls))
        seconds = next(readings)
        return {k: [seconds[k]] for k in fns}

    monkeypatch.setattr(_tune, "interleaved_seconds", timed)
    return log


def test_tuner_runoff_times_the_close_candidates_again_among_themselves(monkeypatch):
    log = _scripted_timings(monkeypatch, {"a": 1.05, "b": 1.01})
    tuner = ejkfn.Tuner(iters=4, runoff=0.03)
    fns = {k: (lambda: None) for k in "abc"}
    assert tuner.runoff_timings(fns, {"a": 1.0, "b": 1.02, "c": 1.5}) == {"a": 1.05, "b": 1.01}
    assert log == [(["a", "b"], 8)]  # c is 50% behind; runoff_iters defaults to twice iters
    # nothing to decide: one candidate within the margin, failures, or no runoff asked for
    assert tuner.runoff_timings(fns, {"a": 1.0, "b": 1.2, "c": ValueError("x")}) == {}
    assert ejkfn.Tuner(runoff=0.0).runoff_timings(fns, {"a": 1.0, "b": 1.0}) == {}
    assert len(log) == 1


def test_tune_chooses_on_the_runoff(monkeypatch):
    cfgs = [ScaleCfg(block=1), ScaleCfg(block=2), ScaleCfg(block=8)]
    log = _scripted_timings(monkeypatch, {0: 1.0, 1: 1.02, 2: 2.0}, {0: 1.1, 1: 1.0})
    tuner = ejkfn.Tuner(warmup=0, iters=2, runoff=0.05, runoff_iters=6, progress=False)
    report = tuner.tune(inv_of(), cfgs)
    assert log == [([0, 1, 2], 2), ([0, 1], 6)]
    assert report.best == ScaleCfg(block=2)
    assert [r.seconds for r in report.results] == [1.1, 1.0, 2.0]
    assert any("runoff: 2 candidates" in n for n in report.notes)
    _scripted_timings(monkeypatch, {0: 1.0, 1: 1.02, 2: 2.0})  # without a runoff: one pass
    assert ejkfn.Tuner(warmup=0, iters=2, progress=False).tune(inv_of(), cfgs).best == cfgs[0]


@pytest.mark.parametrize(
    "bad, match", [(dict(runoff=-0.1), "runoff"), (dict(runoff_iters=0), "runoff_iters")]
)
def test_tuner_refuses_a_bad_runoff(bad, match):
    with pytest.raises(ValueError, match=match):
        ejkfn.Tuner(**bad)


def test_interleaved_seconds_takes_turns_in_a_new_order_each_round():
    log: list[str] = []

    def counted(name):
        return lambda: log.append(name) or jnp.zeros(())

    names = ["a", "b", "c", "d"]
    times = ejkfn.interleaved_seconds(
        {n: counted(n) for n in names}, warmup=1, calls=7, rounds=3, settle=2
    )
    assert {n: len(r) for n, r in times.items()} == dict.fromkeys(names, 3)
    assert all(t > 0 for r in times.values() for t in r)
    # warm-up 1 + 3 rounds x (2 untimed + a share of 3, 2, 2 timed)
    assert {n: log.count(n) for n in names} == dict.fromkeys(names, 1 + 3 * 2 + 7)
    turns = log[len(names) :]
    firsts = [turns[i] for i in range(0, len(turns), 2 + 3)][:4]  # round 0: shares of 3
    later = turns[4 * 5 :]
    round_orders = [firsts, later[0 : 4 * 4 : 4], later[4 * 4 :: 4]]
    assert all(sorted(order) == names for order in round_orders)
    assert len({tuple(order) for order in round_orders}) > 1  # not one fixed order


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_interleaved_seconds_has_each_function_follow_every_other_equally_often(n):
    """Within a round a function's turn follows each other function's equally often over a block
    of rounds (``n`` of them, ``2n`` for odd ``n``), so a light function's wake on the next turn
    falls on all alike; random shuffles once had one copy of a program follow the light one twice
    as often as its twin (benchmarks/NOTES.md, eighty-first round)."""
    log: list[int] = []
    rounds = 2 * n if n % 2 else n
    fns = {i: (lambda i=i: log.append(i) or jnp.zeros(())) for i in range(n)}
    times = ejkfn.interleaved_seconds(fns, warmup=0, calls=rounds, rounds=rounds, settle=0)
    assert all(len(t) == rounds for t in times.values())
    orders = [log[i : i + n] for i in range(0, len(log), n)]
    assert len(orders) == rounds and all(sorted(o) == list(range(n)) for o in orders)
    pairs = collections.Counter((o[i], o[i + 1]) for o in orders for i in range(n - 1))
    assert pairs == {(a, b): rounds // n for a in range(n) for b in range(n) if a != b}
    with pytest.raises(ValueError, match="rounds=0"):
        _tune._carryover_balanced_orders(3, 0, random.Random(0))


@pytest.fixture
def slow_call(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[int]], Callable[[], Any]]:
    """Calls that log themselves and last 6 ms on a fake ``time.perf_counter``: a real sleep
    overruns by tens of ms on a busy machine, and these tests count calls, not time."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def make(log: list[int]) -> Callable[[], Any]:
        def call() -> jax.Array:
            log.append(1)
            now[0] += 0.006
            return jnp.zeros(())

        return call

    return make


def test_interleaved_seconds_lengthens_short_batches(slow_call):
    """A function whose share of a round would last under ``min_batch_seconds`` runs that long
    instead (judged by its warm-up); without the minimum, or without warm-up, it runs its share."""

    def batches(**kw):
        log: list[int] = []
        sleepy = slow_call(log)
        times = ejkfn.interleaved_seconds({"f": sleepy}, calls=3, rounds=3, settle=0, **kw)
        assert len(times["f"]) == 3 and all(t >= 0.005 for t in times["f"])
        return len(log) - kw.get("warmup", 2)

    assert batches() == 3  # a share of one call a round
    assert batches(warmup=0, min_batch_seconds=0.05) == 3
    lengthened = batches(warmup=1, min_batch_seconds=0.05)
    assert lengthened % 3 == 0 and 4 <= lengthened // 3 <= 10  # 0.05 s of 6 ms calls
    with pytest.raises(ValueError, match=r"min_batch_seconds=-1\.0"):
        ejkfn.interleaved_seconds({"f": lambda: None}, min_batch_seconds=-1.0)
    # settle_seconds lengthens the untimed calls before each turn alike (3 rounds of 4-10 more).
    settled = batches(warmup=1, settle_seconds=0.05)
    assert settled - 3 >= 12 and (settled - 3) % 3 == 0 and (settled - 3) // 3 <= 10
    with pytest.raises(ValueError, match=r"settle_seconds=-1\.0"):
        ejkfn.interleaved_seconds({"f": lambda: None}, settle_seconds=-1.0)
    with pytest.raises(ValueError, match=r"min_batch_seconds=-1\.0"):
        ejkfn.Tuner(min_batch_seconds=-1.0)
    with pytest.raises(ValueError, match=r"settle_seconds=-1\.0"):
        ejkfn.Tuner(settle_seconds=-1.0)


def test_calls_back_to_back_keep_a_bounded_number_unfinished(monkeypatch):
    """The timed and settling calls keep at most ``MAX_IN_FLIGHT`` unfinished, so a slow kernel's
    queued outputs and scratch cannot fill the device; every call has finished when the batch
    returns."""

    class Call:
        def __init__(self):
            self.done = False

    calls: list[Call] = []
    most = [0]

    def dispatch():
        calls.append(Call())
        most[0] = max(most[0], sum(not c.done for c in calls))  # this one among them
        return calls[-1]

    def block(tree):
        # waiting on a call means the device, running in order, has run every call before it
        last = max(
            calls.index(c) for c in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Call))
        )
        for c in calls[: last + 1]:
            c.done = True
        return tree

    monkeypatch.setattr(_tune, "_block", block)
    _tune._seconds_per_call(dispatch, 100, None)
    assert most[0] == _tune.MAX_IN_FLIGHT and all(c.done for c in calls)
    calls.clear()
    most[0] = 0
    _tune._back_to_back(dispatch, 40)  # the settling calls
    assert most[0] == _tune.MAX_IN_FLIGHT and all(c.done for c in calls) and len(calls) == 40


def test_tuner_settles_each_candidate_before_timing_it(slow_call):
    """``Tuner(settle_seconds=...)`` lengthens the untimed calls before each timed batch as
    :func:`interleaved_seconds` does (here 0.04 s of 6 ms calls before each of 3 turns)."""

    def untimed_calls(**kw) -> int:
        log: list[int] = []
        sleepy = slow_call(log)

        tuner = ejkfn.Tuner(warmup=1, iters=3, rounds=3, min_batch_seconds=0.0, **kw)
        assert tuner.timings({"f": sleepy})["f"] >= 0.005
        return len(log) - 1 - 3  # less the warm-up call and the timed ones

    assert untimed_calls() == 3  # one settling call a turn
    settled = untimed_calls(settle_seconds=0.04)
    assert settled % 3 == 0 and 4 <= settled // 3 <= 8


def test_tuner_settles_for_a_gpu_clock_only_on_a_gpu(monkeypatch):
    """Unset, ``settle_seconds`` is :data:`ejkfn._tune.GPU_SETTLE_SECONDS` where JAX's default
    backend is a GPU (its clock lags the power drawn) and 0 elsewhere; a value given is kept."""
    from ejkfn import _tune

    assert ejkfn.Tuner().settling_seconds == 0.0  # the CPU
    assert ejkfn.Tuner(settle_seconds=0.03).settling_seconds == 0.03
    monkeypatch.setattr(_tune.jax, "default_backend", lambda: "gpu")
    assert ejkfn.Tuner().settling_seconds == _tune.GPU_SETTLE_SECONDS > 0.05
    assert ejkfn.Tuner(settle_seconds=0.0).settling_seconds == 0.0


def test_interleaved_seconds_drops_what_fails_and_times_the_rest():
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("device lost")
        return jnp.zeros(())

    times = ejkfn.interleaved_seconds(
        {"ok": lambda: jnp.zeros(()), "flaky": flaky}, warmup=1, calls=6, rounds=3
    )
    assert len(times["ok"]) == 3
    assert isinstance(times["flaky"], RuntimeError)
    with pytest.raises(ValueError, match="rounds=0"):
        ejkfn.interleaved_seconds({"ok": lambda: None}, rounds=0)
    with pytest.raises(ValueError, match="rounds=0"):
        ejkfn.Tuner(rounds=0)
