"""lane_requests: each lane stops after N profiling requests, so two runs of one plan send the
same requests whatever their speeds."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from agentab.errors import AgentabError
from agentab.replay import simulate_to_dir
from agentab.replay.options import ReplayOptions
from agentab.rundir import scan_records
from agentab.workloads.generator import generate, load_config

ENGINE = {"profile": "gb300-tp16-kimi-k3", "decode_backend": "auto"}


def _run(path: Path, workload, **engine) -> pl.DataFrame:
    replay = ReplayOptions(concurrency=3, duration_s=None, lane_requests=7, warmup_requests=1)
    simulate_to_dir(
        workload,
        engine_options={**ENGINE, **engine},
        replay=replay,
        out_dir=path,
        progress=False,
    )
    return scan_records(path).filter(pl.col("phase") == "profiling").collect()


def test_each_lane_sends_exactly_n_profiling_requests_in_both_arms(tmp_path: Path) -> None:
    workload = generate(load_config("agentx-coding"), 8, 5)
    a = _run(tmp_path / "a", workload)
    # another decode path and engine timing noise: other step times, the same requests
    b = _run(
        tmp_path / "b",
        workload,
        decode_backend="latency_specialized",
        step_noise=0.05,
        noise_seed=3,
    )
    for records in (a, b):
        per_lane = records.group_by("lane").len().sort("lane")
        assert per_lane["len"].to_list() == [7, 7, 7]
    assert sorted(a["request_id"].to_list()) == sorted(b["request_id"].to_list())
    assert a["sent_s"].sum() != b["sent_s"].sum()  # the arms did run at different speeds


def test_lane_requests_is_closed_loop_only() -> None:
    with pytest.raises(AgentabError, match="lane_requests must be used with closed-loop"):
        ReplayOptions(rate=0.5, lane_requests=3)
