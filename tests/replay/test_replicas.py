"""`agentab serve --replicas N` and `agentab replay --url A --url B` against real server
processes: each replica serves and records its own emissions, the replay pins each lane to one
replica (the same one whatever the client count), the merged run is complete, the replicas'
scraped counters are summed by the analysis, and a dead replica or URL is one clear line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import polars as pl
import pytest

from agentab.analysis.load import load_run
from agentab.analysis.summary import counter_delta, summarize_run
from agentab.replay.metrics import parse_prometheus
from agentab.rundir import scan_metrics, scan_records
from tests.replay.chained_sessions import save_chained
from tests.serving import serve_replicas

SERVE = ("--profile", "gb300-tp16-kimi-k3")


@pytest.fixture(scope="module")
def workload_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_chained(
        tmp_path_factory.mktemp("replicas") / "w.jsonl", 8, turns=4, gap_s=0.1, out_step=2
    )


@contextmanager
def replicas(n: int, *extra: str) -> Iterator[tuple[list[str], subprocess.Popen[str]]]:
    """`agentab serve --replicas N --port 0` of the simulator: the replicas' URLs (replica 0
    first) and the supervising process; SIGTERM on exit."""
    with serve_replicas(n, *SERVE, *extra) as served:
        yield served


def replay(
    workload: Path, urls: list[str], out: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    targets = [arg for url in urls for arg in ("--url", url)]
    return subprocess.run(
        [sys.executable, "-m", "agentab", "replay", str(workload), *targets, "--out", str(out),
         "--concurrency", "4", "--lane-requests", "3", "--warmup-requests", "1",
         "--duration", "0", "--prompt-salt", "same", "--quiet", *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def urlopen_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return str(resp.read().decode())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_each_lane_stays_on_one_replica_and_each_replica_records_its_own(
    workload_file: Path, tmp_path: Path
) -> None:
    with replicas(2, "--record-emissions") as (urls, _proc):
        one = replay(workload_file, urls, tmp_path / "one", "--scrape-metrics")
        # each replica's counters once the first run is over (the second adds to them)
        live = [parse_prometheus(urlopen_text(url + "/metrics")) for url in urls]
        two = replay(workload_file, urls, tmp_path / "two", "--clients", "2")
        emitted = [get_json(url + "/agentab/emissions") for url in urls]
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    runs = [scan_records(tmp_path / d).collect().sort("request_id") for d in ("one", "two")]
    for df in runs:
        # lane k to URL k mod 2, whatever the client count; every lane's requests all there
        assert df["target"].to_list() == [lane % 2 for lane in df["lane"].to_list()]
        assert (
            df.filter(pl.col("phase") == "profiling").group_by("lane").len()["len"].to_list()
            == [3] * 4
        )
        assert df["error_class"].null_count() == df.height
    assert (
        runs[0]
        .select("request_id", "lane", "target")
        .equals(runs[1].select("request_id", "lane", "target"))
    )
    for d in ("one", "two"):
        manifest = json.loads((tmp_path / d / "manifest.json").read_text())
        assert manifest["targets"] == urls and manifest["replicas"] == 2
        assert manifest["status"] == "completed"
    # each replica kept the emissions of the requests sent to it, and only those: both runs
    # sent the same request ids, so a replica's ids are those of its lanes
    for target, log in enumerate(emitted):
        assert isinstance(log, dict)
        mine = set(runs[0].filter(pl.col("target") == target)["request_id"].to_list())
        assert set(log) == mine
    # the replicas' scraped counters stay apart, one label each, and the analysis sums them:
    # the run's counter is the sum of each replica's own increase
    metrics = scan_metrics(tmp_path / "one").collect()
    labels = {orjson.loads(x).get("agentab_target") for x in metrics["labels"].to_list()}
    assert labels == {"0", "1"}
    name = "vllm:prefix_cache_queries_total"
    first = metrics.filter(pl.col("name") == name).sort("t_s").group_by("labels").first()
    assert counter_delta(metrics, name, None) == pytest.approx(
        sum(v for samples in live for n, _, v in samples if n == name) - first["value"].sum()
    )
    summary = summarize_run(load_run(tmp_path / "one")).values
    start = json.loads((tmp_path / "one" / "manifest.json").read_text())["stats"][
        "profiling_start_s"
    ]
    hits, queries = (
        sum(per_replica_delta(metrics, n, target, start) for target in ("0", "1"))
        for n in ("vllm:prefix_cache_hits_total", name)
    )
    assert queries > 0
    assert summary["server_cache_hit_ratio"] == pytest.approx(hits / queries)


def per_replica_delta(metrics: pl.DataFrame, name: str, target: str, since: float) -> float:
    """One replica's increase of a counter since `since`, from its own samples alone."""
    rows = metrics.filter(
        (pl.col("name") == name)
        & pl.col("labels").map_elements(
            lambda x: orjson.loads(x).get("agentab_target") == target, return_dtype=pl.Boolean
        )
    ).sort("t_s")
    before = rows.filter(pl.col("t_s") <= since)
    base = before["value"][-1] if before.height else 0.0
    return float(rows["value"][-1] - base)


