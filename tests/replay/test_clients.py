"""`agentab replay --clients N` against a real `agentab serve` process: one plan split by lane
over N client processes sends the requests one process sends, from one t0, with one profiling
window, into one run dir whose manifest records each client's load; refusals are one line."""

from __future__ import annotations

import fcntl
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import polars as pl
import pytest

from agentab.rundir import part_files, scan_records
from tests.replay.chained_sessions import save_chained
from tests.serving import served

SERVE = ("--profile", "gb300-tp16-kimi-k3")


@pytest.fixture(scope="module")
def workload_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_chained(
        tmp_path_factory.mktemp("clients") / "w.jsonl", 8, turns=6, gap_s=0.2, out_step=4
    )


def replay(workload: Path, url: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    args = ("--concurrency", "4", "--lane-requests", "3", "--warmup-requests", "1",
            "--duration", "0", "--prompt-salt", "same", "--quiet")  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "agentab", "replay", str(workload), "--url", url, "--out",
         str(out), *args, *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.slow
def test_two_clients_send_the_requests_one_process_sends(workload_file: Path, tmp_path: Path):
    with served(*SERVE) as url:
        one = replay(workload_file, url, tmp_path / "one")
        two = replay(workload_file, url, tmp_path / "two", "--clients", "2")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    names = [sorted(p.name for p in (tmp_path / d).iterdir()) for d in ("one", "two")]
    assert names[0] == names[1] == [".agentab.lock", "manifest.json", "records"]
    columns = ["request_id", "session_id", "lane", "phase", "prompt_tokens", "osl"]
    a, b = (scan_records(tmp_path / d).collect().sort("request_id") for d in ("one", "two"))
    assert a.select(columns).equals(b.select(columns))
    per_lane = b.filter(pl.col("phase") == "profiling").group_by("lane").len()
    assert per_lane["len"].to_list() == [3] * 4
    ma, mb = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("one", "two"))
    assert sorted(ma) == sorted(mb)
    assert mb["status"] == "completed"
    # per lane: the turn before the start with its output, the start turn with 1 token (the
    # warmup), then 3 profiling requests
    assert mb["stats"]["dispatched"] == ma["stats"]["dispatched"] == 20
    assert mb["stats"]["finished"] == 20 and mb["stats"]["warmup_requests"] == 8
    # one clock: every client started its run at the same loop time (the monotonic clock the
    # processes of one host share), and every lane's first request was due at it
    assert [c["clock_t0"] for c in mb["clients"]] == [mb["clock_t0"]] * 2
    first = b.sort("planned_s").group_by("lane", maintain_order=True).first()
    assert first["planned_s"].to_list() == [0.0] * 4
    # one window: it opened after the last warmup request, in both clients
    warm_end = b.filter(pl.col("phase") == "warmup").select(
        pl.col("sent_s") + pl.col("chunk_times_s").list.last()
    )
    assert mb["stats"]["profiling_start_s"] >= warm_end.max().item() - 1e-6
    assert b.filter(pl.col("phase") == "profiling")["planned_s"].min() >= 0
    clients = mb["clients"]
    assert [c["client"] for c in clients] == [0, 1]
    assert [c["lanes"] for c in clients] == [2, 2]
    assert sum(c["requests"] for c in clients) == 20
    assert sum(c["chunks"] for c in clients) == b["chunk_times_s"].list.len().sum()
    for c in clients:
        assert set(c["loop_lag_ms"]) == set(c["behind_plan_ms"]) == {"p50", "p90", "p99", "max"}
        assert c["chunks_per_s"] > 0
    assert len(ma["clients"]) == 1 and ma["clients"][0]["lanes"] == 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ("--clients", "5"),
            "agentab: error: --clients 5: more client processes than lanes (--concurrency 4); "
            "each client plays whole lanes\n",
        ),
        (
            ("--clients", "2", "--max-requests", "10"),
            "agentab: error: --clients 2: --max-requests counts over all lanes at once, which "
            "separate client processes cannot share; stop the run with --duration, "
            "--lane-requests or --passes\n",
        ),
    ],
)
def test_a_split_that_cannot_keep_the_plan_is_refused(
    workload_file: Path, tmp_path: Path, extra: tuple[str, ...], message: str
) -> None:
    result = replay(workload_file, "http://127.0.0.1:9", tmp_path / "out", *extra)
    assert result.returncode == 2
    assert result.stderr == message
    assert not (tmp_path / "out").exists()


