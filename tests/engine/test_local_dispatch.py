"""Which steps the local engine's specialized backend serves by default (engine.local.dispatch)."""

from __future__ import annotations

from agentab.engine.local.dispatch import MEASURED, specialized_limit


def test_the_measured_device_routes_the_shapes_its_decoder_loses():
    limit = specialized_limit(None, "NVIDIA H200", "k2-tp8-shard", 64)
    assert (limit.max_tokens, limit.source) == (4, "measured")
    assert limit.reason == MEASURED[0].evidence


def test_the_option_overrides_the_table_within_vllms_limit():
    assert specialized_limit(64, "NVIDIA H200", "k2-tp8-shard", 64).max_tokens == 64
    assert specialized_limit(2, "NVIDIA H200", "k2-tp8-shard", 64).max_tokens == 2
    limit = specialized_limit(32, None, "tiny", 16)
    assert (limit.max_tokens, limit.source, limit.reason) == (
        16,
        "option",
        "specialized_max_tokens = 32",
    )


def test_an_unmeasured_device_or_preset_keeps_vllms_rule_and_says_so():
    h100 = specialized_limit(None, "NVIDIA H100 80GB HBM3", "k2-tp8-shard", 64)
    assert (h100.max_tokens, h100.source) == (64, "vllm-rule")
    assert (
        h100.reason
        == "no measured dispatch for NVIDIA H100 80GB HBM3 and k2-tp8-shard: vLLM's rule"
    )
    other = specialized_limit(None, "NVIDIA H200", "tiny", 64)
    assert (other.max_tokens, other.source) == (64, "vllm-rule")
