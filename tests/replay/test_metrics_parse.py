"""The Prometheus text parser behind every `/metrics` scrape: exact samples for what vLLM and the
simulator's server write, and a malformed line that costs only itself."""

from __future__ import annotations

import math

from agentab.replay.metrics import engine_samples, parse_prometheus

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="kimi"} 3.0
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="kimi"} 1234.0
vllm:prefix_cache_queries_created{engine="0",model_name="kimi"} 1.7e+09
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="kimi"} 1.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="kimi"} 2.0
vllm:time_to_first_token_seconds_sum{model_name="kimi"} 0.25
vllm:time_to_first_token_seconds_count{model_name="kimi"} 2.0
"""


def test_vllm_exposition_gives_every_sample_in_order() -> None:
    assert parse_prometheus(VLLM_TEXT) == [
        ("vllm:num_requests_running", {"engine": "0", "model_name": "kimi"}, 3.0),
        ("vllm:prefix_cache_queries_total", {"engine": "0", "model_name": "kimi"}, 1234.0),
        ("vllm:prefix_cache_queries_created", {"engine": "0", "model_name": "kimi"}, 1.7e9),
        ("vllm:time_to_first_token_seconds_bucket", {"le": "0.1", "model_name": "kimi"}, 1.0),
        ("vllm:time_to_first_token_seconds_bucket", {"le": "+Inf", "model_name": "kimi"}, 2.0),
        ("vllm:time_to_first_token_seconds_sum", {"model_name": "kimi"}, 0.25),
        ("vllm:time_to_first_token_seconds_count", {"model_name": "kimi"}, 2.0),
    ]


def test_label_escapes_timestamps_and_untyped_lines() -> None:
    text = 'x{a="q\\"u\\\\o\\nte", b="2",} 5 1700000000000\ny 7\nz{} 1.5e3\n'
    assert parse_prometheus(text) == [
        ("x", {"a": 'q"u\\o\nte', "b": "2"}, 5.0),
        ("y", {}, 7.0),
        ("z", {}, 1500.0),
    ]


def test_nan_and_infinities_stay_floats() -> None:
    samples = parse_prometheus("n NaN\np +Inf\nm -Inf\n")
    assert [name for name, _, _ in samples] == ["n", "p", "m"]
    assert math.isnan(samples[0][2])
    assert samples[1][2] == math.inf
    assert samples[2][2] == -math.inf


def test_a_malformed_line_is_skipped_and_the_rest_kept() -> None:
    text = '# TYPE ok gauge\nok 1\nthis line is not a sample\nv abc\nok2{a="b"} 2\r\n'
    assert parse_prometheus(text) == [("ok", {}, 1.0), ("ok2", {"a": "b"}, 2.0)]


def test_empty_and_comment_only_text() -> None:
    assert parse_prometheus("") == []
    assert parse_prometheus("# HELP a nothing\n# TYPE a gauge\n\n") == []


def test_engine_metrics_become_unlabelled_samples() -> None:
    assert engine_samples({"kv_usage": 0.5, "steps": 3}) == [
        ("kv_usage", {}, 0.5),
        ("steps", {}, 3.0),
    ]
