"""Per-run metrics against values computed by hand (docs/analysis.md).

The hand-built run: 11 successful requests whose ITLs are exactly 1/64 .. 11/64 s (per-token
chunks and multi-token "spec decode" chunks), one OSL-1 request (no ITL), one request without
server usage (OSL counted from chunks), two errors (one died mid-stream), one request cancelled
by an aborted run (counted apart, in nothing else), one warmup request,
three sessions with subagents, and scraped counters with a warmup baseline. Times are dyadic so
every intermediate value is exact; the expected numbers below were worked out on paper.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from agentab.analysis.load import load_run
from agentab.analysis.summary import summarize_requests, summarize_run, write_summary
from agentab.rundir import RECORD_SCHEMA, PartWriter

from .rundirs import rec, synthetic_records, write_run

HAND_RECORDS = [
    rec("r1", sent_s=0.0, planned_s=0.0, chunk_times_s=[0.5, 0.515625, 0.53125],
        chunk_tokens=[1, 1, 1], completion_tokens=3, prompt_tokens=1000, cached_tokens=0),
    rec("r2", sent_s=2.0, planned_s=1.5, chunk_times_s=[0.25, 0.375], chunk_tokens=[1, 4],
        completion_tokens=5, reasoning_chunks=0, prompt_tokens=2000, cached_tokens=1024),
    rec("r3", agent_id="sub-1", sent_s=3.0, planned_s=3.0, chunk_times_s=[0.125, 0.171875],
        chunk_tokens=[1, 1], completion_tokens=2, prompt_tokens=500, cached_tokens=0),
    rec("r4", sent_s=5.0, planned_s=5.0, chunk_times_s=[1.0, 1.0625, 1.125, 1.1875],
        chunk_tokens=[1, 1, 1, 1], completion_tokens=None, reasoning_chunks=2,
        prompt_tokens=3000, cached_tokens=2048),
    rec("r5", session_id="s2", lane=1, sent_s=1.0, planned_s=1.0,
        chunk_times_s=[0.75, 0.828125, 0.90625], chunk_tokens=[1, 1, 1], completion_tokens=3,
        prompt_tokens=800, cached_tokens=None),
    rec("r6", session_id="s2", lane=1, sent_s=4.0, planned_s=3.75,
        chunk_times_s=[0.5, 0.875, 1.25], chunk_tokens=[1, 4, 4], completion_tokens=9,
        prompt_tokens=1200, cached_tokens=1024),
    rec("r7", session_id="s2", lane=1, agent_id="sub-a", sent_s=4.8125, planned_s=4.5,
        chunk_times_s=[0.375, 0.484375], chunk_tokens=[1, 1], completion_tokens=2,
        prompt_tokens=600, cached_tokens=512),
    rec("r8", session_id="s3", lane=2, sent_s=0.5, planned_s=0.5,
        chunk_times_s=[2.0, 2.125, 2.25, 2.375, 2.5], chunk_tokens=[1, 1, 1, 1, 1],
        completion_tokens=5, prompt_tokens=4000, cached_tokens=0),
    rec("r9", session_id="s3", lane=2, sent_s=8.0, planned_s=7.0,
        chunk_times_s=[0.625, 0.90625], chunk_tokens=[1, 2], completion_tokens=3,
        prompt_tokens=4100, cached_tokens=3968),
    rec("r10", session_id="s3", lane=2, sent_s=12.0, planned_s=12.0,
        chunk_times_s=[0.5, 0.65625], chunk_tokens=[1, 1], completion_tokens=2,
        prompt_tokens=4200, cached_tokens=4096),
    rec("r11", session_id="s3", lane=2, agent_id="sub-b", sent_s=13.0, planned_s=13.0,
        chunk_times_s=[0.25, 0.421875, 0.59375, 0.765625, 0.9375, 1.109375],
        chunk_tokens=[1] * 6, completion_tokens=6, prompt_tokens=300, cached_tokens=0),
    rec("osl1", session_id="s2", lane=1, sent_s=9.0, planned_s=9.0, chunk_times_s=[0.3125],
        chunk_tokens=[1], completion_tokens=1, prompt_tokens=900, cached_tokens=512),
    rec("err-timeout", sent_s=7.0, planned_s=6.875, chunk_times_s=[0.5, 0.75],
        chunk_tokens=[1, 1], error_class="timeout", prompt_tokens=2500),
    rec("err-500", session_id="s3", lane=2, sent_s=14.0, planned_s=14.0,
        error_class="http_500", prompt_tokens=100),
    rec("cancel", session_id="s2", lane=1, sent_s=13.5, planned_s=13.0, chunk_times_s=[0.25],
        chunk_tokens=[1], error_class="cancelled", prompt_tokens=700),
    rec("warm", phase="warmup", sent_s=-5.0, planned_s=-5.0, chunk_times_s=[0.1],
        chunk_tokens=[1], completion_tokens=1, prompt_tokens=5000, cached_tokens=0),
]  # fmt: skip


def _sample(t: float, name: str, value: float, labels: str = "{}") -> dict[str, object]:
    return {"t_s": t, "name": name, "labels": labels, "value": value}


HAND_METRICS = [
    _sample(-6.0, "vllm:prefix_cache_queries_total", 0.0),
    _sample(-1.0, "vllm:prefix_cache_queries_total", 5000.0),
    _sample(15.0, "vllm:prefix_cache_queries_total", 27600.0),
    _sample(-1.0, "vllm:prefix_cache_hits_total", 0.0, '{"engine":"0"}'),
    _sample(15.0, "vllm:prefix_cache_hits_total", 10000.0, '{"engine":"0"}'),
    _sample(-1.0, "vllm:prefix_cache_hits_total", 100.0, '{"engine":"1"}'),
    _sample(15.0, "vllm:prefix_cache_hits_total", 3284.0, '{"engine":"1"}'),
    _sample(-1.0, "vllm:spec_decode_num_drafts_total", 10.0),
    _sample(15.0, "vllm:spec_decode_num_drafts_total", 40.0),
    _sample(-1.0, "vllm:spec_decode_num_accepted_tokens_total", 20.0),
    _sample(15.0, "vllm:spec_decode_num_accepted_tokens_total", 110.0),
    # vLLM's per-position series (k = 4): warmup counts before the phase, 30/25/20/15 in it
    *(
        _sample(
            t,
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            v,
            f'{{"engine":"0","position":"{i}"}}',
        )
        for i in range(4)
        for t, v in ((-1.0, 5.0), (15.0, 35.0 - 5 * i))
    ),
    _sample(-1.0, "agentab:decode_steps_specialized_total", 0.0),
    _sample(15.0, "agentab:decode_steps_specialized_total", 100.0),
    _sample(-1.0, "agentab:decode_steps_standard_total", 10.0),
    _sample(15.0, "agentab:decode_steps_standard_total", 60.0),
    _sample(-1.0, "agentab:device_busy_seconds_total", 2.0),
    _sample(15.0, "agentab:device_busy_seconds_total", 12.0),
    _sample(-1.0, "agentab:decode_device_busy_seconds_total", 1.0),
    _sample(15.0, "agentab:decode_device_busy_seconds_total", 7.0),
    _sample(-1.0, "agentab:decode_device_idle_seconds_total", 0.5),
    _sample(15.0, "agentab:decode_device_idle_seconds_total", 0.8),
    _sample(-1.0, "agentab:draft_device_seconds_total", 0.2),
    _sample(15.0, "agentab:draft_device_seconds_total", 1.4),
    _sample(-1.0, "agentab:draft_steps_total", 10.0),
    _sample(15.0, "agentab:draft_steps_total", 40.0),
]

H11 = 83711 / 27720  # 1 + 1/2 + ... + 1/11

EXPECTED = {
    "requests": 14,
    "requests_ok": 12,
    "requests_error": 2,
    "requests_warmup": 1,
    "requests_cancelled": 1,
    "error_rate": 2 / 14,
    "errors_by_class": {"http_500": 1, "timeout": 1},
    "sessions": 3,
    "ttft_s": {"mean": 7.1875 / 12, "p50": 0.5, "p90": 0.975, "p95": 1.45, "p99": 1.89},
    "ttfo_s": {"mean": 0.6875, "p50": 0.6875, "p90": 1.0375, "p95": 1.08125, "p99": 1.11625},
    "e2e_s": {"mean": 10.390625 / 12, "p50": 0.78125, "p90": 1.24375, "p95": 1.8125,
              "p99": 2.3625},
    "decode_s": {"mean": 205 / 64 / 12, "p50": 10 / 64, "p90": 0.725, "p95": 51.15 / 64,
                 "p99": 54.23 / 64},
    "itl_s": {"mean": 0.09375, "p50": 0.09375, "p90": 0.15625, "p95": 0.1640625,
              "p99": 0.1703125},
    "p90_interactivity_tok_s": 6.4,
    "interactivity_tok_s": {"mean": 64 * H11 / 11, "p50": 64 / 6, "p90": 32.0, "p95": 48.0,
                            "p99": 60.8},
    "osl_tokens": {"mean": 3.75, "p50": 3.0, "p90": 5.9, "p95": 7.35, "p99": 8.67},
    "dispatch_lateness_s": {"mean": 2.1875 / 14, "p50": 0.0, "p90": 0.44375, "p95": 0.675,
                            "p99": 0.935},
    "phase_wall_s": 14.109375,
    "output_tokens": 45,
    "input_tokens": 22600,
    "decode_tokens": 33,
    "decode_busy_s": 201 / 64,
    "decode_throughput_tok_s": 33 / (201 / 64),
    "output_throughput_tok_s": 45 / 14.109375,
    "throughput_per_gpu_tok_s": 22645 / 14.109375 / 16,
    # the 13,184 cached prompt tokens left out
    "throughput_per_gpu_uncached_tok_s": (22600 - 13184 + 45) / 14.109375 / 16,
    "request_throughput_req_s": 12 / 14.109375,
    "cache_hit_ratio": 13184 / 21800,
    "server_cache_hit_ratio": 13184 / 22600,
    "spec_acceptance_length": 4.0,
    "spec_acceptance_rates": [1.0, 25 / 30, 20 / 30, 0.5],  # per position, over 30 drafts
    # 100 of 150 pure-decode steps specialized; 10 s busy on the device, 6 s in decode steps
    "specialized_decode_share": 100 / 150,
    "prefill_device_share": 4 / 10,
    "decode_step_device_s": 6 / 150,
    # 0.3 s idle before those decode steps against their 6 s of device time
    "decode_idle_share": 0.3 / 6,
    # 1.2 s of drafts over 30 drafting steps
    "draft_step_device_s": 1.2 / 30,
    "gpu_count": 16,
}  # fmt: skip


@pytest.fixture(scope="module")
def hand_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("hand"), HAND_RECORDS, metrics=HAND_METRICS)


def _approx(value: object) -> object:
    if isinstance(value, list):
        return [_approx(v) for v in value]
    if isinstance(value, dict):
        return {k: _approx(v) for k, v in value.items()}
    if isinstance(value, float):
        return pytest.approx(value, rel=1e-12, abs=1e-15)
    return value


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_every_per_run_metric_matches_the_hand_computed_value(hand_run: Path, key: str) -> None:
    values = summarize_run(load_run(hand_run)).values
    got = values[key]
    if isinstance(got, dict) and "std" in got:  # the spread keys are checked below
        got = {k: v for k, v in got.items() if k not in ("min", "max", "std")}
    assert got == _approx(EXPECTED[key])


def test_min_max_std_beside_the_percentiles(hand_run: Path) -> None:
    itl = summarize_run(load_run(hand_run)).values["itl_s"]
    # ITLs 1/64 .. 11/64 s: min 1/64, max 11/64, sample std (ddof 1) sqrt(11) / 64
    assert itl["min"] == pytest.approx(1 / 64) and itl["max"] == pytest.approx(11 / 64)
    assert itl["std"] == pytest.approx(11**0.5 / 64, rel=1e-12)


def test_headline_and_other_interactivity_definitions_differ(hand_run: Path) -> None:
    values = summarize_run(load_run(hand_run)).values
    # 1/P90(ITL) is the slow tail; the p90 of 1/ITL_i is the fast tail: 6.4 vs 32 tok/s.
    assert values["p90_interactivity_tok_s"] == pytest.approx(1 / values["itl_s"]["p90"])
    assert values["interactivity_tok_s"]["p90"] == pytest.approx(32.0)


def test_summary_json_has_the_documented_keys(hand_run: Path, tmp_path: Path) -> None:
    summary = summarize_run(load_run(hand_run))
    path = write_summary(summary, tmp_path)
    data = json.loads(path.read_text())
    for key in ("ttft_s", "itl_s", "e2e_s", "interactivity_tok_s"):
        assert set(data[key]) == {"mean", "p50", "p90", "p95", "p99", "min", "max", "std"}
    for key in (
        "requests_ok",
        "error_rate",
        "p90_interactivity_tok_s",
        "decode_throughput_tok_s",
        "output_throughput_tok_s",
        "throughput_per_gpu_tok_s",
        "throughput_per_gpu_uncached_tok_s",
        "request_throughput_req_s",
        "cache_hit_ratio",
    ):
        assert data[key] == _approx(EXPECTED[key])
    sessions = pl.read_csv(tmp_path / "sessions.csv")
    s1 = sessions.filter(pl.col("session_id") == "s1").row(0, named=True)
    # s1: r1 r2 r3 r4 and the timed-out request in the profiling phase; the warmup is not counted.
    assert (s1["requests"], s1["errors"], s1["output_tokens"]) == (5, 1, 3 + 5 + 2 + 4)
    assert s1["itl_p90_s"] == pytest.approx(np.percentile([1, 2, 3, 4], 90) / 64)


def test_percentiles_match_numpy_on_random_data() -> None:
    rng = np.random.default_rng(7)
    n = 5001
    itl = rng.lognormal(-3.0, 0.7, n)
    ttft = rng.exponential(0.8, n)
    frame = pl.DataFrame(
        {
            "request_id": [f"r{i}" for i in range(n)],
            "session_id": [f"s{i % 37}" for i in range(n)],
            "lane": 0,
            "pass": 0,
            "agent_id": "main",
            "phase": "profiling",
            "ok": True,
            "error_class": None,
            "error_message": None,
            "warning_class": None,
            "sent_s": np.arange(n, dtype=float),
            "end_s": np.arange(n, dtype=float) + ttft + 10 * itl,
            "first_s": np.arange(n, dtype=float) + ttft,
            "ttft_s": ttft,
            "ttfo_s": ttft,
            "e2e_s": ttft + 10 * itl,
            "decode_s": 10 * itl,
            "itl_s": itl,
            "interactivity_tok_s": 1 / itl,
            "osl": 11,
            "prompt_tokens": 100,
            "cached_tokens": 0,
            "lateness_s": 0.0,
        },
        schema_overrides={"error_class": pl.String, "warning_class": pl.String},
    )
    values = summarize_requests(frame, gpu_count=8)
    for key, data in (("itl_s", itl), ("ttft_s", ttft), ("interactivity_tok_s", 1 / itl)):
        for name, q in (("p50", 50), ("p90", 90), ("p95", 95), ("p99", 99)):
            assert values[key][name] == pytest.approx(np.percentile(data, q), rel=1e-12)
        assert values[key]["mean"] == pytest.approx(np.mean(data), rel=1e-12)
    assert values["p90_interactivity_tok_s"] == pytest.approx(1 / np.percentile(itl, 90))


def test_the_summary_does_not_depend_on_where_the_writer_flushed(tmp_path: Path) -> None:
    """A run's records reach disk in parts wherever the writer's wall-clock flushes fell; the
    same rows must give the same summary to the last digit (a sweep on Ray and in one process
    write byte-identical summaries), so the float sums may not follow the part boundaries."""
    records = synthetic_records(11, sessions=40, per_session=10)
    one = write_run(tmp_path / "one", records)
    split = tmp_path / "split"
    split.mkdir()
    (split / "manifest.json").write_bytes((one / "manifest.json").read_bytes())
    for start in range(0, len(records), 37):  # a part file every 37 rows
        with PartWriter(split / "records", RECORD_SCHEMA) as writer:
            writer.add_many(records[start : start + 37])
    assert len(list((split / "records").iterdir())) == 11
    whole, parts = (summarize_run(load_run(d)).values for d in (one, split))
    assert {k: v for k, v in parts.items() if k != "run_dir"} == {
        k: v for k, v in whole.items() if k != "run_dir"
    }
