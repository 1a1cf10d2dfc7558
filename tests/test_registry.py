"""Platform machinery: launch parameters, the implementation registry, platform detection."""

import dataclasses

import pytest

import ejkfn


def test_params_are_frozen_hashable_and_validated():
    assert ejkfn.FwdParams() == ejkfn.FwdParams() and hash(ejkfn.BwdParams()) == hash(
        ejkfn.BwdParams()
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        ejkfn.FwdParams().num_warps = 8
    for bad in ({"num_warps": 0}, {"q_blocksize": -64}, {"num_stages": 1.5}):
        with pytest.raises(
            (ValueError, TypeError), match=next(iter(bad))
        ):  # TypeError: type checks
            ejkfn.FwdParams(**bad)
    with pytest.raises(ValueError, match="block_d"):
        ejkfn.KernelConfig(block_d=0)
    with pytest.raises(ValueError, match="gpu2"):
        ejkfn.KernelConfig(platform="gpu2")
    assert ejkfn.KernelConfig(priority=0).priority == 0  # priority is not a size


def test_backward_params_keep_the_dq_stages_through_json_and_read_older_configs():
    """A config written before ``dq_num_stages`` existed (no such field) reads as None: the dQ
    kernel then runs on ``num_stages``."""
    from ejkfn._serialize import from_json, to_json

    bp = ejkfn.BwdParams(num_stages=3, variant="mirrored", dq_num_stages=2)
    assert from_json(to_json(bp)) == bp
    older = '{"fields":{"num_stages":3,"variant":"mirrored"},"type":"ejkfn._registry:BwdParams"}'
    assert from_json(older) == ejkfn.BwdParams(num_stages=3, variant="mirrored")
    for bad in (0, 1.5, "2"):
        with pytest.raises(
            (ValueError, TypeError), match="dq_num_stages"
        ):  # TypeError: type checks
            ejkfn.BwdParams(dq_num_stages=bad)


def test_registry_and_detection():
    marker = object()
    ejkfn.register_kernel("test_algo", "xla", "cpu")(marker)
    assert ejkfn.get_kernel("test_algo", "xla") is marker
    assert ejkfn.available_platforms("test_algo") == ["xla"]
    assert ejkfn.detect_platform("test_algo") == ejkfn.Platform.XLA
    with pytest.raises(ValueError, match="platform='triton' is not available"):
        ejkfn.detect_platform("test_algo", platform="triton")
    with pytest.raises(ValueError, match="no implementation"):
        ejkfn.get_kernel("test_algo", "pallas")


def test_flash_attention_is_registered_for_every_platform():
    assert {"xla", "pallas", "triton", "cudnn"} <= set(
        ejkfn.available_platforms("flash_attention", "gpu")
    )
    assert ejkfn.detect_platform("flash_attention") == ejkfn.Platform.XLA  # this machine is a CPU
    assert ejkfn.detect_platform("flash_attention", backend="gpu") == ejkfn.Platform.TRITON