def test_a_replica_that_misses_a_scrape_costs_no_other_replica_its_counts() -> None:
    # Per replica series: a scrape one replica did not answer (no rows for it) leaves the sum
    # of the increases right, where a sum taken at each scrape would dip and count twice.
    def row(t: float, target: str, value: float) -> dict[str, object]:
        labels = orjson.dumps({"agentab_target": target}, option=orjson.OPT_SORT_KEYS).decode()
        return {"t_s": t, "name": "c_total", "labels": labels, "value": value}

    metrics = pl.DataFrame(
        [row(0.0, "0", 10), row(0.0, "1", 100), row(1.0, "0", 15),  # replica 1 missed t=1
         row(2.0, "0", 20), row(2.0, "1", 130)]
    )  # fmt: skip
    assert counter_delta(metrics, "c_total", 0.5) == (20 - 10) + (130 - 100)


@pytest.mark.slow
def test_an_unreachable_replica_url_is_refused_in_one_line(
    workload_file: Path, tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with replicas(1) as (urls, _proc):
        for extra in ((), ("--clients", "2"), ("--model", "agentab-sim")):
            out = tmp_path / f"run{len(extra)}{extra[:1]}"
            result = replay(workload_file, [urls[0], dead], out, *extra)
            assert result.returncode == 2, result.stderr
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and dead in lines[0] and "cannot reach" in lines[0], lines
            assert not (out / "records").exists()  # nothing was sent, so nothing is lost


@pytest.mark.slow
def test_a_replica_that_cannot_listen_stops_the_others_with_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1] - 1  # replica 1 gets the taken port
        result = subprocess.run(
            [sys.executable, "-m", "agentab", "serve", *SERVE, "--replicas", "2", "--port",
             str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("agentab: error: --replicas 2: replica 1 (port "), last
    assert f"port {port + 1}" in last


@pytest.mark.slow
def test_a_replica_killed_while_serving_ends_the_command_non_zero() -> None:
    with replicas(2) as (urls, proc):
        replica = get_pid_of_listener(urls[1])
        os.kill(replica, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        assert proc.stderr is not None
        err = proc.stderr.read()
        port = urls[1].rsplit(":", 1)[1]
        assert f"replica 1 (port {port})" in err and "exited with status -9" in err, err
        with pytest.raises(OSError):
            urllib.request.urlopen(urls[0] + "/health", timeout=5)


def get_pid_of_listener(url: str) -> int:
    """The pid of the process listening on `url`'s port (Linux /proc: the socket's inode)."""
    port = int(url.rsplit(":", 1)[1])
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":
            inodes.add(fields[9])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fds = list((entry / "fd").iterdir())
                for fd in fds:
                    if os.readlink(fd).strip("socket:[]") in inodes:
                        return int(entry.name)
            except OSError:
                continue
    raise AssertionError(f"no process listens on {url}")


def test_bad_engine_flags_are_one_line_before_any_replica_starts() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agentab", "serve", "--replicas", "2", "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "agentab: error: --engine sim needs --profile (a hardware profile name or TOML)"
    ]
    assert "replica" not in result.stdout