def test_a_client_that_cannot_start_ends_the_run_in_one_line(
    workload_file: Path, tmp_path: Path
) -> None:
    result = replay(workload_file, "http://127.0.0.1:9", tmp_path / "out", "--clients", "2")
    assert result.returncode == 2
    assert re.match(
        r"agentab: error: --clients 2: client [01] failed before the run completed: "
        r"AgentabError: http://127\.0\.0\.1:9: cannot reach the server: ",
        result.stderr,
    )
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".agentab.lock"]


def lane_ids(run_dir: Path) -> dict[int, list[str]]:
    """Each lane's request ids in the order the run dir holds them (a lane's requests are
    sequential: the same order in every run of the plan, whatever its timings)."""
    frame = scan_records(run_dir).collect()
    lanes = frame.group_by("lane", maintain_order=True).agg("request_id").sort("lane")
    return dict(lanes.iter_rows())


@pytest.mark.ray
@pytest.mark.slow
def test_clients_as_ray_actors_send_what_local_clients_send(
    workload_file: Path, tmp_path: Path
) -> None:
    with served(*SERVE) as url:
        here = replay(workload_file, url, tmp_path / "here", "--clients", "2")
        ray = replay(workload_file, url, tmp_path / "ray", "--clients", "2", "--ray", "local")
    assert here.returncode == 0, here.stderr
    assert ray.returncode == 0, ray.stderr
    names = [sorted(p.name for p in (tmp_path / d).iterdir()) for d in ("here", "ray")]
    assert names[0] == names[1] == [".agentab.lock", "manifest.json", "records"]
    a, b = (scan_records(tmp_path / d).collect() for d in ("here", "ray"))
    assert a.height == b.height == 20
    columns = ["request_id", "session_id", "lane", "phase", "prompt_tokens", "osl", "error_class"]
    assert a.sort("request_id").select(columns).equals(b.sort("request_id").select(columns))
    assert lane_ids(tmp_path / "here") == lane_ids(tmp_path / "ray")
    # both merged in plan order: by planned time
    assert b["planned_s"].is_sorted() and a["planned_s"].is_sorted()
    ma, mb = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("here", "ray"))
    assert sorted(ma) == sorted(mb)
    assert mb["status"] == "completed" and mb["stats"] == {**mb["stats"], "finished": 20}
    here_clients, ray_clients = ma["clients"], mb["clients"]
    assert [sorted(c) for c in here_clients] == [sorted(c) for c in ray_clients]
    assert [c["clock"] for c in here_clients] == [{"sync": "monotonic"}] * 2
    assert [c["node"] for c in here_clients] == [None, None]
    assert [c["lanes"] for c in ray_clients] == [2, 2]
    nodes = {c["node"] for c in ray_clients}
    assert len(nodes) == 1 and isinstance(nodes.pop(), str)  # one node: the local cluster
    # one wall-clock start, turned by each actor into its host's monotonic time
    starts = {c["clock"]["start_wall_s"] for c in ray_clients}
    assert len(starts) == 1
    for c in ray_clients:
        assert c["clock"]["sync"] == "wall"
        assert c["clock_t0"] + c["clock"]["wall_minus_monotonic_s"] == pytest.approx(
            c["clock"]["start_wall_s"], abs=1e-6
        )
    assert sum(c["requests"] for c in ray_clients) == 20


@pytest.mark.ray
@pytest.mark.parametrize(
    ("extra", "message", "left"),
    [
        (
            ("--ray", "local"),
            "agentab: error: --ray local: places the client processes of --clients N (N > 1) "
            "on a Ray cluster; add --clients\n",
            None,
        ),
        (  # refused within seconds: Ray itself would retry the address for minutes
            ("--clients", "2", "--ray", "127.0.0.1:9"),
            "agentab: error: --ray 127.0.0.1:9: cannot join the cluster: 127.0.0.1:9: "
            "Connection refused\n",
            [".agentab.lock"],
        ),
    ],
)
def test_ray_clients_refusals_are_one_line(
    workload_file: Path,
    tmp_path: Path,
    extra: tuple[str, ...],
    message: str,
    left: list[str] | None,
) -> None:
    out = tmp_path / "out"
    result = replay(workload_file, "http://127.0.0.1:9", out, *extra)
    assert result.returncode == 2
    assert result.stderr == message
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == left


