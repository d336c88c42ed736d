"""The bench's profile writer produces a file the simulator's profile loader accepts."""

from __future__ import annotations

import pytest

from agentab.engine import profile as profile_mod
from agentab.kernels.profile_toml import HBM_READ_BYTES_PER_S, KV_BYTES_PER_TOKEN, render_profile


def _results() -> dict:
    # A results document's shape (values are inputs to the writer, not measurements).
    return {
        "device": "NVIDIA H200",
        "torch": "2.11.0",
        "preset": "k2-tp8-shard",
        "context": 1000,
        "layers_per_graph": 4,
        "iters": 100,
        "command": "agentab kernels bench --batch 1,64",
        "rows": [
            {"batch": 1, "standard_us": 200.0, "specialized_us": 100.0},
            {"batch": 64, "standard_us": 1200.0, "specialized_us": 900.0},
        ],
        "standard_extra_rows": [{"batch": 128, "standard_us": 1500.0}],
    }


def test_profile_round_trips_through_the_engine_loader() -> None:
    text = render_profile(_results())
    prof = profile_mod.parse_profile(text.encode(), "test")
    assert prof.status == "measured" and prof.name == "h200-tp1-kimi-shard"
    kv_us = 1000 * KV_BYTES_PER_TOKEN / HBM_READ_BYTES_PER_S * 1e6  # 0.256 us per sequence
    assert list(prof.specialized.batch_tokens) == [1, 64]
    assert prof.specialized.layer_time_us[0] == pytest.approx(100.0 - kv_us, abs=0.01)
    assert list(prof.standard.batch_tokens) == [1, 64, 128]
    assert prof.standard.layer_time_us[2] == pytest.approx(1500.0 - 128 * kv_us, abs=0.01)
