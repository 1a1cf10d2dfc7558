"""The pre-tuned configs shipped as package data."""

import jax.numpy as jnp
import pytest

import ejkfn
from ejkfn.attention import AttentionConfig


@pytest.mark.parametrize("device_kind", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
@pytest.mark.parametrize("causal", [False, True])
def test_shipped_configs_answer_hopper_calls(device_kind, causal):
    # The package ships configs tuned on both GPUs; a call of a tuned shape on either is answered
    # from them, whatever its driver and jax versions.
    q = jnp.zeros((4, 2048, 16, 128), jnp.bfloat16)
    (inv,) = ejkfn.record(lambda q, k, v: ejkfn.flash_attention(q, k, v, causal=causal), q, q, q)
    on_gpu = inv.replace(
        device={"platform": "gpu", "device_kind": device_kind, "platform_version": "any driver"}
    )
    decision, _ = ejkfn.decide(on_gpu, ejkfn.Caches())
    assert decision.tier == "shipped"
    assert isinstance(decision.cfg, AttentionConfig)
    assert decision.cfg.platform in ("cudnn", "pallas", "triton")
