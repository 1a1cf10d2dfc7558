"""The public surface: every name documented, names of the reference present."""

import inspect
import types

import ejkfn

PUBLIC = sorted(
    n
    for n in dir(ejkfn)
    if not n.startswith("_") and not isinstance(getattr(ejkfn, n), types.ModuleType)
)


def test_every_public_name_has_a_docstring_with_a_summary():
    undocumented = [n for n in PUBLIC if not (inspect.getdoc(getattr(ejkfn, n)) or "").strip()]
    assert undocumented == []
    for name in PUBLIC:
        summary = inspect.getdoc(getattr(ejkfn, name)).split("\n\n")[0].strip()
        assert summary.endswith((".", ":", ")")), f"{name}: summary {summary!r}"


def test_reference_names_are_present():
    expected = {
        "Kernel",
        "Invocation",
        "ConfigCache",
        "PersistentCache",
        "Caches",
        "select",
        "AutotunePolicy",
        "policy_override",
        "forward_autotune_only",
        "overlay_cache",
        "Tuner",
        "autotune",
        "benchmark",
        "interleaved_seconds",
        "choose_config",
        "configure",
        "compile",
        "vmap_with_config",
        "pmap_with_config",
        "shard_map_with_config",
        "label",
        "find_labels_in_lowered",
        "extract_labels_from_hlo_text",
        "labels_to_configs",
        "record",
        "get_invocations",
        "autotune_recorded",
        "autotune_lowered",
        "device_kind",
        "get_device_platform",
        "device_fingerprint",
        "sharding_fingerprint",
        "to_json",
        "from_json",
        "stable_json",
        "KernelConfig",
        "FwdParams",
        "BwdParams",
        "detect_platform",
        "flash_attention",
        "FlashAttention",
        "configure_tree",
    }
    assert expected <= set(PUBLIC), sorted(expected - set(PUBLIC))
