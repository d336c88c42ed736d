"""The same workload over real HTTP (`agentab serve`) and in-process gives the same counts, and
the client's chunk times match the server's own write times."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from urllib.request import urlopen

import numpy as np
import polars as pl
import pytest

from agentab.engine import build_simulator
from agentab.replay import ReplayOptions, replay_to_dir, run_to_dir, simulate_to_dir
from agentab.replay.targets.loopback import LoopbackTarget
from agentab.rundir import scan_metrics, scan_records
from agentab.workloads.model import Request, Session, Subagent, Workload
from tests.serving import serve_process

PROFILE = "h200-tp1-kimi-shard"
OPTS = ReplayOptions(
    concurrency=2,
    passes=2,
    duration_s=None,
    start_window=(0.0, 0.0),
    warmup_requests=0,
    idle_cap_global_s=0,
    idle_cap_tree_s=0,
    max_error_rate=0.0,
    scrape_metrics=True,
    scrape_interval_s=0.5,
)


def _session(i: int, out_scale: int = 1) -> Session:
    """Four growing parent turns (chained hash ids) and one joined subagent.

    `out_scale` multiplies the parent turns' output lengths: the timing test needs enough chunks
    that its p99 is a percentile, not the second-largest of a few hundred samples.
    """
    items: list[Request | Subagent] = []
    ids: tuple[int, ...] = ()
    for k in range(4):
        ids = ids + tuple(range(100 * k + 1, 100 * k + 1 + 8))
        items.append(
            Request(
                t=0.3 * k,
                in_tokens=len(ids) * 64 + 10,
                out_tokens=(12 + 4 * k) * out_scale,
                hash_ids=ids,
                api_time=0.1,
            )
        )
        if k == 1:
            sub_ids = (*ids[:8], 900, 901)
            items.append(
                Subagent(
                    agent_id=f"sub{i}",
                    t=0.45,
                    duration_s=0.1,
                    items=(
                        Request(
                            t=0.46,
                            in_tokens=700,
                            out_tokens=6,
                            hash_ids=sub_ids,
                            api_time=0.05,
                            kind="subagent",
                            agent_id=f"sub{i}",
                        ),
                    ),
                )
            )
    return Session(f"s{i}", 64, tuple(items))


def _lags(records: pl.DataFrame, emissions: dict[str, list[float]], t0: float) -> np.ndarray:
    """Client arrival minus server write time of every chunk (seconds)."""
    diffs: list[float] = []
    for rid, sent_s, chunks in records.select("request_id", "sent_s", "chunk_times_s").iter_rows():
        server = emissions[rid]
        client = [t0 + sent_s + c for c in chunks]
        assert len(client) == len(server), rid
        diffs.extend(c - s for c, s in zip(client, server, strict=True))
    d = np.asarray(diffs)
    print(
        f"client - server chunk time over {d.size} chunks: p50 {np.percentile(d, 50) * 1e3:.3f} "
        f"ms, p99 {np.percentile(d, 99) * 1e3:.3f} ms, max {d.max() * 1e3:.3f} ms"
    )
    assert d.min() > -1e-4  # a chunk never arrives before it was written
    return d


def test_client_chunk_times_match_server_writes(tmp_path: Path) -> None:
    wl = Workload(tuple(_session(i, out_scale=5) for i in range(3)))
    target = LoopbackTarget(build_simulator(PROFILE))
    run_dir = run_to_dir(
        wl, target, replay=OPTS, out_dir=tmp_path / "r", virtual=False, progress=False
    )
    records = scan_records(run_dir).collect()
    assert records.height == 20 and records["error_class"].null_count() == 20
    t0 = json.loads((run_dir / "manifest.json").read_text())["clock_t0"]
    d = _lags(records, target.server.emissions, t0)
    # Every chunk the server wrote was timed by the client, once, in order (how close the two
    # clocks are is a speed figure: benchmarks/bench_chunk_timing.py prints it).
    assert d.size == sum(len(v) for v in target.server.emissions.values())
    for rid, chunks in records.select("request_id", "chunk_times_s").iter_rows():
        assert chunks == sorted(chunks), rid


@pytest.mark.slow
def test_http_and_inprocess_agree(tmp_path: Path) -> None:
    wl = Workload(tuple(_session(i) for i in range(3)))
    opts = OPTS
    with serve_process("--profile", PROFILE, "--record-emissions") as (url, _proc):
        http_dir = replay_to_dir(
            wl, url=url, replay=opts, out_dir=tmp_path / "http", progress=False
        )
        with urlopen(url + "/agentab/emissions") as resp:
            emissions = json.loads(resp.read())
        chat_opts = replace(opts, endpoint="chat", scrape_metrics=False)
        chat_dir = replay_to_dir(
            wl, url=url, replay=chat_opts, out_dir=tmp_path / "chat", progress=False
        )
    sim_dir = simulate_to_dir(
        wl,
        engine_options={"profile": PROFILE},
        replay=opts,
        out_dir=tmp_path / "sim",
        progress=False,
    )

    cols = ["request_id", "prompt_tokens", "completion_tokens", "cached_tokens", "error_class"]
    http = scan_records(http_dir).collect().sort("request_id")
    sim = scan_records(sim_dir).collect().sort("request_id")
    assert http.height == sim.height == 2 * 2 * 5  # lanes x passes x requests
    assert http.select(cols).equals(sim.select(cols))
    assert http["error_class"].null_count() == http.height
    assert (http["cached_tokens"] > 0).sum() >= 12  # later turns and subagents hit the cache
    # The HTTP manifest carries the served engine's facts.
    manifest = json.loads((http_dir / "manifest.json").read_text())
    assert manifest["engine"] == "agentab-sim" and manifest["profile"] == PROFILE
    assert manifest["target"] == "http"

    # Client chunk times vs the server's write times, both on CLOCK_MONOTONIC: never earlier
    # (how much later is printed by benchmarks/bench_chunk_timing.py).
    _lags(http, emissions, manifest["clock_t0"])
    # Per-request token counts per chunk agree with usage.
    sums = http.select(pl.col("chunk_tokens").list.sum())["chunk_tokens"].to_list()
    assert sums == http["completion_tokens"].to_list()

    # Scraped server metrics: the prefix-cache hit counter ends at the sum of cached tokens.
    for run_dir, records in ((http_dir, http), (sim_dir, sim)):
        hits = (
            scan_metrics(run_dir)
            .filter(pl.col("name") == "vllm:prefix_cache_hits_total")
            .sort("t_s")
            .collect()
        )
        assert hits.height >= 2
        assert hits["value"].is_sorted()
        assert hits["value"][-1] == records["cached_tokens"].sum()

    # The chat endpoint: text prompts (one word per token plus the salt tag), same outputs.
    chat = scan_records(chat_dir).collect().sort("request_id")
    assert chat["error_class"].null_count() == chat.height == http.height
    in_tokens = {r.agent_id + str(r.in_tokens) for r in wl.sessions[0].all_requests()}
    assert in_tokens  # prompt sizes are the recorded ones plus the salt tag word
    assert (chat["prompt_tokens"] - http["prompt_tokens"]).to_list() == [1] * chat.height
    assert chat["completion_tokens"].to_list() == http["completion_tokens"].to_list()
    assert chat["reasoning_chunks"].to_list() == [0] * chat.height