def assert_report_merges_what_the_clients_left(out: Path, folders: list[Path]) -> pl.DataFrame:
    """`agentab report` on a run whose coordinator was killed merges every record its clients
    left under clients/ into records/, and says so in one line; returns the merged records."""
    left = pl.concat([records_of(f) for f in folders])
    assert left.height > 0
    report = subprocess.run(
        [sys.executable, "-m", "agentab", "report", str(out), "--allow-incomplete"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert report.stderr.startswith(
        f"agentab: {out}: merged {left.height} records its clients left under clients/ "
        "into records/ (the replay ended before merging them)\n"
    )
    merged = scan_records(out).collect()
    assert merged.sort("request_id").equals(left.sort("request_id"))
    return merged


def records_of(folder: Path) -> pl.DataFrame:
    files = part_files(folder / "records")
    return pl.concat([pl.read_ipc(p) for p in files]) if files else pl.DataFrame()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_sharded_run_whose_coordinator_is_stopped_keeps_every_record(
    workload_file: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    out = tmp_path / "out"
    with served(*SERVE, "--record-emissions") as url:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentab", "replay", str(workload_file), "--url", url,
             "--out", str(out), "--concurrency", "4", "--lane-requests", "10000",
             "--duration", "0", "--clients", "2", "--quiet"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        folders = [out / "clients" / str(k) for k in range(2)]
        while not all(part_files(f / "records") for f in folders):  # both have written records
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
        if sig == signal.SIGKILL:  # the clients see their coordinator gone and stop
            for folder in folders:  # each holds its folder's lock until its process ends
                with (folder / ".agentab.lock").open() as held:
                    fcntl.flock(held, fcntl.LOCK_EX)
        with urllib.request.urlopen(url + "/agentab/emissions") as response:
            streamed = set(json.loads(response.read()))
    if sig == signal.SIGTERM:  # the coordinator stopped the clients and merged their records
        assert proc.returncode == 128 + sig
        assert stderr.startswith("agentab: error: interrupted by SIGTERM; ")
        assert not (out / "clients").exists()
        assert json.loads((out / "manifest.json").read_text())["status"] == "interrupted"
    else:  # killed: the records are where the clients wrote them, merged when the dir is opened
        assert proc.returncode == -sig
        merged = assert_report_merges_what_the_clients_left(out, folders)
        assert not (out / "clients").exists()
        assert merged["planned_s"].is_sorted()
    records = scan_records(out).collect()
    assert records["request_id"].n_unique() == records.height
    # every request the server streamed to is in the run dir's records: none was lost
    assert streamed and streamed <= set(records["request_id"])


@pytest.mark.ray
@pytest.mark.slow
def test_ray_clients_send_their_records_back_as_the_run_goes(
    workload_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    with served(*SERVE) as url:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentab", "replay", str(workload_file), "--url", url,
             "--out", str(out), "--concurrency", "4", "--lane-requests", "10000",
             "--duration", "0", "--clients", "2", "--ray", "local", "--quiet"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        folders = [out / "clients" / str(k) for k in range(2)]
        # the actors' clients write on their node; their parts arrive here while the run goes
        while not all(part_files(f / "records") for f in folders):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.kill()  # the coordinator, and with it the local cluster and its actors
        proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    merged = assert_report_merges_what_the_clients_left(out, folders)
    assert merged["request_id"].n_unique() == merged.height


@pytest.mark.ray
@pytest.mark.slow
def test_ray_clients_spread_over_the_nodes_of_a_cluster(
    workload_file: Path, tmp_path: Path
) -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)  # a second node (its own raylet), one CPU each
        cluster.wait_for_nodes()
        with served(*SERVE) as url:
            result = subprocess.run(
                [sys.executable, "-m", "agentab", "replay", str(workload_file), "--url", url,
                 "--out", str(tmp_path / "out"), "--concurrency", "4", "--lane-requests", "3",
                 "--warmup-requests", "1", "--duration", "0", "--prompt-salt", "same",
                 "--clients", "2", "--ray", cluster.address],
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
    finally:
        cluster.shutdown()
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("replay: 2 clients as Ray actors on 2 node(s) of 1 host(s): ")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    nodes = [c["node"] for c in manifest["clients"]]
    assert len(set(nodes)) == 2  # SPREAD: one client per node
    assert manifest["status"] == "completed" and manifest["stats"]["finished"] == 20
    assert scan_records(tmp_path / "out").collect().height == 20


@pytest.mark.ray
@pytest.mark.slow
def test_a_cluster_with_fewer_cpus_than_clients_is_refused(
    workload_file: Path, tmp_path: Path
) -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    address = cluster.address
    try:
        result = replay(workload_file, "http://127.0.0.1:9", tmp_path / "out", "--clients", "2",
                        "--ray", address)  # fmt: skip
    finally:
        cluster.shutdown()
    assert result.returncode == 2
    assert result.stderr == (
        f"agentab: error: --ray {address}: the cluster has 1 CPU(s), fewer than the 2 "
        "clients (each client takes one)\n"
    )
